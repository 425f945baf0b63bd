"""Writes: two-phase puts, write-through, flush and explicit eviction.

A put is planned under the index lock (placement decides where the new chunks go and
what makes room), executed outside it in its sequencer turn, and published under it.
Its TENTATIVE objects are in the index from ``prepare_put`` on (so a second put of the
same chunk leaves it to the first) but are never served until they are INDEXED. They
carry the creation stamp of the moment the put was prepared (the global invalidation
epoch, :mod:`kvlife.store.shared`), and an invalidation covers them like any live
object (:mod:`kvlife.store.invalidation`): a chunk invalidated while its put was in
flight is not stored (``commit_put`` leaves it out, or, if its bytes are being written
already, deletes them when the write returns).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvlife.core.errors import (
    InvalidArgument,
    LayoutMismatch,
    PartialChunkError,
    ReplicaNotFound,
    StorageFullError,
    StoreClosedError,
    StorePathError,
)
from kvlife.core.identity import ChunkKey, KVLayout
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import ObjectInfo, ObjectRecord, PromptRef, TierName
from kvlife.core.payload import as_numpy, check_chunk, numpy_dtype
from kvlife.placement import Evict, Plan, Reject
from kvlife.results import PutResult
from kvlife.store.core import StoreCore
from kvlife.store.deletes import delete_or_keep
from kvlife.store.executor import execute
from kvlife.store.invalidation import covered_at_birth, raced_a_rule, record_sources
from kvlife.store.shared import creation_stamp, stamp_moved
from kvlife.tiers.base import dtype_name

INDEXED = ObjectState.INDEXED
TENTATIVE = ObjectState.TENTATIVE


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
    wt_seen: int = 0
    """Write-through: ``write_through_failed`` when the put was prepared (a failure
    since may have taken chunks of its prompt it found indexed or in flight)."""
    done: bool = False
    seals: dict[ChunkKey, bytes] = field(default_factory=dict)
    """The xxh3-128 of new chunks' arrays, hashed by the writer as they were written
    (the server while its client copies the next chunk): the DRAM tier seals them with
    it instead of hashing at commit (``execute``'s ``seals``)."""


class Writer:
    """The write side of a store."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self._pending: dict[int, PendingPut] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._shut = False
        """The pool was shut by :meth:`close`: no other is started."""

    def put_async(self, pending: PendingPut) -> Future[PutResult]:
        """``commit_put`` on a background thread (puts run one plan at a time anyway)."""
        self.core.check_open()
        with self._pool_lock:
            if self._shut:  # closing: a pool started now would outlive the store
                raise StoreClosedError(f"store {self.core.path} is closed (or closing)")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlife-put")
            return self._pool.submit(self.commit_put, pending)

    def close(self) -> None:
        with self._pool_lock:
            self._shut = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------------ puts

    def prepare_put(self, prompt: PromptRef, kv: object, request_id: str) -> PendingPut:
        core = self.core
        core.check_open()
        keys = prompt.keys()
        layout = prompt.identity.layout
        chunks = split_chunks(kv, layout, len(keys), len(prompt.tokens))
        dtype = dtype_name(numpy_dtype(layout.dtype))
        n = layout.tokens_per_chunk
        born = creation_stamp(core)  # before the lock: the first one may read the index
        with core.lock:
            core.check_accepting_puts()
            core.counters.puts += 1
            pending = PendingPut(keys, n, request_id)
            pending.wt_seen = core.counters.write_through_failed
            prev = prompt.parent
            deps = record_sources(core, prompt, len(keys))
            for i, (key, arr) in enumerate(zip(keys, chunks, strict=True)):
                rec = core.index.get(key)
                if rec is not None and rec.state is INDEXED:
                    pending.present += 1  # touched at commit, in prompt order
                elif rec is not None:
                    pending.in_flight += 1  # one object per key: the other put writes it
                else:
                    info = ObjectInfo.for_chunk(
                        prompt.identity, prompt.namespace, prev, prompt.start + i * n, deps[i]
                    )
                    rec = ObjectRecord(
                        key, info, dtype, layout.chunk_shape, layout.chunk_nbytes, born=born
                    )
                    core.ledger.move(rec, Move.PUT, nbytes=rec.nbytes, request_id=request_id)
                    core.index.add(rec)
                    pending.items.append((rec, arr))
                prev = key
            if core.invalidating:  # an invalidation under way covers this put too
                covered_at_birth(core, [r for r, _ in pending.items])
            if stamp_moved(core, born):
                raced_a_rule(core, [r for r, _ in pending.items])
            self._pending[id(pending)] = pending
            return pending

    def commit_put(self, pending: PendingPut) -> PutResult:
        core = self.core
        core.check_open()
        with core.lock:
            core.check_accepting_puts()  # before anything changes: closing gives no ticket
            self._finish(pending)
            fresh = _still_tentative(pending)  # an invalidation took the others
            keep = {id(r) for r in fresh}
            _, placed = core.placement.plan_put(pending.keys, [r.key for r in fresh])
            wt = Plan()
            if core.config.write_through:
                live = [k for k in pending.keys if _live(core, k)]
                wt = core.placement.plan_copies(
                    live, core.durable[0], "write-through", protected=pending.keys
                )
            core.placement.touch_in_order(pending.keys, placed)
            bound = core.residency.take()
            for b in bound:
                if isinstance(b.action, Reject):
                    core.ledger.move(b.rec, Move.ABORT, reason=b.action.reason)
                    core.counters.aborted += 1
                    core.index.remove(b.rec.key)
            ticket = core.seq.take()
        with core.seq.turn(ticket):
            out = execute(
                core,
                bound,
                payloads={r.key: a for r, a in pending.items if id(r) in keep},
                request_id=pending.request_id,
                protect=set(pending.keys),
                seals=pending.seals,
            )
            if core.config.write_through:
                # in this put's turn: a later put that found these chunks indexed sees
                # them durable or already gone, never in between
                # its own chunks whose seal failed as they were copied (bytes written
                # after they were sealed, or seals a writer sent that are not theirs)
                wt_errors = out.copy_errors("write-through") + [
                    out.unsealed[k] for k in pending.keys if k in out.unsealed
                ]
                with core.lock:
                    lost = _not_durable(core, pending)
                if not wt.complete or wt_errors or lost:
                    self._undo_write_through(fresh, wt_errors, wt.complete, lost)
        if out.failed_places:
            raise next(iter(out.failed_places.values()))
        if out.errors:
            raise out.errors[0]
        with core.lock:
            stored = len(out.placed)
            core.counters.chunks_stored += stored
            core.counters.chunks_already_present += pending.present
            core.counters.chunks_dropped += len(fresh) - stored
            covered = 0
            for key in pending.keys:
                rec = core.index.get(key)
                if rec is None or rec.state is not INDEXED:
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

    def _undo_write_through(
        self,
        fresh: list[ObjectRecord],
        errors: list[Exception],
        complete: bool,
        lost: list[ChunkKey],
    ) -> None:
        """Not durable means not stored: every new chunk of the put goes (those a first
        copy batch made durable too), each counted and explained, and the error is
        raised. Runs in the put's sequencer turn. ``lost``: chunks of the prompt the put
        cannot promise durable (:func:`_not_durable`)."""
        core = self.core
        doomed: list[tuple[TierName, ChunkKey]] = []
        durable = core.durable[0]
        with core.lock:
            for rec in fresh:
                if rec.state is INDEXED:
                    doomed += core.retire(rec, Move.INVALIDATE, "write-through failed")
                    core.counters.write_through_failed += 1
        delete_or_keep(core, doomed)  # a failure here is not the put's error
        if errors:
            raise errors[0]
        if not complete:
            raise StorageFullError(
                f"tier {durable} of {core.path} cannot hold the put's chunks even after "
                "eviction (write-through: nothing of the put was stored)"
            )
        raise StorePathError(
            f"write-through: {len(lost)} chunk(s) of this prompt are not durable in tier "
            f"{durable} of {core.path} (the copy of another write this put counted on "
            "failed, or making room evicted them); nothing of this put was stored"
        )

    def abort_put(self, pending: PendingPut, reason: str) -> None:
        core = self.core
        with core.lock:
            self._finish(pending)
            for rec in _still_tentative(pending):
                core.ledger.move(rec, Move.ABORT, reason=reason)
                core.counters.aborted += 1
                core.index.remove(rec.key)

    def abort_all(self, reason: str) -> None:
        """Abort every pending put (at close). Under the index lock throughout: a
        background ``commit_put`` that took one of them from a list made outside it made
        its abort raise, out of ``close`` before anything was released."""
        with self.core.lock:
            for pending in list(self._pending.values()):
                self.abort_put(pending, reason)

    def _finish(self, pending: PendingPut) -> None:
        if pending.done or self._pending.pop(id(pending), None) is None:
            raise InvalidArgument(
                "this pending put was already committed or aborted, or its store was closed"
            )
        pending.done = True

    # ------------------------------------------------------------------ flush, evict

    def flush(self) -> int:
        """Copy every readable object without a durable replica to the first durable
        tier; raises StorageFullError if it cannot hold them, the write error if one
        failed. A copy whose source replica went away under it (an eviction, a
        re-adoption of a shared object, an invalidation) is planned again from the
        object's replicas then, a few times, before its ReplicaNotFound is raised."""
        done = 0
        for attempt in range(_FLUSH_TRIES):
            copied, failed, full = self._flush_once()
            done += copied
            vanished = bool(failed) and all(isinstance(e, ReplicaNotFound) for e in failed)
            if vanished and attempt < _FLUSH_TRIES - 1:
                continue  # a fresh plan, from the replicas the objects have now
            if failed:
                raise failed[0]
            if full is not None:
                raise full
            break
        return done

    def _flush_once(self) -> tuple[int, list[Exception], StorageFullError | None]:
        """One plan of the flush, executed: the replicas copied, the copies' errors, and
        the error to raise if the plan could not make room for them all."""
        core = self.core
        core.check_open()
        if not core.durable:
            return 0, [], None
        durable = core.durable[0]
        with core.lock:
            core.check_open()
            keys = [r.key for r in core.index if r.state is INDEXED and durable not in r.replicas]
            plan = core.placement.plan_copies(keys, durable, "flush")
            bound = core.residency.take()
            ticket = core.seq.take()
        with core.seq.turn(ticket):
            out = execute(core, bound)
        copied = (
            sum(1 for b in bound if b.action.__class__.__name__ == "Copy")
            - len(out.failed_copies)
            - len(out.unsealed)
        )
        full = None
        if not plan.complete:
            full = StorageFullError(
                f"tier {durable} of {core.path} cannot hold the {len(keys)} objects to flush "
                "even after eviction"
            )
        return copied, out.copy_errors("flush") + out.errors, full

    def evict(self, tier: TierName, nbytes: int) -> int:
        """Evict ``nbytes``' worth of replicas from ``tier``, coldest first by its policy:
        victims until the room they held there adds up to at least ``nbytes`` (or no
        unpinned replica is left), however much of its budget was free already; each
        victim held only there is demoted to the next tier first where the chain allows.
        Returns the payload bytes of the replicas evicted from it (a tier that stores
        frames or rounds to pages charges a replica a different room)."""
        core = self.core
        core.check_open()
        if not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"cannot free {nbytes!r} bytes (need an int >= 0)")
        with core.lock:
            core.check_open()
            if tier not in core.tiers:
                raise InvalidArgument(f"store has no tier {tier!r}; tiers: {list(core.tiers)}")
            core.placement.plan_evict(tier, nbytes, core.protected(()))
            bound = core.residency.take()
            ticket = core.seq.take()
        with core.seq.turn(ticket):
            out = execute(core, bound)
        if out.errors:
            raise out.errors[0]
        return sum(
            b.rec.nbytes for b in bound if isinstance(b.action, Evict) and b.action.tier == tier
        )


