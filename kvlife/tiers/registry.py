"""Tier kinds by name: how a :class:`~kvlife.tiers.spec.TierSpec` becomes a tier.

A kind is a :class:`TierKind`: its typed options class (:mod:`kvlife.tiers.kinds`), how
to build its tier class from a spec and those options, and the footprint of a replica
in it (what a budget must hold per replica, known before any tier of the kind exists).
Built-in kinds are registered on first use, their tier modules imported only when a
tier is built; another package registers its own with :func:`register_tier_kind`, and a
spec made after that can name it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.tiers.base import Tier
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.kinds import (
    DiskOptions,
    MemoryOptions,
    MooncakeOptions,
    RedisOptions,
    SharedIndexOptions,
    ShmOptions,
)
from kvlife.tiers.options import TierOptionError, TierOptions, options_from_pairs

if TYPE_CHECKING:  # the spec asks this module for its kind as it is made
    from kvlife.globalindex import IndexConfig
    from kvlife.tiers.spec import TierSpec


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier factory may use besides its spec."""

    store_path: Path
    """The store directory (a durable tier keeps its files under ``store_path / name``)."""
    fileio: FileIO | None = None
    """File I/O seam for tiers that write files (fault injection in tests)."""


def _payload_only(nbytes: int) -> int:
    return nbytes


Opts = TypeVar("Opts", bound=TierOptions)


@dataclass(frozen=True, slots=True)
class TierKind(Generic[Opts]):
    """One registered kind of tier."""

    name: str
    """The kind's name, as a :class:`TierSpec` gives it (``memory``, ``disk``, ...)."""
    options: type[Opts]
    """Its typed options (a frozen :class:`TierOptions` dataclass)."""
    build: Callable[[TierSpec, Opts, TierContext], Tier]
    """Makes the kind's tier class (imported on first use) from a spec and its options."""
    footprint: Callable[[int], int] = _payload_only
    """Budget bytes a replica of ``nbytes`` payload bytes takes in a tier of this kind
    (framing, page rounding): what such a tier's :meth:`Tier.footprint` answers."""

    def options_of(self, tier: str, given: TierOptions | Sequence[tuple[str, object]]) -> Opts:
        """``given`` as this kind's options, for the tier called ``tier``."""
        if isinstance(given, self.options):
            return given
        if isinstance(given, TierOptions):
            raise InvalidArgument(
                f"{self.name} tier {tier!r}: options must be {self.options.__name__}, "
                f"got {type(given).__name__}"
            )
        if not isinstance(given, list | tuple):
            raise InvalidArgument(
                f"{self.name} tier {tier!r}: options must be {self.options.__name__} or "
                f"(name, value) pairs, got {type(given).__name__}"
            )
        return options_from_pairs(self.options, tier, given)


_KINDS: dict[str, TierKind[Any]] = {}


def register_tier_kind(kind: TierKind[Any]) -> None:
    """Register a tier kind (a duplicate name is an error)."""
    _builtins()
    if kind.name in _KINDS:
        raise InvalidArgument(f"tier kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind


def tier_kind(kind: str) -> TierKind[Any]:
    """The registered kind called ``kind`` (InvalidArgument naming the known ones)."""
    _builtins()
    found = _KINDS.get(kind)
    if found is None:
        raise InvalidArgument(f"unknown tier kind {kind!r}; known: {sorted(_KINDS)}")
    return found


def build_tier(spec: TierSpec, ctx: TierContext) -> Tier:
    """The tier ``spec`` names (its options were checked when the spec was made)."""
    return tier_kind(spec.kind).build(spec, spec.config, ctx)


def footprint(kind: str, nbytes: int) -> int:
    """Budget bytes a replica of ``nbytes`` payload bytes takes in a tier of ``kind``:
    to size a budget in replicas before the tier is built."""
    return tier_kind(kind).footprint(nbytes)


def _disk_footprint(nbytes: int) -> int:
    from kvlife.tiers.disk.frame import frame_room

    return frame_room(nbytes)


def _shm_footprint(nbytes: int) -> int:
    from kvlife.tiers.buffers import round_up

    return round_up(max(nbytes, 1))


def _memory(spec: TierSpec, o: MemoryOptions, ctx: TierContext) -> Tier:
    from kvlife.tiers.memory import MemoryTier

    return MemoryTier(spec.capacity_bytes, spec.name)


def _disk(spec: TierSpec, o: DiskOptions, ctx: TierContext) -> Tier:
    from kvlife.tiers.disk import DiskTier, DiskTierConfig

    config = DiskTierConfig(
        capacity_bytes=spec.capacity_bytes,
        segment_bytes=o.segment_bytes,
        direct_io=o.direct_io,
        verify_on_open=o.verify_on_open,
        io_depth=o.io_depth,
        read_pool_bytes=o.read_pool_bytes,
    )
    return DiskTier(ctx.store_path / spec.name, config, name=spec.name, fileio=ctx.fileio)


def _shm(spec: TierSpec, o: ShmOptions, ctx: TierContext) -> Tier:
    from kvlife.tiers.shm import ShmTier

    if o.arena_path is None:
        raise TierOptionError("shm", "arena_path", "required to build the tier", spec.name)
    return ShmTier(spec.capacity_bytes, spec.name, Path(o.arena_path), o.staging_bytes)


def _index_config(o: SharedIndexOptions) -> IndexConfig:
    from kvlife.globalindex import IndexConfig

    return IndexConfig(
        namespace=o.index_namespace, buckets=o.buckets, host=o.host, lease_ttl_ms=o.lease_ttl_ms
    )


def _redis(spec: TierSpec, o: RedisOptions, ctx: TierContext) -> Tier:
    from kvlife.tiers.redis import RedisEndpoint, RedisTier

    endpoint = RedisEndpoint.parse(o.address, socket_timeout_s=o.socket_timeout_s)
    return RedisTier(endpoint, spec.capacity_bytes, spec.name, _index_config(o))


def _mooncake(spec: TierSpec, o: MooncakeOptions, ctx: TierContext) -> Tier:
    from kvlife.tiers.mooncake import MooncakeConfig, MooncakeTier
    from kvlife.tiers.redis import RedisEndpoint

    mc = MooncakeConfig(
        master=o.master,
        metadata=o.metadata,
        local_hostname=o.local_hostname,
        segment_bytes=o.segment_bytes,
        buffer_bytes=o.buffer_bytes,
        read_lease_s=o.read_lease_s,
        register_buffers=o.register_buffers,
        read_group_bytes=o.read_group_bytes,
    )
    index = RedisEndpoint.parse(o.index, socket_timeout_s=o.socket_timeout_s)
    return MooncakeTier(mc, index, spec.capacity_bytes, spec.name, _index_config(o))


def _builtins() -> None:
    if _KINDS:
        return
    for kind in (
        TierKind("memory", MemoryOptions, _memory),
        TierKind("shm", ShmOptions, _shm, _shm_footprint),
        TierKind("disk", DiskOptions, _disk, _disk_footprint),
        TierKind("redis", RedisOptions, _redis),
        TierKind("mooncake", MooncakeOptions, _mooncake),
    ):
        _KINDS[kind.name] = kind
