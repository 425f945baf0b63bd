"""TenantShares' heap of tenants chooses exactly the victims the scan of every tenant
did (the scanning version is kept here as the reference), under hypothesis: many
tenants, equal excesses (the tie goes to the tenant seen first), protected keys of
several tenants, resident or not (a call's incoming units), removals that empty a
tenant, and evictions that run out of unprotected keys."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Hashable, Mapping
from pathlib import Path
from typing import Generic, TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.policy.base import EvictionPolicy
from kvlife.policy.lru import LRUPolicy
from kvlife.policy.shares import TenantShares

K = TypeVar("K", bound=Hashable)
T = TypeVar("T", bound=Hashable)


def _one(key: object) -> int:
    return 1


class ScanningShares(EvictionPolicy[K], Generic[K, T]):
    """TenantShares as it was before its heap (kvlife 2026-12-02, 688f6ad): every
    tenant scanned per victim. The reference the heap must choose exactly as."""

    name = "tenant-shares-scan"

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
        part.insert(key)
        self._held[key] = (tenant, size)
        self._used[tenant] += size

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
        spent: set[T] = set()
        # tenants with nothing evictable left in this call (all protected)
        while len(victims) < n:
            tenant = self._most_over(spent, incoming)
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
        return victims

    def _most_over(self, spent: set[T], incoming: dict[T, int]) -> T | None:
        best: T | None = None
        over = 0
        for tenant, part in self._parts.items():  # first seen first: ties go to it
            if tenant in spent or not len(part):
                continue
            excess = self._used[tenant] + incoming.get(tenant, 0) - self._shares.get(tenant, 0)
            if best is None or excess > over:
                best, over = tenant, excess
        return best

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)


TENANTS = 8
PER = 10
"""Keys of tenant ``t``: ``PER * t`` .. ``PER * t + PER - 1``."""
KEY = st.integers(0, TENANTS * PER - 1)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), KEY),
        st.tuples(st.just("touch"), KEY),
        st.tuples(st.just("remove"), KEY),
        st.tuples(
            st.sampled_from(["evict", "evict_up_to"]),
            st.integers(0, 6),
            st.frozensets(KEY, max_size=12),
        ),
    ),
    max_size=120,
)


@given(
    OPS,
    st.lists(st.integers(0, 4), min_size=TENANTS, max_size=TENANTS),
    st.lists(st.integers(1, 3), min_size=TENANTS * PER, max_size=TENANTS * PER),
)
@settings(max_examples=300, deadline=None)
def test_the_heap_chooses_the_victims_the_scan_chose(
    ops: list[tuple[object, ...]], share_list: list[int], sizes: list[int]
) -> None:
    # small shares and sizes: excesses tie often, so the tie-break is exercised
    shares = {t: s for t, s in enumerate(share_list) if s}  # some tenants have none
    heap: TenantShares[int, int] = TenantShares(lambda k: k // PER, shares, size=sizes.__getitem__)
    scan: ScanningShares[int, int] = ScanningShares(
        lambda k: k // PER, shares, size=sizes.__getitem__
    )
    for op in ops:
        if op[0] in ("evict", "evict_up_to"):
            verb, n, protected = op
            assert isinstance(verb, str) and isinstance(n, int)
            assert isinstance(protected, frozenset)
            got = getattr(heap, verb)(n, protected)
            want = getattr(scan, verb)(n, protected)
            assert got == want, (verb, n, sorted(protected))
        else:
            verb, key = op
            getattr(heap, str(verb))(key)
            getattr(scan, str(verb))(key)
        assert len(heap) == len(scan)
    assert heap.figures() == scan.figures()
    for t in range(TENANTS):
        assert heap.used(t) == scan.used(t) and heap.evicted(t) == scan.evicted(t)


def test_a_thousand_tenants_one_burst() -> None:
    """1,000 tenants at their share, one bursting: every victim is the burster's, as
    the scan chooses, and the heap stays within a bound of the tenants."""
    shares = dict.fromkeys(range(1000), 4)
    heap: TenantShares[int, int] = TenantShares(lambda k: k // 100, shares)
    scan: ScanningShares[int, int] = ScanningShares(lambda k: k // 100, shares)
    for t in range(1000):
        for i in range(4):
            heap.insert(100 * t + i)
            scan.insert(100 * t + i)
    for i in range(4, 90):
        burst = 100 * 7 + i
        heap.insert(burst)
        scan.insert(burst)
        assert heap.evict(1, {burst}) == scan.evict(1, {burst}) == [100 * 7 + i - 4]
    assert heap.used(7) == 4 and all(heap.used(t) == 4 for t in range(1000))
    assert len(heap._heap) <= 2 * 1000 + 16 + 90


def test_the_shares_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    from kvlife.bench.shares import main

    out = tmp_path / "shares.json"
    assert main(["--quick", "--tenants", "50", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tenants"] == 50 and got["victims"] == 500
    assert got["victims_per_s"] > 0 and len(got["runs_victims_per_s"]) == got["rounds"]
    assert got["machine"]["python_loop_mips"] > 0
