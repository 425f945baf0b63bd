"""Attacks on the pipelined disk load (issue 28, commit f6c0dfe): ``load_async`` with a
depth, as on one CPU, reads a run of plain disk replicas back to back in one task
(``Reader.read_pipelined``) and verifies each on the disk tier's check pool. Two faults it
found are fixed (e713584): a chunk read after an invalidation took its row, and checks
queued behind other loads' stalled reads on the read helpers' pool.

Every test here forces that path (``reads._one_cpu`` patched to True) and checks that it
ran (``DiskTier.read_pipelined`` was called), then holds it to the store's promises:
never wrong bytes, every loss a counted and explained event (once), a load never hangs,
no pin left behind. Orders are forced with events; every wait is bounded (``WAIT``), so
a hang is a failure, never a stuck run."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError, StoreClosedError
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.damage import Frame, flip, scan_frames, swap_frames
from kvlife.results import LookupResult
from kvlife.store import Accept, KVStore, StoreConfig, TierSpec, reads
from kvlife.store.reads import LoadHandle
from kvlife.tiers.disk import DiskTier
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.fileio import FileIO
from tests.conftest import TINY, prompt_kv

N = TINY.tokens_per_chunk
CHUNK = TINY.chunk_nbytes
WAIT = 10.0


# ---------------------------------------------------------------------------- helpers


class ScriptedIO(FileIO):
    """Buffered reads; read number ``k`` (0-based, counted once ``armed``) may be held
    until an event is set (``holds``) or fail (``fails``: an exception to raise). Records
    how many reads were issued and which thread issued each."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.lock = threading.Lock()
        self.armed = False
        self.issued = 0
        self.threads: list[str] = []
        self.holds: dict[int, tuple[threading.Event, threading.Event]] = {}
        self.fails: dict[int, BaseException] = {}

    def arm(self) -> None:
        with self.lock:
            self.issued = 0
            self.threads.clear()
            self.armed = True

    def hold(self, k: int) -> tuple[threading.Event, threading.Event]:
        """(entered, release) for read ``k``."""
        pair = (threading.Event(), threading.Event())
        self.holds[k] = pair
        return pair

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        with self.lock:
            if not self.armed:
                return super().preadv(fd, buffers, offset)
            k = self.issued
            self.issued += 1
            self.threads.append(threading.current_thread().name)
        if k in self.holds:
            entered, release = self.holds[k]
            entered.set()
            if not release.wait(WAIT * 3):
                raise OSError(errno.EIO, "test hold was never released")
        if k in self.fails:
            raise self.fails[k]
        return super().preadv(fd, buffers, offset)


def chunk(kv: np.ndarray, i: int) -> np.ndarray:
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def disk_only(path: Path, io: FileIO, io_threads: int = 4) -> KVStore:
    return KVStore.open(
        path,
        dram_bytes=0,
        disk_bytes=1 << 24,
        segment_bytes=1 << 20,
        fileio=io,
        io_threads=io_threads,
    )


def frame_of(path: Path, key: ChunkKey) -> Frame:
    return next(f for f in scan_frames(path) if f.key == key)


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def no_segment_pins(store: KVStore) -> bool:
    tier = store.tier("disk")
    assert isinstance(tier, DiskTier)
    table = tier._reader._table
    with table.lock:
        return all(seg.readers == 0 for seg in table.segments.values())


def settled(store: KVStore) -> None:
    """No store pin and (once the load's task unpinned them) no segment pin left."""
    store.drain()
    assert not store._core.pinned, f"pins left behind: {store._core.pinned}"
    wait_until(lambda: no_segment_pins(store), "the load's segment pins to be released")


