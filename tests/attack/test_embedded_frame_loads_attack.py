"""Red team of the embedded frame load (commit 6bb5861): ``KVStore.load(lookup, outs)`` on
an embedded store first tries :func:`kvlife.store.frame_loads.start` (the leading
INDEXED disk hits read from their frames by the extension in the caller's thread,
verified, re-checked INDEXED at ``FrameLoad.wait``'s publication), the rest through the
pinned ``Reader.load``. ``tests/attack/test_frame_loads_attack.py`` attacks
``load_frames`` and a real server; this file attacks what differs for the embedded
entry point, with real stores and real segment files:

- every kind of buffer (unaligned, strided, Fortran-ordered, wrong dtype or shape,
  page-aligned but short, read-only, overlapping, None entries) at the first hit and at
  a later one, each load held to the same load with the extension unavailable (the
  pinned Python path, ``KVLIFE_NATIVE=0``-like): same error type or same result, bytes,
  buffers after and counts;
- mixed DRAM/disk hits and a corrupt frame among them, with and without promotion;
- a disk tier that keeps only a transformed (lossless) replica, looked up with an
  ``accept`` that takes it: never read as exact frames;
- a FileIO that reads another way (a FaultyIO stall, a ``preadv`` patched on the
  store's own FileIO object or on the class) is never read around;
- a KeyboardInterrupt out of the extension's run (before its reads are finished) or out
  of the publication: no descriptor, thread or pin left, the store still serves;
- threads loading into their own aligned buffers while another closes the store;
- a hammer: loaders against invalidations, re-puts with other KV, disk evictions,
  flushes and garbage puts whose segments are reclaimed under the loads, every result
  against a ledger of the puts;
- the window inside ``FrameLoad._publish`` between its INDEXED re-check and its counts,
  where the store's load of the rest runs.

Found, each kept below as a strict xfail until it was mended (the commit after 6bb5861),
and held now:

1. A mixed result no moment of the store held (wrong KV, ledger and counters
   disagree): ``_publish`` re-checks the frame-read chunks INDEXED under the lock,
   releases it, loads the rest through ``Reader.load``, then counts the frame-read
   chunks under the lock again without looking at their state. A chunk invalidated (and
   the prompt put again with other KV) in between is handed back as loaded with the OLD
   put's bytes while the rest carries the NEW put's bytes; the old chunks are counted in
   the tier's ``loaded``/``bytes_loaded``/``frame_loads`` with no LOAD in the ledger
   (``count_exact_load`` skips the move for a record out of the index). With disk hits
   followed by DRAM hits (the common embedded case) ``KVStore.load`` returned
   ``[A0, A1, B2, B3]``, loaded 4, two LOAD events. A pinned load pins every chunk at
   once and publishes them under one lock: it never mixes puts.
2. A buffer that does not fit its replica at a later hit of an all-disk load: the
   frame path reads the leading chunks into the caller's buffers, then the store's load
   of the rest raises InvalidArgument; the buffers before the bad one were overwritten
   by a load that raised. The same load with the extension unavailable (one disk run,
   its buffers checked before any read) raises with every buffer untouched. (The pinned
   load writes earlier tier runs too when the bad buffer is in a later tier run, so
   this is the all-disk case only.)

Everything else held: the same outcome, counts and buffers as the pinned load for every
other buffer kind; exact bytes and single counts for mixes and damaged frames; no FileIO
read around; nothing leaked by an interrupt or a close; no wrong byte in the hammer.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError, StoreClosedError
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC
from kvlife.core.lifecycle import Move
from kvlife.faults.damage import flip, scan_frames
from kvlife.faults.fileio import FaultyIO
from kvlife.native import frames as native
from kvlife.results import LoadResult, LookupResult, StoreCounters
from kvlife.store import KVStore, frame_loads
from kvlife.store.config import StoreConfig, TierSpec
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk import DiskTier
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES, frame_room
from kvlife.transforms.contract import Accept
from tests.test_frame_loads import CHUNKS, IDENT, PAGE, _chunks, _kv, _on_disk, _open, _outs

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

N = PAGE.tokens_per_chunk
C = PAGE.chunk_nbytes
BIG = 1 << 40
MARK = 7


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _buf() -> np.ndarray:
    return aligned_empty(C).view(np.float16).reshape(PAGE.chunk_shape)


def _segment_files(store: KVStore) -> int:
    """Segment files the disk tier holds open (one descriptor each)."""
    table = _disk(store)._table
    with table.lock:
        return len(table.segments)


def _disk(store: KVStore) -> DiskTier:
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    return disk


def _loads_of(sink: MemorySink, rid: str | None = None) -> list[str]:
    return [
        e.key
        for e in sink.take()
        if e.kind == Move.LOAD.value and (rid is None or e.request_id == rid)
    ]


def _delta(before: StoreCounters, after: StoreCounters) -> dict[str, int]:
    """The counts a load moves (frame_loads apart: the path taken)."""
    out = {
        "loads": after.loads - before.loads,
        "vanished": after.vanished - before.vanished,
        "corrupt": after.corrupt - before.corrupt,
        "read_errors": after.read_errors - before.read_errors,
        "bytes_loaded": after.bytes_loaded - before.bytes_loaded,
    }
    for t in ("dram", "disk"):
        out[f"{t}.loaded"] = after.tier(t).loaded - before.tier(t).loaded
    return out


@contextlib.contextmanager
def _no_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The extension unavailable (what ``KVLIFE_NATIVE=0`` makes of it): the embedded
    load is the pinned load through the disk tier's Python reads."""
    monkeypatch.setattr(native, "available", lambda: False)
    try:
        yield
    finally:
        monkeypatch.undo()


