"""Red team of the split last frame (commit af50da6): a run's last frame larger than
``SPLIT_BYTES`` is read in pieces (``read_split`` in ``kvlife/native/_frames.c``) and the
caller that reaches it while it is still being read hashes each landed piece with
xxhash's streaming xxh3-128 (``stream_check``), comparing the digest once it landed.

The promise attacked: the outcome of every frame is what verifying it whole gives (OK
only when the header bytes are the row's, the payload's xxh3-128 is the row's checksum
and the file held the whole frame), and an OK frame's buffer holds exactly the bytes
that were hashed; never a crash, a hang or a leak. The reference is computed here in
Python from the bytes on disk (:func:`_expect`), independently of the extension, and
for the disk tier the Python read path (``both_paths``).

Attacked, with real files:

- every size edge (``SPLIT_BYTES`` - 1, exactly, + 1, odd payloads, payload 0 or 1 byte
  in a body of a MiB, a body longer than the payload or not whole pages), each piece's
  edges damaged, the header inside and outside the row's bytes, the checksum, the file
  cut before the header ends, at and inside every piece, at the payload's end; on
  ``read_run`` and on direct runs, at several depths, with the streaming hash on and off,
  into buffers that already hold the right bytes (a hash of bytes not landed yet would
  vouch for them) or junk;
- damage timed while the last frame is read: a byte toggled in the file, the file cut
  and regrown, the payload rewritten with another put's, the descriptor re-pointed
  (``dup2``) at a decoy file between pieces;
- many runs at once in threads, ``depth`` 1..8 with up to 16 frames; the streaming hash
  switched off and on meanwhile; no thread or descriptor left;
- direct runs: ``step()`` then ``finish()`` in every split, ``close()`` from another
  thread while a step streams, runs dropped or collected with pieces in flight, the
  segment file unlinked or replaced after ``start_direct`` opened it;
- ``read_run``'s callback raising (KeyboardInterrupt too), returning False, or starting
  a run of its own while the last frame's pieces land;
- ``set_stream``'s documented validation (a refused partial set leaves the functions
  that were set);
- end to end, an embedded ``KVStore`` with 2 MiB chunks loaded by threads while another
  invalidates, puts again with other KV, and damages the last chunk's frame in place.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvlife.core.errors import ChecksumMismatch, KVLifeError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.native import frames as native
from kvlife.results import LoadResult
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk import DiskTier
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.helpers.pieces import PIECE, SPLIT, small_pieces
from tests.test_native_frames import _segment_path, _stored, _tier, both_paths, streaming

__all__ = ["both_paths", "small_pieces", "streaming"]  # fixtures used here

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLIFE_NATIVE") == "0" or not native.available(),
    reason="the native extension is off or not built",
)

PAGE = 4096
WANT = 96
"""Bytes of a frame's header the row names (the rest of the page is not compared)."""
OK, HEADER_DIFFERS, CHECKSUM_MISMATCH, TRUNCATED = (
    native.OK,
    native.HEADER_DIFFERS,
    native.CHECKSUM_MISMATCH,
    native.TRUNCATED,
)
MISSES = {HEADER_DIFFERS, CHECKSUM_MISMATCH, TRUNCATED}

Outcome = tuple[int, int, int]
"""(status, errno, bytes read), as ``read_run`` hands them to its callback."""


# ---------------------------------------------------------------------------- helpers


def _module() -> tuple[Any, int]:
    loaded = native._loaded()
    assert loaded is not None
    return loaded


