"""Reads: lookups, verified loads (synchronous and asynchronous, with per-chunk
completion) and promotion of hits into the first tier, off the caller's path.

A lookup is one pass over the prompt under the store lock: one probe of the index for
every key, and the common chunk (a READY exact replica first in chain order) answered
without the general path, by the hit record its replica answered last time when that
record still holds (:meth:`Reader._leading_hits`); the answers are the general path's,
hit for hit.

A load pins the replica of each hit under the index lock, reads without the lock, then
publishes under it: a chunk whose object was invalidated or evicted meanwhile is a miss
(``vanished``), a corrupt replica invalidates its object, an I/O error is a miss that
keeps the replica. The first failed chunk ends the result. A pinned replica is never an
eviction victim. A store closed while an asynchronous load is in flight finishes the
reads already started; the chunks not read by then are misses, and the handle's
``wait()`` raises :class:`~kvlife.core.errors.StoreClosedError`. Hits served from a
slower tier are promoted by a background thread in plan order (``drain()`` waits for
it).

Ownership: a caller's output buffers are written, never kept; an array a load returns
without a buffer is read-only from the start and its flag cannot be set back (a DRAM
replica itself, or a new array: a disk read, a decoded frame). The promotion of a hit
returned without a buffer copies the returned array into the first tier (no second
read, no hash: it takes the checksum the read verified); it never adopts it, so nothing
handed to a caller becomes a replica. With
``verify_dram_on_load`` a replica read from a tier that seals replicas in memory is
verified against its seal first (a mismatch is a corrupt replica: a miss, invalidated).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvlife.core.errors import (
    ChecksumMismatch,
    CorruptFrame,
    InvalidArgument,
    KVLifeError,
    ReplicaNotFound,
    ReplicaReadError,
    StoreClosedError,
)
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import (
    EXACT,
    ObjectRecord,
    PromptRef,
    Replica,
    ReplicaState,
    Representation,
    TierName,
)
from kvlife.results import ChunkHit, LoadResult, LookupResult
from kvlife.store.core import Bound, Serving, StoreCore
from kvlife.store.executor import execute
from kvlife.store.forms import DecodeRates, decode_replica, exactness_of
from kvlife.store.shared import consult_shared
from kvlife.tiers.base import (
    PipelinedReads,
    ReadResult,
    SealedInMemory,
    Tier,
    read_only,
    seal_of,
    when_read_returns,
)
from kvlife.transforms.base import UnknownTransform
from kvlife.transforms.contract import Accept

Outcome = ReadResult | ReplicaNotFound | UnknownTransform | StoreClosedError
"""A chunk's read: the array, or why it is a miss (StoreClosedError: never read, the
store closed first)."""

E = TypeVar("E", bound=BaseException)
INDEXED = ObjectState.INDEXED
READY = ReplicaState.READY
EVICTING = ReplicaState.EVICTING


@dataclass(slots=True)
class _Item:
    rec: ObjectRecord
    tier: TierName
    rep: Replica
    out: np.ndarray | None
    result: Outcome | None = None
    """The read's outcome; ReplicaNotFound when the replica was deleted under the read,
    UnknownTransform when its frame names a transform this reader lacks."""
    promotable: bool = False
    """Served from a tier after the first: its result may be promoted."""
    seal: bytes = b""
    """xxh3-128 of a decoded result handed to the caller, taken as it was decoded: the
    seal its promotion records (the frame's checksum names the frame's bytes, not these;
    hashed at promotion, a caller's change made before it would be sealed as healthy)."""


class LoadCompletion:
    """What every asynchronous load handle shares: its result or error once finished,
    ``done()``, ``wait()``, and ``completed()`` over the per-chunk events."""

    def __init__(self) -> None:
        self._result: LoadResult | None = None
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def _chunk_events(self) -> Iterable[threading.Event]:
        raise NotImplementedError

    def completed(self) -> int:
        """Leading chunks whose reads finished."""
        n = 0
        for ev in self._chunk_events():
            if not ev.is_set():
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


class LoadHandle(LoadCompletion):
    """An asynchronous load: chunks complete in any order, results are taken in order.

    ``chunk(i)`` waits for chunk ``i`` and returns its array, or None when it (or a chunk
    before it) is a miss; ``wait()`` returns the :class:`LoadResult`; ``done()`` says
    whether every read has finished. If the store closes before every read started,
    the chunks read by then are still handed out by ``chunk(i)``, the others are misses,
    and ``wait()`` raises :class:`~kvlife.core.errors.StoreClosedError`.
    """

    def __init__(
        self, reader: Reader, items: list[_Item], requested: int, vanished: int, request_id: str
    ) -> None:
        super().__init__()
        self._reader = reader
        self._items = items
        self._requested = requested
        self._vanished = vanished
        self._request_id = request_id
        self._left = len(items)
        self._read = threading.Condition(threading.Lock())
        """Notified as each chunk's read finishes (its item's ``result`` set): one
        condition per load, not an Event per chunk (each Event is a Condition and a
        lock to make; issue 28, a served load's set-up)."""
        if not items:
            self._publish()

    def __len__(self) -> int:
        return len(self._items)

    def _complete(self, item: _Item, result: Outcome | BaseException) -> None:
        if isinstance(result, StoreClosedError):  # never read: a miss, and wait() says why
            self._error = self._error or result
        elif isinstance(result, BaseException) and not isinstance(
            result, (ReplicaNotFound, UnknownTransform, ChecksumMismatch, ReplicaReadError)
        ):
            if not isinstance(result, KVLifeError):  # a bug, not a miss: wait() raises it
                self._error = self._error or result
            result = ReplicaReadError(item.rec.key.hex(), item.tier, f"read failed: {result}")
        if isinstance(result, BaseException):
            _bare(result)
        with self._read:
            item.result = result
            self._left -= 1
            last = self._left == 0
            self._read.notify_all()
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
        with self._read:
            for j in range(i + 1):
                item = self._items[j]
                if item.result is None and not self._read.wait_for(
                    lambda item=item: item.result is not None,  # type: ignore[misc]
                    timeout,
                ):
                    raise TimeoutError(f"chunk {j} did not complete within {timeout} s")
                if not isinstance(item.result, np.ndarray):
                    return None
            res = self._items[i].result
        return res if isinstance(res, np.ndarray) else None

    def completed(self) -> int:
        """Leading chunks whose reads finished."""
        n = 0
        with self._read:
            for item in self._items:
                if item.result is None:
                    break
                n += 1
        return n


class _Feed:
    """Submits a load's reads to the I/O pool in order; with ``chained``, each finished
    read submits the next (so at most the initial number are in flight). An object, not
    two closures that call each other: those formed a reference cycle that kept the
    load's items, and the arena extents they read into, alive until the cyclic garbage
    collector ran (whose finalizers then ran on whichever thread set it off)."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        core: StoreCore,
        handle: LoadHandle,
        items: list[_Item],
        chained: bool,
        open_: Callable[[], bool] = lambda: True,
    ) -> None:
        self.pool = pool
        self.open = open_
        """Whether the store is still open (a pipelined load reads no chunk after a
        close began: those are misses, as the chained reads not yet submitted)."""
        self.tiers = core.tiers
        self.rates = core.decode_rates
        self.verify = core.config.verify_dram_on_load
        self.handle = handle
        self.queue = iter(items)
        self.lock = threading.Lock()
        self.chained = chained

    def read(self, it: _Item) -> None:
        nxt = _Next(self) if self.chained else None
        try:
            if nxt is None:
                res: Outcome | BaseException = _read_run(
                    self.tiers[it.tier], [it], self.rates, self.verify
                )[0]
            else:
                # the next read is submitted as soon as this one's device read returned
                # (a tier that says so: the disk tier), so that this chunk's checksum
                # (and copy) overlaps it; else after this read, as before
                with when_read_returns(nxt):
                    res = _read_run(self.tiers[it.tier], [it], self.rates, self.verify)[0]
        except BaseException as exc:  # handed to the handle as a typed miss
            res = exc
        if nxt is not None:
            nxt.submit()
        self.handle._complete(it, res)

    def pipelined(self) -> bool:
        """On one CPU, submit the whole load as one task that goes through its chunks
        in order: runs of plain replicas (no frame to decode) on a tier that reads so
        (the disk tier: ``read_pipelined``) read back to back, each chunk verified on the
        tier's check pool meanwhile, the other chunks read one at a time. Whether it was (False:
        on more CPUs, or with no such run, the chained reads, one chunk per task).

        Measured (issue 28), 4 chunks a load: through ``kvlife serve`` on one CPU the
        chained reads left the device idle while the thread that had read a chunk
        hashed it before the next read's thread could run (0.2-0.3 ms a pair at 2 MiB),
        and two reads in flight ran slower than one: 16 MiB loads went from 0.58 / 0.73
        of raw reads (ordinary / shared buffers) to 0.69 / 0.80, 2 MiB loads stayed
        within the noise. In one process on two CPUs the chained reads at depth 2 kept
        two in flight and were faster than these (2 MiB x 32: 0.79 against 0.69)."""
        items = list(self.queue)
        self.queue = iter(items)
        if not any(self._pipelinable(it) for it in items):
            return False
        if not _one_cpu() and not any(self._native(it) for it in items):
            return False
        try:
            self.pool.submit(self._pipeline, items)
        except RuntimeError:  # the pool shut down: the store is closing
            self.submit_next()  # completes every chunk as a typed miss
        return True

    def _same_run(self, first: _Item, it: _Item) -> bool:
        """``it`` continues a pipelined run that began with ``first``."""
        return it.tier == first.tier and self._pipelinable(it)

    def _pipelinable(self, it: _Item) -> bool:
        return isinstance(self.tiers[it.tier], PipelinedReads) and not it.rep.transform.framed

    def _native(self, it: _Item) -> bool:
        tier = self.tiers[it.tier]
        return (
            isinstance(tier, PipelinedReads)
            and not it.rep.transform.framed
            and tier.reads_runs_natively()
        )

    def _pipeline(self, items: list[_Item]) -> None:
        """The pipelined load's task: every chunk completed exactly once, whatever
        fails; no chunk read once the store began to close (those are misses, as the
        chained reads not yet submitted)."""
        finished = [False] * len(items)
        try:
            at, n = 0, len(items)
            while at < n and (at == 0 or self.open()):
                if not self._pipelinable(items[at]):
                    self.read_alone(items[at])
                    finished[at] = True
                    at += 1
                    continue
                end = at + 1
                while end < n and self._same_run(items[at], items[end]):
                    end += 1
                read = self._read_run_pipelined(items, range(at, end), finished)
                at += read
                if at < end:  # the store began to close under the run
                    break
            if not all(finished):
                self._fail_rest(items, finished, self._closed_at(items, finished))
        except BaseException as exc:  # never a load left waiting
            self._fail_rest(items, finished, exc)

    def _read_run_pipelined(self, items: list[_Item], run: range, finished: list[bool]) -> int:
        """Read one run of chunks of a pipelining tier; how many of them were read (or
        given another way: a replica gone before the reads, one chunk at a time)."""
        tier = self.tiers[items[run.start].tier]
        assert isinstance(tier, PipelinedReads)

        def done(j: int, res: ReadResult) -> None:
            i = run.start + j
            it = items[i]
            out: Outcome | BaseException
            try:
                out = _decoded(it, res, self.rates, it.tier)
            except BaseException as exc:  # the handle makes a miss (or an error) of it
                out = exc
            finished[i] = True
            self.handle._complete(it, out)

        try:
            read = tier.read_pipelined(
                [items[i].rec.key for i in run], [items[i].out for i in run], done, self.open
            )
        except (ReplicaNotFound, InvalidArgument):
            # a replica gone, or a buffer that does not fit, before anything was read:
            # one chunk at a time, as the chained reads (the chunks before it served)
            if any(finished[i] for i in run):
                raise
            read = 0
        # stopped early (the store closing, or a replica gone or replaced since the
        # run began): the rest one chunk at a time, each looked up when it is read, as
        # the chained reads do, so that none is read from a replica an invalidation
        # took before its read began
        for i in run[read:]:
            if i > run.start and not self.open():
                return i - run.start
            self.read_alone(items[i])
            finished[i] = True
        return len(run)

    @staticmethod
    def _closed_at(items: list[_Item], finished: list[bool]) -> StoreClosedError:
        first = items[finished.index(False)]
        return StoreClosedError(
            f"store closed while a load was in flight: chunk "
            f"{first.rec.key.hex()[:16]}… and the ones after it were not read"
        )

    def _fail_rest(self, items: list[_Item], finished: list[bool], exc: BaseException) -> None:
        for it, fin in zip(items, finished, strict=True):
            if not fin:
                self.handle._complete(it, exc)

    def read_alone(self, it: _Item) -> None:
        """Read one chunk in this thread (no next read to submit)."""
        try:
            res: Outcome | BaseException = _read_run(
                self.tiers[it.tier], [it], self.rates, self.verify
            )[0]
        except BaseException as exc:
            res = exc
        self.handle._complete(it, res)

    def submit_next(self) -> bool:
        """Submit the next chunk's read; whether one was submitted (False: none left, or
        the pool shut down and the rest were completed as misses)."""
        with self.lock:
            it = next(self.queue, None)
        while it is not None:
            try:
                self.pool.submit(self.read, it)
                return True
            except RuntimeError:  # the pool shut down: the store is closing
                # this chunk and every later one: misses, typed (wait() raises it)
                self.handle._complete(
                    it,
                    StoreClosedError(
                        f"store closed while a load was in flight: chunk "
                        f"{it.rec.key.hex()[:16]}… and the ones after it were not read"
                    ),
                )
            with self.lock:
                it = next(self.queue, None)
        return False


class _Next:
    """Submits a chained load's next read, once: called by the tier as soon as this
    read's device read returned (then it yields the CPU, below), else after the read.

    The yield: the thread that submitted goes on to hash its chunk, and the pool
    thread that takes the next read needs a CPU and the interpreter lock to reach its
    ``preadv``. On one CPU (``kvlife serve --cpus`` with one) it got neither until the
    hash was done, so the next read started no earlier than before (measured, issue
    28: 2 MiB chunks, the next read 350 µs after the last ended against 220 µs before
    the hook; with the yield 96 µs). ``os.sched_yield`` lets it run to its ``preadv``
    (where it blocks and gives both back) first. Only on one CPU: with more, the pool
    thread may run beside, and a yield could hand this CPU to any other runnable
    thread or process for a time slice (milliseconds) before the hash."""

    __slots__ = ("feed",)

    def __init__(self, feed: _Feed) -> None:
        self.feed: _Feed | None = feed

    def __call__(self) -> None:
        """The tier's hook: submit the next read and, on one CPU, let it start."""
        if self.submit() and _one_cpu():
            os.sched_yield()

    def submit(self) -> bool:
        """Submit the next read unless that was done; whether this call submitted one
        (not when none was left: the last chunk yields nothing, on a CPU shared with
        other processes a yield for nothing lost a time slice, 2 ms, measured)."""
        feed, self.feed = self.feed, None
        return feed is not None and feed.submit_next()