# --------------------------------------------------------------------------- buffers

# kinds of buffer put at one hit; the others are whole aligned pages
KINDS = (
    "none",
    "unaligned",
    "strided",
    "fortran",
    "wrong_dtype",
    "wrong_shape",
    "short_aligned",
    "read_only",
    "overlapping",
    "self_overlapping",
)
MISFITS = {"wrong_dtype", "wrong_shape", "short_aligned"}
"""Buffers that do not fit their replica: the store's load raises InvalidArgument."""


def _with(kind: str, at: int) -> list[np.ndarray | None]:
    outs: list[np.ndarray | None] = [_buf() for _ in range(CHUNKS)]
    if kind == "none":
        outs[at] = None
    elif kind == "unaligned":
        outs[at] = aligned_empty(C + 4096)[64 : 64 + C].view(np.float16).reshape(PAGE.chunk_shape)
    elif kind == "strided":
        outs[at] = aligned_empty(2 * C).view(np.float16)[::2].reshape(PAGE.chunk_shape)
    elif kind == "fortran":
        # aligned, whole pages, the chunk's shape and dtype: not C-contiguous
        f = aligned_empty(C).view(np.float16).reshape(PAGE.chunk_shape[::-1]).T
        assert f.shape == PAGE.chunk_shape and not f.flags.c_contiguous
        outs[at] = f
    elif kind == "wrong_dtype":
        outs[at] = aligned_empty(C).view(np.int16).reshape(PAGE.chunk_shape)
    elif kind == "wrong_shape":
        outs[at] = aligned_empty(C).view(np.float16)
    elif kind == "short_aligned":
        outs[at] = aligned_empty(C).view(np.float16)[: C // 4]  # one aligned page, short
    elif kind == "read_only":
        b = _buf()
        b[...] = MARK
        b.flags.writeable = False
        outs[at] = b
    elif kind == "overlapping":
        other = outs[(at + 1) % CHUNKS]
        assert other is not None
        outs[at] = other.reshape(-1)[::-1].reshape(PAGE.chunk_shape)
    elif kind == "self_overlapping":
        base = aligned_empty(C).view(np.float16)
        outs[at] = np.lib.stride_tricks.as_strided(base, PAGE.chunk_shape, (0, 0, 0, 0, 2))
    for o in outs:
        if o is not None and o.flags.writeable:
            o[...] = MARK
    return outs


def _one_load(
    store: KVStore, sink: MemorySink, lk: LookupResult, outs: Sequence[np.ndarray | None]
) -> tuple[Any, dict[str, int], list[bytes | None], int]:
    """One ``store.load``: (the error type or the result's loaded count and bytes, the
    counts it moved, every buffer's bytes after, its LOAD events)."""
    sink.take()
    before = copy.deepcopy(store.counters)
    outcome: Any
    try:
        res = store.load(lk, outs)  # type: ignore[arg-type]
        outcome = (res.loaded, [a.tobytes() for a in res.arrays], res.vanished, res.corrupt)
    except KVLifeError as exc:
        outcome = type(exc)
    after = store.counters
    bufs = [None if o is None else o.tobytes() for o in outs]
    return outcome, _delta(before, after), bufs, len(_loads_of(sink))


def _kinds_at() -> list[Any]:
    params = []
    for kind in KINDS:
        for at in (0, 2):
            params.append(pytest.param(kind, at, id=f"{kind}-{at}"))
    return params


@pytest.mark.parametrize(("kind", "at"), _kinds_at())
def test_every_buffer_kind_gets_what_the_pinned_load_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, at: int
) -> None:
    """Each kind of buffer at hit ``at`` of an all-disk load: ``store.load`` answers as
    the same load with the extension unavailable does (the pinned Python path): the
    same error type, or the same result; the same counts; every buffer the same bytes
    after (a load that raises leaves them as they were). Loaded arrays are the stored
    bytes, and no descriptor or thread is left."""
    sink = MemorySink()
    store = _open(tmp_path / "s", sink=sink)
    try:
        tokens, stored = _on_disk(store, 31)
        lk = store.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        fds, tasks = _fds(), _tasks()
        framed = store.counters.frame_loads
        got = _one_load(store, sink, lk, _with(kind, at))
        assert _fds() <= fds and _tasks() <= tasks
        with _no_native(monkeypatch):
            want = _one_load(store, sink, lk, _with(kind, at))
        assert got[0] == want[0], "outcome"
        if not isinstance(got[0], type):
            assert got[0][1] == stored[: got[0][0]]
        assert got[1] == want[1], "counts"
        assert got[3] == want[3], "LOAD events"
        assert got[2] == want[2], "buffers after"
        if isinstance(got[0], type):
            assert store.counters.frame_loads == framed  # a load that raised counts none
    finally:
        store.close()


