"""``kvlife replay`` and ``kvlife sweep``: entry points taking argv.

The ``kvlife`` command forwards to :func:`replay_main` and :func:`sweep_main`
(``kvlife bench replay`` is :mod:`kvlife.bench.replay`, which reads traces with
:func:`trace_args` and :func:`load_trace`). Without ``--trace`` the built-in synthetic
workload is replayed. Progress bars go to stderr (tqdm).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlife.core.errors import KVLifeError
from kvlife.replay.engine import COMPUTE_PRESETS, DEVICE_KINDS
from kvlife.replay.ftl_disk import DISK_MODELS
from kvlife.replay.runner import DEFAULT_KV_BYTES_PER_TOKEN, ReplayConfig, parse_capacity
from kvlife.trace.importers import FORMATS, read_trace
from kvlife.trace.model import Trace

DEFAULT_SHARES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
DEFAULT_SWEEP_POLICIES = (
    "lru", "lfu", "s3fifo", "arc", "lifespan",
    "prefixtree", "prefixtree-admit", "prefixtree-door", "kvhd", "wild",
)  # fmt: skip


def trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="trace file (default: synthetic workload)")
    p.add_argument("--format", default="mooncake", choices=FORMATS, help="trace format")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")


def load_trace(args: argparse.Namespace) -> Trace:
    if args.trace is None:
        from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace

        trace = synthetic_trace(SyntheticConfig(seed=args.seed))
        return trace.head(args.max_requests) if args.max_requests else trace
    return read_trace(args.trace, args.format, args.max_requests)


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, unit="req", leave=False)


def _config(args: argparse.Namespace, trace: Trace) -> ReplayConfig:
    block_bytes = args.kv_bytes_per_token * trace.block_tokens
    unique = trace.n_unique_blocks()
    return ReplayConfig(
        policy=args.policy,
        dram_blocks=parse_capacity(args.dram, unique, block_bytes),
        disk_blocks=parse_capacity(args.disk, unique, block_bytes),
        dram_device=args.dram_device,
        disk_device=args.disk_device,
        kv_bytes_per_token=args.kv_bytes_per_token,
        compute=COMPUTE_PRESETS[args.compute],
        tenant_shares=getattr(args, "tenant_shares", "") or "",
        planner=bool(getattr(args, "planner", False)),
        disk_model=getattr(args, "disk_model", "bandwidth"),
        disk_drives=getattr(args, "disk_drives", 1),
        disk_op=getattr(args, "disk_op", 0.07),
    )


def replay_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlife replay", description="replay a request trace")
    trace_args(p)
    p.add_argument(
        "--policy", default="lru", help="eviction policy (a registered name, e.g. lru, kvhd)"
    )
    p.add_argument("--dram", default="10%", help="DRAM capacity: share of unique blocks or bytes")
    p.add_argument("--disk", default="0", help="disk capacity: share of unique blocks or bytes")
    p.add_argument("--dram-device", default="dram", choices=DEVICE_KINDS)
    p.add_argument("--disk-device", default="nvme", choices=DEVICE_KINDS)
    p.add_argument("--disk-model", default="bandwidth", choices=DISK_MODELS,
                   help="time the disk tier with a bandwidth model of its device, or per "
                        "block through the page-level FTL with GC (kvlife.replay.ftl_disk, "
                        "as kvlife report does)")  # fmt: skip
    p.add_argument("--disk-drives", type=int, default=1, help="FTL: drives the disk tier spans")
    p.add_argument("--disk-op", type=float, default=0.07, help="FTL: over-provisioning")
    p.add_argument("--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN)
    p.add_argument("--compute", default="gpu-8b", choices=sorted(COMPUTE_PRESETS))
    p.add_argument("--derive-tenants", default="", choices=("", "user", "organisation"),
                   help="label requests with tenants derived from the trace's structure "
                        "(kvlife.replay.tenants.derive_tenants)")  # fmt: skip
    p.add_argument("--tenant-shares", default="",
                   help="quotas between the trace's tenants: 'equal' or name=fraction,... "
                        "of each tier (kvlife.replay.tenants)")  # fmt: skip
    p.add_argument("--planner", action="store_true",
                   help="time the run again with the load-or-recompute planner "
                        "(kvlife.planner; TTFT beside always-load)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the report as JSON")
    p.add_argument("--report", default=None, help="write an HTML report with plots")
    p.add_argument("--events", default=None, help="write lifecycle events (.jsonl or .parquet)")
    p.add_argument("--live", action="store_true", help="replay against a real KVStore too")
    p.add_argument("--live-block-bytes", type=int, default=256, help="bytes per block, live")
    return p


def replay_main(argv: Sequence[str]) -> int:
    args = replay_parser().parse_args(list(argv))
    try:
        return _replay(args)
    except KVLifeError as e:
        print(f"kvlife replay: error: {e}", file=sys.stderr)
        return 1


def _sink(path: str | None) -> Any:
    if path is None:
        return None
    from kvlife.trace.events_io import open_event_file

    return open_event_file(path)


def _replay(args: argparse.Namespace) -> int:
    from kvlife.replay.report import table, to_json, write_html
    from kvlife.replay.runner import replay, sweep

    trace = load_trace(args)
    if args.derive_tenants:
        from kvlife.replay.tenants import with_derived_tenants

        trace = with_derived_tenants(trace, args.derive_tenants)
    cfg = _config(args, trace)
    sink = _sink(args.events)
    with _bar(trace.n_requests, f"replay {cfg.policy}") as bar:
        report = replay(trace, cfg, sink=sink, progress=bar.update)
    if sink is not None:
        sink.close()
    if args.live:
        report["live"] = _live(trace, cfg, args.live_block_bytes, report)
    print(table(report))
    if "live" in report:
        lv = report["live"]
        print(f"live store: prefix hit ratio {lv['prefix_hit_ratio']:.4f}, "
              f"agrees with simulation: {lv['agrees']}, {lv['seconds']:.1f} s")  # fmt: skip
    sw = None
    if args.report:
        from kvlife.policy.base import policy_names

        with _bar(len(policy_names()) * len(DEFAULT_SHARES), "sweep") as bar:
            sw = sweep(trace, policy_names(), DEFAULT_SHARES, progress=bar.update)
        report["sweep"] = sw
        write_html(args.report, report, sw)
    if args.json:
        Path(args.json).write_text(to_json(report), encoding="utf-8")
    return 0


def _live(trace: Trace, cfg: ReplayConfig, block_bytes: int, report: dict[str, Any]) -> Any:
    from kvlife.replay.cache import CacheSim
    from kvlife.replay.live import run_live

    with _bar(trace.n_requests, "live") as bar:
        live = run_live(
            trace, cfg.policy, cfg.dram_blocks, cfg.disk_blocks, block_bytes=block_bytes,
            progress=bar.update,
        )  # fmt: skip
    sim = CacheSim(cfg.policy, cfg.dram_blocks, cfg.disk_blocks, class_hints=False).run(trace)
    agrees = all(
        (getattr(sim, f) == getattr(live, f)).all()
        for f in ("prefix_dram", "prefix_disk", "present", "new", "dropped")
    )
    touches = trace.n_touches
    return {
        "prefix_hit_ratio": float((live.prefix_dram + live.prefix_disk).sum()) / touches,
        "block_hit_ratio": float(live.present.sum()) / touches,
        "agrees": bool(agrees),
        "seconds": live.seconds,
        "block_touches_per_s": touches / live.seconds if live.seconds else 0.0,
        "counters": live.counters,
    }


def sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlife sweep", description="hit ratio against capacity for several policies"
    )
    trace_args(p)
    p.add_argument("--policies", default=",".join(DEFAULT_SWEEP_POLICIES), help="comma list")
    p.add_argument("--shares", default=",".join(str(s) for s in DEFAULT_SHARES),
                   help="capacities as shares of the unique blocks, comma list")  # fmt: skip
    p.add_argument("--json", default=None, help="write the curves as JSON")
    p.add_argument("--report", default=None, help="write an HTML page with the plot")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip libCacheSim's and vLLM's policies (run when installed)")  # fmt: skip
    return p


def belady_curve(trace: Trace, shares: Sequence[float]) -> list[dict[str, Any]]:
    """Belady's offline optimum at each capacity (as the sweep sizes it): the headroom."""
    from kvlife.replay.belady import belady_hits

    unique = trace.n_unique_blocks()
    touches = trace.n_touches
    pts = []
    for share in shares:
        cap = max(1, int(unique * share))
        hits = belady_hits(trace.blocks, cap)
        pts.append(
            {
                "share": share,
                "capacity_blocks": cap,
                "block_hit_ratio": hits / touches if touches else 0.0,
            }
        )
    return pts


