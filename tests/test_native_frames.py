"""The disk tier's reads of a run of frames through the C extension (issue 28).

``kvlife.native._frames`` reads and verifies a run of frames outside the interpreter
lock; the Python path (``Reader._land`` / ``_check``) is the reference. The contract:
for every frame, intact or damaged on disk (a payload byte, a header byte, a truncated
segment), both paths hand out the same thing: the same bytes, or the same kind of
typed miss with the same message; a run stops where its callback says; an exception
in it is raised after the reads in flight ended; a row deleted or replaced while a
run is read is not handed out. Damage is done to the real segment files.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlife.core.errors import ChecksumMismatch, ReplicaReadError
from kvlife.core.identity import ChunkKey
from kvlife.faults.damage import flip, truncate
from kvlife.native import frames as native
from kvlife.tiers.base import ReadResult, ReplicaMeta, Reservation
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk import DiskTier, DiskTierConfig, native_reads
from kvlife.tiers.disk import reader as reader_mod
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED
from tests.helpers.pieces import PIECE, SPLIT, small_pieces

T = TypeVar("T")

__all__ = ["small_pieces"]  # a fixture: pieces of 256 KiB in these tests

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLIFE_NATIVE") == "0", reason="KVLIFE_NATIVE=0: the extension is off"
)


def test_the_extension_is_built_and_checked() -> None:
    """``make`` builds it (setup.py): a machine without a C compiler reads through the
    Python path, and this test says so rather than letting every other one pass on it."""
    assert native.available(), (
        "kvlife.native._frames was not built or failed its check against xxhash "
        "(a C compiler is needed at install time: pip install -e . builds it)"
    )


def test_a_native_batch_keeps_its_share_of_io_depth_between_one_and_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads in flight of a native ``read_batch`` (issue 28, measured in reader.py's
    BATCH_DEPTH): a caller alone keeps two however large ``io_depth`` is (not all its
    frames at once), one at ``io_depth`` 1, and with four callers reading at once each
    keeps one; the bytes are the stored ones at every depth."""
    depths: list[int] = []
    real = native_reads.read_frames

    def spy(*args: object) -> None:
        depths.append(args[6])  # type: ignore[arg-type]
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(reader_mod, "read_frames", spy)
    for io_depth, want in ((4, 2), (8, 2), (2, 2), (1, 1)):
        tier = _tier(tmp_path / f"d{io_depth}", io_depth=io_depth)
        try:
            keys, arrays = _stored(tier, [4096, 8192, 4096, 12288])
            depths.clear()
            got = tier.read_batch(keys, [np.empty_like(a) for a in arrays])
            assert all(np.array_equal(g, a) for g, a in zip(got, arrays, strict=True))  # type: ignore[arg-type]
            assert depths == [want], (io_depth, depths)
        finally:
            tier.close()
    tier = _tier(tmp_path / "four", io_depth=4)
    try:
        keys, arrays = _stored(tier, [4096] * 6)
        tier._reader._callers += 3  # three other callers in their reads meanwhile
        depths.clear()
        got = tier.read_batch(keys, None)
        assert depths == [1]
        assert all(np.array_equal(g, a) for g, a in zip(got, arrays, strict=True))  # type: ignore[arg-type]
        tier._reader._callers -= 3
    finally:
        tier.close()


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000))
def test_the_hash_address_hashes_as_xxhash(data: bytes) -> None:
    loaded = native._loaded()
    assert loaded is not None
    module, addr = loaded
    assert module.xxh3_128(data, addr) == xxhash.xxh3_128_digest(data)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.integers(1, 6000))
def test_the_streaming_hash_hashes_as_xxhash_in_pieces_of_any_size(data: bytes, piece: int) -> None:
    """The streaming xxh3-128 a split frame is verified with (set from the same xxhash
    extension, checked at load): the digest of the bytes fed piece by piece is
    xxhash's digest of them whole, for any piece size."""
    module = native.native_module()
    assert module is not None
    assert module.xxh3_128_stream(data, piece) == xxhash.xxh3_128_digest(data)


