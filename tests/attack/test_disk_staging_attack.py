"""Attacks on the disk tier's staging copies (commit 64fa40b): a payload O_DIRECT cannot
take is copied into an aligned staging buffer by the extension's ``copy_sealed`` (each
32 KiB block of the SOURCE hashed, then streamed into the buffer), or by
``stream_copy`` alone where the meta gives the checksum (``kvlife/tiers/disk/writer.py``
``_frame_buffers``); a read for a buffer O_DIRECT cannot fill lands in a staging
buffer, is verified there, and is streamed out only then (``reader.py`` ``_check``,
``native_reads.py`` ``_result``).

The promise under attack: a frame that verifies on read holds exactly what its
checksum says, and its checksum is the xxh3-128 of the payload the caller gave (when the
tier hashed it); a read never writes bytes that failed verification into the caller's
(unaligned) buffer; a payload changed by another thread while ``DiskTier.store`` runs
may leave a frame that fails verification (a miss), never one that verifies with other
bytes; a seal to verify that does not match raises ChecksumMismatch and stores nothing
of the batch; stale bytes of a reused staging buffer never reach a frame or its padding.
Tried: sizes of 0, 1, under and over a 32 KiB block, a 64 KiB streaming threshold and a
page, 2 MiB + 1; every misalignment of the source; dtypes other than uint8; strided,
transposed, reversed, Fortran-order and broadcast sources; both read paths (the
extension's runs, and the tier's own reader under a ``FaultyIO``); frames damaged on disk.
Real files (tmp_path), real ``DiskTier``, a real thread for the racing writer. Every
promise held.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import ChecksumMismatch
from kvlife.core.identity import ChunkKey
from kvlife.faults.fileio import FaultyIO
from kvlife.native import frames as native
from kvlife.native.copies import copy_sealed, stream_copy
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.buffers import ALIGN, aligned_empty, round_up
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED

pytestmark = pytest.mark.skipif(not native.available(), reason="the extension is not built")

MiB = 1 << 20
BLOCK = 32 << 10
"""The extension's hashing block."""
SPECIAL = (
    1,
    4095,
    4097,
    BLOCK - 1,
    BLOCK,
    BLOCK + 1,
    (64 << 10) - 1,
    64 << 10,
    (64 << 10) + 1,
    3 * BLOCK + 7,
    (256 << 10) + 1,
    (2 << 20) + 1,
)
"""Byte counts either side of every threshold of the copies: a page, a hash block, the
extension's streaming threshold (64 KiB), a 2 MiB huge page."""

_keys = iter(range(1, 1 << 40))


def _key() -> ChunkKey:
    return ChunkKey(next(_keys).to_bytes(8, "little") * 4)


def _seal(a: np.ndarray) -> bytes:
    return bytes(xxhash.xxh3_128_digest(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data))


