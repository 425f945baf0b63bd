"""``kvlife bench replay``: how fast trace replay runs, in block touches per second.

Both figures go through the store's placement engine (:mod:`kvlife.placement`; the
simulator has no other path): **policy-only** (one DRAM tier at 10% of the trace's
unique blocks, hits only) and the **full simulation** (10% DRAM + 30% disk, timing
models, lifespans). Parsing the trace and making its block ids Python ints (once per
trace, :func:`kvlife.replay.cache.block_ids` and ``request_ids``) are timed apart
(``parse_seconds``).

One policy-only run lands anywhere in a wide band on a shared or virtual machine (the
same loop has run 0.78-1.43 M touches/s back to back on one VM), so each is run
``--repeat`` times (default 5) in this process and timed by the process's CPU time
(what the replay itself used; other processes' load distorts it far less than the
wall clock) and by the wall clock. The **headline is the best run in CPU time**: the
least-disturbed run, the usual figure for a deterministic workload (a disturbance only
ever slows a run down). The median and every run are in the JSON beside it. The full
simulation is timed once (wall clock). The machine's own figures go with them
(:func:`machine`: a Python loop's speed as every ``kvlife bench`` reports it, the CPU
count, the load average before and after), so that two runs can be compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlife.bench.limits import python_loop_mips
from kvlife.core.errors import KVLifeError
from kvlife.trace.model import Trace

DEFAULT_REPEAT = 5
"""Policy-only runs per policy."""
POLICY_ONLY_SHARE = 0.1
"""The policy-only replay's DRAM tier, as a share of the trace's unique blocks."""
FULL_SHARES = (0.1, 0.3)
"""The full simulation's DRAM and disk tiers, as shares of the unique blocks."""


def time_policy_only(trace: Trace, policy: str, share: float, repeat: int) -> dict[str, Any]:
    """``repeat`` policy-only replays of ``trace`` (one tier, ``share`` of its unique
    blocks): block touches per CPU second and per wall-clock second of each run, the
    best and the median of each, and the block hit ratio (the same in every run, or
    :class:`RuntimeError`). A run is ``CacheSim`` built and run and its hits summed,
    after a full garbage collection (not timed) so that every run starts alike."""
    from kvlife.replay.cache import CacheSim

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    cap = max(1, int(trace.n_unique_blocks() * share))
    touches = trace.n_touches
    cpu_rates: list[float] = []
    wall_rates: list[float] = []
    hits: set[int] = set()
    for _ in range(repeat):
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        run = CacheSim(policy, cap).run(trace)
        hits.add(int(run.present.sum()))
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        cpu_rates.append(touches / cpu if cpu > 0 else 0.0)
        wall_rates.append(touches / wall if wall > 0 else 0.0)
    if len(hits) != 1:
        raise RuntimeError(f"{policy}: repeated replays gave different hits {sorted(hits)}")
    return {
        "block_touches_per_cpu_s": max(cpu_rates),
        "block_touches_per_cpu_s_median": statistics.median(cpu_rates),
        "block_touches_per_s": max(wall_rates),
        "block_touches_per_s_median": statistics.median(wall_rates),
        "runs_per_cpu_s": cpu_rates,
        "runs_per_s": wall_rates,
        "hit_ratio": hits.pop() / touches if touches else 0.0,
        "capacity_blocks": cap,
    }


def machine() -> dict[str, Any]:
    """What the figures were measured on: a plain Python loop's speed (best of 3, as
    every ``kvlife bench`` reports it, :func:`kvlife.bench.limits.python_loop_mips`),
    the CPU count and the 1-minute load average (other processes' work on a shared
    machine shows there)."""
    return {
        "python_loop_mips": max(python_loop_mips() for _ in range(3)),
        "cpu_count": os.cpu_count() or 0,
        "load_average_1m": os.getloadavg()[0],
    }


def format_machine(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One line under the table."""
    return (
        f"machine: Python loop {before['python_loop_mips']:.1f} M iterations/s, "
        f"{before['cpu_count']} CPUs, load average {before['load_average_1m']:.1f} before / "
        f"{after['load_average_1m']:.1f} after (1 min)"
    )


def run(trace: Trace, policies: Sequence[str], repeat: int) -> dict[str, Any]:
    """The benchmark's JSON document for ``trace`` (parsed already)."""
    from kvlife.replay.runner import ReplayConfig, replay

    unique = trace.n_unique_blocks()
    before = machine()
    result: dict[str, Any] = {
        "trace": trace.name,
        "block_touches": trace.n_touches,
        "decisions": "kvlife.placement",
        "repeat": repeat,
        "headline": "policy_only.<policy>.block_touches_per_cpu_s (best of repeat runs)",
        "policy_only": {},
        "full": {},
    }
    for pol in policies:
        result["policy_only"][pol] = time_policy_only(trace, pol, POLICY_ONLY_SHARE, repeat)
        dram, disk = (int(unique * s) for s in FULL_SHARES)
        rep = replay(trace, ReplayConfig(pol, dram, disk))
        result["full"][pol] = {"block_touches_per_s": rep["speed"]["block_touches_per_s"]}
    result["machine"] = before
    result["machine_after"] = machine()
    return result


def format_result(result: dict[str, Any]) -> str:
    from kvlife.report import format_table

    rows = []
    for pol, fig in result["policy_only"].items():
        rows.append(
            [
                pol,
                f"{fig['block_touches_per_cpu_s']:,.0f}",
                f"{fig['block_touches_per_cpu_s_median']:,.0f}",
                f"{fig['block_touches_per_s']:,.0f}",
                f"{result['full'][pol]['block_touches_per_s']:,.0f}",
            ]
        )
    n = result["repeat"]
    head = [
        "policy",
        f"policy-only touches/CPU-s (best of {n})",
        "median",
        "wall-clock best",
        "full-sim touches/s",
    ]
    return (
        format_table(head, rows) + "\n" + format_machine(result["machine"], result["machine_after"])
    )


def main(argv: Sequence[str]) -> int:
    from kvlife.policy.base import policy_names
    from kvlife.replay.cache import block_ids, request_ids
    from kvlife.replay.cli import load_trace, trace_args

    p = argparse.ArgumentParser(prog="kvlife bench replay", description=__doc__)
    trace_args(p)
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="policy-only runs")
    p.add_argument("--policies", default=None, help="comma-separated (default: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args(list(argv))
    if args.repeat < 1:
        print("kvlife bench replay: error: --repeat must be >= 1", file=sys.stderr)
        return 1
    try:
        known = policy_names()
        policies = known if args.policies is None else args.policies.split(",")
        unknown = sorted(set(policies) - set(known))
        if unknown:
            print(f"kvlife bench replay: error: unknown policies {unknown}", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        trace = load_trace(args)
        block_ids(trace)  # the block ids as Python ints, made once per trace: parsing
        request_ids(trace)
        parse_s = time.perf_counter() - t0
        result = {"parse_seconds": parse_s, **run(trace, policies, args.repeat)}
    except KVLifeError as e:
        print(f"kvlife bench replay: error: {e}", file=sys.stderr)
        return 1
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