# --------------------------------------------------------------------------- mixes


def _mixed(store: KVStore, seed: int, on_disk_only: int) -> tuple[np.ndarray, list[bytes]]:
    """A prompt put and flushed whose first ``on_disk_only`` chunks left DRAM (the rest
    in DRAM, their disk copies too)."""
    tokens, kv = _kv(seed)
    store.put_prompt(IDENT, PUBLIC, tokens, kv)
    store.flush()
    store.evict("dram", on_disk_only * C)
    lk = store.lookup(IDENT, PUBLIC, tokens)
    want = {"disk": on_disk_only, "dram": CHUNKS - on_disk_only}
    assert lk.tiers() == {t: n for t, n in want.items() if n}
    return tokens, _chunks(kv)


@pytest.mark.parametrize("promote", [False, True])
@pytest.mark.parametrize("damaged", [None, 0, 1, 3])
def test_mixed_hits_with_a_damaged_frame_load_exact_and_count_once(
    tmp_path: Path, promote: bool, damaged: int | None
) -> None:
    """Chunks 0 and 1 on disk only, 2 and 3 in DRAM (and on disk); the frame of chunk
    ``damaged`` has a payload bit flipped. A damaged disk-only chunk ends the result as
    corrupt (counted once, retired); a damaged disk copy of a DRAM chunk is not read.
    The chunks loaded are the stored bytes with one LOAD each; with promotion the
    frame-read ones end up in DRAM and no pin is left."""
    sink = MemorySink()
    store = _open(tmp_path / "s", promote=promote, sink=sink)
    try:
        tokens, stored = _mixed(store, 32, 2)
        lk = store.lookup(IDENT, PUBLIC, tokens)
        keys = [h.key for h in lk.hits]
        if damaged is not None:
            f = {f.key: f for f in scan_frames(tmp_path / "s")}[keys[damaged]]
            flip(f.segment, f.offset + HEADER_BYTES + 64, 1)
        before = copy.deepcopy(store.counters)
        sink.take()
        outs = _outs()
        res = store.load(lk, outs, request_id="m")
        want = damaged if damaged is not None and damaged < 2 else CHUNKS
        assert res.loaded == want
        assert [a.tobytes() for a in res.arrays] == stored[:want]
        assert all(a is o for a, o in zip(res.arrays, outs, strict=False))
        assert res.corrupt == ([keys[want]] if want < CHUNKS else [])
        after = store.counters
        assert after.corrupt - before.corrupt == len(res.corrupt)
        assert after.loads - before.loads == 1
        assert after.frame_loads - before.frame_loads == min(want, 2)
        assert sorted(_loads_of(sink, "m")) == sorted(k.hex() for k in keys[:want])
        d = _delta(before, after)
        assert d["disk.loaded"] + d["dram.loaded"] == want
        store.drain()
        assert not store._core.pinned
        again = store.lookup(IDENT, PUBLIC, tokens)
        assert len(again.hits) == (want if res.corrupt else CHUNKS)
        if promote and want:
            assert again.tiers().get("dram", 0) >= min(want, CHUNKS)
        res2 = store.load(again, _outs(len(again.hits)))
        assert [a.tobytes() for a in res2.arrays] == stored[: res2.loaded]
    finally:
        store.close()