@pytest.fixture
def pipelined(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """As on one CPU: a load with a depth goes through the pipelined path. Returns the
    number of keys of each ``read_pipelined`` call (a test asserts the path ran)."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: True)
    calls: list[int] = []
    real = DiskTier.read_pipelined

    def spy(
        self: DiskTier,
        keys: Sequence[ChunkKey],
        outs: Sequence[np.ndarray | None],
        done: Callable[[int, object], None],
        proceed: Callable[[], bool] | None = None,
    ) -> int:
        calls.append(len(keys))
        return real(self, keys, outs, done, proceed)

    monkeypatch.setattr(DiskTier, "read_pipelined", spy)
    return calls


@pytest.fixture
def completions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The chunk index of every ``LoadHandle._complete`` call, in order (each chunk of a
    load must complete exactly once)."""
    seen: list[int] = []
    lock = threading.Lock()
    real = LoadHandle._complete

    def spy(self: LoadHandle, item: reads._Item, result: object) -> None:
        with lock:
            seen.append(next(i for i, it in enumerate(self._items) if it is item))
        real(self, item, result)  # type: ignore[arg-type]

    monkeypatch.setattr(LoadHandle, "_complete", spy)
    return seen


def verify_waits(monkeypatch: pytest.MonkeyPatch, which: int) -> tuple[threading.Event, ...]:
    """Frame verification number ``which`` (0-based, in the order they start) signals
    ``entered`` and waits (bounded) for ``release``: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    count = [0]
    real = CatalogRow.verify

    def verify(
        self: CatalogRow, header: memoryview | bytes, payload: list[np.ndarray] | None
    ) -> str:
        with lock:
            k = count[0]
            count[0] += 1
        if k == which:
            entered.set()
            if not release.wait(WAIT * 3):
                raise AssertionError("verification hold was never released")
        return real(self, header, payload)

    monkeypatch.setattr(CatalogRow, "verify", verify)
    return entered, release


@pytest.fixture
def store4(
    tmp_path: Path, identity: ModelIdentity
) -> Iterator[tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]]]:
    """A disk-only store holding one prompt of 4 chunks (reads scripted)."""
    io = ScriptedIO()
    tokens, kv = prompt_kv(300, 4 * N)
    store = disk_only(tmp_path, io)
    keys = list(store.put_prompt(identity, PUBLIC, tokens, kv).keys)
    try:
        yield store, io, tokens, kv, keys
    finally:
        store.close()


# ---------------------------------------------------------------------------- invalidation


def test_an_invalidation_under_a_held_read_leaves_no_hit_in_the_result(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    pipelined: list[int],
) -> None:
    """Chunk 1's read held in the device while the prompt is invalidated: the load
    finishes, its result holds no chunk (the first one vanished, counted once), every
    array ``chunk(i)`` hands out is the byte-exact chunk, nothing is counted corrupt or
    a read error, no pin is left, and the prompt is gone for the next lookup."""
    store, io, tokens, kv, _ = store4
    hit = store.lookup(identity, PUBLIC, tokens)
    entered, release = io.hold(1)
    io.arm()
    handle = store.load_async(hit, depth=2)
    assert entered.wait(WAIT)
    assert store.invalidate(namespace=PUBLIC) == 4
    release.set()
    got = [handle.chunk(i, timeout=WAIT) for i in range(4)]
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4]
    assert res.loaded == 0 and res.arrays == [] and res.vanished == 1
    assert store.counters.vanished == 1
    assert store.counters.corrupt == 0 and store.counters.read_errors == 0
    for i, g in enumerate(got):
        assert g is None or np.array_equal(g, chunk(kv, i))
    settled(store)
    assert store.lookup(identity, PUBLIC, tokens).hits == []


@pytest.mark.parametrize(
    "mode",
    [
        "chained",
        "one-cpu",
    ],
)
def test_a_chunk_whose_read_starts_after_an_invalidation_returned_is_not_handed_out(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """``depth=1``; chunk 1's read held while the prompt is invalidated. Chunks 2 and 3
    are not read yet when ``invalidate()`` returns: the chained load makes them misses
    (their rows are gone); the pipelined one must not hand them out either (an engine
    that takes ``chunk(i)`` as it comes would put invalidated KV in its cache, read
    from the device after the invalidation was acknowledged)."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: mode == "one-cpu")
    store, io, tokens, _, _ = store4
    hit = store.lookup(identity, PUBLIC, tokens)
    entered, release = io.hold(1)
    io.arm()
    handle = store.load_async(hit, depth=1)
    assert entered.wait(WAIT)
    assert store.invalidate(namespace=PUBLIC) == 4
    release.set()
    late = [handle.chunk(i, timeout=WAIT) is not None for i in (2, 3)]
    handle.wait(timeout=WAIT)
    settled(store)
    assert io.issued >= 2
    assert late == [False, False], f"{mode}: chunks read after the invalidation were handed out"


def test_an_invalidation_and_a_new_put_of_the_same_prompt_under_a_load(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    pipelined: list[int],
) -> None:
    """Invalidated and put again (new frames, new rows) while the load's chunk 1 read
    is held: whatever the load hands out is byte-exact, its result counts the old
    objects as vanished, no pin is left, and the new put loads in full after."""
    store, io, tokens, kv, _ = store4
    hit = store.lookup(identity, PUBLIC, tokens)
    entered, release = io.hold(1)
    io.arm()
    handle = store.load_async(hit, depth=3)
    assert entered.wait(WAIT)
    store.invalidate(namespace=PUBLIC)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    release.set()
    got = [handle.chunk(i, timeout=WAIT) for i in range(4)]
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4]
    assert res.loaded == 0 and res.vanished == 1
    for i, g in enumerate(got):
        assert g is None or np.array_equal(g, chunk(kv, i))
    settled(store)
    again = store.load_async(store.lookup(identity, PUBLIC, tokens), depth=2).wait(timeout=WAIT)
    assert again.loaded == 4
    for i, a in enumerate(again.arrays):
        assert np.array_equal(a, chunk(kv, i))
    settled(store)


# ---------------------------------------------------------------------------- close


def test_close_while_a_verification_is_held_on_a_helper(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    monkeypatch: pytest.MonkeyPatch,
    pipelined: list[int],
) -> None:
    """Chunk 0's verification held on the tier's helper and chunk 2's read held in the
    device when ``close()`` begins. The close waits for both (it does not return, nor
    unpin a segment, under a verification); chunks 0-2 are handed out exact, chunk 3 is
    never read (a typed miss), ``wait()`` raises StoreClosedError, no read error or
    corruption is counted, and nothing hangs."""
    store, io, tokens, kv, _ = store4
    hit = store.lookup(identity, PUBLIC, tokens)
    v_entered, v_release = verify_waits(monkeypatch, 0)
    r_entered, r_release = io.hold(2)
    io.arm()
    handle = store.load_async(hit, depth=2)
    assert v_entered.wait(WAIT) and r_entered.wait(WAIT)
    closer = threading.Thread(target=store.close)
    closer.start()
    wait_until(lambda: store._reader._closed, "close() to mark the reader closed")
    r_release.set()  # chunk 2 lands; proceed() says stop before chunk 3
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while a verification was in progress"
    assert not handle.done()
    v_release.set()
    closer.join(WAIT)
    assert not closer.is_alive(), "close() hung"
    assert pipelined == [4]
    for i in range(3):
        g = handle.chunk(i, timeout=WAIT)
        assert g is not None and np.array_equal(g, chunk(kv, i))
    assert handle.chunk(3, timeout=WAIT) is None
    with pytest.raises(StoreClosedError):
        handle.wait(timeout=WAIT)
    assert io.issued == 3, "a chunk was read after the close began"
    assert store.counters.read_errors == 0 and store.counters.corrupt == 0
    assert not store._core.pinned and no_segment_pins(store)


