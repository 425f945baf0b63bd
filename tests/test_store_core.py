"""The second store core: gap-safe prefix invalidation, counted demotion failures, a third
tier with no edit of the facade, lookups that never wait for I/O, asynchronous loads."""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import InvalidArgument, StoreClosedError
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.faults.fileio import FaultyIO
from kvlife.store import KVStore, TierSpec
from kvlife.tiers.disk.fileio import FileIO
from tests.conftest import TINY, prompt_kv
from tests.helpers.workload import disk_of

CHUNK = TINY.chunk_nbytes
N = TINY.tokens_per_chunk
WAIT = 10.0  # seconds; a bound for "does not hang", never a speed claim


def chunks_of(kv: np.ndarray, n: int) -> list[np.ndarray]:
    return [kv[:, :, :, i * N : (i + 1) * N, :] for i in range(n)]


def disk_only(path: Path, **kw: object) -> KVStore:
    return KVStore.open(path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- bug 1


def test_prefix_invalidation_reaches_chunks_behind_a_corrupt_gap(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A→B→C on disk, B's frame damaged and dropped on load: invalidating from A must take
    C too, so re-putting A and B never brings C back."""
    tokens, kv = prompt_kv(7, 3 * N)
    with disk_only(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    frame_b = next(f for f in scan_frames(tmp_path) if f.key == keys[1])
    flip(frame_b.segment, frame_b.payload_offset + 5, 3)
    with disk_only(tmp_path) as store:
        loaded = store.load(store.lookup(identity, PUBLIC, tokens))
        assert loaded.loaded == 1 and loaded.corrupt == [keys[1]]
        assert set(store.indexed_keys()) == {keys[0], keys[2]}
        assert store.invalidate(prefix=keys[0]) == 2
        assert store.indexed_keys() == []
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        hit = store.lookup(identity, PUBLIC, tokens)
        assert hit.tokens == 2 * N, "an invalidated chunk behind the gap is served again"


def test_async_load_of_a_corrupt_frame_counts_it_corrupt_and_invalidates_it(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """load_async must treat a checksum mismatch as corruption (invalidate, count
    ``corrupt``), as load() does, not as an I/O error that keeps the bad replica."""
    tokens, kv = prompt_kv(11, 3 * N)
    with disk_only(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    frame_b = next(f for f in scan_frames(tmp_path) if f.key == keys[1])
    flip(frame_b.segment, frame_b.payload_offset + 5, 3)
    with disk_only(tmp_path) as store:
        res = store.load_async(store.lookup(identity, PUBLIC, tokens)).wait()
        assert res.loaded == 1 and res.corrupt == [keys[1]] and res.read_errors == 0
        assert store.counters.corrupt == 1 and store.counters.read_errors == 0
        assert keys[1] not in store.indexed_keys()


def test_prefix_invalidation_reaches_behind_a_gap_after_a_restart(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The same across a restart: the disk tier keeps the link A->B when it deletes B's
    row while C is still stored, so a later session still knows C is chained after A."""
    tokens, kv = prompt_kv(9, 3 * N)
    with disk_only(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    frame_b = next(f for f in scan_frames(tmp_path) if f.key == keys[1])
    flip(frame_b.segment, frame_b.payload_offset + 5, 3)
    with disk_only(tmp_path) as store:
        assert store.load(store.lookup(identity, PUBLIC, tokens)).corrupt == [keys[1]]
    with disk_only(tmp_path) as store:  # a new session: B is gone from the catalog
        assert set(store.indexed_keys()) == {keys[0], keys[2]}
        assert store.invalidate(prefix=keys[0]) == 2
    with disk_only(tmp_path) as store:
        assert store.indexed_keys() == []
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        assert store.lookup(identity, PUBLIC, tokens).tokens == 2 * N
        # the links kept are the stored chunks' own (B->A); none leads to nothing stored
        kept = disk_of(store).load_edges()
        assert kept == [(keys[1], keys[0])], "a link that leads nowhere was kept"


def test_prefix_invalidation_from_an_absent_root(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(8, 3 * N)
    with disk_only(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        store.invalidate(prefix=keys[1])  # B and C
        store.put_prompt(identity, PUBLIC, tokens, kv)  # all three again
        assert store.invalidate(prefix=keys[0]) == 3


# ---------------------------------------------------------------------- bug 2


def test_failed_demotion_is_counted_and_explained(tmp_path: Path, identity: ModelIdentity) -> None:
    """A demotion whose disk write fails must not drop the DRAM replicas silently."""
    io = FaultyIO()
    sink = MemorySink()
    first_t, first_kv = prompt_kv(20, 4 * N)
    second_t, second_kv = prompt_kv(21, 4 * N)
    with KVStore.open(
        tmp_path, dram_bytes=4 * CHUNK, disk_bytes=1 << 24, segment_bytes=1 << 20,
        fileio=io, sink=sink,
    ) as store:  # fmt: skip
        first = store.put_prompt(identity, PUBLIC, first_t, first_kv)
        io.arm("pwritev", errno.EIO)
        second = store.put_prompt(identity, PUBLIC, second_t, second_kv)
        io.disarm()
        assert second.stored == 4
        assert store.counters.demote_failed == 4
        assert store.counters.demotions == 0
        gone = {
            e.key
            for e in sink.take()
            if e.kind == "invalidate" and "demote to disk failed" in e.reason
        }
        assert gone == {k.hex() for k in first.keys}, "each lost chunk is an explained event"
        assert store.lookup(identity, PUBLIC, first_t).tokens == 0
        loaded = store.get(identity, PUBLIC, second_t)
        assert loaded.loaded == 4
        for a, b in zip(loaded.arrays, chunks_of(second_kv, 4), strict=True):
            assert np.array_equal(a, b)


# ---------------------------------------------------------------------- a third tier


def three_tiers(path: Path, sink: MemorySink | None = None) -> KVStore:
    chain = (
        TierSpec("memory", "dram", 4 * CHUNK),
        TierSpec("memory", "remote", 8 * CHUNK),
        TierSpec("disk", "disk", 1 << 24, options=(("segment_bytes", 1 << 20),)),
    )
    return KVStore.open(path, tiers=chain, sink=sink)


def test_a_third_tier_in_the_chain_demotes_promotes_and_recovers(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    prompts = [prompt_kv(30 + i, 4 * N) for i in range(6)]
    with three_tiers(tmp_path) as store:
        assert store.tier_names == ["dram", "remote", "disk"]
        for tokens, kv in prompts:
            store.put_prompt(identity, PUBLIC, tokens, kv)
        c = store.counters
        assert c.tier("remote").stored >= 8 and c.tier("disk").stored >= 4
        assert c.tier("remote").evictions > 0
        seen: set[str] = set()
        for tokens, kv in prompts:
            hit = store.lookup(identity, PUBLIC, tokens)
            assert hit.tokens == 4 * N
            seen.update(hit.tiers())
            loaded = store.load(hit)
            store.drain()
            for a, b in zip(loaded.arrays, chunks_of(kv, 4), strict=True):
                assert np.array_equal(a, b)
        assert seen == {"dram", "remote", "disk"} or {"remote", "disk"} <= seen
        info = {t.name: t for t in store.info().tiers}
        assert info["remote"].used_bytes <= 8 * CHUNK and info["dram"].used_bytes <= 4 * CHUNK
    with three_tiers(tmp_path) as store:  # only the durable tier comes back
        for tokens, _ in prompts:
            loaded = store.get(identity, PUBLIC, tokens)
            assert loaded.loaded == 4 and set(loaded.tiers) == {"disk"}


# ---------------------------------------------------------------------- I/O outside the lock


class StallingIO(FileIO):
    """Reads at file offsets >= ``from_offset`` block until released (once armed)."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.armed = False
        self.from_offset = 0
        self.release = threading.Event()
        self.stalled = threading.Event()

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        if self.armed and offset >= self.from_offset:
            self.stalled.set()
            if not self.release.wait(WAIT * 3):
                raise OSError(errno.EIO, "test stall was never released")
        return super().preadv(fd, buffers, offset)


def test_lookup_and_put_complete_while_a_disk_read_is_stalled(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    io = StallingIO()
    cold_t, cold_kv = prompt_kv(40, 2 * N)
    hot_t, hot_kv = prompt_kv(41, 2 * N)
    new_t, new_kv = prompt_kv(42, 2 * N)
    with KVStore.open(
        tmp_path, dram_bytes=8 * CHUNK, disk_bytes=1 << 24, fileio=io, promote_on_hit=False
    ) as store:
        store.put_prompt(identity, PUBLIC, cold_t, cold_kv)
        store.flush()
        store.evict("dram", 8 * CHUNK)  # cold now lives on disk only
        store.put_prompt(identity, PUBLIC, hot_t, hot_kv)
        io.armed = True
        result: list[object] = []
        reader = threading.Thread(
            target=lambda: result.append(store.get(identity, PUBLIC, cold_t)), daemon=True
        )
        reader.start()
        assert io.stalled.wait(WAIT), "the disk read never started"
        done = threading.Event()

        def others() -> None:
            assert store.lookup(identity, PUBLIC, hot_t).tokens == 2 * N
            assert store.get(identity, PUBLIC, hot_t).loaded == 2
            assert store.put_prompt(identity, PUBLIC, new_t, new_kv).stored == 2
            done.set()

        worker = threading.Thread(target=others, daemon=True)
        worker.start()
        finished = done.wait(WAIT)
        assert reader.is_alive(), "the stalled read finished early: the test proves nothing"
        io.release.set()
        reader.join(WAIT)
        worker.join(WAIT)
        assert finished, "a lookup, a DRAM load or a put waited behind a stalled disk read"
        (cold,) = result
        assert cold.loaded == 2  # type: ignore[attr-defined]


def test_async_load_hands_out_chunk_zero_while_later_chunks_are_in_flight(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    io = StallingIO()
    tokens, kv = prompt_kv(50, 4 * N)
    with disk_only(tmp_path, fileio=io) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        io.from_offset = 1  # the first frame sits at offset 0: only chunk 0 reads freely
        io.armed = True
        hit = store.lookup(identity, PUBLIC, tokens)
        outs = [np.empty_like(c) for c in chunks_of(kv, 4)]
        handle = store.load_async(hit, outs)
        first = handle.chunk(0, timeout=WAIT)
        assert first is not None and np.array_equal(first, chunks_of(kv, 4)[0])
        assert not handle.done(), "chunk 0 was only handed out after the whole load"
        io.release.set()
        res = handle.wait(timeout=WAIT)
        assert res.loaded == 4 and handle.done()
        for a, b in zip(res.arrays, chunks_of(kv, 4), strict=True):
            assert np.array_equal(a, b)
        again = store.load(store.lookup(identity, PUBLIC, tokens))
        assert again.loaded == 4


def test_an_async_load_tells_each_chunk_to_every_waiter_in_order(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The handle's per-chunk waits (one condition per load since issue 28, an Event per
    chunk before): while chunk 1's read is held, ``completed()`` counts the one chunk
    before it, a wait for chunk 1 or 2 with a timeout raises TimeoutError, and waiters
    already blocked on chunks 1-3 in other threads each get their own chunk once the
    read is released; a chunk waited for twice is the same array."""
    io = StallingIO()
    tokens, kv = prompt_kv(53, 4 * N)
    with disk_only(tmp_path, fileio=io) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        io.from_offset = 1  # the first frame sits at offset 0: only chunk 0 reads freely
        io.armed = True
        hit = store.lookup(identity, PUBLIC, tokens)
        outs = [np.empty_like(c) for c in chunks_of(kv, 4)]
        handle = store.load_async(hit, outs, depth=1)
        first = handle.chunk(0, timeout=WAIT)
        assert first is outs[0] and np.array_equal(first, chunks_of(kv, 4)[0])
        assert io.stalled.wait(WAIT)
        assert handle.completed() == 1 and not handle.done()
        for i in (1, 2):
            with pytest.raises(TimeoutError, match="chunk 1 did not complete"):
                handle.chunk(i, timeout=0.05)
        got: dict[int, np.ndarray | None] = {}
        waiters = [  # no timeout: a waiter nobody wakes is still blocked after the joins
            threading.Thread(target=lambda i=i: got.__setitem__(i, handle.chunk(i)), daemon=True)
            for i in (3, 1, 2)
        ]
        for w in waiters:
            w.start()
        io.release.set()
        for w in waiters:
            w.join(WAIT)
        assert not any(w.is_alive() for w in waiters)
        assert all(got[i] is outs[i] for i in (1, 2, 3)), got
        assert handle.wait(timeout=WAIT).loaded == 4 and handle.completed() == 4
        assert handle.chunk(2, timeout=0) is outs[2]


class CountingIO(FileIO):
    """Records the most reads in flight at once, and the offsets in the order read."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.offsets: list[int] = []

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.offsets.append(offset)
        try:
            threading.Event().wait(0.005)  # long enough for a second read to overlap
            return super().preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("depth", [1, 2, None])
def test_async_load_depth_bounds_reads_in_flight_and_reads_in_chunk_order(
    tmp_path: Path, identity: ModelIdentity, depth: int | None
) -> None:
    io = CountingIO()
    tokens, kv = prompt_kv(55, 6 * N)
    with disk_only(tmp_path, fileio=io) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens)
        io.most, io.offsets = 0, []
        res = store.load_async(hit, depth=depth).wait(timeout=WAIT)
        assert res.loaded == 6
        for a, b in zip(res.arrays, chunks_of(kv, 6), strict=True):
            assert np.array_equal(a, b)
        if depth is not None:
            assert io.most <= depth
        if depth == 1:
            assert io.offsets == sorted(io.offsets), "one at a time, in chunk order"
        else:
            assert io.most >= 2, "no bound: reads overlap"
        with pytest.raises(InvalidArgument, match="depth"):
            store.load_async(hit, depth=0)


def test_close_during_a_depth_limited_async_load_gives_typed_misses(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """``close()`` while chunk 0 of a ``depth=1`` load is being read: chunk 0 is still
    handed out, the chunks never read are misses, ``wait()`` raises StoreClosedError (it
    raised a bare RuntimeError from the shut-down pool, and counted a read error), and a
    load started after the close is refused the same way."""
    io = StallingIO()
    tokens, kv = prompt_kv(52, 4 * N)
    store = disk_only(tmp_path, fileio=io)
    store.put_prompt(identity, PUBLIC, tokens, kv)
    hit = store.lookup(identity, PUBLIC, tokens)
    io.armed = True  # every read stalls until released
    handle = store.load_async(hit, depth=1)
    assert io.stalled.wait(WAIT)
    closer = threading.Thread(target=store.close)
    closer.start()
    # let close() reach the I/O pool's shutdown (an order, never a speed claim): it then
    # waits for the read in flight, whose next chunk can no longer be submitted
    closer.join(1.0)
    io.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    first = handle.chunk(0, timeout=WAIT)
    assert first is not None and np.array_equal(first, chunks_of(kv, 1)[0])
    assert [handle.chunk(i, timeout=WAIT) for i in (1, 2, 3)] == [None, None, None]
    with pytest.raises(StoreClosedError, match="closed"):
        handle.wait(timeout=WAIT)
    assert store.counters.read_errors == 0, "a chunk never read is no read error"
    with pytest.raises(StoreClosedError):
        store.load_async(hit, depth=1)


@pytest.mark.parametrize("outs", [False, True])
def test_async_and_sync_loads_agree(tmp_path: Path, identity: ModelIdentity, outs: bool) -> None:
    tokens, kv = prompt_kv(60, 5 * N)
    with KVStore.open(tmp_path, dram_bytes=2 * CHUNK, disk_bytes=1 << 24) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens)
        bufs = [np.empty_like(c) for c in chunks_of(kv, 5)] if outs else None
        a = store.load_async(hit, bufs).wait(timeout=WAIT)
        store.drain()
        b = store.load(store.lookup(identity, PUBLIC, tokens))
        assert a.loaded == b.loaded == 5
        for x, y, z in zip(a.arrays, b.arrays, chunks_of(kv, 5), strict=True):
            assert np.array_equal(x, z) and np.array_equal(y, z)


def test_put_async_returns_the_put_result(tmp_path: Path, identity: ModelIdentity) -> None:
    tokens, kv = prompt_kv(70, 3 * N)
    with KVStore.open(tmp_path, dram_bytes=16 * CHUNK, disk_bytes=1 << 24) as store:
        pending = store.prepare_put(identity, PUBLIC, tokens, kv)
        res = store.put_async(pending).result(timeout=WAIT)
        assert res.stored == 3
        assert store.lookup(identity, PUBLIC, tokens).tokens == 3 * N


# ---------------------------------------------------------------------- decided rules


def test_write_back_put_larger_than_every_tier_drops_what_fits_nowhere(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Write-back: a cache does not fail a request because it is full. Chunks that fit in
    no tier are not stored, counted and explained (abort events); the rest is served."""
    sink = MemorySink()
    tokens, kv = prompt_kv(80, 8 * N)
    frame = 4096 + ((CHUNK + 4095) // 4096) * 4096
    store = KVStore.open(
        tmp_path, dram_bytes=2 * CHUNK, disk_bytes=3 * frame, segment_bytes=1 << 20, sink=sink
    )
    try:
        res = store.put_prompt(identity, PUBLIC, tokens, kv)
        assert res.stored + res.dropped == 8 and res.dropped >= 3
        assert store.counters.chunks_dropped == res.dropped
        aborted = [e for e in sink.take() if e.kind == "abort"]
        assert len(aborted) == res.dropped and all("no room" in e.reason for e in aborted)
        assert store.get(identity, PUBLIC, tokens).loaded == 8 - res.dropped
    finally:
        store.close(flush=False)


def test_write_through_put_larger_than_the_disk_is_storage_full_and_stores_nothing(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    from kvlife.core.errors import StorageFullError

    tokens, kv = prompt_kv(81, 8 * N)
    frame = 4096 + ((CHUNK + 4095) // 4096) * 4096
    with KVStore.open(
        tmp_path, dram_bytes=16 * CHUNK, disk_bytes=3 * frame, segment_bytes=1 << 20,
        write_through=True,
    ) as store:  # fmt: skip
        with pytest.raises(StorageFullError):
            store.put_prompt(identity, PUBLIC, tokens, kv)
        assert store.lookup(identity, PUBLIC, tokens).tokens == 0
        assert store.indexed_keys() == []


def test_unknown_open_setting_is_named(tmp_path: Path) -> None:
    from kvlife.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="write_trough"):
        KVStore.open(tmp_path, write_trough=True)
    with pytest.raises(InvalidArgument, match="dram_bytes"):
        KVStore.open(tmp_path, dram_bytes="1G")  # type: ignore[arg-type]
    assert not (tmp_path / "disk").exists(), "a refused open left files behind"


def test_garbage_in_the_active_segment_never_refuses_a_batch_that_fits(tmp_path: Path) -> None:
    """A disk tier whose free space is garbage in its active segment still takes a batch
    that fits its live budget (it seals and compacts that segment)."""
    from kvlife.core.identity import ChunkKey
    from kvlife.tiers.base import ReplicaMeta, Reservation
    from kvlife.tiers.disk import DiskTier, DiskTierConfig
    from kvlife.tiers.disk.frame import frame_len

    arr = np.arange(CHUNK // 2, dtype=np.float16).reshape(TINY.chunk_shape)
    metas = [ReplicaMeta(ChunkKey(bytes([i]) * 32), "float16", TINY.chunk_shape) for i in range(5)]
    cap = 3 * frame_len(CHUNK)
    disk = DiskTier(tmp_path, DiskTierConfig(capacity_bytes=cap, segment_bytes=1 << 20))
    try:
        res = disk.prepare_store(metas[:3])
        assert isinstance(res, Reservation)
        disk.commit_store(res, [arr] * 3)
        disk.delete_batch([metas[0].key, metas[1].key])
        res = disk.prepare_store(metas[3:5])
        assert isinstance(res, Reservation), res
        disk.commit_store(res, [arr + 1] * 2)
        assert disk.used_bytes <= cap
        for m, want in ((metas[2], arr), (metas[3], arr + 1), (metas[4], arr + 1)):
            assert np.array_equal(disk.read(m.key), want)
    finally:
        disk.close()


def test_evict_takes_nbytes_worth_however_much_is_free(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """``evict(tier, nbytes)`` evicts ``nbytes``' worth of replicas (coldest first), not
    "until ``nbytes`` are free": a DRAM tier with room for 16 chunks and 3 in it gives up
    exactly one chunk for ``evict("dram", CHUNK)``, demoted to disk."""
    tokens, kv = prompt_kv(80, 3 * N)
    with KVStore.open(tmp_path, dram_bytes=16 * CHUNK, disk_bytes=1 << 24) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        store.lookup(identity, PUBLIC, tokens[: 2 * N])  # the last chunk is the coldest
        assert store.evict("dram", CHUNK) == CHUNK
        assert store.counters.tier("dram").evictions == 1
        assert store.tier("disk").replica_keys() == [keys[2]]
        assert store.load(store.lookup(identity, PUBLIC, tokens)).tiers == {"dram": 2, "disk": 1}


@pytest.mark.parametrize("outs", [False, True])
def test_a_chunk_being_demoted_is_served_from_its_source_until_its_copy_lands(
    tmp_path: Path, identity: ModelIdentity, outs: bool
) -> None:
    """Copy, then drop: while a put's demotion of a DRAM chunk waits inside its disk
    write, the chunk is still found and loaded from DRAM (it was a miss, counted nowhere:
    its DRAM replica left service when the eviction was planned, before its copy
    existed); once the demotion ran it is served from disk, and nothing was lost."""
    io = FaultyIO()
    sink = MemorySink()
    old_t, old_kv = prompt_kv(90, 2 * N)
    new_t, new_kv = prompt_kv(91, N)
    with KVStore.open(
        tmp_path,
        dram_bytes=2 * CHUNK,
        disk_bytes=1 << 24,
        segment_bytes=1 << 20,
        fileio=io,
        sink=sink,
    ) as store:
        keys = store.put_prompt(identity, PUBLIC, old_t, old_kv).keys  # DRAM full
        stall = io.stall("pwritev", path="seg-*.kvs")
        try:
            pending = store.prepare_put(identity, PUBLIC, new_t, new_kv)
            put = store.put_async(pending)  # demotes the coldest old chunk, waits in its write
            assert stall.wait_entered(WAIT)
            assert [e.kind for e in sink.take() if e.key == keys[0].hex()][-1] == "evict"
            for _ in range(2):
                hit = store.lookup(identity, PUBLIC, old_t)
                assert [h.key for h in hit.hits] == keys, "a chunk being demoted was a miss"
                bufs = [np.empty_like(c) for c in chunks_of(old_kv, 2)] if outs else None
                res = store.load(hit, bufs)
                assert res.loaded == 2 and res.tiers == {"dram": 2}
                for a, b in zip(res.arrays, chunks_of(old_kv, 2), strict=True):
                    assert np.array_equal(a, b)
        finally:
            stall.release()
        assert put.result(timeout=WAIT).stored == 1
        store.drain()
        assert store.counters.demotions == 1 and store.counters.vanished == 0
        res = store.load(store.lookup(identity, PUBLIC, old_t))
        assert res.loaded == 2 and sum(res.tiers.values()) == 2 and "disk" in res.tiers
