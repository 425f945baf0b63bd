"""Load or recompute: where each path wins, and how close the planner gets to the best.

``kvlife experiment crossover --json F --plot F.png``: SmolLM2-135M (the HF engine on
this CPU) with a store whose only tier is a disk throttled
(:mod:`kvlife.faults.throttle`) to bandwidths from a few MB/s to the device's full speed.
For each prefix length and bandwidth one request of ``prefix + suffix`` tokens is served
four ways: load-only (every hit loaded, then the suffix), compute-only (the whole prompt
prefilled), the Cake split (the front computed while the back loads, split where the
model predicts they meet) and the planner (the least predicted time over every
``(front, stop)``). The per-request oracle is the best TTFT measured among them.

The cost model is the planner's: the engine's prefill profile (measured at start-up or
read from the cache), and the tier's speed seeded at each bandwidth by a short
calibration (a one-chunk and a four-chunk load) and learnt from every load after. The
result says, per point, each TTFT, the planner's plan and its ratio to the oracle, and
per prefix where the pure plans cross and how much better the split is there.

:func:`field_table` applies the same model with documented parameters to an H200
serving Llama-3-8B from NVMe, 100 GbE and CXL (``docs/planner.md`` cites the sources).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.identity import PUBLIC, ChunkKey
from kvlife.core.objects import TierName
from kvlife.planner import (
    CostModel,
    Plan,
    PrefillProfile,
    choose,
    compute_only,
    load_only,
    split_only,
)
from kvlife.results import ChunkHit

PLANS: dict[str, Callable[[CostModel, Sequence[ChunkHit], int], Plan]] = {
    "load": load_only,
    "compute": compute_only,
    "split": split_only,
    "planner": choose,
}


@dataclass(frozen=True, slots=True)
class CrossoverConfig:
    """What the experiment sweeps."""

    prefixes: tuple[int, ...] = (256, 512, 1024, 2048)
    """Prefix lengths (tokens stored, then reused)."""
    bandwidths_mb_s: tuple[float, ...] = (5.0, 10.0, 30.0, 100.0, 0.0)
    """Disk read limits in MB/s (0: the device's full speed)."""
    suffix: int = 16
    """New tokens after the prefix."""
    tokens_per_chunk: int = 64
    repeats: int = 1
    """Runs of each plan per point (the best is kept)."""
    model: str = "smollm2"
    """``smollm2`` or ``tiny`` (a random tiny Llama, for tests)."""
    threads: int = 1
    """torch threads. One by default: on a machine whose cores other processes share,
    two OpenMP threads wait at every barrier for a descheduled sibling (a 64-token
    prefill of SmolLM2 took 9 s with two threads beside other jobs, 0.3 s with one)."""
    seed: int = 0


def _engine(cfg: CrossoverConfig, store: Any) -> Any:
    from kvlife.engines.hf import HFEngine
    from kvlife.engines.models import load_smollm2, tiny_llama

    loaded = tiny_llama(seed=cfg.seed) if cfg.model == "tiny" else load_smollm2()
    return HFEngine.for_model(loaded, store, tokens_per_chunk=cfg.tokens_per_chunk)


def _calibrate(planned: Any, ids: list[int], namespace: Any) -> None:
    """Seed the disk's cost from a one-chunk and a four-chunk load (best of two)."""
    store = planned.engine.store
    found = store.lookup(planned.engine.identity, namespace, ids)
    timed = []
    for k in (1, min(4, len(found.hits))):
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            store.load(found.sub(0, k))
            best = min(best, time.perf_counter() - t0)
        timed.append((sum(h.stored_nbytes for h in found.hits[:k]), best))
    tier = planned.model.tier("disk")
    if timed[1][0] > timed[0][0]:
        tier.calibrate(timed[0], timed[1])
    else:
        tier.per_byte.seed(timed[0][1] / timed[0][0])


def run(cfg: CrossoverConfig, progress: bool = True) -> dict[str, Any]:
    import torch

    from kvlife.engines.hf_plan import PlannedEngine, measure_prefill, prefill_profile
    from kvlife.faults.throttle import MB, ThrottledDiskOptions, ThrottledTier
    from kvlife.store import KVStore, StoreConfig, TierSpec

    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    tpc = cfg.tokens_per_chunk
    with tempfile.TemporaryDirectory(prefix="kvlife-crossover-") as tmp:
        spec = TierSpec(
            "throttled-disk",
            "disk",
            max(cfg.prefixes) * 200_000 + (256 << 20),
            options=ThrottledDiskOptions(segment_bytes=64 << 20),
        )
        store = KVStore(Path(tmp), StoreConfig(tiers=(spec,), promote_on_hit=False))
        try:
            eng = _engine(cfg, store)
            t0 = time.perf_counter()
            if cfg.model == "tiny":
                profile = measure_prefill(eng, [(0, 32), (0, 128), (0, 256), (256, 64)], repeats=1)
            else:
                profile = prefill_profile(eng)
            profile_s = time.perf_counter() - t0
            tier = store.tier("disk")
            assert isinstance(tier, ThrottledTier)
            vocab = int(eng.config.vocab_size)
            points: list[dict[str, Any]] = []
            # one model for the run: the engine's speed is learnt across points, the
            # disk's is calibrated again at each bandwidth and learnt from every load
            model = CostModel(profile, tpc)
            planned = PlannedEngine(eng, model)
            # the fixed policies are measured as they are: no deadline, no fallback
            fixed = PlannedEngine(eng, model, deadline_factor=float("inf"))
            for prefix in cfg.prefixes:
                ids = rng.integers(0, vocab, prefix + cfg.suffix).tolist()
                tier.set_limits(0.0)
                eng.generate(ids[:prefix], PUBLIC, max_new_tokens=1)  # stores the prefix
                for bw in cfg.bandwidths_mb_s:
                    tier.set_limits(bw * MB)
                    _calibrate(planned, ids, PUBLIC)
                    fallbacks = planned.counters.fallback_chunks
                    row: dict[str, Any] = {"prefix": prefix, "bandwidth_mb_s": bw}
                    for name, policy in PLANS.items():
                        best, plan = float("inf"), None
                        runner = planned if name == "planner" else fixed
                        for _ in range(cfg.repeats):
                            done = runner.prefill(ids, PUBLIC, policy=policy)
                            runner.settle(600)  # abandoned loads end before the next run
                            if done.ttft_s < best:
                                best, plan = done.ttft_s, done
                        assert plan is not None
                        row[name] = best
                        row[f"{name}_plan"] = {
                            **plan.plan.as_dict(),
                            "loaded": plan.loaded,
                            "fallback": plan.fallback,
                            "measured": {
                                "lookup_s": plan.lookup_s,
                                "front_s": plan.front_s,
                                "load_s": plan.load_s,
                                "rest_s": plan.rest_s,
                            },
                        }
                    row["oracle"] = min(row[n] for n in PLANS)
                    row["planner_vs_oracle"] = row["planner"] / row["oracle"]
                    row["disk_s_per_mb_learnt"] = (model.tier("disk").per_byte.value or 0) * MB
                    row["prefill_learnt"] = [model.prefill.c0, model.prefill.c1, model.prefill.c2]
                    row["planner_fallback_chunks"] = planned.counters.fallback_chunks - fallbacks
                    points.append(row)
                    if progress:
                        print(
                            f"prefix {prefix:5d} @ {bw or 'full':>5} MB/s: "
                            + "  ".join(f"{n} {row[n]:.3f}s" for n in PLANS)
                            + f"  planner/oracle {row['planner_vs_oracle']:.3f}"
                            + f" ({row['planner_plan']['kind']} {row['planner_plan']['front']}"
                            + f"/{row['planner_plan']['stop']}/{row['planner_plan']['hits']},"
                            + f" fallback {row['planner_fallback_chunks']})",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            store.close(flush=False)
    return {
        "config": asdict(cfg),
        "kv_bytes_per_token": int(eng.identity.layout.num_layers * 2)
        * eng.identity.layout.num_kv_heads
        * eng.identity.layout.head_dim
        * np.dtype(eng.identity.layout.dtype).itemsize,
        "profile": {
            "c0": profile.c0,
            "c1": profile.c1,
            "c2": profile.c2,
            "engine": profile.engine,
            "seconds": profile_s,
        },
        "points": points,
        "summary": summarise(points),
        "field": field_table(),
    }


def chosen_plan_ratio(row: dict[str, Any]) -> float:
    """The planner's choice against the oracle, run-to-run noise aside: where the plan it
    chose is also one of the fixed plans (same ``front`` and ``stop``), both runs measured
    that plan, and the better of them is the plan's time."""
    mine = (row["planner_plan"]["front"], row["planner_plan"]["stop"])
    same = [row["planner"]]
    for name in ("load", "compute", "split"):
        plan = row.get(f"{name}_plan")
        if plan is None and name == "compute":
            plan = {"front": 0, "stop": 0}  # compute-only measured once per prefix
        if plan is not None and (plan["front"], plan["stop"]) == mine:
            same.append(row[name])
    return float(min(same) / row["oracle"])


def summarise(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The planner's worst ratio to the oracle (as measured, and for the plan it chose
    with run-to-run noise aside), and per prefix the point where the pure plans are
    closest (their crossing) with the split's gain there."""
    worst = max((p["planner_vs_oracle"] for p in points), default=1.0)
    worst_plan = max((chosen_plan_ratio(p) for p in points), default=1.0)
    within = sum(p["planner_vs_oracle"] <= 1.05 for p in points)
    cross = {}
    for prefix in sorted({p["prefix"] for p in points}):
        rows = [p for p in points if p["prefix"] == prefix]
        at = min(rows, key=lambda p: abs(np.log(p["load"] / p["compute"])))
        cross[str(prefix)] = {
            "bandwidth_mb_s": at["bandwidth_mb_s"],
            "load": at["load"],
            "compute": at["compute"],
            "split": at["split"],
            "split_gain": min(at["load"], at["compute"]) / at["split"],
        }
    return {
        "planner_worst_vs_oracle": worst,
        "planner_within_5pct": worst <= 1.05,
        "points_within_5pct": within,
        "points": len(points),
        "planner_plan_worst_vs_oracle": worst_plan,
        "crossings": cross,
    }


# ---------------------------------------------------------------------- the field


@dataclass(frozen=True, slots=True)
class FieldTier:
    name: str
    bytes_per_s: float
    """Sustained read bandwidth into the GPU (the tier's, capped by PCIe 5.0 x16)."""
    latency_s: float
    source: str


H200_LLAMA3_8B = PrefillProfile(
    c0=5e-3,
    c1=2 * 8.03e9 / (989e12 * 0.5),
    c2=4 * 32 * 4096 / (989e12 * 0.5),
    engine="H200 (989 TFLOPS bf16 dense at 50% MFU), Llama-3-8B",
)
"""Llama-3-8B on one H200: 2 x 8.03e9 FLOP per token (weights), 4 x 32 layers x 4096
per token per position attended (QK^T and AV), at half the H200's dense bf16 peak; 5 ms
per prefill call (launches, scheduling)."""

LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
"""K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes (bf16) = 128 KiB."""

PCIE5_X16 = 55e9
"""Host-to-device copies over PCIe 5.0 x16: 64 GB/s raw, ~55 GB/s achieved."""

FIELD_TIERS: tuple[FieldTier, ...] = (
    FieldTier("NVMe Gen5 (1 drive)", 13e9, 100e-6, "Samsung PM1743 datasheet: 13 GB/s seq. read"),
    FieldTier("NVMe Gen4 (1 drive)", 7e9, 100e-6, "Samsung PM9A3 datasheet: 6.9 GB/s seq. read"),
    FieldTier("100 GbE (RDMA)", 11e9, 20e-6, "100 Gb/s line rate = 12.5 GB/s; ~11 GB/s goodput"),
    FieldTier("25 GbE", 2.8e9, 50e-6, "25 Gb/s line rate = 3.1 GB/s; ~2.8 GB/s goodput"),
    FieldTier(
        "CXL memory (x16)", min(50e9, PCIE5_X16), 1e-6, "PCIe 5.0 x16 link 64 GB/s; ~50 GB/s seen"
    ),
)


def field_table(
    prefixes: Sequence[int] = (1024, 4096, 8192, 32768), tokens_per_chunk: int = 256
) -> dict[str, Any]:
    """Predicted TTFT of each plan on an H200 for Llama-3-8B KV from each field tier,
    and the bandwidth below which recomputing beats loading (per prefix)."""
    kvb = LLAMA3_8B_KV_BYTES_PER_TOKEN
    rows = []
    for tier in FIELD_TIERS:
        model = CostModel(H200_LLAMA3_8B, tokens_per_chunk)
        cost = model.tier("field")
        cost.latency_s = tier.latency_s
        cost.per_byte.seed(1.0 / min(tier.bytes_per_s, PCIE5_X16))
        for prefix in prefixes:
            n = prefix + 16
            hits = [
                ChunkHit(
                    index=i,
                    key=ChunkKey(i.to_bytes(32, "big")),
                    start=i * tokens_per_chunk,
                    tier=TierName("field"),
                    stored_nbytes=kvb * tokens_per_chunk,
                )
                for i in range(prefix // tokens_per_chunk)
            ]
            got = {name: policy(model, hits, n) for name, policy in PLANS.items()}
            rows.append(
                {
                    "tier": tier.name,
                    "prefix": prefix,
                    **{name: p.predicted_s for name, p in got.items()},
                    "planner_plan": got["planner"].as_dict(),
                }
            )
    crossover = {}
    for prefix in prefixes:
        # load-only equals compute-only when bytes / bw = C(0, prefix) - latency
        c = H200_LLAMA3_8B.seconds(0, prefix + 16) - H200_LLAMA3_8B.seconds(prefix, 16)
        crossover[str(prefix)] = prefix * kvb / c
    return {
        "kv_bytes_per_token": kvb,
        "profile": {"c0": H200_LLAMA3_8B.c0, "c1": H200_LLAMA3_8B.c1, "c2": H200_LLAMA3_8B.c2},
        "tiers": [asdict(t) for t in FIELD_TIERS],
        "rows": rows,
        "crossover_bytes_per_s": crossover,
    }


def plot_png(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    prefixes = sorted({p["prefix"] for p in points})
    fig, axes = plt.subplots(1, len(prefixes), figsize=(4.2 * len(prefixes), 3.8), squeeze=False)
    for ax, prefix in zip(axes[0], prefixes, strict=True):
        rows = [p for p in points if p["prefix"] == prefix]
        full = max((r["bandwidth_mb_s"] for r in rows), default=1.0) * 4 or 1000.0
        xs = [r["bandwidth_mb_s"] or full for r in rows]
        for name, style in (
            ("load", "o-"),
            ("compute", "s--"),
            ("split", "^-"),
            ("planner", "x-"),
            ("oracle", ":"),
        ):
            ax.plot(xs, [r[name] for r in rows], style, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"prefix {prefix} tokens")
        ax.set_xlabel("disk read MB/s (rightmost: unthrottled)")
        ax.set_ylabel("TTFT (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment crossover",
        description="TTFT of load-only, compute-only, the Cake split and the planner against "
        "the per-request oracle, on SmolLM2 with a throttled disk tier.",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write a PNG of TTFT against bandwidth")
    parser.add_argument(
        "--quick", action="store_true", help="one prefix (256), two bandwidths (5 MB/s, full)"
    )
    parser.add_argument("--prefixes", default=None, help="comma-separated prefix lengths")
    parser.add_argument("--bandwidths", default=None, help="comma-separated MB/s (0: full)")
    parser.add_argument("--tokens-per-chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = CrossoverConfig(tokens_per_chunk=args.tokens_per_chunk, repeats=args.repeats)
    if args.quick:
        cfg = CrossoverConfig(
            prefixes=(256,), bandwidths_mb_s=(5.0, 0.0), tokens_per_chunk=args.tokens_per_chunk
        )
    if args.prefixes:
        cfg = _with(cfg, prefixes=tuple(int(x) for x in args.prefixes.split(",")))
    if args.bandwidths:
        cfg = _with(cfg, bandwidths_mb_s=tuple(float(x) for x in args.bandwidths.split(",")))
    cfg = _with(cfg, model=args.model, repeats=args.repeats, threads=args.threads)
    result = run(cfg, progress=not args.no_progress)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    if args.plot:
        plot_png(result, Path(args.plot))
    s = result["summary"]
    print(
        f"planner worst/oracle {s['planner_worst_vs_oracle']:.3f} (its plan's best run: "
        f"{s['planner_plan_worst_vs_oracle']:.3f}), within 5% at {s['points_within_5pct']}"
        f"/{s['points']}; crossings "
        + ", ".join(
            f"{k}: {v['bandwidth_mb_s'] or 'full'} MB/s split x{v['split_gain']:.2f}"
            for k, v in s["crossings"].items()
        ),
        file=sys.stderr,
    )
    return 0


def _with(cfg: CrossoverConfig, **changes: Any) -> CrossoverConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


if __name__ == "__main__":
    sys.exit(main())
