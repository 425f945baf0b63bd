"""KVStore: the one facade an engine talks to.

``KVStore.open(path, dram_bytes=..., disk_bytes=...)`` is the embedded default: a host
DRAM tier in front of a disk tier (segment files + SQLite catalog) under ``path``. The
store owns the object index and the lifecycle: every move goes through
:func:`kvlife.core.lifecycle.check_move` and is emitted to the event sink, and only
INDEXED objects are ever served.

Policies: puts land in DRAM (or straight on disk when there is no DRAM tier); when DRAM
is full the least recently used objects are written back to disk (demotion) and dropped
from DRAM; a disk hit is copied back into DRAM (promotion). With ``write_through`` every
put is also made durable on disk before it returns. ``flush()`` makes every DRAM-only
object durable; ``close()`` flushes.

Concurrency: every public method takes one re-entrant lock, so threads of one process
may share a store. A store directory is held by one process at a time: a second
``open`` of the same path raises :class:`~kvlife.core.errors.StoreLockedError`.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Literal

import numpy as np

from kvlife.core.errors import (
    InvalidArgument,
    KVLifeError,
    LayoutMismatch,
    PartialChunkError,
    ReplicaReadError,
    StorageFullError,
    StoreClosedError,
    StoreLockedError,
    StorePathError,
)
from kvlife.core.events import EventSink, LifecycleEvent, NullSink
from kvlife.core.identity import (
    ROOT_PARENT,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    prompt_chunk_keys,
)
from kvlife.core.lifecycle import Move, ObjectState, check_move
from kvlife.core.objects import ObjectInfo, ObjectRecord
from kvlife.core.payload import as_numpy, check_chunk, numpy_dtype
from kvlife.index.prefix import ObjectIndex
from kvlife.policy.base import EvictionPolicy, make_policy
from kvlife.results import (
    ChunkHit,
    LoadResult,
    LookupResult,
    PutResult,
    StoreCounters,
    StoreInfo,
    TierInfo,
)
from kvlife.tiers.base import CapacityShortfall, ReadResult, ReplicaMeta, Reservation, Tier
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.tier import CheckReport
from kvlife.tiers.memory import MemoryTier

GiB = 1 << 30
DRAM = "dram"
DISK = "disk"
INDEXED = ObjectState.INDEXED
STORE_FORMAT = 1


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of an embedded store."""

    dram_bytes: int = 1 * GiB
    """Host-DRAM tier budget (0: no DRAM tier)."""
    disk_bytes: int = 8 * GiB
    """Disk tier budget including garbage awaiting reclaim (0: no disk tier)."""
    policy: str = "lru"
    """Eviction policy of each tier, by registered name."""
    write_through: bool = False
    """Make every put durable on disk before it returns."""
    promote_on_hit: bool = True
    """Copy disk hits into DRAM."""
    segment_bytes: int = 256 << 20
    """Disk segment file size."""
    direct_io: bool | None = None
    """O_DIRECT on the disk tier: None detects."""
    verify_on_open: Literal["none", "header", "full"] = "header"
    """What recovery checks for each durable replica."""

    def __post_init__(self) -> None:
        if self.dram_bytes < 0 or self.disk_bytes < 0:
            raise InvalidArgument(
                f"tier budgets must be >= 0 (dram_bytes={self.dram_bytes}, "
                f"disk_bytes={self.disk_bytes})"
            )
        if self.dram_bytes == 0 and self.disk_bytes == 0:
            raise InvalidArgument("a store needs at least one tier (dram_bytes or disk_bytes > 0)")
        if self.write_through and self.disk_bytes == 0:
            raise InvalidArgument("write_through needs a disk tier (disk_bytes > 0)")


@dataclass(slots=True)
class PendingPut:
    """TENTATIVE chunks of one prompt between ``prepare_put`` and ``commit_put``."""

    keys: list[ChunkKey]
    tokens_per_chunk: int
    request_id: str
    items: list[tuple[ObjectRecord, np.ndarray]] = field(default_factory=list)
    present: int = 0
    in_flight: int = 0
    """Chunks another pending put is writing (one object per key)."""
    done: bool = False


