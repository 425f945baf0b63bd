"""Lifespan-aware eviction: evict the object that has most outlived its class's reuse time.

Objects carry a class (a small integer hint from the workload, see
:class:`~kvlife.policy.base.SupportsClassHints`; the replay engine uses the request
category and the block's position bucket: a shared system-prompt head lives long, the tail
of a one-shot prompt dies at once). Per class the policy learns, online:

- ``interval[c]``: an exponentially weighted mean (weight 1/16) of the time between
  consecutive uses of an object, in policy operations (inserts + touches);
- ``reuse[c]``: touches per insert, the chance an object of the class is used again.

Each class keeps its objects in LRU order. ``evict`` compares the least recent object of
each class and takes the one with the largest ``age / (interval[c] * (0.01 + reuse[c]))``,
where ``age`` is the operations since its last use: an object idle for many times its
class's usual reuse interval, in a class whose objects are rarely reused, is unlikely to
be used again. With a single class (no hints) this is exactly LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, SupportsClassHints, register_policy

K = TypeVar("K", bound=Hashable)

EWMA_WEIGHT = 1.0 / 16.0


class LifespanPolicy(EvictionPolicy[K], SupportsClassHints[K]):
    name = "lifespan"

    def __init__(self) -> None:
        self._clock = 0
        self._cls: dict[K, int] = {}
        self._last: dict[K, int] = {}
        self._lru: dict[int, OrderedDict[K, None]] = {}
        self._interval: dict[int, float] = {}
        self._inserts: dict[int, int] = {}
        self._touches: dict[int, int] = {}

    def insert(self, key: K) -> None:
        self.insert_classed(key, 0)

    def insert_classed(self, key: K, cls: int) -> None:
        if key in self._cls:
            self.touch(key)
            return
        self._clock += 1
        self._cls[key] = cls
        self._last[key] = self._clock
        lru = self._lru.get(cls)
        if lru is None:
            lru = self._lru[cls] = OrderedDict()
            self._inserts[cls] = 0
            self._touches[cls] = 0
        lru[key] = None
        self._inserts[cls] += 1

    def touch(self, key: K) -> None:
        cls = self._cls.get(key)
        if cls is None:
            return
        self._clock += 1
        gap = self._clock - self._last[key]
        self._last[key] = self._clock
        old = self._interval.get(cls)
        self._interval[cls] = gap if old is None else old + EWMA_WEIGHT * (gap - old)
        self._touches[cls] += 1
        self._lru[cls].move_to_end(key)

    def remove(self, key: K) -> None:
        cls = self._cls.pop(key, None)
        if cls is not None:
            del self._last[key]
            del self._lru[cls][key]

    def score(self, key: K) -> float:
        """How far ``key`` has outlived its class (larger: evicted sooner)."""
        cls = self._cls[key]
        age = self._clock - self._last[key]
        reuse = self._touches[cls] / max(1, self._inserts[cls])
        return age / (self._interval.get(cls, 1.0) * (0.01 + reuse))

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        size = len(self._cls)
        # when size - n >= len(protected) it is feasible whatever the protected keys are
        if size - n < len(protected) and size - sum(1 for k in protected if k in self._cls) < n:
            return None
        victims: list[K] = []
        skip: set[K] = set()
        clock, last = self._clock, self._last
        interval, touches, inserts = self._interval, self._touches, self._inserts
        for _ in range(n):
            best: K | None = None
            best_score = -1.0
            for cls, lru in self._lru.items():
                for key in lru:
                    if key in protected or key in skip:
                        continue
                    # score(key), inlined: this loop is the policy's hot path
                    ins = inserts[cls]
                    reuse = touches[cls] / (ins if ins > 1 else 1)
                    s = (clock - last[key]) / (interval.get(cls, 1.0) * (0.01 + reuse))
                    if s > best_score:
                        best, best_score = key, s
                    break
            assert best is not None  # feasibility was checked above
            skip.add(best)
            victims.append(best)
        for key in victims:
            self.remove(key)
        return victims

    @property
    def members(self) -> Collection[object]:
        return self._cls

    def __contains__(self, key: object) -> bool:
        return key in self._cls

    def __len__(self) -> int:
        return len(self._cls)


register_policy("lifespan", LifespanPolicy)