def test_a_transformed_disk_replica_is_never_read_as_an_exact_frame(tmp_path: Path) -> None:
    """A disk tier that stores lossless frames, the prompt evicted from DRAM, looked up
    with ``accept`` LOSSLESS: ``load`` into aligned buffers decodes each through the
    store's load (frame_loads stays 0) and returns the stored bytes."""
    store = KVStore(
        tmp_path / "s",
        StoreConfig(
            tiers=(
                TierSpec("memory", "dram", 1 << 22),
                TierSpec(
                    "disk",
                    "disk",
                    1 << 24,
                    options=(("segment_bytes", 1 << 20),),
                    transform="lossless",
                ),
            ),
            promote_on_hit=False,
            write_through=True,
        ),
    )
    try:
        tokens, kv = _kv(33)
        store.put_prompt(IDENT, PUBLIC, tokens, kv)
        store.flush()
        store.evict("dram", BIG)
        lk = store.lookup(IDENT, PUBLIC, tokens, accept=Accept.LOSSLESS)
        assert [h.transform for h in lk.hits] == ["lossless"] * CHUNKS
        outs = _outs()
        res = store.load(lk, outs)
        assert res.loaded == CHUNKS and res.decoded == CHUNKS
        assert [a.tobytes() for a in res.arrays] == _chunks(kv)
        assert store.counters.frame_loads == 0
        # the exact lookup finds nothing to serve: no frame read either
        assert store.lookup(IDENT, PUBLIC, tokens).hits == []
    finally:
        store.close()


# --------------------------------------------------------------------------- the FileIO seam


def test_a_stalled_fileio_holds_the_embedded_load(tmp_path: Path) -> None:
    """A FaultyIO stalling ``preadv``: the load into aligned buffers waits in the stall
    (it reads through the seam, never around it), then returns the stored bytes."""
    io = FaultyIO()
    store = _open(tmp_path / "s", fileio=io)
    try:
        tokens, stored = _on_disk(store, 34)
        lk = store.lookup(IDENT, PUBLIC, tokens)
        stall = io.stall("preadv")
        got: list[LoadResult] = []
        t = threading.Thread(target=lambda: got.append(store.load(lk, _outs())))
        t.start()
        try:
            assert stall.wait_entered(10.0), "the load went around the stalled FileIO"
            time.sleep(0.05)
            assert not got and t.is_alive()
        finally:
            stall.release()
            io.disarm()
            t.join(10)
        assert got and got[0].loaded == CHUNKS
        assert [a.tobytes() for a in got[0].arrays] == stored
        assert store.counters.frame_loads == 0
    finally:
        store.close()