def test_the_streaming_hash_is_set_whole_or_not_at_all() -> None:
    """``set_stream`` takes five addresses or five zeros (a partial set would call a
    null function in a run); a run started without it verifies every frame whole."""
    module = native.native_module()
    assert module is not None
    addrs = native._stream_addresses()
    assert addrs is not None, "the xxhash extension exports no streaming xxh3-128"
    with pytest.raises(ValueError, match="five"):
        module.set_stream(addrs[0], 0, 0, 0, 0)
    try:
        module.set_stream(0, 0, 0, 0, 0)
        with pytest.raises(ValueError, match="no streaming"):
            module.xxh3_128_stream(b"abc", 1)
    finally:
        module.set_stream(*addrs)
    with pytest.raises(ValueError, match="piece"):
        module.xxh3_128_stream(b"abc", 0)


def _tier(path: Path, io_depth: int = 4) -> DiskTier:
    return DiskTier(path, DiskTierConfig(64 << 20, direct_io=False, io_depth=io_depth))


def _stored(
    tier: DiskTier, sizes: list[int], seed: int = 0
) -> tuple[list[ChunkKey], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    metas = [
        ReplicaMeta(ChunkKey(bytes([seed % 256, i % 256, i // 256]) * 10 + b"nf"), "uint8", (n,))
        for i, n in enumerate(sizes)
    ]
    res = tier.prepare_store(metas)
    assert isinstance(res, Reservation)
    tier.commit_store(res, arrays)
    return [m.key for m in metas], arrays


def _segment_path(tier: DiskTier, key: ChunkKey) -> tuple[Path, int, int]:
    row = tier._table.row(key)
    seg = tier._table.segments[row.seg]
    return seg.path, row.off, row.nbytes


@pytest.fixture
def both_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bool]]:
    """A switch between the two paths of one tier (``state["native"]``)."""
    state = {"native": True}
    usable = native_reads.usable
    monkeypatch.setattr(reader_mod, "usable", lambda io: state["native"] and usable(io))
    yield state


def _note(into: list[T], item: T) -> bool:
    into.append(item)
    return True


def _kind(r: ReadResult) -> tuple[str, str]:
    if isinstance(r, np.ndarray):
        return ("array", r.tobytes().hex()[:64] + str(r.nbytes))
    return (type(r).__name__, str(r))


DAMAGE = ["none", "payload", "header", "padding", "truncate"]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    sizes=st.lists(st.integers(0, 3 * 4096 + 7), min_size=2, max_size=6),
    damage=st.lists(st.sampled_from(DAMAGE), min_size=6, max_size=6),
    where=st.integers(0, 1 << 30),
    into_buffers=st.booleans(),
)
@example(sizes=[0, 0], damage=["none", "truncate"] + ["none"] * 4, where=0, into_buffers=False)
def test_both_paths_hand_out_the_same(
    tmp_path_factory: pytest.TempPathFactory,
    both_paths: dict[str, bool],
    sizes: list[int],
    damage: list[str],
    where: int,
    into_buffers: bool,
) -> None:
    """Random runs with random damage on disk: the native and the Python path return the
    same arrays and the same typed misses (same messages); damage never comes back as
    an array, and the intact frames come back whole."""
    tier = _tier(tmp_path_factory.mktemp("nf"))
    try:
        keys, arrays = _stored(tier, sizes, seed=where % 251)
        damaged: set[int] = set()
        truncated_at: int | None = None
        for i, key in enumerate(keys):
            path, off, nbytes = _segment_path(tier, key)
            what = damage[i]
            if what == "payload" and nbytes:
                flip(path, off + HEADER_BYTES + where % nbytes, 1)
                damaged.add(i)
            elif what == "header":
                flip(path, off + where % HEADER_USED, 1)
                damaged.add(i)
            elif what == "padding" and nbytes % 4096:
                flip(path, off + HEADER_BYTES + nbytes, 1)  # outside the payload: harmless
            elif what == "truncate" and truncated_at is None and i == len(keys) - 1:
                truncated_at = off + (HEADER_BYTES + nbytes) // 2  # into the frame
                truncate(path, truncated_at)
                damaged.add(i)
        got: dict[bool, list[tuple[str, str]]] = {}
        for native_on in (True, False):
            both_paths["native"] = native_on
            assert tier._reader.native() is native_on
            outs = [np.zeros(n, np.uint8) for n in sizes] if into_buffers else None
            res = tier.read_batch(keys, outs)
            for i, r in enumerate(res):
                if i in damaged:
                    assert isinstance(r, ChecksumMismatch), (i, damage[i], r)
                else:
                    assert isinstance(r, np.ndarray) and np.array_equal(r, arrays[i]), (i, r)
                    if not into_buffers:
                        assert not r.flags.writeable
            got[native_on] = [_kind(r) for r in res]
        assert got[True] == got[False]
    finally:
        tier.close()


SPLIT_DAMAGE = ["none", "payload", "header", "padding", "truncate"]


@pytest.fixture
def streaming() -> Iterator[Callable[[bool], None]]:
    """Turn the extension's streaming hash off and on (on again after the test)."""
    module = native.native_module()
    addrs = native._stream_addresses()
    assert module is not None and addrs is not None

    def switch(on: bool) -> None:
        module.set_stream(*(addrs if on else (0, 0, 0, 0, 0)))

    yield switch
    switch(True)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    first=st.integers(0, 3 * 4096),
    last=st.integers(SPLIT + 1, 3 * SPLIT + 4095),
    damage=st.sampled_from(SPLIT_DAMAGE),
    where=st.integers(0, 1 << 30),
)
@example(first=4096, last=SPLIT + 1, damage="payload", where=SPLIT)
@example(first=0, last=3 * SPLIT, damage="truncate", where=0)
@example(first=0, last=3 * SPLIT, damage="payload", where=768 << 10)  # piece 2
@example(first=0, last=3 * SPLIT, damage="payload", where=(768 << 10) - 1)
@example(first=0, last=3 * SPLIT, damage="payload", where=3 * SPLIT - 1)
def test_a_last_frame_read_in_pieces_is_handed_out_as_the_python_path_hands_it_out(
    tmp_path_factory: pytest.TempPathFactory,
    both_paths: dict[str, bool],
    streaming: Callable[[bool], None],
    first: int,
    last: int,
    damage: str,
    where: int,
) -> None:
    """A run's last frame larger than ``SPLIT_BYTES`` is read in pieces and hashed as
    they land (``read_split``, ``stream_check``): damaged anywhere in any piece (a
    payload byte, on either side of a piece's edge too, a header byte, the file cut
    inside it) it is the same typed miss as the Python path's and as the native path's
    without the streaming hash; intact or damaged only in its padding, the same bytes."""
    tier = _tier(tmp_path_factory.mktemp("split"), io_depth=2)
    try:
        keys, arrays = _stored(tier, [first, last], seed=where % 251)
        path, off, nbytes = _segment_path(tier, keys[1])
        bad = damage not in ("none", "padding")
        if damage == "payload":
            flip(path, off + HEADER_BYTES + where % nbytes, 1)
        elif damage == "header":
            flip(path, off + where % HEADER_USED, 1)
        elif damage == "padding" and nbytes % 4096:
            flip(path, off + HEADER_BYTES + nbytes, 1)
        elif damage == "truncate":
            truncate(path, off + HEADER_BYTES + where % nbytes)
        got = []
        for native_on, stream_on in ((True, True), (True, False), (False, False)):
            both_paths["native"] = native_on
            streaming(stream_on)
            res = tier.read_batch(keys, [np.zeros(first, np.uint8), np.zeros(last, np.uint8)])
            assert isinstance(res[0], np.ndarray) and np.array_equal(res[0], arrays[0])
            if bad:
                assert isinstance(res[1], ChecksumMismatch), (damage, res[1])
            else:
                assert isinstance(res[1], np.ndarray) and np.array_equal(res[1], arrays[1])
            got.append([_kind(r) for r in res])
        assert got[0] == got[1] == got[2]
    finally:
        tier.close()


@pytest.mark.parametrize("piece", [PIECE, native.DEFAULT_PIECE], ids=["small", "default"])
def test_a_runs_large_last_frame_is_verified_as_its_pieces_land(tmp_path: Path, piece: int) -> None:
    """The streaming path is the one taken: a run whose last frame is several pieces
    (the caller reaches it while it is still being read) counts as streamed, and the
    frames come back whole; a run of frames of at most two pieces streams none. With
    the pieces these tests use and with the extension's default (2 MiB: frames of up
    to 4 MiB read whole)."""
    native.set_piece(piece)  # the fixture sets the default back after the test
    tier = _tier(tmp_path / "t", io_depth=2)
    try:
        keys, arrays = _stored(tier, [4096, max(8 << 20, 4 * piece)])
        before = native.streamed()
        # streamed when the caller reaches the last frame while it is still being read:
        # a caller that a busy machine keeps off the CPU until the read is done checks
        # it whole instead (one CI run on 2026-12-06 did so three times in a row)
        for _ in range(30):
            res = tier.read_batch(keys, None)
            assert all(np.array_equal(r, a) for r, a in zip(res, arrays, strict=True))  # type: ignore[arg-type]
            if native.streamed() > before:
                break
        assert native.streamed() > before
        small, small_arrays = _stored(tier, [4096, 2 * piece], seed=3)
        before = native.streamed()
        res = tier.read_batch(small, None)
        assert all(np.array_equal(r, a) for r, a in zip(res, small_arrays, strict=True))  # type: ignore[arg-type]
        assert native.streamed() == before
    finally:
        tier.close()


def test_the_piece_is_whole_pages_of_at_least_64_kib() -> None:
    """``set_piece`` refuses a size that is not whole pages or below 64 KiB (nothing
    changed), and returns the size it replaced."""
    assert native.set_piece(PIECE) == PIECE  # the fixture's
    for bad in (0, -4096, 4096, (64 << 10) - 4096, (64 << 10) + 1, 1 << 40 | 1):
        with pytest.raises(ValueError, match="multiple of 4096"):
            native.set_piece(bad)
    assert native.set_piece(64 << 10) == PIECE
    assert native.set_piece(native.DEFAULT_PIECE) == 64 << 10


def test_a_read_error_is_a_typed_miss_naming_the_errno(tmp_path: Path) -> None:
    """A frame whose read fails (its fd closed under the tier) is READ_ERROR with the
    errno, made a ReplicaReadError; the other frames of the run still verify."""
    hdrs = aligned_empty(HEADER_BYTES * 2)
    body = aligned_empty(4096)
    data = np.arange(4096, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * HEADER_BYTES + data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    frames = [
        native.FrameRead(-1, 0, hdrs[:HEADER_BYTES], aligned_empty(4096), 4096, b"", b"\0" * 16),
        native.FrameRead(
            fd,
            0,
            hdrs[HEADER_BYTES:],
            body,
            4096,
            b"\0" * 64,
            xxhash.xxh3_128_digest(bytes(data)),
        ),
    ]
    seen: list[native.FrameOutcome] = []
    try:
        assert native.read_run(frames, 2, lambda i, o: _note(seen, o)) == 2
    finally:
        os.close(fd)
    assert seen[0].status == native.READ_ERROR and seen[0].errno == errno.EBADF
    assert seen[1].status == native.OK and np.array_equal(body, data)


def test_a_run_stops_where_its_callback_says_and_raises_what_it_raised(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = np.arange(4096, dtype=np.uint8)
    path.write_bytes((b"\0" * HEADER_BYTES + data.tobytes()) * 8)
    fd = os.open(path, os.O_RDONLY)
    ck = xxhash.xxh3_128_digest(bytes(data))
    hdrs = aligned_empty(HEADER_BYTES * 8)

    def run() -> list[native.FrameRead]:
        return [
            native.FrameRead(
                fd,
                i * 2 * 4096,
                hdrs[i * 4096 : (i + 1) * 4096],
                aligned_empty(4096),
                4096,
                b"",
                ck,
            )
            for i in range(8)
        ]

    try:
        calls: list[int] = []
        assert native.read_run(run(), 3, lambda i, o: _note(calls, i) and i < 2) == 2
        assert calls == [0, 1, 2]  # frame 2 refused: the run ended there

        def boom(i: int, o: native.FrameOutcome) -> bool:
            if i == 4:
                raise KeyError("from the callback")
            return True

        with pytest.raises(KeyError, match="from the callback"):
            native.read_run(run(), 2, boom)
    finally:
        os.close(fd)


def test_frames_that_do_not_fit_their_buffers_are_refused(tmp_path: Path) -> None:
    hdr = aligned_empty(HEADER_BYTES)
    body = aligned_empty(4096)
    ok = [native.FrameRead(-1, 0, hdr, body, 4096, b"", b"\0" * 16)]
    with pytest.raises(ValueError, match="payload of 4097 bytes in a buffer of 4096"):
        native.read_run(
            [native.FrameRead(-1, 0, hdr, body, 4097, b"", b"\0" * 16)], 1, lambda *_: True
        )
    with pytest.raises(ValueError, match="checksum of 15 bytes"):
        native.read_run(
            [native.FrameRead(-1, 0, hdr, body, 10, b"", b"\0" * 15)], 1, lambda *_: True
        )
    with pytest.raises(TypeError):  # a read-only buffer cannot be read into
        native.read_run(
            [
                native.FrameRead(
                    -1, 0, hdr, np.frombuffer(bytes(4096), np.uint8), 1, b"", b"\0" * 16
                )
            ],
            1,
            lambda *_: True,
        )
    with pytest.raises(TypeError, match="on_frame must be callable"):
        native.read_run(ok, 1, None)  # type: ignore[arg-type]


def test_read_pipelined_hands_out_no_frame_whose_row_was_deleted_during_the_run(
    tmp_path: Path,
) -> None:
    """Frame 0's ``done`` deletes frame 2's replica (an invalidation racing the load):
    frames 0 and 1 are handed out, frame 2 and the rest are not (the caller reads them
    one at a time and finds them gone), whatever the reads had landed meanwhile."""
    tier = _tier(tmp_path)
    try:
        assert tier._reader.native()
        keys, arrays = _stored(tier, [8192] * 5)
        handed: dict[int, ReadResult] = {}

        def done(i: int, res: ReadResult) -> None:
            handed[i] = res
            if i == 0:
                tier.delete(keys[2])

        outs: list[np.ndarray | None] = [None] * 5
        assert tier.read_pipelined(keys, outs, done) == 2
        assert sorted(handed) == [0, 1]
        for i in (0, 1):
            r = handed[i]
            assert isinstance(r, np.ndarray) and np.array_equal(r, arrays[i])
    finally:
        tier.close()


def test_read_pipelined_raises_what_a_done_raised_after_handing_out_the_rest(
    tmp_path: Path,
) -> None:
    tier = _tier(tmp_path)
    try:
        keys, _ = _stored(tier, [4096] * 4)
        handed: list[int] = []

        def done(i: int, res: ReadResult) -> None:
            handed.append(i)
            if i == 1:
                raise RuntimeError("a done that fails")

        with pytest.raises(RuntimeError, match="a done that fails"):
            tier.read_pipelined(keys, [None] * 4, done)
        assert handed == [0, 1, 2, 3]
    finally:
        tier.close()


def test_many_threads_read_the_same_run_at_once(tmp_path: Path) -> None:
    """Eight threads, each reading the same twelve frames (half into its own buffers)
    many times: every result is the stored bytes."""
    tier = _tier(tmp_path)
    errors: list[BaseException] = []
    try:
        keys, arrays = _stored(tier, [4096 * (1 + i % 3) for i in range(12)])

        def reader(t: int) -> None:
            try:
                for r in range(20):
                    outs = [np.empty_like(a) if (t + r) % 2 else None for a in arrays]
                    for got, want in zip(tier.read_batch(keys, outs), arrays, strict=True):
                        assert isinstance(got, np.ndarray) and np.array_equal(got, want)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors[0]
    finally:
        tier.close()


def test_a_frame_read_into_an_unaligned_buffer_is_staged_and_copied(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    try:
        assert tier._reader.native()
        keys, arrays = _stored(tier, [8192, 5000, 4096])
        raw = [np.zeros(a.nbytes + 1, np.uint8) for a in arrays]
        outs = [r[1:] for r in raw]  # one byte off any alignment
        got = tier.read_batch(keys, outs)
        for g, o, a in zip(got, outs, arrays, strict=True):
            assert g is o and np.array_equal(o, a)
    finally:
        tier.close()


def test_a_read_error_on_the_native_path_is_a_replica_read_error(tmp_path: Path) -> None:
    """The segment's fd closed under the tier (as a failing device would): every frame
    of the run is a ReplicaReadError naming the errno, none an array."""
    tier = _tier(tmp_path)
    try:
        keys, _ = _stored(tier, [4096, 4096])
        seg = tier._table.segments[tier._table.row(keys[0]).seg]
        saved = os.dup(seg.fd)
        os.close(seg.fd)
        try:
            got = tier.read_batch(keys)
        finally:
            os.dup2(saved, seg.fd)
            os.close(saved)
        for r in got:
            assert isinstance(r, ReplicaReadError) and "Bad file descriptor" in str(r)
    finally:
        tier.close()


def test_a_run_started_from_inside_another_run_reads_into_headers_of_its_own(
    tmp_path: Path,
) -> None:
    """A thread's runs share one buffer of frame headers (issue 28: one aligned
    allocation per thread, not per run), but a run started from inside another run's
    callback on the same thread (a ``take`` that reads again) gets one of its own: its
    headers never land over those of the outer run's frames still being read and
    checked, which would turn intact frames into misses. Both runs hand out every frame
    whole; a thread's next run reuses the buffer; a run longer than the buffer kept
    gets one of its own."""
    tier = _tier(tmp_path / "t", io_depth=2)
    try:
        outer_keys, outer = _stored(tier, [4096, 8192, 4096, 12288, 4096], seed=1)
        inner_keys, inner = _stored(tier, [8192, 4096, 4096, 4096, 8192], seed=2)
        table = tier._table
        reader = tier._reader

        def run(keys: list[ChunkKey], take: Callable[[int, ReadResult], bool]) -> int:
            rows = [table.row(k) for k in keys]
            with table.lock:
                pinned = table.pin_rows(rows)
            try:
                return native_reads.read_frames(
                    rows,
                    [pinned[r.seg] for r in rows],
                    [None] * len(rows),
                    [None] * len(rows),
                    [aligned_empty(-(-r.nbytes // 4096) * 4096) for r in rows],
                    reader._staging,
                    1,
                    [],
                    reader._where,
                    take,
                )
            finally:
                with table.lock:
                    table.unpin(pinned.values())

        got_outer: list[ReadResult] = []
        got_inner: list[ReadResult] = []
        buffers: list[int] = []

        def take_outer(i: int, res: ReadResult) -> bool:
            got_outer.append(res)
            if i == 0:  # the outer run's later frames are being read and checked now
                buffers.append(id(native_reads._local.headers))
                assert run(inner_keys, lambda _, r: _note(got_inner, r)) == len(inner_keys)
            return True

        assert run(outer_keys, take_outer) == len(outer_keys)
        for got, want in ((got_outer, outer), (got_inner, inner)):
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert isinstance(g, np.ndarray) and np.array_equal(g, w), g
        assert run(inner_keys, lambda _, r: True) == len(inner_keys)
        assert id(native_reads._local.headers) == buffers[0]  # reused, not reallocated
        # the rule itself, which the runs above need not race into: a nested run's room
        # shares no byte with the outer one's
        with native_reads.headers(3) as outer_room, native_reads.headers(3) as nested:
            assert not np.shares_memory(outer_room, nested)
            assert outer_room is native_reads._local.headers
        many = native_reads.KEPT_HEADERS + 1
        more_keys, more = _stored(tier, [4096] * many, seed=3)
        got_more: list[ReadResult] = []
        assert run(more_keys, lambda _, r: _note(got_more, r)) == many
        assert all(np.array_equal(g, w) for g, w in zip(got_more, more, strict=True))  # type: ignore[arg-type]
        assert id(native_reads._local.headers) == buffers[0]  # not grown past the bound
    finally:
        tier.close()
