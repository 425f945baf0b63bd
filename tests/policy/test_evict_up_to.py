"""``evict_up_to(n)``, the call placement takes its victims with, chooses and forgets
exactly what ``n`` calls of ``evict(1)`` would, for every policy (LRU overrides it with a
single scan; the others use the base class's loop)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import BUILTIN_POLICIES, EvictionPolicy, SupportsClassHints, make_policy

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
