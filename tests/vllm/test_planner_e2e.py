"""Load deadlines and the planner under a real vLLM (CPU build), the store's disk tier
behind the throttle wrapper (``throttled-disk``, :mod:`kvlife.faults.throttle`), the
connector configured by a ``kvlife.config`` file alone. Three engine processes on one
store:

- W writes the prompt's chunks (they reach the disk when it closes) and measures the
  engine's prefill profile (:mod:`kvlife.engines.vllm.profile`);
- T reads them through a disk that answers each read after 2 s, with
  ``load_timeout_ms = 300``: the load is abandoned at its deadline, vLLM recomputes the
  blocks, the output is W's and the first token does not wait for the disk;
- L has the ``[planner]`` table (W's profile; the disk seeded as 1 GB/s, far faster than
  it is): it loads, overruns the deadline the planner set, learns the disk's speed from
  what the worker reports, and stops loading from it; every output is W's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.vllm.conftest import run_engine

CHUNK = 64
P1 = [int(t) for t in np.random.default_rng(23).integers(5, 1000, size=5 * CHUNK)]
NEW = 8
LATENCY_MS = 2000

STORE = """
[store]
path = "store"

[[tiers]]
name = "dram"
kind = "memory"
budget = "64MiB"

[[tiers]]
name = "disk"
kind = "throttled-disk"
budget = "256MiB"
options = {{ read_latency_ms = {latency}, segment_bytes = "64MiB" }}

[vllm]
chunk_tokens = 64
{vllm}
"""

PLANNER = """
[planner]
prefill_profile = "profile.json"

[planner.tiers.disk]
latency_s = 0.0
bytes_per_s = 1e9
"""


def _spec(model: Path, config: Path, requests: int, **kw: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "skip_tokenizer_init": True,
        "block_size": 32,
        "dtype": "float32",
        "kv_cache_mib": 64,
        "max_model_len": 1024,
        "requests": [{"tokens": P1, "max_tokens": NEW}] * requests,
        "imports": ["kvlife.faults.throttle"],
        "kvlife": {"kvlife.config": str(config)},
    } | kw


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-planner")
    out: dict[str, Any] = {}
    configs = {
        "W": STORE.format(latency=0, vllm=""),
        "T": STORE.format(latency=LATENCY_MS, vllm="load_timeout_ms = 300"),
        "L": STORE.format(latency=LATENCY_MS, vllm="") + PLANNER,
    }
    for name, text in configs.items():
        (work / f"{name}.toml").write_text(text)
    # the best of five per point: on a busy machine the best of two left the three
    # points' times flat (the fit's per-token terms 0)
    profile = {
        "out": str(work / "profile.json"),
        "points": [[0, 64], [0, 256], [0, 512]],
        "repeats": 5,
    }
    out["W"] = run_engine(_spec(tiny_model, work / "W.toml", 1, prefill_profile=profile), work, "W")
    out["T"] = run_engine(_spec(tiny_model, work / "T.toml", 1), work, "T")
    out["L"] = run_engine(_spec(tiny_model, work / "L.toml", 6), work, "L")
    return out


def test_a_load_past_its_deadline_is_recomputed_and_the_output_is_unchanged(
    runs: dict[str, Any],
) -> None:
    ref = runs["W"]["requests"][0]["output_ids"]
    assert len(ref) == NEW and runs["W"]["requests"][0]["cached_tokens"] == 0
    t = runs["T"]
    req = t["requests"][0]
    assert req["output_ids"] == ref
    w = t["counters"]["worker"]
    assert w["loads_timed_out"] == 1 and w["chunks_timed_out"] == 4
    assert w["blocks_failed"] == 4 * CHUNK // 32 and w["tokens_loaded"] == 0
    assert req["kvlife_chunks"] == {}
    # the first token came at the deadline plus a recompute, not after the disk's 2 s
    assert req["ttft_s"] < LATENCY_MS / 1000, req["ttft_s"]


def test_the_planner_learns_the_throttled_disk_and_stops_loading_from_it(
    runs: dict[str, Any],
) -> None:
    ref = runs["W"]["requests"][0]["output_ids"]
    assert runs["W"]["prefill_profile"]["c1"] > 0 or runs["W"]["prefill_profile"]["c2"] > 0
    lr = runs["L"]
    assert [r["output_ids"] for r in lr["requests"]] == [ref] * 6
    s, w = lr["counters"]["scheduler"], lr["counters"]["worker"]
    assert s["planner_loads"] >= 1, "seeded as fast, the disk is tried first"
    assert w["loads_timed_out"] >= 1 and s["load_samples"] >= 1
    assert s["planner_recomputes"] >= 1 and s["planner_declined"] >= 4 * CHUNK
    last = lr["requests"][-1]
    assert last["kvlife_chunks"] == {} and last["ttft_s"] < LATENCY_MS / 1000
