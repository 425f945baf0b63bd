"""Attacks on the native read path of the disk tier (issue 28, commit d42ab76):
``kvlife/native/_frames.c`` reads a run of frames on its own threads and verifies each
(header bytes, payload xxh3-128) with the interpreter lock released, through
``kvlife.native.frames.read_run`` and ``kvlife.tiers.disk.native_reads.read_frames``,
used by ``Reader.read_batch`` (two frames or more) and ``Reader.read_pipelined``.

The Python path is the reference: every test that damages frames compares the two
(``paths`` switches ``reader.usable``). Damage is done to the REAL segment files (a
patched ``preadv`` would send the reads down the Python path): bit flips in every field
class of a header and every position class of a payload, truncations at every boundary,
frames copied over each other, a descriptor closed or pointed at another file. The
promise held against: never wrong bytes (a bad frame is a typed miss, ChecksumMismatch
or ReplicaReadError), never a crash, never a hang, a clear error for bad input.

Every wait is bounded: a hang is a failure, never a stuck run."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import xxhash

from kvlife.core.errors import ChecksumMismatch, KVLifeError, ReplicaReadError
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.native import frames as native
from kvlife.store import KVStore, reads
from kvlife.store.reads import LoadHandle
from kvlife.tiers.base import ReadResult, ReplicaMeta, Reservation
from kvlife.tiers.buffers import aligned_empty, round_up
from kvlife.tiers.disk import DiskTier, DiskTierConfig, native_reads
from kvlife.tiers.disk import reader as reader_mod
from kvlife.tiers.disk.fileio import FileIO, probe_direct_io
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED
from tests.conftest import TINY, prompt_kv

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLIFE_NATIVE") == "0" or not native.available(),
    reason="the native extension is off or not built",
)

WAIT = 10.0
T = TypeVar("T")
N = TINY.tokens_per_chunk

# header field offsets ("<8sHHQ32s16s16sB8Q24s" then the u64 header checksum)
HEADER_FIELDS = {
    "magic": 0,
    "version": 8,
    "flags": 10,
    "payload_len": 12,
    "key": 20,
    "checksum": 52,
    "dtype": 68,
    "ndim": 84,
    "shape": 85,
    "transform": 149,
    "header_checksum": 173,
    "header_checksum_last": HEADER_USED - 1,
}


# ---------------------------------------------------------------------------- helpers


def _tier(path: Path, io_depth: int = 4, direct: bool = False) -> DiskTier:
    return DiskTier(path, DiskTierConfig(256 << 20, direct_io=direct, io_depth=io_depth))


def _store(
    tier: DiskTier, sizes: Sequence[int], seed: int = 0, tag: bytes = b"at"
) -> tuple[list[ChunkKey], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    metas = [
        ReplicaMeta(ChunkKey(bytes([seed % 256, i % 256, i // 256]) * 10 + tag), "uint8", (n,))
        for i, n in enumerate(sizes)
    ]
    res = tier.prepare_store(metas)
    assert isinstance(res, Reservation)
    tier.commit_store(res, arrays)
    return [m.key for m in metas], arrays


def _put(tier: DiskTier, key: ChunkKey, arr: np.ndarray) -> None:
    res = tier.prepare_store([ReplicaMeta(key, str(arr.dtype), arr.shape)])
    assert isinstance(res, Reservation)
    tier.commit_store(res, [arr])


def _where(tier: DiskTier, key: ChunkKey) -> tuple[Path, int, int]:
    row = tier._table.row(key)
    return tier._table.segments[row.seg].path, row.off, row.nbytes


def _flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        assert len(b) == 1, f"offset {offset} is past the end of {path}"
        fh.seek(offset)
        fh.write(bytes([b[0] ^ (1 << bit)]))


def _noted(into: list[T], what: T) -> bool:
    """A callback's body: note ``what``, take the frame."""
    into.append(what)
    return True


def _kind(r: ReadResult) -> tuple[str, str]:
    if isinstance(r, np.ndarray):
        return ("array", xxhash.xxh3_64_hexdigest(r.tobytes()) + f":{r.nbytes}")
    return (type(r).__name__, str(r))


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """``paths["native"]`` switches one tier between the native and the Python path."""
    state = {"native": True}
    usable = native_reads.usable
    monkeypatch.setattr(reader_mod, "usable", lambda io: state["native"] and usable(io))
    return state


def _both(
    tier: DiskTier,
    paths: dict[str, bool],
    read: Callable[[], T],
) -> tuple[T, T]:
    """``read()`` on the native path, then on the Python path."""
    out: list[T] = []
    for on in (True, False):
        paths["native"] = on
        assert tier._reader.native() is on
        out.append(read())
    paths["native"] = True
    return out[0], out[1]


def _pipelined(
    tier: DiskTier, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None]
) -> tuple[int, dict[int, ReadResult]]:
    handed: dict[int, ReadResult] = {}
    lock = threading.Lock()

    def done(i: int, res: ReadResult) -> None:
        with lock:
            handed[i] = res

    n = tier.read_pipelined(keys, outs, done)
    return n, handed


def _assert_same_on_both(
    tier: DiskTier,
    paths: dict[str, bool],
    keys: list[ChunkKey],
    arrays: list[np.ndarray],
    bad: set[int],
    into: str = "new",
) -> None:
    """read_batch and read_pipelined on both paths: the damaged frames are
    ChecksumMismatch, the rest byte-exact, and both paths give the same results (same
    kinds, same messages)."""

    def outs() -> list[np.ndarray | None]:
        if into == "new":
            return [None] * len(keys)
        if into == "aligned":
            return [aligned_empty(round_up(max(a.nbytes, 1)))[: a.nbytes] for a in arrays]
        return [aligned_empty(a.nbytes + 1)[1:] for a in arrays]  # unaligned: staged

    nat, py = _both(tier, paths, lambda: tier.read_batch(keys, outs()))
    for i, r in enumerate(nat):
        if i in bad:
            assert isinstance(r, ChecksumMismatch), (i, r)
        else:
            assert isinstance(r, np.ndarray) and np.array_equal(r, arrays[i]), (i, r)
            if into == "new":
                assert not r.flags.writeable
    assert [_kind(r) for r in nat] == [_kind(r) for r in py]

    (n_nat, h_nat), (n_py, h_py) = _both(tier, paths, lambda: _pipelined(tier, keys, outs()))
    assert n_nat == n_py == len(keys)
    assert sorted(h_nat) == list(range(len(keys)))
    assert [_kind(h_nat[i]) for i in range(len(keys))] == [_kind(h_py[i]) for i in range(len(keys))]
    for i in range(len(keys)):
        r = h_nat[i]
        if i in bad:
            assert isinstance(r, ChecksumMismatch), (i, r)
        else:
            assert isinstance(r, np.ndarray) and np.array_equal(r, arrays[i]), (i, r)


# ---------------------------------------------------------------------------- on-disk damage


