"""Pipelined disk loads (issue 28): a chained ``load_async`` submits its next read as soon
as the disk tier's ``preadv`` returned (the tier's read hook), so that the checksum
(and copy) of one chunk overlaps the read of the next, and no promise moves: every
byte is verified before it is handed out, a corrupt chunk in the middle is a counted
miss with nothing after it handed out, pins balance, a close with reads in flight gives
typed misses, and reads in flight never exceed the load's depth.

On one CPU (``kvlife serve --cpus`` with one) a load's chunks are instead read back to
back by one task, each verified on a helper of the disk tier meanwhile
(``read_pipelined``): the tests marked ``mode`` run both ways, and the tier's own tests
below check that the reading thread never waits for a checksum.

Orders are forced with events and barriers (each wait bounded by ``WAIT``: a hang is
a failure, never a speed claim)."""

from __future__ import annotations

import errno
import itertools
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import ChecksumMismatch, ReplicaNotFound, StoreClosedError
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.native import frames as native_frames
from kvlife.store import KVStore, reads
from kvlife.tiers.base import ReplicaMeta, Reservation, device_read_returned, when_read_returns
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk import reader as disk_reader
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import payload_checksum
from tests.conftest import TINY, budget, prompt_kv, tiny_identity

N = TINY.tokens_per_chunk
WAIT = 10.0


def chunks_of(kv: np.ndarray, n: int) -> list[np.ndarray]:
    return [kv[:, :, :, i * N : (i + 1) * N, :] for i in range(n)]


def disk_only(path: Path, io: FileIO) -> KVStore:
    return KVStore.open(path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20, fileio=io)


class GatedIO(FileIO):
    """Counts reads in flight (``most``: the most at once) and the reads issued; read
    number ``hold`` (0-based, once armed) blocks until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.issued = 0
        self.armed = False
        self.hold = -1
        self.entered = threading.Event()
        self.release = threading.Event()
        self.started: list[threading.Event] = [threading.Event() for _ in range(16)]

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        with self.lock:
            k = self.issued
            self.issued += 1
            self.now += 1
            self.most = max(self.most, self.now)
        if k < len(self.started):
            self.started[k].set()
        try:
            if self.armed and k == self.hold:
                self.entered.set()
                if not self.release.wait(WAIT * 3):
                    raise OSError(errno.EIO, "test hold was never released")
            return super().preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self.now -= 1


@pytest.fixture(params=["chained", "one-cpu", "native"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a load with a depth reads: chained (one chunk per task, the next submitted
    from the read hook), as on one CPU back to back in one task, or (where the disk
    tier reads runs through the C extension, on any number of CPUs) one native run
    per task. The first two with the extension off; a tier whose reads go through a
    test's FileIO subclass reads through Python in every mode."""
    monkeypatch.setattr(reads, "_one_cpu", lambda: request.param == "one-cpu")
    if request.param != "native":
        monkeypatch.setattr(disk_reader, "usable", lambda io: False)
    elif not native_frames.available():
        pytest.skip("kvlife.native._frames not built (tests/test_native_frames.py fails)")
    return str(request.param)


def _verify_waits_for(monkeypatch: pytest.MonkeyPatch, event: threading.Event) -> list[bool]:
    """The first frame verification waits (bounded) for ``event``; whether it was set."""
    seen: list[bool] = []
    calls = itertools.count()
    real = CatalogRow.verify

    def verify(
        self: CatalogRow, header: memoryview | bytes, payload: list[np.ndarray] | None
    ) -> str:
        if next(calls) == 0:  # atomic: the first caller alone waits
            seen.append(event.wait(WAIT))
        return real(self, header, payload)

    monkeypatch.setattr(CatalogRow, "verify", verify)
    return seen


