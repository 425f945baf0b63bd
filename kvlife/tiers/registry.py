"""Tier kinds by name: how a :class:`~kvlife.store.config.TierSpec` becomes a tier.

Built-in kinds are registered on first use (lazy import); another package registers its
own with :func:`register_tier_kind`, and a store chain can then name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlife.core.errors import InvalidArgument
from kvlife.tiers.base import Tier
from kvlife.tiers.disk.fileio import FileIO

if TYPE_CHECKING:
    from kvlife.store.config import TierSpec


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier factory may use besides its spec."""

    store_path: Path
    """The store directory (a durable tier keeps its files under ``store_path / name``)."""
    fileio: FileIO | None = None
    """File I/O seam for tiers that write files (fault injection in tests)."""


TierFactory = Callable[["TierSpec", TierContext], Tier]
_KINDS: dict[str, TierFactory] = {}


def register_tier_kind(kind: str, factory: TierFactory) -> None:
    """Register a tier kind (a duplicate name is an error)."""
    if kind in _KINDS:
        raise InvalidArgument(f"tier kind {kind!r} is already registered")
    _KINDS[kind] = factory


def build_tier(spec: TierSpec, ctx: TierContext) -> Tier:
    _builtins()
    factory = _KINDS.get(spec.kind)
    if factory is None:
        raise InvalidArgument(f"unknown tier kind {spec.kind!r}; known: {sorted(_KINDS)}")
    return factory(spec, ctx)


def _memory(spec: TierSpec, ctx: TierContext) -> Tier:
    from kvlife.tiers.memory import MemoryTier

    if spec.options:
        raise InvalidArgument(f"memory tier {spec.name!r} takes no options, got {spec.options}")
    return MemoryTier(spec.capacity_bytes, spec.name)


def _disk(spec: TierSpec, ctx: TierContext) -> Tier:
    from kvlife.tiers.disk import DiskTier, DiskTierConfig

    known = {"segment_bytes", "direct_io", "verify_on_open", "io_depth", "read_pool_bytes"}
    opts = dict(spec.options)
    unknown = sorted(set(opts) - known)
    if unknown:
        raise InvalidArgument(f"disk tier {spec.name!r}: unknown option(s) {unknown}")
    opts = {k: v for k, v in opts.items() if v is not None or k == "direct_io"}
    config = DiskTierConfig(capacity_bytes=spec.capacity_bytes, **opts)  # type: ignore[arg-type]
    return DiskTier(ctx.store_path / spec.name, config, name=spec.name, fileio=ctx.fileio)


def _shm(spec: TierSpec, ctx: TierContext) -> Tier:
    from kvlife.tiers.shm import ShmTier

    opts = dict(spec.options)
    unknown = sorted(set(opts) - {"arena_path", "staging_bytes"})
    if unknown:
        raise InvalidArgument(f"shm tier {spec.name!r}: unknown option(s) {unknown}")
    arena = opts.get("arena_path")
    staging = opts.get("staging_bytes", 256 << 20)
    if not isinstance(arena, str) or not arena:
        raise InvalidArgument(f"shm tier {spec.name!r} needs an arena_path option")
    if not isinstance(staging, int) or isinstance(staging, bool) or staging < 0:
        raise InvalidArgument(f"shm tier {spec.name!r}: staging_bytes must be an int >= 0")
    return ShmTier(spec.capacity_bytes, spec.name, Path(arena), staging)


def _builtins() -> None:
    for kind, factory in (("memory", _memory), ("disk", _disk), ("shm", _shm)):
        _KINDS.setdefault(kind, factory)
