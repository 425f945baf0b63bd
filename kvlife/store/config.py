"""Settings of a store: the tier chain and the store-wide options.

``StoreConfig(dram_bytes=..., disk_bytes=...)`` is the embedded default, a host-DRAM tier
in front of a disk tier. ``tiers=(TierSpec(...), ...)`` names any chain, fastest first;
each kind is built by the tier registry (:mod:`kvlife.tiers.registry`), so a new kind of
tier needs no edit here. :class:`TierSpec` lives with the tiers (:mod:`kvlife.tiers.spec`),
below the store; it is re-exported here and from :mod:`kvlife.store`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from kvlife.core.errors import InvalidArgument
from kvlife.tenancy.quotas import Shares, by_tier
from kvlife.tiers.kinds import DiskOptions
from kvlife.tiers.options import TierOptionError
from kvlife.tiers.spec import TierSpec

GiB = 1 << 30
MiB = 1 << 20

__all__ = ["GiB", "MiB", "StoreConfig", "TierSpec"]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of a store."""

    dram_bytes: int = 1 * GiB
    """Host-DRAM tier budget of the default chain (0: no DRAM tier)."""
    disk_bytes: int = 8 * GiB
    """Disk tier budget of the default chain, garbage included (0: no disk tier)."""
    policy: str = "lru"
    """Eviction policy of each tier of the default chain, by registered name."""
    write_through: bool = False
    """Make every put durable (on every durable tier) before it returns."""
    promote_on_hit: bool = True
    """Copy hits served from a slower tier into the first tier (in the background)."""
    segment_bytes: int = 256 * MiB
    """Disk segment file size."""
    direct_io: bool | None = None
    """O_DIRECT on the disk tier: None detects."""
    verify_on_open: Literal["none", "header", "full"] = "header"
    """What recovery checks for each durable replica."""
    read_pool_bytes: int = 1 * GiB
    """Warm memory the disk tier may keep for loads into new arrays (on top of the DRAM
    budget; never more than the caller ever had out at once)."""
    tiers: tuple[TierSpec, ...] = ()
    """An explicit chain, fastest first; overrides dram_bytes/disk_bytes/policy."""
    io_threads: int = 4
    """Threads of the asynchronous load/put pool."""
    verify_dram_on_load: bool = False
    """Verify every load served from a tier that holds replicas in memory (DRAM, the
    server's arena) against the xxh3-128 seal the replica was published with (a replica
    changed in memory is then a counted, invalidated miss at once, not only at its
    demotion or the next ``check``). Costs one hash of every such chunk loaded."""
    segment_parity: tuple[int, int] | None = None
    """``(k, m)``: protect the disk tiers' segment files with m parity files per k at
    each clean close, and rebuild lost ones at open (:mod:`kvlife.store.protection`)."""
    tenant_shares: Shares = ()
    """Quotas: ``((tenant, ((tier name, bytes), ...)), ...)``. Each tier named here
    evicts through :class:`~kvlife.policy.shares.TenantShares` (its ``policy`` within
    each tenant), an object's tenant decided by its namespace
    (:func:`kvlife.tenancy.quotas.tenant_of_namespace`). A tier's shares may not add
    up to more than its capacity (isolation could not hold)."""
    chain: tuple[TierSpec, ...] = field(init=False, default=())
    """The chain in use (``tiers`` or the default built from the budgets)."""

    def __post_init__(self) -> None:
        for name in ("dram_bytes", "disk_bytes", "segment_bytes", "io_threads", "read_pool_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(f"{name} must be an int, got {value!r}")
        if self.dram_bytes < 0 or self.disk_bytes < 0:
            raise InvalidArgument(
                f"tier budgets must be >= 0 (dram_bytes={self.dram_bytes}, "
                f"disk_bytes={self.disk_bytes})"
            )
        if self.io_threads < 1:
            raise InvalidArgument(f"io_threads must be >= 1, got {self.io_threads}")
        chain = tuple(self.tiers)
        if not chain:
            if self.dram_bytes > 0:
                chain += (TierSpec("memory", "dram", self.dram_bytes, self.policy),)
            if self.disk_bytes > 0:
                try:
                    disk = DiskOptions(
                        segment_bytes=self.segment_bytes,
                        direct_io=self.direct_io,
                        verify_on_open=self.verify_on_open,
                        read_pool_bytes=self.read_pool_bytes,
                    )
                except TierOptionError as exc:
                    raise exc.for_tier("disk") from None
                chain += (TierSpec("disk", "disk", self.disk_bytes, self.policy, disk),)
        if not chain:
            raise InvalidArgument("a store needs at least one tier (dram_bytes or disk_bytes > 0)")
        if not all(isinstance(t, TierSpec) for t in chain):
            raise InvalidArgument("tiers must be TierSpec values")
        names = [t.name for t in chain]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must be unique in the chain, got {names}")
        object.__setattr__(self, "chain", chain)
        if self.segment_parity is not None:
            sp = self.segment_parity
            if not (
                isinstance(sp, tuple)
                and len(sp) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in sp)
                and sp[0] >= 1
                and sp[1] >= 1
                and sp[0] + sp[1] <= 32
            ):
                raise InvalidArgument(
                    f"segment_parity must be (k, m) with k, m >= 1 and k + m <= 32, got {sp!r}"
                )
            if not any(t.kind == "disk" for t in chain):
                raise InvalidArgument("segment_parity needs a disk tier")
        caps = {t.name: t.capacity_bytes for t in chain}
        for tier, tenants in by_tier(self.tenant_shares).items():
            if tier not in caps:
                raise InvalidArgument(f"tenant shares name tier {tier!r}; the chain has {names}")
            if sum(tenants.values()) > caps[tier]:
                raise InvalidArgument(
                    f"tenant shares of tier {tier} add up to {sum(tenants.values())} bytes, "
                    f"more than its capacity {caps[tier]}: one tenant's burst could evict "
                    "another's objects within its share"
                )
        if self.write_through and not any(t.kind == "disk" for t in chain):
            raise InvalidArgument("write_through needs a durable tier (a disk tier)")

    @classmethod
    def from_settings(cls, settings: dict[str, object]) -> StoreConfig:
        """Build from keyword settings, naming any unknown one."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown store setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        try:
            return cls(**settings)  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidArgument(f"bad store settings: {exc}") from exc