def test_the_native_path_is_the_one_under_attack(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        assert native.available()
        assert tier._reader.native()
        assert tier.reads_runs_natively()
    finally:
        tier.close()


@pytest.mark.parametrize("field", sorted(HEADER_FIELDS))
@pytest.mark.parametrize("into", ["new", "aligned", "unaligned"])
def test_a_bit_flipped_in_each_header_field_is_the_same_miss_on_both_paths(
    tmp_path: Path, paths: dict[str, bool], field: str, into: str
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 5000, 8192, 0, 12288])
        victims = [1, 3]  # a partial page and a zero-byte payload
        for v in victims:
            path, off, _ = _where(tier, keys[v])
            _flip_bit(path, off + HEADER_FIELDS[field], bit=3)
        _assert_same_on_both(tier, paths, keys, arrays, set(victims), into)
    finally:
        tier.close()


def test_a_bit_flipped_in_the_header_padding_is_harmless_on_both_paths(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 5000, 0])
        for k in keys:
            path, off, _ = _where(tier, k)
            _flip_bit(path, off + HEADER_USED, 0)
            _flip_bit(path, off + HEADER_BYTES - 1, 7)
        _assert_same_on_both(tier, paths, keys, arrays, set())
    finally:
        tier.close()


PAYLOAD_SPOTS: dict[str, Callable[[int], int]] = {
    "first": lambda n: 0,
    "second": lambda n: 1,
    "middle": lambda n: n // 2,
    "page_end": lambda n: 4095,
    "page_start": lambda n: 4096,
    "last": lambda n: n - 1,
}


@pytest.mark.parametrize("spot", sorted(PAYLOAD_SPOTS))
@pytest.mark.parametrize("into", ["new", "aligned", "unaligned"])
def test_a_bit_flipped_at_each_payload_position_is_the_same_miss_on_both_paths(
    tmp_path: Path, paths: dict[str, bool], spot: str, into: str
) -> None:
    tier = _tier(tmp_path)
    try:
        sizes = [8192, 4097 + 4096, 12288, 6000]
        keys, arrays = _store(tier, sizes)
        victims = [0, 1, 3]
        for v in victims:
            path, off, n = _where(tier, keys[v])
            _flip_bit(path, off + HEADER_BYTES + PAYLOAD_SPOTS[spot](n), bit=v % 8)
        _assert_same_on_both(tier, paths, keys, arrays, set(victims), into)
    finally:
        tier.close()


def test_damage_in_the_payload_padding_is_harmless_on_both_paths(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [5000, 1, 0, 4095])
        for k in keys:
            path, off, n = _where(tier, k)
            pad_from = off + HEADER_BYTES + n
            pad_to = off + HEADER_BYTES + round_up(n)
            if pad_to > pad_from:
                _flip_bit(path, pad_from, 1)
                _flip_bit(path, pad_to - 1, 6)
        _assert_same_on_both(tier, paths, keys, arrays, set())
    finally:
        tier.close()


def test_a_large_aligned_frame_flipped_at_its_last_byte(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    """A payload of 2 MiB and more is placed at 64 KiB (padding before its header):
    damage at its last byte and in its first page are misses on both paths."""
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [5000, (2 << 20) + 4096, 3 << 20, 4096])
        path, off, n = _where(tier, keys[1])
        _flip_bit(path, off + HEADER_BYTES + n - 1, 0)
        path, off, n = _where(tier, keys[2])
        _flip_bit(path, off + HEADER_BYTES + 17, 4)
        _assert_same_on_both(tier, paths, keys, arrays, {1, 2}, "aligned")
        _assert_same_on_both(tier, paths, keys, arrays, {1, 2}, "new")
    finally:
        tier.close()


TRUNCATE_AT: dict[str, Callable[[int, int], int]] = {
    "frame_start": lambda off, n: off,
    "mid_header": lambda off, n: off + 100,
    "header_used": lambda off, n: off + HEADER_USED,
    "header_end": lambda off, n: off + HEADER_BYTES,
    "one_payload_byte": lambda off, n: off + HEADER_BYTES + 1,
    "mid_payload": lambda off, n: off + HEADER_BYTES + n // 2,
    "payload_end_minus_1": lambda off, n: off + HEADER_BYTES + n - 1,
}


@pytest.mark.parametrize("at", sorted(TRUNCATE_AT))
@pytest.mark.parametrize("into", ["new", "aligned", "unaligned"])
def test_a_segment_truncated_at_each_boundary_is_the_same_miss_on_both_paths(
    tmp_path: Path, paths: dict[str, bool], at: str, into: str
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 6000, 9000])
        path, off, n = _where(tier, keys[2])
        os.truncate(path, TRUNCATE_AT[at](off, n))
        _assert_same_on_both(tier, paths, keys, arrays, {2}, into)
    finally:
        tier.close()


def test_a_segment_cut_right_after_the_payload_keeps_the_frame(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    """Only the padding after the last payload is gone: the frame is whole on both."""
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 6000, 9000])
        path, off, n = _where(tier, keys[2])
        os.truncate(path, off + HEADER_BYTES + n)
        _assert_same_on_both(tier, paths, keys, arrays, set(), "aligned")
        _assert_same_on_both(tier, paths, keys, arrays, set(), "new")
    finally:
        tier.close()


def test_a_segment_truncated_to_nothing_is_a_miss_for_every_frame(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 0, 6000, 9000])
        path, _, _ = _where(tier, keys[0])
        os.truncate(path, 0)
        _assert_same_on_both(tier, paths, keys, arrays, {0, 1, 2, 3})
    finally:
        tier.close()


def test_frames_copied_over_each_other_are_misses(tmp_path: Path, paths: dict[str, bool]) -> None:
    """Frame 0's whole frame copied over frame 1 (a header naming another key), and an
    old frame of key 2 (written before a replace, same size) copied over its live
    frame (a header with the old checksum): misses on both paths, never the bytes."""
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [8192, 8192, 8192, 4096])
        p0, off0, _ = _where(tier, keys[0])
        p1, off1, _ = _where(tier, keys[1])
        old_path, old_off, _ = _where(tier, keys[2])
        with p0.open("rb") as fh:
            fh.seek(off0)
            whole0 = fh.read(HEADER_BYTES + 8192)
        with old_path.open("rb") as fh:
            fh.seek(old_off)
            old2 = fh.read(HEADER_BYTES + 8192)
        with p1.open("r+b") as fh:
            fh.seek(off1)
            fh.write(whole0)
        tier.delete(keys[2])
        new2 = np.random.default_rng(99).integers(0, 256, 8192, dtype=np.uint8)
        _put(tier, keys[2], new2)
        arrays[2] = new2
        p2, off2, _ = _where(tier, keys[2])
        assert (p2, off2) != (old_path, old_off)
        with p2.open("r+b") as fh:
            fh.seek(off2)
            fh.write(old2)
        _assert_same_on_both(tier, paths, keys, arrays, {1, 2}, "aligned")
        _assert_same_on_both(tier, paths, keys, arrays, {1, 2}, "new")
    finally:
        tier.close()


