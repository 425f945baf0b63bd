"""The plan chooser: its plan's predicted time to first token is the least over every
(front, stop) split, computed here from the model's formula independently; the fixed
policies are candidates it never loses to; per-chunk actions follow the hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.planner import (
    ChunkAction,
    CostModel,
    PlanKind,
    PrefillProfile,
    choose,
    compute_only,
    load_only,
    split_only,
    tokens_to_load,
)
from kvlife.planner.plan import make_plan
from kvlife.results import ChunkHit

TPC = 64


def _hits(n: int, nbytes: int, decode: list[float]) -> list[ChunkHit]:
    out = []
    for i in range(n):
        d = decode[i % len(decode)] if decode else 0.0
        out.append(
            ChunkHit(
                index=i,
                key=ChunkKey(bytes([i % 256]) * 32),
                start=i * TPC,
                tier=TierName("disk"),
                transform="int8" if d > 0 else "exact",
                exactness="lossy" if d > 0 else "exact",
                stored_nbytes=nbytes,
                decode_nbytes=nbytes * 2 if d > 0 else 0,
                decode_seconds=d,
            )
        )
    return out


models = st.builds(
    lambda c0, c1, c2, c3, lat, spb: (PrefillProfile(c0, c1, c2, c3=c3), lat, spb),
    st.floats(min_value=0, max_value=1e-2),
    st.floats(min_value=1e-6, max_value=1e-3),
    st.floats(min_value=0, max_value=1e-7),
    st.floats(min_value=0, max_value=1e-4),
    st.floats(min_value=0, max_value=1e-2),
    st.floats(min_value=1e-11, max_value=1e-6),
)


def _model(prefill: PrefillProfile, lat: float, spb: float) -> CostModel:
    m = CostModel(prefill, TPC)
    m.tier("disk").latency_s = lat
    m.tier("disk").per_byte.seed(spb)
    return m


@settings(max_examples=80, deadline=None)
@given(
    models,
    st.integers(min_value=0, max_value=12),
    st.integers(min_value=1, max_value=3 * TPC),
    st.integers(min_value=1 << 10, max_value=1 << 22),
    st.lists(st.floats(min_value=0, max_value=0.05), max_size=3),
)
def test_the_chosen_plan_is_the_least_predicted_time(
    m: tuple[PrefillProfile, float, float], h: int, tail: int, nbytes: int, decode: list[float]
) -> None:
    prefill, lat, spb = m
    model = _model(prefill, lat, spb)
    join_per_token = prefill.c3  # a learnt join cost, drawn with the profile
    model.join_per_token.seed(join_per_token)
    hits = _hits(h, nbytes, decode)
    n = h * TPC + tail
    usable = min(h, (n - 1) // TPC)

    def ttft(front: int, stop: int) -> float:  # the model's formula, written out again
        load = (
            lat + sum(nbytes * spb + hits[i].decode_seconds for i in range(front, stop))
            if stop > front
            else 0.0
        )
        # a front joined to loaded chunks: one copy of both, at the learnt cost
        join = join_per_token * stop * TPC if 0 < front < stop else 0.0
        return (
            max(prefill.seconds(0, front * TPC), load)
            + join
            + prefill.seconds(stop * TPC, n - stop * TPC)
        )

    brute = min([ttft(0, 0)] + [ttft(f, s) for s in range(1, usable + 1) for f in range(s)])
    plan = choose(model, hits, n)
    assert plan.predicted_s == pytest.approx(brute, rel=1e-9, abs=1e-12)
    assert plan.predicted_s == pytest.approx(ttft(plan.front, plan.stop), rel=1e-9, abs=1e-12)
    for fixed in (load_only, compute_only, split_only):
        assert plan.predicted_s <= fixed(model, hits, n).predicted_s * (1 + 1e-12)
    # per chunk: recomputed outside [front, stop), loaded (decoded where framed) inside
    assert len(plan.chunks) == usable
    for c in plan.chunks:
        if plan.front <= c.index < plan.stop:
            framed = hits[c.index].decode_nbytes > 0
            assert c.action is (ChunkAction.LOAD_DECODE if framed else ChunkAction.LOAD_EXACT)
        else:
            assert c.action is ChunkAction.RECOMPUTE
    # the prefix-only seam: the best plan that computes no front beside its load
    best0 = min(range(usable + 1), key=lambda s: (ttft(0, s), s))
    assert tokens_to_load(hits, model, n) == best0 * TPC or ttft(
        0, tokens_to_load(hits, model, n) // TPC
    ) == pytest.approx(ttft(0, best0), rel=1e-9, abs=1e-12)


def test_the_fixed_policies_and_their_kinds() -> None:
    model = _model(PrefillProfile(0.0, 1e-3, 0.0), 0.0, 1e-8)  # 64 ms a chunk both ways
    hits = _hits(8, 64 * 100_000, [])
    n = 8 * TPC + 1
    assert compute_only(model, hits, n).kind is PlanKind.COMPUTE
    assert load_only(model, hits, n).kind is PlanKind.LOAD
    split = split_only(model, hits, n)
    assert split.kind is PlanKind.SPLIT and split.front == 4 and split.stop == 8
    # equal speeds: halving the prefix beats both pure plans by about 2x
    assert load_only(model, hits, n).predicted_s / split.predicted_s > 1.9
    assert choose(model, hits, n).predicted_s == pytest.approx(split.predicted_s)


def test_a_plan_that_breaks_its_bounds_is_refused() -> None:
    model = _model(PrefillProfile(0.0, 1e-3, 0.0), 0.0, 1e-8)
    hits = _hits(4, 1000, [])
    with pytest.raises(InvalidArgument, match="front <= stop"):
        make_plan(model, hits, 4 * TPC + 1, 3, 2)
    with pytest.raises(InvalidArgument, match="nothing to prefill"):
        make_plan(model, hits, 4 * TPC, 0, 4)


def test_a_tier_of_unknown_speed_is_loaded_to_learn_it() -> None:
    model = CostModel(PrefillProfile(0.0, 1e-3, 0.0), TPC)
    hits = _hits(4, 1000, [])
    plan = choose(model, hits, 4 * TPC + 1)
    assert plan.kind is PlanKind.LOAD and plan.stop == 4
    model.observe_load(hits, 10.0)  # very slow: 10 s for 4 kB
    assert choose(model, hits, 4 * TPC + 1).kind is PlanKind.COMPUTE
