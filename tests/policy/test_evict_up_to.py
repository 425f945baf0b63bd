"""``evict_up_to(n)``, the call placement takes its victims with, chooses and forgets
exactly what ``n`` calls of ``evict(1)`` would, for every policy (LRU overrides it with a
single scan; the others use the base class's loop)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import (
    BUILTIN_POLICIES,
    EvictionPolicy,
    SupportsClassHints,
    make_policy,
    policy_names,
)

OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "classed", "touch", "remove", "evict"]),
              st.integers(0, 14), st.integers(0, 6)),
    max_size=160,
)  # fmt: skip


def _one_at_a_time(p: EvictionPolicy[int], n: int, protected: set[int]) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        got = p.evict(1, protected)
        if not got:
            break
        out += got
    return out


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
@settings(max_examples=120, deadline=None)
@given(ops=OPS)
def test_evict_up_to_equals_evict_one_at_a_time(name: str, ops: list[tuple[str, int, int]]) -> None:
    batch: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    single: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    for op, k, m in ops:
        if op == "evict":
            protected = set(range(k, k + m % 4))
            assert batch.evict_up_to(m, protected) == _one_at_a_time(single, m, protected)
        elif op == "classed":
            for p in (batch, single):
                if isinstance(p, SupportsClassHints):
                    p.insert_classed(k, m % 3)
                else:
                    p.insert(k)
        else:
            getattr(batch, op)(k)
            getattr(single, op)(k)
        assert len(batch) == len(single)
    # the same state: both give up the same victims, in the same order, to the end
    assert batch.evict_up_to(len(batch) + 1) == _one_at_a_time(single, len(single) + 1, set())
    assert len(batch) == 0


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
def test_evict_up_to_takes_what_is_left_and_refuses_a_negative_count(name: str) -> None:
    p: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    for k in range(5):
        p.insert(k)
    assert p.evict_up_to(0) == []
    got = p.evict_up_to(9, protected={0, 1})
    assert sorted(got) == [2, 3, 4] and len(p) == 2
    with pytest.raises(InvalidArgument, match="negative"):
        p.evict_up_to(-1)


BATCH = st.lists(st.tuples(st.sampled_from(["touch_all", "record", "evict"]),
                           st.lists(st.integers(0, 14), max_size=12), st.integers(0, 5)),
                 max_size=60)  # fmt: skip


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
@settings(max_examples=120, deadline=None)
@given(ops=BATCH)
def test_batch_calls_equal_the_calls_one_by_one(
    name: str, ops: list[tuple[str, list[int], int]]
) -> None:
    """``touch_all`` and ``record_in_order`` (a lookup's hits, a put's chunks in prompt
    order: placement's one-tier paths) leave a policy as the calls one by one would."""
    batch: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    single: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    for op, keys, m in ops:
        if op == "touch_all":  # absent keys are ignored, as touch ignores them
            batch.touch_all(iter(keys))
            for k in keys:
                single.touch(k)
        elif op == "record":
            # a put: its new keys are not residents; the others are (the precondition)
            keys = list(dict.fromkeys(keys))
            new = {k for k in keys if k not in single}
            batch.record_in_order(keys, new)
            for k in keys:
                single.insert(k) if k in new else single.touch(k)
        else:
            assert batch.evict_up_to(m) == _one_at_a_time(single, m, set())
        assert len(batch) == len(single)
    assert batch.evict_up_to(len(batch) + 1) == _one_at_a_time(single, len(single) + 1, set())


TAIL = st.lists(st.tuples(st.sampled_from(["put", "touch_all", "evict"]),
                          st.lists(st.integers(0, 20), max_size=12), st.integers(0, 6)),
                max_size=60)  # fmt: skip


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=80, deadline=None)
@given(ops=TAIL)
def test_record_tail_equals_record_in_order(
    name: str, ops: list[tuple[str, list[int], int]]
) -> None:
    """``record_tail(keys, head)``, the usual put placement knows from its lookup
    (residents ``keys[:head]``, then new keys), leaves every policy, the KV-aware ones
    included, as ``record_in_order(keys, keys[head:])`` does."""
    tail: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    full: EvictionPolicy[int] = make_policy(name)  # type: ignore[assignment]
    for op, keys, m in ops:
        if op == "put":
            keys = list(dict.fromkeys(keys))
            held = [k for k in keys if k in full][:m]  # some residents, in the given order
            new = [k for k in keys if k not in full]
            tail.record_tail([*held, *new], len(held))
            full.record_in_order([*held, *new], set(new))
        elif op == "touch_all":
            tail.touch_all(iter(keys))
            full.touch_all(iter(keys))
        else:
            protected = set(keys)
            assert tail.evict_up_to(m, protected) == full.evict_up_to(m, protected)
        assert len(tail) == len(full)
    assert tail.evict_up_to(len(tail) + 1) == full.evict_up_to(len(full) + 1)