class KVStore:
    """Typed KV objects with full identity, an enforced lifecycle and crash-safe tiers."""

    def __init__(
        self,
        path: str | Path,
        config: StoreConfig,
        *,
        sink: EventSink | None = None,
        fileio: FileIO | None = None,
    ) -> None:
        self.path = Path(path)
        self.config = config
        self.sink: EventSink = sink if sink is not None else NullSink()
        self._emitting = not isinstance(self.sink, NullSink)
        self._lock = threading.RLock()
        self._seq = 0
        self._tentative = 0
        self._pending_puts: dict[int, PendingPut] = {}
        self._pending_keys: set[ChunkKey] = set()
        self._closed = False
        self.counters = StoreCounters()
        self._index = ObjectIndex()
        self._lockfile = _take_lock(self.path)
        self.dram: MemoryTier | None = None
        self.disk: DiskTier | None = None
        self._policies: dict[str, EvictionPolicy[object]] = {}
        try:
            if config.dram_bytes > 0:
                self.dram = MemoryTier(config.dram_bytes, DRAM)
                self._policies[DRAM] = make_policy(config.policy)
            if config.disk_bytes > 0:
                self.disk = DiskTier(
                    self.path / "disk",
                    DiskTierConfig(
                        capacity_bytes=config.disk_bytes,
                        segment_bytes=config.segment_bytes,
                        direct_io=config.direct_io,
                        verify_on_open=config.verify_on_open,
                    ),
                    name=DISK,
                    fileio=fileio,
                )
                self._policies[DISK] = make_policy(config.policy)
                self._lifetime_base = self.disk.catalog.load_counters()
                self._recover()
            else:
                self._lifetime_base = {}
        except BaseException:
            self._release()
            raise

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        dram_bytes: int = 1 * GiB,
        disk_bytes: int = 8 * GiB,
        sink: EventSink | None = None,
        fileio: FileIO | None = None,
        **settings: object,
    ) -> KVStore:
        """Open (or create) the store at ``path``; see :class:`StoreConfig` for settings."""
        config = StoreConfig(dram_bytes=dram_bytes, disk_bytes=disk_bytes, **settings)  # type: ignore[arg-type]
        return cls(path, config, sink=sink, fileio=fileio)

    # ------------------------------------------------------------------ lifecycle plumbing

    def _move(
        self,
        rec: ObjectRecord,
        move: Move,
        *,
        tier: str = "",
        dst: str = "",
        nbytes: int = 0,
        reason: str = "",
        request_id: str = "",
    ) -> None:
        old_state = rec.state
        new_state = check_move(rec.key.hex(), old_state, move)
        if new_state is not old_state:
            if new_state is ObjectState.TENTATIVE:
                self._tentative += 1
            elif old_state is ObjectState.TENTATIVE:
                self._tentative -= 1
        rec.state = new_state
        self._seq += 1
        if self._emitting:
            self.sink.emit(
                LifecycleEvent(
                    time=time.time(),
                    seq=self._seq,
                    kind=move.value,
                    key=rec.key.hex(),
                    state=new_state.value if new_state else "",
                    tier=tier,
                    dst_tier=dst,
                    nbytes=nbytes,
                    namespace=rec.info.namespace,
                    model=rec.info.weights_digest,
                    reason=reason,
                    request_id=request_id,
                )
            )

    def _tier(self, name: str) -> Tier:
        tier = self.dram if name == DRAM else self.disk
        if tier is None:
            raise KVLifeError(f"store has no {name} tier")
        return tier

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    # ------------------------------------------------------------------ put

    def put_prompt(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        request_id: str = "",
    ) -> PutResult:
        """Store the full chunks of a prompt's KV (``prepare_put`` + ``commit_put``).

        ``kv`` is one array (or CPU tensor) shaped ``(layers, 2, kv_heads, T, head_dim)``
        with ``chunks * tokens_per_chunk <= T <= len(tokens)``, or a sequence of chunk
        arrays shaped like ``identity.layout.chunk_shape``. A trailing partial chunk is
        never stored (it is recomputed on the next request). Everything is validated
        before anything is written.
        """
        pending = self.prepare_put(
            identity,
            namespace,
            tokens,
            kv,
            start=start,
            parent=parent,
            extra_keys=extra_keys,
            request_id=request_id,
        )
        return self.commit_put(pending)

    def prepare_put(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        request_id: str = "",
    ) -> PendingPut:
        """Validate and create TENTATIVE objects for the prompt's new chunks.

        Nothing is written or visible until :meth:`commit_put`; :meth:`abort_put` rolls
        back. The arrays in ``kv`` are referenced, not copied: keep them unchanged until
        the commit or abort.
        """
        self._check_open()
        keys = prompt_chunk_keys(
            identity, namespace, tokens, start=start, parent=parent, extra_keys=extra_keys
        )
        chunks = _split_chunks(kv, identity.layout, len(keys), len(tokens))
        layout = identity.layout
        dtype = numpy_dtype(layout.dtype)
        with self._lock:
            self._check_open()
            self.counters.puts += 1
            pending = PendingPut(keys, layout.tokens_per_chunk, request_id)
            prev = parent
            for i, (key, arr) in enumerate(zip(keys, chunks, strict=True)):
                rec = self._index.get(key)
                if rec is not None:
                    pending.present += 1  # touched in commit_put, in prompt order
                elif key in self._pending_keys:
                    pending.in_flight += 1  # one object per key: the other put writes it
                else:
                    info = ObjectInfo.for_chunk(
                        identity, namespace, prev, start + i * layout.tokens_per_chunk
                    )
                    rec = ObjectRecord(
                        key, info, dtype.name, layout.chunk_shape, layout.chunk_nbytes
                    )
                    self._move(rec, Move.PUT, nbytes=rec.nbytes, request_id=request_id)
                    pending.items.append((rec, arr))
                    self._pending_keys.add(key)
                prev = key
            self._pending_puts[id(pending)] = pending
            return pending

    def commit_put(self, pending: PendingPut) -> PutResult:
        """Write, make durable as the tier promises, then index the pending chunks.

        On a write error every chunk of the batch is aborted and the typed error is
        raised; nothing of the batch is visible.
        """
        self._check_open()
        with self._lock:
            self._finish_pending(pending)
            fresh = pending.items
            try:
                stored = self._store_new(fresh, pending.request_id, set(pending.keys))
                if self.config.write_through:
                    self._write_through(pending.keys, [r for r, _ in fresh])
            except BaseException:
                for rec, _ in fresh:  # e.g. a fault while making room: nothing of it stays
                    if rec.state is ObjectState.TENTATIVE:
                        self._move(rec, Move.ABORT, reason="write failed")
                        self.counters.aborted += 1
                raise
            self._touch_in_order(pending.keys, {r.key for r, _ in fresh})
            self.counters.chunks_stored += stored
            self.counters.chunks_already_present += pending.present
            self.counters.chunks_dropped += len(fresh) - stored
            covered = 0
            for key in pending.keys:
                if key not in self._index:
                    break
                covered += 1
            return PutResult(
                chunks=len(pending.keys),
                stored=stored,
                already_present=pending.present,
                in_flight=pending.in_flight,
                dropped=len(fresh) - stored,
                tokens_stored_or_present=covered * pending.tokens_per_chunk,
                keys=pending.keys,
            )

    def abort_put(self, pending: PendingPut, reason: str = "aborted by caller") -> None:
        """Roll back a pending put: its TENTATIVE objects become DELETED."""
        with self._lock:
            self._finish_pending(pending)
            for rec, _ in pending.items:
                self._move(rec, Move.ABORT, reason=reason)
                self.counters.aborted += 1

    def _finish_pending(self, pending: PendingPut) -> None:
        if pending.done or self._pending_puts.pop(id(pending), None) is None:
            raise InvalidArgument(
                "this pending put was already committed or aborted, or its store was closed"
            )
        pending.done = True
        for rec, _ in pending.items:
            self._pending_keys.discard(rec.key)

    def evict(self, tier_name: str, nbytes: int) -> int:
        """Evict least valuable replicas from a tier until ``nbytes`` are freed (DRAM
        victims are written back to disk first). Returns the bytes freed."""
        self._check_open()
        if nbytes < 0:
            raise InvalidArgument(f"cannot free a negative number of bytes ({nbytes})")
        with self._lock:
            policy = self._policies.get(tier_name)
            if policy is None:
                raise InvalidArgument(f"store has no tier {tier_name!r}")
            victims = self._choose_victims(tier_name, policy, CapacityShortfall(nbytes), set())
            self._evict(tier_name, victims)
            return sum(r.nbytes for r in victims)

    def _touch_in_order(self, keys: list[ChunkKey], new: set[ChunkKey]) -> None:
        """Tell each tier's policy about a put's chunks in prompt order: the new ones are
        inserted, present ones touched. Policies then see one use per chunk in the order
        of the prompt, which is what the replay simulator models (docs/replay.md)."""
        for key in keys:
            rec = self._index.get(key)
            if rec is None or rec.state is not INDEXED:
                continue
            for tier_name in (DRAM, DISK):
                if tier_name in rec.tiers:
                    policy = self._policies[tier_name]
                    if key in new and key not in policy:
                        policy.insert(key)
                    else:
                        policy.touch(key)

    def _store_new(
        self,
        items: list[tuple[ObjectRecord, np.ndarray]],
        request_id: str,
        protected: set[ChunkKey],
    ) -> int:
        """Write TENTATIVE objects to the first tier that takes them; returns how many.

        Making room never evicts a chunk in ``protected`` (the whole prompt being put).
        Policies learn of the new objects in :meth:`_touch_in_order`.
        """
        if not items:
            return 0
        first = DRAM if self.dram is not None else DISK
        recs = [r for r, _ in items]
        res = self._make_room(first, recs, protected=protected)
        if res is not None:
            self._commit(first, res, items, request_id)
            done = len(items)
        else:
            done = 0
            for item in items:  # the batch is larger than the tier: place chunk by chunk
                placed = False
                for tier_name in (DRAM, DISK):
                    if tier_name in self._policies:
                        r = self._make_room(tier_name, [item[0]], protected=protected)
                        if r is not None:
                            self._commit(tier_name, r, [item], request_id)
                            placed = True
                            break
                if not placed:
                    self._move(item[0], Move.ABORT, reason="no room in any tier")
                    self.counters.aborted += 1
                else:
                    done += 1
        return done

    def _write_through(self, keys: list[ChunkKey], new: list[ObjectRecord]) -> None:
        """Make every indexed chunk of a prompt durable, present ones included (their
        disk replica may have been evicted). On failure the put's new chunks are dropped:
        not durable means not stored."""
        recs = [self._index.get(k) for k in keys]
        pending = [r for r in recs if r is not None and DISK not in r.tiers]
        try:
            for i in range(0, len(pending), 64):
                self._write_back(pending[i : i + 64], reason="write-through", raise_errors=True)
        except BaseException:
            for rec in new:
                if rec.state is INDEXED and DISK not in rec.tiers:
                    self._drop(rec, Move.INVALIDATE, "write-through failed")
            raise

    def _commit(
        self,
        tier_name: str,
        res: Reservation,
        items: list[tuple[ObjectRecord, np.ndarray]],
        request_id: str,
    ) -> None:
        """Write a batch to one tier and publish it (policies hear of it afterwards, in
        prompt order, from :meth:`_touch_in_order`)."""
        tier = self._tier(tier_name)
        try:
            tier.commit_store(res, [a for _, a in items])
        except BaseException:
            for rec, _ in items:
                self._move(rec, Move.ABORT, tier=tier_name, reason="write failed")
                self.counters.aborted += 1
            raise
        for rec, _ in items:
            self._move(rec, Move.WRITE, tier=tier_name, nbytes=rec.nbytes, request_id=request_id)
            self._move(rec, Move.SEAL, tier=tier_name, nbytes=rec.nbytes)
            self._move(rec, Move.COMMIT, tier=tier_name)
            self._move(rec, Move.INDEX, tier=tier_name)
            rec.tiers.add(tier_name)
            self._index.add(rec)

    def _make_room(
        self, tier_name: str, recs: Sequence[ObjectRecord], protected: set[ChunkKey]
    ) -> Reservation | None:
        """Reserve room for ``recs`` in a tier, evicting (and demoting) others as needed."""
        tier = self._tier(tier_name)
        metas = [ReplicaMeta(r.key, r.dtype, r.shape, "exact", r.info.encode()) for r in recs]
        policy = self._policies[tier_name]
        while True:
            res = tier.prepare_store(metas)
            self._reap_lost()
            if isinstance(res, Reservation):
                return res
            victims = self._choose_victims(tier_name, policy, res, protected)
            if not victims:
                return None
            self._evict(tier_name, victims)

    def _choose_victims(
        self,
        tier_name: str,
        policy: EvictionPolicy[object],
        short: CapacityShortfall,
        protected: set[ChunkKey],
    ) -> list[ObjectRecord]:
        victims: list[ObjectRecord] = []
        freed = 0
        footprint = self._tier(tier_name).footprint
        while freed < short.need_bytes:
            got = policy.evict(1, protected)
            if not got:
                break
            rec = self._index.get(ChunkKey(got[0]))  # type: ignore[arg-type]
            if rec is None or tier_name not in rec.tiers:
                continue
            victims.append(rec)
            freed += footprint(rec.nbytes)
        return victims

    def _evict(self, tier_name: str, victims: list[ObjectRecord]) -> None:
        """Drop replicas from a tier; DRAM victims are written back to disk first."""
        if tier_name == DRAM and self.disk is not None:
            self._write_back([r for r in victims if DISK not in r.tiers], reason="demote")
        tier = self._tier(tier_name)
        if isinstance(tier, DiskTier):
            tier.delete_batch([r.key for r in victims])
        else:
            for rec in victims:
                tier.delete(rec.key)
        for rec in victims:
            rec.tiers.discard(tier_name)
            self._move(rec, Move.EVICT, tier=tier_name, nbytes=rec.nbytes, reason="capacity")
            if tier_name == DRAM:
                self.counters.evictions_dram += 1
            else:
                self.counters.evictions_disk += 1
            if not rec.tiers:
                self._drop(rec, Move.INVALIDATE, "evicted")

    def _write_back(
        self, recs: list[ObjectRecord], *, reason: str, raise_errors: bool = False
    ) -> int:
        """Copy DRAM replicas to disk (one batch); returns how many became durable."""
        if not recs or self.disk is None or self.dram is None:
            return 0
        protected = {r.key for r in recs}
        res = self._make_room(DISK, recs, protected)
        if res is None:
            if raise_errors:
                raise StorageFullError(
                    f"disk tier of {self.path} cannot hold {len(recs)} chunks "
                    f"({sum(r.nbytes for r in recs)} bytes) even after eviction"
                )
            return 0
        arrays = [
            a for a in self.dram.read_batch([r.key for r in recs]) if isinstance(a, np.ndarray)
        ]
        try:
            self.disk.commit_store(res, arrays)
        except KVLifeError:
            if raise_errors:
                raise
            return 0
        policy = self._policies[DISK]
        for rec in recs:
            rec.tiers.add(DISK)
            policy.insert(rec.key)
            self._move(rec, Move.OFFLOAD, tier=DRAM, dst=DISK, nbytes=rec.nbytes, reason=reason)
            if reason == "demote":
                self.counters.demotions += 1
        return len(recs)

    def _drop(self, rec: ObjectRecord, move: Move, reason: str) -> None:
        """Invalidate (or mark corrupt) and delete an object, removing every replica."""
        if rec.state is INDEXED or rec.state is ObjectState.COMMITTED:
            self._move(rec, move, reason=reason)
        for tier_name in list(rec.tiers):
            self._tier(tier_name).delete(rec.key)
            self._policies[tier_name].remove(rec.key)
        rec.tiers.clear()
        for policy in self._policies.values():
            policy.remove(rec.key)
        self._move(rec, Move.DELETE, reason=reason)
        self._index.remove(rec.key)

    def _reap_lost(self) -> None:
        """Drop replicas the disk tier gave up on by itself (found corrupt in compaction)."""
        if self.disk is None:
            return
        for key, why in self.disk.take_lost():
            rec = self._index.get(key)
            if rec is None:
                self.counters.recovery_dropped += 1
                continue
            rec.tiers.discard(DISK)
            self._policies[DISK].remove(key)
            self.counters.corrupt += 1
            if not rec.tiers:
                self._drop(rec, Move.CORRUPT, f"corrupt: {why}")

    # ------------------------------------------------------------------ lookup and load

    def lookup(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
    ) -> LookupResult:
        """The longest run of INDEXED leading chunks, with the tier of each."""
        self._check_open()
        keys = prompt_chunk_keys(
            identity, namespace, tokens, start=start, parent=parent, extra_keys=extra_keys
        )
        n = identity.layout.tokens_per_chunk
        hits: list[ChunkHit] = []
        with self._lock:
            self._reap_lost()
            get = self._index.get
            for i, key in enumerate(keys):
                rec = get(key)
                if rec is None or rec.state is not INDEXED:
                    break
                hits.append(ChunkHit(i, key, start + i * n, DRAM if DRAM in rec.tiers else DISK))
            for hit in reversed(hits):  # the head of a chain is evicted last
                self._policies[hit.tier].touch(hit.key)
            self.counters.lookups += 1
            self.counters.lookup_chunks_hit += len(hits)
            self.counters.lookup_chunks_miss += len(keys) - len(hits)
        return LookupResult(hits, len(keys), n)

    def load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> LoadResult:
        """Load the hits of ``lookup`` in order, verifying every disk read.

        Into ``outs`` (one buffer per hit) or new read-only arrays (zero-copy views of
        DRAM replicas; fresh disk reads, which promotion then adopts into DRAM).
        The first chunk that is gone or fails verification ends the result: it and every
        chunk after it are misses; a corrupt replica is invalidated (reason ``corrupt``).
        """
        self._check_open()
        hits = lookup.hits
        if outs is not None and len(outs) != len(hits):
            raise InvalidArgument(f"{len(outs)} output buffers for {len(hits)} hits")
        with self._lock:
            self._reap_lost()
            self.counters.loads += 1
            recs: list[ObjectRecord] = []
            for hit in hits:
                rec = self._index.get(hit.key)
                if rec is None or rec.state is not INDEXED:
                    break
                recs.append(rec)
            vanished = len(hits) - len(recs)
            where = [DRAM if DRAM in r.tiers else DISK for r in recs]
            results: list[ReadResult | None] = [None] * len(recs)
            for tier_name in (DRAM, DISK):
                idx = [i for i, w in enumerate(where) if w == tier_name]
                if not idx:
                    continue
                got = self._tier(tier_name).read_batch(
                    [recs[i].key for i in idx], [outs[i] for i in idx] if outs is not None else None
                )
                for i, r in zip(idx, got, strict=True):
                    results[i] = r
            out = LoadResult([], 0, len(hits), vanished=vanished)
            promote: list[tuple[ObjectRecord, np.ndarray]] = []
            for rec, tier_name, res in zip(recs, where, results, strict=True):
                if isinstance(res, ReplicaReadError):
                    self.counters.read_errors += 1  # a miss; the replica may read next time
                    out.read_errors += 1
                    break
                if not isinstance(res, np.ndarray):
                    self._corrupt(rec, tier_name, str(res))
                    out.corrupt.append(rec.key)
                    break
                r = res
                out.arrays.append(r)
                out.tiers[tier_name] = out.tiers.get(tier_name, 0) + 1
                self._move(rec, Move.LOAD, tier=tier_name, nbytes=rec.nbytes, request_id=request_id)
                if tier_name == DISK:
                    promote.append((rec, r))
            out.loaded = len(out.arrays)
            out.vanished = vanished if not (out.corrupt or out.read_errors) else 0
            self.counters.vanished += out.vanished
            self.counters.chunks_loaded_dram += out.tiers.get(DRAM, 0)
            self.counters.chunks_loaded_disk += out.tiers.get(DISK, 0)
            self.counters.bytes_loaded += sum(a.nbytes for a in out.arrays)
            if promote and self.dram is not None and self.config.promote_on_hit:
                self._promote(promote, adopt=outs is None)
            return out

    def _corrupt(self, rec: ObjectRecord, tier_name: str, detail: str) -> None:
        self.counters.corrupt += 1
        self._drop(rec, Move.CORRUPT, f"corrupt: {detail}")

    def _promote(self, items: list[tuple[ObjectRecord, np.ndarray]], *, adopt: bool) -> None:
        """Copy disk hits into DRAM; arrays the disk read allocated are adopted, not copied
        (they become read-only, like every DRAM hit handed out without a buffer)."""
        recs = [r for r, _ in items]
        res = self._make_room(DRAM, recs, protected={r.key for r in recs})
        if res is None:
            return
        assert self.dram is not None
        if adopt:
            self.dram.commit_adopt(res, [a for _, a in items])
        else:
            self.dram.commit_store(res, [a for _, a in items])
        for rec in recs:
            rec.tiers.add(DRAM)
            self._policies[DRAM].insert(rec.key)
            self._move(rec, Move.OFFLOAD, tier=DISK, dst=DRAM, nbytes=rec.nbytes, reason="promote")
            self.counters.promotions += 1

    def get(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        **kwargs: object,
    ) -> LoadResult:
        """lookup + load in one call."""
        return self.load(self.lookup(identity, namespace, tokens, **kwargs))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ invalidation

    def invalidate(
        self,
        *,
        weights_digest: str | None = None,
        adapter_id: str | None = None,
        namespace: Namespace | None = None,
        prefix: ChunkKey | None = None,
    ) -> int:
        """Invalidate and delete every object matching all the given criteria.

        ``prefix`` selects that chunk and every chunk chained after it. Returns the number
        of objects removed.
        """
        self._check_open()
        if weights_digest is None and adapter_id is None and namespace is None and prefix is None:
            raise InvalidArgument("invalidate needs at least one criterion")
        with self._lock:
            sets: list[set[ChunkKey]] = []
            reasons: list[str] = []
            if weights_digest is not None:
                sets.append(self._index.by_weights(weights_digest))
                reasons.append("weights")
            if adapter_id is not None:
                sets.append(self._index.by_adapter(adapter_id))
                reasons.append("adapter")
            if namespace is not None:
                sets.append(self._index.by_namespace(str(namespace)))
                reasons.append("namespace")
            if prefix is not None:
                sets.append(set(self._index.subtree([prefix])))
                reasons.append("prefix")
            chosen = set.intersection(*sets)
            reason = "invalidated:" + "+".join(reasons)
            recs = [r for r in (self._index.get(k) for k in chosen) if r is not None]
            disk_keys = [r.key for r in recs if DISK in r.tiers]
            if disk_keys and self.disk is not None:
                self.disk.delete_batch(disk_keys)
                for rec in recs:
                    rec.tiers.discard(DISK)
                    self._policies[DISK].remove(rec.key)
            for rec in recs:
                self._drop(rec, Move.INVALIDATE, reason)
            self.counters.invalidated += len(recs)
            return len(recs)

    # ------------------------------------------------------------------ recovery, flush, info

    def _recover(self) -> None:
        assert self.disk is not None
        policy = self._policies[DISK]
        for key in self.disk.replica_keys():
            meta = self.disk.meta(key)
            try:
                info = ObjectInfo.decode(meta.info)
            except InvalidArgument:
                self.disk.delete(key)
                self.counters.recovery_dropped += 1
                continue
            rec = ObjectRecord(key, info, meta.dtype, meta.shape, meta.nbytes)
            self._move(rec, Move.RECOVER, tier=DISK, nbytes=rec.nbytes, reason="reopen")
            self._move(rec, Move.INDEX, tier=DISK)
            rec.tiers.add(DISK)
            self._index.add(rec)
            policy.insert(key)
            self.counters.recovered += 1
        self.counters.recovery_dropped += len(self.disk.take_lost())

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> CheckReport:
        """Audit every disk replica (payload checksums included) and the segment files;
        with ``fix``, drop bad replicas (their objects are invalidated as corrupt) and
        delete orphan segments."""
        self._check_open()
        with self._lock:
            if self.disk is None:
                return CheckReport()
            report = self.disk.check(fix=fix, progress=progress)
            self._reap_lost()
            return report

    def flush(self) -> int:
        """Write every DRAM-only object to disk; returns how many became durable."""
        self._check_open()
        with self._lock:
            if self.disk is None or self.dram is None:
                return 0
            pending = [r for r in self._index if r.state is INDEXED and DISK not in r.tiers]
            done = 0
            for i in range(0, len(pending), 64):
                done += self._write_back(pending[i : i + 64], reason="flush", raise_errors=True)
            self._save_counters()
            return done

    def _save_counters(self) -> None:
        if self.disk is not None:
            total = self.counters.add(self._lifetime_base).as_dict()
            self.disk.catalog.save_counters(total)

    def info(self) -> StoreInfo:
        self._check_open()
        with self._lock:
            by_state: dict[str, int] = {s.value: 0 for s in ObjectState}
            bytes_by_state: dict[str, int] = {s.value: 0 for s in ObjectState}
            for rec in self._index:
                if rec.state is not None:
                    by_state[rec.state.value] += 1
                    bytes_by_state[rec.state.value] += rec.nbytes
            by_state[ObjectState.TENTATIVE.value] = self._tentative
            tiers: list[TierInfo] = []
            if self.dram is not None:
                tiers.append(
                    TierInfo(
                        DRAM,
                        self.dram.capacity_bytes,
                        self.dram.used_bytes,
                        len(self.dram.replica_keys()),
                    )
                )
            if self.disk is not None:
                d = self.disk
                tiers.append(
                    TierInfo(
                        DISK,
                        d.capacity_bytes,
                        d.used_bytes,
                        len(d.replica_keys()),
                        {
                            "direct_io": d.direct_io,
                            "live_bytes": d.live_bytes,
                            "segments": d.segment_count,
                            **asdict(d.stats),
                        },
                    )
                )
            return StoreInfo(
                str(self.path),
                tiers,
                by_state,
                bytes_by_state,
                self.counters.as_dict(),
                self.counters.add(self._lifetime_base).as_dict(),
            )

    def close(self, *, flush: bool = True) -> None:
        """Flush DRAM-only objects to disk (unless ``flush=False``), then release all."""
        with self._lock:
            if self._closed:
                return
            for pending in list(self._pending_puts.values()):
                self.abort_put(pending, reason="store closed")
            try:
                if flush:
                    self.flush()
                else:
                    self._save_counters()
            finally:
                self._closed = True
                self.sink.flush()
                self._release()

    def _release(self) -> None:
        for tier in (self.dram, self.disk):
            if tier is not None:
                tier.close()
        _drop_lock(self._lockfile)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def indexed_keys(self) -> list[ChunkKey]:
        """Keys of every indexed object."""
        with self._lock:
            return [r.key for r in self._index if r.state is INDEXED]