def _placed(nbytes: int, shift: int, fill: int | None = None, seed: int = 0) -> np.ndarray:
    """``nbytes`` of uint8 whose data pointer is ``shift`` bytes past a page boundary:
    random bytes, or ``fill``."""
    raw = np.empty(nbytes + 3 * ALIGN, np.uint8)
    at = (-raw.ctypes.data) % ALIGN + shift
    out = raw[at : at + nbytes]
    if fill is None:
        out[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    else:
        out[:] = fill
    return out


def _typed(count: int, dtype: str, shift: int, seed: int) -> np.ndarray:
    """``count`` elements of ``dtype`` (every bit pattern random), ``shift`` bytes past
    a page boundary."""
    dt = np.dtype(dtype)
    raw = _placed(count * dt.itemsize, shift, seed=seed)
    if dt == np.bool_:
        raw[:] &= 1  # only 0 and 1 are bools
    return raw.view(dt)


def _tier(path: Path, python_reads: bool = False) -> DiskTier:
    io = FaultyIO(direct=True) if python_reads else None
    return DiskTier(path, DiskTierConfig(512 * MiB, direct_io=True), fileio=io)


def _frame_bytes(tier: DiskTier, key: ChunkKey) -> tuple[bytes, bytes]:
    """(the payload, its padding to a page) of ``key``'s frame, read from its file."""
    (row,) = tier.frame_rows([key])
    assert row is not None
    with open(tier.segment_file(row.seg), "rb") as fh:
        fh.seek(row.off + HEADER_BYTES)
        body = fh.read(round_up(row.nbytes))
    return body[: row.nbytes], body[row.nbytes :]


def _stored_exact(tier: DiskTier, key: ChunkKey, want: np.ndarray, seed: int) -> None:
    """``key``'s frame holds ``want`` (C order), zero padding, its checksum the
    payload's; a read into a new array, an unaligned and (where it fits) an aligned
    buffer all give ``want`` verified."""
    c = np.ascontiguousarray(want)
    body, pad = _frame_bytes(tier, key)
    assert body == c.tobytes(), "the frame holds other bytes than the payload"
    assert pad == bytes(len(pad)), "stale bytes in a frame's padding"
    assert tier.meta(key).checksum == _seal(c)
    (fresh,) = tier.read_batch([key])
    assert isinstance(fresh, np.ndarray) and not fresh.flags.writeable
    assert fresh.dtype == c.dtype and fresh.shape == c.shape
    assert fresh.tobytes() == c.tobytes()
    for shift in (1 + seed % 4000, 0):
        out = _placed(c.nbytes, shift, fill=0x77).view(c.dtype).reshape(c.shape)
        (got,) = tier.read_batch([key], [out])
        assert got is out and out.tobytes() == c.tobytes()
        out = _placed(c.nbytes, shift, fill=0x78).view(c.dtype).reshape(c.shape)
        assert _pipelined(tier, key, out) is out and out.tobytes() == c.tobytes()


def _pipelined(tier: DiskTier, key: ChunkKey, out: np.ndarray) -> object:
    """``key`` read by ``read_pipelined`` into ``out``: its outcome."""
    seen: dict[int, object] = {}
    assert tier.read_pipelined([key], [out], seen.__setitem__) == 1
    return seen[0]


@pytest.fixture(scope="module", params=["native", "python"])
def tier(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DiskTier]:
    """One tier per read path for a module's property tests (its staging buffers reused
    from one example to the next, whatever they held)."""
    t = _tier(tmp_path_factory.mktemp(f"staging-{request.param}"), request.param == "python")
    try:
        yield t
    finally:
        t.close()


# ------------------------------------------------------------------ round trips


@given(
    size=st.one_of(st.sampled_from(SPECIAL), st.integers(0, 300_000)),
    dtype=st.sampled_from(["uint8", "float16", "float32", "int64", "bool", "complex64"]),
    shift=st.one_of(st.integers(1, 4095), st.just(0)),
    mode=st.sampled_from(["hashed", "given", "verified"]),
    seed=st.integers(0, 1 << 16),
)
@settings(max_examples=30, deadline=None)
def test_odd_payloads_are_stored_and_read_exact(
    tier: DiskTier, size: int, dtype: str, shift: int, mode: str, seed: int
) -> None:
    """Any size, dtype and misalignment (an aligned pointer with a length that is no
    whole number of pages is staged too), the checksum hashed here, given, or given to
    verify: the frame holds the payload and zeros, its checksum the payload's, and
    every read gives it back."""
    itemsize = np.dtype(dtype).itemsize
    count = max(size // itemsize, 0)
    p: np.ndarray = _typed(count, dtype, shift, seed).reshape(-1)
    if count % 2 == 0 and count:
        p = p.reshape(2, -1)
    key = _key()
    seal = _seal(p) if mode != "hashed" else b""
    meta = ReplicaMeta(key, dtype, p.shape, checksum=seal, verify_checksum=mode == "verified")
    assert tier.store([meta], [p])
    _stored_exact(tier, key, p, seed)


def test_stale_staging_bytes_never_reach_a_frame_or_its_padding(tmp_path: Path) -> None:
    """A large unaligned payload of 0xAB leaves its bytes in the staging buffer (and the
    read staging buffer); smaller odd payloads after it, one per batch and several in
    one batch, each hashed or given: every frame holds its payload and zeros only, and
    reads into unaligned buffers after a read of the large frame give each exactly."""
    t = _tier(tmp_path / "d")
    try:
        big_key = _key()
        big = _placed((2 << 20) + 1, 64, fill=0xAB)
        assert t.store([ReplicaMeta(big_key, "uint8", big.shape)], [big])
        sizes = [1, 100, 4095, 4097, BLOCK + 3, (64 << 10) + 5, (1 << 20) + 9]
        single: list[tuple[ChunkKey, np.ndarray]] = []
        for i, n in enumerate(sizes):
            p = _placed(n, 1 + i, fill=0x11 + i)
            k = _key()
            given_ = _seal(p) if i % 2 else b""
            assert t.store([ReplicaMeta(k, "uint8", p.shape, checksum=given_)], [p])
            single.append((k, p))
            # the large frame read into an unaligned buffer: the read staging full of 0xAB
            out = _placed(big.nbytes, 5, fill=0)
            (got,) = t.read_batch([big_key], [out])
            assert got is out and (out == 0xAB).all()
        batch = [(_key(), _placed(n, 7 + i, fill=0x41 + i)) for i, n in enumerate(sizes)]
        assert t.store([ReplicaMeta(k, "uint8", p.shape) for k, p in batch], [p for _, p in batch])
        for k, p in single + batch:
            _stored_exact(t, k, p, 3)
        assert t.check().clean
    finally:
        t.close()


@pytest.mark.parametrize(
    "make",
    ["transposed", "every-other", "reversed", "fortran", "broadcast", "column", "unaligned-dtype"],
)
def test_non_contiguous_sources_are_stored_in_c_order(tmp_path: Path, make: str) -> None:
    """Sources that are no contiguous run (made contiguous first, then staged): the
    frame holds the C-order bytes, its checksum theirs, every read gives them back."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((96, 1030)).astype(np.float16)
    if make == "transposed":
        p = base.T
    elif make == "every-other":
        p = base[:, ::2]
    elif make == "reversed":
        p = base[::-1, ::-1]
    elif make == "fortran":
        p = np.asfortranarray(base)
    elif make == "broadcast":
        p = np.broadcast_to(base[3], (64, 1030))
    elif make == "column":
        p = base[:, 7]
    else:  # float32 one byte off its alignment: contiguous, not aligned for its dtype
        raw = _placed(4 * 70_001 + 1, 0, seed=6)
        p = raw[1:].view(np.float32)
        assert not p.flags.aligned
    t = _tier(tmp_path / "d")
    try:
        for mode in ("hashed", "given"):
            key = _key()
            seal = _seal(p) if mode == "given" else b""
            assert t.store([ReplicaMeta(key, p.dtype.name, p.shape, checksum=seal)], [p])
            _stored_exact(t, key, p, 9)
    finally:
        t.close()


@pytest.mark.parametrize("python_reads", [False, True])
def test_zero_size_payloads(tmp_path: Path, python_reads: bool) -> None:
    """Payloads of no bytes, at unaligned addresses, of several shapes and dtypes: stored,
    read back empty and verified; a wrong seal to verify stores nothing."""
    t = _tier(tmp_path / "d", python_reads)
    try:
        for dtype, shape in (("uint8", (0,)), ("float16", (3, 0, 5)), ("int64", (0, 0))):
            p = _placed(0, 3).view(dtype).reshape(shape)
            for mode in ("hashed", "given", "verified"):
                key = _key()
                seal = _seal(p) if mode != "hashed" else b""
                m = ReplicaMeta(
                    key, dtype, shape, checksum=seal, verify_checksum=mode == "verified"
                )
                assert t.store([m], [p])
                assert t.meta(key).checksum == _seal(p)
                (got,) = t.read_batch([key])
                assert isinstance(got, np.ndarray) and got.shape == shape
                out = np.empty(shape, dtype)
                (got,) = t.read_batch([key], [out])
                assert got is out
            bad = ReplicaMeta(
                _key(), dtype, shape, checksum=_seal(np.ones(1)), verify_checksum=True
            )
            with pytest.raises(ChecksumMismatch):
                t.store([bad], [p])
            assert not t.contains(bad.key)
        assert t.check().clean
    finally:
        t.close()


# ------------------------------------------------------------------ seals that do not match


@pytest.mark.parametrize("bad_at", [0, 2, 4])
def test_a_batch_with_a_seal_that_does_not_match_stores_nothing(
    tmp_path: Path, bad_at: int
) -> None:
    """A batch of five (an aligned payload, unaligned ones under and over the streaming
    threshold, a 2 MiB + 1 one and an empty one) whose payload ``bad_at`` comes with a
    seal to verify that its bytes do not have: ChecksumMismatch, nothing of the batch
    stored, no space kept; the staging buffers it put back serve the next batches
    exactly, again and again."""
    t = _tier(tmp_path / "d")
    try:
        aligned = aligned_empty(64 << 10)
        aligned[:] = np.random.default_rng(1).integers(0, 256, aligned.size, dtype=np.uint8)
        payloads = [
            aligned,
            _placed(5000, 9, seed=2),
            _placed((200 << 10) + 3, 100, seed=3),
            _placed((2 << 20) + 1, 1, seed=4),
            _placed(0, 5),
        ]
        used = t.used_bytes
        for attempt in range(3):
            keys = [_key() for _ in payloads]
            metas = [
                ReplicaMeta(
                    k,
                    "uint8",
                    p.shape,
                    checksum=_seal(p[::-1]) if i == bad_at else _seal(p),
                    verify_checksum=True,
                )
                for i, (k, p) in enumerate(zip(keys, payloads, strict=True))
            ]
            if payloads[bad_at].nbytes < 2:  # reversing does not change it
                metas[bad_at] = ReplicaMeta(
                    keys[bad_at], "uint8", (0,), checksum=b"\x01" * 16, verify_checksum=True
                )
            with pytest.raises(ChecksumMismatch):
                t.store(metas, payloads)
            assert not any(t.contains(k) for k in keys)
            assert t.used_bytes == used
            good = [_key() for _ in payloads]
            hashed = [ReplicaMeta(k, "uint8", p.shape) for k, p in zip(good, payloads, strict=True)]
            assert t.store(hashed, payloads)
            for k, p in zip(good, payloads, strict=True):
                _stored_exact(t, k, p, attempt)
            used = t.used_bytes
        assert t.check().clean
    finally:
        t.close()


@pytest.mark.parametrize("python_reads", [False, True])
@pytest.mark.parametrize("nbytes", [5000, BLOCK, (2 << 20) + 1])
def test_a_wrong_given_checksum_is_a_miss_and_writes_no_byte_out(
    tmp_path: Path, python_reads: bool, nbytes: int
) -> None:
    """A checksum taken as given (not verified) that the bytes do not have: stored, and
    every read is a miss; an unaligned buffer read into keeps every byte it had."""
    t = _tier(tmp_path / "d", python_reads)
    try:
        p = _placed(nbytes, 33, seed=nbytes)
        key = _key()
        wrong = _seal(p[1:])
        assert t.store([ReplicaMeta(key, "uint8", p.shape, checksum=wrong)], [p])
        (got,) = t.read_batch([key])
        assert isinstance(got, ChecksumMismatch)
        out = _placed(nbytes, 17, fill=0x5A)
        (got,) = t.read_batch([key], [out])
        assert isinstance(got, ChecksumMismatch)
        assert (out == 0x5A).all(), "bytes that failed verification reached the buffer"
        assert isinstance(_pipelined(t, key, out), ChecksumMismatch)
        assert (out == 0x5A).all(), "bytes that failed verification reached the buffer"
    finally:
        t.close()


# ------------------------------------------------------------------ damage on disk


@given(
    size=st.sampled_from(SPECIAL),
    where=st.sampled_from(["payload", "header", "padding"]),
    at=st.integers(0, 1 << 30),
    python_reads=st.booleans(),
)
@settings(max_examples=24, deadline=None)
def test_a_frame_damaged_on_disk_never_reaches_an_unaligned_buffer(
    tmp_path_factory: pytest.TempPathFactory, size: int, where: str, at: int, python_reads: bool
) -> None:
    """One byte of a frame flipped in its file (payload, header or padding): a read into
    an unaligned buffer is a miss that leaves the buffer as it was, or (padding: no
    part of the data) the exact payload; never other bytes."""
    t = _tier(tmp_path_factory.mktemp("damaged"), python_reads)
    try:
        p = _placed(size, 1 + at % 4000, seed=at % 997)
        key = _key()
        assert t.store([ReplicaMeta(key, "uint8", p.shape)], [p])
        (row,) = t.frame_rows([key])
        assert row is not None
        pad = round_up(size) - size
        if where == "padding" and pad == 0:
            where = "payload"
        if where == "payload":
            pos = row.off + HEADER_BYTES + at % size
        elif where == "header":
            pos = row.off + at % HEADER_USED  # the header's fields and their checksum
        else:
            pos = row.off + HEADER_BYTES + size + at % pad
        with open(t.segment_file(row.seg), "r+b") as fh:
            fh.seek(pos)
            byte = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([byte[0] ^ (1 + at % 255)]))
            fh.flush()
            os.fsync(fh.fileno())
        for pipelined in (False, True):
            out = _placed(size, 2 + at % 3000, fill=0x33)
            got = _pipelined(t, key, out) if pipelined else t.read_batch([key], [out])[0]
            if where == "padding":
                assert got is out and out.tobytes() == p.tobytes()
            else:
                assert isinstance(got, ChecksumMismatch)
                assert (out == 0x33).all(), "bytes that failed verification reached the buffer"
    finally:
        t.close()


@pytest.mark.parametrize("python_reads", [False, True])
def test_a_truncated_frame_never_reaches_an_unaligned_buffer(
    tmp_path: Path, python_reads: bool
) -> None:
    """The segment file cut inside the frame's payload: a miss, the buffer unchanged."""
    t = _tier(tmp_path / "d", python_reads)
    try:
        p = _placed((1 << 20) + 5, 11, seed=1)
        key = _key()
        assert t.store([ReplicaMeta(key, "uint8", p.shape)], [p])
        (row,) = t.frame_rows([key])
        assert row is not None
        os.truncate(t.segment_file(row.seg), row.off + HEADER_BYTES + p.nbytes // 2)
        out = _placed(p.nbytes, 9, fill=0x44)
        (got,) = t.read_batch([key], [out])
        assert isinstance(got, ChecksumMismatch)
        assert (out == 0x44).all()
    finally:
        t.close()


# ------------------------------------------------------------------ a payload changing


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("mode", ["hashed", "given", "verified"])
def test_a_payload_changed_while_it_is_stored_never_verifies_as_other_bytes(
    tmp_path: Path, mode: str, aligned: bool
) -> None:
    """Another thread rewrites the source over and over (its first version, then whole
    fills of one byte) while ``store`` copies and hashes it. Each frame stored either
    fails verification on every read (a miss, the unaligned buffer untouched) or
    verifies holding bytes whose xxh3-128 is its checksum; with the first version's seal
    given (or given to verify) that is the first version exactly; hashed here, every
    byte is one the source held at that place. A seal to verify that the bytes did
    not match as they were copied stores nothing."""
    n = (4 << 20) + (0 if aligned else 4096 + 17)
    src = aligned_empty(n) if aligned else _placed(n, 64)
    first = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    src[:] = first
    fills = list(range(1, 8))
    seal = _seal(first)
    stop = threading.Event()
    writes = [0]

    def rewrite() -> None:
        k = 0
        while not stop.is_set():
            if k % 2:
                src[:] = fills[k % len(fills)]
            else:
                src[:] = first
            k += 1
            writes[0] = k

    t = _tier(tmp_path / "d")
    outcomes = {"verified": 0, "miss": 0, "refused": 0}
    w = threading.Thread(target=rewrite, daemon=True)
    w.start()
    try:
        for _ in range(12):
            key = _key()
            meta = ReplicaMeta(
                key,
                "uint8",
                (n,),
                checksum=seal if mode != "hashed" else b"",
                verify_checksum=mode == "verified",
            )
            try:
                assert t.store([meta], [src])
            except ChecksumMismatch:
                assert mode == "verified"
                assert not t.contains(key)
                outcomes["refused"] += 1
                continue
            stored = t.meta(key).checksum
            out = _placed(n, 3, fill=0x5A)
            (got,) = t.read_batch([key], [out])
            (fresh,) = t.read_batch([key])
            if isinstance(got, ChecksumMismatch):
                assert (out == 0x5A).all(), "bytes that failed verification reached the buffer"
                assert isinstance(fresh, ChecksumMismatch)
                outcomes["miss"] += 1
                continue
            assert got is out and isinstance(fresh, np.ndarray)
            assert fresh.tobytes() == out.tobytes()
            assert _seal(out) == stored, "a frame verified with bytes its checksum does not name"
            if mode == "hashed":
                ok = (out == first) | ((out >= 1) & (out <= 7))
                assert ok.all(), "a byte the source never held"
            else:
                assert stored == seal and out.tobytes() == first.tobytes()
            outcomes["verified"] += 1
    finally:
        stop.set()
        w.join(timeout=30)
        t.close()
    assert writes[0] > 12  # the source did change while it was stored
    assert sum(outcomes.values()) == 12


# ------------------------------------------------------------------ the copies themselves


@given(
    size=st.one_of(st.sampled_from(SPECIAL), st.integers(0, 200_000)),
    src_shift=st.integers(0, 127),
    dst_shift=st.sampled_from([0, 0, 64, 1, 4095]),
    sealed=st.booleans(),
    seed=st.integers(0, 1 << 16),
)
@settings(max_examples=40, deadline=None)
def test_the_copies_write_exactly_their_destination(
    size: int, src_shift: int, dst_shift: int, sealed: bool, seed: int
) -> None:
    """``copy_sealed`` and ``stream_copy`` (what the writer stages with and the readers
    copy out with), any size and misalignment: the destination holds the source, the
    seal is the source's xxh3-128, and no byte either side of the destination moves."""
    src = _placed(size, src_shift, seed=seed)
    guard = 4096
    canvas = _placed(size + 2 * guard + dst_shift, 0, fill=0xC3)
    dst = canvas[guard + dst_shift : guard + dst_shift + size]
    if sealed:
        seal = copy_sealed(dst, src)
        assert seal == _seal(src)
    else:
        stream_copy(dst, src)
    assert dst.tobytes() == src.tobytes()
    assert (canvas[: guard + dst_shift] == 0xC3).all(), "written before the destination"
    assert (canvas[guard + dst_shift + size :] == 0xC3).all(), "written past the destination"
