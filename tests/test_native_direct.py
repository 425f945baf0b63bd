"""The extension's direct runs and its one-call overlap check (issue 28).

``start_direct`` opens the segment files a served lookup named and starts reading the
frames before it returns; ``finish()`` verifies them in order and counts the leading
ones read whole and verified (``kvlife.client.direct`` keeps no more). The contract
held here against real segment files: the bytes of every counted frame are the stored
ones; a damaged payload or header, a truncated file, a file that cannot be opened
(missing, a FIFO, a link, a NUL in its name) ends the count there; buffers O_DIRECT
cannot fill are ValueError before anything is read; a run dropped, closed or finished
twice neither crashes nor reads on. ``disjoint`` is held to the exact check
(:func:`kvlife.store.overlap.shared_pair`) on arrays drawn by hypothesis.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.identity import ChunkKey
from kvlife.faults.damage import flip, scan_frames, truncate
from kvlife.native import frames as native
from kvlife.native.spans import disjoint, spans
from kvlife.store.overlap import shared_pair
from kvlife.tiers.base import ReplicaMeta, Reservation
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED, unpack_header
from tests.helpers.pieces import small_pieces

__all__ = ["small_pieces"]  # a fixture: pieces of 256 KiB in these tests

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

SIZES = [8192, 4096 * 5, 4096, 4096 * 3]


def _frames(
    tmp_path: Path, sizes: list[int] = SIZES
) -> tuple[list[native.DirectFrame], list[np.ndarray], list[bytes]]:
    """Frames of ``sizes`` (whole pages; default four small ones) stored by a real disk
    tier (closed after): each as a direct run reads it, into its own aligned buffer,
    and the payloads stored."""
    tier = DiskTier(tmp_path / "store" / "disk", DiskTierConfig(64 << 20, direct_io=False))
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    metas = [
        ReplicaMeta(ChunkKey(bytes([i]) * 30 + b"nd"), "uint8", (n,)) for i, n in enumerate(sizes)
    ]
    res = tier.prepare_store(metas)
    assert isinstance(res, Reservation)
    tier.commit_store(res, arrays)
    tier.close()
    by_key = {f.key: f for f in scan_frames(tmp_path / "store")}
    frames: list[native.DirectFrame] = []
    outs = [aligned_empty(n) for n in sizes]
    for meta, out in zip(metas, outs, strict=True):
        f = by_key[meta.key]
        with open(f.segment, "rb") as fh:
            fh.seek(f.offset)
            header = fh.read(HEADER_USED)
        h = unpack_header(header)
        frames.append((str(f.segment.absolute()), f.offset, out, h.payload_len, header, h.checksum))
    return frames, outs, [a.tobytes() for a in arrays]


def _start(frames: list[native.DirectFrame]) -> native.DirectRun:
    return native.start_direct(frames, 1)


def test_a_run_reads_and_verifies_every_frame(tmp_path: Path) -> None:
    frames, outs, stored = _frames(tmp_path)
    run = _start(frames)
    assert run.reading == len(frames)
    assert run.finish() == len(frames)
    assert [o.tobytes() for o in outs] == stored
    assert run.reading == 0
    with pytest.raises(RuntimeError, match="finished"):
        run.finish()
    run.close()  # idempotent once spent


@pytest.mark.parametrize("part", ["payload", "header"])
def test_a_damaged_frame_ends_the_count_there(tmp_path: Path, part: str) -> None:
    frames, outs, stored = _frames(tmp_path)
    path, off = frames[2][0], frames[2][1]
    flip(Path(path), off + (HEADER_BYTES + 100 if part == "payload" else 40), 1)
    assert _start(frames).finish() == 2
    assert [o.tobytes() for o in outs[:2]] == stored[:2]


def test_a_truncated_segment_ends_the_count_at_the_frame_it_cut(tmp_path: Path) -> None:
    frames, _, _ = _frames(tmp_path)
    path, off = frames[3][0], frames[3][1]
    truncate(Path(path), off + HEADER_BYTES + 10)
    assert _start(frames).finish() == 3


BIG = [8192, 8 << 20]
"""A run whose last frame is read in pieces (``read_split``, pieces of at least 256 KiB
here): 4 MiB with the header,
then 2 MiB, 1 MiB, 512 KiB, 256 KiB and 256 KiB."""


@pytest.mark.parametrize(
    "damage",
    ["none", "payload-first", "payload-edge", "payload-last", "header", "checksum", "truncate"],
)
def test_a_last_frame_read_in_pieces_counts_only_if_every_piece_verifies(
    tmp_path: Path, damage: str
) -> None:
    """The run's last frame, larger than ``SPLIT_BYTES``, is read in pieces and hashed
    as they land: a byte flipped in its first piece, on a piece's edge or in its last
    byte, a header byte, a row naming another checksum, the file cut inside it: each
    ends the count before it, as when the frame is verified whole; intact, its bytes
    are the stored ones."""
    frames, outs, stored = _frames(tmp_path, BIG)
    path, off, _, nbytes, header, _ = frames[1]
    where = {"payload-first": 0, "payload-edge": (4 << 20) - 1, "payload-last": nbytes - 1}
    if damage in where:
        flip(Path(path), off + HEADER_BYTES + where[damage], 1)
    elif damage == "header":
        flip(Path(path), off + 8, 1)
    elif damage == "checksum":
        frames[1] = (path, off, outs[1], nbytes, header, bytes(16))
    elif damage == "truncate":
        truncate(Path(path), off + HEADER_BYTES + (5 << 20))
    for _ in range(3):  # until the caller reached the big frame while it was being read
        before = native.streamed()
        assert _start(frames).finish() == (2 if damage == "none" else 1)
        assert outs[0].tobytes() == stored[0]
        if damage == "none":
            assert outs[1].tobytes() == stored[1]
        if native.streamed() == before + 1:
            break
    else:
        raise AssertionError("three runs and the 8 MiB frame was never verified as it landed")


@pytest.mark.parametrize("damage", ["none", "payload-last", "header"])
def test_progress_tells_the_landed_bytes_of_a_frame_read_in_pieces_before_it_verified(
    tmp_path: Path, damage: str
) -> None:
    """``progress(at_least)``: bytes of the next frame to step that landed and were
    hashed (the stored ones), at least ``at_least`` while it is read, not yet verified:
    ``step()`` still decides. All of a frame read whole once it landed; 0 for a frame
    whose header differs (nothing of it is worth copying); a damaged last byte is told
    as landed, then fails its step."""
    frames, outs, stored = _frames(tmp_path, BIG)
    path, off, _, nbytes, _, _ = frames[1]
    if damage == "payload-last":
        flip(Path(path), off + HEADER_BYTES + nbytes - 1, 1)
    elif damage == "header":
        flip(Path(path), off + 8, 1)
    for _ in range(3):  # until frame 1 was still being read when asked
        run = _start(frames)
        assert run.progress(1) == 8192  # frame 0 is read whole: all of it once it landed
        assert outs[0].tobytes() == stored[0]
        assert run.step()
        got = run.progress(1)
        if got == 0 and damage != "header":
            run.close()  # it landed before it was asked for: verified whole by step
            continue
        if damage == "header":
            assert got == 0
            assert not run.step()
            assert run.finish() == 1
            return
        assert 0 < got <= nbytes
        assert outs[1].tobytes()[:got] == stored[1][:got]
        more = run.progress(min(nbytes, got + 1))
        # more landed; or its read ended meanwhile and it was verified: 0 if it failed
        assert got <= more <= nbytes or (damage != "none" and more == 0)
        assert run.step() is (damage == "none")
        assert run.finish() == (2 if damage == "none" else 1)
        if damage == "none":
            assert outs[1].tobytes() == stored[1]
        with pytest.raises(RuntimeError, match="finished"):
            run.progress(1)
        break
    else:
        raise AssertionError("three runs and frame 1 had always landed when asked")
    run = _start(frames)
    with pytest.raises(ValueError, match="at least one byte"):
        run.progress(0)
    run.close()


@pytest.mark.parametrize("damage", ["none", "payload", "header", "truncate"])
def test_progress_of_a_frame_read_whole_is_all_of_it_once_landed_unless_its_read_failed(
    tmp_path: Path, damage: str
) -> None:
    """A frame read whole (not split): ``progress`` says all of its payload once it
    landed whole with the row's header, 0 where its header differs or the file ends
    inside it. A damaged payload byte is all of it while the frame is not hashed yet
    (``progress`` does not hash a frame read whole), 0 once a reader thread hashed it
    and found it damaged (the reader checks the frames that landed once it has nothing
    left to read): either way ``step`` says it did not verify."""
    frames, outs, stored = _frames(tmp_path)
    path, off, _, nbytes, _, _ = frames[1]
    if damage == "payload":
        flip(Path(path), off + HEADER_BYTES + 5, 1)
    elif damage == "header":
        flip(Path(path), off + 8, 1)
    elif damage == "truncate":
        truncate(Path(path), off + HEADER_BYTES + 10)
    run = _start(frames)
    assert run.step()
    got = run.progress(1)
    if damage == "payload":
        assert got in (0, nbytes)
    else:
        assert got == (0 if damage in ("header", "truncate") else nbytes)
    if damage == "none":
        assert outs[1].tobytes() == stored[1]
    assert run.step() is (damage == "none")
    run.close()


def test_the_header_must_be_the_named_one_byte_for_byte(tmp_path: Path) -> None:
    frames, _, _ = _frames(tmp_path)
    p, off, out, n, header, checksum = frames[1]
    frames[1] = (p, off, out, n, header[:-1] + bytes([header[-1] ^ 1]), checksum)
    assert _start(frames).finish() == 1
    frames, _, _ = _frames(tmp_path / "again")
    p, off, out, n, header, checksum = frames[0]
    frames[0] = (p, off, out, n, header, bytes(16))  # another checksum
    assert _start(frames).finish() == 0


@pytest.mark.parametrize("kind", ["missing", "fifo", "symlink", "nul", "directory"])
def test_a_file_that_cannot_be_opened_as_a_regular_file_ends_the_count(
    tmp_path: Path, kind: str
) -> None:
    frames, _, _ = _frames(tmp_path)
    real = frames[0][0]
    other = tmp_path / f"other-{kind}"
    if kind == "fifo":
        os.mkfifo(other)  # a reader opened without O_NONBLOCK would wait for a writer
    elif kind == "symlink":
        os.symlink(real, other)
    elif kind == "directory":
        other.mkdir()
    name = str(other) + ("\0x" if kind == "nul" else "")
    for i in (2, 3):
        frames[i] = (name, *frames[i][1:])
    run = _start(frames)
    assert run.reading == 2
    assert run.finish() == 2


@pytest.mark.parametrize("fault", ["unaligned", "strided", "read-only", "offset", "short"])
def test_buffers_and_offsets_o_direct_cannot_take_are_refused_before_a_read(
    tmp_path: Path, fault: str
) -> None:
    frames, outs, _ = _frames(tmp_path)
    p, off, out, n, header, checksum = frames[1]
    if fault == "unaligned":
        out = aligned_empty(out.nbytes + 4096)[8 : 8 + out.nbytes]
    elif fault == "strided":
        out = aligned_empty(2 * out.nbytes)[::2]
    elif fault == "read-only":
        out = aligned_empty(out.nbytes)
        out.flags.writeable = False
    elif fault == "offset":
        off += 512
    else:
        n = out.nbytes + 1
    frames[1] = (p, off, out, n, header, checksum)
    outs[0][:] = 0xAB
    with pytest.raises(ValueError, match="frame 1"):
        _start(frames)
    assert (outs[0] == 0xAB).all()  # nothing was read


def test_a_run_dropped_or_closed_unfinished_ends_its_reads_and_lets_go(tmp_path: Path) -> None:
    frames, outs, stored = _frames(tmp_path)
    run = _start(frames)
    del run  # its reads end before the collector lets go of the buffers
    gc.collect()
    run = _start(frames)
    run.close()
    run.close()
    with pytest.raises(RuntimeError):
        run.finish()
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        _start(frames).close()
        _start(frames)  # dropped unfinished: joined and closed by the collector
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds  # no descriptor left open
    assert _start(frames).finish() == len(frames)
    assert [o.tobytes() for o in outs] == stored


def test_an_empty_run_counts_nothing() -> None:
    run = native.start_direct([], 1)
    assert run.reading == 0
    assert run.step() is False
    assert run.finish() == 0


@settings(max_examples=40, deadline=None)
@given(
    damaged=st.one_of(st.none(), st.integers(0, len(SIZES) - 1)),
    part=st.sampled_from(["payload", "header"]),
    steps=st.integers(0, len(SIZES) + 2),
    depth=st.integers(1, 3),
)
def test_steps_verify_in_order_and_finish_counts_on_from_them(
    tmp_path_factory: pytest.TempPathFactory,
    damaged: int | None,
    part: str,
    steps: int,
    depth: int,
) -> None:
    """``step()`` says True for each frame in order that verified, False from the first
    damaged one on (and once every frame was stepped); ``finish()`` after any number of
    steps counts the same leading frames as a run never stepped, and the bytes of each
    counted frame are the stored ones."""
    frames, outs, stored = _frames(tmp_path_factory.mktemp("steps"))
    good = len(frames)
    if damaged is not None:
        path, off = frames[damaged][0], frames[damaged][1]
        flip(Path(path), off + (HEADER_BYTES + 100 if part == "payload" else 40), 1)
        good = damaged
    run = native.start_direct(frames, depth)
    said = [run.step() for _ in range(steps)]
    assert said == [i < good for i in range(steps)]
    assert run.finish() == good
    assert [o.tobytes() for o in outs[:good]] == stored[:good]
    with pytest.raises(RuntimeError, match="finished"):
        run.step()


_shapes = st.tuples(st.integers(1, 6), st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 40),  # start element in one base buffer
            _shapes,
            st.sampled_from(["c", "t", "step", "ro"]),
        ),
        min_size=0,
        max_size=5,
    ),
    st.booleans(),
)
def test_disjoint_says_true_only_when_the_exact_check_finds_no_shared_byte(
    picks: list[tuple[int, tuple[int, int], str]], separate: bool
) -> None:
    base = np.zeros(200, np.uint16)
    arrays: list[np.ndarray] = []
    for start, (a, b), kind in picks:
        src = np.zeros(200, np.uint16) if separate else base
        arr = src[start : start + a * b].reshape(a, b)
        if kind == "t":
            arr = arr.T
        elif kind == "step":
            arr = src[start : start + 2 * a * b : 2].reshape(a, b)
        elif kind == "ro":
            arr = arr.view()
            arr.flags.writeable = False
        arrays.append(arr)
    got = disjoint(arrays)
    exact_free = shared_pair(arrays, spans(arrays)) is None
    all_fit = all(a.flags.writeable and a.flags.c_contiguous for a in arrays)
    if got:
        assert exact_free and all_fit
    elif exact_free and all_fit:
        pytest.fail(f"disjoint refused buffers that share no byte: {arrays!r}")
