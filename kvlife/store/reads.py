"""Reads: lookups, verified loads (synchronous and asynchronous, with per-chunk
completion) and promotion of hits into the first tier, off the caller's path.

A load pins the replica of each hit under the index lock, reads without the lock, then
publishes under it: a chunk whose object was invalidated or evicted meanwhile is a miss
(``vanished``), a corrupt replica invalidates its object, an I/O error is a miss that
keeps the replica. The first failed chunk ends the result. A pinned replica is never an
eviction victim. Hits served from a slower tier are promoted by a background thread in
plan order (``drain()`` waits for it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvlife.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    KVLifeError,
    ReplicaNotFound,
    ReplicaReadError,
)
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import ObjectRecord, PromptRef, Replica, TierName
from kvlife.results import ChunkHit, LoadResult, LookupResult
from kvlife.store.core import Bound, StoreCore
from kvlife.store.executor import execute
from kvlife.tiers.base import ReadResult, Tier

INDEXED = ObjectState.INDEXED


@dataclass(slots=True)
class _Item:
    rec: ObjectRecord
    tier: TierName
    rep: Replica
    out: np.ndarray | None
    result: ReadResult | ReplicaNotFound | None = None
    """The read's outcome; ReplicaNotFound when the replica was deleted under the read."""
    done: threading.Event = field(default_factory=threading.Event)


class LoadHandle:
    """An asynchronous load: chunks complete in any order, results are taken in order.

    ``chunk(i)`` waits for chunk ``i`` and returns its array, or None when it (or a chunk
    before it) is a miss; ``wait()`` returns the :class:`LoadResult`; ``done()`` says
    whether every read has finished.
    """

    def __init__(
        self, reader: Reader, items: list[_Item], requested: int, vanished: int, request_id: str
    ) -> None:
        self._reader = reader
        self._items = items
        self._requested = requested
        self._vanished = vanished
        self._request_id = request_id
        self._left = len(items)
        self._lock = threading.Lock()
        self._result: LoadResult | None = None
        self._finished = threading.Event()
        self._error: BaseException | None = None
        if not items:
            self._publish()

    def __len__(self) -> int:
        return len(self._items)

    def _complete(self, item: _Item, result: ReadResult | BaseException) -> None:
        # a tier *returns* ChecksumMismatch / ReplicaReadError as read outcomes (they are
        # exceptions too): only what it raised is turned into a read error here
        outcome = (ReplicaNotFound, ChecksumMismatch, ReplicaReadError)
        if isinstance(result, BaseException) and not isinstance(result, outcome):
            if not isinstance(result, KVLifeError):  # a bug, not a miss: wait() raises it
                self._error = self._error or result
            result = ReplicaReadError(item.rec.key.hex(), item.tier, f"read failed: {result}")
        item.result = result
        item.done.set()
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._publish()

    def _publish(self) -> None:
        try:
            self._result = self._reader.publish(
                self._items, self._requested, self._vanished, self._request_id
            )
        except BaseException as exc:  # raised to whoever waits, not lost in a pool thread
            self._error = self._error or exc
        finally:
            self._finished.set()

    def chunk(self, i: int, timeout: float | None = None) -> np.ndarray | None:
        """Chunk ``i`` once it and every chunk before it verified; None if one is a miss."""
        if not 0 <= i < self._requested:
            raise InvalidArgument(f"chunk {i} is not in this load of {self._requested} hits")
        if i >= len(self._items):
            return None
        for j in range(i + 1):
            item = self._items[j]
            if not item.done.wait(timeout):
                raise TimeoutError(f"chunk {j} did not complete within {timeout} s")
            if not isinstance(item.result, np.ndarray):
                return None
        res = self._items[i].result
        return res if isinstance(res, np.ndarray) else None

    def completed(self) -> int:
        """Leading chunks whose reads finished."""
        n = 0
        for item in self._items:
            if not item.done.is_set():
                break
            n += 1
        return n

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> LoadResult:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"load did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _read_run(tier: Tier, run: Sequence[_Item]) -> list[ReadResult | ReplicaNotFound]:
    """Read consecutive chunks of one tier; a replica deleted under the read (by an
    invalidation) is reported as such, one chunk at a time from there on."""
    keys = [it.rec.key for it in run]
    outs = [it.out for it in run] if run[0].out is not None else None
    try:
        return list(tier.read_batch(keys, outs))
    except ReplicaNotFound:
        pass
    got: list[ReadResult | ReplicaNotFound] = []
    for i, key in enumerate(keys):
        try:
            got.append(tier.read_batch([key], [outs[i]] if outs is not None else None)[0])
        except ReplicaNotFound as exc:
            got.append(exc)
            break  # the first miss ends the result: later chunks are not read
    return got


