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

``--layered`` runs :mod:`kvlife.experiments.crossover_layered` instead: load-only from
whole chunks against load-only layer by layer (chunks stored as layer groups, the rest's
forward starting when the first group landed), at a few throttled bandwidths.

:func:`field_table` applies the same model with documented parameters to an H200
serving Llama-3-8B from NVMe, 100 GbE and CXL (``docs/planner.md`` cites the sources):
each plan's predicted TTFT, load-only also layer by layer (one group per layer, as a GPU
engine injects, and four), the planner told the engine loads per layer, and where
loading beats recomputing, whole and layered. ``--field`` prints only that table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument
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
    repeats: int = 3
    """Runs of each policy per point, interleaved; a policy's time is their median (the
    best of several noisy runs is biased low, and the oracle is the best policy)."""
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


def _calibrate(planned: Any, ids: list[int], namespace: Any, repeats: int = 3) -> None:
    """Seed the disk's cost from a one-chunk and a four-chunk load (the median of
    ``repeats`` each: the best of a few would be biased low)."""
    store = planned.engine.store
    found = store.lookup(planned.engine.identity, namespace, ids)
    timed = []
    for k in (1, min(4, len(found.hits))):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            store.load(found.sub(0, k))
            times.append(time.perf_counter() - t0)
        timed.append((sum(h.stored_nbytes for h in found.hits[:k]), statistics.median(times)))
    tier = planned.model.tier("disk")
    if timed[1][0] > timed[0][0]:
        tier.calibrate(timed[0], timed[1])
    else:
        tier.per_byte.seed(timed[0][1] / timed[0][0])


def _record(done: Any) -> dict[str, Any]:
    """One run of a plan: what the model predicted per term and what was measured."""
    p = done.plan
    return {
        "ttft_s": done.ttft_s,
        **p.as_dict(),
        "loaded": done.loaded,
        "fallback": done.fallback,
        "predicted": {
            "front_s": p.front_s,
            "load_s": p.load_s,
            "join_s": p.join_s,
            "rest_s": p.rest_s,
            "total_s": p.predicted_s,
        },
        "measured": {
            "lookup_s": done.lookup_s,
            "front_s": done.front_s,
            "load_s": done.load_s,
            "wait_s": done.wait_s,
            "join_s": done.join_s,
            "rest_s": done.rest_s,
        },
        "main_cpu_s": done.main_cpu_s,
        "other_cpu_s": done.other_cpu_s,
        "cpu": done.cpu_s,
        "cpu_ttft_s": cpu_ttft(done),
    }


def cpu_ttft(done: Any) -> float:
    """The run's TTFT with the time the engine's thread waited for a core taken out:
    each compute phase counted at its CPU time (one torch thread), the load at its wall
    time (a throttled load mostly sleeps), the front and the load overlapped as the plan
    runs them. On a shared machine this is what the same plan would take alone, roughly;
    it ranks plans with the scheduler's noise removed (not the I/O threads' share)."""
    c = done.cpu_s
    load = done.load_s if done.loaded or done.fallback else 0.0
    return float(c["lookup_s"] + max(c["front_s"], load) + c["join_s"] + c["rest_s"])


def _median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run whose TTFT is the (low) median of the runs."""
    return sorted(runs, key=lambda r: r["ttft_s"])[(len(runs) - 1) // 2]


def point_row(
    prefix: int, bw: float, runs: dict[str, list[dict[str, Any]]], extra: dict[str, Any]
) -> dict[str, Any]:
    """A point's row from every run of every policy: each policy's time is the median
    of its runs (the oracle is the least median, not a lucky minimum), its spread the
    runs' range over that median, with the per-term table and the diagnosis."""
    row: dict[str, Any] = {"prefix": prefix, "bandwidth_mb_s": bw, **extra}
    for name, rs in runs.items():
        times = [r["ttft_s"] for r in rs]
        med = float(statistics.median(times))
        row[name] = med
        row[f"{name}_runs"] = times
        row[f"{name}_spread"] = (max(times) - min(times)) / med if med > 0 else 0.0
        row[f"{name}_plan"] = _median_run(rs)
        row[f"{name}_records"] = rs
        row[f"{name}_cpu"] = float(statistics.median(r["cpu_ttft_s"] for r in rs))
    row["oracle_policy"] = min(runs, key=lambda n: row[n])
    row["oracle"] = row[row["oracle_policy"]]
    row["planner_vs_oracle"] = row["planner"] / row["oracle"]
    # the same comparison on the CPU-time reconstruction of each run (noise removed)
    row["cpu_oracle"] = min(row[f"{n}_cpu"] for n in runs)
    row["planner_vs_cpu_oracle"] = row["planner_cpu"] / row["cpu_oracle"]
    row["diagnosis"] = diagnose(row, list(runs))
    return row