@pytest.mark.parametrize("mode", ["chained", "one-cpu"])
def test_a_load_queued_behind_a_close_reads_at_most_its_first_chunk(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """One I/O thread, taken by a load whose read is held; a second load (``depth=1``)
    waits in the pool's queue when ``close()`` begins. Both ways, the queued load reads
    its first chunk only (the task was submitted before the close; the chained one's
    next submission, the pipelined one's proceed(), are refused), hands it out exact,
    the rest are typed misses, and every pin is released."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: mode == "one-cpu")
    io = ScriptedIO()
    tokens, kv = prompt_kv(301, 3 * N)
    store = disk_only(tmp_path, io, io_threads=1)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    hit = store.lookup(identity, PUBLIC, tokens)
    entered, release = io.hold(0)
    io.arm()
    first = store.load_async(hit.sub(0, 1), depth=1)
    assert entered.wait(WAIT)
    second = store.load_async(hit, depth=1)
    closer = threading.Thread(target=store.close)
    closer.start()
    wait_until(lambda: store._reader._closed, "close() to mark the reader closed")
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive(), "close() hung"
    assert first.wait(timeout=WAIT).loaded == 1
    got = [second.chunk(i, timeout=WAIT) for i in range(3)]
    assert got[0] is not None and np.array_equal(got[0], chunk(kv, 0))
    assert got[1:] == [None, None]
    with pytest.raises(StoreClosedError):
        second.wait(timeout=WAIT)
    assert io.issued == 2
    assert not store._core.pinned and no_segment_pins(store)


# ---------------------------------------------------------------------------- DRAM and disk


def mixed_store(
    path: Path, identity: ModelIdentity, io: FileIO, in_dram: Sequence[int], n: int
) -> tuple[KVStore, np.ndarray, np.ndarray, list[ChunkKey]]:
    """DRAM over disk, written through, no promotion: a prompt of ``n`` chunks, only
    those ``in_dram`` still in DRAM (the others on disk only). The others are evicted
    from DRAM while these are shielded as pinned (eviction never takes a pinned key)."""
    store = KVStore.open(
        path,
        dram_bytes=4 * n * CHUNK,
        disk_bytes=1 << 24,
        segment_bytes=1 << 20,
        fileio=io,
        write_through=True,
        promote_on_hit=False,
    )
    tokens, kv = prompt_kv(310 + n, n * N)
    keys = list(store.put_prompt(identity, PUBLIC, tokens, kv).keys)
    core = store._core
    with core.lock:
        for i in in_dram:
            core.pinned[keys[i]] = core.pinned.get(keys[i], 0) + 1
    store.evict("dram", 4 * n * CHUNK)
    with core.lock:
        for i in in_dram:
            core.pinned[keys[i]] -= 1
            if not core.pinned[keys[i]]:
                del core.pinned[keys[i]]
    want = ["dram" if i in in_dram else "disk" for i in range(n)]
    assert [h.tier for h in store.lookup(identity, PUBLIC, tokens).hits] == want
    return store, tokens, kv, keys


@pytest.mark.parametrize("outs", [False, True], ids=["new-arrays", "buffers"])
def test_dram_and_disk_chunks_alternating_complete_once_in_order(
    tmp_path: Path,
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
    outs: bool,
) -> None:
    """DRAM, disk, disk, DRAM, disk, disk, DRAM: each chunk completes exactly once, the
    DRAM chunk after a disk run only after that run's chunks completed (a run is read
    and verified before the next chunk is taken up), every chunk byte-exact (into the
    caller's buffers when given), the result counts each tier, no pin is left."""
    store, tokens, kv, _ = mixed_store(tmp_path, identity, FileIO(direct=False), (0, 3, 6), 7)
    try:
        hit = store.lookup(identity, PUBLIC, tokens)
        bufs = [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in range(7)] if outs else None
        completions.clear()
        handle = store.load_async(hit, bufs, depth=2)
        res = handle.wait(timeout=WAIT)
        assert pipelined == [2, 2]
        assert sorted(completions) == list(range(7)), completions
        pos = {c: k for k, c in enumerate(completions)}
        assert pos[0] < min(pos[1], pos[2]) and max(pos[1], pos[2]) < pos[3]
        assert pos[3] < min(pos[4], pos[5]) and max(pos[4], pos[5]) < pos[6]
        assert res.loaded == 7 and res.tiers == {"dram": 3, "disk": 4}
        for i in range(7):
            a = handle.chunk(i, timeout=WAIT)
            assert a is not None and np.array_equal(a, chunk(kv, i))
            if bufs is not None:
                assert a is bufs[i]
            else:
                assert not a.flags.writeable
        settled(store)
    finally:
        store.close()


def test_a_corrupt_disk_chunk_before_a_dram_chunk_ends_the_load_there(
    tmp_path: Path,
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
) -> None:
    """DRAM, disk, disk(damaged), DRAM, disk: the healthy DRAM chunk after the damaged
    one is never handed out by ``chunk(i)`` (nor anything after it); the damage is
    counted once, its object invalidated; the chunks before it are exact."""
    store, tokens, kv, keys = mixed_store(tmp_path, identity, FileIO(direct=False), (0, 3), 5)
    try:
        frame = frame_of(tmp_path, keys[2])
        flip(frame.segment, frame.payload_offset + 9, 1)
        hit = store.lookup(identity, PUBLIC, tokens)
        completions.clear()
        handle = store.load_async(hit, depth=1)
        got = [handle.chunk(i, timeout=WAIT) for i in range(5)]
        res = handle.wait(timeout=WAIT)
        assert pipelined == [2, 1]
        assert sorted(completions) == list(range(5))
        assert [g is not None for g in got] == [True, True, False, False, False]
        for i in (0, 1):
            assert np.array_equal(got[i], chunk(kv, i))  # type: ignore[arg-type]
        assert res.loaded == 2 and res.corrupt == [keys[2]]
        assert store.counters.corrupt == 1 and store.counters.corrupt_frames == 0
        settled(store)
        assert len(store.lookup(identity, PUBLIC, tokens).hits) == 2
    finally:
        store.close()


# ---------------------------------------------------------------------------- damage


def _load_all(store: KVStore, identity: ModelIdentity, tokens: np.ndarray, n: int) -> list[bool]:
    hit = store.lookup(identity, PUBLIC, tokens)
    handle = store.load_async(hit, depth=2)
    handle.wait(timeout=WAIT)
    return [handle.chunk(i, timeout=WAIT) is not None for i in range(n)]


@pytest.mark.parametrize("where", [0, 40, 63], ids=["first-byte", "mid-header", "last-used"])
def test_a_damaged_header_is_a_counted_corrupt_miss(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    tmp_path: Path,
    pipelined: list[int],
    where: int,
) -> None:
    """A byte of chunk 1's frame header (not its payload) flipped under the open store:
    chunk 0 exact, chunk 1 a corrupt miss counted once (nothing after it handed out),
    its object invalidated, no pin left; a synchronous load agrees after."""
    store, _, tokens, kv, keys = store4
    frame = frame_of(tmp_path, keys[1])
    flip(frame.segment, frame.offset + where, 1)
    hit = store.lookup(identity, PUBLIC, tokens)
    handle = store.load_async(hit, depth=2)
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4]
    assert res.loaded == 1 and res.corrupt == [keys[1]]
    assert np.array_equal(res.arrays[0], chunk(kv, 0))
    assert [handle.chunk(i, timeout=WAIT) is not None for i in range(4)] == [True] + [False] * 3
    assert store.counters.corrupt == 1 and store.counters.read_errors == 0
    settled(store)
    assert store.load(store.lookup(identity, PUBLIC, tokens)).loaded == 1
    assert store.counters.corrupt == 1


