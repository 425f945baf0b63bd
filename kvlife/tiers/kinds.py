"""The options of each built-in tier kind, one typed frozen dataclass per kind.

``TierSpec("disk", "disk", budget, options=DiskOptions(segment_bytes=64 << 20))`` or, the
same, ``options=(("segment_bytes", 64 << 20),)``. The tier registry
(:mod:`kvlife.tiers.registry`) maps each kind's name to its options class here and to
its tier class, and builds the tier from both. These classes import no tier module, so a
spec is checked without loading Redis, Mooncake or SQLite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvlife.tiers.buffers import ALIGN
from kvlife.tiers.options import TierOptions

MiB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOptions(TierOptions):
    """Host DRAM (:class:`~kvlife.tiers.memory.MemoryTier`): no options."""

    kind: ClassVar[str] = "memory"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmOptions(TierOptions):
    """DRAM in a shared-memory arena (:class:`~kvlife.tiers.shm.ShmTier`, the first tier
    of ``kvlife serve``)."""

    kind: ClassVar[str] = "shm"

    arena_path: str | None = None
    """The arena file, on a tmpfs (``kvlife serve`` names one per server process); a
    tier is built only once it is given."""
    staging_bytes: int = 256 * MiB
    """Arena room beyond the budget: puts being written, disk reads handed out."""

    def check(self) -> None:
        if self.arena_path is not None and not self.arena_path:
            raise self.bad("arena_path", "must be a path, got an empty string")
        if self.staging_bytes < 0:
            raise self.bad("staging_bytes", f"must be >= 0, got {self.staging_bytes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskOptions(TierOptions):
    """Segment files and a SQLite catalog (:class:`~kvlife.tiers.disk.DiskTier`)."""

    kind: ClassVar[str] = "disk"

    segment_bytes: int = 256 * MiB
    """Target size of a segment file; a larger frame gets a segment of its own."""
    direct_io: bool | None = None
    """Use O_DIRECT: None detects, True requires it, False never uses it."""
    verify_on_open: Literal["none", "header", "full"] = "header"
    """What recovery checks for each catalog row before serving it again."""
    io_depth: int = 4
    """Frames in flight per call (a writer's queued frames, a reader's parallel reads)."""
    read_pool_bytes: int = 1 << 30
    """Most idle memory kept warm for reads into new arrays (0 disables)."""

    def check(self) -> None:
        if self.segment_bytes < ALIGN or self.segment_bytes % ALIGN:
            raise self.bad(
                "segment_bytes", f"must be a positive multiple of {ALIGN}, got {self.segment_bytes}"
            )
        if self.io_depth < 1:
            raise self.bad("io_depth", f"must be >= 1, got {self.io_depth}")
        if self.read_pool_bytes < 0:
            raise self.bad("read_pool_bytes", f"must be >= 0, got {self.read_pool_bytes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedIndexOptions(TierOptions):
    """What both shared tiers (Redis, Mooncake) say about the global index on Redis
    (:class:`~kvlife.globalindex.IndexConfig`, docs/remote.md)."""

    index_namespace: str = "kvlife"
    """Index namespace: every key of this deployment starts with ``kvl:NAMESPACE``."""
    buckets: int = 16
    """Hash-tag buckets the chunks are spread over (slots of a cluster)."""
    host: str = ""
    """This host's id in leases (empty: hostname-pid)."""
    lease_ttl_ms: int = 10_000
    """Lease lifetime; a host paused or cut off longer than this cannot publish."""
    socket_timeout_s: float = 2.0
    """Timeout of each Redis call, seconds."""

    def check(self) -> None:
        ns = self.index_namespace
        if not ns or ":" in ns or "{" in ns:
            raise self.bad("index_namespace", f"must be plain (no ':' or '{{'), got {ns!r}")
        if not 1 <= self.buckets <= 4096:
            raise self.bad("buckets", f"must be in 1..4096, got {self.buckets}")
        if self.lease_ttl_ms < 10:
            raise self.bad("lease_ttl_ms", f"must be >= 10, got {self.lease_ttl_ms}")
        if self.socket_timeout_s <= 0:
            raise self.bad("socket_timeout_s", f"must be > 0, got {self.socket_timeout_s}")


