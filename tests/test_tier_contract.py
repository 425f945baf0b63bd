"""One contract suite run against every Tier implementation."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import blake3
import numpy as np
import pytest

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, ReplicaNotFound
from kvlife.core.identity import ChunkKey
from kvlife.store import TierSpec
from kvlife.tiers.base import (
    AuditReport,
    CapacityShortfall,
    ReplicaMeta,
    ReportsLostReplicas,
    Reservation,
    SupportsBatchDelete,
    Tier,
)
from kvlife.tiers.buffers import aligned_empty, aligned_runs
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.kinds import ShmOptions
from kvlife.tiers.memory import MemoryTier
from kvlife.tiers.redis.published import PublishedTier
from kvlife.tiers.registry import TierContext, build_tier
from tests.conftest import budget

CAP = 1 << 20
MOONCAKE = ["mooncake"] if os.environ.get("KVLIFE_MOONCAKE_NETNS") else []
"""Only inside the private network namespace the Mooncake runner starts."""


def key(i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(b"k%d" % i).digest())


def payload(i: int, n: int = 5000, dtype: str = "float16") -> np.ndarray:
    return np.random.default_rng(i).standard_normal(n).astype(dtype)


def meta(i: int, arr: np.ndarray) -> ReplicaMeta:
    return ReplicaMeta(key(i), arr.dtype.name, arr.shape, "exact", b"info%d" % i)


SPECS = {
    "memory": TierSpec("memory", "dram", CAP),
    # a second memory tier standing in for a remote one, as a store chain would build it
    "remote": TierSpec("memory", "remote", CAP),
    "disk": TierSpec("disk", "disk", CAP, options=(("segment_bytes", 256 << 10),)),
    # the shared-memory DRAM tier of `kvlife serve` (its arena file is set per test)
    "shm": TierSpec("shm", "dram", CAP, options=(("staging_bytes", CAP),)),
    "disk-buffered": TierSpec(
        "disk", "disk", CAP, options=(("segment_bytes", 256 << 10), ("direct_io", False))
    ),
}


REMOTE = ["redis", "redis-cluster"]
"""Remote kinds, against real servers (session fixtures in tests/remote/servers.py); the
Mooncake tier runs this suite inside a private network namespace
(tests/remote/test_mooncake.py)."""


def _remote_spec(request: pytest.FixtureRequest, param: str) -> TierSpec:
    ns = ("index_namespace", "c" + uuid.uuid4().hex[:12])
    if param == "redis":
        url = request.getfixturevalue("redis_server").url
        return TierSpec("redis", "redis", CAP, options=(("url", url), ns))
    if param == "redis-cluster":
        seeds = request.getfixturevalue("redis_cluster").seeds
        return TierSpec("redis", "redis", CAP, options=(("cluster", seeds), ns))
    from tests.remote.mooncake_env import mooncake_spec

    return mooncake_spec(request, CAP, ns[1])


@pytest.fixture(params=list(SPECS) + REMOTE + MOONCAKE)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    """Every tier kind, built by the registry from a TierSpec, as a store builds it."""
    spec = SPECS.get(request.param) or _remote_spec(request, request.param)
    if isinstance(spec.config, ShmOptions):  # its arena file is set per test
        spec = replace(spec, options=replace(spec.config, arena_path=str(tmp_path / "arena")))
    t = build_tier(spec, TierContext(tmp_path))
    assert t.name == spec.name
    yield t
    t.close()


def test_store_then_read_returns_equal_bytes(tier: Tier) -> None:
    arrs = [payload(i) for i in range(5)]
    assert tier.store([meta(i, a) for i, a in enumerate(arrs)], arrs)
    for i, a in enumerate(arrs):
        assert tier.contains(key(i))
        assert np.array_equal(tier.read(key(i)), a)
        m = tier.meta(key(i))
        assert (m.dtype, m.shape, m.info) == ("float16", a.shape, b"info%d" % i)
    outs: list[np.ndarray | None] = [np.empty_like(a) for a in arrs]
    got = tier.read_batch([key(i) for i in range(5)], outs)
    for g, o, a in zip(got, outs, arrs, strict=True):
        assert g is o and np.array_equal(g, a)
    assert sorted(tier.replica_keys()) == sorted(key(i) for i in range(5))


def test_caller_may_reuse_its_buffer_after_store(tier: Tier) -> None:
    a = payload(1)
    expect = a.copy()
    tier.store([meta(1, a)], [a])
    a[:] = 0
    assert np.array_equal(tier.read(key(1)), expect)


def test_aligned_output_buffers_are_filled_in_place(tier: Tier) -> None:
    a = payload(3, n=8192)
    tier.store([meta(3, a)], [a])
    out = aligned_empty(a.nbytes).view(np.float16)
    (got,) = tier.read_batch([key(3)], [out])
    assert got is out and np.array_equal(out, a)


def test_wrong_output_buffer_is_rejected(tier: Tier) -> None:
    a = payload(2)
    tier.store([meta(2, a)], [a])
    with pytest.raises(InvalidArgument, match="does not fit"):
        tier.read_batch([key(2)], [np.empty(3, np.float16)])


def test_capacity_shortfall_is_a_result_and_changes_nothing(tier: Tier) -> None:
    big = payload(9, n=CAP // 2 + 1)  # float16: just over CAP bytes
    res = tier.prepare_store([meta(9, big)])
    assert isinstance(res, CapacityShortfall) and res.need_bytes > 0
    assert tier.used_bytes == 0
    assert not tier.store([meta(9, big)], [big])
    assert not tier.contains(key(9))


def test_reservation_counts_until_commit_or_cancel(tier: Tier) -> None:
    a = payload(4)
    res = tier.prepare_store([meta(4, a)])
    assert isinstance(res, Reservation)
    assert tier.used_bytes >= a.nbytes
    assert not tier.contains(key(4))
    tier.cancel_store(res)
    assert tier.used_bytes == 0
    with pytest.raises(InvalidArgument):
        tier.commit_store(res, [a])
    assert not tier.contains(key(4))


def test_mismatched_payload_publishes_nothing(tier: Tier) -> None:
    a = payload(5)
    res = tier.prepare_store([meta(5, a)])
    assert isinstance(res, Reservation)
    with pytest.raises(InvalidArgument, match="meta says"):
        tier.commit_store(res, [a.astype(np.float32)])
    assert not tier.contains(key(5))
    assert tier.used_bytes == 0 or isinstance(tier, DiskTier)


def test_delete_frees_and_forgets(tier: Tier) -> None:
    arrs = [payload(i) for i in range(3)]
    tier.store([meta(i, a) for i, a in enumerate(arrs)], arrs)
    used = tier.used_bytes
    assert tier.delete(key(1)) == arrs[1].nbytes
    assert not tier.contains(key(1))
    with pytest.raises(ReplicaNotFound):
        tier.read(key(1))
    with pytest.raises(ReplicaNotFound):
        tier.delete(key(1))
    assert tier.used_bytes <= used
    assert np.array_equal(tier.read(key(2)), arrs[2])


def test_space_of_deleted_replicas_is_reused(tier: Tier) -> None:
    """Write and delete many times the capacity: reclaim must keep up."""
    for i in range(40):
        a = payload(i, n=20_000)  # 40 kB each, 40 rounds = 1.6x capacity
        assert tier.store([meta(i, a)], [a]), f"round {i} did not fit"
        if i >= 2:
            tier.delete(key(i - 2))
    for i in (38, 39):
        assert np.array_equal(tier.read(key(i)), payload(i, n=20_000))


def test_disk_tier_survives_reopen_and_check_is_clean(tmp_path: Path) -> None:
    cfg = DiskTierConfig(CAP, segment_bytes=64 << 10)
    t = DiskTier(tmp_path, cfg)
    arrs = [payload(i) for i in range(12)]
    t.store([meta(i, a) for i, a in enumerate(arrs)], arrs)
    for i in range(0, 12, 3):
        t.delete(key(i))
    t.close()
    t = DiskTier(tmp_path, cfg)
    try:
        assert sorted(t.replica_keys()) == sorted(key(i) for i in range(12) if i % 3)
        for i in range(12):
            if i % 3:
                assert np.array_equal(t.read(key(i)), arrs[i])
        report = t.check()
        assert report.clean and report.rows == 8 and report.ok == 8
    finally:
        t.close()


def test_disk_payload_corruption_is_caught(tmp_path: Path) -> None:
    t = DiskTier(tmp_path, DiskTierConfig(CAP))
    a = payload(1)
    t.store([meta(1, a)], [a])
    seg = next((tmp_path / "segments").glob("seg-*.kvs"))
    with seg.open("r+b") as fh:
        fh.seek(4096 + 100)
        b = fh.read(1)
        fh.seek(4096 + 100)
        fh.write(bytes([b[0] ^ 0xFF]))
    (got,) = t.read_batch([key(1)])
    assert isinstance(got, ChecksumMismatch)
    assert "checksum" in str(got)
    with pytest.raises(ChecksumMismatch):
        t.read(key(1))
    report = t.check()
    assert not report.clean and report.bad_keys == [key(1)]
    t.check(fix=True)
    assert not t.contains(key(1)) and t.check().clean
    t.close()


def test_compaction_reclaims_and_counts(tmp_path: Path) -> None:
    cfg = DiskTierConfig(600_000, segment_bytes=64 << 10)
    t = DiskTier(tmp_path, cfg)
    # 12 kB payloads -> 16 kB frames, 4 per segment
    arrs = {i: payload(i, n=6000) for i in range(60)}
    live: list[int] = []
    for i, a in arrs.items():
        assert t.store([meta(i, a)], [a]), f"store {i}"
        if i % 2 == 1:  # leave every segment half full of garbage
            t.delete(key(i))
        else:
            live.append(i)
    assert t.stats.compaction_bytes_written > 0
    assert t.stats.compaction_bytes_read >= t.stats.compaction_bytes_written
    for i in live:
        assert np.array_equal(t.read(key(i)), arrs[i])
    assert t.used_bytes <= cfg.capacity_bytes
    t.close()


def test_memory_tier_never_recycles_a_buffer_someone_still_reads() -> None:
    t = MemoryTier(CAP)
    a, b = payload(1), payload(2)
    t.store([meta(1, a)], [a])
    view = t.read(key(1))  # zero-copy, read-only
    assert not view.flags.writeable
    t.delete(key(1))
    t.store([meta(2, b)], [b])  # same size: would reuse the freed buffer if it could
    assert np.array_equal(view, a), "a live view changed under its reader"
    del view
    t.delete(key(2))
    t.store([meta(3, a)], [a])  # the buffer of key 2 is free now and may be reused
    assert np.array_equal(t.read(key(3)), a)
    assert t.used_bytes == a.nbytes


def test_strided_output_buffers_are_filled(tier: Tier) -> None:
    """A chunk slice of a per-layer buffer (strided) is filled exactly; on disk it is read
    straight into it when its pieces are aligned."""
    big = aligned_empty(2 * 3 * 1024 * 16 * 4).view(np.float32).reshape(2, 3, 1024, 16)
    chunks = [
        np.random.default_rng(i).standard_normal((2, 3, 256, 16)).astype(np.float32)
        for i in range(4)
    ]
    tier.store([meta(i, c) for i, c in enumerate(chunks)], chunks)
    views = [big[:, :, i * 256 : (i + 1) * 256] for i in range(4)]
    assert aligned_runs(views[1]) is not None  # 6 pieces of 16 KiB: the direct path
    outs: list[np.ndarray | None] = list(views)
    got = tier.read_batch([key(i) for i in range(4)], outs)
    for i, c in enumerate(chunks):
        assert got[i] is outs[i]
        assert np.array_equal(big[:, :, i * 256 : (i + 1) * 256], c)
    odd = np.empty((2, 3, 300, 16), np.float32)[:, :, :256]  # unaligned: staged, same bytes
    (res,) = tier.read_batch([key(2)], [odd])
    assert isinstance(res, np.ndarray) and np.array_equal(res, chunks[2])


# ---------------------------------------------------------------------- concurrency


def _concurrent_payload(i: int) -> np.ndarray:
    return payload(i, n=20_000)  # 40 kB: about 5 frames per 256 KiB segment


def test_many_readers_beside_one_writer_get_exact_bytes_or_a_typed_miss(tier: Tier) -> None:
    """Readers race a writer that stores, overwrites, deletes and (on disk) compacts:
    every read is the exact bytes of its key or ReplicaNotFound, never anything else."""
    window = 8
    rounds = budget(60, 120)  # disk: still a dozen segments emptied and reclaimed
    for i in range(window):
        a = _concurrent_payload(i)
        assert tier.store([meta(i, a)], [a])
    newest = [window - 1]
    stop = threading.Event()
    failures: list[str] = []
    counts = {"hits": 0, "misses": 0}
    count_lock = threading.Lock()

    def writer() -> None:
        try:
            for i in range(window, window + rounds):
                a = _concurrent_payload(i)
                assert tier.store([meta(i, a)], [a]), f"store {i} did not fit"
                newest[0] = i
                if i % 3 == 0:  # overwrite a live key with the same bytes
                    b = _concurrent_payload(i - 1)
                    assert tier.store([meta(i - 1, b)], [b])
                old = [key(j) for j in range(i - window, i - window + 1)]
                if isinstance(tier, SupportsBatchDelete):
                    tier.delete_batch(old)
                else:
                    for k in old:
                        tier.delete(k)
        except BaseException as exc:  # reported by the main thread
            failures.append(f"writer: {exc!r}")
        finally:
            stop.set()

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        hits = misses = 0
        while not stop.is_set() or hits + misses < 20:
            top = newest[0]
            picks = [int(x) for x in rng.integers(max(0, top - window - 2), top + 1, size=2)]
            outs: list[np.ndarray | None] | None = None
            if seed % 2:
                outs = [np.empty(20_000, np.float16), None]
            try:
                got = tier.read_batch([key(j) for j in picks], outs)
            except ReplicaNotFound:
                misses += 1
                continue
            for j, g in zip(picks, got, strict=True):
                if not isinstance(g, np.ndarray) or not np.array_equal(g, _concurrent_payload(j)):
                    failures.append(f"reader {seed}: key {j} gave {type(g).__name__} {g}")
                    return
            hits += 1
        with count_lock:
            counts["hits"] += hits
            counts["misses"] += misses

    threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in range(4)]
    threads.append(threading.Thread(target=writer, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread is stuck: reads and the writer deadlocked"
    assert not failures, failures
    assert counts["hits"] > 0
    if isinstance(tier, ReportsLostReplicas):
        assert tier.take_lost() == []
    if isinstance(tier, DiskTier):
        assert tier.stats.compaction_bytes_written > 0 or tier.stats.segments_reclaimed > 0
        assert tier.check().clean  # no segment left behind by a deferred unlink
    if isinstance(tier, PublishedTier):  # a race is never mistaken for corruption
        d = tier.details()
        assert d["corrupt"] == 0 and d["short_payloads"] == 0, d


class StallingIO(FileIO):
    """Fault seam: the next ``preadv`` after :meth:`arm` blocks until released."""

    def __init__(self, direct: bool) -> None:
        super().__init__(direct)
        self._armed = False
        self._guard = threading.Lock()
        self.entered = threading.Event()
        self.release = threading.Event()

    def arm(self) -> None:
        with self._guard:
            self._armed = True

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        with self._guard:
            stall, self._armed = self._armed, False
        if stall:
            self.entered.set()
            self.release.wait(timeout=60)
        return super().preadv(fd, buffers, offset)


def _in_thread(fn: Callable[[], object], timeout: float = 30.0) -> object:
    """Run ``fn`` in another thread; fail if it does not return within ``timeout``
    (a deadline against a hang, not a timing: the operation must not wait at all)."""
    box: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} blocked behind a stalled read"
    if errors:
        raise errors[0]
    return box[0]


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-supported", "buffered"])
def test_a_stalled_read_blocks_no_writer_and_no_other_reader(
    tmp_path: Path, direct: bool | None
) -> None:
    io = StallingIO(False)
    t = DiskTier(tmp_path, DiskTierConfig(CAP, segment_bytes=64 << 10, direct_io=direct), fileio=io)
    try:
        arrs = {i: payload(i, n=12_000) for i in range(6)}  # 24 kB: 2 frames per segment
        t.store([meta(i, a) for i, a in arrs.items()], list(arrs.values()))
        seg_files = set((tmp_path / "segments").glob("seg-*.kvs"))
        io.arm()
        stalled: list[object] = []
        reader = threading.Thread(
            target=lambda: stalled.extend(t.read_batch([key(0)])), daemon=True
        )
        reader.start()
        assert io.entered.wait(timeout=30), "the reader never reached preadv"

        got = _in_thread(lambda: t.read_batch([key(2), key(3), key(4)]))
        assert isinstance(got, list)
        for j, g in zip((2, 3, 4), got, strict=True):
            assert np.array_equal(g, arrs[j])
        fresh = payload(7, n=12_000)
        res = _in_thread(lambda: t.prepare_store([meta(7, fresh)]))
        assert isinstance(res, Reservation)
        _in_thread(lambda: t.commit_store(res, [fresh]))
        # the replica under the stalled read and its segment neighbour go: the segment
        # has no live frame left but must outlive the read in flight on it
        _in_thread(lambda: t.delete_batch([key(0), key(1)]))
        assert not t.contains(key(0))
        assert seg_files <= set((tmp_path / "segments").glob("seg-*.kvs"))

        io.release.set()
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert len(stalled) == 1 and np.array_equal(stalled[0], arrs[0])  # type: ignore[arg-type]
        assert t.segment_count < len(seg_files) + 1  # the emptied segment is gone now
        assert np.array_equal(t.read(key(7)), fresh)
        assert t.check().clean
    finally:
        io.release.set()
        t.close()


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-supported", "buffered"])
def test_compaction_beside_a_stalled_read(tmp_path: Path, direct: bool | None) -> None:
    """prepare_store compacts while a read is stalled on a garbage-laden segment: it does
    not wait for the read, leaves that segment alone and the read still gets its bytes."""
    frame = 28_672  # 24 kB payload + header, 2 frames per 64 KiB segment
    io = StallingIO(False)
    cfg = DiskTierConfig(6 * frame + frame - 1, segment_bytes=64 << 10, direct_io=direct)
    t = DiskTier(tmp_path, cfg, fileio=io)
    try:
        arrs = {i: payload(i, n=12_000) for i in range(6)}
        for i, a in arrs.items():
            assert t.store([meta(i, a)], [a])
        t.delete_batch([key(1), key(3)])  # segments 1 and 2 are half garbage
        io.arm()
        stalled: list[object] = []
        reader = threading.Thread(
            target=lambda: stalled.extend(t.read_batch([key(0)])), daemon=True
        )
        reader.start()
        assert io.entered.wait(timeout=30)
        fresh = payload(7, n=12_000)
        res = _in_thread(lambda: t.prepare_store([meta(7, fresh)]))
        assert isinstance(res, Reservation), res  # segment 2 was compacted, not segment 1
        _in_thread(lambda: t.commit_store(res, [fresh]))
        assert t.stats.compaction_bytes_written == frame
        io.release.set()
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert np.array_equal(stalled[0], arrs[0])  # type: ignore[arg-type]
        for i in (0, 2, 4, 5):
            assert np.array_equal(t.read(key(i)), arrs[i])
        assert t.check().clean
    finally:
        io.release.set()
        t.close()


class StallingCreateIO(FileIO):
    """Fault seam: the next creation of a file after :meth:`arm` blocks until released."""

    def __init__(self, direct: bool) -> None:
        super().__init__(direct)
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def open(self, path: Path, create: bool) -> int:
        if create and self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(timeout=60)
        return super().open(path, create)


def test_a_stalled_segment_creation_blocks_no_reader(tmp_path: Path) -> None:
    """A writer whose batch needs a new segment creates its file outside the tier lock:
    readers, lookups and the tier's figures do not wait for that file system call."""
    io = StallingCreateIO(False)
    t = DiskTier(tmp_path, DiskTierConfig(CAP, segment_bytes=64 << 10), fileio=io)
    try:
        arrs = {i: payload(i, n=12_000) for i in range(2)}  # 2 frames fill a segment
        t.store([meta(i, a) for i, a in arrs.items()], list(arrs.values()))
        io.armed = True
        fresh = payload(7, n=12_000)
        writer = threading.Thread(target=lambda: t.store([meta(7, fresh)], [fresh]), daemon=True)
        writer.start()
        assert io.entered.wait(timeout=30), "the writer never created a segment"
        got = _in_thread(lambda: t.read_batch([key(0), key(1)]))
        assert isinstance(got, list)
        assert all(np.array_equal(g, arrs[i]) for i, g in enumerate(got))
        assert _in_thread(lambda: t.contains(key(1))) is True
        assert isinstance(_in_thread(lambda: t.used_bytes), int)
        io.release.set()
        writer.join(timeout=30)
        assert not writer.is_alive()
        assert np.array_equal(t.read(key(7)), fresh)
        assert t.check().clean
    finally:
        io.release.set()
        t.close()