def test_a_descriptor_pointed_at_another_file_is_a_miss_never_its_bytes(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    """The segment's fd number now names another file (a descriptor closed and reused):
    one holding a damaged copy of the segment. Every frame is a typed miss on both."""
    tier = _tier(tmp_path / "t")
    try:
        keys, arrays = _store(tier, [4096, 8192, 5000])
        seg_path, _, _ = _where(tier, keys[1])
        decoy = tmp_path / "decoy"
        decoy.write_bytes(seg_path.read_bytes())
        for k in keys:
            _, o, m = _where(tier, k)
            _flip_bit(decoy, o + HEADER_BYTES + max(m - 1, 0), 2)
        seg = tier._table.segments[tier._table.row(keys[0]).seg]
        saved = os.dup(seg.fd)
        dfd = os.open(decoy, os.O_RDONLY)
        os.dup2(dfd, seg.fd)
        os.close(dfd)
        try:
            _assert_same_on_both(tier, paths, keys, arrays, {0, 1, 2}, "aligned")
        finally:
            os.dup2(saved, seg.fd)
            os.close(saved)
        _assert_same_on_both(tier, paths, keys, arrays, set(), "aligned")
    finally:
        tier.close()


def test_a_descriptor_opened_write_only_is_a_read_error_on_both(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    tier = _tier(tmp_path / "t")
    try:
        keys, _ = _store(tier, [4096, 8192])
        seg = tier._table.segments[tier._table.row(keys[0]).seg]
        saved = os.dup(seg.fd)
        wfd = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)
        os.dup2(wfd, seg.fd)
        os.close(wfd)
        try:
            nat, py = _both(tier, paths, lambda: tier.read_batch(keys))
        finally:
            os.dup2(saved, seg.fd)
            os.close(saved)
        for r in nat:
            assert isinstance(r, ReplicaReadError) and "Bad file descriptor" in str(r)
        assert [_kind(r) for r in nat] == [_kind(r) for r in py]
    finally:
        tier.close()


def test_many_frames_with_scattered_damage(tmp_path: Path, paths: dict[str, bool]) -> None:
    """Three hundred frames (sizes 0 to 3 pages), one in ten damaged: both paths agree,
    through read_batch at the widest depth and read_pipelined."""
    tier = _tier(tmp_path, io_depth=64)
    try:
        rng = np.random.default_rng(7)
        sizes = [int(s) for s in rng.integers(0, 3 * 4096, 300)]
        sizes[::37] = [0] * len(sizes[::37])
        keys, arrays = _store(tier, sizes, seed=3)
        bad = set()
        for i in rng.choice(300, 30, replace=False):
            path, off, n = _where(tier, keys[int(i)])
            if n:
                _flip_bit(path, off + HEADER_BYTES + int(rng.integers(0, n)), int(i) % 8)
            else:
                _flip_bit(path, off + int(rng.integers(0, HEADER_USED)), int(i) % 8)
            bad.add(int(i))
        _assert_same_on_both(tier, paths, keys, arrays, bad, "new")
        _assert_same_on_both(tier, paths, keys, arrays, bad, "unaligned")
    finally:
        tier.close()


def test_a_direct_io_tier_reads_natively_and_catches_damage(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    if not probe_direct_io(tmp_path):
        pytest.skip("no O_DIRECT on this filesystem")
    tier = _tier(tmp_path, direct=True)
    try:
        assert tier.io.direct and tier._reader.native()
        keys, arrays = _store(tier, [4096, 0, 5000, 8192, 1])
        path, off, n = _where(tier, keys[2])
        _flip_bit(path, off + HEADER_BYTES + n - 1, 0)
        path, off, n = _where(tier, keys[4])
        _flip_bit(path, off + HEADER_FIELDS["shape"], 0)
        for into in ("new", "aligned", "unaligned"):
            _assert_same_on_both(tier, paths, keys, arrays, {2, 4}, into)
    finally:
        tier.close()


# ---------------------------------------------------------------------------- buffers


def test_returned_new_arrays_are_read_only_for_good(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 5000, 0])
        got = tier.read_batch(keys)
        _, handed = _pipelined(tier, keys, [None] * 3)
        for r in [*got, *handed.values()]:
            assert isinstance(r, np.ndarray) and not r.flags.writeable
            if r.size:  # (an empty array has no byte to protect)
                with pytest.raises(ValueError):
                    r.flags.writeable = True
                with pytest.raises(ValueError):
                    r[0] = 1
                with pytest.raises((ValueError, TypeError)):
                    r.data.cast("B")[0] = 1
        for r, a in zip(got, arrays, strict=True):
            assert isinstance(r, np.ndarray) and np.array_equal(r, a)
    finally:
        tier.close()


def test_results_still_held_survive_the_recycling_of_dropped_ones(tmp_path: Path) -> None:
    """Read a run, keep every other result, drop the rest, read again many times (the
    pool recycles the dropped memory): the kept arrays never change."""
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 8192] * 6)
        kept: list[tuple[np.ndarray, np.ndarray]] = []
        for _ in range(20):
            got = tier.read_batch(keys)
            for g, a in zip(got[::2], arrays[::2], strict=True):
                assert isinstance(g, np.ndarray)
                kept.append((g, a))
            del got
            _, handed = _pipelined(tier, keys, [None] * len(keys))
            del handed
        assert tier._reader._new_arrays.reused > 0
        for g, a in kept:
            assert isinstance(g, np.ndarray) and np.array_equal(g, a)
    finally:
        tier.close()


def test_odd_output_buffers_get_the_right_bytes(tmp_path: Path, paths: dict[str, bool]) -> None:
    """Output buffers one byte off, non-contiguous, Fortran-ordered, reversed, exact
    size zero: the bytes land right (or, on both paths alike, a typed error)."""
    tier = _tier(tmp_path)
    try:
        rng = np.random.default_rng(5)
        arrs = [
            rng.integers(0, 256, (4, 2048), dtype=np.uint8),
            rng.integers(0, 256, (64, 64), dtype=np.uint8),
            rng.integers(0, 256, (2, 4096), dtype=np.uint8),
            rng.integers(0, 256, (0, 16), dtype=np.uint8),
            rng.integers(0, 256, (3, 5), dtype=np.uint8),
        ]
        keys = [ChunkKey(bytes([i]) * 30 + b"od") for i in range(len(arrs))]
        res = tier.prepare_store(
            [ReplicaMeta(k, "uint8", a.shape) for k, a in zip(keys, arrs, strict=True)]
        )
        assert isinstance(res, Reservation)
        tier.commit_store(res, arrs)

        def outs() -> list[np.ndarray]:
            return [
                np.zeros((4, 2048), np.uint8, order="F"),
                aligned_empty(64 * 64 + 1)[1:].reshape(64, 64),
                aligned_empty(2 * 4096).reshape(2, 4096)[::-1],
                np.zeros((0, 16), np.uint8),
                np.zeros((3, 10), np.uint8)[:, ::2],
            ]

        for _ in range(3):
            nat, py = _both(tier, paths, lambda: tier.read_batch(keys, outs()))
            for r, a in zip(nat, arrs, strict=True):
                assert isinstance(r, np.ndarray) and np.array_equal(r, a)
            assert [_kind(r) for r in nat] == [_kind(r) for r in py]
    finally:
        tier.close()


