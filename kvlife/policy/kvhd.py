"""``kvhd``: KV hit density, a learned ranking over the prefix tree's leaves.

LHD (Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density",
NSDI'18) evicts the object with the least expected hits per unit of the space-time it
will still take, learned online from the ages at which objects of its class were hit or
evicted. Here the classes are the KV structure a put reveals (:mod:`kvlife.policy.reuse`:
last block of a prompt, first turn by length, continuation by blocks added and turn
depth, reused) and age is counted in blocks inserted since the last touch (no clock).

Each class keeps its residents in LRU order, so within a class the oldest is the first
candidate; the victim is the candidate (an unprotected leaf: the prefix-tree rules of
:mod:`kvlife.policy.prefixtree` hold) whose class and age bucket have the least learned
density. Densities are recomputed every 2048 evictions from decayed histograms; until
then, and between classes of equal density, the oldest goes first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import TypeVar

from kvlife.policy.base import register_policy
from kvlife.policy.prefixtree import PrefixTreePolicy
from kvlife.policy.reuse import N_CLASSES, REUSED, UNKNOWN, structural_classes

K = TypeVar("K", bound=Hashable)

N_BUCKETS = 64
RECOMPUTE_EVERY = 2048
DECAY = 0.9
SCAN = 8
"""Keys a class queue is scanned for an unprotected leaf before it is passed over."""


class HitDensityPolicy(PrefixTreePolicy[K]):
    """Least learned hit density among the prefix tree's leaves (module docstring)."""

    name = "kvhd"

    def __init__(self) -> None:
        super().__init__()
        self._cq: list[OrderedDict[K, int]] = [OrderedDict() for _ in range(N_CLASSES)]
        """Per class: resident key -> the clock at its last touch (LRU order)."""
        self._kc: dict[K, int] = {}
        self._clock = 0
        self._shift = 0
        self._hits = [[0.0] * N_BUCKETS for _ in range(N_CLASSES)]
        self._ends = [[0.0] * N_BUCKETS for _ in range(N_CLASSES)]
        self._density = [[0.0] * N_BUCKETS for _ in range(N_CLASSES)]
        self._evictions = 0

    def _bucket(self, age: int) -> int:
        b = age >> self._shift
        return b if b < N_BUCKETS else N_BUCKETS - 1

    def _place(self, key: K, cls: int) -> None:
        self._kc[key] = cls
        self._cq[cls][key] = self._clock

    def _hit(self, key: K) -> None:
        cls = self._kc[key]
        stamp = self._cq[cls].pop(key)
        self._hits[cls][self._bucket(self._clock - stamp)] += 1.0
        self._place(key, REUSED)

    def insert(self, key: K) -> None:
        if key in self._order:
            self.touch(key)
            return
        super().insert(key)
        self._clock += 1
        self._place(key, UNKNOWN)

    def touch(self, key: K) -> None:
        if key in self._kc:
            super().touch(key)
            self._hit(key)

    def touch_all(self, keys: Iterable[K]) -> None:
        # one by one: each touch moves the key in its class queue too
        touch = self.touch
        for key in keys:
            touch(key)

    def remove(self, key: K) -> None:
        cls = self._kc.pop(key, None)
        if cls is not None:
            del self._cq[cls][key]
        super().remove(key)

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        flags = [key in new and key not in self._kc for key in keys]
        hit = 0
        while hit < len(keys) and not flags[hit]:
            hit += 1
        d_hit = self._depth.get(keys[hit - 1], 0) if hit > 1 else 0
        classes, depth = structural_classes(keys, flags, d_hit)
        super().record_in_order(keys, new)  # the tree and the LRU order
        self._clock += sum(flags)
        place, depths = self._place, self._depth
        # last to first, as the LRU order: a parent is younger than its children
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if flags[i]:
                depths[key] = depth
                place(key, classes[i])
            elif key in self._kc:
                self._hit(key)

    def record_tail(self, keys: Sequence[K], head: int) -> None:
        # the classes are learned in record_in_order: the tree's written-out usual put
        # (PrefixTreePolicy.record_tail) would skip them
        self.record_in_order(keys, set(keys[head:]))

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        return self._evict_one_by_one(n, protected)

    def _victim(self, protected: Collection[K]) -> K | None:
        kids = self._kids
        for key in self._orphans:
            if key not in protected and key not in kids:
                return key
        best: K | None = None
        best_score = (0.0, 0)
        clock, rank = self._clock, self._rank
        for cls, queue in enumerate(self._cq):
            if not queue:
                continue
            for scanned, (key, stamp) in enumerate(queue.items(), 1):
                if key not in protected and key not in kids:
                    score = (rank(cls, clock - stamp), stamp)
                    if best is None or score < best_score:
                        best, best_score = key, score
                    break
                if scanned == SCAN:
                    break
        if best is None:  # every queue's head is busy: any evictable leaf
            return super()._victim(protected)
        return best

    def _rank(self, cls: int, age: int) -> float:
        """What the victim has least of (the oldest first on a tie): the learned hit
        density of the class at that age."""
        b = age >> self._shift
        return self._density[cls][b if b < N_BUCKETS else N_BUCKETS - 1]

    def _drop(self, key: K) -> None:
        cls = self._kc.pop(key)
        stamp = self._cq[cls].pop(key)
        self._ends[cls][self._bucket(self._clock - stamp)] += 1.0
        super()._drop(key)
        self._evictions += 1
        if self._evictions % RECOMPUTE_EVERY == 0:
            self._recompute()

    def _recompute(self) -> None:
        """Densities from the histograms (LHD's), then decay them; rescale ages to the
        cache (8 resident counts span the buckets)."""
        for cls in range(N_CLASSES):
            hits, ends, dens = self._hits[cls], self._ends[cls], self._density[cls]
            hits_above = events_above = life = 0.0
            for j in range(N_BUCKETS - 1, -1, -1):
                hits_above += hits[j]
                events_above += hits[j] + ends[j]
                life += events_above
                dens[j] = hits_above / life if life > 0 else 0.0
                hits[j] *= DECAY
                ends[j] *= DECAY
        shift = max(0, (8 * len(self._order) // N_BUCKETS).bit_length())
        if shift != self._shift:
            self._shift = shift
            for table in (self._hits, self._ends):
                for row in table:
                    row[:] = [0.0] * N_BUCKETS

    def densities(self) -> dict[int, list[float]]:
        """The learned density per class and age bucket (for reports)."""
        return {c: list(row) for c, row in enumerate(self._density)}


register_policy("kvhd", HitDensityPolicy)