def sweep_main(argv: Sequence[str]) -> int:
    from kvlife.replay.runner import sweep
    from kvlife.report import format_table

    args = sweep_parser().parse_args(list(argv))
    try:
        trace = load_trace(args)
        pols = [p for p in args.policies.split(",") if p]
        shares = [float(s) for s in args.shares.split(",") if s]
        with _bar(len(pols) * len(shares), "sweep") as bar:
            sw = sweep(trace, pols, shares, progress=bar.update)
        sw["references"] = {"belady": belady_curve(trace, shares)}
        if args.peers:
            from kvlife.replay.peers import libcachesim_curves, vllm_offload_curves

            notes = {}
            for peer, fn in (("libcachesim", libcachesim_curves), ("vllm", vllm_offload_curves)):
                curves, note = fn(trace, shares)
                sw["references"].update(curves)
                if note:
                    notes[peer] = note
            sw["peer_notes"] = notes
        if "prefixtree-admit" in pols:
            from kvlife.replay.predictor import predictor_accuracy

            sw["reuse_predictor"] = predictor_accuracy(trace, 0.1)
    except (KVLifeError, ValueError) as e:
        print(f"kvlife sweep: error: {e}", file=sys.stderr)
        return 1
    rows = [
        [pol] + [f"{p['block_hit_ratio']:.4f}" for p in pts] for pol, pts in sw["curves"].items()
    ]
    for ref, pts in sw["references"].items():
        rows.append([ref] + [f"{p['block_hit_ratio']:.4f}" for p in pts])
    rows.append(["infinite cache"] + [f"{sw['ideal_hit_ratio']:.4f}"] * len(shares))
    print(format_table(["policy"] + [f"{100 * s:g}%" for s in shares], rows))
    print(f"infinite cache: {sw['ideal_hit_ratio']:.4f}; "
          f"{sw['speed']['block_touches_per_s']:,.0f} block touches/s")  # fmt: skip
    for peer, note in sw.get("peer_notes", {}).items():
        print(f"{peer}: skipped: {note.splitlines()[0] if note else ''}")
    acc = sw.get("reuse_predictor")
    if acc is not None:
        parts = ", ".join(
            f"p>={th}: precision {v['precision']:.3f} recall {v['recall']:.3f}"
            for th, v in acc["thresholds"].items()
        )
        print(f"reuse predictor (prefixtree-admit, 10%): base rate {acc['base_rate']:.3f}; {parts}")
    if args.json:
        Path(args.json).write_text(json.dumps(sw, indent=2), encoding="utf-8")
    if args.report:
        from kvlife.replay.report import plots

        imgs = plots({}, sw)
        body = "".join(
            f"<h2>{t}</h2><img src='data:image/png;base64,{b}'>" for t, b in imgs.items()
        )
        Path(args.report).write_text(f"<!doctype html><title>kvlife sweep</title>{body}", "utf-8")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvlife.replay.cli {replay,sweep} ...`` (``kvlife`` forwards to it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    table = {"replay": replay_main, "sweep": sweep_main}
    if not argv or argv[0] not in table:
        print("usage: python -m kvlife.replay.cli {replay,sweep} [options]", file=sys.stderr)
        return 2
    return table[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