_FLUSH_TRIES = 3
"""Plans a flush makes when sources vanish under its copies (each a fresh plan)."""


def _still_tentative(pending: PendingPut) -> list[ObjectRecord]:
    """The put's new objects no invalidation took out of service meanwhile."""
    return [r for r, _ in pending.items if r.state is TENTATIVE]


def _not_durable(core: StoreCore, pending: PendingPut) -> list[ChunkKey]:
    """Write-through, at the end of the put's own turn (under the lock): the chunks of
    its prompt it cannot promise durable. An indexed chunk not readable in the durable
    tier (another write's copy it counted on failed; or making room for its own copies
    evicted it there). A chunk gone since a write-through failed in this store: that
    failure may have taken it (another put's copy this one found indexed or in flight);
    one an invalidation alone took is not a failure (the put then covers less). A chunk
    another pending put is writing is that put's promise."""
    durable = core.durable[0]
    failed_since = core.counters.write_through_failed != pending.wt_seen
    lost: list[ChunkKey] = []
    for key in pending.keys:
        rec = core.index.get(key)
        if rec is None or (rec.state is not INDEXED and rec.state is not TENTATIVE):
            if failed_since:
                lost.append(key)
        elif rec.state is INDEXED and not rec.readable_in(durable):
            lost.append(key)
    return lost


def _live(core: StoreCore, key: ChunkKey) -> bool:
    rec = core.index.get(key)
    return rec is not None and (rec.state is INDEXED or rec.state is TENTATIVE)


def split_chunks(kv: object, layout: KVLayout, nchunks: int, ntokens: int) -> list[np.ndarray]:
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