def _redis_address(text: str) -> bool:
    return text.startswith(("redis://", "unix://", "cluster://"))


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisOptions(SharedIndexOptions):
    """Frames and records in Redis or a Redis Cluster
    (:class:`~kvlife.tiers.redis.RedisTier`); exactly one of ``url`` and ``cluster``."""

    kind: ClassVar[str] = "redis"

    url: str | None = None
    """One Redis: ``redis://host:port/db`` or ``unix://path``."""
    cluster: str | None = None
    """A Redis Cluster's seed nodes: ``host:port,host:port`` (``cluster://`` optional)."""

    def check(self) -> None:
        SharedIndexOptions.check(self)
        if (self.url is None) == (self.cluster is None):
            raise self.bad("url", "give exactly one of url= and cluster=")
        if self.url is not None and not self.url.startswith(("redis://", "unix://")):
            raise self.bad("url", f"must be redis://... or unix://..., got {self.url!r}")
        if self.cluster is not None and not self.cluster.removeprefix("cluster://"):
            raise self.bad("cluster", "must name at least one host:port")

    @property
    def address(self) -> str:
        """The endpoint as :meth:`~kvlife.tiers.redis.RedisEndpoint.parse` reads it."""
        if self.cluster is not None:
            return "cluster://" + self.cluster.removeprefix("cluster://")
        assert self.url is not None  # check(): exactly one is given
        return self.url


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeOptions(SharedIndexOptions):
    """Payloads in Mooncake Store, records and leases in Redis
    (:class:`~kvlife.tiers.mooncake.MooncakeTier`, docs/remote.md)."""

    kind: ClassVar[str] = "mooncake"

    master: str
    """Master RPC address, ``127.0.0.1:50051``."""
    metadata: str
    """HTTP metadata server, ``http://127.0.0.1:8080/metadata``."""
    index: str
    """The Redis holding the records and leases: ``redis://...`` or ``cluster://...``."""
    local_hostname: str = "127.0.0.1"
    """This client's address in the transfer engine."""
    segment_bytes: int = 256 * MiB
    """Memory this client contributes to the pool (0: none, a pure client)."""
    buffer_bytes: int = 64 * MiB
    """The client's local transfer buffer."""
    read_lease_s: float = 2.0
    """The master's ``--default_kv_lease_ttl``: a removal refused because a reader holds
    the object is retried after this."""
    register_buffers: bool | None = None
    """Register buffers with the transfer engine around each call (RDMA needs it; None:
    only when the protocol is not tcp)."""
    read_group_bytes: int = 8 * MiB
    """A large read is fetched in groups of about this many bytes, each verified while
    the next is copied; 0: the whole batch in one call, verified after
    (:attr:`~kvlife.tiers.mooncake.MooncakeConfig.read_group_bytes`)."""

    def check(self) -> None:
        SharedIndexOptions.check(self)
        if not self.master:
            raise self.bad("master", "must be host:port")
        if not self.metadata.startswith("http://"):
            raise self.bad("metadata", f"must be http://..., got {self.metadata!r}")
        if not _redis_address(self.index):
            raise self.bad("index", f"must be redis://... or cluster://..., got {self.index!r}")
        if self.segment_bytes < 0:
            raise self.bad("segment_bytes", f"must be >= 0, got {self.segment_bytes}")
        if self.buffer_bytes <= 0:
            raise self.bad("buffer_bytes", f"must be > 0, got {self.buffer_bytes}")
        if self.read_lease_s <= 0:
            raise self.bad("read_lease_s", f"must be > 0, got {self.read_lease_s}")
        if self.read_group_bytes < 0:
            raise self.bad("read_group_bytes", f"must be >= 0, got {self.read_group_bytes}")