def _term_errors(run: dict[str, Any]) -> dict[str, float]:
    """Measured minus predicted seconds per term of a run. The front and the load
    overlap: their error is that of the critical path (front + wait for the load
    against the predicted max), put on whichever of the two took longer."""
    pred, meas = run["predicted"], run["measured"]
    overlap = meas["front_s"] + meas["wait_s"] - max(pred["front_s"], pred["load_s"])
    key = "load" if run["stop"] > run["front"] and meas["load_s"] >= meas["front_s"] else "front"
    return {
        key: overlap,
        "load" if key == "front" else "front": 0.0,
        "join": meas["join_s"] - pred["join_s"],
        "rest": meas["rest_s"] - pred["rest_s"],
        "lookup": meas["lookup_s"],
    }


def core_share(run: dict[str, Any]) -> float | None:
    """The share of a core the engine's thread had while it computed (front and rest:
    CPU seconds over wall seconds); None for a run that computed next to nothing. Far
    below 1, other processes had the cores: a compute term off its prediction by that
    factor is the machine's, not the profile's."""
    wall = run["measured"]["front_s"] + run["measured"]["rest_s"]
    cpu = run["cpu"]["front_s"] + run["cpu"]["rest_s"]
    return cpu / wall if wall > 0.05 else None


def diagnose(row: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Why the planner is (or is not) within 5 % of the oracle at this point.

    - ``within 5%``: it is;
    - ``noise: same plan``: the oracle's policy ran the plan the planner chose (same
      front and stop): the gap is the repeat-to-repeat spread of one plan;
    - ``noise: runs overlap``: another plan, but the planner's fastest run is faster
      than the oracle's slowest (the medians' order is not settled by these repeats);
    - ``model: TERM``: the plans' runs do not overlap: the model ordered them wrong;
      TERM is the term whose prediction error (measured minus predicted, the planner's
      plan's less the oracle's) accounts for most of the gap.

    Per policy it also lists predicted and measured TTFT (medians of the runs),
    the spread, and the per-term errors of the median run."""
    table = {}
    for name in names:
        run = row[f"{name}_plan"]
        table[name] = {
            "plan": f"{run['kind']} {run['front']}/{run['stop']}",
            "predicted_s": run["predicted"]["total_s"],
            "measured_s": row[name],
            "spread": row[f"{name}_spread"],
            "cpu_time_s": row[f"{name}_cpu"],
            "core_share": core_share(run),
            "term_errors_s": _term_errors(run),
        }
    ratio = row["planner_vs_oracle"]
    out: dict[str, Any] = {"table": table, "gap": ratio - 1.0}
    o = row["oracle_policy"]
    mine, theirs = row["planner_plan"], row[f"{o}_plan"]
    if ratio <= 1.05:
        out["verdict"] = "within 5%"
    elif (mine["front"], mine["stop"]) == (theirs["front"], theirs["stop"]):
        out["verdict"] = "noise: same plan"
    elif min(row["planner_runs"]) <= max(row[f"{o}_runs"]):
        out["verdict"] = "noise: runs overlap"
    else:
        em, et = table["planner"]["term_errors_s"], table[o]["term_errors_s"]
        diff = {t: em[t] - et.get(t, 0.0) for t in em}
        term = max(diff, key=lambda t: diff[t])
        out["verdict"] = f"model: {term}"
        out["term_gap_s"] = diff
    out["noise"] = max(row["planner_spread"], row[f"{o}_spread"])
    out["cpu_time_ratio"] = row["planner_vs_cpu_oracle"]
    return out


def _loadavg() -> float:
    try:
        return float(os.getloadavg()[0])
    except OSError:  # not on every platform
        return -1.0


def run(
    cfg: CrossoverConfig,
    progress: bool = True,
    partial: Callable[[list[dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """The experiment; ``partial`` is handed the points so far after each one (a long
    run on a shared machine leaves what it measured if it is stopped)."""
    import torch

    from kvlife.engines.hf_plan import PlannedEngine, measure_prefill, prefill_profile
    from kvlife.faults.throttle import MB, ThrottledDiskOptions, ThrottledTier
    from kvlife.store import KVStore, StoreConfig, TierSpec

    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    tpc = cfg.tokens_per_chunk
    names = list(PLANS)
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
                profile = measure_prefill(
                    eng, [(0, 32), (0, 128), (0, 256), (256, 64), (256, 16)], repeats=1
                )
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
                    load0 = _loadavg()
                    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
                    for r in range(cfg.repeats):
                        # interleaved, in a rotating order: each policy's runs see the
                        # same moments of the machine as the others'
                        for name in names[r % len(names) :] + names[: r % len(names)]:
                            runner = planned if name == "planner" else fixed
                            done = runner.prefill(ids, PUBLIC, policy=PLANS[name])
                            runner.settle(600)  # abandoned loads end before the next run
                            runs[name].append(_record(done))
                    row = point_row(
                        prefix,
                        bw,
                        runs,
                        {
                            "loadavg": [load0, _loadavg()],
                            "disk_s_per_mb_learnt": (model.tier("disk").per_byte.value or 0) * MB,
                            "prefill_learnt": [
                                model.prefill.c0,
                                model.prefill.c1,
                                model.prefill.c2,
                                model.prefill.c3,
                            ],
                            "planner_fallback_chunks": planned.counters.fallback_chunks - fallbacks,
                        },
                    )
                    points.append(row)
                    if partial is not None:
                        partial(points)
                    if progress:
                        d = row["diagnosis"]
                        print(
                            f"prefix {prefix:5d} @ {bw or 'full':>5} MB/s: "
                            + "  ".join(
                                f"{n} {row[n]:.3f}s\u00b1{row[f'{n}_spread']:.0%}" for n in PLANS
                            )
                            + f"  planner/oracle {row['planner_vs_oracle']:.3f}"
                            + f" ({row['planner_plan']['kind']} {row['planner_plan']['front']}"
                            + f"/{row['planner_plan']['stop']}/{row['planner_plan']['hits']},"
                            + f" fallback {row['planner_fallback_chunks']}) {d['verdict']}"
                            + f" load {row['loadavg'][0]:.1f}"
                            + f"; cpu-time: planner/oracle {row['planner_vs_cpu_oracle']:.3f}",
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
            "c3": profile.c3,
            "engine": profile.engine,
            "seconds": profile_s,
        },
        "points": points,
        "summary": summarise(points),
        "field": field_table(),
    }


def crossing(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where the pure plans are closest (their crossing) among a prefix's rows: the
    split's gain there (medians), the model's predicted gain, and what bounds it: the
    split's median run per term (the front and the load overlap; the lookup, the join
    and the rest do not), the front's slowdown against its prediction while the load
    ran beside it, and the load's CPU (cores the process's other threads used over the
    load-only run's load time)."""
    at = min(rows, key=lambda p: abs(np.log(p["load"] / p["compute"])))
    split = at["split_plan"]
    pure = min(at["load"], at["compute"])
    pred_pure = min(
        at["load_plan"]["predicted"]["total_s"], at["compute_plan"]["predicted"]["total_s"]
    )
    meas = split["measured"]
    serial = meas["lookup_s"] + meas["join_s"] + meas["rest_s"]
    lo = at["load_plan"]
    return {
        "bandwidth_mb_s": at["bandwidth_mb_s"],
        "load": at["load"],
        "compute": at["compute"],
        "split": at["split"],
        "split_gain": pure / at["split"],
        "split_gain_cpu_time": min(at["load_cpu"], at["compute_cpu"]) / at["split_cpu"],
        "split_gain_predicted": pred_pure / split["predicted"]["total_s"],
        "split_plan": f"{split['front']}/{split['stop']} of {split['hits']}",
        "split_terms_s": meas,
        "split_serial_s": serial,
        "split_gain_if_overlap_were_free": pure / serial if serial > 0 else float("inf"),
        "split_front_vs_predicted": meas["front_s"] / split["predicted"]["front_s"]
        if split["predicted"]["front_s"] > 0
        else None,
        "split_other_cpu_share": split["other_cpu_s"] / max(split["ttft_s"], 1e-9),
        "load_cpu_cores": lo["other_cpu_s"] / max(lo["measured"]["load_s"], 1e-9),
        "loadavg": at.get("loadavg"),
    }


