"""The documented ``lru`` semantics, checked on the real Mooncake trace against an
independent plain-OrderedDict computation, and fast path == general path."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from kvlife.replay.cache import CacheSim
from kvlife.trace.importers import read_mooncake
from kvlife.trace.model import Trace
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace

MOONCAKE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")


def ordered_dict_lru(trace: Trace, cap: int) -> tuple[int, int]:
    """Block hits and usable-prefix hits under the documented semantics, from scratch:
    requests in order, blocks in order; a present block becomes the most recent (hit); a
    missing block is inserted as the most recent, evicting the least recent block that the
    current request does not use."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = prefix_hits = 0
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    for r in range(trace.n_requests):
        req = blocks[offs[r] : offs[r + 1]]
        in_use = set(req)
        leading = True
        for b in req:
            if b in cache:
                hits += 1
                prefix_hits += leading
                cache.move_to_end(b)
                continue
            leading = False
            if len(cache) >= cap:
                victim = next(k for k in cache if k not in in_use)
                del cache[victim]
            cache[b] = None
    return hits, prefix_hits


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_lru_on_mooncake_agrees_exactly_with_an_ordered_dict() -> None:
    trace = read_mooncake(MOONCAKE)
    unique = trace.n_unique_blocks()
    assert (trace.n_touches - unique) / trace.n_touches == pytest.approx(0.366, abs=5e-4)
    cap = unique // 10
    hits, prefix_hits = ordered_dict_lru(trace, cap)
    run = CacheSim("lru", cap).run(trace)
    assert int(run.present.sum()) == hits
    assert int(run.prefix_dram.sum()) == prefix_hits
    assert hits / trace.n_touches == pytest.approx(0.278, abs=1e-3)  # the trace README's figure
    # the general path (events, lifespans, any tiers) takes the same decisions
    general = CacheSim("lru", cap, track_lifespans=True).run(trace)
    assert np.array_equal(general.present, run.present)
    assert np.array_equal(general.prefix_dram, run.prefix_dram)


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo", "arc", "lifespan"])
@pytest.mark.parametrize("cap", [3, 40, 400])
def test_fast_path_equals_general_path(policy: str, cap: int) -> None:
    trace = synthetic_trace(SyntheticConfig(seed=2, sessions=40))
    fast = CacheSim(policy, cap).run(trace)
    general = CacheSim(policy, cap, track_lifespans=True).run(trace)
    for f in ("prefix_dram", "present", "new", "dropped"):
        assert np.array_equal(getattr(fast, f), getattr(general, f)), f
    assert fast.tiers["dram"].evictions == general.tiers["dram"].evictions


def test_synthetic_lru_agrees_with_ordered_dict_at_many_capacities() -> None:
    trace = synthetic_trace(SyntheticConfig(seed=5, sessions=60))
    longest = int(np.diff(trace.offsets).max())
    for cap in (longest, 2 * longest, 500, 5000):
        hits, prefix_hits = ordered_dict_lru(trace, cap)
        run = CacheSim("lru", cap).run(trace)
        assert (int(run.present.sum()), int(run.prefix_dram.sum())) == (hits, prefix_hits)
