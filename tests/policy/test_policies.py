"""Eviction policies: one contract suite for all, tiny scenarios with exact victims, and
hypothesis property tests against independent reference models."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.policy.arc import ARCPolicy
from kvlife.policy.base import (
    BUILTIN_POLICIES,
    EvictionPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from kvlife.policy.lfu import LFUPolicy
from kvlife.policy.lifespan import LifespanPolicy
from kvlife.policy.lru import LRUPolicy
from kvlife.policy.s3fifo import S3FIFOPolicy

ALL = list(BUILTIN_POLICIES)
KV_AWARE = ["prefixtree", "prefixtree-admit", "prefixtree-door", "kvhd", "wild"]
"""The KV-aware policies (tests/policy/test_kvaware.py): the same contract, not in
BUILTIN_POLICIES because they learn from whole prompts (batch calls are not the calls
one by one)."""


def test_registry_knows_every_builtin_and_refuses_duplicates() -> None:
    assert set(ALL) <= set(policy_names())
    for name in ALL:
        assert make_policy(name).name == name
    with pytest.raises(InvalidArgument, match="already registered"):
        register_policy("lru", LRUPolicy)
    with pytest.raises(InvalidArgument, match="unknown eviction policy"):
        make_policy("belady")


@pytest.mark.parametrize("name", ALL + KV_AWARE)
class TestContract:
    def test_insert_touch_remove_len(self, name: str) -> None:
        p: EvictionPolicy[object] = make_policy(name)
        for k in range(5):
            p.insert(k)
        p.insert(2)  # a resident key again: a touch, not a second copy
        p.touch(99)  # unknown keys are ignored
        assert len(p) == 5 and 3 in p and 99 not in p
        p.remove(3)
        p.remove(42)
        assert len(p) == 4 and 3 not in p

    def test_evict_is_atomic_and_skips_protected(self, name: str) -> None:
        p: EvictionPolicy[object] = make_policy(name)
        for k in range(4):
            p.insert(k)
        assert p.evict(4, protected={0}) is None
        assert len(p) == 4  # nothing changed
        got = p.evict(3, protected={0})
        assert got is not None and sorted(got) == [1, 2, 3]  # type: ignore[type-var]
        assert len(p) == 1 and 0 in p
        assert p.evict(0) == []
        with pytest.raises(InvalidArgument):
            p.evict(-1)
        with pytest.raises(InvalidArgument):
            p.evict_up_to(-1)


def test_lru_scenario() -> None:
    p: LRUPolicy[str] = LRUPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    assert p.evict(2) == ["b", "c"]
    assert p.evict(1, protected={"d"}) == ["a"]


def test_lfu_scenario_counts_then_recency() -> None:
    p: LFUPolicy[str] = LFUPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    p.touch("a")
    p.touch("c")
    assert p.count("a") == 3 and p.count("c") == 2
    assert p.evict(1) == ["b"]  # count 1, older than d
    assert p.evict(2) == ["d", "c"]
    p.insert("e")
    assert p.evict(1, protected={"e"}) == ["a"]


def test_s3fifo_scenario_one_hit_wonders_go_first() -> None:
    p: S3FIFOPolicy[str] = S3FIFOPolicy()
    for k in "abcdefghij":
        p.insert(k)
    p.touch("a")  # a was used while in the small queue: it moves to main
    assert p.evict(1) == ["b"]
    assert p.evict(1) == ["c"]
    # a ghost comes back straight into main; scanned keys d.. leave before it and a
    p.insert("b")
    assert p.evict(7) == ["d", "e", "f", "g", "h", "i", "j"]
    assert sorted(p.evict(2) or []) == ["a", "b"]


def test_arc_scenario_frequency_survives_a_scan() -> None:
    p: ARCPolicy[str] = ARCPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("a")  # a is in T2 (seen twice)
    assert p.evict(1) == ["b"]  # T1 is above its target (0)
    p.insert("x")
    assert p.evict(2) == ["c", "d"]
    p.insert("b")  # a ghost hit in B1 grows T1's target and enters T2
    assert p.target_t1 == 1.0
    assert p.evict(1) == ["a"]  # |T1| = 1 is not above the target: T2's least recent
    assert p.evict(2) == ["b", "x"]


def test_lifespan_scenario_evicts_the_overstayed_class() -> None:
    p: LifespanPolicy[str] = LifespanPolicy()
    # class 1 objects are reused quickly; class 2 objects are never reused
    for i in range(5):
        p.insert_classed(f"hot{i}", 1)
        p.touch(f"hot{i}")
    p.insert_classed("cold", 2)
    for i in range(5):
        p.touch(f"hot{i}")
    # "cold" is more recent than hot0, but its class is never reused: it goes first
    assert p.evict(1) == ["cold"]
    assert p.evict(1) == ["hot0"]
    q: LifespanPolicy[str] = LifespanPolicy()
    for k in "abc":
        q.insert(k)  # no hints: one class, plain LRU
    q.touch("a")
    assert q.evict(2) == ["b", "c"]


# -- property tests against reference models -------------------------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "remove", "evict"]), st.integers(0, 12)),
    max_size=80,
)


class RefLRU:
    """A list, most recent last."""

    def __init__(self) -> None:
        self.keys: list[int] = []

    def insert(self, k: int) -> None:
        if k in self.keys:
            self.keys.remove(k)
        self.keys.append(k)

    def touch(self, k: int) -> None:
        if k in self.keys:
            self.insert(k)

    def remove(self, k: int) -> None:
        if k in self.keys:
            self.keys.remove(k)

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        victims = [k for k in self.keys if k not in protected][:n]
        if len(victims) < n:
            return None
        for v in victims:
            self.keys.remove(v)
        return victims


class RefLFU:
    """Counts and a logical clock; the victim minimises (count, last use)."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.clock = 0

    def insert(self, k: int) -> None:
        if k in self.count:
            self.touch(k)
            return
        self.clock += 1
        self.count[k], self.last[k] = 1, self.clock

    def touch(self, k: int) -> None:
        if k in self.count:
            self.clock += 1
            self.count[k] += 1
            self.last[k] = self.clock

    def remove(self, k: int) -> None:
        self.count.pop(k, None)
        self.last.pop(k, None)

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        cands = sorted((k for k in self.count if k not in protected),
                       key=lambda k: (self.count[k], self.last[k]))  # fmt: skip
        if len(cands) < n:
            return None
        for v in cands[:n]:
            self.remove(v)
        return cands[:n]


