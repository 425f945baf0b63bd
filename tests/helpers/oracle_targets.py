"""What the oracle machine drives: a store behind one small interface that answers in plain
data (keys, served bytes, counts), so that the same rules run against an embedded
``KVStore`` (:class:`EmbeddedTarget`, here) and against ``kvlife serve`` with two client
processes (:mod:`tests.helpers.oracle_served`, whose workers run a :class:`StoreDriver`
over a ``RemoteStore``).

A driver keeps every array and buffer a call handed out or was given (returned arrays,
output buffers, an engine-like buffer pool that loads land in, the KV of finished puts),
so that ``scribble`` can write into all of them, as a caller that reuses its memory does.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvlife.client import RemoteStore
from kvlife.client.handles import RemotePendingPut
from kvlife.core.errors import KVLifeError
from kvlife.core.events import MemorySink
from kvlife.core.identity import ROOT_PARENT, ChunkKey
from kvlife.faults.damage import flip, scan_frames
from kvlife.results import LoadResult, LookupResult, PutResult
from kvlife.store import KVStore, PendingPut
from kvlife.store.api import LoadProgress
from tests.helpers.damage import copy_crash_image
from tests.helpers.oracle import CHUNK, LAYOUT, N, PromptSpec, Universe, scribble

MiB = 1 << 20
DRAM_CHUNKS = (3, 2, 8)
"""DRAM tiers an example may run with, in chunks: three (the next put demotes), two (a
three-chunk prompt straddles DRAM and disk from its put on), eight. (The first is what
hypothesis' simplest examples get.)"""
DISK_BYTES = 16 * MiB
"""Far more than the universe's chunks need (8 KiB frames, garbage included): the disk
never evicts unless a rule asks it to."""
SEGMENT_BYTES = 64 << 10
HANDED_MAX = 256
"""Arrays remembered for scribbling (the oldest are forgotten)."""
OBJECT_LOSS = frozenset({"invalidate", "corrupt", "delete", "abort"})
"""Event kinds that take an object out of the store."""
POOL_CHUNKS = 8


@dataclass(slots=True)
class PutOut:
    stored: int
    present: int
    in_flight: int
    dropped: int
    covered: int
    """Leading chunks indexed when the put returned (``tokens_stored_or_present``)."""
    written: list[ChunkKey] | None = None
    """Chunks this put wrote (None: the target cannot tell)."""


@dataclass(slots=True)
class PrepOut:
    hid: int
    written: list[ChunkKey]
    present: int
    in_flight: int


@dataclass(slots=True)
class LoadOut:
    served: list[bytes]
    requested: int
    corrupt: list[ChunkKey] = field(default_factory=list)
    vanished: int = 0
    read_errors: int = 0


@dataclass(slots=True)
class AsyncOut:
    chunks: list[bytes | None]
    """What ``chunk(i)`` returned, by chunk number."""
    result: LoadOut | None
    error: str = ""
    error_module: str = ""
    """Module of the error's type (``kvlife.core.errors`` for a typed one)."""


@dataclass(slots=True)
class CheckOut:
    bad_keys: list[ChunkKey]
    problems: list[str]
    orphans: list[str]
    quarantined: list[str]


class Target(Protocol):
    """A store the oracle machine drives; ``c`` names the client (ignored by a target
    that has one)."""

    write_through: bool

    def configure(self, dram_chunks: int) -> None: ...
    def put(self, c: int, spec: PromptSpec, form: str) -> PutOut: ...
    def prepare(self, c: int, spec: PromptSpec, form: str) -> PrepOut: ...
    def commit(self, c: int, hid: int) -> PutOut: ...
    def commit_async(self, c: int, hid: int) -> int: ...
    def await_commit(self, c: int, fid: int) -> PutOut: ...
    def abort(self, c: int, hid: int) -> None: ...
    def lookup(
        self, c: int, spec: PromptSpec, chunk: int | None = None, keep: bool = True
    ) -> tuple[list[ChunkKey], int]: ...
    def load(self, c: int, lid: int, mode: str, scribble_now: bool) -> LoadOut: ...
    def load_async_start(self, c: int, lid: int, mode: str, depth: int) -> int: ...
    def load_async_finish(
        self, c: int, aid: int, reverse: bool, scribble_now: bool
    ) -> AsyncOut: ...
    def invalidate(self, c: int, **criteria: Any) -> int: ...
    def race_commit_invalidate(
        self, c: int, hid: int, criteria: dict[str, Any]
    ) -> tuple[PutOut | KVLifeError, int]: ...
    def evict(self, c: int, tier: str, nbytes: int, scribbling: bool) -> int: ...
    def scribble(self, c: int) -> tuple[int, int]: ...
    def flush(self, c: int) -> None: ...
    def drain(self, c: int) -> None: ...
    def check(self, c: int, fix: bool) -> CheckOut: ...
    def reopen(self, flush: bool, crash: bool, write_through: bool) -> tuple[Path, bool]: ...
    def corrupt(self, key: ChunkKey, part: str) -> bool: ...
    def sync(self, tick: int) -> None: ...
    def explained(self, key: ChunkKey, since: int) -> bool: ...
    def close(self) -> None: ...


def put_out(r: PutResult, written: list[ChunkKey] | None) -> PutOut:
    return PutOut(
        r.stored,
        r.already_present,
        r.in_flight,
        r.dropped,
        r.tokens_stored_or_present // N,
        written,
    )


def load_out(r: LoadResult, requested: int) -> LoadOut:
    return LoadOut(
        [a.tobytes() for a in r.arrays], requested, list(r.corrupt), r.vanished, r.read_errors
    )


class Handed:
    """Arrays and buffers a caller holds after calls (scribbled on request)."""

    def __init__(self) -> None:
        self.arrays: deque[np.ndarray] = deque(maxlen=HANDED_MAX)
        self.pool = np.empty((POOL_CHUNKS, *LAYOUT.chunk_shape), np.float16)
        """An engine's buffer pool: loads in ``pool`` mode land in its slots, reused."""
        self._lent: list[np.ndarray] | None = None
        """The pool's slots while an asynchronous load owns them."""

    def add(self, arrays: object) -> None:
        """Keep what a call handed out or was given. Slots of the pool are not kept on
        their own: the pool is scribbled as a whole while no load owns it, never while
        an asynchronous load writes into it (a caller that scribbles a buffer a load in
        flight owns gets what it wrote, which is no fault of the store)."""
        items = [arrays] if isinstance(arrays, np.ndarray) else arrays
        if isinstance(items, (list, tuple)):
            self.arrays.extend(
                a
                for a in items
                if isinstance(a, np.ndarray) and not np.may_share_memory(a, self.pool)
            )

    def outs(self, mode: str, n: int, lasting: bool = False) -> list[np.ndarray] | None:
        """Output buffers for a load of ``n`` chunks (``lasting``: an asynchronous load,
        which owns them until it finished; the pool is lent to one at a time)."""
        if mode == "new":
            return None
        if mode == "pool" and n <= len(self.pool) and self._lent is None:
            slots = [self.pool[i] for i in range(n)]
            if lasting:
                self._lent = slots
            return slots
        return [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(n)]

    def returned(self, outs: list[np.ndarray] | None) -> None:
        """An asynchronous load finished: its buffers are the caller's again."""
        if outs is not None and outs is self._lent:
            self._lent = None
        else:
            self.add(outs)

    def scribble(self) -> tuple[int, int]:
        done = refused = 0
        for arr in (*self.arrays, *(() if self._lent is not None else (self.pool,))):
            if scribble(arr):
                done += 1
            else:
                refused += 1
        return done, refused


Store = KVStore | RemoteStore


class StoreDriver:
    """The public API calls of the rules on one store (a ``KVStore`` or a
    ``RemoteStore``), keeping what a caller would keep between calls."""

    def __init__(
        self,
        store: Store,
        universe: Universe,
        written_since: Callable[[], list[ChunkKey]] | None = None,
    ) -> None:
        self.store = store
        self.u = universe
        self.written_since = written_since
        """The chunks written since the last call (None: cannot tell)."""
        self.handed = Handed()
        self._ids = itertools.count(1)
        self.pendings: dict[int, tuple[PendingPut | RemotePendingPut, object]] = {}
        self.lookups: dict[int, LookupResult] = {}
        self.loads: dict[int, tuple[LoadProgress, list[np.ndarray] | None, int]] = {}
        self.futures: dict[int, tuple[Future[PutResult], object]] = {}
        self.done_futures: dict[int, PutOut | KVLifeError] = {}

    def _kv(self, spec: PromptSpec, form: str) -> object:
        return self.u.kv(spec, form)

    def put(self, spec: PromptSpec, form: str) -> PutOut:
        if self.written_since is not None:
            self.written_since()
        kv = self._kv(spec, form)
        r = self.store.put_prompt(
            self.u.identity(spec), self.u.namespace(spec), self.u.tokens(spec), kv
        )
        self.handed.add(kv)
        return put_out(r, self.written_since() if self.written_since is not None else None)

    def prepare(self, spec: PromptSpec, form: str) -> PrepOut:
        kv = self._kv(spec, form)
        p = self.store.prepare_put(
            self.u.identity(spec), self.u.namespace(spec), self.u.tokens(spec), kv
        )
        hid = next(self._ids)
        self.pendings[hid] = (p, kv)
        if isinstance(p, RemotePendingPut):
            written = [p.keys[i] for i in p.stored_chunks]
            self.handed.add(kv)  # a served prepare copied them: the caller's again
        else:
            written = [rec.key for rec, _ in p.items]
        return PrepOut(hid, written, p.present, p.in_flight)

    def commit(self, hid: int) -> PutOut:
        p, kv = self.pendings.pop(hid)
        try:
            return put_out(self.store.commit_put(p), None)  # type: ignore[arg-type]
        finally:
            self.handed.add(kv)  # the caller's again once the commit returned

    def commit_async(self, hid: int) -> int:
        p, kv = self.pendings.pop(hid)
        fut = self.store.put_async(p)  # type: ignore[arg-type]
        fid = next(self._ids)
        self.futures[fid] = (fut, kv)
        return fid

    def await_commit(self, fid: int) -> PutOut:
        if fid not in self.done_futures:
            fut, kv = self.futures.pop(fid)
            try:
                self.done_futures[fid] = put_out(fut.result(timeout=60), None)
            except KVLifeError as exc:
                self.done_futures[fid] = exc
            self.handed.add(kv)
        got = self.done_futures[fid]
        if isinstance(got, KVLifeError):
            raise got
        return got

    def await_all(self) -> None:
        for fid in list(self.futures):
            with contextlib.suppress(KVLifeError):
                self.await_commit(fid)

    def abort(self, hid: int) -> None:
        p, kv = self.pendings.pop(hid)
        try:
            self.store.abort_put(p)  # type: ignore[arg-type]
        finally:
            self.handed.add(kv)

    def lookup(
        self, spec: PromptSpec, chunk: int | None = None, keep: bool = True
    ) -> tuple[list[ChunkKey], int]:
        ident, ns, tokens = self.u.identity(spec), self.u.namespace(spec), self.u.tokens(spec)
        if chunk is None:
            hit = self.store.lookup(ident, ns, tokens)
        else:
            keys = self.u.keys(spec)
            hit = self.store.lookup(
                ident,
                ns,
                tokens[chunk * N : (chunk + 1) * N],
                start=chunk * N,
                parent=keys[chunk - 1] if chunk else ROOT_PARENT,
            )
        lid = next(self._ids)
        if keep:
            self.lookups[lid] = hit
        return [h.key for h in hit.hits], lid

    def load(self, lid: int, mode: str, scribble_now: bool) -> LoadOut:
        hit = self.lookups.pop(lid)
        outs = self.handed.outs(mode, len(hit.hits))
        r = self.store.load(hit, outs)
        out = load_out(r, len(hit.hits))
        if outs is None:
            self.handed.add(r.arrays)
        else:
            self.handed.add(outs)
            for a, b in zip(r.arrays, outs, strict=False):
                assert a is b, "a load with output buffers returned other arrays"
        if scribble_now:  # before the promotion of these hits ran
            for a in [*r.arrays, *(outs or ())]:
                scribble(a)
        return out

    def load_async_start(self, lid: int, mode: str, depth: int) -> int:
        hit = self.lookups.pop(lid)
        outs = self.handed.outs(mode, len(hit.hits), lasting=True)
        # the served store takes depth and keeps its server's own bound
        handle = self.store.load_async(hit, outs, depth=depth or None)
        aid = next(self._ids)
        self.loads[aid] = (handle, outs, len(hit.hits))
        return aid

    def load_async_finish(self, aid: int, reverse: bool, scribble_now: bool) -> AsyncOut:
        handle, outs, n = self.loads.pop(aid)
        chunks: list[bytes | None] = [None] * n
        got: list[np.ndarray] = []
        chunk = handle.chunk
        try:
            for i in reversed(range(n)) if reverse else range(n):
                arr = chunk(i, timeout=60)
                if arr is not None:
                    chunks[i] = arr.tobytes()
                    got.append(arr)
                    if scribble_now:  # while later chunks (and promotions) are in flight
                        scribble(arr)
            r = handle.wait(timeout=60)
        except Exception as exc:  # the machine judges: typed, and only after a close
            return AsyncOut(chunks, None, f"{type(exc).__name__}: {exc}", type(exc).__module__)
        finally:
            self.handed.returned(outs)
            self.handed.add(got)
        return AsyncOut(chunks, load_out(r, n))

    def invalidate(self, **criteria: Any) -> int:
        return self.store.invalidate(**criteria)

    def invalidate_kw(self, criteria: dict[str, Any]) -> int:
        return self.store.invalidate(**criteria)

    def evict(self, tier: str, nbytes: int, scribbling: bool) -> int:
        if not scribbling:
            return self.store.evict(tier, nbytes)
        box: list[int | BaseException] = []

        def run() -> None:
            try:
                box.append(self.store.evict(tier, nbytes))
            except BaseException as exc:
                box.append(exc)

        t = threading.Thread(target=run)
        t.start()
        self.handed.scribble()  # while the demotions run
        t.join(60)
        assert box, "evict did not return"
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def scribble(self) -> tuple[int, int]:
        return self.handed.scribble()

    def flush(self) -> None:
        self.store.flush()

    def drain(self) -> None:
        self.store.drain()

    def check(self, fix: bool) -> CheckOut:
        r = self.store.check(fix=fix) if isinstance(self.store, KVStore) else self.store.check()
        return CheckOut(
            [ChunkKey(k) for k in r.bad_keys], r.problems, r.orphan_segments, r.quarantined
        )


class EmbeddedTarget:
    """A ``KVStore`` in this process: a small DRAM tier in front of a large disk."""

    def __init__(self, path: Path, universe: Universe, write_through: bool = False) -> None:
        self.path = path
        self.u = universe
        self.write_through = write_through
        self.sink = MemorySink()
        self.events: dict[bytes, list[tuple[int, str]]] = {}
        self.unkeyed_losses: list[tuple[int, int]] = [(0, 0)]
        """(tick, recovery drops so far): losses counted without an event per key."""
        self._base_losses = 0
        self.tick = 0
        self.images = 0
        self.dram_chunks = 2
        self.d = StoreDriver(self._open(), universe, self._written_since)

    def _open(self) -> KVStore:
        return KVStore.open(
            self.path,
            dram_bytes=self.dram_chunks * CHUNK,
            disk_bytes=DISK_BYTES,
            segment_bytes=SEGMENT_BYTES,
            write_through=self.write_through,
            io_threads=2,
            sink=self.sink,
        )

    @property
    def store(self) -> KVStore:
        assert isinstance(self.d.store, KVStore)
        return self.d.store

    def configure(self, dram_chunks: int) -> None:
        """Reopen (the store is empty yet) with a DRAM tier of ``dram_chunks`` chunks."""
        self.store.close()
        self.dram_chunks = dram_chunks
        self.d.store = self._open()

    # ------------------------------------------------------------------ events

    def _take(self) -> list[tuple[str, str]]:
        got = []
        for e in self.sink.take():
            self.events.setdefault(bytes.fromhex(e.key), []).append((self.tick, e.kind))
            got.append((e.key, e.kind))
        return got

    def _written_since(self) -> list[ChunkKey]:
        """Chunks that got a ``put`` event (were written) since the last call."""
        return [ChunkKey(bytes.fromhex(k)) for k, kind in self._take() if kind == "put"]

    def sync(self, tick: int) -> None:
        self.tick = tick
        self._take()
        c = self.store.counters
        total = self._base_losses + c.recovery_dropped + c.segments_unrecoverable
        if total != self.unkeyed_losses[-1][1]:
            self.unkeyed_losses.append((tick, total))

    def explained(self, key: ChunkKey, since: int) -> bool:
        self._take()
        if any(t >= since and kind in OBJECT_LOSS for t, kind in self.events.get(key, [])):
            return True
        before = max(v for t, v in self.unkeyed_losses if t <= since)
        return self.unkeyed_losses[-1][1] > before

    # ------------------------------------------------------------------ the API

    def put(self, c: int, spec: PromptSpec, form: str) -> PutOut:
        return self.d.put(spec, form)

    def prepare(self, c: int, spec: PromptSpec, form: str) -> PrepOut:
        return self.d.prepare(spec, form)

    def commit(self, c: int, hid: int) -> PutOut:
        return self.d.commit(hid)

    def commit_async(self, c: int, hid: int) -> int:
        return self.d.commit_async(hid)

    def await_commit(self, c: int, fid: int) -> PutOut:
        return self.d.await_commit(fid)

    def abort(self, c: int, hid: int) -> None:
        self.d.abort(hid)

    def lookup(
        self, c: int, spec: PromptSpec, chunk: int | None = None, keep: bool = True
    ) -> tuple[list[ChunkKey], int]:
        return self.d.lookup(spec, chunk, keep)

    def load(self, c: int, lid: int, mode: str, scribble_now: bool) -> LoadOut:
        return self.d.load(lid, mode, scribble_now)

    def load_async_start(self, c: int, lid: int, mode: str, depth: int) -> int:
        return self.d.load_async_start(lid, mode, depth)

    def load_async_finish(self, c: int, aid: int, reverse: bool, scribble_now: bool) -> AsyncOut:
        return self.d.load_async_finish(aid, reverse, scribble_now)

    def invalidate(self, c: int, **criteria: Any) -> int:
        return self.d.invalidate(**criteria)

    def race_commit_invalidate(
        self, c: int, hid: int, criteria: dict[str, Any]
    ) -> tuple[PutOut | KVLifeError, int]:
        """Commit a pending put in one thread while this one invalidates."""
        box: list[PutOut | KVLifeError] = []

        def commit() -> None:
            try:
                box.append(self.d.commit(hid))
            except KVLifeError as exc:
                box.append(exc)

        t = threading.Thread(target=commit)
        t.start()
        n = self.d.invalidate(**criteria)
        t.join(60)
        assert box, "commit_put did not return"
        return box[0], n

    def evict(self, c: int, tier: str, nbytes: int, scribbling: bool) -> int:
        return self.d.evict(tier, nbytes, scribbling)

    def scribble(self, c: int) -> tuple[int, int]:
        return self.d.scribble()

    def flush(self, c: int) -> None:
        self.d.flush()

    def drain(self, c: int) -> None:
        self.d.drain()

    def check(self, c: int, fix: bool) -> CheckOut:
        return self.d.check(fix)

    # ------------------------------------------------------------------ sessions, damage

    def reopen(self, flush: bool, crash: bool, write_through: bool) -> tuple[Path, bool]:
        """Close (flushing or not) and open again; ``crash`` is a close without flush
        here (an in-process store cannot be killed). Returns a copy of the closed
        store's files (for :func:`prefix_audit`) and whether the close flushed."""
        flush = flush and not crash
        self._take()
        c = self.store.counters
        self._base_losses += c.recovery_dropped + c.segments_unrecoverable
        self.store.close(flush=flush)
        self.d.await_all()
        self.images += 1
        image = self.path.with_name(f"{self.path.name}-image{self.images}")
        copy_crash_image(self.path, image)
        self.write_through = write_through
        self.d.store = self._open()
        return image, flush

    def corrupt(self, key: ChunkKey, part: str) -> bool:
        self.store.drain()
        return damage_frames(self.path, key, part)

    def close(self) -> None:
        self.store.close(flush=False)


def damage_frames(path: Path, key: ChunkKey, part: str) -> bool:
    """Flip bytes of every frame of ``key`` in the segment files of the store at ``path``
    (its payload, or its header's payload checksum); False if it has none."""
    frames = [f for f in scan_frames(path) if f.key == key]
    for f in frames:
        if part == "header":
            flip(f.segment, f.offset + 56, 1)
        else:
            flip(f.segment, f.payload_offset + 3, 2)
    return bool(frames)


def prefix_audit(
    image: Path, u: Universe, roots: list[ChunkKey]
) -> list[tuple[ChunkKey, ChunkKey]]:
    """Open ``image`` (a copy of a closed store's files) as a new store, invalidate each
    of ``roots`` by prefix and look up every chunk chained after it, each on its own:
    the (root, chunk) pairs still found. Each chain's durable chunks must be reachable
    from its root whatever of the chain lived only in DRAM, so there are none."""
    missed: list[tuple[ChunkKey, ChunkKey]] = []
    store = KVStore.open(
        image, dram_bytes=8 * CHUNK, disk_bytes=DISK_BYTES, segment_bytes=SEGMENT_BYTES
    )
    try:
        for root in roots:
            store.invalidate(prefix=root)
            for key, meta in u.meta.items():
                if root not in meta.ancestors:
                    continue
                spec, i = u.chunk_ref(key)
                keys = u.keys(spec)
                hit = store.lookup(
                    u.identity(spec),
                    u.namespace(spec),
                    u.tokens(spec)[i * N : (i + 1) * N],
                    start=i * N,
                    parent=keys[i - 1],
                )
                if hit.hits:
                    missed.append((root, key))
    finally:
        store.close(flush=False)
    return missed