def test_new_array_memory_is_reused_only_after_its_last_view_dies(tier: Tier) -> None:
    """Reads into new arrays may recycle the memory of earlier results, but never while
    any view of it is alive (a slice kept by the engine must not change under it)."""
    a, b = payload(1, n=8192), payload(2, n=8192)
    tier.store([meta(1, a), meta(2, b)], [a, b])
    (x,) = tier.read_batch([key(1)])
    assert isinstance(x, np.ndarray)
    kept = x.reshape(4, -1)[1:3]
    del x
    later = [tier.read(key(2)) for _ in range(4)]
    assert np.array_equal(kept, a.reshape(4, -1)[1:3])
    del later
    again = [tier.read(key(2)) for _ in range(4)]  # may reuse freed memory
    assert all(np.array_equal(g, b) for g in again)
    assert np.array_equal(kept, a.reshape(4, -1)[1:3])


class BarrierIO(FileIO):
    """Fault seam: once armed, every ``preadv`` waits until ``parties`` are inside at
    once (a broken barrier, after a deadline, proves they never were)."""

    def __init__(self, direct: bool, parties: int) -> None:
        super().__init__(direct)
        self.armed = False
        self.barrier = threading.Barrier(parties, timeout=30)

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        if self.armed:
            self.barrier.wait()
        return super().preadv(fd, buffers, offset)


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-supported", "buffered"])
def test_n_reader_threads_have_n_reads_in_flight(tmp_path: Path, direct: bool | None) -> None:
    n = 6  # more than the tier's io_depth: each caller issues its own read
    io = BarrierIO(False, n)
    t = DiskTier(tmp_path, DiskTierConfig(CAP, direct_io=direct, io_depth=4), fileio=io)
    try:
        arrs = [payload(i) for i in range(n)]
        t.store([meta(i, a) for i, a in enumerate(arrs)], arrs)
        io.armed = True
        got: dict[int, object] = {}
        threads = [
            threading.Thread(target=lambda i=i: got.update({i: t.read(key(i))}), daemon=True)
            for i in range(n)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not io.barrier.broken, "the readers never had their reads in flight together"
        for i in range(n):
            assert np.array_equal(got[i], arrs[i])  # type: ignore[arg-type]
    finally:
        io.barrier.abort()
        t.close()


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-supported", "buffered"])
def test_one_caller_keeps_io_depth_reads_in_flight(tmp_path: Path, direct: bool | None) -> None:
    io = BarrierIO(False, 4)
    t = DiskTier(tmp_path, DiskTierConfig(CAP, direct_io=direct, io_depth=4), fileio=io)
    try:
        arrs = [payload(i) for i in range(8)]
        t.store([meta(i, a) for i, a in enumerate(arrs)], arrs)
        io.armed = True
        got = _in_thread(lambda: t.read_batch([key(i) for i in range(8)]), timeout=60)
        assert isinstance(got, list)
        assert all(np.array_equal(g, a) for g, a in zip(got, arrs, strict=True))
    finally:
        io.barrier.abort()
        t.close()


def test_check_fix_beside_a_writer_finishes(tmp_path: Path) -> None:
    """An audit that drops a corrupt replica takes the writers' mutex before the tier
    lock, like every writer, so it cannot deadlock with a concurrent store."""
    t = DiskTier(tmp_path, DiskTierConfig(CAP, segment_bytes=64 << 10))
    try:
        a = payload(1)
        t.store([meta(1, a)], [a])
        seg = sorted((tmp_path / "segments").glob("seg-*.kvs"))[0]
        with seg.open("r+b") as fh:
            fh.seek(4096 + 10)
            fh.write(b"\xff\xfe")
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            i = 100
            try:
                while not stop.is_set():
                    b = payload(i)
                    t.store([meta(i, b)], [b])
                    t.delete(key(i))
                    i += 1
            except BaseException as exc:
                errors.append(exc)

        w = threading.Thread(target=writer, daemon=True)
        w.start()
        try:
            report = _in_thread(lambda: t.check(fix=True), timeout=60)
        finally:
            stop.set()
            w.join(timeout=60)
        assert not w.is_alive() and not errors, errors
        assert isinstance(report, AuditReport) and report.bad_keys == [key(1)]
        assert not t.contains(key(1))
    finally:
        t.close()