def test_the_next_read_runs_while_a_chunk_is_verified(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A ``depth=1`` load: chunk 0's verification waits for chunk 1's read to start; the
    load completes (before, chunk 1 was submitted only after chunk 0's checksum: the
    wait ran out), with one read in flight at a time, in chunk order, every chunk exact."""
    io = GatedIO()
    tokens, kv = prompt_kv(90, 4 * N)
    with disk_only(tmp_path, io) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens)
        io.most = io.issued = 0
        for ev in io.started:
            ev.clear()
        seen = _verify_waits_for(monkeypatch, io.started[1])
        res = store.load_async(hit, depth=1).wait(timeout=WAIT * 2)
        assert seen == [True], "chunk 1's read was not submitted before chunk 0 verified"
        assert res.loaded == 4 and io.most == 1
        for a, b in zip(res.arrays, chunks_of(kv, 4), strict=True):
            assert np.array_equal(a, b)
        assert not store._core.pinned


@pytest.mark.parametrize("depth", [1, 2, None])
@pytest.mark.parametrize("outs", [False, True], ids=["new-arrays", "buffers"])
def test_a_corrupt_middle_frame_of_a_pipelined_load_is_a_counted_miss(
    tmp_path: Path, identity: ModelIdentity, depth: int | None, outs: bool, mode: str
) -> None:
    """Chunk 2 of 5 damaged on disk, read while chunk 3's read is already in flight:
    chunks 0 and 1 exact, chunk 2 a counted corrupt miss, nothing after it handed out
    (its buffer is never returned), pins balanced; the synchronous load agrees."""
    tokens, kv = prompt_kv(91, 5 * N)
    with disk_only(tmp_path, FileIO(direct=False)) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    frame = next(f for f in scan_frames(tmp_path) if f.key == keys[2])
    flip(frame.segment, frame.payload_offset + 7, 2)
    with disk_only(tmp_path, FileIO(direct=False)) as store:
        hit = store.lookup(identity, PUBLIC, tokens)
        assert len(hit.hits) == 5
        bufs = [np.zeros_like(c) for c in chunks_of(kv, 5)] if outs else None
        handle = store.load_async(hit, bufs, depth=depth)
        res = handle.wait(timeout=WAIT)
        assert res.loaded == 2 and res.corrupt == [keys[2]]
        for a, b in zip(res.arrays, chunks_of(kv, 2), strict=True):
            assert np.array_equal(a, b)
        assert [handle.chunk(i, timeout=WAIT) is not None for i in range(5)] == [True] * 2 + [
            False
        ] * 3
        assert store.counters.corrupt == 1
        assert not store._core.pinned, "a pipelined load left pins behind"
        again = store.load(store.lookup(identity, PUBLIC, tokens))
        assert again.loaded == 2 and not store._core.pinned


def test_close_with_a_read_in_flight_behind_a_verified_chunk_gives_typed_misses(
    tmp_path: Path, identity: ModelIdentity, mode: str
) -> None:
    """``depth=1``: chunk 0 read, chunk 1's read (submitted from chunk 0's read hook)
    held in the device while the store closes. Chunks 0 and 1 are handed out exact (a
    read started before the close finishes), chunks 2 and 3 are misses never read,
    ``wait()`` raises StoreClosedError, no read error is counted, no pin is left."""
    io = GatedIO()
    tokens, kv = prompt_kv(92, 4 * N)
    store = disk_only(tmp_path, io)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    hit = store.lookup(identity, PUBLIC, tokens)
    io.issued = 0
    io.hold, io.armed = 1, True
    handle = store.load_async(hit, depth=1)
    assert io.entered.wait(WAIT)
    first = handle.chunk(0, timeout=WAIT)
    assert first is not None and np.array_equal(first, chunks_of(kv, 1)[0])
    closer = threading.Thread(target=store.close)
    closer.start()
    pool = store._reader._pool
    assert pool is not None
    deadline = time.monotonic() + WAIT
    while not pool._shutdown and time.monotonic() < deadline:  # close() reached the
        closer.join(0.01)  # I/O pool's shutdown, which waits for the read in flight
    assert pool._shutdown
    io.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    second = handle.chunk(1, timeout=WAIT)
    assert second is not None and np.array_equal(second, chunks_of(kv, 2)[1])
    assert [handle.chunk(i, timeout=WAIT) for i in (2, 3)] == [None, None]
    with pytest.raises(StoreClosedError, match="closed"):
        handle.wait(timeout=WAIT)
    assert store.counters.read_errors == 0
    assert not store._core.pinned
    assert io.issued == 2, "a chunk was read after the close"


def _disk_tier(
    path: Path, io: FileIO, arrays: list[np.ndarray], depth: int
) -> tuple[DiskTier, list[ChunkKey]]:
    tier = DiskTier(
        path / "disk", DiskTierConfig(64 << 20, direct_io=False, io_depth=depth), fileio=io
    )
    metas = [
        ReplicaMeta(ChunkKey(bytes([i + 1]) * 32), "float16", a.shape, checksum=payload_checksum(a))
        for i, a in enumerate(arrays)
    ]
    res = tier.prepare_store(metas)
    assert isinstance(res, Reservation)
    tier.commit_store(res, arrays)
    return tier, [m.key for m in metas]


def test_a_corrupt_frame_in_a_pipelined_batch_is_its_own_miss(tmp_path: Path) -> None:
    """A batch of 6 frames read by the caller and a helper (one verifies while the other
    reads), a read hook set in the caller's thread: the damaged frame is a
    ChecksumMismatch, every other frame exact (into buffers and new arrays), and the
    hook ran at most once, in the caller's thread only."""
    arrays = [np.full((64, 64), i, np.float16) for i in range(6)]
    tier, keys = _disk_tier(tmp_path, FileIO(direct=False), arrays, depth=2)
    try:
        frame = next(f for f in scan_frames(tmp_path) if f.key == keys[3])
        flip(frame.segment, frame.payload_offset + 11, 1)
        for outs in (None, [np.zeros_like(a) for a in arrays]):
            fired: list[str] = []

            def hook(fired: list[str] = fired) -> None:
                fired.append(threading.current_thread().name)

            with when_read_returns(hook):
                got = tier.read_batch(keys, outs)
            # at most once, and never in a helper's thread (the caller reads a frame
            # unless its helper took them all first)
            assert fired in ([], [threading.current_thread().name])
            for i, (a, g) in enumerate(zip(arrays, got, strict=True)):
                if i == 3:
                    assert isinstance(g, ChecksumMismatch)
                else:
                    assert isinstance(g, np.ndarray) and np.array_equal(a, g)
    finally:
        tier.close()


