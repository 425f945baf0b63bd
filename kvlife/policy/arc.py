"""Adaptive Replacement Cache (Megiddo and Modha, FAST'03), scan-resistant.

T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 are ghost lists
of keys evicted from T1 and T2. A touch moves a key to T2's most recent end. Inserting a
key found in B1 grows the target size ``p`` of T1 (by ``max(|B2|/|B1|, 1)``), one found in
B2 shrinks it, and both go to T2; other new keys go to T1. ``evict`` takes T1's least
recent key when ``|T1| > p`` (or T2 has nothing evictable), else T2's, and remembers the
victim in the matching ghost list. Ghost lists are trimmed so that ``|T1| + |B1| <= c``
and all four lists hold at most ``2c`` keys.

Deviation from the paper, forced by the insert/evict split of the policy interface: the
store evicts before it inserts, so the victim is chosen before ``p`` adapts to the key
that caused the miss. ``c`` is the largest number of resident keys seen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy, register_policy

K = TypeVar("K", bound=Hashable)


class ARCPolicy(EvictionPolicy[K]):
    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self._p = 0.0
        self._c = 0

    @property
    def target_t1(self) -> float:
        """The adaptive target size of T1."""
        return self._p

    def insert(self, key: K) -> None:
        t1, t2 = self._t1, self._t2
        if key in t1 or key in t2:
            self.touch(key)
            return
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._p = min(float(self._c), self._p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            t2[key] = None
        elif key in b2:
            self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            t2[key] = None
        else:
            t1[key] = None
        size = len(t1) + len(t2)
        if size > self._c:
            self._c = size
        c = self._c
        if len(t1) + len(b1) > c or size + len(b1) + len(b2) > 2 * c:
            self._trim_ghosts()

    def touch(self, key: K) -> None:
        t2 = self._t2
        if key in t2:
            t2.move_to_end(key)
        elif key in self._t1:
            del self._t1[key]
            t2[key] = None

    def remove(self, key: K) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def touch_all(self, keys: Iterable[K]) -> None:
        # touch, written out
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        # insert and touch, written out: a resident is touched either way (insert of a
        # resident is a touch), a key in new not yet resident is inserted, any other key
        # is ignored as touch ignores it
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
                continue
            if key in t1:
                del t1[key]
                t2[key] = None
                continue
            if key not in new:
                continue
            if key in b1:
                self._p = min(float(self._c), self._p + max(len(b2) / len(b1), 1.0))
                del b1[key]
                t2[key] = None
            elif key in b2:
                self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None
            size = len(t1) + len(t2)
            if size > self._c:
                self._c = size
            c = self._c
            if len(t1) + len(b1) > c or size + len(b1) + len(b2) > 2 * c:
                self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self._c
        b1, b2 = self._b1, self._b2
        while b1 and len(self._t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(self._t1) + len(self._t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def _pick(self, lst: OrderedDict[K, None], protected: Collection[K]) -> K | None:
        if not protected:
            return next(iter(lst)) if lst else None
        for key in lst:
            if key not in protected:
                return key
        return None

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        if not self._can_evict(n, protected):
            return None
        victims = [self._evict_one(protected) for _ in range(n)]
        self._trim_ghosts()
        return victims

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        # evict(1) n times: a feasibility check and a victim each. No ghost trim: the
        # lists are trimmed after every call, and a victim moves from T1 to B1 or from
        # T2 to B2, which changes neither |T1| + |B1| nor the total (evict's trim is a
        # no-op too; it stays as a guard)
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        sure = len(t1) + len(t2) - n >= len(protected)
        for _ in range(n):
            # each victim takes one resident: when n are sure to pass, so is each check
            if not sure and not self._can_evict(1, protected):
                break
            # _evict_one, written out
            from_t1 = len(t1) > self._p
            for key in t1 if from_t1 else t2:
                if key not in protected:
                    break
            else:
                from_t1 = not from_t1
                for key in t1 if from_t1 else t2:
                    if key not in protected:
                        break
                else:  # pragma: no cover - the feasibility check makes this impossible
                    raise AssertionError("no unprotected resident after a feasible check")
            if from_t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
            victims.append(key)
        return victims

    def _can_evict(self, n: int, protected: Collection[K]) -> bool:
        resident = len(self._t1) + len(self._t2)
        # when size - n >= len(protected) it is feasible whatever the protected keys are
        return resident - n >= len(protected) or resident - sum(k in self for k in protected) >= n

    def _evict_one(self, protected: Collection[K]) -> K:
        """Move one victim to its ghost list (there must be an unprotected resident)."""
        from_t1 = len(self._t1) > self._p
        key = self._pick(self._t1 if from_t1 else self._t2, protected)
        if key is None:
            from_t1 = not from_t1
            key = self._pick(self._t1 if from_t1 else self._t2, protected)
        assert key is not None  # feasibility was checked by the caller
        if from_t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


register_policy("arc", ARCPolicy)