class Reader:
    """The read side of a store."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ lookup

    def lookup(self, prompt: PromptRef) -> LookupResult:
        core = self.core
        core.check_open()
        keys = prompt.keys()
        n = prompt.tokens_per_chunk
        start = prompt.start
        hits: list[ChunkHit] = []
        with core.lock:
            doomed = core.reap_lost()
            get = core.index.get
            for i, key in enumerate(keys):
                rec = get(key)
                if rec is None or rec.state is not INDEXED:
                    break
                tier = core.fastest(rec)
                if tier is None:
                    break
                hits.append(ChunkHit(i, key, start + i * n, tier))
            core.placement.touch_hits([(h.key, h.tier) for h in hits])
            core.counters.lookups += 1
            core.counters.lookup_chunks_hit += len(hits)
            core.counters.lookup_chunks_miss += len(keys) - len(hits)
            core.delete_later(doomed)
        return LookupResult(hits, len(keys), n)

    # ------------------------------------------------------------------ load

    def _start(
        self, lookup: LookupResult, outs: Sequence[np.ndarray] | None
    ) -> tuple[list[_Item], int]:
        core = self.core
        core.check_open()
        hits = lookup.hits
        if outs is not None and len(outs) != len(hits):
            raise InvalidArgument(f"{len(outs)} output buffers for {len(hits)} hits")
        items: list[_Item] = []
        with core.lock:
            doomed = core.reap_lost()
            core.counters.loads += 1
            for i, hit in enumerate(hits):
                rec = core.index.get(hit.key)
                if rec is None or rec.state is not INDEXED:
                    break
                tier = core.fastest(rec)
                if tier is None:
                    break
                items.append(
                    _Item(rec, tier, core.pin(rec, tier), outs[i] if outs is not None else None)
                )
            core.delete_later(doomed)
        return items, len(hits) - len(items)

    def load(
        self, lookup: LookupResult, outs: Sequence[np.ndarray] | None, request_id: str
    ) -> LoadResult:
        """Read in the caller's thread, one batch per run of chunks in the same tier."""
        items, vanished = self._start(lookup, outs)
        try:
            i = 0
            while i < len(items):
                j = i
                while j < len(items) and items[j].tier == items[i].tier:
                    j += 1
                run = items[i:j]
                tier = self.core.tiers[run[0].tier]
                got = _read_run(tier, run)
                for it, res in zip(run, got, strict=False):
                    it.result = res
                if any(not isinstance(r, np.ndarray) for r in got):
                    break  # the first miss ends the result: later chunks are not read
                i = j
        except BaseException:
            self._unpin_all(items)
            raise
        return self.publish(items, len(lookup.hits), vanished, request_id)

    def load_async(
        self, lookup: LookupResult, outs: Sequence[np.ndarray] | None, request_id: str
    ) -> LoadHandle:
        """Submit one read per chunk to the I/O pool, in order."""
        items, vanished = self._start(lookup, outs)
        handle = LoadHandle(self, items, len(lookup.hits), vanished, request_id)
        pool = self._io_pool()
        tiers = self.core.tiers
        for item in items:

            def read(it: _Item = item) -> None:
                try:
                    res = tiers[it.tier].read_batch(
                        [it.rec.key], [it.out] if it.out is not None else None
                    )[0]
                except BaseException as exc:  # handed to the handle as a typed miss
                    handle._complete(it, exc)
                    return
                handle._complete(it, res)

            pool.submit(read)
        return handle

    def publish(
        self, items: list[_Item], requested: int, vanished: int, request_id: str
    ) -> LoadResult:
        """Take the reads' outcomes in order (under the lock), unpin, start promotion."""
        core = self.core
        out = LoadResult([], 0, requested, vanished=vanished)
        promote: list[_Item] = []
        doomed: list[tuple[TierName, ChunkKey]] = []
        first = core.chain[0].name
        with core.lock:
            ended = False
            for it in items:
                res, rec = it.result, it.rec
                if ended or res is None:
                    ended = True
                elif isinstance(res, ReplicaReadError):
                    core.counters.read_errors += 1  # a miss; the replica may read next time
                    out.read_errors += 1
                    ended = True
                elif isinstance(res, ChecksumMismatch):
                    core.counters.corrupt += 1
                    out.corrupt.append(rec.key)
                    if rec.state is INDEXED:
                        doomed += core.retire(rec, Move.CORRUPT, f"corrupt: {res}")
                    ended = True
                elif isinstance(res, ReplicaNotFound) or rec.state is not INDEXED:
                    out.vanished += 1  # invalidated or evicted while it was read
                    ended = True
                else:
                    out.arrays.append(res)
                    out.tiers[it.tier] = out.tiers.get(it.tier, 0) + 1
                    core.ledger.move(
                        rec, Move.LOAD, tier=it.tier, nbytes=rec.nbytes, request_id=request_id
                    )
                    tc = core.counters.tier(it.tier)
                    tc.loaded += 1
                    tc.bytes_loaded += res.nbytes
                    if it.tier != first:
                        promote.append(it)
                        continue  # stays pinned until its promotion ran
                core.unpin(rec, it.rep)
            out.loaded = len(out.arrays)
            if out.corrupt or out.read_errors:
                out.vanished = 0
            core.counters.vanished += out.vanished
            core.counters.bytes_loaded += sum(a.nbytes for a in out.arrays)
            if promote and core.config.promote_on_hit and len(core.chain) > 1:
                core.placement.plan_promote([it.rec.key for it in promote])
                bound = core.residency.take()
                owned = {
                    it.rec.key: it.result
                    for it in promote
                    if it.out is None and isinstance(it.result, np.ndarray)
                }
                # submitted under the lock with its ticket: background jobs queue in
                # ticket order, so the one background thread never waits on a later one
                core.later(core.seq.take(), lambda: self._promote(bound, promote, owned))
            elif promote:
                for it in promote:
                    core.unpin(it.rec, it.rep)
            core.delete_later(doomed)
        return out

    def _promote(
        self, bound: list[Bound], pinned: list[_Item], owned: dict[ChunkKey, np.ndarray]
    ) -> None:
        """Execute a promotion plan (in its turn, on the background thread)."""
        try:
            execute(self.core, bound, sources=owned)
        finally:  # inside the turn, so that drain() returns with the pins released
            self._unpin_all(pinned)

    def _unpin_all(self, items: list[_Item]) -> None:
        with self.core.lock:
            for it in items:
                self.core.unpin(it.rec, it.rep)

    # ------------------------------------------------------------------ pools

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.core.config.io_threads, thread_name_prefix="kvlife-load"
                )
            return self._pool

    def drain(self) -> None:
        """Wait until every planned promotion (and any plan taken before) has run."""
        self.core.seq.wait_idle()

    def close(self) -> None:
        self.drain()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = None
        self.core.stop_background()
