"""Least-frequently-used eviction (ties: least recently used first).

Semantics: a key's count is 1 when inserted and grows by one per touch (inserting a
resident key counts as a touch); counts are forgotten when a key leaves. ``evict`` takes
keys of the lowest count first and, within a count, the least recently used one,
skipping protected keys. O(1) per touch: one insertion-ordered dict per count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, register_policy

K = TypeVar("K", bound=Hashable)


class LFUPolicy(EvictionPolicy[K]):
    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[K, int] = {}
        # OrderedDicts: evicting from the front of a plain dict leaves deleted slots that
        # every later "first key" lookup walks over (O(n) after many evictions)
        self._buckets: dict[int, OrderedDict[K, None]] = {}
        self._min: int | None = None
        """The lowest count with keys, or None when it must be recomputed."""

    def insert(self, key: K) -> None:
        if key in self._count:
            self.touch(key)
            return
        self._count[key] = 1
        self._min = 1
        bucket = self._buckets.get(1)
        if bucket is None:
            self._buckets[1] = OrderedDict({key: None})
        else:
            bucket[key] = None

    def touch(self, key: K) -> None:
        c = self._count.get(key)
        if c is None:
            return
        bucket = self._buckets[c]
        del bucket[key]
        if not bucket:
            del self._buckets[c]
            if self._min == c:
                self._min = c + 1
        c += 1
        self._count[key] = c
        nxt = self._buckets.get(c)
        if nxt is None:
            self._buckets[c] = OrderedDict({key: None})
        else:
            nxt[key] = None

    def remove(self, key: K) -> None:
        c = self._count.pop(key, None)
        if c is not None:
            bucket = self._buckets[c]
            del bucket[key]
            if not bucket:
                del self._buckets[c]
                if self._min == c:
                    self._min = None

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        if n == 0:
            return victims
        if n == 1:
            key = self._evict_one(protected)
            return None if key is None else [key]
        for c in sorted(self._buckets):
            for key in self._buckets[c]:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == n:
                        break
            if len(victims) == n:
                break
        if len(victims) < n:
            return None
        for key in victims:
            self.remove(key)
        return victims

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        # evict(1) n times: _evict_one and remove written out (one call, not two per
        # victim)
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        count, buckets, low = self._count, self._buckets, self._min
        for _ in range(n):
            if not buckets:
                break
            if low is None:
                low = min(buckets)
            c = low
            for key in buckets[c]:
                if key not in protected:
                    break
            else:  # every key of the lowest count is protected: the next counts
                for c in sorted(buckets):
                    for key in buckets[c]:
                        if key not in protected:
                            break
                    else:
                        continue
                    break
                else:
                    break  # every key is protected
            # remove(key), written out
            del count[key]
            bucket = buckets[c]
            del bucket[key]
            if not bucket:
                del buckets[c]
                if low == c:
                    low = None
            victims.append(key)
        self._min = low
        return victims

    def touch_all(self, keys: Iterable[K]) -> None:
        # touch, written out
        count, buckets, low = self._count, self._buckets, self._min
        for key in keys:
            c = count.get(key)
            if c is None:
                continue
            bucket = buckets[c]
            del bucket[key]
            if not bucket:
                del buckets[c]
                if low == c:
                    low = c + 1
            c += 1
            count[key] = c
            nxt = buckets.get(c)
            if nxt is None:
                buckets[c] = OrderedDict({key: None})
            else:
                nxt[key] = None
        self._min = low

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        # insert and touch, written out: a key in new not yet resident gets count 1 (a
        # second place in keys finds it resident: a touch), a resident gains one
        count, buckets, low = self._count, self._buckets, self._min
        for key in keys:
            c = count.get(key)
            if c is None:
                if key in new:
                    count[key] = 1
                    low = 1
                    one = buckets.get(1)
                    if one is None:
                        buckets[1] = OrderedDict({key: None})
                    else:
                        one[key] = None
                continue
            bucket = buckets[c]
            del bucket[key]
            if not bucket:
                del buckets[c]
                if low == c:
                    low = c + 1
            c += 1
            count[key] = c
            nxt = buckets.get(c)
            if nxt is None:
                buckets[c] = OrderedDict({key: None})
            else:
                nxt[key] = None
        self._min = low

    def _evict_one(self, protected: Collection[K]) -> K | None:
        """Forget and return the unprotected key of the lowest count, least recent first."""
        if not self._buckets:
            return None
        if self._min is None:
            self._min = min(self._buckets)
        for key in self._buckets[self._min]:
            if key not in protected:
                self.remove(key)
                return key
        for c in sorted(self._buckets):  # every key of the lowest count is protected
            for key in self._buckets[c]:
                if key not in protected:
                    self.remove(key)
                    return key
        return None

    def count(self, key: K) -> int:
        """The key's use count (0 if not resident)."""
        return self._count.get(key, 0)

    @property
    def members(self) -> Collection[object]:
        return self._count

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def __len__(self) -> int:
        return len(self._count)


register_policy("lfu", LFUPolicy)