AFFINITY_TTL_S = 1.0
"""How long :func:`_one_cpu` reuses what it last read of the affinity (a system call of
3-5 us per load otherwise; a process pinned later is seen within this)."""

_affinity: list[float] = [-AFFINITY_TTL_S, 0.0]
"""When the affinity was last read (``time.monotonic``) and whether it was one CPU."""


def _one_cpu() -> bool:
    """This process may run on one CPU only (its affinity, read at most once per
    :data:`AFFINITY_TTL_S`)."""
    now = time.monotonic()
    if now - _affinity[0] < AFFINITY_TTL_S:
        return bool(_affinity[1])
    try:
        one = len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):  # no affinity on this platform
        one = False
    _affinity[:] = [now, float(one)]
    return one


def _read_run(
    tier: Tier, run: Sequence[_Item], rates: DecodeRates, verify: bool = False
) -> list[Outcome]:
    """Read consecutive chunks of one tier (decoding framed replicas into their
    buffers); a replica deleted under the read (by an invalidation) is reported as such,
    one chunk at a time from there on. ``verify``: check seals of replicas held in
    memory first (``verify_dram_on_load``)."""
    keys = [it.rec.key for it in run]
    outs = [it.out if not it.rep.transform.framed else None for it in run]
    plain = outs if any(o is not None for o in outs) else None
    read = tier.read_verified if verify and isinstance(tier, SealedInMemory) else tier.read_batch
    try:
        return [
            _decoded(it, r, rates, tier.name) for it, r in zip(run, read(keys, plain), strict=True)
        ]
    except ReplicaNotFound:
        pass
    got: list[Outcome] = []
    for it, key, out in zip(run, keys, outs, strict=True):
        try:
            got.append(_decoded(it, read([key], [out])[0], rates, tier.name))
        except ReplicaNotFound as exc:
            got.append(_bare(exc))
            break  # the first miss ends the result: later chunks are not read
    return got