def _split_chunks(kv: object, layout: KVLayout, nchunks: int, ntokens: int) -> list[np.ndarray]:
    """Validate ``kv`` against the layout and cut it into ``nchunks`` chunk arrays."""
    n = layout.tokens_per_chunk
    if isinstance(kv, (list, tuple)):
        arrays = [as_numpy(a, layout.dtype) for a in kv]
        if len(arrays) < nchunks:
            raise LayoutMismatch(
                f"{len(arrays)} chunk arrays for a prompt of {nchunks} full chunks"
            )
        for i, arr in enumerate(arrays):
            if arr.ndim == 5 and arr.shape[3] < n and arr.shape[:3] == layout.chunk_shape[:3]:
                raise PartialChunkError(
                    f"chunk {i} holds {arr.shape[3]} tokens; only full chunks of {n} tokens "
                    "are stored (leave a trailing partial chunk out)"
                )
            check_chunk(arr, layout, f"chunk {i}")
        return arrays[:nchunks]
    arr = as_numpy(kv, layout.dtype)
    want = (layout.num_layers, 2, layout.num_kv_heads)
    if arr.ndim != 5 or arr.shape[:3] != want or arr.shape[4] != layout.head_dim:
        raise LayoutMismatch(
            f"KV has shape {arr.shape}; layout needs (layers={want[0]}, 2, "
            f"kv_heads={want[2]}, T, head_dim={layout.head_dim})"
        )
    tlen = arr.shape[3]
    if tlen < nchunks * n or tlen > ntokens:
        raise LayoutMismatch(
            f"KV covers {tlen} tokens; the prompt has {ntokens} tokens ({nchunks} full chunks "
            f"of {n}), so T must lie in [{nchunks * n}, {ntokens}]"
        )
    return [arr[:, :, :, i * n : (i + 1) * n, :] for i in range(nchunks)]


def _take_lock(path: Path) -> IO[str]:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fh = (path / "LOCK").open("a+", encoding="utf-8")
    except OSError as exc:
        raise StorePathError(f"cannot create or open the store at {path}: {exc}") from exc
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise StoreLockedError(
            f"store {path} is open in another process (pid {holder}); a kvlife store is "
            "used by one process at a time"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def _drop_lock(fh: IO[str]) -> None:
    if not fh.closed:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()