def test_two_frames_swapped_whole_are_never_served_as_each_other(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    tmp_path: Path,
    pipelined: list[int],
) -> None:
    """Chunks 1 and 2's frames (header and payload, each intact) swapped in place: each
    frame verifies by itself, but names another key; chunk 1 is a corrupt miss, no
    chunk's bytes are ever handed out as another's."""
    store, _, tokens, kv, keys = store4
    swap_frames(frame_of(tmp_path, keys[1]), frame_of(tmp_path, keys[2]), "whole-frames")
    hit = store.lookup(identity, PUBLIC, tokens)
    handle = store.load_async(hit, depth=3)
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4]
    assert res.loaded == 1 and res.corrupt == [keys[1]]
    assert store.counters.corrupt == 1
    for i in range(4):
        g = handle.chunk(i, timeout=WAIT)
        assert g is None or np.array_equal(g, chunk(kv, i))
    settled(store)


def test_payloads_swapped_between_frames_are_caught(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    tmp_path: Path,
    pipelined: list[int],
) -> None:
    """Payloads of chunks 0 and 3 swapped (headers in place): chunk 0 is a corrupt miss
    at once, nothing is handed out, counted once."""
    store, _, tokens, _, keys = store4
    swap_frames(frame_of(tmp_path, keys[0]), frame_of(tmp_path, keys[3]), "payloads")
    assert _load_all(store, identity, tokens, 4) == [False] * 4
    assert pipelined == [4]
    assert store.counters.corrupt == 1
    settled(store)