def _decoded(it: _Item, res: ReadResult, rates: DecodeRates, where: TierName) -> Outcome:
    """A read's outcome, with a framed replica decoded into the item's buffer; an array
    not of the object's dtype and shape is a ChecksumMismatch (never served)."""
    if not isinstance(res, np.ndarray):
        return res
    if not it.rep.transform.framed:
        return _as_recorded(it.rec, res, where)
    try:
        got = decode_replica(it.rec, it.rep, res, it.out, where, rates)
    except (ChecksumMismatch, UnknownTransform) as exc:
        return _bare(exc)
    bad = _as_recorded(it.rec, got, where)
    if not isinstance(bad, np.ndarray) or it.out is not None:
        return bad
    if it.promotable:
        it.seal = seal_of(got)
    return read_only(got)  # a new array: nobody writes it


def _as_recorded(rec: ObjectRecord, arr: np.ndarray, where: TierName) -> Outcome:
    """``arr``, or a ChecksumMismatch if it is not of the dtype and shape the object was
    put with (a tier that hands back another array's bytes is caught here, whatever its
    checksums said: the engine would write it into its cache as this chunk)."""
    if arr.shape == tuple(rec.shape) and arr.dtype == np.dtype(rec.dtype):
        return arr
    return ChecksumMismatch(
        rec.key.hex(),
        where,
        f"read {arr.dtype}{list(arr.shape)}, the object is {rec.dtype}{list(rec.shape)}",
    )


