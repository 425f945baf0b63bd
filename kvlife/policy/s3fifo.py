"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small queue S (10% of the cache), a main queue M and a ghost queue
G of recently evicted keys (no data, as many entries as M). A new key enters S, or M if
it is in G. A touch raises the key's frequency (capped at 3). To evict: if S holds at
least 10% of the resident keys, S's oldest key moves to M if it was touched while in S,
else it is evicted (and remembered in G); otherwise M's oldest key is reinserted at M's
head with frequency - 1 if its frequency is > 0, else evicted. Quick demotion of one-hit
keys makes it scan-resistant.

The store does not tell a policy its capacity, so the cache size used for the 10% and
the ghost length is the largest number of resident keys seen (a full cache's size).
Protected keys are never evicted: one found at S's tail moves to M, one at M's tail is
passed over (back to M's head, frequency kept); after a full turn of M, S is used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, register_policy

K = TypeVar("K", bound=Hashable)

SMALL_FRACTION = 0.1
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy[K]):
    name = "s3fifo"

    def __init__(self) -> None:
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}
        self._peak = 0
        self._ghost_limit = 1
        """Ghost entries kept: the main queue's share of the peak size."""

    def insert(self, key: K) -> None:
        freq = self._freq
        if key in freq:
            self.touch(key)
            return
        freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        size = len(freq)
        if size > self._peak:
            self._peak = size
            self._ghost_limit = max(1, size - int(size * SMALL_FRACTION))

    def touch(self, key: K) -> None:
        f = self._freq.get(key)
        if f is not None and f < MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: K) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def _remember(self, key: K) -> None:
        ghost = self._ghost
        ghost[key] = None
        if len(ghost) > self._ghost_limit:
            ghost.popitem(last=False)  # one in, one out: the limit only grows

    def _evict_one(self, protected: Collection[K]) -> K:
        small, main, freq = self._small, self._main, self._freq
        spins = 0  # protected keys passed over in M; past len(M), look in S instead
        while True:
            if small and (
                len(small) >= self._peak * SMALL_FRACTION or not main or spins > len(main)
            ):
                key, _ = small.popitem(last=False)
                if freq[key] > 0 or key in protected:
                    freq[key] = 0
                    main[key] = None
                    continue
                del freq[key]
                ghost = self._ghost  # _remember, inlined: once per victim
                ghost[key] = None
                if len(ghost) > self._ghost_limit:
                    ghost.popitem(last=False)
                return key
            key, _ = main.popitem(last=False)
            main[key] = None  # back at the head unless it is the victim
            if key in protected:
                spins += 1
                continue
            f = freq[key]
            if f > 0:
                freq[key] = f - 1
                continue
            del main[key]
            del freq[key]
            return key

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        size = len(self._freq)
        # when size - n >= len(protected) it is feasible whatever the protected keys are
        if size - n < len(protected) and size - sum(1 for k in protected if k in self._freq) < n:
            return None
        if n == 1:
            return [self._evict_one(protected)]
        return [self._evict_one(protected) for _ in range(n)]

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        # evict(1) n times, without building a list per victim
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        freq = self._freq
        if len(freq) - n >= len(protected):
            # each victim takes one key: every one of the n checks passes on its own
            return [self._evict_one(protected) for _ in range(n)]
        victims: list[K] = []
        for _ in range(n):
            size = len(freq)
            if size - 1 < len(protected) and size - sum(1 for k in protected if k in freq) < 1:
                break
            victims.append(self._evict_one(protected))
        return victims

    def touch_all(self, keys: Iterable[K]) -> None:
        # touch, inlined
        freq = self._freq
        for key in keys:
            f = freq.get(key)
            if f is not None and f < MAX_FREQ:
                freq[key] = f + 1

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        # insert and touch, inlined: a resident gains one (capped) either way, a new key
        # enters S (or M from the ghost), anything else is ignored as touch ignores it
        freq, ghost = self._freq, self._ghost
        for key in keys:
            f = freq.get(key)
            if f is not None:
                if f < MAX_FREQ:
                    freq[key] = f + 1
            elif key in new:
                freq[key] = 0
                if key in ghost:
                    del ghost[key]
                    self._main[key] = None
                else:
                    self._small[key] = None
                size = len(freq)
                if size > self._peak:
                    self._peak = size
                    self._ghost_limit = max(1, size - int(size * SMALL_FRACTION))

    @property
    def members(self) -> Collection[object]:
        return self._freq

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)


register_policy("s3fifo", S3FIFOPolicy)
