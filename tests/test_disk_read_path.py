"""The disk tier's read path (issue 28).

It verifies a frame's header by comparing it with the header its catalog row's frame
was written with (one comparison instead of parsing it field by field): its answer is
the field-by-field check's answer for every header, the right one and every damaged
one, and a frame the tier wrote matches its row's header. And a call keeps two of its
reads in flight even when other callers have taken the tier's whole ``io_depth``, so
that its checksum of one frame overlaps the read of the next."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import ReplicaMeta, Reservation
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import (
    HEADER_BYTES,
    HEADER_USED,
    FrameHeader,
    pack_header,
    payload_checksum,
    verify_frame,
)
from tests.conftest import budget

_names = st.text(max_size=30)


@st.composite
def rows(draw: st.DrawFn) -> CatalogRow:
    shape = tuple(draw(st.lists(st.integers(0, 1 << 20), min_size=0, max_size=9)))
    return CatalogRow(
        key=draw(st.binary(min_size=32, max_size=32)),
        seg=draw(st.integers(0, 1 << 20)),
        off=draw(st.integers(0, 1 << 40)),
        nbytes=draw(st.integers(0, 1 << 40)),
        checksum=draw(st.binary(min_size=16, max_size=16)),
        dtype=draw(st.sampled_from(["float16", "bfloat16", "uint8", "x" * 17]) | _names),
        shape=shape,
        transform=draw(st.sampled_from(["", "exact", "q8", "t" * 25]) | _names),
        info=b"",
    )


def _fields(row: CatalogRow) -> dict[str, object]:
    return {
        "key": row.key,
        "nbytes": row.nbytes,
        "checksum": row.checksum,
        "dtype": row.dtype,
        "shape": row.shape,
        "transform": row.transform,
    }


def _written(row: CatalogRow) -> bytearray:
    """The header a writer packs for ``row`` (zeros where it cannot be packed)."""
    buf = bytearray(HEADER_BYTES)
    try:
        head = FrameHeader(row.key, row.nbytes, row.checksum, row.dtype, row.shape, row.transform)
        pack_header(head, memoryview(buf))
    except (ValueError, UnicodeEncodeError):
        pass
    return buf


@settings(max_examples=budget(200, 2000), deadline=None)
@given(
    row=rows(),
    other=rows(),
    # damage where it counts: the header's used bytes (the rest is zero padding)
    flips=st.lists(st.tuples(st.integers(0, HEADER_USED + 3), st.integers(1, 255)), max_size=3),
    use_other=st.booleans(),
)
def test_header_check_answers_as_the_field_by_field_check(
    row: CatalogRow,
    other: CatalogRow,
    flips: list[tuple[int, int]],
    use_other: bool,
) -> None:
    """The header of this row's frame, of another row's, and either with bytes flipped
    (damage): the row's check says exactly what ``verify_frame`` says of it."""
    buf = _written(other if use_other else row)
    for at, bits in flips:
        buf[at] ^= bits
    header = memoryview(bytes(buf))
    assert row.verify(header, None) == verify_frame(header, None, **_fields(row))  # type: ignore[arg-type]


@settings(max_examples=budget(50, 500), deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), flip=st.integers(0, 4095))
def test_payload_is_hashed_whatever_the_header(data: bytes, flip: int) -> None:
    """A right header never excuses the payload: a changed byte is a mismatch."""
    payload = np.frombuffer(data, np.uint8).copy()
    row = CatalogRow(b"k" * 32, 1, 0, payload.nbytes, payload_checksum(payload), "uint8",
                     (payload.size,), "", b"")  # fmt: skip
    header = memoryview(bytes(_written(row)))
    assert row.verify(header, [payload]) == ""
    if payload.size:
        payload[flip % payload.size] ^= 1
        assert row.verify(header, [payload]) == "payload checksum mismatch"


