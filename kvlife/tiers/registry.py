"""Tier kinds by name: how a :class:`~kvlife.tiers.spec.TierSpec` becomes a tier.

A kind is a :class:`TierKind`: how to build a tier of it from a spec, and the footprint
of a replica in it (what a budget must hold per replica, known before any tier of the
kind exists). Built-in kinds are registered on first use (lazy import of the tier
modules); another package registers its own with :func:`register_tier_kind`, and a store
chain can then name it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvlife.core.errors import InvalidArgument
from kvlife.tiers.base import Tier
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.spec import TierSpec


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a tier factory may use besides its spec."""

    store_path: Path
    """The store directory (a durable tier keeps its files under ``store_path / name``)."""
    fileio: FileIO | None = None
    """File I/O seam for tiers that write files (fault injection in tests)."""


TierFactory = Callable[[TierSpec, TierContext], Tier]


def _payload_only(nbytes: int) -> int:
    return nbytes


@dataclass(frozen=True, slots=True)
class TierKind:
    """One registered kind of tier."""

    name: str
    """The kind's name, as a :class:`TierSpec` gives it (``memory``, ``disk``, ...)."""
    build: TierFactory
    """Builds a tier of this kind from its spec."""
    footprint: Callable[[int], int] = _payload_only
    """Budget bytes a replica of ``nbytes`` payload bytes takes in a tier of this kind
    (framing, page rounding): what such a tier's :meth:`Tier.footprint` answers."""


_KINDS: dict[str, TierKind] = {}


def register_tier_kind(
    kind: str, factory: TierFactory, footprint: Callable[[int], int] = _payload_only
) -> None:
    """Register a tier kind (a duplicate name is an error)."""
    if kind in _KINDS:
        raise InvalidArgument(f"tier kind {kind!r} is already registered")
    _KINDS[kind] = TierKind(kind, factory, footprint)


def tier_kind(kind: str) -> TierKind:
    """The registered kind called ``kind`` (InvalidArgument naming the known ones)."""
    _builtins()
    found = _KINDS.get(kind)
    if found is None:
        raise InvalidArgument(f"unknown tier kind {kind!r}; known: {sorted(_KINDS)}")
    return found


def build_tier(spec: TierSpec, ctx: TierContext) -> Tier:
    return tier_kind(spec.kind).build(spec, ctx)


def footprint(kind: str, nbytes: int) -> int:
    """Budget bytes a replica of ``nbytes`` payload bytes takes in a tier of ``kind``:
    to size a budget in replicas before the tier is built."""
    return tier_kind(kind).footprint(nbytes)


def _disk_footprint(nbytes: int) -> int:
    from kvlife.tiers.disk.frame import frame_len

    return frame_len(nbytes)


def _shm_footprint(nbytes: int) -> int:
    from kvlife.tiers.buffers import round_up

    return round_up(max(nbytes, 1))


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


def _index_config(spec: TierSpec, opts: dict[str, object]) -> object:
    from kvlife.globalindex import IndexConfig

    return IndexConfig(
        namespace=str(opts.get("index_namespace", "kvlife")),
        buckets=int(opts.get("buckets", 16)),  # type: ignore[call-overload]
        host=str(opts.get("host", "")),
        lease_ttl_ms=int(opts.get("lease_ttl_ms", 10_000)),  # type: ignore[call-overload]
    )


_INDEX_OPTIONS = {"index_namespace", "buckets", "host", "lease_ttl_ms", "socket_timeout_s"}


def _redis(spec: TierSpec, ctx: TierContext) -> Tier:
    """Options: ``url`` (redis://...) or ``cluster`` (cluster://h:p,...), index options."""
    from kvlife.tiers.redis import RedisEndpoint, RedisTier

    opts = dict(spec.options)
    unknown = sorted(set(opts) - _INDEX_OPTIONS - {"url", "cluster"})
    if unknown:
        raise InvalidArgument(f"redis tier {spec.name!r}: unknown option(s) {unknown}")
    where = opts.get("cluster") or opts.get("url")
    if not isinstance(where, str):
        raise InvalidArgument(f"redis tier {spec.name!r} needs option url= or cluster=")
    if "cluster" in opts and not where.startswith("cluster://"):
        where = "cluster://" + where
    timeout = float(opts.get("socket_timeout_s", 2.0))  # type: ignore[arg-type]
    endpoint = RedisEndpoint.parse(where, socket_timeout_s=timeout)
    return RedisTier(endpoint, spec.capacity_bytes, spec.name, _index_config(spec, opts))  # type: ignore[arg-type]


def _mooncake(spec: TierSpec, ctx: TierContext) -> Tier:
    """Options: ``master`` (host:port), ``metadata`` (http://.../metadata), ``index``
    (the Redis holding records and leases: redis://... or cluster://...), sizes,
    ``read_lease_s`` (the master's ``--default_kv_lease_ttl``, seconds) and
    ``register_buffers`` (docs/remote.md)."""
    from kvlife.tiers.mooncake import MooncakeConfig, MooncakeTier
    from kvlife.tiers.redis import RedisEndpoint

    opts = dict(spec.options)
    known = _INDEX_OPTIONS | {
        "master",
        "metadata",
        "index",
        "local_hostname",
        "segment_bytes",
        "buffer_bytes",
        "read_lease_s",
        "register_buffers",
    }
    unknown = sorted(set(opts) - known)
    if unknown:
        raise InvalidArgument(f"mooncake tier {spec.name!r}: unknown option(s) {unknown}")
    for need in ("master", "metadata", "index"):
        if not isinstance(opts.get(need), str):
            raise InvalidArgument(f"mooncake tier {spec.name!r} needs option {need}=")
    mc = MooncakeConfig(
        master=str(opts["master"]),
        metadata=str(opts["metadata"]),
        local_hostname=str(opts.get("local_hostname", "127.0.0.1")),
        segment_bytes=int(opts.get("segment_bytes", 256 << 20)),  # type: ignore[call-overload]
        buffer_bytes=int(opts.get("buffer_bytes", 64 << 20)),  # type: ignore[call-overload]
        read_lease_s=float(opts.get("read_lease_s", 2.0)),  # type: ignore[arg-type]
        register_buffers=None if "register_buffers" not in opts else bool(opts["register_buffers"]),
    )
    timeout = float(opts.get("socket_timeout_s", 2.0))  # type: ignore[arg-type]
    index = RedisEndpoint.parse(str(opts["index"]), socket_timeout_s=timeout)
    return MooncakeTier(mc, index, spec.capacity_bytes, spec.name, _index_config(spec, opts))  # type: ignore[arg-type]


def _builtins() -> None:
    for kind in (
        TierKind("memory", _memory),
        TierKind("disk", _disk, _disk_footprint),
        TierKind("redis", _redis),
        TierKind("mooncake", _mooncake),
        TierKind("shm", _shm, _shm_footprint),
    ):
        _KINDS.setdefault(kind.name, kind)