class Reader:
    """The read side of a store."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        """Closed: no new I/O pool (asynchronous loads raise StoreClosedError)."""

    # ------------------------------------------------------------------ lookup

    def lookup(self, prompt: PromptRef, accept: Accept = Accept.EXACT) -> LookupResult:
        core = self.core
        core.check_open()
        if not isinstance(accept, Accept):
            raise InvalidArgument(f"accept must be an Accept, got {type(accept).__name__}")
        keys = prompt.keys()
        n = prompt.tokens_per_chunk
        with core.lock:
            doomed = core.reap_lost()
            hits, tiers, refusal = self._leading_hits(keys, prompt.start, n, accept)
            core.placement.touch_hits(keys[: len(hits)], tiers)
            core.counters.lookups += 1
            core.counters.lookup_chunks_hit += len(hits)
            core.counters.lookup_chunks_miss += len(keys) - len(hits)
            if refusal:
                core.counters.lookup_chunks_refused += 1
            core.delete_later(doomed)
        # a shared tier: global invalidations, and other hosts' KV where the run ended
        hits = consult_shared(core, prompt, keys, hits, accept, _hit)
        return LookupResult(hits, len(keys), n, accept, int(bool(refusal)), refusal)

    def _leading_hits(
        self, keys: list[ChunkKey], start: int, n: int, accept: Accept
    ) -> tuple[list[ChunkHit], list[TierName], str]:
        """The hits of the prompt's leading indexed chunks, the tier of each, and why the
        run ended if a chunk's replicas were refused (under the store lock).

        One pass: the index is probed for every key at once (a C-level map of dict
        lookups), and a chunk whose first readable replica in chain order is READY and
        exact (what :meth:`StoreCore.serving` answers for it whatever ``accept``: an
        exact replica is taken by every Accept) is served from it without the general
        path; its hit record is the one the replica answered last time when that one
        still says the same chunk, position, tier and size (hits are frozen), else a new
        one kept on the replica. Anything else (an EVICTING replica first, a transformed
        one, none readable) goes through ``serving`` as before: the same answers, hit
        for hit.
        """
        core = self.core
        chain = [t.name for t in core.chain]
        rates = core.decode_rates
        hits: list[ChunkHit] = []
        tiers: list[TierName] = []
        add_hit, add_tier = hits.append, tiers.append
        for i, rec in enumerate(core.index.get_many(keys)):
            if rec is None or rec.state is not INDEXED:
                break
            reps = rec.replicas
            rep: Replica | None = None
            for name in chain:
                rep = reps.get(name)
                if rep is not None and (rep.state is READY or rep.state is EVICTING):
                    break
            else:
                rep = None
            pos = start + i * n
            if (
                rep is not None
                and rep.state is READY
                and (rep.transform is EXACT or rep.transform.exact)
            ):
                h = rep.served
                if (
                    type(h) is not ChunkHit
                    or h.index != i
                    or h.start != pos
                    or h.tier != name
                    or h.stored_nbytes != rep.nbytes
                ):
                    h = rep.served = ChunkHit(i, rec.key, pos, name, stored_nbytes=rep.nbytes)
                add_hit(h)
                add_tier(name)
                continue
            got = core.serving(rec, accept)
            if got.unknown:
                self._explain_unknown(rec, got)
            if got.tier is None or got.replica is None:
                return hits, tiers, got.refused
            add_hit(_hit(i, rec.key, pos, got, rec, rates))
            add_tier(got.tier)
        return hits, tiers, ""

    def _explain_unknown(self, rec: ObjectRecord, got: Serving) -> None:
        """Count and explain (once per replica) replicas whose transform is unknown."""
        core = self.core
        for rep in got.unknown or ():
            if rep.noted:
                continue
            rep.noted = True
            core.counters.unknown_transform += 1
            form = rep.transform
            core.ledger.move(
                rec,
                Move.REFUSE,
                tier=rep.tier,
                nbytes=rep.nbytes,
                transform=form.name,
                reason=f"unknown transform {form.name!r} v{form.version}",
            )

    # ------------------------------------------------------------------ load

    def _start(
        self, lookup: LookupResult, outs: Sequence[np.ndarray] | None
    ) -> tuple[list[_Item], int]:
        """Pin the replica of each hit. ``outs`` were checked by the store's ``load`` or
        ``load_async`` (:func:`kvlife.store.args.outs`), the only callers."""
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
                tier = core.serving(rec, lookup.accept).tier
                if tier is None:
                    break
                out = outs[i] if outs is not None else None
                item = _Item(rec, tier, core.pin(rec, tier), out)
                item.promotable = tier != core.chain[0].name
                items.append(item)
            core.delete_later(doomed)
        return items, len(hits) - len(items)

    def load(
        self, lookup: LookupResult, outs: Sequence[np.ndarray] | None, request_id: str
    ) -> LoadResult:
        """Read in the caller's thread, one batch per run of chunks in the same tier."""
        items, vanished = self.read_pinned(lookup, outs)
        return self.publish(items, len(lookup.hits), vanished, request_id)

    def read_pinned(
        self, lookup: LookupResult, outs: Sequence[np.ndarray | None] | None
    ) -> tuple[list[_Item], int]:
        """The reads of :meth:`load`, not published: the hits' replicas pinned (the call
        counted among ``loads``) and read in the caller's thread, one batch per run of
        chunks in the same tier. The caller publishes them (:meth:`publish`, under the
        store's lock or not) or gives them up (:meth:`release`); a read that raises
        leaves nothing pinned. Returns the items and how many hits were gone at once."""
        with self.core.reading():
            return self._read_pinned(lookup, outs)

    def _read_pinned(
        self, lookup: LookupResult, outs: Sequence[np.ndarray | None] | None
    ) -> tuple[list[_Item], int]:
        items, vanished = self._start(lookup, outs)  # type: ignore[arg-type]
        verify = self.core.config.verify_dram_on_load
        try:
            i = 0
            while i < len(items):
                j = i
                while j < len(items) and items[j].tier == items[i].tier:
                    j += 1
                run = items[i:j]
                tier = self.core.tiers[run[0].tier]
                got = _read_run(tier, run, self.core.decode_rates, verify)
                for it, res in zip(run, got, strict=False):
                    it.result = res
                if any(not isinstance(r, np.ndarray) for r in got):
                    break  # the first miss ends the result: later chunks are not read
                i = j
        except BaseException:
            self._unpin_all(items)
            raise
        return items, vanished

    def release(self, items: list[_Item]) -> None:
        """Give up reads of :meth:`read_pinned` without publishing them: unpinned,
        nothing counted loaded."""
        self._unpin_all(items)

    def load_async(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None,
        request_id: str,
        depth: int | None = None,
    ) -> LoadHandle:
        """Submit one read per chunk to the I/O pool, in order, at most ``depth`` in
        flight (each finished read submits the next)."""
        if depth is not None and depth < 1:
            raise InvalidArgument(f"load depth must be >= 1, got {depth}")
        pool = self._io_pool()  # before pinning: a closing store refuses here
        items, vanished = self._start(lookup, outs)
        handle = LoadHandle(self, items, len(lookup.hits), vanished, request_id)
        feed = _Feed(pool, self.core, handle, items, depth is not None, self._open)
        if depth is not None and feed.pipelined():
            return handle
        for _ in range(len(items) if depth is None else min(depth, len(items))):
            feed.submit_next()
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
                if ended or res is None or isinstance(res, StoreClosedError):
                    ended = True  # (never read: the store closed first; wait() raises)
                elif isinstance(res, ReplicaReadError):
                    core.counters.read_errors += 1  # a miss; the replica may read next time
                    out.read_errors += 1
                    ended = True
                elif isinstance(res, UnknownTransform):
                    out.unknown_transform += 1  # a miss; a reader that knows it may serve it
                    if not it.rep.noted:
                        it.rep.noted = True
                        core.counters.unknown_transform += 1
                        if rec.state is INDEXED:
                            core.ledger.move(
                                rec,
                                Move.REFUSE,
                                tier=it.tier,
                                nbytes=it.rep.nbytes,
                                transform=it.rep.transform.name,
                                reason=f"unknown transform: {res}",
                            )
                    ended = True
                elif isinstance(res, ChecksumMismatch):
                    core.counters.corrupt += 1
                    if isinstance(res, CorruptFrame):
                        core.counters.corrupt_frames += 1
                    elif isinstance(core.tiers[it.tier], SealedInMemory):
                        core.counters.sealed_mismatch += 1  # changed since sealed
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
                    form = it.rep.transform
                    out.representations[form.name] = out.representations.get(form.name, 0) + 1
                    if form.framed:
                        out.decoded += 1
                        core.counters.decoded += 1
                    core.ledger.move(
                        rec,
                        Move.LOAD,
                        tier=it.tier,
                        nbytes=rec.nbytes,
                        request_id=request_id,
                        transform=form.name,
                    )
                    tc = core.counters.tier(it.tier)
                    tc.loaded += 1
                    tc.bytes_loaded += res.nbytes
                    if it.tier != first:
                        promote.append(it)
                        continue  # stays pinned until its promotion ran
                core.unpin(rec, it.rep)
            out.loaded = len(out.arrays)
            if out.corrupt or out.read_errors or out.unknown_transform:
                out.vanished = 0
            core.counters.vanished += out.vanished
            core.counters.bytes_loaded += sum(a.nbytes for a in out.arrays)
            if promote and core.config.promote_on_hit and len(core.chain) > 1 and not core.closed:
                core.placement.plan_promote([it.rec.key for it in promote])
                bound = core.residency.take()
                owned = {
                    it.rec.key: (it.result, _served(it.rep.transform), it.seal)
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
        self,
        bound: list[Bound],
        pinned: list[_Item],
        owned: dict[ChunkKey, tuple[np.ndarray, Representation, bytes]],
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
            if self._closed:
                raise StoreClosedError(f"store {self.core.path} is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.core.config.io_threads, thread_name_prefix="kvlife-load"
                )
            return self._pool

    def _open(self) -> bool:
        return not self._closed

    def drain(self) -> None:
        """Wait until every planned promotion (and any plan taken before) has run."""
        self.core.seq.wait_idle()

    def close(self) -> None:
        self.drain()
        with self._pool_lock:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = None
        self.core.stop_background()


def _served(form: Representation) -> Representation:
    """The representation of what a load returned: a frame's values, decoded."""
    if not form.framed:
        return form
    return Representation(form.name, form.version, form.params, False, form.descriptor)


def _hit(
    i: int, key: ChunkKey, start: int, got: Serving, rec: ObjectRecord, rates: DecodeRates
) -> ChunkHit:
    rep = got.replica
    assert got.tier is not None and rep is not None
    form = rep.transform
    if form.exact:
        return ChunkHit(i, key, start, got.tier, stored_nbytes=rep.nbytes)
    decode = rec.nbytes if form.framed else 0
    return ChunkHit(
        i,
        key,
        start,
        got.tier,
        form.name,
        exactness_of(form),
        rep.nbytes,
        decode,
        rates.estimate(form.name, decode) if decode else 0.0,
    )


def _bare(exc: E) -> E:
    """Drop the tracebacks of a miss kept as a chunk's result (and of the errors it was
    raised from): their frames hold the load's items and buffers, in a reference cycle
    through the item that only the collector frees (a served load's buffers are arena
    extents or a client's shared memory). A bug's error keeps its own (``wait`` raises
    it)."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        at.__traceback__ = None
        at = at.__cause__ or at.__context__
    return exc