def _round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _pieces(body_len: int) -> list[tuple[int, int]]:
    """(start, length) of each piece ``read_split`` reads a body of ``body_len`` in, as
    ``piece_len`` cuts them: half of what is left in whole pages (at least 256 KiB),
    the rest in one piece once it is at most 256 KiB."""
    out, done = [], 0
    while done < body_len:
        rest = body_len - done
        n = rest if rest <= PIECE else max((rest // 2) & ~(PAGE - 1), PIECE)
        out.append((done, n))
        done += n
    return out


def test_the_piece_model_is_the_codes() -> None:
    """The pieces the damage below is placed around (piece_len in _frames.c)."""
    mib, kib = 1 << 20, 1 << 10
    assert [n for _, n in _pieces(16 * mib)] == [
        8 * mib,
        4 * mib,
        2 * mib,
        mib,
        512 * kib,
        256 * kib,
        256 * kib,
    ]
    assert _pieces(SPLIT + PAGE) == [(0, PIECE), (PIECE, PIECE), (2 * PIECE, PAGE)]
    assert _pieces(3 * PIECE) == [
        (0, 3 * PIECE // 2),
        (3 * PIECE // 2, PIECE),
        (5 * PIECE // 2, PIECE // 2),
    ]


@dataclass(frozen=True)
class Frame:
    off: int
    nbytes: int
    header: bytes
    payload: bytes

    @property
    def want(self) -> bytes:
        return self.header[:WANT]

    @property
    def checksum(self) -> bytes:
        return xxhash.xxh3_128_digest(self.payload)


def _layout(sizes: Sequence[int], seed: int) -> tuple[bytearray, list[Frame]]:
    """A file's bytes holding frames of ``sizes`` back to back (a random 4 KiB header
    each, the payload padded to whole pages with 0x5a), and the frames."""
    rng = np.random.default_rng(seed)
    data = bytearray()
    frames = []
    for n in sizes:
        header = rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes()
        payload = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        frames.append(Frame(len(data), n, header, payload))
        data += header + payload + b"\x5a" * (_round(n) - n)
    return data, frames


def _expect(
    data: bytes | bytearray,
    f: Frame,
    body_len: int,
    want: bytes | None = None,
    checksum: bytes | None = None,
) -> tuple[int, int]:
    """What verifying frame ``f`` whole gives against the bytes on disk ``data``, for a
    body buffer of ``body_len``: (status, bytes read)."""
    want = f.want if want is None else want
    checksum = f.checksum if checksum is None else checksum
    got = max(0, min(len(data) - f.off, PAGE + body_len))
    if got < PAGE + f.nbytes:
        return TRUNCATED, got
    if bytes(data[f.off : f.off + len(want)]) != want:
        return HEADER_DIFFERS, got
    payload = bytes(data[f.off + PAGE : f.off + PAGE + f.nbytes])
    if xxhash.xxh3_128_digest(payload) != checksum:
        return CHECKSUM_MISMATCH, got
    return OK, got


def _body(body_len: int, aligned: bool = True) -> Any:
    if aligned:
        return aligned_empty(body_len)
    return bytearray(body_len)


def _fill(body: Any, payload: bytes, right: bool) -> None:
    """The body before a run: the frame's right bytes (a hash of bytes not yet landed
    would vouch for them) or junk."""
    view = memoryview(body).cast("B")
    view[:] = b"\xab" * len(view)
    if right:
        view[: len(payload)] = payload


def _read_run(
    fd: int,
    frames: Sequence[Frame],
    bodies: Sequence[Any],
    depth: int,
    checksums: Sequence[bytes] | None = None,
    on_frame: Callable[[int, int, int, int], bool] | None = None,
) -> list[Outcome]:
    module, addr = _module()
    seen: list[Outcome] = []

    def took(i: int, status: int, err: int, got: int) -> bool:
        seen.append((status, err, got))
        return True if on_frame is None else on_frame(i, status, err, got)

    sums = checksums if checksums is not None else [f.checksum for f in frames]
    items = [
        (fd, f.off, bytearray(PAGE), b, f.nbytes, f.want, s)
        for f, b, s in zip(frames, bodies, sums, strict=True)
    ]
    module.read_run(items, depth, addr, took)
    return seen


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _tasks_back_to(tasks: int, seconds: float = 5.0) -> bool:
    """Whether this process's threads are back to ``tasks`` within ``seconds``: a
    Python thread joined may still be leaving the kernel's task list a moment after."""
    end = time.monotonic() + seconds
    while _tasks() > tasks and time.monotonic() < end:
        time.sleep(0.01)
    return _tasks() <= tasks


@contextlib.contextmanager
def _opened(path: Path, flags: int = os.O_RDONLY) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


def _streamed_once(run: Callable[[], None], tries: int = 60, seconds: float = 10.0) -> bool:
    """Run ``run`` until one of its runs verified its last frame as it landed: at least
    ``tries`` times, and on for up to ``seconds`` (under load the caller may reach a
    small frame only after it landed, many times in a row): whether one did."""
    start = time.monotonic()
    k = 0
    while k < tries or time.monotonic() - start < seconds:
        k += 1
        before = native.streamed()
        run()
        if native.streamed() > before:
            return True
    return False


# ------------------------------------------------------------- static damage, read_run

SMALL = [4096, 8192 + 17]
"""Frames before the run's last one (the caller verifies these while it is read)."""

SIZES: dict[str, tuple[int, int, bool]] = {
    # name: (payload bytes, body bytes, body page-aligned)
    "split-1": (SPLIT - 1, SPLIT, True),  # read whole
    "split": (SPLIT, SPLIT, True),  # read whole: only larger ones are split
    "split+1": (SPLIT + 1, SPLIT + PAGE, True),  # two pieces, the second one page
    "odd-3MiB": (3 * (1 << 20) + 123, _round(3 * (1 << 20) + 123), True),
    "body-longer": (700_001, _round(700_001) + (1 << 20), True),  # reads past the frame
    "body-odd": (600_001, 600_001, False),  # a body that is not whole pages
    "one-byte": (1, 1 << 20, True),  # a MiB of body for one payload byte
    "empty": (0, 1 << 20, True),  # no payload: never split
}


def _damages(nbytes: int, body_len: int) -> list[tuple[str, int]]:
    """(kind, where) of each damage tried on a last frame of ``nbytes`` in ``body_len``."""
    out: list[tuple[str, int]] = [("none", 0), ("header", 10), ("header", WANT - 1)]
    out += [("header-unnamed", WANT), ("checksum", 0), ("truncate", 0), ("truncate", 100)]
    out += [("truncate", PAGE), ("truncate", PAGE + nbytes)]
    if nbytes:
        out += [("truncate", PAGE + nbytes - 1), ("payload", nbytes - 1)]
    if nbytes < _round(nbytes):
        out.append(("padding", nbytes))
    for start, length in _pieces(body_len):
        for at in (start - 1, start, start + length - 1):
            if 0 <= at < nbytes:
                out.append(("payload", at))
        if 0 < start < nbytes:
            out += [("truncate", PAGE + start), ("truncate", PAGE + start + 1)]
    return sorted(set(out))


def _streams(nbytes: int, body_len: int, kind: str, where: int) -> bool:
    """Whether the caller can be expected to reach the last frame while its pieces land:
    it is split, its payload goes past the first piece and the file is not cut before
    that piece's end (a short first read lands at once)."""
    first = _pieces(body_len)[0][1] if body_len else 0
    cut_early = kind == "truncate" and where <= PAGE + first
    return body_len > SPLIT and nbytes > first and not cut_early


def _static_cases() -> list[Any]:
    cases = []
    for name, (nbytes, body_len, aligned) in SIZES.items():
        for kind, where in _damages(nbytes, body_len):
            cases.append(
                pytest.param(nbytes, body_len, aligned, kind, where, id=f"{name}-{kind}-{where}")
            )
    return cases


def _damaged(
    tmp_path: Path, nbytes: int, kind: str, where: int, seed: int
) -> tuple[Path, bytearray, list[Frame], list[bytes]]:
    """A file of the SMALL frames, the last frame (``nbytes``) and one frame after it,
    the last frame damaged as ``kind`` says; its bytes, the run's frames and the
    checksums the rows name."""
    data, frames = _layout([*SMALL, nbytes, 3 * PAGE], seed)
    run = frames[:-1]
    last = run[-1]
    sums = [f.checksum for f in run]
    if kind in ("payload", "padding"):
        data[last.off + PAGE + where] ^= 0x01
    elif kind in ("header", "header-unnamed"):
        data[last.off + where] ^= 0x80
    elif kind == "checksum":
        sums[-1] = bytes(16)
    elif kind == "truncate":
        del data[last.off + where :]
    path = tmp_path / f"seg-{seed}.kvs"
    path.write_bytes(bytes(data))
    return path, data, run, sums


@pytest.mark.parametrize(("nbytes", "body_len", "aligned", "kind", "where"), _static_cases())
def test_a_run_hands_out_what_verifying_the_last_frame_whole_gives(
    tmp_path: Path,
    streaming: Callable[[bool], None],
    nbytes: int,
    body_len: int,
    aligned: bool,
    kind: str,
    where: int,
) -> None:
    """Every size edge and damage of the run's last frame, at depths 1, 2 and 8, with the
    streaming hash on and off, into bodies already holding the right bytes or junk:
    each frame's status and byte count are the reference's, and an OK frame's body holds
    the stored payload. Where the frame is split, one run at least (bounded) verified it
    as it landed, so that the streaming path is the one held."""
    path, data, run, sums = _damaged(tmp_path, nbytes, kind, where, seed=nbytes % 97 + where % 89)
    bodies_len = [_round(f.nbytes) for f in run[:-1]] + [body_len]
    want = [_expect(data, f, n, checksum=s) for f, n, s in zip(run, bodies_len, sums, strict=True)]
    splits = _streams(nbytes, body_len, kind, where)
    with _opened(path) as fd:
        for stream_on in (True, False):
            streaming(stream_on)
            for depth in (1, 2, 8):
                for right in (True, False):

                    def once(depth: int = depth, right: bool = right) -> None:
                        bodies = [
                            _body(n, aligned or i < len(run) - 1) for i, n in enumerate(bodies_len)
                        ]
                        for f, b in zip(run, bodies, strict=True):
                            _fill(b, f.payload, right)
                        got = _read_run(fd, run, bodies, depth, sums)
                        assert [(s, g) for s, _, g in got] == want, (depth, right)
                        for f, b, (s, _, _) in zip(run, bodies, got, strict=True):
                            if s == OK:
                                assert bytes(memoryview(b).cast("B")[: f.nbytes]) == f.payload

                    if stream_on and splits and depth == 2 and right:
                        assert _streamed_once(once), "never verified as its pieces landed"
                    else:
                        once()


# ------------------------------------------------------------ static damage, direct runs


def _direct_cases() -> list[Any]:
    cases = []
    for name, (nbytes, body_len, aligned) in SIZES.items():
        if not aligned:
            continue  # a direct run takes whole aligned pages only
        for kind, where in _damages(nbytes, body_len):
            if kind == "truncate" and where not in (100, PAGE + nbytes - 1) and nbytes > SPLIT:
                continue  # the cuts inside pieces: read_run's cases above
            cases.append(pytest.param(nbytes, body_len, kind, where, id=f"{name}-{kind}-{where}"))
    return cases


@pytest.mark.parametrize(("nbytes", "body_len", "kind", "where"), _direct_cases())
def test_a_direct_run_counts_the_last_frame_only_as_verifying_it_whole_would(
    tmp_path: Path,
    streaming: Callable[[bool], None],
    nbytes: int,
    body_len: int,
    kind: str,
    where: int,
) -> None:
    """The same edges on direct runs, stepped 0, 2 or 3 times then finished, at depths
    1, 2 and 4, streaming on and off, into bodies holding the right bytes or junk:
    ``step()`` says what the reference says for each frame in order, ``finish()`` counts
    the leading frames the reference verifies, each counted frame's bytes the stored
    ones."""
    path, data, run, sums = _damaged(tmp_path, nbytes, kind, where, seed=nbytes % 101 + where % 83)
    lens = [_round(f.nbytes) for f in run[:-1]] + [body_len]
    status = [_expect(data, f, n, checksum=s)[0] for f, n, s in zip(run, lens, sums, strict=True)]
    good = next((i for i, s in enumerate(status) if s != OK), len(run))
    splits = _streams(nbytes, body_len, kind, where)
    for stream_on in (True, False):
        streaming(stream_on)
        for depth, steps in ((1, 0), (2, 3), (4, 2), (1, 3)):
            for right in (True, False):

                def once(depth: int = depth, steps: int = steps, right: bool = right) -> None:
                    bodies = [aligned_empty(n) for n in lens]
                    for f, b in zip(run, bodies, strict=True):
                        _fill(b, f.payload, right)
                    frames = [
                        (str(path), f.off, b, f.nbytes, f.want, s)
                        for f, b, s in zip(run, bodies, sums, strict=True)
                    ]
                    d = native.start_direct(frames, depth)
                    said = [d.step() for _ in range(steps)]
                    assert said == [i < good for i in range(steps)]
                    assert d.finish() == good
                    for f, b in zip(run[:good], bodies, strict=False):
                        assert b[: f.nbytes].tobytes() == f.payload

                if stream_on and splits and right and depth == 2:
                    assert _streamed_once(once), "never verified as its pieces landed"
                else:
                    once()


# ------------------------------------------------------------ damage while it is read

BIG = 6 << 20
"""A last frame read in pieces of 3 MiB (with the header), 1.5 MiB, 768, 384 and 384 KiB."""


def _big_file(tmp_path: Path, seed: int = 5) -> tuple[Path, bytearray, list[Frame]]:
    data, frames = _layout([8192, BIG], seed)
    path = tmp_path / "big.kvs"
    path.write_bytes(bytes(data))
    return path, data, frames


def _hammer(
    act: Callable[[int], None], stop: threading.Event, errors: list[BaseException]
) -> threading.Thread:
    def loop() -> None:
        k = 0
        try:
            while not stop.is_set():
                act(k)
                k += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def _race(
    tmp_path: Path,
    act: Callable[[int, int], None],
    allowed: set[int],
    rounds: int = 150,
    seconds: float = 2.0,
) -> dict[int, int]:
    """Runs of [8 KiB, 6 MiB] read by ``read_run`` (depths 1..4, bodies holding the right
    bytes first) while a thread calls ``act(fd, k)`` with the run's descriptor: every
    status is in ``allowed`` or OK, and an OK frame's body is the stored payload. The
    statuses seen, counted, once ``rounds`` runs (or ``seconds``) are done and both an
    OK and a miss of the last frame were seen (bounded)."""
    path, _, frames = _big_file(tmp_path)
    seen: dict[int, int] = {}
    stop = threading.Event()
    errors: list[BaseException] = []
    fd = os.open(path, os.O_RDONLY)
    streamed = native.streamed()
    try:
        t = _hammer(lambda k: act(fd, k), stop, errors)
        start = time.monotonic()
        n = 0
        while n < rounds or (len(seen) < 2 and time.monotonic() - start < seconds):
            if time.monotonic() - start > 4 * seconds:
                break
            bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
            for f, b in zip(frames, bodies, strict=True):
                _fill(b, f.payload, right=True)
            got = _read_run(fd, frames, bodies, 1 + n % 4)
            for f, b, (s, _, _) in zip(frames, bodies, got, strict=True):
                assert s == OK or s in allowed, s
                if s == OK:
                    assert b[: f.nbytes].tobytes() == f.payload
            seen[got[-1][0]] = seen.get(got[-1][0], 0) + 1
            n += 1
        stop.set()
        t.join(10)
        assert not errors, errors
        assert native.streamed() > streamed  # some runs verified the pieces as they landed
    finally:
        stop.set()
        os.close(fd)
    return seen


def test_a_byte_toggled_in_the_file_while_the_pieces_land_is_never_served(tmp_path: Path) -> None:
    """A thread flips and unflips a byte in each piece of the last frame (another
    descriptor) while runs read it: a run that read a flipped byte in any piece misses
    (CHECKSUM_MISMATCH), one that read none hands out the stored bytes."""
    path, data, frames = _big_file(tmp_path)
    last = frames[-1]
    spots = [last.off + PAGE + start + length // 2 for start, length in _pieces(_round(BIG))]
    wfd = os.open(path, os.O_WRONLY)
    try:

        def toggle(_fd: int, k: int) -> None:
            at = spots[k % len(spots)]
            os.pwrite(wfd, bytes([data[at] ^ (1 + k % 255)]), at)
            os.pwrite(wfd, bytes([data[at]]), at)

        seen = _race(tmp_path, toggle, {CHECKSUM_MISMATCH})
    finally:
        os.close(wfd)
    assert seen.get(OK, 0) > 0


def test_a_file_cut_and_regrown_while_the_pieces_land_is_never_served(tmp_path: Path) -> None:
    """A thread cuts the file inside a piece of the last frame and writes the rest back:
    a run misses (the cut seen as the file's end, or a page not yet written back) or
    hands out the stored bytes."""
    path, data, frames = _big_file(tmp_path)
    last = frames[-1]
    cuts = [last.off + PAGE + start + 4096 for start, _ in _pieces(_round(BIG))]
    wfd = os.open(path, os.O_WRONLY)
    try:

        def cut(_fd: int, k: int) -> None:
            at = cuts[k % len(cuts)]
            os.ftruncate(wfd, at)
            os.pwrite(wfd, bytes(data[at:]), at)
            time.sleep(0.0005 * (k % 3))  # whole for a while: some runs read it whole

        seen = _race(tmp_path, cut, {TRUNCATED, CHECKSUM_MISMATCH})
    finally:
        os.close(wfd)
    assert seen.get(OK, 0) > 0


def test_the_payload_rewritten_with_another_puts_while_the_pieces_land(tmp_path: Path) -> None:
    """A thread writes another payload (same header) over the last frame piece by piece
    and writes the stored one back: a run whose body mixes the two, or holds the other
    one, misses; only the stored payload is handed out."""
    path, _, frames = _big_file(tmp_path)
    last = frames[-1]
    other = bytes(np.random.default_rng(99).integers(0, 256, BIG, dtype=np.uint8))
    base = last.off + PAGE
    wfd = os.open(path, os.O_WRONLY)
    try:

        def rewrite(_fd: int, k: int) -> None:
            src = other if k % 2 == 0 else last.payload
            for start, length in _pieces(BIG):
                os.pwrite(wfd, src[start : start + length], base + start)

        _race(tmp_path, rewrite, {CHECKSUM_MISMATCH})
    finally:
        os.close(wfd)


def test_the_descriptor_repointed_at_a_decoy_between_pieces(tmp_path: Path) -> None:
    """The run's descriptor is made (``dup2``) to name a decoy file (the same frames, one
    byte of each piece of the last one changed) and the real one again, over and over
    while the pieces land: a run that read any piece from the decoy misses."""
    path, data, frames = _big_file(tmp_path)
    last = frames[-1]
    decoy = bytearray(data)
    for start, length in _pieces(_round(BIG)):
        decoy[last.off + PAGE + start + length // 3] ^= 0xFF
    decoy_path = tmp_path / "decoy.kvs"
    decoy_path.write_bytes(bytes(decoy))
    real = os.open(path, os.O_RDONLY)
    fake = os.open(decoy_path, os.O_RDONLY)
    try:

        def repoint(fd: int, k: int) -> None:
            os.dup2(fake if k % 2 == 0 else real, fd)

        _race(tmp_path, repoint, {CHECKSUM_MISMATCH})
    finally:
        os.close(real)
        os.close(fake)


# ------------------------------------------------------------- many runs, many threads


def _pool(
    tmp_path: Path,
) -> tuple[list[int], list[list[tuple[int, int]]], list[Frame], Callable[[], None]]:
    """Two files of the same 12 frames (small ones and 0.6-3 MiB ones), the second with
    damage in several (a payload byte in a late piece, a header byte, the last frame cut):
    their descriptors, each frame's reference (status, bytes read) in each file, the
    frames, and a closer."""
    sizes = [
        4096,
        12288 + 5,
        3 << 20,
        700_000,
        40_000,
        (2 << 20) + 1,
        4096,
        1 << 20,
        9000,
        600_001,
        65536,
        3 << 20,
    ]
    data, frames = _layout(sizes, seed=21)
    bad = bytearray(data)
    for i in (2, 5, 7):  # late in the payload: the last piece or the one before
        bad[frames[i].off + PAGE + frames[i].nbytes - 1 - i] ^= 0x04
    bad[frames[9].off + 33] ^= 0x10  # a header byte the row names
    bad[frames[3].off + PAGE + PIECE + 1] ^= 0x40  # the second piece's second byte
    del bad[frames[11].off + PAGE + (2 << 20) :]  # the last frame cut in a late piece
    paths = [tmp_path / "good.kvs", tmp_path / "bad.kvs"]
    paths[0].write_bytes(bytes(data))
    paths[1].write_bytes(bytes(bad))
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    ref = [[_expect(d, f, _round(f.nbytes)) for f in frames] for d in (data, bad)]
    assert {s for s, _ in ref[1]} == {OK, CHECKSUM_MISMATCH, HEADER_DIFFERS, TRUNCATED}

    def close() -> None:
        for fd in fds:
            os.close(fd)

    return fds, ref, frames, close


def test_many_runs_in_threads_while_the_streaming_hash_is_switched(
    tmp_path: Path, streaming: Callable[[bool], None]
) -> None:
    """Four threads each read runs of 2 to 12 frames of either file (depth 1..8, the last
    frame one of the large ones, bodies holding the right bytes first) while a fifth
    switches the streaming hash off and on: every frame is its reference, every OK
    body the stored bytes; runs streamed; no thread or descriptor is left after."""
    fds, ref, frames, close = _pool(tmp_path)
    big = [i for i, f in enumerate(frames) if f.nbytes > SPLIT]
    stop = threading.Event()
    errors: list[BaseException] = []
    runs = [0]
    tasks, nfds, streamed = _tasks(), _fds(), native.streamed()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                n = rng.randrange(1, 12)
                picks = [rng.randrange(len(frames)) for _ in range(n)] + [rng.choice(big)]
                which = [rng.randrange(2) for _ in picks]
                chosen = [frames[i] for i in picks]
                bodies = [aligned_empty(_round(f.nbytes)) for f in chosen]
                for f, b in zip(chosen, bodies, strict=True):
                    _fill(b, f.payload, right=True)
                module, addr = _module()
                seen: list[Outcome] = []
                items = [
                    (fds[w], f.off, bytearray(PAGE), b, f.nbytes, f.want, f.checksum)
                    for w, f, b in zip(which, chosen, bodies, strict=True)
                ]
                module.read_run(items, rng.randint(1, 8), addr, functools.partial(_took_as, seen))
                assert [(s, g) for s, _, g in seen] == [
                    ref[w][i] for w, i in zip(which, picks, strict=True)
                ]
                for f, b, (st, _, _) in zip(chosen, bodies, seen, strict=True):
                    if st == OK:
                        assert b[: f.nbytes].tobytes() == f.payload
                runs[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    def switch(k: int) -> None:
        streaming(k % 2 == 1)
        time.sleep(0.0005)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    toggler = _hammer(switch, stop, errors)
    start = time.monotonic()
    while time.monotonic() - start < 1.5 or (runs[0] < 40 and time.monotonic() - start < 10):
        time.sleep(0.05)
    stop.set()
    for t in [*threads, toggler]:
        t.join(30)
    try:
        assert not errors, errors
        assert runs[0] >= 40
        assert native.streamed() > streamed
        assert _tasks_back_to(tasks)
    finally:
        close()
    assert _fds() <= nfds


def _took_as(into: list[Outcome], i: int, status: int, err: int, got: int) -> bool:
    into.append((status, err, got))
    return True


def test_a_run_keeps_the_streaming_hash_it_started_with(
    tmp_path: Path, streaming: Callable[[bool], None]
) -> None:
    """Direct runs started with the streaming hash, then the hash switched off before they
    are stepped (and runs started without it, stepped after it is on again): each counts
    what the reference says, the damaged last frame never."""
    path, data, frames = _big_file(tmp_path)
    bad_path = tmp_path / "bad.kvs"
    bad = bytearray(data)
    bad[frames[-1].off + PAGE + BIG - 2] ^= 0x01
    bad_path.write_bytes(bytes(bad))
    for k in range(20):
        on = k % 2 == 0
        streaming(on)
        runs = []
        for p in (path, bad_path):
            bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
            for f, b in zip(frames, bodies, strict=True):
                _fill(b, f.payload, right=True)
            d = native.start_direct(
                [
                    (str(p), f.off, b, f.nbytes, f.want, f.checksum)
                    for f, b in zip(frames, bodies, strict=True)
                ],
                1 + k % 3,
            )
            runs.append((d, bodies))
        streaming(not on)
        (good_run, good_bodies), (bad_run, _) = runs
        assert bad_run.step() is True and bad_run.step() is False and bad_run.finish() == 1
        assert good_run.finish() == 2
        assert [b[: f.nbytes].tobytes() for f, b in zip(frames, good_bodies, strict=True)] == [
            f.payload for f in frames
        ]
    streaming(False)
    before = native.streamed()
    for _ in range(5):
        bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
        d = native.start_direct(
            [
                (str(path), f.off, b, f.nbytes, f.want, f.checksum)
                for f, b in zip(frames, bodies, strict=True)
            ],
            2,
        )
        assert d.finish() == 2
    assert native.streamed() == before  # without it, every frame is verified whole


# ------------------------------------------------------------------------ direct runs


def _direct(
    path: Path, frames: Sequence[Frame], depth: int = 1
) -> tuple[native.DirectRun, list[np.ndarray]]:
    bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
    for f, b in zip(frames, bodies, strict=True):
        _fill(b, f.payload, right=False)
    run = native.start_direct(
        [
            (str(path), f.off, b, f.nbytes, f.want, f.checksum)
            for f, b in zip(frames, bodies, strict=True)
        ],
        depth,
    )
    return run, bodies


def test_close_from_another_thread_while_a_step_streams(tmp_path: Path) -> None:
    """One thread steps a run whose last frame streams, another drops its reference and
    calls ``close()`` over and over meanwhile: ``close`` is refused while the step is
    under way, a step either says what the reference says or is refused once the run
    is closed; a True step's bytes are the stored ones; nothing is left open."""
    path, _, frames = _big_file(tmp_path)
    tasks, nfds = _tasks(), _fds()
    refused = 0
    for k in range(30):
        run, bodies = _direct(path, frames, 1 + k % 2)
        shared: dict[str, native.DirectRun] = {"run": run}
        said: list[bool | str] = []
        go = threading.Event()

        def stepper(
            run: native.DirectRun = run, said: list[bool | str] = said, go: threading.Event = go
        ) -> None:
            go.set()
            for _ in range(3):
                try:
                    said.append(run.step())
                except RuntimeError:
                    said.append("closed")

        t = threading.Thread(target=stepper)
        t.start()
        go.wait()
        if k % 3 == 0:
            time.sleep(0.0005 * (k % 5))
        shared.clear()
        while True:
            try:
                run.close()
                break
            except RuntimeError:
                refused += 1
        t.join(10)
        assert not t.is_alive()
        assert said in (
            [True, True, False],
            [True, True, "closed"],
            [True, "closed", "closed"],
            ["closed", "closed", "closed"],
        ), said
        if said[:2] == [True, True]:
            assert bodies[1][: frames[1].nbytes].tobytes() == frames[1].payload
        del run, t
    gc.collect()
    assert refused > 0  # close came while a step was under way
    assert _tasks_back_to(tasks) and _fds() <= nfds


def test_runs_dropped_or_collected_with_pieces_in_flight_leave_nothing(tmp_path: Path) -> None:
    """Runs dropped right after they started (their last frame's pieces landing), caught
    in reference cycles the collector breaks, and stepped up to the big frame then
    dropped: no thread, no descriptor left, and the next run still verifies."""
    path, _, frames = _big_file(tmp_path)
    tasks, nfds = _tasks(), _fds()
    for k in range(40):
        run, _ = _direct(path, frames, 1 + k % 3)
        if k % 3 == 0:
            cycle: list[Any] = [run]
            cycle.append(cycle)
            del cycle
        elif k % 3 == 1:
            assert run.step() is True
        del run
        if k % 10 == 0:
            gc.collect()
    gc.collect()
    assert _tasks_back_to(tasks) and _fds() <= nfds
    run, bodies = _direct(path, frames, 2)
    assert run.finish() == 2
    assert bodies[1][: frames[1].nbytes].tobytes() == frames[1].payload


def test_a_segment_unlinked_or_replaced_after_the_run_opened_it(tmp_path: Path) -> None:
    """``start_direct`` opened the file; it is then unlinked, or another file (the same
    frames, the last one damaged in its last piece) renamed over it: the run reads what
    it opened (both frames counted, the stored bytes); a run started after the rename
    reads the decoy and stops before its last frame."""
    path, data, frames = _big_file(tmp_path)
    decoy = bytearray(data)
    decoy[frames[1].off + PAGE + BIG - 100] ^= 0x02
    for how in ("unlink", "replace"):
        path.write_bytes(bytes(data))
        for depth in (1, 2):
            run, bodies = _direct(path, frames, depth)
            if how == "unlink":
                path.unlink()
            else:
                other = tmp_path / "other.kvs"
                other.write_bytes(bytes(decoy))
                os.replace(other, path)
            assert run.finish() == 2
            assert bodies[1][: frames[1].nbytes].tobytes() == frames[1].payload
            if how == "replace":
                again, _ = _direct(path, frames, depth)
                assert again.finish() == 1
            path.write_bytes(bytes(data))


# --------------------------------------------------------------- read_run's callback


def test_the_callback_raising_or_stopping_while_the_last_frame_lands(tmp_path: Path) -> None:
    """``on_frame`` of the frame before the last (the last one's pieces landing
    meanwhile) raises KeyboardInterrupt or ValueError, or returns False; or that of the
    last raises: the exception comes out of ``read_run`` (False: the count), no thread
    is left, and the next run verifies whole."""
    path, _, frames = _big_file(tmp_path)
    module, addr = _module()
    tasks = _tasks()
    with _opened(path) as fd:
        for k in range(24):
            at = len(frames) - 2 if k % 4 != 3 else len(frames) - 1
            what: BaseException | None = (
                KeyboardInterrupt(),
                ValueError("no"),
                None,
                KeyboardInterrupt(),
            )[k % 4]

            def on_frame(
                i: int, s: int, e: int, g: int, at: int = at, what: BaseException | None = what
            ) -> bool:
                if i == at:
                    if what is None:
                        return False
                    raise what
                return True

            bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
            items = [
                (fd, f.off, bytearray(PAGE), b, f.nbytes, f.want, f.checksum)
                for f, b in zip(frames, bodies, strict=True)
            ]
            if what is None:
                assert module.read_run(items, 1 + k % 3, addr, on_frame) == at
            else:
                with pytest.raises(type(what)):
                    module.read_run(items, 1 + k % 3, addr, on_frame)
        assert _tasks_back_to(tasks)
        bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
        got = _read_run(fd, frames, bodies, 2)
        assert [s for s, _, _ in got] == [OK, OK]
        assert bodies[1][: frames[1].nbytes].tobytes() == frames[1].payload


def test_a_run_started_from_the_callback_while_the_outer_last_frame_lands(tmp_path: Path) -> None:
    """``on_frame`` of the outer run's first frame (its 6 MiB last frame landing) reads
    a run of its own, of the same frames (one file intact, one damaged in the last
    frame's first piece): both runs hand out what the reference says."""
    path, data, frames = _big_file(tmp_path)
    bad = bytearray(data)
    bad[frames[1].off + PAGE + 5] ^= 0x01
    bad_path = tmp_path / "bad.kvs"
    bad_path.write_bytes(bytes(bad))
    with _opened(path) as good_fd, _opened(bad_path) as bad_fd:
        for k in range(10):
            inner: list[list[Outcome]] = []
            outer_fd, inner_fd = (good_fd, bad_fd) if k % 2 else (bad_fd, good_fd)

            def on_frame(
                i: int,
                s: int,
                e: int,
                g: int,
                inner_fd: int = inner_fd,
                inner: list[list[Outcome]] = inner,
            ) -> bool:
                if i == 0:
                    ibodies = [aligned_empty(_round(f.nbytes)) for f in frames]
                    inner.append(_read_run(inner_fd, frames, ibodies, 2))
                    if inner[-1][-1][0] == OK:
                        assert ibodies[1][: frames[1].nbytes].tobytes() == frames[1].payload
                return True

            bodies = [aligned_empty(_round(f.nbytes)) for f in frames]
            for f, b in zip(frames, bodies, strict=True):
                _fill(b, f.payload, right=True)
            got = _read_run(outer_fd, frames, bodies, 1 + k % 2, on_frame=on_frame)
            want_outer = OK if outer_fd == good_fd else CHECKSUM_MISMATCH
            want_inner = CHECKSUM_MISMATCH if outer_fd == good_fd else OK
            assert [s for s, _, _ in got] == [OK, want_outer]
            assert [s for s, _, _ in inner[0]] == [OK, want_inner]


# ---------------------------------------------------------------------- set_stream


def test_a_refused_partial_set_keeps_the_functions_that_were_set() -> None:
    """``set_stream`` refuses four addresses and a zero in any place, and a wrong count
    or type, and leaves what was set: the streaming hash still hashes as xxhash."""
    module, _ = _module()
    addrs = native._stream_addresses()
    assert addrs is not None
    data = bytes(range(256)) * 5000
    for j in range(5):
        partial = [0 if i == j else a for i, a in enumerate(addrs)]
        with pytest.raises(ValueError, match="five"):
            module.set_stream(*partial)
        assert module.xxh3_128_stream(data, 4097) == xxhash.xxh3_128_digest(data)
    with pytest.raises(TypeError):
        module.set_stream(*addrs[:4])
    with pytest.raises(TypeError):
        module.set_stream("a", 0, 0, 0, 0)
    assert module.xxh3_128_stream(data, 1 << 20) == xxhash.xxh3_128_digest(data)
    view = np.frombuffer(data, np.uint8)[::2]  # not contiguous: refused, not misread
    with pytest.raises((TypeError, BufferError, ValueError)):
        module.xxh3_128_stream(view, 7)


def test_a_streaming_hash_that_does_not_hash_as_xxhash_is_taken_back() -> None:
    """``_set_stream`` hands the functions over, and takes them back (five zeros) when
    the streamed digest of a sample differs from xxhash's for any piece size."""

    class Fake:
        def __init__(self, wrong_at: int | None) -> None:
            self.calls: list[tuple[int, ...]] = []
            self.wrong_at = wrong_at

        def set_stream(self, *a: int) -> None:
            self.calls.append(a)

        def xxh3_128_stream(self, s: bytes, piece: int) -> bytes:
            d = xxhash.xxh3_128_digest(s)
            return bytes(16) if piece == self.wrong_at else d

    samples = [b"", b"x" * 100, bytes(range(256)) * 8000]
    for wrong_at in (None, 1, 7, 64, 4096, 1 << 16, 1 << 20):
        fake = Fake(wrong_at)
        native._set_stream(fake, samples)  # type: ignore[arg-type]
        assert fake.calls[0] == native._stream_addresses()
        assert (fake.calls[-1] == (0, 0, 0, 0, 0)) is (wrong_at is not None), wrong_at


# ------------------------------------------------------------------- the disk tier


def test_tier_reads_in_threads_hand_out_what_the_python_path_hands_out(
    tmp_path: Path, both_paths: dict[str, bool]
) -> None:
    """A disk tier's ``read_batch`` of [8 KiB, 20 KiB, 3 MiB] (the last damaged in its
    last piece in one batch, intact in another), into new arrays, aligned and unaligned
    buffers, from three threads at once: each result is the Python path's (the same
    array bytes or the same typed miss), the damaged frame never an array."""
    tier = _tier(tmp_path / "t", io_depth=4)
    try:
        keys, arrays = _stored(tier, [8192, 20480, 3 << 20], seed=11)
        bad_keys, bad_arrays = _stored(tier, [8192, 20480, 3 << 20], seed=12)
        path, off, nbytes = _segment_path(tier, bad_keys[2])
        with open(path, "r+b") as fh:
            fh.seek(off + HEADER_BYTES + nbytes - 3)
            b = fh.read(1)
            fh.seek(off + HEADER_BYTES + nbytes - 3)
            fh.write(bytes([b[0] ^ 0x20]))

        def outs(kind: int, sizes: Sequence[np.ndarray]) -> list[np.ndarray] | None:
            if kind == 0:
                return None
            if kind == 1:
                return [aligned_empty(a.nbytes) for a in sizes]
            return [aligned_empty(a.nbytes + 64)[64:] for a in sizes]  # staged, copied

        def kinds(res: Sequence[Any]) -> list[Any]:
            return [
                r.tobytes() if isinstance(r, np.ndarray) else (type(r).__name__, str(r))
                for r in res
            ]

        both_paths["native"] = False
        want = {
            k: kinds(tier.read_batch(ks, outs(1, arrs)))
            for k, ks, arrs in ((0, keys, arrays), (1, bad_keys, bad_arrays))
        }
        assert isinstance(want[1][2], tuple) and want[1][2][0] == ChecksumMismatch.__name__
        assert want[0] == [a.tobytes() for a in arrays]
        both_paths["native"] = True
        errors: list[BaseException] = []
        streamed = native.streamed()

        def reader(seed: int) -> None:
            try:
                for k in range(24):
                    which = (k + seed) % 2
                    ks, arrs = ((keys, arrays), (bad_keys, bad_arrays))[which]
                    assert kinds(tier.read_batch(ks, outs((k + seed) % 3, arrs))) == want[which]
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert native.streamed() > streamed
    finally:
        tier.close()


# ------------------------------------------------------------------- end to end

BIG_PAGE = KVLayout(
    num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=512
)
"""Chunks of 2 MiB: every load's last frame is read in pieces."""
BIG_IDENT = ModelIdentity("split", "w0", "t0", BIG_PAGE)
E2E_CHUNKS = 3


def _prompt(seed: int) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    rng = np.random.default_rng(seed)
    n = BIG_PAGE.tokens_per_chunk
    tokens = rng.integers(0, 50_000, E2E_CHUNKS * n)
    shape = (BIG_PAGE.num_layers, 2, BIG_PAGE.num_kv_heads, E2E_CHUNKS * n, BIG_PAGE.head_dim)
    kv = rng.standard_normal(shape).astype(np.float16)
    chunks = [
        np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :]).tobytes()
        for i in range(E2E_CHUNKS)
    ]
    return tokens, kv, chunks


def test_loads_never_serve_bytes_of_no_live_put_while_the_last_chunk_is_damaged(
    tmp_path: Path,
) -> None:
    """An embedded store of 2 MiB chunks on disk only: three threads load the prompt
    into their own aligned buffers (the extension's frame loads: the last chunk's frame
    read in pieces) while a fourth invalidates it and puts it again with one of two
    KVs, and flips a byte of the last chunk's frame (its payload in a late piece, or its
    header) in place and back. Every result holds one put's chunks, from the first;
    frames were verified as they landed; the store's audit is clean after."""
    c = BIG_PAGE.chunk_nbytes
    assert c == 2 << 20
    store = KVStore.open(
        tmp_path / "s",
        dram_bytes=0,
        disk_bytes=256 << 20,
        segment_bytes=16 << 20,
        promote_on_hit=False,
    )
    tokens, kv_a, a = _prompt(1)
    _, kv_b, b = _prompt(2)
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    store.put_prompt(BIG_IDENT, PUBLIC, tokens, kv_a)
    store.flush()
    stop = threading.Event()
    errors: list[BaseException] = []
    results: list[LoadResult] = []
    streamed = native.streamed()
    current = [kv_a]  # the KV of the live put (a retired chunk is put back from it)

    def mutate(k: int) -> None:
        rng = random.Random(k)
        op = k % 4
        if op == 0:
            store.invalidate(namespace=PUBLIC)
            current[0] = kv_b if rng.random() < 0.5 else kv_a
            store.put_prompt(BIG_IDENT, PUBLIC, tokens, current[0])
            store.flush()
        elif op in (1, 2):
            lk = store.lookup(BIG_IDENT, PUBLIC, tokens)
            if len(lk.hits) == E2E_CHUNKS:
                with contextlib.suppress(KVLifeError):  # the chunk retired meanwhile
                    path, off, nbytes = _segment_path(disk, lk.hits[-1].key)
                    at = off + (HEADER_BYTES + nbytes - 1 - rng.randrange(PIECE) if op == 1 else 40)
                    fd = os.open(path, os.O_RDWR)
                    try:
                        old = os.pread(fd, 1, at)
                        os.pwrite(fd, bytes([old[0] ^ 0x08]), at)
                        time.sleep(rng.uniform(0, 0.004))
                        os.pwrite(fd, old, at)
                    finally:
                        os.close(fd)
        else:
            lk = store.lookup(BIG_IDENT, PUBLIC, tokens)
            if len(lk.hits) < E2E_CHUNKS:  # a damaged chunk was retired: put it back
                store.put_prompt(BIG_IDENT, PUBLIC, tokens, current[0])
                store.flush()
        time.sleep(rng.uniform(0, 0.002))

    def load(who: int) -> None:
        try:
            while not stop.is_set():
                lk = store.lookup(BIG_IDENT, PUBLIC, tokens)
                if not lk.hits:
                    continue
                outs = [
                    aligned_empty(c).view(np.float16).reshape(BIG_PAGE.chunk_shape) for _ in lk.hits
                ]
                results.append(store.load(lk, outs))
        except BaseException as exc:  # reported below
            errors.append(exc)

    loaders = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for t in loaders:
        t.start()
    mutator = _hammer(mutate, stop, errors)
    start = time.monotonic()
    corrupt = store.counters.corrupt
    while time.monotonic() - start < 10 and (
        time.monotonic() - start < 2.5 or len(results) < 30 or store.counters.corrupt == corrupt
    ):
        time.sleep(0.05)
    stop.set()
    for t in [*loaders, mutator]:
        t.join(30)
    try:
        assert not errors, errors
        assert len(results) >= 30
        for res in results:
            got = [arr.tobytes() for arr in res.arrays]
            assert res.loaded == len(got)
            assert got in (a[: res.loaded], b[: res.loaded])
        assert native.streamed() > streamed
        assert store.counters.corrupt > corrupt  # loads met the damage
        assert any(res.loaded == E2E_CHUNKS for res in results)
        store.drain()
        assert store.check().problems == []
    finally:
        store.close()