def _drive(policy: EvictionPolicy[int], ref: RefLRU | RefLFU, ops: list[tuple[str, int]]) -> None:
    for op, k in ops:
        if op == "evict":
            n, protected = k % 3, {k, k + 1}
            assert policy.evict(n, protected) == ref.evict(n, protected)
        else:
            getattr(policy, op)(k)
            getattr(ref, op)(k)
        assert len(policy) == len(ref.keys if isinstance(ref, RefLRU) else ref.count)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_lru_matches_list_model(ops: list[tuple[str, int]]) -> None:
    _drive(LRUPolicy(), RefLRU(), ops)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_lifespan_without_hints_matches_lru_model(ops: list[tuple[str, int]]) -> None:
    _drive(LifespanPolicy(), RefLRU(), ops)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_lfu_matches_count_model(ops: list[tuple[str, int]]) -> None:
    _drive(LFUPolicy(), RefLFU(), ops)


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_adaptive_policies_keep_an_exact_resident_set(
    name: str, ops: list[tuple[str, int]]
) -> None:
    """No reference model is simple enough; check the resident set against a plain set."""
    p: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    resident: set[int] = set()
    for op, k in ops:
        if op == "evict":
            n, protected = k % 3, {k, k + 1}
            got = p.evict(n, protected)
            if len(resident - protected) < n:
                assert got is None
            else:
                assert got is not None and len(set(got)) == n
                assert not set(got) & protected and set(got) <= resident
                resident -= set(got)
        elif op == "insert":
            p.insert(k)
            resident.add(k)
        elif op == "touch":
            p.touch(k)
        else:
            p.remove(k)
            resident.discard(k)
        assert len(p) == len(resident) and all(x in p for x in resident)


def test_lru_replays_like_an_ordered_dict() -> None:
    """A longer random sequence with a capacity, checked against OrderedDict."""
    import random

    rnd = random.Random(7)
    p: LRUPolicy[int] = LRUPolicy()
    ref: OrderedDict[int, None] = OrderedDict()
    for _ in range(5000):
        k = int(rnd.paretovariate(1.2)) % 300
        if k in p:
            p.touch(k)
            ref.move_to_end(k)
        else:
            if len(p) >= 50:
                assert p.evict(1) == [ref.popitem(last=False)[0]]
            p.insert(k)
            ref[k] = None
    assert len(p) == len(ref) and all(k in p for k in ref)
    assert p.evict(len(ref)) == list(ref)
