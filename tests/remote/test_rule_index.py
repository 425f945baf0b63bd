"""The rules a host holds, filed by criterion (:mod:`kvlife.globalindex.rule_index`):
for any rules and any object, :meth:`RuleIndex.covering` finds a covering rule exactly
when a scan of every rule newer than the object does (hypothesis), whatever order the
rules came in, with rules replaced, and after a clear."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.identity import ChunkKey
from kvlife.core.objects import ObjectInfo
from kvlife.core.sources import Source
from kvlife.globalindex.rule_index import RuleIndex
from kvlife.globalindex.rules import InvalidationRule

KEYS = [bytes([i]) * 32 for i in range(6)]
NAMESPACES = ["user:a", "user:b", "organisation:c"]
WEIGHTS = ["w1", "w2"]
ADAPTERS = ["", "lora1"]
MODELS = ["", "m1", "m2"]
SOURCES = ["doc", "sys"]


@st.composite
def rules(draw: st.DrawFn, epoch: int) -> InvalidationRule:
    if draw(st.integers(0, 15)) == 0:
        return InvalidationRule(epoch, everything=True, reason="unreadable")
    crit: dict[str, object] = {}
    while not crit:
        if draw(st.booleans()):
            crit["namespace"] = draw(st.sampled_from(NAMESPACES))
        if draw(st.integers(0, 3)) == 0:
            crit["weights_digest"] = draw(st.sampled_from(WEIGHTS))
        if draw(st.integers(0, 3)) == 0:
            crit["adapter_id"] = draw(st.sampled_from(ADAPTERS))
        if draw(st.integers(0, 3)) == 0:
            crit["model"] = draw(st.sampled_from(MODELS))
            if draw(st.booleans()):
                crit["keep_weights_digest"] = draw(st.sampled_from(WEIGHTS))
        if draw(st.integers(0, 3)) == 0:
            crit["source"] = draw(st.sampled_from(SOURCES))
            if draw(st.booleans()):
                lo = draw(st.integers(0, 3))
                crit["versions"] = (lo, lo + draw(st.integers(1, 3)))
        if draw(st.integers(0, 2)) == 0:
            crit["prefix"] = draw(st.sampled_from(KEYS))
    return InvalidationRule(epoch, **crit)  # type: ignore[arg-type]


@st.composite
def objects(draw: st.DrawFn) -> tuple[int, bytes, ObjectInfo, tuple[bytes, ...]]:
    sources = draw(
        st.lists(st.builds(Source, st.sampled_from(SOURCES), st.integers(0, 5)), max_size=2)
    )
    info = ObjectInfo(
        b"i" * 32,
        draw(st.sampled_from(WEIGHTS)),
        draw(st.sampled_from(ADAPTERS)),
        draw(st.sampled_from(NAMESPACES)),
        ChunkKey(draw(st.sampled_from(KEYS))),
        0,
        16,
        draw(st.sampled_from(MODELS)),
        tuple(sources),
    )
    lineage = tuple(draw(st.lists(st.sampled_from(KEYS), max_size=8)))
    return draw(st.integers(-1, 40)), draw(st.sampled_from(KEYS)), info, lineage


def _scan(
    held: dict[int, InvalidationRule], obj: tuple[int, bytes, ObjectInfo, tuple[bytes, ...]]
) -> bool:
    epoch, key, info, lineage = obj
    return any(r.matches(key, info, lineage) for e, r in held.items() if e > max(0, epoch))


@settings(max_examples=300, deadline=None)
@given(
    st.data(),
    st.permutations(list(range(1, 31))),
    st.lists(objects(), min_size=1, max_size=12),
)
def test_covering_finds_a_rule_exactly_when_a_scan_of_every_newer_rule_does(
    data: st.DataObject,
    order: list[int],
    objs: list[tuple[int, bytes, ObjectInfo, tuple[bytes, ...]]],
) -> None:
    n = data.draw(st.integers(0, 30))
    index = RuleIndex()
    held: dict[int, InvalidationRule] = {}
    for epoch in order[:n]:  # in any order, as a refresh and a host's own rules land
        rule = data.draw(rules(epoch))
        index.add(rule)
        held[epoch] = rule
        if data.draw(st.integers(0, 5)) == 0:  # the same epoch again: replaced
            again = data.draw(rules(epoch))
            index.add(again)
            held[epoch] = again
    assert len(index) == len(held)
    assert index.top == max(held, default=0)
    for obj in objs:
        found = index.covering(*obj)
        assert (found is not None) == _scan(held, obj), (obj, held)
        if found is not None:
            assert found.epoch > max(0, obj[0]) and found.matches(obj[1], obj[2], obj[3])
    index.clear()
    assert len(index) == 0 and index.top == 0
    assert all(index.covering(*obj) is None for obj in objs)


def test_a_prefix_rule_covers_the_run_after_its_chunk_found_either_way() -> None:
    """Few prefix rules are looked for in the run; many are looked up by its keys."""
    run = tuple(bytes([i]) * 32 for i in range(10))
    info = ObjectInfo(b"i" * 32, "w1", "", "user:a", ChunkKey(run[-1]), 0, 16)
    for extra in (0, 40):  # more prefixes than the run has keys: the other way round
        index = RuleIndex()
        for e in range(1, extra + 1):
            index.add(InvalidationRule(e, prefix=bytes([100 + e]) * 32))
        index.add(InvalidationRule(extra + 1, prefix=run[3]))
        assert index.covering(0, b"\xff" * 32, info, run) is not None
        assert index.covering(0, b"\xff" * 32, info, run[:3]) is None
        assert index.covering(extra + 1, b"\xff" * 32, info, run) is None  # not newer


def test_checking_an_old_record_costs_the_rules_that_could_cover_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten thousand rules of other tenants: an old record of a tenant with none is
    checked against none of them (a scan matched every one: 128 records, 1.28 million
    matches)."""
    index = RuleIndex()
    for e in range(1, 10_001):
        index.add(InvalidationRule(e, namespace=f"organisation:t{e}"))
    info = ObjectInfo(b"i" * 32, "w1", "", "user:a", ChunkKey(KEYS[0]), 0, 16)
    calls = 0
    real = InvalidationRule.matches

    def counted(self: InvalidationRule, key: bytes, o: ObjectInfo, lin: tuple[bytes, ...]) -> bool:
        nonlocal calls
        calls += 1
        return real(self, key, o, lin)

    monkeypatch.setattr(InvalidationRule, "matches", counted)
    for _ in range(128):
        assert index.covering(0, KEYS[1], info, ()) is None
    assert calls == 0
    index.add(InvalidationRule(10_001, namespace="user:a"))
    assert index.covering(0, KEYS[1], info, ()) is not None
    assert calls == 1
