"""One contract suite run against every Tier implementation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, ReplicaNotFound
from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import CapacityShortfall, ReplicaMeta, Reservation, Tier
from kvlife.tiers.buffers import aligned_empty, aligned_runs
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.memory import MemoryTier

CAP = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(b"k%d" % i).digest())


def payload(i: int, n: int = 5000, dtype: str = "float16") -> np.ndarray:
    return np.random.default_rng(i).standard_normal(n).astype(dtype)


def meta(i: int, arr: np.ndarray) -> ReplicaMeta:
    return ReplicaMeta(key(i), arr.dtype.name, arr.shape, "exact", b"info%d" % i)


@pytest.fixture(params=["memory", "disk", "disk-buffered"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    t: Tier
    if request.param == "memory":
        t = MemoryTier(CAP)
    else:
        direct = None if request.param == "disk" else False
        t = DiskTier(tmp_path, DiskTierConfig(CAP, segment_bytes=256 << 10, direct_io=direct))
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