def test_frames_the_tier_wrote_match_their_rows_header(tmp_path: Path) -> None:
    """Every frame the disk tier writes carries, byte for byte, the header its row
    expects, so that reads take the one-comparison check."""
    tier = DiskTier(tmp_path, DiskTierConfig(capacity_bytes=64 << 20, direct_io=False))
    try:
        arrays = [np.full((3, 5), i, np.float16) for i in range(4)]
        metas = [
            ReplicaMeta(ChunkKey(bytes([i]) * 32), "float16", (3, 5), checksum=payload_checksum(a))
            for i, a in enumerate(arrays)
        ]
        res = tier.prepare_store(metas)
        assert isinstance(res, Reservation)
        tier.commit_store(res, arrays)
        table = tier._table
        for m in metas:
            row = table.row(m.key)
            seg = table.segments[row.seg]
            head = np.empty(HEADER_BYTES, np.uint8)
            assert os.preadv(seg.fd, [head.data], row.off) == HEADER_BYTES
            assert bytes(head[:HEADER_USED]) == row.header()
        got = tier.read_batch([m.key for m in metas])
        for a, g in zip(arrays, got, strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(a, g)
    finally:
        tier.close()


@settings(max_examples=budget(20, 200), deadline=None)
@given(row=rows())
def test_every_single_byte_of_damage_is_answered_as_field_by_field(row: CatalogRow) -> None:
    """Each byte of the header's used part changed in turn (every field, the header
    checksum itself): the row's check says what ``verify_frame`` says."""
    written = _written(row)
    for at in range(HEADER_USED):
        buf = bytearray(written)
        buf[at] ^= 0x5A
        header = memoryview(bytes(buf))
        assert row.verify(header, None) == verify_frame(header, None, **_fields(row))  # type: ignore[arg-type]


class PairIO(FileIO):
    """Once armed, every ``preadv`` waits until another one is inside too (a broken
    barrier, after its timeout, proves that reads ran one at a time)."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.armed = False
        self.barrier = threading.Barrier(2, timeout=5)
        self.broken = False

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        if self.armed:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                self.broken = True
        return super().preadv(fd, buffers, offset)


def test_a_caller_keeps_two_reads_in_flight_when_others_hold_io_depth(tmp_path: Path) -> None:
    """``io_depth`` 1, one caller (or as many as its io_depth): the call still reads two
    frames at once (before, it read one, hashed it, then issued the next read)."""
    io = PairIO()
    tier = DiskTier(tmp_path, DiskTierConfig(64 << 20, direct_io=False, io_depth=1), fileio=io)
    try:
        arrays = [np.full((64, 64), i, np.float16) for i in range(4)]
        metas = [
            ReplicaMeta(
                ChunkKey(bytes([i]) * 32), "float16", (64, 64), checksum=payload_checksum(a)
            )
            for i, a in enumerate(arrays)
        ]
        res = tier.prepare_store(metas)
        assert isinstance(res, Reservation)
        tier.commit_store(res, arrays)
        io.armed = True
        got = tier.read_batch([m.key for m in metas])
        assert not io.broken, "the call's reads ran one at a time"
        for a, g in zip(arrays, got, strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(a, g)
    finally:
        io.barrier.abort()
        tier.close()


def test_new_arrays_are_mapped_by_the_caller_before_any_read(tmp_path: Path) -> None:
    """A batch read into new arrays maps every array on the calling thread before the
    first read: a mapping made on a helper while the others' reads fault fresh pages in
    waits for them all (the process's memory map lock; the first batch ran at 0.2x of
    later ones). Mixed with caller buffers, only the frames without one get an array."""
    tier = DiskTier(tmp_path, DiskTierConfig(64 << 20, direct_io=False, io_depth=4))
    events: list[tuple[str, str]] = []
    reader = tier._reader
    pool = reader._new_arrays
    take, preadv = pool.take, tier.io.preadv

    def traced_take(nbytes: int) -> np.ndarray:
        events.append(("take", threading.current_thread().name))
        return take(nbytes)

    def traced_preadv(fd: int, bufs: Sequence[np.ndarray], offset: int) -> int:
        events.append(("read", threading.current_thread().name))
        return preadv(fd, bufs, offset)

    try:
        arrays = [np.full((256, 64), i, np.float16) for i in range(8)]
        metas = [ReplicaMeta(ChunkKey(bytes([i]) * 32), "float16", (256, 64)) for i in range(8)]
        res = tier.prepare_store(metas)
        assert isinstance(res, Reservation)
        tier.commit_store(res, arrays)
        pool.take = traced_take  # type: ignore[method-assign]
        tier.io.preadv = traced_preadv  # type: ignore[method-assign, assignment]
        outs: list[np.ndarray | None] = [
            None if i % 2 == 0 else np.empty((256, 64), np.float16) for i in range(8)
        ]
        got = tier.read_batch([m.key for m in metas], outs)
        for a, g in zip(arrays, got, strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(a, g)
        kinds = [k for k, _ in events]
        assert kinds.count("take") == 4 and kinds.count("read") == 8
        assert kinds[:4] == ["take"] * 4, kinds  # all mapped before the first read
        me = threading.current_thread().name
        assert all(who == me for k, who in events if k == "take")
        assert {who for k, who in events if k == "read"} - {me}, "no helper read"
    finally:
        tier.close()
