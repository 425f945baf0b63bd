"""Benchmark of the SSD model: simulation speed and the WAF validation table.

Why: the device model is only useful if it is both right and fast enough to replay
hours of KV traffic. This benchmark (1) times random overwrites of a large device and
reports simulated page writes per wall-clock second, and (2) reruns the Desnoyers
validation (:mod:`kvlife.sim.validation`) on a large device at over-provisioning 7%,
12.5%, 20%, 28%, 50% (and 30%, the published cross-check point), printing simulated WAF,
the closed form and the error. It is a benchmark, not a test: nothing here asserts speed.

Entry point for the CLI (``kvlife bench ssd``): :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from kvlife.sim.ssd import Ftl, SSDConfig
from kvlife.sim.validation import VALIDATION_OPS, UniformWafRow, measure_uniform_waf

CROSS_CHECK_OP = 0.30
"""Extra validation point: the closed form gives WAF 2.36 at op 0.3."""


def measure_speed(
    logical_pages: int, op: float, pages_per_block: int, capacities: float, seed: int = 0
) -> dict[str, float | int]:
    """Time uniform random overwrites of a filled, warmed-up device."""
    cfg = SSDConfig.for_logical_pages(logical_pages, pages_per_block, op, page_bytes=4096)
    ftl = Ftl(cfg)
    # Warm the JIT on a tiny device so compile time is not measured.
    tiny = Ftl(SSDConfig.for_logical_pages(1024, 16, 0.5, page_bytes=4096))
    tiny.fill_sequential()
    tiny.write_uniform_random(1024, seed=seed)
    ftl.fill_sequential()
    ftl.write_uniform_random(cfg.logical_pages, seed=seed)
    before = ftl.counters()
    t0, c0 = time.perf_counter(), time.process_time()
    ftl.write_uniform_random(int(capacities * cfg.logical_pages), seed=seed + 1)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    c = ftl.counters().since(before)
    return {
        "logical_pages": cfg.logical_pages,
        "physical_pages": cfg.physical_pages,
        "pages_per_block": cfg.pages_per_block,
        "op": op,
        "seconds": dt,
        "cpu_seconds": dc,
        "host_page_writes": c.host_page_writes,
        "nand_page_writes": c.nand_page_writes,
        "waf": c.waf,
        "host_page_writes_per_s": c.host_page_writes / dt,
        "nand_page_writes_per_s": c.nand_page_writes / dt,
        # CPU time is less disturbed than wall time when the machine is shared.
        "host_page_writes_per_cpu_s": c.host_page_writes / dc,
        "nand_page_writes_per_cpu_s": c.nand_page_writes / dc,
    }


def validation_table(
    n_blocks: int,
    pages_per_block: int,
    warmup: float,
    measure: float,
    seed: int,
    progress: bool = False,
) -> list[UniformWafRow]:
    """Simulated vs closed-form WAF at the validation OPs and the 0.3 cross-check."""
    ops: Sequence[float] = (*VALIDATION_OPS, CROSS_CHECK_OP)
    if progress:
        from tqdm import tqdm

        ops = tqdm(ops, desc="validation", unit="OP point")
    return [
        measure_uniform_waf(
            op,
            n_blocks=n_blocks,
            pages_per_block=pages_per_block,
            warmup_capacities=warmup,
            measure_capacities=measure,
            seed=seed,
        )
        for op in ops
    ]


def format_table(rows: list[UniformWafRow]) -> str:
    head = (
        f"{'OP':>6} {'alpha':>7} {'closed form':>12} {'simulated':>10} {'error %':>8} "
        f"{'logical pages':>14} {'ppb':>5} {'s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:>6.3f} {1 + r.effective_op:>7.4f} {r.closed_form_waf:>12.3f} "
            f"{r.simulated_waf:>10.3f} {r.error_pct:>+8.2f} {r.logical_pages:>14} "
            f"{r.pages_per_block:>5} {r.seconds:>6.1f}"
        )
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``kvlife bench ssd`` (added to ``parser`` if given)."""
    p = parser or argparse.ArgumentParser(
        prog="kvlife bench ssd",
        description="SSD model speed (page writes per second) and WAF validation table.",
    )
    p.add_argument("--json", type=Path, help="write results as JSON to this file")
    p.add_argument(
        "--speed-pages",
        type=int,
        default=1 << 22,
        help="logical pages of the speed run (default 4194304)",
    )
    p.add_argument("--speed-op", type=float, default=0.28, help="OP of the speed run")
    p.add_argument(
        "--speed-capacities", type=float, default=1.0, help="capacities overwritten while timed"
    )
    p.add_argument("--val-blocks", type=int, default=4096, help="blocks of the validation device")
    p.add_argument("--pages-per-block", type=int, default=256, help="pages per block")
    p.add_argument("--warmup", type=float, default=4.0, help="capacities before measuring")
    p.add_argument("--measure", type=float, default=4.0, help="capacities measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tiny", action="store_true", help="a seconds-long run on tiny devices (for tests)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cli_main(args: argparse.Namespace) -> int:
    if args.tiny:
        args.speed_pages, args.val_blocks, args.pages_per_block = 1 << 14, 64, 64
        args.warmup, args.measure, args.speed_capacities = 1.0, 1.0, 1.0
    speed = measure_speed(
        args.speed_pages, args.speed_op, args.pages_per_block, args.speed_capacities, args.seed
    )
    print(
        f"speed: {speed['host_page_writes_per_s']:,.0f} host page writes/s, "
        f"{speed['nand_page_writes_per_s']:,.0f} NAND page writes/s of wall time "
        f"({speed['host_page_writes_per_cpu_s']:,.0f} / "
        f"{speed['nand_page_writes_per_cpu_s']:,.0f} per CPU second; "
        f"{speed['logical_pages']:,} logical pages, OP {speed['op']}, WAF {speed['waf']:.2f})"
    )
    rows = validation_table(
        args.val_blocks,
        args.pages_per_block,
        args.warmup,
        args.measure,
        args.seed,
        progress=not (args.no_progress or args.tiny),
    )
    print("validation: greedy GC, uniform random overwrites, vs Desnoyers' closed form")
    print(format_table(rows))
    within = all(abs(r.error_pct) <= 5.0 for r in rows)
    note = " (tiny devices with small blocks: a smoke run, not a validation)" if args.tiny else ""
    print(f"all within 5%: {within}{note}")
    if args.json is not None:
        out = {
            "page_writes_per_s": speed["nand_page_writes_per_s"],
            "page_writes_per_s_meaning": "NAND page programs (host writes + GC copies) "
            "simulated per wall-clock second",
            "host_page_writes_per_s": speed["host_page_writes_per_s"],
            "nand_page_writes_per_s": speed["nand_page_writes_per_s"],
            "speed": speed,
            "validation": [asdict(r) for r in rows],
            "validation_all_within_5pct": within,
            "machine": {
                "python": platform.python_version(),
                "processor": platform.machine(),
                "load_average": list(os.getloadavg()),
                "cpus": os.cpu_count(),
            },
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps(out, indent=2), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvlife bench ssd [--json FILE] [--tiny] ...``."""
    return cli_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