@pytest.mark.parametrize("cut", ["in-header", "in-payload", "at-frame-start"])
def test_a_segment_cut_under_the_open_store_is_a_short_read_miss(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    tmp_path: Path,
    pipelined: list[int],
    cut: str,
) -> None:
    """The segment file truncated inside chunk 2's frame (or right before it) while the
    store is open: chunks 0 and 1 exact, chunk 2 a corrupt miss ("truncated", given
    inline by the reading thread) counted once, chunk 3 (also cut off) neither handed
    out nor counted, no pin left, the load does not hang."""
    store, _, tokens, kv, keys = store4
    frame = frame_of(tmp_path, keys[2])
    at = {"in-header": frame.offset + 10, "in-payload": frame.payload_offset + 100}.get(
        cut, frame.offset
    )
    os.truncate(frame.segment, at)
    hit = store.lookup(identity, PUBLIC, tokens)
    handle = store.load_async(hit, depth=2)
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4]
    assert res.loaded == 2 and res.corrupt == [keys[2]]
    for i in (0, 1):
        assert np.array_equal(res.arrays[i], chunk(kv, i))
    assert [handle.chunk(i, timeout=WAIT) is not None for i in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    assert store.counters.corrupt == 1 and store.counters.read_errors == 0
    settled(store)


# ---------------------------------------------------------------------------- read failures


def test_an_io_error_mid_run_is_one_read_error_and_the_replica_loads_next_time(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
) -> None:
    """EIO on chunk 1's read (given inline, in the reading thread): chunk 0 exact,
    chunk 1 a read error counted once (a miss, the replica kept), the rest read but not
    handed out, each chunk completed once; the next load serves all four."""
    store, io, tokens, kv, _ = store4
    io.fails[1] = OSError(errno.EIO, "injected")
    io.arm()
    completions.clear()
    assert _load_all(store, identity, tokens, 4) == [True, False, False, False]
    assert pipelined == [4] and sorted(completions) == [0, 1, 2, 3]
    assert store.counters.read_errors == 1 and store.counters.corrupt == 0
    assert io.threads and len(set(io.threads)) == 1, "reads of one run in one thread"
    settled(store)
    io.fails.clear()
    res = store.load_async(store.lookup(identity, PUBLIC, tokens), depth=2).wait(timeout=WAIT)
    assert res.loaded == 4 and store.counters.read_errors == 1
    for i, a in enumerate(res.arrays):
        assert np.array_equal(a, chunk(kv, i))
    settled(store)


def test_a_bug_in_a_read_mid_run_completes_every_chunk_and_is_raised(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
) -> None:
    """A read that raises something no read should (a bug, not an OSError) on chunk 2:
    the load still completes every chunk exactly once (no hang), chunks 0 and 1 are
    exact, nothing after is handed out, ``wait()`` raises the bug, no pin is left."""
    store, io, tokens, kv, _ = store4
    io.fails[2] = ZeroDivisionError("injected bug")
    io.arm()
    completions.clear()
    hit = store.lookup(identity, PUBLIC, tokens)
    handle = store.load_async(hit, depth=2)
    with pytest.raises(ZeroDivisionError, match="injected bug"):
        handle.wait(timeout=WAIT)
    assert pipelined == [4] and sorted(completions) == [0, 1, 2, 3]
    got = [handle.chunk(i, timeout=WAIT) for i in range(4)]
    assert [g is not None for g in got] == [True, True, False, False]
    for i in (0, 1):
        assert np.array_equal(got[i], chunk(kv, i))  # type: ignore[arg-type]
    assert io.issued == 3, "a chunk was read after the failed one"
    settled(store)


def test_a_consumer_bug_in_decoding_is_raised_not_lost(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    monkeypatch: pytest.MonkeyPatch,
    pipelined: list[int],
    completions: list[int],
) -> None:
    """The store's per-frame step on the helper (``_decoded``) raises for chunk 1: the
    chunk is a miss, every chunk completes once, ``wait()`` raises the error."""
    store, _, tokens, _, _ = store4
    real = reads._decoded
    calls = [0]
    lock = threading.Lock()

    def decoded(it: reads._Item, res: object, rates: object, where: str) -> object:
        with lock:
            k = calls[0]
            calls[0] += 1
        if it.rec.key == keys[1]:
            raise KeyError(f"injected bug in call {k}")
        return real(it, res, rates, where)  # type: ignore[arg-type]

    keys = store4[4]
    monkeypatch.setattr(reads, "_decoded", decoded)
    completions.clear()
    hit = store.lookup(identity, PUBLIC, tokens)
    handle = store.load_async(hit, depth=2)
    with pytest.raises(KeyError, match="injected bug"):
        handle.wait(timeout=WAIT)
    assert pipelined == [4] and sorted(completions) == [0, 1, 2, 3]
    assert [handle.chunk(i, timeout=WAIT) is not None for i in range(4)] == [True] + [False] * 3
    settled(store)


# ---------------------------------------------------------------------------- races


def test_concurrent_pipelined_loads_race_invalidations_puts_and_evictions(
    tmp_path: Path, identity: ModelIdentity, pipelined: list[int]
) -> None:
    """Four threads load the same prompts (pipelined, random depth, buffers or not)
    while one invalidates a prompt and puts it again and one evicts from the disk (a
    small one, compacting): every array handed out by ``chunk(i)`` or the result is the
    byte-exact chunk, nothing healthy is counted corrupt or a read error, nothing but
    typed errors is raised, no load hangs, and no pin is left."""
    prompts = [prompt_kv(320 + p, 4 * N) for p in range(3)]
    store = KVStore.open(
        tmp_path,
        dram_bytes=0,
        disk_bytes=160 * 8192,
        segment_bytes=64 << 10,
        fileio=FileIO(direct=False),
    )
    errors: list[BaseException] = []
    stop = threading.Event()
    served = [0]
    churned = [0]
    lock = threading.Lock()
    try:
        for tokens, kv in prompts:
            store.put_prompt(identity, PUBLIC, tokens, kv)

        def loader(t: int) -> None:
            rng = random.Random(t)
            try:
                for _ in range(60):
                    tokens, kv = prompts[rng.randrange(3)]
                    hit = store.lookup(identity, PUBLIC, tokens)
                    n = len(hit.hits)
                    bufs = (
                        [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in range(n)]
                        if rng.random() < 0.5
                        else None
                    )
                    handle = store.load_async(hit, bufs, depth=rng.choice([1, 2, 3]))
                    got = [handle.chunk(i, timeout=WAIT) for i in range(n)]
                    res = handle.wait(timeout=WAIT)
                    for i, g in enumerate(got):
                        if g is not None:
                            assert np.array_equal(g, chunk(kv, i)), f"wrong bytes, chunk {i}"
                    for i, a in enumerate(res.arrays):
                        assert np.array_equal(a, chunk(kv, i)), f"wrong bytes in result {i}"
                    with lock:
                        served[0] += res.loaded
            except BaseException as exc:
                errors.append(exc)

        def churn() -> None:
            rng = random.Random(99)
            try:
                while not stop.is_set():
                    churned[0] += 1
                    tokens, kv = prompts[rng.randrange(3)]
                    op = rng.random()
                    if op < 0.4:
                        hit = store.lookup(identity, PUBLIC, tokens)
                        if hit.hits:
                            store.invalidate(prefix=hit.hits[rng.randrange(len(hit.hits))].key)
                    elif op < 0.8:
                        store.put_prompt(identity, PUBLIC, tokens, kv)
                    else:
                        store.evict("disk", rng.choice([8192, 5 * 8192]))
            except KVLifeError:
                pass
            except BaseException as exc:
                errors.append(exc)

        loaders = [threading.Thread(target=loader, args=(t,)) for t in range(4)]
        churner = threading.Thread(target=churn)
        churner.start()
        for th in loaders:
            th.start()
        for th in loaders:
            th.join(WAIT * 6)
        stop.set()
        churner.join(WAIT)
        assert not any(th.is_alive() for th in [*loaders, churner]), "a thread hung"
        assert not errors, errors[:3]
        assert pipelined, "the pipelined path never ran"
        assert served[0] > 0 and churned[0] > 0
        assert store.counters.corrupt == 0 and store.counters.read_errors == 0
        settled(store)
        assert not store.check().problems
    finally:
        store.close()


# ---------------------------------------------------------------------------- caller buffers


def test_a_buffer_scribbled_on_after_chunk_returns_spoils_nothing_else(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DRAM over disk with promotion; every chunk on disk only. The caller overwrites
    chunk ``i``'s buffer as soon as ``chunk(i)`` returns, while later chunks are still
    read and verified: every later chunk is exact, and the promotion into DRAM does not
    adopt the scribbled buffer (the next load, from DRAM, is exact)."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: True)
    io = FileIO(direct=False)
    store = KVStore.open(
        tmp_path, dram_bytes=16 * CHUNK, disk_bytes=1 << 24, segment_bytes=1 << 20, fileio=io
    )
    try:
        tokens, kv = prompt_kv(330, 5 * N)
        store.put_prompt(identity, PUBLIC, tokens, kv)
        store.flush()
        store.evict("dram", 16 * CHUNK)
        hit = store.lookup(identity, PUBLIC, tokens)
        assert [h.tier for h in hit.hits] == ["disk"] * 5
        bufs = [np.zeros(TINY.chunk_shape, np.float16) for _ in range(5)]
        handle = store.load_async(hit, bufs, depth=2)
        for i in range(5):
            a = handle.chunk(i, timeout=WAIT)
            assert a is bufs[i] and np.array_equal(a, chunk(kv, i)), f"chunk {i}"
            a[...] = 7.0  # the caller reuses its buffer at once
        assert handle.wait(timeout=WAIT).loaded == 5
        store.drain()
        again = store.lookup(identity, PUBLIC, tokens)
        assert [h.tier for h in again.hits] == ["dram"] * 5
        res = store.load_async(again, depth=2).wait(timeout=WAIT)
        assert res.loaded == 5
        for i, a in enumerate(res.arrays):
            assert np.array_equal(a, chunk(kv, i)), f"promoted chunk {i} took the caller's bytes"
        settled(store)
    finally:
        store.close()


def test_overlapping_buffers_are_refused_before_anything_is_read(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    pipelined: list[int],
) -> None:
    """The same buffer twice, or two overlapping views of one array: InvalidArgument
    at the call, nothing read, nothing pinned."""
    store, io, tokens, _, _ = store4
    hit = store.lookup(identity, PUBLIC, tokens)
    one = np.zeros(TINY.chunk_shape, np.float16)
    big = np.zeros((3, *TINY.chunk_shape), np.float16).reshape(-1)
    size = one.size
    views = [big[k * size // 2 : k * size // 2 + size].reshape(TINY.chunk_shape) for k in range(4)]
    io.arm()
    for bufs in ([one, np.zeros_like(one), one, np.zeros_like(one)], views):
        with pytest.raises(ValueError, match="share memory"):
            store.load_async(hit, bufs, depth=2)
    assert io.issued == 0 and pipelined == []
    settled(store)


def test_unaligned_buffers_go_through_staging_exact(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    tmp_path: Path,
    pipelined: list[int],
) -> None:
    """Buffers off the direct-read alignment (read into staging buffers, copied by the
    helper that verified them), one frame damaged: the healthy chunks before it land in
    the caller's buffers exact, the damaged one's buffer is never handed out."""
    store, _, tokens, kv, keys = store4
    frame = frame_of(tmp_path, keys[2])
    flip(frame.segment, frame.payload_offset + 1, 1)
    hit = store.lookup(identity, PUBLIC, tokens)
    bufs = [
        np.empty(CHUNK + 2, np.uint8)[2:].view(np.float16).reshape(TINY.chunk_shape)
        for _ in range(4)
    ]
    handle = store.load_async(hit, bufs, depth=2)
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4]
    assert res.loaded == 2 and res.corrupt == [keys[2]]
    for i in (0, 1):
        assert res.arrays[i] is bufs[i] and np.array_equal(bufs[i], chunk(kv, i))
    assert handle.chunk(2, timeout=WAIT) is None and handle.chunk(3, timeout=WAIT) is None
    settled(store)


# ---------------------------------------------------------------------------- framed replicas


def framed_chain_store(path: Path) -> KVStore:
    """DRAM (one chunk) over a lossless (framed) memory tier over a plain disk tier:
    chunks demoted through the framed tier reach the disk still framed."""
    return KVStore(
        path,
        StoreConfig(
            tiers=(
                TierSpec("memory", "dram", CHUNK),
                TierSpec("memory", "remote", 3 * CHUNK, transform="lossless"),
                TierSpec("disk", "disk", 1 << 24, options=(("segment_bytes", 1 << 20),)),
            )
        ),
    )


def _runs(indices: list[int]) -> list[int]:
    """Lengths of the runs of consecutive indices."""
    runs: list[int] = []
    for k, i in enumerate(indices):
        if k and indices[k - 1] == i - 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


@pytest.mark.parametrize("outs", [False, True], ids=["new-arrays", "buffers"])
@pytest.mark.parametrize("damage", [None, "first-disk", "last-disk"])
def test_framed_memory_chunks_between_pipelined_disk_runs(
    tmp_path: Path,
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
    outs: bool,
    damage: str | None,
) -> None:
    """Framed (lossless) chunks of a memory tier between runs of plain disk chunks (the
    ones demoted through it, stored decoded): the framed ones are read alone and
    decoded, each disk run pipelined; every chunk exact (bit for bit: lossless) and
    completed once, decodes counted; a damaged disk frame (the first disk chunk, or the
    last) is one counted corrupt miss, nothing after it handed out."""
    store = framed_chain_store(tmp_path)
    try:
        tokens, kv = prompt_kv(340, 6 * N)
        keys = list(store.put_prompt(identity, PUBLIC, tokens, kv).keys)
        store.evict("dram", CHUNK)
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS)
        layout = [(h.tier, h.transform) for h in hit.hits]
        disk = [i for i, t in enumerate(layout) if t[0] == "disk"]
        framed = [i for i, t in enumerate(layout) if t == ("remote", "lossless")]
        assert len(layout) == 6 and len(disk) + len(framed) == 6, layout
        assert len(_runs(disk)) >= 2 and framed[0] < disk[-1], layout
        bad = {None: None, "first-disk": disk[0], "last-disk": disk[-1]}[damage]
        if bad is not None:
            frame = frame_of(tmp_path, keys[bad])
            flip(frame.segment, frame.payload_offset + 3, 1)
        bufs = [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in range(6)] if outs else None
        completions.clear()
        handle = store.load_async(hit, bufs, depth=2)
        got = [handle.chunk(i, timeout=WAIT) for i in range(6)]
        res = handle.wait(timeout=WAIT)
        assert pipelined == _runs(disk), "a disk run was not pipelined as one"
        assert sorted(completions) == list(range(6))
        first_bad = 6 if bad is None else bad
        assert [g is not None for g in got] == [i < first_bad for i in range(6)]
        for i in range(first_bad):
            assert np.array_equal(got[i], chunk(kv, i)), f"chunk {i}"  # type: ignore[arg-type]
            if bufs is not None:
                assert got[i] is bufs[i]
        assert res.loaded == first_bad
        assert res.decoded == sum(1 for i in framed if i < first_bad)
        assert store.counters.corrupt == (bad is not None)
        assert res.corrupt == ([] if bad is None else [keys[bad]])
        settled(store)
    finally:
        store.close()


def test_a_transforming_disk_tier_is_not_pipelined_and_loads_right(
    tmp_path: Path, identity: ModelIdentity, pipelined: list[int]
) -> None:
    """Every replica of a lossless disk tier is framed: the load takes the chained path
    (no ``read_pipelined``), decodes every chunk bit-exact, leaves no pin."""
    store = KVStore(
        tmp_path,
        StoreConfig(
            tiers=(
                TierSpec(
                    "disk",
                    "disk",
                    1 << 24,
                    options=(("segment_bytes", 1 << 20),),
                    transform="lossless",
                ),
            )
        ),
    )
    try:
        tokens, kv = prompt_kv(341, 4 * N)
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens, accept=Accept.LOSSLESS)
        assert [h.transform for h in hit.hits] == ["lossless"] * 4
        res = store.load_async(hit, depth=2).wait(timeout=WAIT)
        assert pipelined == []
        assert res.loaded == 4 and res.decoded == 4
        for i, a in enumerate(res.arrays):
            assert np.array_equal(a, chunk(kv, i))
        settled(store)
    finally:
        store.close()


# ---------------------------------------------------------------------------- liveness


class StallIO(FileIO):
    """While ``go`` is clear, every read not issued by a store I/O-pool thread
    (``kvlife-load*``: where a pipelined load reads) stalls until it is set; counts the
    stalled reads of the tier's helper threads (``kvlife-read*``)."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.go = threading.Event()
        self.go.set()
        self.lock = threading.Lock()
        self.helpers_stalled = 0

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        name = threading.current_thread().name
        if not self.go.is_set() and not name.startswith("kvlife-load"):
            if name.startswith("kvlife-read"):
                with self.lock:
                    self.helpers_stalled += 1
            if not self.go.wait(WAIT * 3):
                raise OSError(errno.EIO, "test stall was never released")
        return super().preadv(fd, buffers, offset)


@contextlib.contextmanager
def _stalled_helpers(
    tmp_path: Path, identity: ModelIdentity, seed: int
) -> Iterator[tuple[KVStore, StallIO, LookupResult, np.ndarray, list[threading.Thread]]]:
    """A disk-only store whose read helpers are all held by sixteen synchronous loads
    stalled in the device (a slow region of the disk), and the lookup of another,
    2-chunk prompt whose reads return at once; the stalls end when the block does."""
    io = StallIO()
    store = disk_only(tmp_path, io)
    stalled: list[threading.Thread] = []
    try:
        slow = [prompt_kv(seed + 1 + p, 4 * N) for p in range(16)]
        for t, k in slow:
            store.put_prompt(identity, PUBLIC, t, k)
        tokens, kv = prompt_kv(seed, 2 * N)
        store.put_prompt(identity, PUBLIC, tokens, kv)
        slow_hits = [store.lookup(identity, PUBLIC, t) for t, _ in slow]
        hit = store.lookup(identity, PUBLIC, tokens)
        io.go.clear()
        for h in slow_hits:
            th = threading.Thread(target=store.load, args=(h,), daemon=True)
            th.start()
            stalled.append(th)
        wait_until(lambda: io.helpers_stalled >= 16, "the helper pool to fill with stalled reads")
        yield store, io, hit, kv, stalled
    finally:
        io.go.set()
        for th in stalled:
            th.join(WAIT)
        store.close()
    assert not any(th.is_alive() for th in stalled)


@pytest.mark.parametrize("mode", ["chained", "one-cpu"])
def test_a_load_whose_reads_returned_does_not_wait_for_other_loads_stalled_reads(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Sixteen synchronous loads stall in the device, their batch helpers filling the
    tier's helper pool; a ``depth=2`` load of another prompt, whose own reads return at
    once, must still hand out its chunks (chained: it does; pipelined: its checks run on
    a pool of their own since the review, before they queued behind the stalls)."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: mode == "one-cpu")
    with _stalled_helpers(tmp_path, identity, 349) as (store, _, hit, kv, _):
        handle = store.load_async(hit, depth=2)
        first = handle.chunk(0, timeout=2.0)  # TimeoutError: the load is starved
        assert first is not None and np.array_equal(first, chunk(kv, 0))


def test_a_starved_pipelined_load_completes_once_the_stalled_reads_return(
    tmp_path: Path, identity: ModelIdentity, pipelined: list[int]
) -> None:
    """The same stalls, then the stalled reads return: the pipelined load completes (no
    deadlock), exact, and every load leaves no pin."""
    with _stalled_helpers(tmp_path, identity, 369) as (store, io, hit, kv, stalled):
        handle = store.load_async(hit, depth=2)
        io.go.set()
        res = handle.wait(timeout=WAIT)
        assert pipelined == [2]
        assert res.loaded == 2
        for i, a in enumerate(res.arrays):
            assert np.array_equal(a, chunk(kv, i))
        for th in stalled:
            th.join(WAIT)
        assert not any(th.is_alive() for th in stalled)
        settled(store)


# ---------------------------------------------------------------------------- fallbacks


def test_a_disk_replica_gone_in_a_later_run_falls_back_and_ends_there(
    tmp_path: Path,
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
) -> None:
    """DRAM, disk, disk, DRAM, disk, disk with chunk 4's disk replica deleted behind the
    store's back: the first disk run is pipelined, the second finds the key gone before
    reading and goes one chunk at a time; chunks 0-3 exact, nothing from chunk 4 on
    handed out (vanished, counted once), every chunk completed once, no pin left."""
    store, tokens, kv, keys = mixed_store(tmp_path, identity, FileIO(direct=False), (0, 3), 6)
    try:
        hit = store.lookup(identity, PUBLIC, tokens)
        assert store.tier("disk").delete(keys[4]) > 0
        completions.clear()
        handle = store.load_async(hit, depth=2)
        got = [handle.chunk(i, timeout=WAIT) for i in range(6)]
        res = handle.wait(timeout=WAIT)
        assert pipelined == [2, 2]
        assert sorted(completions) == list(range(6))
        assert [g is not None for g in got] == [True] * 4 + [False] * 2
        for i in range(4):
            assert np.array_equal(got[i], chunk(kv, i))  # type: ignore[arg-type]
        assert res.loaded == 4 and res.vanished == 1
        assert store.counters.corrupt == 0 and store.counters.read_errors == 0
        settled(store)
    finally:
        store.close()


def test_a_buffer_that_does_not_fit_a_replica_is_a_typed_miss_never_a_hang(
    store4: tuple[KVStore, ScriptedIO, np.ndarray, np.ndarray, list[ChunkKey]],
    identity: ModelIdentity,
    pipelined: list[int],
    completions: list[int],
) -> None:
    """Chunk 2's buffer has the wrong dtype (the store does not check buffers against
    the replicas; the tier does): the pipelined run refuses before reading anything and
    the load goes one chunk at a time, as the chained reads do: chunks 0 and 1 handed
    out exact, chunk 2 a read-error miss counted once, nothing from it on handed out,
    each chunk completed once, nothing written into chunk 2's buffer, no pin left."""
    store, io, tokens, kv, _ = store4
    hit = store.lookup(identity, PUBLIC, tokens)
    bufs = [np.full(TINY.chunk_shape, np.nan, np.float16) for _ in range(4)]
    bufs[2] = np.zeros(TINY.chunk_shape, np.float32)
    io.arm()
    completions.clear()
    handle = store.load_async(hit, bufs, depth=2)
    res = handle.wait(timeout=WAIT)
    assert pipelined == [4] and sorted(completions) == [0, 1, 2, 3]
    got = [handle.chunk(i, timeout=WAIT) for i in range(4)]
    assert [g is not None for g in got] == [True, True, False, False]
    for i in (0, 1):
        assert got[i] is bufs[i] and np.array_equal(got[i], chunk(kv, i))  # type: ignore[arg-type]
    assert res.loaded == 2 and res.read_errors == 1 and store.counters.read_errors == 1
    assert not bufs[2].any()
    settled(store)
