"""The tiers' bulk copies by the extension (issue 28). The disk tier: a payload in
memory O_DIRECT cannot take is copied into an aligned staging buffer by the streaming
copy, hashed as it is copied (``copy_sealed``) unless its checksum is given; a frame
read for a buffer O_DIRECT cannot fill lands in a staging buffer and is streamed out only
once it verified. The shared-memory DRAM tier: a replica that is not already one of its
sealed extents is copied into one the same way. What is checked: the bytes and
checksums that land, that the streaming copies did the copying, and that a copy whose
bytes differ from what was hashed is never read back as data."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import xxhash

from kvlife.core.errors import ChecksumMismatch
from kvlife.core.identity import ChunkKey
from kvlife.faults.fileio import FaultyIO
from kvlife.native import frames as native
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES
from kvlife.tiers.shm import ShmTier
from tests.helpers.stream_spy import count_native

MiB = 1 << 20
SIZE = 2 * MiB + 12_288  # whole pages, larger than a copy's block; not a multiple of 2 MiB


@pytest.fixture
def module() -> ModuleType:
    mod = native.native_module()
    if mod is None:
        pytest.skip("the native extension is not built")
    return mod


def _unaligned(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` random bytes whose data pointer is 64 bytes past a page boundary."""
    raw = np.empty(nbytes + 2 * 4096, np.uint8)
    at = (-raw.ctypes.data) % 4096 + 64
    out = raw[at : at + nbytes]
    out[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return out


def _key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i]) * 32)


def _seal(a: np.ndarray) -> bytes:
    return bytes(xxhash.xxh3_128_digest(a.data))


def _reads_back(tier: DiskTier, keys: list[ChunkKey], payloads: list[np.ndarray]) -> None:
    """Each key's replica is sealed with its payload's xxh3-128 and reads back as it."""
    for k, p in zip(keys, payloads, strict=True):
        assert tier.meta(k).checksum == _seal(p)
    for got, p in zip(tier.read_batch(keys), payloads, strict=True):
        assert isinstance(got, np.ndarray) and np.array_equal(got, p)


def _tier(tmp_path: Path, io: FileIO | None = None) -> DiskTier:
    return DiskTier(tmp_path / "disk", DiskTierConfig(64 * MiB, direct_io=True), fileio=io)


@pytest.mark.parametrize("checksum", ["hashed here", "given"])
def test_an_unaligned_payload_is_copied_by_the_extension(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType, checksum: str
) -> None:
    """Each payload copied once: hashed as it is copied (nothing streamed without its
    hash), or, its checksum given, only streamed (and the checksum kept)."""
    payloads = [_unaligned(SIZE, i) for i in range(3)]
    given = checksum == "given"
    seen = count_native(monkeypatch, module)
    tier = _tier(tmp_path)
    try:
        metas = [
            ReplicaMeta(_key(i), "uint8", (SIZE,), checksum=_seal(p) if given else b"")
            for i, p in enumerate(payloads)
        ]
        assert tier.store(metas, payloads)
        copied = {
            "copy_sealed": [] if given else [SIZE] * 3,
            "stream_copy": [SIZE] * 3 if given else [],
        }
        assert seen == copied
        _reads_back(tier, [m.key for m in metas], payloads)
    finally:
        tier.close()


def test_a_seal_to_verify_that_the_bytes_do_not_match_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType
) -> None:
    p = _unaligned(SIZE, 8)
    wrong = _seal(p[::-1].copy())
    seen = count_native(monkeypatch, module)
    tier = _tier(tmp_path)
    try:
        meta = ReplicaMeta(_key(2), "uint8", (SIZE,), checksum=wrong, verify_checksum=True)
        with pytest.raises(ChecksumMismatch, match="changed in memory"):
            tier.store([meta], [p])
        assert seen["copy_sealed"] == [SIZE]  # hashed as it was copied, then compared
        assert not tier.contains(_key(2)) and tier.used_bytes == 0
        # the same payload with its own seal goes in
        ok = ReplicaMeta(_key(2), "uint8", (SIZE,), checksum=_seal(p), verify_checksum=True)
        assert tier.store([ok], [p])
        _reads_back(tier, [_key(2)], [p])
    finally:
        tier.close()


