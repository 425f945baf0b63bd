"""Load deadlines in the vLLM connector, without vLLM: the scheduler and worker sides
driven through vLLM's step protocol by the oracle mini engine
(:mod:`tests.engines.vllm_fakes`) against a real store whose only tier is a real disk
behind the throttle wrapper (:mod:`kvlife.faults.throttle`).

A load still running at its deadline is abandoned: its blocks are reported as failed
loads, vLLM recomputes them, the output is the one without kvlife and no wrong chunk is
ever served. The step does not wait for the slow device. The worker reports the time it
waited, and the scheduler's planner learns from it until it stops loading from that
tier at all."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from kvlife.engines.vllm.meta import LoadSample, StepReport
from kvlife.faults.throttle import ThrottledDiskOptions, ThrottledTier
from kvlife.planner import CostModel, PrefillProfile
from kvlife.store import KVStore, StoreConfig, TierSpec
from tests.engines.vllm_fakes import (
    BLOCK,
    CHUNK,
    MiniEngine,
    identities,
    reference_outputs,
    served_chunks,
)

P = [(5 * i + 2) % 977 for i in range(4 * CHUNK + 3)]
"""4 full chunks and 3 tokens."""
LATENCY_S = 2.0
"""Added to every read of the throttled disk: far past any deadline below."""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    spec = TierSpec(
        "throttled-disk", "disk", 64 << 20, options=ThrottledDiskOptions(segment_bytes=8 << 20)
    )
    with KVStore(tmp_path / "store", StoreConfig(tiers=(spec,), promote_on_hit=False)) as s:
        yield s


def _throttle(store: KVStore, latency_s: float) -> None:
    tier = store.tier("disk")
    assert isinstance(tier, ThrottledTier)
    tier.set_limits(0.0, latency_s)


def _stored(store: KVStore) -> MiniEngine:
    """An engine that served ``P`` once (its four chunks are on the disk)."""
    engine = MiniEngine(store, [store])
    assert engine.serve(P, 3) == reference_outputs(P, 3)
    return engine


def test_a_load_past_its_deadline_is_recomputed_without_waiting_for_the_device(
    store: KVStore,
) -> None:
    engine = _stored(store)
    _throttle(store, LATENCY_S)
    engine.scheduler.load_timeout_s = 0.2
    t0 = time.perf_counter()
    assert engine.serve(P, 3) == reference_outputs(P, 3)
    took = time.perf_counter() - t0
    # the step went on at the deadline, not when the throttled reads returned
    assert took < LATENCY_S, f"the step waited {took:.2f} s for the throttled disk"
    w = engine.workers[0].counters
    assert engine.scheduler.counters.hit_tokens == 4 * CHUNK  # offered, planned, abandoned
    assert w.loads_timed_out == 1 and w.chunks_timed_out == 4
    assert w.blocks_failed == 4 * CHUNK // BLOCK and w.tokens_loaded == 0
    _throttle(store, 0.0)
    served, wrong = served_chunks([store], identities(1), [P])
    assert wrong == [] and served == 4
    engine.close()


def test_without_a_deadline_the_same_load_waits_and_loads(store: KVStore) -> None:
    """The control: the throttle is what makes the load overrun; with no deadline the
    engine waits for the disk and loads all four chunks."""
    engine = _stored(store)
    _throttle(store, 0.3)
    assert engine.serve(P, 3) == reference_outputs(P, 3)
    w = engine.workers[0].counters
    assert w.loads_timed_out == 0 and w.tokens_loaded == 4 * CHUNK and w.blocks_failed == 0
    engine.close()


def test_the_planner_learns_the_slow_tier_from_abandoned_loads_and_stops_loading(
    store: KVStore,
) -> None:
    engine = _stored(store)
    _throttle(store, LATENCY_S)
    # seeded as a fast disk: four chunks load in far less than the 32 ms their prefill
    # takes, so the planner loads, with a deadline of twice that plus 50 ms
    model = CostModel(PrefillProfile(0.0, 1e-3, 0.0), CHUNK)
    model.tier("disk").per_byte.seed(1e-12)
    sched = engine.scheduler
    sched.planner = model
    seeded = model.tier("disk").per_byte.value
    timeouts = []
    for _ in range(8):
        assert engine.serve(P, 3) == reference_outputs(P, 3)
        timeouts.append(engine.workers[0].counters.loads_timed_out)
    c = sched.counters
    assert c.load_samples == timeouts[-1] >= 1
    learnt = model.tier("disk").per_byte.value
    assert seeded is not None and learnt is not None and learnt > 1000 * seeded
    # it stopped loading: the last requests recomputed without trying the disk
    assert c.planner_recomputes >= 2 and timeouts[-1] == timeouts[-2] == timeouts[-3]
    _throttle(store, 0.0)
    served, wrong = served_chunks([store], identities(1), [P])
    assert wrong == [] and served == 4
    engine.close()


_samples = st.lists(
    st.builds(
        LoadSample, st.sampled_from(["dram", "disk"]), st.integers(1, 1 << 30), st.floats(0, 10)
    ),
    max_size=4,
)


@settings(max_examples=50, deadline=None)
@given(st.lists(_samples, min_size=1, max_size=4))
def test_merged_reports_carry_every_rank_s_load_samples(per_rank: list[list[LoadSample]]) -> None:
    """vLLM merges the ranks' worker metadata pairwise in any order: every sample
    survives once, and a report with samples only is still sent (truthy)."""
    reports = [StepReport(loads=list(s)) for s in per_rank]
    merged = reports[0]
    for r in reports[1:]:
        merged = merged.merge(r)
    assert sorted(map(repr, merged.loads)) == sorted(repr(x) for s in per_rank for x in s)
    assert bool(merged) == any(per_rank)
    assert all(r.loads == s for r, s in zip(reports, per_rank, strict=True))  # unchanged