def test_the_read_hook_runs_once_in_its_thread_and_is_restored() -> None:
    calls: list[str] = []
    device_read_returned()  # no hook: nothing
    with when_read_returns(lambda: calls.append("outer")):
        with when_read_returns(lambda: calls.append("inner")):
            other = threading.Thread(target=device_read_returned)
            other.start()
            other.join()
            assert calls == [], "a hook ran from another thread"
            device_read_returned()
            device_read_returned()
        assert calls == ["inner"]
        device_read_returned()
    device_read_returned()
    assert calls == ["inner", "outer"]


class _Recorded(GatedIO):
    """GatedIO that also records which thread issued each read."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        self.threads.append(threading.current_thread().name)
        return super().preadv(fd, buffers, offset)


def test_read_pipelined_reads_back_to_back_while_a_helper_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frame 0's verification waits for frame 2's read to start: it starts (the reading
    thread never waits for a checksum), every read in the caller's thread, one at a
    time, each frame's outcome given once and exact."""
    arrays = [np.full((64, 64), i, np.float16) for i in range(4)]
    io = _Recorded()
    tier, keys = _disk_tier(tmp_path, io, arrays, depth=4)
    try:
        io.issued, io.most = 0, 0
        io.threads.clear()
        for ev in io.started:
            ev.clear()
        seen = _verify_waits_for(monkeypatch, io.started[2])
        got: dict[int, object] = {}
        lock = threading.Lock()

        def done(i: int, res: object) -> None:
            with lock:
                assert i not in got, f"frame {i} given twice"
                got[i] = res

        assert tier.read_pipelined(keys, [None] * 4, done) == 4
        assert seen == [True], "frame 2's read waited for frame 0's checksum"
        assert io.threads == [threading.current_thread().name] * 4 and io.most == 1
        assert sorted(got) == [0, 1, 2, 3]
        for i, a in enumerate(arrays):
            g = got[i]
            assert isinstance(g, np.ndarray) and np.array_equal(g, a) and not g.flags.writeable
    finally:
        tier.close()


@pytest.mark.parametrize("outs", ["new", "aligned", "unaligned"])
def test_read_pipelined_a_corrupt_frame_is_its_own_miss(tmp_path: Path, outs: str) -> None:
    arrays = [np.full((64, 64), i, np.float16) for i in range(5)]
    tier, keys = _disk_tier(tmp_path, FileIO(direct=False), arrays, depth=2)
    try:
        frame = next(f for f in scan_frames(tmp_path) if f.key == keys[2])
        flip(frame.segment, frame.payload_offset + 5, 1)
        if outs == "new":
            bufs: list[np.ndarray | None] = [None] * 5
        elif outs == "aligned":
            bufs = [aligned_empty(a.nbytes).view(np.float16).reshape(a.shape) for a in arrays]
        else:  # off the alignment a direct read needs: through a staging buffer
            bufs = [
                np.empty(a.nbytes + 2, np.uint8)[2:].view(np.float16).reshape(a.shape)
                for a in arrays
            ]
        got: dict[int, object] = {}
        tier.read_pipelined(keys, bufs, got.__setitem__)
        assert sorted(got) == [0, 1, 2, 3, 4]
        assert isinstance(got[2], ChecksumMismatch)
        for i in (0, 1, 3, 4):
            g = got[i]
            assert isinstance(g, np.ndarray) and np.array_equal(g, arrays[i])
            if bufs[i] is not None:
                assert g is bufs[i]
    finally:
        tier.close()


def test_read_pipelined_of_a_missing_key_reads_nothing(tmp_path: Path) -> None:
    arrays = [np.full((64, 64), i, np.float16) for i in range(3)]
    io = GatedIO()
    tier, keys = _disk_tier(tmp_path, io, arrays, depth=2)
    try:
        io.issued = 0
        given: list[int] = []
        with pytest.raises(ReplicaNotFound):
            tier.read_pipelined(
                [*keys[:2], ChunkKey(b"\xee" * 32)], [None] * 3, lambda i, _r: given.append(i)
            )
        assert io.issued == 0 and given == []
    finally:
        tier.close()


