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
    st.sampled_from([1, 1, 2, 3, 4]),
)
def test_the_chosen_plan_is_the_least_predicted_time(
    m: tuple[PrefillProfile, float, float],
    h: int,
    tail: int,
    nbytes: int,
    decode: list[float],
    groups: int,
) -> None:
    prefill, lat, spb = m
    model = _model(prefill, lat, spb)
    model.layer_groups = groups
    join_per_token = prefill.c3  # a learnt join cost, drawn with the profile
    model.join_per_token.seed(join_per_token)
    hits = _hits(h, nbytes, decode)
    n = h * TPC + tail
    usable = min(h, (n - 1) // TPC)

    def ttft(front: int, stop: int, groups: int = groups) -> float:  # the model's formula, again
        load = (
            lat + sum(nbytes * spb + hits[i].decode_seconds for i in range(front, stop))
            if stop > front
            else 0.0
        )
        # a front joined to loaded chunks: one copy of both, at the learnt cost
        join = join_per_token * stop * TPC if 0 < front < stop else 0.0
        front_s = prefill.seconds(0, front * TPC)
        rest = join + prefill.seconds(stop * TPC, n - stop * TPC)
        if groups == 1 or stop == front:
            return max(front_s, load) + rest
        # layer by layer: group g lands at (g + 1) * load / G; its layers' share of the
        # rest runs after it landed and after the front; the last group ends last
        return max(
            front_s + rest,
            max(load * (g + 1) / groups + (groups - g) * rest / groups for g in range(groups)),
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
    # the prefix-only seam (vLLM's connector: no front, no layered load): the best plan
    # that computes nothing beside a whole load
    best0 = min(range(usable + 1), key=lambda s: (ttft(0, s, 1), s))
    assert tokens_to_load(hits, model, n) == best0 * TPC or ttft(
        0, tokens_to_load(hits, model, n) // TPC, 1
    ) == pytest.approx(ttft(0, best0, 1), rel=1e-9, abs=1e-12)


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


def test_a_layered_load_overlaps_the_rest_of_the_prefill() -> None:
    """Load-only, loaded in G layer groups: ``max(load, rest) + min(load, rest) / G``
    (the rest's forward starts when group 0 landed), not ``load + rest``."""
    model = _model(PrefillProfile(0.0, 1e-3, 0.0), 0.0, 1e-8)
    hits = _hits(8, 64 * 50_000, [])  # 32 ms a chunk: 256 ms to load
    n = 8 * TPC + 200  # 200 ms of rest
    whole = load_only(model, hits, n)
    load, rest = whole.load_s, whole.rest_s
    assert whole.predicted_s == pytest.approx(load + rest)
    for groups in (2, 4):
        model.layer_groups = groups
        plan = load_only(model, hits, n)
        assert plan.groups == groups and plan.as_dict()["groups"] == groups
        assert plan.predicted_s == pytest.approx(max(load, rest) + min(load, rest) / groups)
    # compute-bound: max(load, rest) + the first group's load, as the issue puts it
    model.layer_groups = 4
    long_rest = load_only(model, hits, 8 * TPC + 2000)
    assert long_rest.predicted_s == pytest.approx(long_rest.rest_s + long_rest.load_s / 4)
    # the overlap changes the choice: a layered load beats computing where a whole load
    # does not (rest 200 ms, load 256 ms, prompt's compute 712 ms: 456 vs 264 ms)
    assert choose(model, hits, n).kind is not PlanKind.COMPUTE
    with pytest.raises(InvalidArgument, match="layer_groups"):
        CostModel(PrefillProfile(0.0, 1e-3, 0.0), TPC, layer_groups=0)