def summarise(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The planner's worst ratio to the oracle (medians), the points within 5 % and the
    verdict on every miss, and per prefix the crossing of the pure plans with the split's
    gain there."""
    worst = max((p["planner_vs_oracle"] for p in points), default=1.0)
    within = sum(p["planner_vs_oracle"] <= 1.05 for p in points)
    cpu_within = sum(p["planner_vs_cpu_oracle"] <= 1.05 for p in points)
    verdicts: dict[str, int] = {}
    for p in points:
        v = p["diagnosis"]["verdict"]
        verdicts[v] = verdicts.get(v, 0) + 1
    misses = [
        {
            "prefix": p["prefix"],
            "bandwidth_mb_s": p["bandwidth_mb_s"],
            "planner_vs_oracle": p["planner_vs_oracle"],
            "planner": p["diagnosis"]["table"]["planner"]["plan"],
            "oracle": f"{p['oracle_policy']} {p['diagnosis']['table'][p['oracle_policy']]['plan']}",
            "verdict": p["diagnosis"]["verdict"],
            "noise": p["diagnosis"]["noise"],
            "cpu_time_ratio": p["planner_vs_cpu_oracle"],
        }
        for p in points
        if p["planner_vs_oracle"] > 1.05
    ]
    cross = {}
    for prefix in sorted({p["prefix"] for p in points}):
        cross[str(prefix)] = crossing([p for p in points if p["prefix"] == prefix])
    return {
        "rule": "each policy run `repeats` times per point, interleaved; its time is the "
        "median of its runs; the oracle is the least median",
        "planner_worst_vs_oracle": worst,
        "planner_within_5pct": worst <= 1.05,
        "points_within_5pct": within,
        "points": len(points),
        "cpu_worst_vs_oracle": max((p["planner_vs_cpu_oracle"] for p in points), default=1.0),
        "cpu_points_within_5pct": cpu_within,
        "verdicts": verdicts,
        "misses": misses,
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


LLAMA3_8B_LAYERS = 32
"""Layer groups a GPU engine loads Llama-3-8B's KV in: one per layer (vLLM's connector
waits per attention layer, ``wait_for_layer_load``; LMCache's layerwise retrieval
advances one layer per wait)."""

FIELD_GROUPS: tuple[int, ...] = (LLAMA3_8B_LAYERS, 4)
"""Layer groups of the field table's layered columns: per layer, and the four of the
``--layered`` figure."""


def _field_model(
    profile: PrefillProfile, tokens_per_chunk: int, tier: FieldTier, groups: int
) -> CostModel:
    model = CostModel(profile, tokens_per_chunk, layer_groups=groups)
    cost = model.tier("field")
    cost.latency_s = tier.latency_s
    cost.per_byte.seed(1.0 / min(tier.bytes_per_s, PCIE5_X16))
    return model


def break_even_load_s(compute_s: float, rest_s: float, groups: int) -> float:
    """The load time at which load-only (load, then the rest's ``rest_s`` of prefill,
    layer by layer in ``groups`` groups) takes as long as computing the whole prompt
    (``compute_s``): the root of ``max(L, R) + min(L, R) / G = C`` in ``L``
    (:func:`~kvlife.planner.layered_seconds` with no front, increasing in ``L``).
    Where ``C >= R + R / G`` the load is the longer stage at the root, ``L = C - R / G``;
    else ``L = G (C - R)``. With one group ``C - R``, the whole-chunk break-even."""
    if groups < 1:
        raise InvalidArgument(f"layer groups must be >= 1, got {groups}")
    if compute_s >= rest_s * (1 + 1 / groups):
        return compute_s - rest_s / groups
    return groups * max(compute_s - rest_s, 0.0)


def field_table(
    prefixes: Sequence[int] = (1024, 4096, 8192, 32768),
    tokens_per_chunk: int = 256,
    *,
    suffix: int = 16,
    groups: Sequence[int] = FIELD_GROUPS,
    tiers: Sequence[FieldTier] = FIELD_TIERS,
    profile: PrefillProfile = H200_LLAMA3_8B,
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
) -> dict[str, Any]:
    """Predicted TTFT of each plan on an H200 for Llama-3-8B KV from each field tier
    (a prompt of ``prefix + suffix`` tokens whose prefix is stored), load-only also
    layer by layer in each of ``groups`` layer groups (``load_layered``, by ``G``: the
    rest's prefill runs each group's layers once that group landed), and the bandwidth
    below which recomputing beats loading, per prefix, whole and layered (the tier's
    latency neglected: 1-100 us against milliseconds of load)."""
    if suffix < 1:
        raise InvalidArgument(
            f"the field table needs suffix >= 1 (the engine prefills the last token), got {suffix}"
        )
    if tokens_per_chunk < 1 or any(p < 0 for p in prefixes):
        raise InvalidArgument(
            f"the field table needs tokens_per_chunk >= 1 and prefixes >= 0, got "
            f"{tokens_per_chunk}, {tuple(prefixes)}"
        )
    if any(not isinstance(g, int) or g < 1 for g in groups):
        raise InvalidArgument(f"layer groups must be ints >= 1, got {tuple(groups)}")
    kvb = kv_bytes_per_token
    finest = max(groups, default=None)
    rows = []
    for tier in tiers:
        model = _field_model(profile, tokens_per_chunk, tier, 1)
        layered = {g: _field_model(profile, tokens_per_chunk, tier, g) for g in groups}
        for prefix in prefixes:
            n = prefix + suffix
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
            row: dict[str, Any] = {
                "tier": tier.name,
                "prefix": prefix,
                "suffix": suffix,
                **{name: p.predicted_s for name, p in got.items()},
                "load_layered": {
                    str(g): load_only(m, hits, n).predicted_s for g, m in layered.items()
                },
                "planner_plan": got["planner"].as_dict(),
            }
            if finest is not None:
                # the planner told the engine loads in the finest groups: every
                # (front, stop) layered, the split's rest behind its load as well
                best = choose(layered[finest], hits, n)
                row["planner_layered"] = best.predicted_s
                row["planner_layered_plan"] = best.as_dict()
            rows.append(row)
    crossover: dict[str, float] = {}
    crossover_layered: dict[str, dict[str, float]] = {str(g): {} for g in groups}
    for prefix in prefixes:
        # load-only equals compute-only where the load of the whole chunks of the
        # prefix takes break_even_load_s
        loaded = prefix // tokens_per_chunk * tokens_per_chunk
        full = profile.seconds(0, prefix + suffix)
        rest = profile.seconds(loaded, prefix + suffix - loaded)
        for g, into in ((1, crossover), *((g, crossover_layered[str(g)]) for g in groups)):
            t = break_even_load_s(full, rest, g)
            into[str(prefix)] = loaded * kvb / t if t > 0 else float("inf")
    return {
        "kv_bytes_per_token": kvb,
        "suffix": suffix,
        "tokens_per_chunk": tokens_per_chunk,
        "groups": list(groups),
        "profile": {"c0": profile.c0, "c1": profile.c1, "c2": profile.c2},
        "tiers": [asdict(t) for t in tiers],
        "rows": rows,
        "crossover_bytes_per_s": crossover,
        "crossover_layered_bytes_per_s": crossover_layered,
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
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each policy per point (median kept)"
    )
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--layered",
        action="store_true",
        help="the layered variant: load-only from whole chunks against layer by layer "
        "(kvlife.experiments.crossover_layered), compute-only for scale",
    )
    parser.add_argument(
        "--groups", type=int, default=4, help="--layered: layer groups per chunk (default 4)"
    )
    parser.add_argument(
        "--suffix",
        type=int,
        default=None,
        help="new tokens after the prefix (default 16; --layered: 256)",
    )
    parser.add_argument(
        "--field",
        action="store_true",
        help="print only the H200 / Llama-3-8B field table (the cost model with documented "
        "parameters, no engine run): --prefixes, --suffix (default 16), --json",
    )
    args = parser.parse_args(argv)
    if args.field:
        return _main_field(args)
    if args.layered:
        return _main_layered(args)
    cfg = CrossoverConfig(tokens_per_chunk=args.tokens_per_chunk, repeats=args.repeats)
    if args.suffix is not None:
        cfg = _with(cfg, suffix=args.suffix)
    if args.quick:
        cfg = CrossoverConfig(
            prefixes=(256,),
            bandwidths_mb_s=(5.0, 0.0),
            tokens_per_chunk=args.tokens_per_chunk,
            suffix=cfg.suffix,
        )
    if args.prefixes:
        cfg = _with(cfg, prefixes=tuple(int(x) for x in args.prefixes.split(",")))
    if args.bandwidths:
        cfg = _with(cfg, bandwidths_mb_s=tuple(float(x) for x in args.bandwidths.split(",")))
    cfg = _with(cfg, model=args.model, repeats=args.repeats, threads=args.threads)

    def partial(points: list[dict[str, Any]]) -> None:
        if args.json:
            tmp = Path(args.json + ".partial")
            tmp.write_text(json.dumps({"config": asdict(cfg), "points": points}, indent=1))

    result = run(cfg, progress=not args.no_progress, partial=partial)
    if args.json:
        Path(args.json + ".partial").unlink(missing_ok=True)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    if args.plot:
        plot_png(result, Path(args.plot))
    s = result["summary"]
    print(
        f"planner worst/oracle {s['planner_worst_vs_oracle']:.3f} (medians of "
        f"{cfg.repeats}), within 5% at {s['points_within_5pct']}/{s['points']} "
        f"{s['verdicts']}; crossings "
        + ", ".join(
            f"{k}: {v['bandwidth_mb_s'] or 'full'} MB/s split x{v['split_gain']:.2f}"
            for k, v in s["crossings"].items()
        ),
        file=sys.stderr,
    )
    return 0


def _main_field(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = {}
    if args.prefixes:
        kwargs["prefixes"] = tuple(int(x) for x in args.prefixes.split(","))
    if args.suffix is not None:
        kwargs["suffix"] = args.suffix
    text = json.dumps(field_table(**kwargs), indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


def _main_layered(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvlife.experiments import crossover_layered as layered

    cfg = layered.LayeredConfig(
        groups=args.groups,
        tokens_per_chunk=args.tokens_per_chunk,
        repeats=args.repeats,
        model=args.model,
        threads=args.threads,
    )
    if args.quick:
        cfg = replace(cfg, prefix=256, suffix=64, bandwidths_mb_s=(10.0, 100.0))
    if args.prefixes:
        cfg = replace(cfg, prefix=int(args.prefixes.split(",")[0]))
    if args.suffix is not None:
        cfg = replace(cfg, suffix=args.suffix)
    if args.bandwidths:
        cfg = replace(cfg, bandwidths_mb_s=tuple(float(x) for x in args.bandwidths.split(",")))
    if any(bw <= 0 for bw in cfg.bandwidths_mb_s):
        raise SystemExit("--layered sweeps throttled bandwidths: give each as MB/s > 0")
    result = layered.run(cfg, progress=not args.no_progress)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    if args.plot:
        layered.plot_png(result, Path(args.plot))
    print(
        "whole/layered TTFT "
        + ", ".join(
            f"{p['bandwidth_mb_s']:g} MB/s x{p['whole_vs_layered']:.2f}"
            f" (predicted x{p['whole_vs_layered_predicted']:.2f})"
            for p in result["points"]
        ),
        file=sys.stderr,
    )
    return 0


def _with(cfg: CrossoverConfig, **changes: Any) -> CrossoverConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


if __name__ == "__main__":
    sys.exit(main())
