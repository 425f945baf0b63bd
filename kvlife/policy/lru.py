"""Least-recently-used eviction.

Semantics: ``insert`` and ``touch`` make a key the most recent; ``evict`` takes the least
recent keys, skipping protected ones.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Hashable, Iterable, Sequence
from itertools import filterfalse, islice, repeat
from typing import TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, register_policy

K = TypeVar("K", bound=Hashable)


class LRUPolicy(EvictionPolicy[K]):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        for key in self._order:
            if len(victims) == n:
                break
            if key not in protected:
                victims.append(key)
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        # one evict(1) takes the least recent unprotected key: n of them take the first n
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        order = self._order
        if not n:
            return []
        # the first n unprotected keys, found and forgotten in C loops
        victims = list(islice(filterfalse(protected.__contains__, order), n))
        deque(map(order.pop, victims), maxlen=0)
        return victims

    def touch_all(self, keys: Iterable[K]) -> None:
        # the residents among keys, each made the most recent in turn (loops in C)
        order = self._order
        deque(map(order.move_to_end, filter(order.__contains__, keys)), maxlen=0)

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        # insert and touch both make a key the most recent, so afterwards the keys are
        # the most recent in the order of their last places in ``keys``
        order = self._order
        head = len(keys) - len(new)
        if (
            head >= 0
            and not any(map(new.__contains__, islice(keys, head)))
            and not any(map(order.__contains__, islice(keys, head, None)))
        ):
            # the usual put: residents first, then its new keys (the last len(new) keys,
            # all of new since new is in keys, none resident): move the residents, then
            # append the new keys
            deque(map(order.move_to_end, islice(keys, head)), maxlen=0)
            order.update(zip(islice(keys, head, None), repeat(None)))
            return
        # add the new keys (the others are residents already, left where they are), then
        # move each key to the end in turn
        order.update(zip(new, repeat(None)))
        deque(map(order.move_to_end, keys), maxlen=0)

    def record_tail(self, keys: Sequence[K], head: int) -> None:
        # record_in_order's usual put without its checks: move the residents in order,
        # then append the new keys (none resident, so appended in order)
        order = self._order
        if head:
            deque(map(order.move_to_end, islice(keys, head)), maxlen=0)
        order.update(zip(islice(keys, head, None), repeat(None)))

    @property
    def members(self) -> Collection[object]:
        return self._order

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


register_policy("lru", LRUPolicy)