def test_a_read_only_output_buffer_fails_alike_on_both_paths(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    """A caller's aligned, read-only output buffer cannot be read into. Bad input must
    give a clear error, and the same one whichever path reads (the native one is taken
    for two frames or more, the Python one for one frame or a patched FileIO)."""
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 8192])

        def outs() -> list[np.ndarray]:
            o = [aligned_empty(a.nbytes) for a in arrays]
            o[1].flags.writeable = False
            return o

        raised: dict[bool, BaseException] = {}
        for on in (True, False):
            paths["native"] = on
            with pytest.raises(Exception) as info:
                tier.read_batch(keys, outs())
            raised[on] = info.value
        assert type(raised[True]) is type(raised[False]), (
            f"native raised {type(raised[True]).__name__}({raised[True]}), "
            f"python {type(raised[False]).__name__}({raised[False]})"
        )
    finally:
        tier.close()


def test_a_read_only_output_buffer_error_says_what_is_wrong(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        assert tier._reader.native()
        keys, arrays = _store(tier, [4096, 8192])
        outs = [aligned_empty(a.nbytes) for a in arrays]
        outs[1].flags.writeable = False
        with pytest.raises(Exception) as info:
            tier.read_batch(keys, outs)
        msg = str(info.value).lower()
        assert "writ" in msg or "read-only" in msg or "readonly" in msg, repr(info.value)
    finally:
        tier.close()


def test_a_wrong_size_output_buffer_is_invalid_argument_and_reads_nothing(
    tmp_path: Path,
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, _ = _store(tier, [4096, 8192])
        outs = [aligned_empty(4096), aligned_empty(4096)]
        outs[0][:] = 7
        with pytest.raises(KVLifeError, match="does not fit"):
            tier.read_batch(keys, outs)
        with pytest.raises(KVLifeError, match="does not fit"):
            tier.read_pipelined(keys, outs, lambda i, r: None)
        assert (outs[0] == 7).all()
        table = tier._table
        assert all(s.readers == 0 for s in table.segments.values())
    finally:
        tier.close()


# ---------------------------------------------------------------------------- concurrency


def test_many_threads_read_the_same_damaged_run(tmp_path: Path) -> None:
    """Twelve threads read the same forty frames (three damaged) into new arrays,
    aligned and unaligned buffers: every result is exact or, for the damaged ones, a
    ChecksumMismatch, every time."""
    tier = _tier(tmp_path, io_depth=8)
    errors: list[BaseException] = []
    try:
        keys, arrays = _store(tier, [4096 * (1 + i % 3) + (i % 5) for i in range(40)])
        bad = {3, 17, 39}
        for b in bad:
            path, off, n = _where(tier, keys[b])
            _flip_bit(path, off + HEADER_BYTES + n // 3, 5)
        start = threading.Barrier(12)

        def reader(t: int) -> None:
            try:
                start.wait(WAIT)
                for r in range(8):
                    mode = (t + r) % 3
                    outs: list[np.ndarray | None]
                    if mode == 0:
                        outs = [None] * len(keys)
                    elif mode == 1:
                        outs = [aligned_empty(round_up(a.nbytes))[: a.nbytes] for a in arrays]
                    else:
                        outs = [aligned_empty(a.nbytes + 1)[1:] for a in arrays]
                    if r % 2:
                        got = tier.read_batch(keys, outs)
                    else:
                        n, handed = _pipelined(tier, keys, outs)
                        assert n == len(keys)
                        got = [handed[i] for i in range(len(keys))]
                    for i, g in enumerate(got):
                        if i in bad:
                            assert isinstance(g, ChecksumMismatch), (i, g)
                        else:
                            assert isinstance(g, np.ndarray) and np.array_equal(g, arrays[i])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(12)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(WAIT * 3)
        assert not any(th.is_alive() for th in threads), "a reader hung"
        assert not errors, errors[0]
        assert all(s.readers == 0 for s in tier._table.segments.values())
    finally:
        tier.close()


def test_replaces_racing_pipelined_reads_never_hand_out_foreign_bytes(tmp_path: Path) -> None:
    """A writer replaces (delete, put new bytes) keys of a run over and over while
    another thread reads the run with read_pipelined and read_batch: every array handed
    out is one of the versions ever stored for its key, never anything else."""
    tier = _tier(tmp_path)
    try:
        nkeys = 12
        keys, first = _store(tier, [8192] * nkeys, seed=11)
        versions: list[set[bytes]] = [{a.tobytes()} for a in first]
        stop = threading.Event()
        errors: list[BaseException] = []
        vlock = threading.Lock()

        def writer() -> None:
            rng = np.random.default_rng(12)
            try:
                while not stop.is_set():
                    i = int(rng.integers(0, nkeys))
                    arr = rng.integers(0, 256, 8192, dtype=np.uint8)
                    with vlock:
                        versions[i].add(arr.tobytes())
                    with contextlib.suppress(KVLifeError):
                        tier.delete(keys[i])
                    _put(tier, keys[i], arr)
            except BaseException as exc:
                errors.append(exc)

        w = threading.Thread(target=writer)
        w.start()
        try:
            for it in range(60):
                try:
                    if it % 2:
                        _, got_d = _pipelined(tier, keys, [None] * nkeys)
                        got = list(got_d.items())
                    else:
                        got = list(enumerate(tier.read_batch(keys)))
                except KVLifeError:  # a key gone between look-ups: not found
                    continue
                for i, g in got:
                    if isinstance(g, np.ndarray):
                        with vlock:
                            assert g.tobytes() in versions[i], f"foreign bytes for key {i}"
                    else:
                        assert isinstance(g, (ChecksumMismatch, ReplicaReadError)), g
        finally:
            stop.set()
            w.join(WAIT)
        assert not w.is_alive()
        assert not errors, errors[0]
    finally:
        tier.close()


def test_a_replace_from_done_stops_the_run_before_the_replaced_frame(tmp_path: Path) -> None:
    """Frame 0's done replaces key 2 (new bytes at a new place) from another thread
    and waits for it: frames 2 on are not handed out; a read after gets the new bytes."""
    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [8192] * 6)
        new = np.full(8192, 0xAB, np.uint8)
        handed: dict[int, ReadResult] = {}

        def replace() -> None:
            tier.delete(keys[2])
            _put(tier, keys[2], new)

        def done(i: int, res: ReadResult) -> None:
            handed[i] = res
            if i == 0:
                t = threading.Thread(target=replace)
                t.start()
                t.join(WAIT)
                assert not t.is_alive()

        outs = [aligned_empty(8192) for _ in keys]
        assert tier.read_pipelined(keys, outs, done) == 2
        assert sorted(handed) == [0, 1]
        for i in (0, 1):
            assert handed[i] is outs[i] and np.array_equal(outs[i], arrays[i])
        again = tier.read_batch(keys)
        assert isinstance(again[2], np.ndarray) and np.array_equal(again[2], new)
    finally:
        tier.close()


def test_done_that_raises_base_exceptions_still_hands_out_every_frame(tmp_path: Path) -> None:
    class Stop(BaseException):
        pass

    tier = _tier(tmp_path)
    try:
        keys, arrays = _store(tier, [4096, 0, 8192, 5000])
        handed: list[int] = []

        def done(i: int, res: ReadResult) -> None:
            handed.append(i)
            assert isinstance(res, np.ndarray) and np.array_equal(res, arrays[i])
            raise Stop(i)

        with pytest.raises(Stop) as info:
            tier.read_pipelined(keys, [None] * 4, done)
        assert info.value.args == (0,)
        assert handed == [0, 1, 2, 3]
        assert all(s.readers == 0 for s in tier._table.segments.values())
    finally:
        tier.close()


def test_proceed_that_raises_ends_the_run_with_its_error_and_no_pin(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        keys, _ = _store(tier, [4096] * 5)
        handed: list[int] = []

        def proceed() -> bool:
            if len(handed) >= 2:
                raise LookupError("proceed failed")
            return True

        with pytest.raises(LookupError, match="proceed failed"):
            tier.read_pipelined(keys, [None] * 5, lambda i, r: handed.append(i), proceed)
        assert handed == [0, 1]
        assert all(s.readers == 0 for s in tier._table.segments.values())
        assert len(tier.read_batch(keys)) == 5
    finally:
        tier.close()


def test_the_tier_closed_from_done_mid_run_gives_no_wrong_bytes(tmp_path: Path) -> None:
    """Frame 0's done closes the tier (its segment fds with it) while the extension's
    threads read the frames after it: no crash, no hang, and whatever is handed out
    is the exact bytes or a typed miss."""
    tier = _tier(tmp_path)
    keys, arrays = _store(tier, [1 << 20] * 6)
    handed: dict[int, ReadResult] = {}

    def done(i: int, res: ReadResult) -> None:
        handed[i] = res
        if i == 0:
            tier.close()

    with contextlib.suppress(KVLifeError, OSError):
        tier.read_pipelined(keys, [None] * 6, done)
    assert 0 in handed
    for i, r in handed.items():
        if isinstance(r, np.ndarray):
            assert np.array_equal(r, arrays[i]), i
        else:
            assert isinstance(r, (ChecksumMismatch, ReplicaReadError)), r


# ---------------------------------------------------------------------------- the store


def _disk_store(path: Path) -> KVStore:
    return KVStore.open(path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20, io_threads=4)


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = DiskTier.read_pipelined

    def spy(self: DiskTier, keys, outs, done, proceed=None):  # type: ignore[no-untyped-def,unused-ignore]
        assert self._reader.native()
        calls.append(len(keys))
        return real(self, keys, outs, done, proceed)

    monkeypatch.setattr(DiskTier, "read_pipelined", spy)
    return calls


def _chunk(kv: np.ndarray, i: int) -> np.ndarray:
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def test_a_store_load_over_damaged_chunks_serves_no_wrong_bytes(
    tmp_path: Path, identity: ModelIdentity, spied: list[int]
) -> None:
    tokens, kv = prompt_kv(77, 6 * N)
    store = _disk_store(tmp_path)
    try:
        keys = list(store.put_prompt(identity, PUBLIC, tokens, kv).keys)
        tier = store.tier("disk")
        assert isinstance(tier, DiskTier) and tier._reader.native()
        path, off, n = _where(tier, keys[3])
        _flip_bit(path, off + HEADER_BYTES + n - 1, 0)
        hit = store.lookup(identity, PUBLIC, tokens)
        handle = store.load_async(hit, depth=2)
        got = [handle.chunk(i, timeout=WAIT) for i in range(6)]
        res = handle.wait(timeout=WAIT)
        assert spied, "the native pipelined path did not run"
        for i, g in enumerate(got):
            if i < 3:
                assert g is not None and np.array_equal(g, _chunk(kv, i))
            else:
                assert g is None
        assert res.loaded == 3
        assert store.counters.corrupt == 1
    finally:
        store.close()


def test_an_invalidation_from_a_completion_stops_the_native_run(
    tmp_path: Path, identity: ModelIdentity, spied: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 0 completes and, from its completion, the prompt is invalidated (on
    another thread, waited for): no later chunk is handed out."""
    tokens, kv = prompt_kv(78, 5 * N)
    store = _disk_store(tmp_path)
    real = LoadHandle._complete
    fired = threading.Event()

    def complete(self: LoadHandle, item: reads._Item, result: object) -> None:
        if not fired.is_set() and item is self._items[0]:
            fired.set()
            t = threading.Thread(target=lambda: store.invalidate(namespace=PUBLIC))
            t.start()
            t.join(WAIT)
            assert not t.is_alive()
        real(self, item, result)  # type: ignore[arg-type]

    try:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens)
        monkeypatch.setattr(LoadHandle, "_complete", complete)
        handle = store.load_async(hit, depth=2)
        got = [handle.chunk(i, timeout=WAIT) for i in range(5)]
        handle.wait(timeout=WAIT)
        assert spied and fired.is_set()
        assert got[0] is not None and np.array_equal(got[0], _chunk(kv, 0))
        assert all(g is None for g in got[1:]), "a chunk read after the invalidation was served"
    finally:
        store.close()


def test_the_store_closing_during_a_native_load_neither_hangs_nor_serves_wrong_bytes(
    tmp_path: Path, identity: ModelIdentity, spied: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, kv = prompt_kv(79, 6 * N)
    store = _disk_store(tmp_path)
    real = LoadHandle._complete
    closer: list[threading.Thread] = []

    def complete(self: LoadHandle, item: reads._Item, result: object) -> None:
        if not closer and item is self._items[1]:
            t = threading.Thread(target=store.close)
            closer.append(t)
            t.start()
            t.join(0.2)  # close begins (it waits for this load)
        real(self, item, result)  # type: ignore[arg-type]

    store.put_prompt(identity, PUBLIC, tokens, kv)
    hit = store.lookup(identity, PUBLIC, tokens)
    monkeypatch.setattr(LoadHandle, "_complete", complete)
    handle = store.load_async(hit, depth=3)
    got = []
    for i in range(6):
        try:
            got.append(handle.chunk(i, timeout=WAIT))
        except KVLifeError:
            got.append(None)
    with contextlib.suppress(KVLifeError):
        handle.wait(timeout=WAIT)
    assert closer, "the close never started"
    closer[0].join(WAIT)
    assert not closer[0].is_alive(), "close() hung under a native load"
    assert spied
    for i, g in enumerate(got):
        assert g is None or np.array_equal(g, _chunk(kv, i))


# ---------------------------------------------------------------------------- read_run itself


def _module() -> tuple[object, int]:
    loaded = native._loaded()
    assert loaded is not None
    return loaded


def _resizable(b: bytearray) -> bool:
    """A bytearray whose buffer is still exported cannot change size."""
    try:
        b.append(0)
    except BufferError:
        return False
    b.pop()
    return True


def _frame_bufs() -> list[bytearray]:
    return [bytearray(HEADER_BYTES), bytearray(4096), bytearray(b"w"), bytearray(16)]


@pytest.mark.parametrize(
    "bad, exc",
    [
        ((-1, 0, None, None, -1, None, None), ValueError),  # negative nbytes
        ((-1, 0, None, None, 4097, None, None), ValueError),  # nbytes > buffer
        ((-1, -4096, None, None, 1, None, None), ValueError),  # negative offset
        ((-1, 0, None, None, 1, None, b"\0" * 15), ValueError),  # short checksum
        ((-1, 0, None, None, 1, None, b"\0" * 17), ValueError),  # long checksum
        ((-1, 0, None, None, 1, "text", None), TypeError),  # header_want not bytes
        ((-1, 0, None, b"ro", 1, None, None), TypeError),  # read-only body
        ((-1, 0, None, None), TypeError),  # too short
        ((-1, 0, None, None, 1, None, None, 0), TypeError),  # too long
        ((-1, 2**63, None, None, 1, None, None), OverflowError),  # offset too big
        ((2**31, 0, None, None, 1, None, None), OverflowError),  # fd too big
    ],
)
def test_bad_frames_raise_and_release_every_buffer(bad: tuple[object, ...], exc: type) -> None:
    """A bad frame after a good one: a typed error, nothing read, no callback, and every
    buffer taken before it (and its own) released."""
    module, addr = _module()
    good = _frame_bufs()
    mine = _frame_bufs()
    defaults = {2: mine[0], 3: mine[1], 5: mine[2], 6: mine[3]}
    frame = tuple(defaults[j] if v is None else v for j, v in enumerate(bad))
    calls: list[int] = []
    with pytest.raises(exc):
        module.read_run(  # type: ignore[attr-defined]
            [(-1, 0, good[0], good[1], 1, good[2], good[3]), frame],
            2,
            addr,
            lambda *a: _noted(calls, a[0]),
        )
    assert calls == []
    assert all(_resizable(b) for b in good + mine)


def test_a_frame_given_as_a_list_is_a_type_error_not_a_system_error() -> None:
    """``PyArg_ParseTuple`` on an item that is not a tuple raises SystemError, the
    interpreter's "internal error" class; a frame in the wrong shape is bad input."""
    module, addr = _module()
    b = _frame_bufs()
    with pytest.raises(TypeError):
        module.read_run([[-1, 0, b[0], b[1], 1, b[2], b[3]]], 1, addr, lambda *a: True)  # type: ignore[attr-defined]
    assert all(_resizable(x) for x in b)


def test_a_bad_offset_error_names_the_offset() -> None:
    module, addr = _module()
    b = _frame_bufs()
    with pytest.raises(ValueError) as info:
        module.read_run([(-1, -4096, b[0], b[1], 1, b[2], b[3])], 1, addr, lambda *a: True)  # type: ignore[attr-defined]
    assert "offset" in str(info.value) or "-4096" in str(info.value), str(info.value)


@pytest.mark.parametrize("depth", [0, -1, 65])
def test_a_depth_out_of_range_is_refused_by_the_module(depth: int) -> None:
    module, addr = _module()
    with pytest.raises(ValueError, match="depth"):
        module.read_run([], depth, addr, lambda *a: True)  # type: ignore[attr-defined]


def test_frames_read_run_clamps_depth_and_takes_no_frames() -> None:
    assert native.read_run([], 0, lambda i, o: True) == 0
    assert native.read_run([], 10**6, lambda i, o: True) == 0


@pytest.mark.parametrize(
    "opener, want_errno",
    [
        ("bad_fd", errno.EBADF),
        ("directory", errno.EISDIR),
        ("write_only", errno.EBADF),
        ("pipe", errno.ESPIPE),
    ],
)
def test_an_unreadable_descriptor_is_a_read_error_status(
    tmp_path: Path, opener: str, want_errno: int
) -> None:
    fds: list[int] = []
    if opener == "bad_fd":
        fd = 1 << 20
    elif opener == "directory":
        fd = os.open(tmp_path, os.O_RDONLY)
        fds.append(fd)
    elif opener == "write_only":
        fd = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)
        fds.append(fd)
    else:
        r, w = os.pipe()
        fds += [r, w]
        fd = r
    try:
        frames = [
            native.FrameRead(
                fd, 0, aligned_empty(HEADER_BYTES), aligned_empty(4096), 4096, b"", b"\0" * 16
            )
            for _ in range(5)
        ]
        seen: list[native.FrameOutcome] = []
        assert native.read_run(frames, 3, lambda i, o: _noted(seen, o)) == 5
        assert [o.status for o in seen] == [native.READ_ERROR] * 5
        assert [o.errno for o in seen] == [want_errno] * 5
    finally:
        for f in fds:
            os.close(f)


def test_an_offset_past_the_end_is_truncated_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        seen: list[native.FrameOutcome] = []
        frames = [
            native.FrameRead(
                fd, off, aligned_empty(HEADER_BYTES), aligned_empty(4096), 10, b"", b"\0" * 16
            )
            for off in (1 << 40, 8192, 4096)
        ]
        assert native.read_run(frames, 2, lambda i, o: _noted(seen, o)) == 3
        assert [(o.status, o.got) for o in seen] == [
            (native.TRUNCATED, 0),
            (native.TRUNCATED, 0),
            (native.TRUNCATED, 4096),
        ]
    finally:
        os.close(fd)


def _file_of_frames(tmp_path: Path, n: int) -> tuple[int, bytes, np.ndarray]:
    data = np.arange(4096, dtype=np.uint8)
    hdr = bytes(range(256)) * 16
    (tmp_path / "frames").write_bytes((hdr + data.tobytes()) * n)
    return os.open(tmp_path / "frames", os.O_RDONLY), hdr, data


def test_a_header_shorter_than_its_want_differs_and_a_longer_want_is_not_read_past(
    tmp_path: Path,
) -> None:
    fd, hdr, data = _file_of_frames(tmp_path, 2)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    try:
        seen: list[tuple[int, ...]] = []
        frames = [
            # a header buffer of 100 bytes but 181 bytes wanted: differs (no over-read)
            (fd, 0, bytearray(100), bytearray(4096), 4096, hdr[:181], ck),
            # the wanted bytes exact, the payload in a buffer larger than it
            (fd, 8192, bytearray(4096), bytearray(8192), 4096, hdr[:181], ck),
        ]
        module, addr = _module()
        module.read_run(frames, 2, addr, lambda i, *o: _noted(seen, o))  # type: ignore[attr-defined]
        assert seen[0][0] == native.HEADER_DIFFERS
        assert seen[1][0] == native.OK
    finally:
        os.close(fd)


def test_a_callback_whose_answer_cannot_be_truth_tested_raises_it(tmp_path: Path) -> None:
    fd, hdr, data = _file_of_frames(tmp_path, 4)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    bufs = [(bytearray(4096), bytearray(4096)) for _ in range(4)]
    try:
        module, addr = _module()
        with pytest.raises(ValueError, match="ambiguous"):
            module.read_run(  # type: ignore[attr-defined]
                [(fd, i * 8192, h, b, 4096, hdr[:181], ck) for i, (h, b) in enumerate(bufs)],
                3,
                addr,
                lambda *a: np.array([True, True]),
            )
        assert all(_resizable(h) and _resizable(b) for h, b in bufs)
    finally:
        os.close(fd)


def test_a_callback_that_raises_or_stops_at_each_frame_releases_everything(
    tmp_path: Path,
) -> None:
    n = 40
    fd, hdr, data = _file_of_frames(tmp_path, n)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    module, addr = _module()
    try:
        for stop_at in range(0, n, 7):
            for how in ("raise", "false"):
                bufs = [(bytearray(4096), bytearray(4096)) for _ in range(n)]
                calls: list[int] = []

                def cb(
                    i: int,
                    status: int,
                    err: int,
                    got: int,
                    calls: list[int] = calls,
                    stop_at: int = stop_at,
                    how: str = how,
                ) -> bool:
                    calls.append(i)
                    assert status == native.OK and got == 8192
                    if i == stop_at:
                        if how == "raise":
                            raise KeyError(i)
                        return False
                    return True

                frames = [
                    (fd, i * 8192, h, b, 4096, hdr[:181], ck) for i, (h, b) in enumerate(bufs)
                ]
                if how == "raise":
                    with pytest.raises(KeyError):
                        module.read_run(frames, 8, addr, cb)  # type: ignore[attr-defined]
                else:
                    assert module.read_run(frames, 8, addr, cb) == stop_at  # type: ignore[attr-defined]
                assert calls == list(range(stop_at + 1))
                del frames
                assert all(_resizable(h) and _resizable(b) for h, b in bufs)
    finally:
        os.close(fd)


def test_a_callback_can_run_another_read_run_inside_it(tmp_path: Path) -> None:
    fd, hdr, data = _file_of_frames(tmp_path, 6)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    module, addr = _module()

    def frames() -> list[tuple[object, ...]]:
        return [
            (fd, i * 8192, bytearray(4096), bytearray(4096), 4096, hdr[:181], ck) for i in range(6)
        ]

    inner: list[int] = []

    def outer(i: int, status: int, err: int, got: int) -> bool:
        assert status == native.OK
        inner.append(module.read_run(frames(), 4, addr, lambda *a: a[1] == native.OK))  # type: ignore[attr-defined]
        return True

    try:
        assert module.read_run(frames(), 4, addr, outer) == 6  # type: ignore[attr-defined]
        assert inner == [6] * 6
    finally:
        os.close(fd)


def test_a_frame_list_mutated_by_its_callback_does_not_crash(tmp_path: Path) -> None:
    """The callback clears the very list of frames being read (and drops its own
    references to the buffers): the extension holds its buffers, the run completes."""
    fd, hdr, data = _file_of_frames(tmp_path, 10)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    module, addr = _module()
    frames = [
        (fd, i * 8192, aligned_empty(4096), aligned_empty(4096), 4096, hdr[:181], ck)
        for i in range(10)
    ]
    statuses: list[int] = []

    def cb(i: int, status: int, err: int, got: int) -> bool:
        statuses.append(status)
        frames.clear()
        return True

    try:
        assert module.read_run(frames, 4, addr, cb) == 10  # type: ignore[attr-defined]
        assert statuses == [native.OK] * 10
    finally:
        os.close(fd)


def test_the_same_buffers_for_every_frame_do_not_crash(tmp_path: Path) -> None:
    """Every frame of the run lands in one header and one body buffer (reads racing on
    them): no crash, every outcome a status, the buffers released."""
    fd, hdr, data = _file_of_frames(tmp_path, 32)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    module, addr = _module()
    h, b = bytearray(4096), bytearray(4096)
    seen: list[int] = []
    try:
        frames = [(fd, i * 8192, h, b, 4096, hdr[:181], ck) for i in range(32)]
        assert module.read_run(frames, 16, addr, lambda i, s, e, g: _noted(seen, s)) == 32  # type: ignore[attr-defined]
        assert set(seen) <= {native.OK, native.HEADER_DIFFERS, native.CHECKSUM_MISMATCH}
        assert bytes(b) == data.tobytes()
        del frames
        assert _resizable(h) and _resizable(b)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- the switch


def test_the_switch_turns_the_native_path_off_in_a_new_process(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path; import sys\n"
        "from kvlife.native import frames\n"
        "from kvlife.tiers.disk import DiskTier, DiskTierConfig\n"
        "t = DiskTier(Path(sys.argv[1]), DiskTierConfig(1 << 24, direct_io=False))\n"
        "print(frames.available(), t._reader.native()); t.close()\n"
    )
    outs = {}
    for val in ("0", "1"):
        env = {**os.environ, "KVLIFE_NATIVE": val}
        p = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / val)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outs[val] = p.stdout.split()
    assert outs["0"] == ["False", "False"]
    assert outs["1"] == ["True", "True"]


def test_a_class_level_patch_of_fileio_preadv_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``usable`` promises that a patched ``preadv`` (the tests' fault seam) sends the
    reads through it. Patching it on the FileIO class (``monkeypatch.setattr(FileIO,
    "preadv", ...)``, as common as patching an instance) must too: an injected fault
    that silently never fires makes a fault test pass without testing anything."""
    tier = _tier(tmp_path)
    try:
        keys, _ = _store(tier, [4096, 4096, 4096])
        calls: list[int] = []

        def failing(self: FileIO, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
            calls.append(offset)
            raise OSError(errno.EIO, "injected")

        monkeypatch.setattr(FileIO, "preadv", failing)
        got = tier.read_batch(keys)
        assert calls, "the patched preadv was never called: the native path bypassed it"
        assert all(isinstance(r, ReplicaReadError) for r in got)
    finally:
        monkeypatch.undo()
        tier.close()


# ---------------------------------------------------------------------------- more runs


def test_a_run_across_many_segments_with_one_cut_short(
    tmp_path: Path, paths: dict[str, bool]
) -> None:
    """Small segments: the frames of one run come from a dozen files (one fd each); one
    segment cut in the middle, a payload flipped in another: the same misses on both."""
    tier = DiskTier(
        tmp_path,
        DiskTierConfig(64 << 20, segment_bytes=16 << 10, direct_io=False, io_depth=6),
    )
    try:
        keys: list[ChunkKey] = []
        arrays: list[np.ndarray] = []
        for s in range(12):  # one put per segment-sized batch
            k, a = _store(tier, [4096, 5000], seed=40 + s)
            keys += k
            arrays += a
        segs = {tier._table.row(k).seg for k in keys}
        assert len(segs) >= 6, segs
        path, off, n = _where(tier, keys[5])
        os.truncate(path, off + HEADER_BYTES + n // 2)
        bad = {
            i
            for i, k in enumerate(keys)
            if _where(tier, k)[0] == path and _where(tier, k)[1] >= off
        }
        path2, off2, n2 = _where(tier, keys[16])
        assert path2 != path
        _flip_bit(path2, off2 + HEADER_BYTES + n2 - 1, 7)
        bad.add(16)
        order = list(range(len(keys)))[::-1] + list(range(len(keys)))  # every key twice
        ks = [keys[i] for i in order]
        arrs = [arrays[i] for i in order]
        badk = {j for j, i in enumerate(order) if i in bad}
        _assert_same_on_both(tier, paths, ks, arrs, badk, "new")
        _assert_same_on_both(tier, paths, ks, arrs, badk, "unaligned")
    finally:
        tier.close()


def test_many_python_threads_each_at_the_widest_depth(tmp_path: Path) -> None:
    """Sixteen threads call read_run at once, 64 reader threads each (a thousand
    pthreads): whatever number of them starts, every frame verifies."""
    fd, hdr, data = _file_of_frames(tmp_path, 64)
    ck = xxhash.xxh3_128_digest(data.tobytes())
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(3):
                bodies = [aligned_empty(4096) for _ in range(64)]
                frames = [
                    native.FrameRead(
                        fd, i * 8192, aligned_empty(HEADER_BYTES), b, 4096, hdr[:181], ck
                    )
                    for i, b in enumerate(bodies)
                ]
                seen: list[int] = []

                def note(i: int, o: native.FrameOutcome, s: list[int] = seen) -> bool:
                    return _noted(s, o.status)

                took = native.read_run(frames, 64, note)
                assert took == 64
                assert seen == [native.OK] * 64
                assert all(np.array_equal(b, data) for b in bodies)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 3)
        assert not any(t.is_alive() for t in threads), "a run hung"
        assert not errors, errors[0]
    finally:
        os.close(fd)


_SUBPROCESS_HEADER = """
import os, sys, resource
import numpy as np, xxhash
from kvlife.native import frames as native
mod, addr = native._loaded()
data = np.arange(4096, dtype=np.uint8); hdr = bytes(range(256)) * 16
open(sys.argv[1], "wb").write((hdr + data.tobytes()) * 16)
fd = os.open(sys.argv[1], os.O_RDONLY)
ck = xxhash.xxh3_128_digest(data.tobytes())
"""


def _run_child(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_HEADER + body, str(tmp_path / "frames")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_no_reader_thread_can_start_the_run_is_read_in_the_calling_thread(
    tmp_path: Path,
) -> None:
    """Address space limited so that no pthread stack can be mapped (pthread_create
    fails): the extension reads the run itself and every frame verifies."""
    p = _run_child(
        tmp_path,
        """
frames = [(fd, i * 8192, bytearray(4096), bytearray(4096), 4096, hdr[:181], ck) for i in range(16)]
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), resource.RLIM_INFINITY))
seen = []
n = mod.read_run(frames, 8, addr, lambda i, s, e, g: seen.append((s, g)) is None)
print(n, sorted(set(seen)), all(bytes(f[3]) == data.tobytes() for f in frames))
""",
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "16 [(0, 8192)] True", p.stdout


def test_a_frame_list_emptied_while_it_is_parsed_does_not_crash_the_process(
    tmp_path: Path,
) -> None:
    """An fd whose ``__index__`` empties the list of frames while read_run parses it
    (``PySequence_Fast`` hands back the list itself, its size read once and its items
    borrowed): the call must fail or succeed, never take the interpreter down."""
    p = _run_child(
        tmp_path,
        """