def test_read_pipelined_raises_what_a_done_raised_after_the_others_and_unpins(
    tmp_path: Path,
) -> None:
    """A ``done`` that raises for frame 1: every other frame is still given, the error
    is raised after, and the segments are unpinned (a later read and delete work)."""
    arrays = [np.full((64, 64), i, np.float16) for i in range(4)]
    tier, keys = _disk_tier(tmp_path, FileIO(direct=False), arrays, depth=2)
    try:
        given: list[int] = []

        def done(i: int, _res: object) -> None:
            given.append(i)
            if i == 1:
                raise RuntimeError("consumer failed")

        with pytest.raises(RuntimeError, match="consumer failed"):
            tier.read_pipelined(keys, [None] * 4, done)
        assert sorted(given) == [0, 1, 2, 3]
        table = tier._reader._table
        assert all(seg.readers == 0 for seg in table.segments.values())
    finally:
        tier.close()


def test_read_pipelined_stops_where_proceed_says(tmp_path: Path) -> None:
    arrays = [np.full((64, 64), i, np.float16) for i in range(4)]
    io = GatedIO()
    tier, keys = _disk_tier(tmp_path, io, arrays, depth=2)
    try:
        io.issued = 0
        asked = itertools.count()
        got: dict[int, object] = {}
        n = tier.read_pipelined(keys, [None] * 4, got.__setitem__, lambda: next(asked) < 1)
        assert n == 2 and io.issued == 2 and sorted(got) == [0, 1]
    finally:
        tier.close()


def test_a_replica_gone_from_the_disk_under_a_load_is_a_miss_from_there(
    tmp_path: Path, identity: ModelIdentity, mode: str
) -> None:
    """Chunk 2's disk replica deleted behind the store's back before a load: chunks 0
    and 1 exact, nothing from chunk 2 on handed out, no pin left (one CPU: the
    pipelined read finds the key gone before reading anything and falls back to one
    chunk at a time)."""
    tokens, kv = prompt_kv(93, 4 * N)
    with disk_only(tmp_path, FileIO(direct=False)) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        hit = store.lookup(identity, PUBLIC, tokens)
        assert store.tier("disk").delete(keys[2]) > 0
        handle = store.load_async(hit, depth=2)
        res = handle.wait(timeout=WAIT)
        assert res.loaded == 2
        for a, b in zip(res.arrays, chunks_of(kv, 2), strict=True):
            assert np.array_equal(a, b)
        assert [handle.chunk(i, timeout=WAIT) is not None for i in range(4)] == [True] * 2 + [
            False
        ] * 2
        assert not store._core.pinned


@settings(max_examples=budget(12, 30), deadline=None, database=None)
@given(
    n=st.integers(1, 5),
    bad=st.sets(st.integers(0, 4), max_size=2),
    depth=st.sampled_from([1, 2, 3]),
    buffers=st.booleans(),
    native=st.booleans(),
)
def test_a_pipelined_load_agrees_with_a_synchronous_one(
    n: int, bad: set[int], depth: int, buffers: bool, native: bool
) -> None:
    """As on one CPU (or natively): any damaged frames, any depth, buffers or not: the
    pipelined load hands out exactly the chunks before the first damaged one, exact,
    counts that one corrupt, leaves no pin; a synchronous load of the same prompt
    afterwards agrees."""
    identity = tiny_identity()
    tokens, kv = prompt_kv(94 + n, n * N)
    bad = {b for b in bad if b < n}
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(reads, "_one_cpu", lambda: True)
        if not native:  # the Python path's pipelined reads (else the extension's)
            mp.setattr(disk_reader, "usable", lambda io: False)
        path = Path(tmp)
        with disk_only(path, FileIO(direct=False)) as store:
            keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        for b in bad:
            frame = next(f for f in scan_frames(path) if f.key == keys[b])
            flip(frame.segment, frame.payload_offset + 3, 1)
        first = min(bad, default=n)
        with disk_only(path, FileIO(direct=False)) as store:
            hit = store.lookup(identity, PUBLIC, tokens)
            bufs = [np.zeros_like(c) for c in chunks_of(kv, n)] if buffers else None
            handle = store.load_async(hit, bufs, depth=depth)
            res = handle.wait(timeout=WAIT)
            assert res.loaded == first
            assert res.corrupt == ([keys[first]] if first < n else [])
            for i, a in enumerate(res.arrays):
                assert np.array_equal(a, chunks_of(kv, n)[i])
                if bufs is not None:
                    assert a is bufs[i]
            got = [handle.chunk(i, timeout=WAIT) is not None for i in range(n)]
            assert got == [True] * first + [False] * (n - first)
            assert not store._core.pinned
            again = store.load(store.lookup(identity, PUBLIC, tokens))
            assert again.loaded == first and not store._core.pinned