def test_bytes_that_changed_after_their_hash_are_never_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType
) -> None:
    """The caller's bytes change between a block's hash and its copy (here: the staging
    copy altered after ``copy_sealed`` took the seal): the frame is written with a
    checksum its bytes do not have, and every read of it fails its check: a miss, never
    the bytes."""

    def flip(dst: np.ndarray) -> None:
        flat = dst.reshape(-1).view(np.uint8)
        flat[SIZE // 2] ^= 0xFF

    p = _unaligned(SIZE, 9)
    count_native(monkeypatch, module, after_sealed=flip)
    tier = _tier(tmp_path)
    try:
        assert tier.store([ReplicaMeta(_key(3), "uint8", (SIZE,))], [p])
        out = np.full(SIZE, 0x5A, np.uint8)
        (got,) = tier.read_batch([_key(3)], [out])
        assert isinstance(got, ChecksumMismatch)
        assert (out == 0x5A).all()  # nothing of the frame reached the caller's buffer
        (fresh,) = tier.read_batch([_key(3)])
        assert isinstance(fresh, ChecksumMismatch)
    finally:
        tier.close()


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_read_into_an_unaligned_buffer_is_streamed_out_once_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType, path: str
) -> None:
    """Both read paths: the extension's runs, and the tier's own reader (taken for a
    FileIO whose reads a test may fault)."""
    io = FaultyIO(direct=True) if path == "python" else None
    tier = _tier(tmp_path, io)
    try:
        payloads = [_unaligned(SIZE, 20 + i) for i in range(3)]
        metas = [ReplicaMeta(_key(10 + i), "uint8", (SIZE,)) for i in range(3)]
        assert tier.store(metas, payloads)
        outs = [_unaligned(SIZE, 40 + i) for i in range(3)]
        seen = count_native(monkeypatch, module)
        got = tier.read_batch([m.key for m in metas], outs)
        for g, o, p in zip(got, outs, payloads, strict=True):
            assert g is o and np.array_equal(o, p)
        assert seen["stream_copy"] == [SIZE] * 3
        # a frame whose bytes changed on disk: its buffer is left as it was
        (row,) = tier.frame_rows([metas[1].key])
        assert row is not None
        at = row.off + HEADER_BYTES + 100  # a byte of the payload
        with open(tier.segment_file(row.seg), "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0xFF]))
            fh.flush()
            os.fsync(fh.fileno())
        before = [o.copy() for o in outs]
        for o in outs:
            o[:] = 0x33
        got = tier.read_batch([m.key for m in metas], outs)
        assert isinstance(got[1], ChecksumMismatch)
        assert (outs[1] == 0x33).all()
        assert np.array_equal(outs[0], before[0]) and np.array_equal(outs[2], before[2])
    finally:
        tier.close()


# ---------------------------------------------------------------- the served DRAM tier


def test_a_copy_into_the_arena_is_sealed_as_it_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType
) -> None:
    """The shared-memory DRAM tier copies a replica that is not already one of its
    sealed extents (a promotion, a put through the socket) into an extent by the
    extension: hashed as it is copied where it seals the bytes itself, streamed alone
    where the store vouches for the checksum; a seal to verify that the bytes do not
    match stores nothing and frees the extent."""
    tier = ShmTier(8 * MiB, "dram", tmp_path / "arena", MiB)
    try:
        seen = count_native(monkeypatch, module)
        a, b, c = (_unaligned(SIZE, 60 + i) for i in range(3))
        assert tier.store([ReplicaMeta(_key(1), "uint8", (SIZE,))], [a])
        assert seen == {"copy_sealed": [SIZE], "stream_copy": []}
        assert tier.meta(_key(1)).checksum == _seal(a)
        assert tier.store([ReplicaMeta(_key(2), "uint8", (SIZE,), checksum=_seal(b))], [b])
        assert seen["stream_copy"] == [SIZE] and tier.meta(_key(2)).checksum == _seal(b)
        for k, want in ((1, a), (2, b)):
            got = tier.read(_key(k))
            assert np.array_equal(got, want) and not got.flags.writeable
        del got
        gc.collect()
        used = tier.arena.used_bytes
        bad = ReplicaMeta(_key(3), "uint8", (SIZE,), checksum=_seal(a), verify_checksum=True)
        with pytest.raises(ChecksumMismatch):
            tier.store([bad], [c])
        gc.collect()
        assert not tier.contains(_key(3)) and tier.arena.used_bytes == used
    finally:
        tier.close()


def test_bytes_changed_after_their_hash_fail_the_arena_replicas_seal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: ModuleType
) -> None:
    """A replica copied into the arena whose bytes differ from what was hashed (the
    caller's bytes changed between a block's hash and its copy) fails its seal where
    seals are verified: never served as sealed."""

    def flip(dst: np.ndarray) -> None:
        dst.reshape(-1).view(np.uint8)[SIZE // 3] ^= 0x0F

    tier = ShmTier(8 * MiB, "dram", tmp_path / "arena", MiB)
    try:
        count_native(monkeypatch, module, after_sealed=flip)
        p = _unaligned(SIZE, 70)
        assert tier.store([ReplicaMeta(_key(4), "uint8", (SIZE,))], [p])
        (got,) = tier.read_verified([_key(4)])
        assert isinstance(got, ChecksumMismatch)
    finally:
        tier.close()