frames = []
class Evil:
    def __index__(self):
        frames.clear()
        return fd
frames.extend((Evil(), i * 8192, bytearray(4096), bytearray(4096), 4096, hdr[:181], ck)
              for i in range(64))
try:
    print("returned", mod.read_run(frames, 2, addr, lambda *a: True))
except Exception as exc:
    print("raised", type(exc).__name__)
""",
    )
    assert p.returncode == 0, f"the child died (rc {p.returncode}): {p.stderr[-500:]}"
    assert p.stdout.startswith(("returned", "raised")), p.stdout


def test_invalidations_and_new_puts_racing_native_loads_serve_only_stored_versions(
    tmp_path: Path, identity: ModelIdentity, spied: list[int]
) -> None:
    """One thread invalidates the prompt and puts it again with other KV (same keys,
    new bytes) over and over; the main thread loads it with a depth (the native run).
    Every chunk served is chunk i of a version that was stored, never anything else."""
    tokens, kv0 = prompt_kv(80, 4 * N)
    store = _disk_store(tmp_path)
    versions = [kv0]
    vlock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        v = 0
        try:
            while not stop.is_set():
                v += 1
                kv = prompt_kv(80 + v, 4 * N)[1]
                with vlock:
                    versions.append(kv)
                store.invalidate(namespace=PUBLIC)
                store.put_prompt(identity, PUBLIC, tokens, kv)
                stop.wait(0.01)  # let loads find the prompt now and then
        except BaseException as exc:
            errors.append(exc)

    try:
        store.put_prompt(identity, PUBLIC, tokens, kv0)
        t = threading.Thread(target=churn)
        t.start()
        try:
            served = 0
            deadline = time.monotonic() + 2.0
            while served < 40 and time.monotonic() < deadline:
                hit = store.lookup(identity, PUBLIC, tokens)
                if not hit.hits:
                    continue
                res = store.load_async(hit, depth=2).wait(timeout=WAIT)
                for i, a in enumerate(res.arrays):
                    with vlock:
                        known = [_chunk(v, i) for v in versions]
                    assert any(np.array_equal(a, k) for k in known), f"chunk {i}: foreign bytes"
                    served += 1
        finally:
            stop.set()
            t.join(WAIT)
        assert not t.is_alive()
        assert not errors, errors[0]
        assert spied
        # settled: the last version loads whole and exact
        res = store.load_async(store.lookup(identity, PUBLIC, tokens), depth=2).wait(timeout=WAIT)
        assert res.loaded == 4
        for i, a in enumerate(res.arrays):
            assert np.array_equal(a, _chunk(versions[-1], i))
        assert served > 0, "no load found the prompt during the churn: nothing was raced"
    finally:
        store.close()
