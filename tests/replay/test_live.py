"""Live mode: the same trace through a real KVStore gives exactly the simulated hits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlife.replay.cache import CacheSim
from kvlife.replay.live import run_live
from kvlife.trace.importers import read_mooncake
from kvlife.trace.model import Trace
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace

MOONCAKE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")
FIELDS = ("prefix_dram", "prefix_disk", "present", "new", "dropped")


def _agree(trace: Trace, policy: str, dram: int, disk: int) -> None:
    sim = CacheSim(policy, dram, disk, class_hints=False).run(trace)
    live = run_live(trace, policy, dram, disk)
    for f in FIELDS:
        assert np.array_equal(getattr(sim, f), getattr(live, f)), (policy, f)
    assert live.bytes_loaded > 0
    assert live.counters["chunks_stored"] == int(sim.new.sum())


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo", "arc", "lifespan"])
def test_dram_only_store_matches_simulation(policy: str) -> None:
    trace = synthetic_trace(SyntheticConfig(seed=9, sessions=30))
    _agree(trace, policy, trace.n_unique_blocks() // 8, 0)


@pytest.mark.parametrize(("dram", "disk"), [(0, 120), (50, 150)])
def test_disk_tiers_match_simulation(dram: int, disk: int) -> None:
    trace = synthetic_trace(SyntheticConfig(seed=9, sessions=30))
    _agree(trace, "lru", dram, disk)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_mooncake_head_dram_only_matches() -> None:
    trace = read_mooncake(MOONCAKE, max_requests=500)
    _agree(trace, "lru", trace.n_unique_blocks() // 10, 0)


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_mooncake_full_trace_dram_only_matches(policy: str) -> None:
    trace = read_mooncake(MOONCAKE)
    _agree(trace, policy, trace.n_unique_blocks() // 10, 0)
