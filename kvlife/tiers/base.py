"""The Tier interface: one narrow seam that every storage tier implements, plus the
small capability interfaces for what only some tiers can do.

Stores are two-phase: :meth:`Tier.prepare_store` reserves capacity (or reports the
shortfall as a typed result, never by raising), :meth:`Tier.commit_store` writes the
payloads, makes them as durable as the tier promises and only then makes them visible;
on any failure nothing of the batch is visible and the reservation is released.

Reads verify whatever the tier can verify. :meth:`Tier.read_batch` returns per-replica
outcomes as values (the verified array, the :class:`~kvlife.core.errors.ChecksumMismatch`
that proves a replica corrupt, or the :class:`~kvlife.core.errors.ReplicaReadError` of an
I/O failure), never wrong bytes; only :meth:`Tier.read` raises. Reads must be safe to
run from several threads at once and while another thread writes, without waiting for
that thread's I/O (see :meth:`Tier.read_batch`).

Optional abilities are capability interfaces (:class:`SupportsBatchDelete`,
:class:`SupportsAudit`, :class:`SupportsAdopt`, :class:`ReportsLostReplicas`,
:class:`PersistsCounters`, :class:`KeepsEdges`, :class:`SealedInMemory`,
:class:`SharedTier`); the store tests
``isinstance(tier, Capability)``, never a concrete tier class, so a new tier needs no
edit of the store.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, ReplicaReadError
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.core.payload import numpy_dtype

if TYPE_CHECKING:
    from kvlife.core.objects import EpochStamp
    from kvlife.globalindex.rules import InvalidationRule, RuleSync


class Durability(enum.Enum):
    """What a tier promises about a committed replica."""

    VOLATILE = "volatile"
    """Gone when the process ends (host DRAM)."""
    DURABLE = "durable"
    """Survives a process kill and a power cut once ``commit_store`` returned."""


@dataclass(frozen=True, slots=True)
class ReplicaMeta:
    """What a tier records about one replica besides its bytes."""

    key: ChunkKey
    """Chunk key."""
    dtype: str
    """numpy dtype name of the stored array."""
    shape: tuple[int, ...]
    """Shape of the stored array."""
    transform: str = "exact"
    """Representation (``exact`` for the engine's own bytes)."""
    info: bytes = b""
    """Opaque object metadata persisted with the replica (identity fields for recovery)."""
    checksum: bytes = b""
    """Content checksum (xxh3-128 of the payload's bytes) the tier verifies reads
    against. On a write, the checksum the payload is known by (empty: unknown): a tier
    that checksums what it writes (:class:`ChecksumsWrites`) takes it instead of hashing
    the payload again, or with ``verify_checksum`` checks the payload against it while
    it hashes anyway. A checksum taken as given that does not match the bytes makes the
    replica fail verification later (a counted miss), never serve wrong bytes."""
    form: bytes = b""
    """Opaque record of the replica's representation (the store's transform descriptor,
    :mod:`kvlife.store.forms`), persisted with the replica like ``info``; empty for the
    engine's own bytes."""
    verify_checksum: bool = False
    """On a write with a ``checksum``: a :class:`ChecksumsWrites` tier checks the payload
    against it (a mismatch fails the batch with a ChecksumMismatch naming the replica,
    nothing of the batch visible) instead of taking it as given: how a replica sealed
    in memory is verified on its way to disk without hashing it twice."""
    links: tuple[tuple[bytes, bytes], ...] = ()
    """On a write: prefix links (child key, parent key) that a tier which keeps edges
    (:class:`KeepsEdges`) makes durable in the same step as this replica: the replica's
    own link and those of its ancestors not kept yet (other tiers ignore them)."""
    born: bytes = b""
    """Opaque record of the global invalidation epoch the object's KV was created under
    (:class:`~kvlife.core.objects.EpochStamp`), persisted with the replica like
    ``info``; empty where unknown."""

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise InvalidArgument(f"replica key must be 32 bytes, got {len(self.key)}")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"replica shape {self.shape} has a negative dimension")

    @property
    def checksum_given(self) -> bool:
        """Whether a write takes ``checksum`` as given: known and not to be verified, so
        the payload is not hashed (else it is: its checksum unknown, or to be checked)."""
        return bool(self.checksum) and not self.verify_checksum

    @property
    def nbytes(self) -> int:
        n = numpy_dtype(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class CapacityShortfall:
    """Returned by prepare_store when the batch does not fit."""

    need_bytes: int
    """Bytes that must be freed before the batch fits."""


@dataclass(slots=True)
class Reservation:
    """Capacity reserved for one batch by prepare_store."""

    tier: str
    metas: list[ReplicaMeta]
    nbytes: int
    state: Any = field(default=None)
    """Tier-private bookkeeping."""
    done: bool = False


ReadResult = np.ndarray | ChecksumMismatch | ReplicaReadError
"""Per replica: the verified array, the mismatch that proves it corrupt, or the I/O
error that kept it from being read (a miss, the replica is kept)."""


class Tier(ABC):
    """A place that holds replicas: host DRAM, local disk, a remote store."""

    name: TierName
    capacity_bytes: int
    durability: Durability = Durability.VOLATILE
    """What a committed replica survives; a DURABLE tier is recovered at open."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes charged against the capacity (reserved ones included)."""

    @abstractmethod
    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        """Reserve room for ``metas``; nothing is visible yet."""

    @abstractmethod
    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        """Write, make durable, then publish. On failure: raise, publish nothing, release."""

    @abstractmethod
    def cancel_store(self, reservation: Reservation) -> None:
        """Release a reservation without writing."""

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def meta(self, key: ChunkKey) -> ReplicaMeta:
        """Metadata of a held replica (ReplicaNotFound if absent)."""

    @abstractmethod
    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        """Read replicas in order, into ``outs`` where given, else into new arrays.

        Outcomes are values, one per key: the array, the ChecksumMismatch of a replica
        that fails verification, or the ReplicaReadError of an I/O failure; the others
        are unaffected. ReplicaNotFound is raised for a key the tier does not hold.

        Concurrency contract: may be called from many threads at once and concurrently
        with one writer (``prepare_store`` with its reclaim, ``commit_store``,
        ``delete``). The tier's lock is held only for metadata (looking rows up,
        reserving offsets, publishing), never across a read, a write or an fsync, so a
        read never waits for another thread's I/O; N reading threads keep at least N
        reads in flight. A replica being read is not destroyed under its reader (its
        storage outlives every read in flight), so each read returns the replica's
        exact bytes or a typed miss.
        """

    @abstractmethod
    def delete(self, key: ChunkKey) -> int:
        """Drop a replica; return the bytes it held (ReplicaNotFound if absent)."""

    @abstractmethod
    def replica_keys(self) -> list[ChunkKey]: ...

    def footprint(self, nbytes: int) -> int:
        """Capacity a replica of ``nbytes`` payload bytes takes (framing included)."""
        return nbytes

    def close(self) -> None:
        """Release files and threads."""

    def details(self) -> dict[str, Any]:
        """Tier-specific figures for ``info`` (JSON-able)."""
        return {}

    def read(self, key: ChunkKey) -> np.ndarray:
        """One replica as a new array; raises ChecksumMismatch on corruption."""
        (result,) = self.read_batch([key])
        if isinstance(result, np.ndarray):
            return result
        raise result

    def store(self, metas: Sequence[ReplicaMeta], payloads: Sequence[np.ndarray]) -> bool:
        """prepare + commit in one call; False (nothing stored) when it does not fit."""
        res = self.prepare_store(metas)
        if isinstance(res, CapacityShortfall):
            return False
        self.commit_store(res, payloads)
        return True


class SupportsBatchDelete(ABC):
    """Capability: drop many replicas at the cost of one (e.g. one catalog transaction)."""

    @abstractmethod
    def delete_batch(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Drop replicas; return the payload bytes each held (ReplicaNotFound if absent)."""


class KeepsEdges(ABC):
    """Capability: a durable tier that keeps the prefix links (child key -> parent key)
    of every chunk it holds and of every ancestor those chunks were chained from, so
    that "a chunk and every chunk chained after it" reaches each durable chunk after a
    restart, whatever of its chain lived only in faster tiers or was lost.

    A replica's links are written with it (:attr:`ReplicaMeta.links`, in the replica's
    own durable step). A link is dropped only when the store says it leads to nothing
    any more (:meth:`delete_forgetting`, :meth:`forget_edges`)."""

    @abstractmethod
    def kept_parent(self, child: bytes) -> bytes | None:
        """The parent of ``child``'s kept link, None if none is kept (no I/O)."""

    @abstractmethod
    def keep_edges(self, links: Sequence[tuple[bytes, bytes]]) -> None:
        """Make ``links`` (child, parent) durable in one step."""

    @abstractmethod
    def delete_forgetting(self, keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        """``delete_batch`` that drops the kept links of ``forget`` in the same step."""

    @abstractmethod
    def load_edges(self) -> list[tuple[bytes, bytes]]:
        """Every kept link (child, parent)."""

    @abstractmethod
    def forget_edges(self, children: Sequence[bytes]) -> None:
        """Drop kept links that lead to nothing any more."""


class SupportsAdopt(ABC):
    """Capability: publish arrays the caller hands over for good, without a copy."""

    @abstractmethod
    def commit_adopt(self, reservation: Reservation, arrays: Sequence[np.ndarray]) -> None:
        """Like ``commit_store`` but takes ownership of ``arrays``: nobody may write them
        any more (the store hands over only memory no caller can write: its own fresh
        reads and copies, or arrays already :func:`read_only`)."""


class ChecksumsWrites(ABC):  # noqa: B024 (a capability with no method of its own)
    """Capability: the tier computes the xxh3-128 of every payload it writes (a disk
    frame's checksum, a DRAM replica's seal) and honours :attr:`ReplicaMeta.checksum`
    and :attr:`ReplicaMeta.verify_checksum` on writes, so a copy never hashes its bytes
    twice: the destination takes the checksum as given or checks it as it hashes."""


class SealedInMemory(ABC):
    """Capability: replicas held in memory that something outside the tier could change
    (a caller forcing a returned view writable, a client writing a shared extent after
    its put committed), each sealed with the xxh3-128 of its bytes (:func:`seal_of`,
    the checksum disk frames carry) when published, kept as :attr:`ReplicaMeta.checksum`.
    Plain reads do not verify it; the store verifies where bytes leave memory (demotion,
    flush), in an audit, and on loads when asked to."""

    @abstractmethod
    def read_verified(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        """``read_batch`` that checks each replica against its seal first (a
        ChecksumMismatch for one that changed, nothing copied out of it)."""


class PipelinedReads(ABC):
    """Capability: the tier reads a run of replicas back to back in the caller's thread
    while a helper verifies each one read (the disk tier), so a load of a few chunks
    keeps the device busy while the checksums run."""

    @abstractmethod
    def read_pipelined(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[np.ndarray | None],
        done: Callable[[int, ReadResult], None],
        proceed: Callable[[], bool] | None = None,
    ) -> int:
        """Read every key's replica in order (into its ``outs`` buffer, or a new array
        for None); call ``done(i, result)`` once key ``i``'s outcome is known (any
        thread, any order); ask ``proceed`` before each read after the first (False:
        stop, the rest neither read nor given to ``done``). Returns, once every
        ``done`` has returned, how many were read. ReplicaNotFound, raised before
        anything is read, when a key has no replica here."""

    def reads_runs_natively(self) -> bool:
        """Whether a run is read and verified outside the interpreter lock in one call
        (no Python per chunk): then a load pipelines its runs on any number of CPUs,
        not only on one (issue 28)."""
        return False


class ReportsLostReplicas(ABC):
    """Capability: the tier may drop replicas by itself (found corrupt by recovery,
    compaction or an audit) and reports each, with why, exactly once."""

    @abstractmethod
    def take_lost(self) -> list[tuple[ChunkKey, str]]:
        """Replicas dropped since the last call, with the reason."""


@dataclass(slots=True)
class AuditReport:
    """Result of a tier audit (``check``)."""

    rows: int = 0
    """Replicas checked."""
    ok: int = 0
    """Replicas that verified."""
    problems: list[str] = field(default_factory=list)
    """Everything found wrong now: bad replicas, catalog integrity, generation."""
    bad_keys: list[bytes] = field(default_factory=list)
    """Keys of the bad replicas among ``problems``."""
    orphan_segments: list[str] = field(default_factory=list)
    """Segment files no catalog row refers to."""
    quarantined: list[str] = field(default_factory=list)
    """Rows an earlier open quarantined (not served), with why."""
    quarantined_files: list[str] = field(default_factory=list)
    """Files recovery set aside in ``quarantine/`` (not part of the store any more:
    listed, deleted by a fix, but not a reason for ``clean`` to be False, since a kill
    during a write routinely leaves one)."""
    generation: int | None = None
    """Catalog generation (transactions that deleted rows), where the tier has one."""
    actions: list[str] = field(default_factory=list)
    """What a fix did."""
    fixed: bool = False

    @property
    def clean(self) -> bool:
        return not self.problems and not self.orphan_segments and not self.quarantined

    def merge(self, other: AuditReport) -> None:
        """Add another tier's report to this one (a store audits every tier)."""
        self.rows += other.rows
        self.ok += other.ok
        for name in ("problems", "bad_keys", "orphan_segments", "quarantined"):
            getattr(self, name).extend(getattr(other, name))
        self.quarantined_files += other.quarantined_files
        self.actions += other.actions
        if other.generation is not None:
            self.generation = other.generation
        self.fixed = self.fixed or other.fixed


class SupportsAudit(ABC):
    """Capability: audit every held replica against its persisted metadata."""

    @abstractmethod
    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> AuditReport:
        """Verify every replica; with ``fix`` repair what can be repaired."""


class PersistsCounters(ABC):
    """Capability: durable storage for the store's lifetime counters."""

    @abstractmethod
    def load_counters(self) -> dict[str, int]: ...

    @abstractmethod
    def save_counters(self, counters: dict[str, int]) -> None: ...


class SharedTier(ABC):
    """Capability: a tier other hosts share through a global index (Redis, Mooncake
    Store). A local miss may be found there, and invalidations issued by any host reach
    this one through it. Calls that read the index raise RemoteTierError when it cannot
    be read: the store then serves nothing (a host cut off from the index may have
    missed an invalidation)."""

    @abstractmethod
    def sync_invalidations(self) -> RuleSync:
        """Read the index (its incarnation and epoch, and the rules not read yet); the
        rules this host has not applied yet, handed out again on every call until
        :meth:`invalidations_applied` (at-least-once)."""

    @abstractmethod
    def invalidations_applied(self, sync: RuleSync) -> None:
        """The store applied everything ``sync`` asked for to its local index."""

    @abstractmethod
    def creation_stamp(self) -> EpochStamp:
        """The stamp of KV created now: the index incarnation and epoch last read (the
        index is read once if it never was; unknown if it cannot be)."""

    @abstractmethod
    def stamp_now(self) -> EpochStamp:
        """The index incarnation and epoch last read, without I/O (unknown if the index
        was never read): what :meth:`creation_stamp` would answer now, to tell whether a
        rule may have been read (and applied) since a stamp was taken."""

    @abstractmethod
    def record_invalidation(
        self,
        *,
        namespace: str | None,
        adapter_id: str | None,
        weights_digest: str | None,
        prefix: bytes | None,
        source: str | None = None,
        versions: tuple[int, int] | None = None,
        model: str | None = None,
        keep_weights_digest: str | None = None,
    ) -> InvalidationRule:
        """Record a global invalidation (validated first) under a fresh epoch; every host
        applies it at its next lookup (criteria as :class:`InvalidationRule`'s)."""

    @abstractmethod
    def probe(self, keys: Sequence[ChunkKey], infos: Sequence[bytes]) -> list[ReplicaMeta]:
        """The leading run of ``keys`` published in the shared tier by any host whose
        record verifies, whose object info equals ``infos[i]`` byte for byte (the full
        identity), that was published under the index's current incarnation and that no
        invalidation rule covers; they are now charged to this tier as replicas of this
        host's store. Call after :meth:`sync_invalidations`."""

    @abstractmethod
    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Stop charging replicas the store does not keep (adopted by a probe but not
        used, or gone): never deletes anything."""

    @abstractmethod
    def take_gone(self) -> list[ChunkKey]:
        """Replicas this host held whose records other hosts deleted or replaced since
        the last call (found by reads): no longer this host's replicas. The store drops
        them, then calls :meth:`forget`."""


_read_hook = threading.local()


@contextlib.contextmanager
def when_read_returns(fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn`` once, in this thread, as soon as the next device read this thread
    issues has returned, before its bytes are verified (issue 28): a caller that reads
    one chunk at a time submits its next read from ``fn``, so that the checksum of this
    chunk overlaps the next chunk's read. A tier that signals it
    (:func:`device_read_returned`; the disk tier does, for reads in the caller's thread)
    frees the caller's read slot early; one that does not leaves ``fn`` uncalled, and
    the caller calls it after the read as before. Nothing is served earlier: the read's
    outcome is returned after its verification either way."""
    prev = getattr(_read_hook, "fn", None)
    _read_hook.fn = fn
    try:
        yield
    finally:
        _read_hook.fn = prev


def device_read_returned() -> None:
    """A tier's device read in this thread returned (its bytes not yet verified): run
    the hook :func:`when_read_returns` set, once; nothing when none is set."""
    fn = getattr(_read_hook, "fn", None)
    if fn is not None:
        _read_hook.fn = None
        fn()


def seal_of(arr: np.ndarray) -> bytes:
    """xxh3-128 of a C-contiguous array's bytes, read in place (the checksum a disk frame
    carries for the same bytes, so a seal can become a frame's checksum unchanged)."""
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"cannot seal a non-contiguous {arr.dtype}{list(arr.shape)} array")
    return bytes(xxhash.xxh3_128_digest(arr.reshape(-1).view(np.uint8).data))


def sealed_meta(meta: ReplicaMeta, seal: bytes) -> ReplicaMeta:
    """``meta`` as a tier holding it in memory records it: sealed with ``seal``, no links
    and nothing left to verify. What ``dataclasses.replace`` makes, without its cost
    (about 5 us per call, once per chunk of every DRAM put; issue 28)."""
    return ReplicaMeta(
        meta.key,
        meta.dtype,
        meta.shape,
        meta.transform,
        meta.info,
        seal,
        meta.form,
        False,
        (),
        born=meta.born,
    )


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def dtype_name(dtype: np.dtype[Any]) -> str:
    """``dtype.name``, remembered (numpy computes it in Python each time, about 4 us:
    once per chunk of every put)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def read_only(arr: np.ndarray) -> np.ndarray:
    """A view of a C-contiguous array's memory that nobody can make writable again:
    numpy refuses to set the write flag back on memory exported read-only. What a tier
    keeps or hands out when the memory is (or may become) a replica's."""
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"cannot export a non-contiguous {arr.dtype} array read-only")
    if arr.nbytes == 0:
        out = arr.view()
        out.flags.writeable = False
        return out
    flat = np.frombuffer(arr.reshape(-1).view(np.uint8).data.toreadonly(), np.uint8)
    if arr.dtype == np.uint8 and arr.ndim == 1:
        return flat  # itself the base of every view taken of it
    return flat.view(arr.dtype).reshape(arr.shape)


def check_payloads(metas: Sequence[ReplicaMeta], payloads: Sequence[np.ndarray]) -> None:
    """Raise InvalidArgument unless every payload matches its meta's dtype and shape."""
    if len(metas) != len(payloads):
        raise InvalidArgument(f"{len(metas)} replica metas but {len(payloads)} payloads")
    for meta, arr in zip(metas, payloads, strict=True):
        if arr.dtype != np.dtype(meta.dtype) or arr.shape != meta.shape:
            raise InvalidArgument(
                f"payload for {meta.key.hex()[:16]}… is {arr.dtype}{list(arr.shape)}, "
                f"its meta says {meta.dtype}{list(meta.shape)}"
            )