@pytest.mark.parametrize("where", ["object", "class"])
def test_a_preadv_patched_on_the_fileio_is_never_read_around(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The store's own plain FileIO with ``preadv`` replaced (on that object, or on the
    class) by one that counts its reads: every embedded load reads through it."""
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 35)
        io = _disk(store).io
        assert type(io) is FileIO
        calls: list[int] = []
        real = FileIO.preadv

        def counting(self: FileIO, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
            calls.append(offset)
            return real(self, fd, buffers, offset)

        if where == "object":
            monkeypatch.setattr(io, "preadv", counting.__get__(io), raising=False)
        else:
            monkeypatch.setattr(FileIO, "preadv", counting)
        for _ in range(3):
            lk = store.lookup(IDENT, PUBLIC, tokens)
            res = store.load(lk, _outs())
            assert res.loaded == CHUNKS and [a.tobytes() for a in res.arrays] == stored
        assert len(calls) >= 3
        assert store.counters.frame_loads == 0
        monkeypatch.undo()
        store.load(store.lookup(IDENT, PUBLIC, tokens), _outs())
        assert store.counters.frame_loads == CHUNKS  # plain again: the frame path
    finally:
        store.close()


# --------------------------------------------------------------------------- interrupts


class _Interrupted:
    """A DirectRun whose ``finish`` raises KeyboardInterrupt with its reads under way."""

    def __init__(self, run: native.DirectRun) -> None:
        self.run = run

    def step(self) -> bool:
        return self.run.step()

    def finish(self) -> int:
        raise KeyboardInterrupt

    def close(self) -> None:
        self.run.close()


@pytest.mark.parametrize("where", ["reads", "publication"])
def test_a_keyboard_interrupt_mid_load_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """KeyboardInterrupt out of the extension's run before its reads finished, or out of
    the publication (under the store's lock, counting the first chunk): it reaches the
    caller, and while the caller still holds the traceback no descriptor, thread or pin
    is left; the store serves the next load exactly and its lock is free."""
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 36)
        lk = store.lookup(IDENT, PUBLIC, tokens)
        store.load(lk, _outs())  # warm: the store's threads started
        fds, tasks = _fds(), _tasks()
        if where == "reads":
            real = native.start_direct

            def interrupted(frames: list[native.DirectFrame], depth: int) -> Any:
                return _Interrupted(real(frames, depth))

            monkeypatch.setattr(native, "start_direct", interrupted)
        else:

            def count(*_: object) -> None:
                raise KeyboardInterrupt

            monkeypatch.setattr(frame_loads, "count_exact_load", count)
        with pytest.raises(KeyboardInterrupt) as info:
            store.load(lk, _outs())
        assert info.traceback  # the frames (and the load's objects) are still held
        assert _fds() <= fds, "a descriptor of the run left open"
        assert _tasks() <= tasks, "a reader thread of the run left running"
        assert not store._core.pinned
        assert store._core.lock.acquire(timeout=1.0)
        store._core.lock.release()
        monkeypatch.undo()
        del info
        res = store.load(store.lookup(IDENT, PUBLIC, tokens), _outs())
        assert res.loaded == CHUNKS and [a.tobytes() for a in res.arrays] == stored
    finally:
        store.close()


# --------------------------------------------------------------------------- close


def test_loads_racing_the_store_closing_serve_exact_or_raise_typed(tmp_path: Path) -> None:
    """Four threads load (disk and DRAM hits) into their own aligned buffers while the
    store is closed under them: each load returns the stored bytes or raises
    StoreClosedError; after, every descriptor and thread the store had is gone."""
    fds0, tasks0 = _fds(), _tasks()
    kvlife0 = {t.name for t in threading.enumerate()}
    store = _open(tmp_path / "s")
    tokens, stored = _mixed(store, 37, 3)
    lk = store.lookup(IDENT, PUBLIC, tokens)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"ok": 0, "closed": 0}

    def load() -> None:
        try:
            while not stop.is_set():
                try:
                    res = store.load(lk, _outs())
                except StoreClosedError:
                    counts["closed"] += 1
                    return
                assert [a.tobytes() for a in res.arrays] == stored[: res.loaded]
                assert res.loaded == CHUNKS
                counts["ok"] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    store.close()
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert counts["ok"] > 0
    time.sleep(0.1)
    left = [t.name for t in threading.enumerate() if t.name not in kvlife0]
    assert not left, left
    assert _tasks() <= tasks0 and _fds() <= fds0


# --------------------------------------------------------------------------- the hammer


def test_loads_racing_every_mutation_serve_only_put_bytes(tmp_path: Path) -> None:
    """A small disk-only store whose segments are reclaimed under the loads (the
    prompt's frames share segments with garbage that is dropped; no DRAM tier: the
    loads' pins keep DRAM replicas from eviction, and the mixes are held above). Three
    threads ``load`` the prompt into their own aligned buffers while a fourth
    invalidates it and puts it again with one of two KVs, evicts the coldest disk
    replica, flushes, and puts and drops garbage. Every chunk returned is one put's
    bytes for it, and a result's chunks are one put's (fault 1, mended); the tier's
    ``loaded`` moved by exactly the chunks the results hold, each with its LOAD; one
    ``loads`` per call; no pin, descriptor or thread left; the audit is clean."""
    room = frame_room(C)
    sink = MemorySink()
    store = KVStore.open(
        tmp_path / "s",
        dram_bytes=0,
        disk_bytes=12 * room,
        segment_bytes=4 * room,
        promote_on_hit=False,
        sink=sink,
    )
    tokens, kv_a = _kv(38)
    _, kv_b = _kv(39)
    versions = [_chunks(kv_a), _chunks(kv_b)]
    stop = threading.Event()
    errors: list[BaseException] = []
    results: list[tuple[str, LoadResult]] = []
    store.put_prompt(IDENT, PUBLIC, tokens, kv_a)
    store.flush()
    sink.take()
    before = copy.deepcopy(store.counters)
    stats0 = copy.deepcopy(_disk(store).stats)
    # the tier keeps one descriptor per segment file it holds: how many it holds varies
    # with how the puts fell, so the descriptors are counted beside them. An audit's
    # read-only catalog connection leaves SQLite's descriptor open once closed (SQLite
    # defers that close while the store's own connection holds its locks on the file,
    # and reuses it for the next such connection): one audit before counting
    assert store.check().problems == []
    fds, tasks = _fds() - _segment_files(store), _tasks()

    def mutate() -> None:
        rng = random.Random(38)
        grng = np.random.default_rng(40)
        try:
            kv = kv_a
            while not stop.is_set():
                op = rng.randrange(8)
                if op == 0:
                    store.invalidate(namespace=PUBLIC)
                    kv = kv_b if rng.random() < 0.5 else kv_a
                    store.put_prompt(IDENT, PUBLIC, tokens, kv)
                elif op in (1, 2, 7):  # the coldest disk replica: a shorter prompt
                    store.evict("disk", 1)
                elif op == 3:
                    store.put_prompt(IDENT, PUBLIC, tokens, kv)
                elif op == 4:
                    store.flush()
                else:  # garbage beside the prompt's frames, dropped: segments compact
                    g = grng.integers(0, 50_000, 2 * N)
                    shape = (PAGE.num_layers, 2, PAGE.num_kv_heads, 2 * N, PAGE.head_dim)
                    store.put_prompt(
                        IDENT, PUBLIC, g, grng.standard_normal(shape).astype(np.float16)
                    )
                    store.flush()
                    glk = store.lookup(IDENT, PUBLIC, g)
                    if glk.hits:
                        store.invalidate(prefix=glk.hits[0].key)
                time.sleep(rng.uniform(0, 0.002))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def load(who: int) -> None:
        n = 0
        try:
            while not stop.is_set():
                lk = store.lookup(IDENT, PUBLIC, tokens)
                if not lk.hits:
                    continue
                rid = f"{who}-{n}"
                n += 1
                outs = _outs(len(lk.hits))
                res = store.load(lk, outs, request_id=rid)
                assert all(a is o for a, o in zip(res.arrays, outs, strict=False))
                results.append((rid, res))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=mutate)] + [
        threading.Thread(target=load, args=(w,)) for w in range(3)
    ]
    for t in threads:
        t.start()
    # two seconds at least, and until segments were reclaimed under enough loads (a
    # loaded machine runs fewer rounds in the same time)
    start, reclaimed = time.monotonic(), stats0.segments_reclaimed
    while time.monotonic() - start < 20 and (
        time.monotonic() - start < 2.0
        or len(results) <= 30
        or _disk(store).stats.segments_reclaimed == reclaimed
    ):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    try:
        assert not errors, errors
        assert len(results) > 30
        events: dict[str, int] = {}
        for e in sink.take():
            if e.kind == Move.LOAD.value:
                events[e.request_id] = events.get(e.request_id, 0) + 1
        total = 0
        for rid, res in results:
            assert res.loaded == len(res.arrays)
            got = [a.tobytes() for a in res.arrays]
            # one put's chunks, live together when the load was published
            assert got in (versions[0][: res.loaded], versions[1][: res.loaded]), rid
            assert events.get(rid, 0) == res.loaded, rid
            total += res.loaded
        store.drain()
        after = store.counters
        d = _delta(before, after)
        assert d["loads"] == len(results)
        assert d["dram.loaded"] + d["disk.loaded"] == total
        assert d["bytes_loaded"] == total * C
        assert 0 < after.frame_loads - before.frame_loads <= total
        stats = _disk(store).stats
        assert stats.segments_reclaimed > stats0.segments_reclaimed  # unlinked under loads
        assert not store._core.pinned
        assert store.check().problems == []
        assert _fds() - _segment_files(store) <= fds, "a descriptor left open"
        assert _tasks() <= tasks, "a thread left running"
    finally:
        store.close()


# --------------------------------------------------------------------------- fault 1


def _while_the_rest_loads(store: KVStore, act: Callable[[], object]) -> None:
    """Run ``act`` once, at the start of the store's pinned read of the rest of a frame
    load (after the publication re-checked the frame-read chunks INDEXED and released
    the store's lock, before it counts them): the real read runs after it."""
    real = store._reader.read_pinned
    done: list[bool] = []

    def rest(lookup: LookupResult, outs: Any) -> Any:
        if not done:
            done.append(True)
            act()
        return real(lookup, outs)

    store._reader.read_pinned = rest  # type: ignore[method-assign]


@pytest.mark.parametrize("change", ["invalidate", "reput_other"])
def test_a_change_while_the_rest_loads_never_mixes_puts(tmp_path: Path, change: str) -> None:
    """Chunks 0 and 1 on disk only (read from their frames), 2 and 3 in DRAM (the
    store's load of the rest). While the rest loads, the prompt is invalidated (and put
    again with other KV). The result must be what one moment of the store held: every
    chunk it holds one put's, live together, each with its LOAD; the tiers' ``loaded``
    moved by the LOADs logged."""
    sink = MemorySink()
    store = _open(tmp_path / "s", sink=sink)
    try:
        tokens, kv_a = _kv(41)
        _, kv_b = _kv(42)
        a, b = _chunks(kv_a), _chunks(kv_b)
        store.put_prompt(IDENT, PUBLIC, tokens, kv_a)
        store.flush()
        store.evict("dram", 2 * C)
        lk = store.lookup(IDENT, PUBLIC, tokens)
        assert [h.tier for h in lk.hits] == ["disk", "disk", "dram", "dram"]

        def act() -> None:
            store.invalidate(namespace=PUBLIC)
            if change == "reput_other":
                store.put_prompt(IDENT, PUBLIC, tokens, kv_b)

        _while_the_rest_loads(store, act)
        before = copy.deepcopy(store.counters)
        sink.take()
        res = store.load(lk, _outs(), request_id="x")
        got = [x.tobytes() for x in res.arrays]
        assert got in (a[: res.loaded], b[: res.loaded]), "one put's chunks"
        after = store.counters
        logged = len(_loads_of(sink, "x"))
        d = _delta(before, after)
        assert logged == res.loaded, "a chunk counted loaded without its LOAD"
        assert d["disk.loaded"] + d["dram.loaded"] == logged
        if change == "invalidate":
            assert res.loaded == 0  # nothing of the prompt was live at the end
    finally:
        store.close()
