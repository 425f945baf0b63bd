"""Load-only, whole or layer by layer: what overlapping the load with the rest's
prefill saves, and whether the planner's cost model predicts it.

``kvlife experiment crossover --layered --json F --plot F.png``: SmolLM2-135M (the HF
engine on this CPU) with a store whose only tier is a disk throttled
(:mod:`kvlife.faults.throttle`) to a few bandwidths. One prompt of ``prefix + suffix``
tokens has its prefix stored twice: once as whole chunks (one object per chunk) and
once as ``groups`` layer-group objects per chunk (:mod:`kvlife.engines.hf_layers`).
Per bandwidth the request is served three ways, interleaved ``repeats`` times:

- ``whole``: load-only from the whole chunks, then the rest's prefill
  (``load + rest``);
- ``layered``: load-only from the layer groups, the rest's forward starting when group 0
  landed and each layer waiting for its own group (``max(load, rest) + min(load, rest)
  / groups``, :func:`~kvlife.planner.layered_seconds`);
- ``compute``: the whole prompt prefilled (for scale).

Each row has every policy's median TTFT and the cost model's prediction for it (the
engine's prefill profile, the disk's speed calibrated at that bandwidth), and the time
the prefill waited for the load (``wait``: all of the load when whole; about the first
group's load, layered, where the rest's prefill is the longer), which a shared
machine's compute noise moves far less than the TTFT. The suffix is
long by default (256 tokens): the overlap can save at most ``min(load, rest)``, so a
16-token suffix would leave nothing to see.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.identity import PUBLIC
from kvlife.planner import CostModel, compute_only, load_only

POLICIES = ("whole", "layered", "compute")


@dataclass(frozen=True, slots=True)
class LayeredConfig:
    """What the layered variant sweeps."""

    prefix: int = 512
    """Tokens stored, then reused."""
    suffix: int = 256
    """New tokens after the prefix (the rest's prefill the load overlaps with)."""
    bandwidths_mb_s: tuple[float, ...] = (5.0, 20.0, 100.0)
    """Disk read limits in MB/s."""
    groups: int = 4
    """Layer groups of the layered copy (capped at the model's layers)."""
    tokens_per_chunk: int = 64
    repeats: int = 3
    model: str = "smollm2"
    """``smollm2`` or ``tiny`` (a random tiny Llama, for tests)."""
    threads: int = 1
    seed: int = 0


def _calibrate(planned: Any, ids: list[int]) -> None:
    """Seed the disk's speed from a one-chunk and a four-chunk load of the engine's own
    objects (every group's), the median of three each."""
    from kvlife.engines.hf_layers import lookup_groups

    eng = planned.engine
    found = lookup_groups(eng.store, eng.group_identities, PUBLIC, ids, 0)
    timed = []
    for k in (1, min(4, len(found[0].hits))):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for group in found:
                eng.store.load(group.sub(0, k))
            times.append(time.perf_counter() - t0)
        nbytes = sum(h.stored_nbytes for group in found for h in group.hits[:k])
        timed.append((nbytes, statistics.median(times)))
    tier = planned.model.tier("disk")
    if timed[1][0] > timed[0][0]:
        tier.calibrate(timed[0], timed[1])
    else:
        tier.per_byte.seed(timed[0][1] / timed[0][0])


def _loadavg() -> float:
    try:
        return float(os.getloadavg()[0])
    except OSError:  # not on every platform
        return -1.0


def run(cfg: LayeredConfig, progress: bool = True) -> dict[str, Any]:
    import torch

    from kvlife.engines.hf import HFEngine
    from kvlife.engines.hf_plan import PlannedEngine, measure_prefill, prefill_profile
    from kvlife.engines.models import load_smollm2, tiny_llama
    from kvlife.faults.throttle import MB, ThrottledDiskOptions, ThrottledTier
    from kvlife.store import KVStore, StoreConfig, TierSpec

    torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    tpc = cfg.tokens_per_chunk
    loaded = tiny_llama(seed=cfg.seed) if cfg.model == "tiny" else load_smollm2()
    with tempfile.TemporaryDirectory(prefix="kvlife-crossover-layered-") as tmp:
        spec = TierSpec(
            "throttled-disk",
            "disk",
            2 * cfg.prefix * 200_000 + (256 << 20),
            options=ThrottledDiskOptions(segment_bytes=64 << 20),
        )
        store = KVStore(Path(tmp), StoreConfig(tiers=(spec,), promote_on_hit=False))
        try:
            whole = HFEngine.for_model(loaded, store, tokens_per_chunk=tpc)
            groups = min(cfg.groups, whole.identity.layout.num_layers)
            layered = HFEngine.for_model(loaded, store, tokens_per_chunk=tpc, layer_groups=groups)
            if cfg.model == "tiny":
                profile = measure_prefill(
                    whole, [(0, 32), (0, 128), (0, 256), (256, 64), (256, 16)], repeats=1
                )
            else:
                profile = prefill_profile(whole)
            tier = store.tier("disk")
            assert isinstance(tier, ThrottledTier)
            ids = rng.integers(0, int(whole.config.vocab_size), cfg.prefix + cfg.suffix).tolist()
            for eng in (whole, layered):  # the prefix, stored as each engine stores it
                eng.generate(ids[: cfg.prefix], PUBLIC, max_new_tokens=1)
            # no deadline: each plan is measured as it runs, never as a fallback
            engines = {
                "whole": PlannedEngine(whole, CostModel(profile, tpc), deadline_factor=np.inf),
                "layered": PlannedEngine(layered, CostModel(profile, tpc), deadline_factor=np.inf),
            }
            engines["compute"] = engines["whole"]
            policies = {"whole": load_only, "layered": load_only, "compute": compute_only}
            points = []
            for bw in cfg.bandwidths_mb_s:
                tier.set_limits(bw * MB)
                for name in ("whole", "layered"):
                    _calibrate(engines[name], ids)
                runs: dict[str, list[dict[str, Any]]] = {n: [] for n in POLICIES}
                for r in range(cfg.repeats):
                    for name in POLICIES[r % 3 :] + POLICIES[: r % 3]:
                        planned = engines[name]
                        done = planned.prefill(ids, PUBLIC, policy=policies[name])
                        planned.settle(600)
                        runs[name].append(
                            {
                                "ttft_s": done.ttft_s,
                                "predicted_s": done.plan.predicted_s,
                                "load_s": done.load_s,
                                "rest_s": done.rest_s,
                                "wait_s": done.wait_s,
                                "loaded": done.loaded,
                                "layered": done.layered,
                                "groups": done.plan.groups,
                            }
                        )
                row: dict[str, Any] = {"bandwidth_mb_s": bw, "loadavg": _loadavg()}
                for name, rs in runs.items():
                    mid = sorted(rs, key=lambda x: x["ttft_s"])[(len(rs) - 1) // 2]
                    row[name] = float(statistics.median(x["ttft_s"] for x in rs))
                    row[f"{name}_predicted"] = mid["predicted_s"]
                    row[f"{name}_wait"] = float(statistics.median(x["wait_s"] for x in rs))
                    row[f"{name}_load"] = float(statistics.median(x["load_s"] for x in rs))
                    row[f"{name}_runs"] = rs
                row["whole_vs_layered"] = row["whole"] / row["layered"]
                row["whole_vs_layered_predicted"] = (
                    row["whole_predicted"] / row["layered_predicted"]
                )
                points.append(row)
                if progress:
                    print(
                        f"{bw:6.1f} MB/s: "
                        + "  ".join(
                            f"{n} {row[n]:.3f}s (pred {row[f'{n}_predicted']:.3f})"
                            for n in POLICIES
                        )
                        + f"  waits {row['whole_wait']:.3f}/{row['layered_wait']:.3f}s"
                        + f"  whole/layered {row['whole_vs_layered']:.2f}"
                        + f" (pred {row['whole_vs_layered_predicted']:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            store.close(flush=False)
    return {
        "config": asdict(cfg),
        "groups": groups,
        "kv_bytes_per_token": whole.identity.layout.bytes_per_token,
        "profile": {"c0": profile.c0, "c1": profile.c1, "c2": profile.c2, "c3": profile.c3},
        "points": points,
        "note": "indicative: one run on a machine shared with other jobs",
    }


def plot_png(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    xs = [p["bandwidth_mb_s"] for p in points]
    fig, (ax, axw) = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for name, style in (("whole", "o-"), ("layered", "^-"), ("compute", "s--")):
        line = ax.plot(xs, [p[name] for p in points], style, label=f"{name} (measured)")[0]
        if name != "compute":
            ax.plot(
                xs,
                [p[f"{name}_predicted"] for p in points],
                ":",
                color=line.get_color(),
                label=f"{name} (predicted)",
            )
            axw.plot(xs, [p[f"{name}_wait"] for p in points], style, label=f"{name}: wait")
    axw.plot(xs, [p["whole_load"] for p in points], "k:", label="the whole load")
    cfg = result["config"]
    ax.set_title(
        f"load-only TTFT, {cfg['prefix']}+{cfg['suffix']} tokens, {result['groups']} groups",
        fontsize=9,
    )
    axw.set_title("time the prefill waited for the load", fontsize=9)
    for a in (ax, axw):
        a.set_xscale("log")
        a.set_xlabel("disk read MB/s")
        a.set_ylabel("seconds")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
