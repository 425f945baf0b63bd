"""The KV-aware policies (prefix tree, admission, learned hit density): a protected
leaf keeps its prefix, evict_up_to as evict(1) n times, the prefix-tree invariant as a hypothesis
property, each admission filter's and the density ranking's behaviour, and the same hits
in a real KVStore as in the replay simulator."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlife.policy.kvhd as kvhd_mod
import kvlife.policy.wild as wild_mod
from kvlife.policy.base import EvictionPolicy, LearnsFromPrompts, make_policy, policy_names
from kvlife.policy.kvhd import HitDensityPolicy
from kvlife.policy.prefixtree import PrefixTreeAdmitPolicy, PrefixTreePolicy
from kvlife.policy.reuse import LAST, N_CLASSES, ReusePredictor, structural_classes
from kvlife.policy.wild import WorkloadAwarePolicy
from kvlife.replay.cache import CacheSim
from kvlife.replay.live import run_live
from kvlife.trace.model import Trace, TraceBuilder
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace
from tests.policy.trees import prompt_paths

KV = ["prefixtree", "prefixtree-admit", "prefixtree-door", "kvhd", "wild"]


def test_registered_and_marked() -> None:
    assert set(KV) <= set(policy_names())
    for name in KV:
        p = make_policy(name)
        assert p.name == name and isinstance(p, LearnsFromPrompts)


# the eviction contract of every policy, these included: tests/policy/test_policies.py


@pytest.mark.parametrize("name", KV)
class TestPrefixContract:
    def test_a_protected_leaf_keeps_its_ancestors(self, name: str) -> None:
        p: EvictionPolicy[object] = make_policy(name)
        p.record_in_order(["a", "b", "c"], {"a", "b", "c"})
        assert p.evict(1, protected={"c"}) is None  # b and a are c's prefix
        assert p.evict_up_to(3, protected={"c"}) == []
        assert p.evict_up_to(3) == ["c", "b", "a"]


# a forest of prompts: each prompt is a root-to-node path of a random tree
TREE = st.lists(st.integers(0, 30), min_size=1, max_size=40)  # parent index of node i+1


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "put", "evict", "touch"]), st.integers(0, 40),
              st.integers(0, 5)),
    max_size=80,
)  # fmt: skip


@pytest.mark.parametrize("name", KV)
@settings(max_examples=60, deadline=None)
@given(parents=TREE, ops=OPS)
def test_no_resident_child_without_its_resident_parent(
    name: str, parents: list[int], ops: list[tuple[str, int, int]]
) -> None:
    """Puts of prefix paths, lookups and evictions (protecting a put's prompt, as the
    engine does) never leave a resident block whose parent is not resident; and
    evict_up_to takes what evict(1) n times would."""
    paths = prompt_paths(parents)
    par = {path[-1]: (path[-2] if len(path) > 1 else None) for path in paths}
    a: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    b: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    for op, i, m in ops:
        path = paths[i % len(paths)]
        if op == "put":
            held = [k for k in path if k in a]
            # a put's prefix: the leading residents, then new keys (as placement makes it)
            lead = 0
            while lead < len(path) and path[lead] in a:
                lead += 1
            keys = path[:lead] + [k for k in path[lead:] if k not in a or k in held]
            new = {k for k in keys if k not in a}
            for p in (a, b):
                p.record_in_order(keys, new)
        elif op == "touch":
            hits = [k for k in path if k in a]
            for p in (a, b):
                p.touch_all(reversed(hits))
        else:
            protected = set(path[: m + 1])
            got = a.evict_up_to(m, protected)
            one = []
            for _ in range(m):
                v = b.evict(1, protected)
                if not v:
                    break
                one += v
            assert got == one
            assert not (set(got) & protected)
        for k in range(len(par)):
            if k in a and par[k] is not None:
                assert par[k] in a, (k, par[k])
        assert len(a) == len(b)


class _GeneralPaths(PrefixTreePolicy[int]):
    """``prefixtree`` through its general paths only: every put by ``_record_plain``,
    every victim by ``_drop`` (the fast paths write both out for the usual put and a
    leaf's eviction)."""

    def record_in_order(self, keys: Sequence[int], new: Collection[int]) -> None:
        self._record_plain(keys, new)

    def _drop(self, key: int) -> None:
        super()._drop(key)


def _tree_state(p: PrefixTreePolicy[int]) -> tuple[object, ...]:
    kids = {k: p.children_of(k) for k in p._order}
    return list(p._order.items()), {k: c for k, c in kids.items() if c}, list(p._orphans)


@settings(max_examples=150, deadline=None)
@given(parents=TREE, ops=OPS, removes=st.lists(st.integers(0, 40), max_size=4))
def test_prefixtree_fast_paths_equal_its_generalprompt_paths(
    parents: list[int], ops: list[tuple[str, int, int]], removes: list[int]
) -> None:
    """The plain tree's written-out put (residents first, then new keys) and leaf
    eviction leave exactly the state of its general paths: order, parents, children and
    orphans, after puts in any order of residents and new keys, lookups, evictions and
    removals (which make orphans)."""
    paths = prompt_paths(parents)
    fast: PrefixTreePolicy[int] = PrefixTreePolicy()
    slow = _GeneralPaths()
    for step, (op, i, m) in enumerate(ops):
        path = paths[i % len(paths)]
        if op == "put":
            # a put as placement makes it (residents and new keys; the new ones last or
            # anywhere when m is odd: a resident after a new key)
            keys = list(path)
            if m % 2 and len(keys) > 2:
                keys = keys[1:] + keys[:1]
            new = {k for k in keys if k not in fast}
            fast.record_in_order(keys, new)
            slow.record_in_order(keys, new)
        elif op == "touch":
            hits = [k for k in path if k in fast]
            fast.touch_all(reversed(hits))
            slow.touch_all(reversed(hits))
        else:
            protected = set(path[: m + 1])
            assert fast.evict_up_to(m, protected) == slow.evict_up_to(m, protected)
        if step < len(removes):
            fast.remove(removes[step])
            slow.remove(removes[step])
        assert _tree_state(fast) == _tree_state(slow)


def test_leaves_first_lru_among_leaves() -> None:
    p: PrefixTreePolicy[str] = PrefixTreePolicy()
    p.record_in_order(["r", "a", "b"], {"r", "a", "b"})
    p.record_in_order(["r", "c"], {"c"})
    p.touch_all(["b", "a", "r"])  # a lookup of r-a-b: its leaf b is now more recent than c
    assert p.parent_of("b") == "a" and p.parent_of("c") == "r" and p.parent_of("r") is None
    assert p.evict_up_to(2) == ["c", "b"]  # r is never a victim while it has children
    assert p.evict_up_to(9) == ["a", "r"]


@pytest.mark.parametrize("name", KV)
def test_many_protected_keys_at_the_front_are_passed_over(name: str) -> None:
    p: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    for k in range(100):
        p.insert(k)
    assert p.evict_up_to(3, protected=set(range(90))) == [90, 91, 92]
    assert p.evict_up_to(50, protected=set(range(90))) == list(range(93, 100))
    assert p.evict_up_to(5, protected=set(range(100))) == []


def test_orphans_go_first() -> None:
    p: PrefixTreePolicy[str] = PrefixTreePolicy()
    p.record_in_order(["x", "y"], {"x", "y"})
    p.record_in_order(["r", "a", "b"], {"r", "a", "b"})
    p.remove("a")  # deleted: b's prefix is broken
    assert p.parent_of("b") is None
    assert p.evict_up_to(1) == ["b"]  # before y, the least recent leaf


def test_structural_classes() -> None:
    cls, depth = structural_classes(["s", "a", "b"], [False, True, True], 0)
    assert cls[-1] == LAST and depth == 0 and cls[1] == 1  # first turn, short
    cls, depth = structural_classes(["s", "a", "b", "c"], [False, False, False, True], 2)
    assert depth == 3 and cls == [4 + 2, 4 + 2, 4 + 2, LAST]  # added < 4, turn 3+


def test_predictor_learns_that_last_blocks_are_not_reused() -> None:
    pred = ReusePredictor(threshold=0.1, ghost_factor=1.0)
    for k in range(200):
        pred.on_evict(("dead", k), LAST, resident=10)
    for k in range(50):
        pred.on_evict(("back", k), 1, resident=10)
        pred.on_insert(("back", k))  # came back while remembered: reused
    assert pred.probability(LAST) < 0.1 and not pred.predict(LAST)
    assert pred.predict(1)


def test_admission_puts_unpredicted_blocks_cold() -> None:
    p: PrefixTreeAdmitPolicy[tuple[int, int]] = PrefixTreeAdmitPolicy()
    assert p.predictor is not None
    # teach it: last blocks die untouched; the others are hit by the next turn
    for r in range(300):
        chain = [(0, 0)] + [(r, i) for i in range(1, 4)]
        p.record_in_order(chain, set(chain[1:]))
        if r:
            p.touch_all([(r - 1, 2), (r - 1, 1), (0, 0)])
        p.evict_up_to(max(0, len(p) - 20))
    assert not p.predictor.predict(LAST)
    assert p.predictor.predict(1)  # first turns, short: reused
    p.record_in_order([(0, 0), (999, 1), (999, 2)], {(999, 1), (999, 2)})
    assert p.evict_up_to(1) == [(999, 2)]  # newest, yet first out: admitted cold


def test_doorkeeper_admits_on_the_second_sighting() -> None:
    p: EvictionPolicy[str] = make_policy("prefixtree-door")  # type: ignore[assignment]
    p.record_in_order(["old"], {"old"})
    p.record_in_order(["x"], {"x"})
    assert p.evict_up_to(1) == ["x"]  # first sighting: cold
    p.record_in_order(["x"], {"x"})  # seen before: warm, "old" goes first now
    assert p.evict_up_to(1) == ["old"]


def conversations(convs: int = 30, turns: int = 12) -> Trace:
    """Round-robin conversations: each turn is the previous turn's full blocks, two new
    full blocks and a partial last block that the next turn replaces (never reused)."""
    tb = TraceBuilder("conversations", 16)
    ids = itertools.count(1)
    hist = {c: [0] for c in range(convs)}
    for t in range(turns):
        for c in range(convs):
            full = hist[c] + [next(ids), next(ids)]
            tb.add(float(t), 16 * (len(full) + 1), 1, [*full, next(ids)])
            hist[c] = full
    return tb.build()


def learned_on_conversations(name: str, monkeypatch: pytest.MonkeyPatch) -> object:
    """The DRAM policy ``name`` after the round-robin conversations (refreshed every 32
    evictions, to learn within a small trace), having more than twice LRU's hits."""
    monkeypatch.setattr(kvhd_mod, "RECOMPUTE_EVERY", 32)
    trace = conversations()
    hits = {p: int(CacheSim(p, 200).run(trace).present.sum()) for p in ("lru", name)}
    assert hits[name] > 2 * hits["lru"], hits
    sim = CacheSim(name, 200)
    sim.run(trace)
    return sim.policies["dram"]


def test_kvhd_learns_the_dead_last_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    pol = learned_on_conversations("kvhd", monkeypatch)
    assert isinstance(pol, HitDensityPolicy)
    dens = pol.densities()
    assert max(dens[LAST]) == 0.0 < max(max(row) for row in dens.values())


def test_wild_fits_dead_last_blocks_and_evicts_them_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pol = learned_on_conversations("wild", monkeypatch)
    assert isinstance(pol, WorkloadAwarePolicy)
    fits = pol.fits()
    assert fits[LAST][0] == 0.0  # the partial last blocks: never reused
    reused = [c for c, (p, lam, life) in fits.items() if p > 0.0]
    assert reused and all(fits[c][1] > 0.0 and fits[c][2] > 0.0 for c in reused)
    assert all(pol.reuse_probability(LAST, age) == 0.0 for age in (0, 10, 10**6))


@settings(max_examples=200, deadline=None)
@given(
    p=st.floats(0.0, 1.0),
    mean=st.floats(1.0, 1e6),
    means=st.floats(0.5, 8.0),
    ages=st.lists(st.integers(0, 10**8), min_size=2, max_size=8),
)
def test_wild_reuse_probability_is_a_probability_falling_with_age(
    p: float, mean: float, means: float, ages: list[int]
) -> None:
    pol: WorkloadAwarePolicy[int] = WorkloadAwarePolicy()
    pol._p[1], pol._lam[1], pol._life[1] = p, 1.0 / mean, means * mean
    probs = [pol.reuse_probability(1, a) for a in sorted(ages)]
    assert all(0.0 <= q <= p + 1e-12 for q in probs)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(probs))
    assert all(q == 0.0 for a, q in zip(sorted(ages), probs, strict=True) if a >= means * mean)
    assert len(pol.fits()) == N_CLASSES and wild_mod.LIFE_MEANS > 0


def test_admission_beats_lru_when_last_blocks_crowd_the_cache() -> None:
    trace = conversations()
    lru = int(CacheSim("lru", 100).run(trace).present.sum())
    admit = int(CacheSim("prefixtree-admit", 100).run(trace).present.sum())
    assert admit > lru * 1.2, (admit, lru)


@pytest.mark.parametrize("name", KV)
def test_store_and_simulation_agree(name: str) -> None:
    """A real KVStore (its placement engine, real writes and reads) under each policy gives
    exactly the simulated hits, with one tier and with DRAM over disk."""
    trace = synthetic_trace(SyntheticConfig(seed=9, sessions=30))
    for dram, disk in ((trace.n_unique_blocks() // 8, 0), (40, 120)):
        sim = CacheSim(name, dram, disk, class_hints=False).run(trace)
        live = run_live(trace, name, dram, disk)
        for f in ("prefix_dram", "prefix_disk", "present", "new", "dropped"):
            assert np.array_equal(getattr(sim, f), getattr(live, f)), (name, dram, disk, f)
        assert live.counters["chunks_stored"] == int(sim.new.sum())
        assert int(sim.present.sum()) > 0
