"""The documented ``lru`` semantics, checked on the real Mooncake trace against an
independent plain-OrderedDict computation, and every policy's counts on that trace pinned
(the figures README and docs/replay.md quote)."""

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
    # events and lifespans only observe: the same decisions with them
    tracked = CacheSim("lru", cap, track_lifespans=True).run(trace)
    assert np.array_equal(tracked.present, run.present)
    assert np.array_equal(tracked.prefix_dram, run.prefix_dram)


# Mooncake, DRAM only at 10% of the unique blocks (18,279), class hints on (`kvlife sweep`'s
# 10% column): block hits, usable-prefix hits, blocks stored, evictions.
DRAM_10 = {
    "lru": (80460, 80323, 208040, 189761),
    "lfu": (56234, 56207, 232266, 213987),
    "s3fifo": (70525, 70441, 217975, 199696),
    "arc": (81912, 81892, 206588, 188309),
    "lifespan": (65176, 64911, 223324, 205045),
}
# ... and DRAM 10% + disk 30% (README's `kvlife replay` table): block hits, prefix hits
# from DRAM and from disk, promotions, demotions, evictions from DRAM and from disk.
TWO_TIERS = {
    "lru": (103882, 80459, 23411, 23411, 169226, 189750, 114389),
    "lfu": (103066, 61646, 41217, 41217, 175074, 208372, 120237),
    "s3fifo": (103229, 72272, 30957, 30957, 181848, 197949, 127011),
    "arc": (103632, 83599, 20029, 20029, 169999, 186618, 115162),
    "lifespan": (104017, 61327, 42685, 42685, 166299, 208889, 111462),
}


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    if not MOONCAKE.exists():
        pytest.skip("Mooncake trace not present")
    return read_mooncake(MOONCAKE)


@pytest.mark.parametrize("policy", sorted(DRAM_10))
def test_every_policy_on_mooncake_gives_the_documented_counts(mooncake: Trace, policy: str) -> None:
    cap = mooncake.n_unique_blocks() // 10
    run = CacheSim(policy, cap).run(mooncake)
    got = (int(run.present.sum()), int(run.prefix_dram.sum()), int(run.new.sum()),
           run.tiers["dram"].evictions)  # fmt: skip
    assert got == DRAM_10[policy]
    assert int(run.dropped.sum()) == 0 and run.resident_at_end == cap
    two = CacheSim(policy, cap, 3 * cap).run(mooncake)
    both = (int(two.present.sum()), int(two.prefix_dram.sum()), int(two.prefix_disk.sum()),
           int(two.promoted.sum()), int(two.demoted.sum()), two.tiers["dram"].evictions,
           two.tiers["disk"].evictions)  # fmt: skip
    assert both == TWO_TIERS[policy]


def test_synthetic_lru_agrees_with_ordered_dict_at_many_capacities() -> None:
    trace = synthetic_trace(SyntheticConfig(seed=5, sessions=60))
    longest = int(np.diff(trace.offsets).max())
    for cap in (longest, 2 * longest, 500, 5000):
        hits, prefix_hits = ordered_dict_lru(trace, cap)
        run = CacheSim("lru", cap).run(trace)
        assert (int(run.present.sum()), int(run.prefix_dram.sum())) == (hits, prefix_hits)
