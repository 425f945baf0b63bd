"""Per-tenant shares of one tier: eviction isolated between tenants (issue 24, quotas).

:class:`TenantShares` is an :class:`~kvlife.policy.base.EvictionPolicy` that keeps one
inner policy per tenant (LRU by default) and a share of the tier per tenant, in the
placement engine's units (bytes in the store, blocks in the simulator). When the engine
needs room in the tier it asks this policy for victims, and each victim is taken from
the tenant furthest over its share, in that tenant's own order. A tenant's excess is
``used + incoming - share``: ``incoming`` are the units of the protected keys of that
tenant that the tier does not hold yet, which is what the room is being made for (the
engine protects a put's whole prompt, and a demotion's victims, while it makes room for
them), so the tenant that asks for room is charged for it; a tie goes to the tenant seen
first. The tenants are kept in a heap by excess (updated lazily: a tenant whose units
changed is pushed again before the next choice, its older entries skipped when they
come up), so a victim costs O(log tenants) rather than a scan of every tenant; the
tenants of the protected keys, whose excess is one call's, are compared by a scan of
those few. So while the shares add up to no more than the tier's capacity, one tenant's
burst evicts only its own objects: a tenant within its share loses none while another
is over its share. (In the live store the engine also protects the keys of other
puts in flight; those count as incoming for their own tenants, which is what they
are.) A tenant without a share has share 0 (the first to go); shared scopes are a
tenant of their own (``tenant_of`` says which), with their own share.

It plugs in where any policy does (:class:`~kvlife.placement.engine.TierSlot`), so the
live store and the replay simulator enforce the same shares: a store built with
:attr:`~kvlife.store.config.StoreConfig.tenant_shares` (``kvlife serve --tenants FILE``,
:mod:`kvlife.tenancy.quotas`) keys tenants by an object's namespace, ``kvlife replay
--shares`` by a trace's tenants. The engine's code is unchanged. Every victim is counted
against its tenant (:meth:`TenantShares.evicted`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Generic, TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy
from kvlife.policy.lru import LRUPolicy

K = TypeVar("K", bound=Hashable)
T = TypeVar("T", bound=Hashable)


def _one(key: object) -> int:
    return 1


class TenantShares(EvictionPolicy[K], Generic[K, T]):
    """One inner policy and one share per tenant; victims from the most over-share."""

    name = "tenant-shares"

    def __init__(
        self,
        tenant_of: Callable[[K], T],
        shares: Mapping[T, int],
        *,
        inner: Callable[[], EvictionPolicy[K]] = LRUPolicy,
        size: Callable[[K], int] = _one,
    ) -> None:
        """``tenant_of``: a key's tenant (asked once, when it is inserted); ``shares``:
        each tenant's units of the tier; ``inner``: makes a tenant's own policy;
        ``size``: a key's units (asked once, at its insert; 1 each by default)."""
        for tenant, share in shares.items():
            if type(share) is not int or share < 0:
                raise InvalidArgument(f"share of tenant {tenant!r} must be an int >= 0")
        self._tenant_of = tenant_of
        self._shares = dict(shares)
        self._inner = inner
        self._size = size
        self._parts: dict[T, EvictionPolicy[K]] = {}
        """Each tenant's policy, in the order tenants were first seen (the tie-break)."""
        self._used: dict[T, int] = {}
        self._held: dict[K, tuple[T, int]] = {}
        """Each resident key's tenant and units, as charged at its insert."""
        self._evicted: dict[T, int] = {}
        """Victims taken from each tenant (keys)."""
        self._rank: dict[T, int] = {}
        """Each tenant's place in the order tenants were first seen (the tie-break)."""
        self._heap: list[tuple[int, int, int, T]] = []
        """``(share - used, rank, stamp, tenant)``: the most over its share first, a tie
        to the first seen. An entry is current while its stamp is its tenant's latest
        (:attr:`_stamp`) and the tenant is not :attr:`_dirty`; others are skipped."""
        self._stamp: dict[T, int] = {}
        self._stamps = itertools.count()
        self._dirty: set[T] = set()
        """Tenants whose units changed since their entry was pushed (pushed again before
        the next choice of a victim: an insert costs no heap operation)."""

    # ------------------------------------------------------------------ figures

    def used(self, tenant: T) -> int:
        """Units ``tenant``'s resident keys take."""
        return self._used.get(tenant, 0)

    def share(self, tenant: T) -> int:
        return self._shares.get(tenant, 0)

    def evicted(self, tenant: T) -> int:
        """Keys of ``tenant`` this policy gave up as victims."""
        return self._evicted.get(tenant, 0)

    def figures(self) -> dict[T, dict[str, int]]:
        """Each tenant seen or with a share: its ``share``, ``used`` units, resident
        ``keys`` and ``evicted`` victims."""
        keys: dict[T, int] = {}
        for tenant, _ in self._held.values():
            keys[tenant] = keys.get(tenant, 0) + 1
        out: dict[T, dict[str, int]] = {}
        for tenant in (*self._shares, *self._parts):
            out[tenant] = {
                "share": self._shares.get(tenant, 0),
                "used": self._used.get(tenant, 0),
                "keys": keys.get(tenant, 0),
                "evicted": self._evicted.get(tenant, 0),
            }
        return out

    # ------------------------------------------------------------------ EvictionPolicy

    def insert(self, key: K) -> None:
        held = self._held.get(key)
        if held is not None:  # a resident: a touch
            self._parts[held[0]].touch(key)
            return
        tenant = self._tenant_of(key)
        size = self._size(key)
        part = self._parts.get(tenant)
        if part is None:
            part = self._parts[tenant] = self._inner()
            self._used[tenant] = 0
            self._rank[tenant] = len(self._rank)
        part.insert(key)
        self._held[key] = (tenant, size)
        self._used[tenant] += size
        self._dirty.add(tenant)

    def touch(self, key: K) -> None:
        held = self._held.get(key)
        if held is not None:
            self._parts[held[0]].touch(key)

    def remove(self, key: K) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            tenant, size = held
            self._parts[tenant].remove(key)
            self._used[tenant] -= size
            self._dirty.add(tenant)

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        free = len(self._held) - sum(1 for k in protected if k in self._held)
        if free < n:
            return None  # atomic: nothing taken
        victims = self.evict_up_to(n, protected)
        if len(victims) != n:  # pragma: no cover - the count above makes this impossible
            raise AssertionError(f"{len(victims)} of {n} victims after a feasible check")
        return victims

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        incoming: dict[T, int] = {}
        held, tenant_of, size = self._held, self._tenant_of, self._size
        for key in protected:
            if key not in held:
                t = tenant_of(key)
                incoming[t] = incoming.get(t, 0) + size(key)
        # tenants with nothing evictable left in this call (all protected)
        spent: set[T] = set()
        # current entries taken off the heap for this call (spent tenants, and those with
        # incoming units, which are compared by a scan), pushed back at its end
        aside: list[tuple[int, int, int, T]] = []
        for changed in self._dirty:
            self._push(changed)
        self._dirty.clear()
        if len(self._heap) > 2 * len(self._parts) + 16:
            self._rebuild()
        try:
            while len(victims) < n:
                tenant = self._most_over(spent, incoming, aside)
                if tenant is None:
                    break
                got = self._parts[tenant].evict_up_to(1, protected)
                if not got:
                    spent.add(tenant)
                    continue
                key = got[0]
                _, units = self._held.pop(key)
                self._used[tenant] -= units
                self._evicted[tenant] = self._evicted.get(tenant, 0) + 1
                victims.append(key)
                self._push(tenant)
        finally:
            stamp = self._stamp
            for entry in aside:
                if entry[2] == stamp[entry[3]]:
                    heapq.heappush(self._heap, entry)
        return victims

    def _push(self, tenant: T) -> None:
        """An entry for ``tenant``'s excess now; its older entries stop being current."""
        stamp = self._stamp[tenant] = next(self._stamps)
        excess = self._used[tenant] - self._shares.get(tenant, 0)
        heapq.heappush(self._heap, (-excess, self._rank[tenant], stamp, tenant))

    def _rebuild(self) -> None:
        """The heap of current entries only (older ones pile up below the top)."""
        stamp = self._stamp
        self._heap = [e for e in self._heap if e[2] == stamp[e[3]]]
        heapq.heapify(self._heap)

    def _most_over(
        self, spent: set[T], incoming: dict[T, int], aside: list[tuple[int, int, int, T]]
    ) -> T | None:
        """The tenant with the largest ``used + incoming - share`` that has a key left to
        give this call (a tie: the first seen), or None. The heap's top answers for the
        tenants without incoming units; those with some (a call's few) are scanned."""
        heap, stamp, parts = self._heap, self._stamp, self._parts
        best: T | None = None
        order: tuple[int, int] = (0, 0)
        while heap:
            entry = heap[0]
            tenant = entry[3]
            if entry[2] != stamp[tenant]:
                heapq.heappop(heap)  # an older entry of a tenant pushed since
            elif tenant in spent or tenant in incoming:
                aside.append(heapq.heappop(heap))
            elif not len(parts[tenant]):
                # nothing to give (its next insert pushes it again)
                heapq.heappop(heap)
            else:
                best, order = tenant, (entry[0], entry[1])
                break
        shares, used, rank = self._shares, self._used, self._rank
        for tenant, units in incoming.items():
            part = parts.get(tenant)
            if part is None or tenant in spent or not len(part):
                continue
            mine = (shares.get(tenant, 0) - used[tenant] - units, rank[tenant])
            if best is None or mine < order:
                best, order = tenant, mine
        return best

    @property
    def members(self) -> Collection[object]:
        return self._held

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)
