"""Reads of a run of disk-tier frames outside the interpreter lock (issue 28).

:func:`read_run` hands a run of frames to the C extension ``kvlife.native._frames``:
its threads read each frame (header and payload in one ``preadv``) while the calling
thread, the interpreter lock released, verifies each as soon as it landed, the header
against the bytes its catalog row says it was written with and the payload's xxh3-128
against the row's checksum, then hands it to a callback in order. The only Python per
frame is that callback, and the checksum of one frame overlaps the reads of the next.

The hash is xxhash's own ``XXH3_128bits`` (its run-time dispatching entry where the
build has one), exported by the ``xxhash`` package's extension (the code that computed
every stored checksum); its address is taken once with :mod:`ctypes` and checked
against ``xxhash.xxh3_128_digest`` on sample inputs before the extension is used.
Where the extension was not built (no C compiler at install time), the symbol is
missing, the check fails, or ``KVLIFE_NATIVE=0`` is set,
:func:`available` is False and the disk tier reads through its Python path, which
gives the same results (the contract tests run both).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Protocol

import numpy as np
import xxhash

OK = 0
HEADER_DIFFERS = 1
CHECKSUM_MISMATCH = 2
TRUNCATED = 3
READ_ERROR = 4

MAX_DEPTH = 64
"""Reads in flight one call may use (threads it starts)."""

DEFAULT_PIECE = 2 << 20
"""The smallest piece of a run's last frame read in pieces (``_frames.c``,
``read_split``, ``stream_check``): a frame larger than twice it is read in pieces that
halve what is left, down to it, each hashed as it lands, so only the last piece's hash
follows the run's last byte, not the whole frame's (1.3 ms of a 16 MiB frame). The
frames before it are hashed while the next one is read; a frame of at most twice it is
read whole.

Why 2 MiB (2026-12-07, one read in flight, O_DIRECT, alternated rounds): each read costs
this device a fixed 60-85 µs, more than the hash a halving saves below a few MiB
(xxh3-128 at about 19 GB/s). Four frames of 2 MiB read and verified by the extension
alone ran at 0.81 / 0.92 / 0.87 / 0.85 of raw reads in pieces of 256 KiB (the size
before), 0.87 / 0.94 / 0.89 / 0.92 read whole; four of 16 MiB at 0.92 / 0.92 in 256 KiB
pieces, 0.94 / 0.91 in 2 MiB ones, 0.88 / 0.89 read whole. :func:`set_piece` changes it
(a device with cheaper reads may want smaller pieces; tests use them to reach every
piece edge with small frames)."""


def set_piece(nbytes: int) -> int:
    """Read a run's last frame in pieces of at least ``nbytes`` (a multiple of 4096, at
    least 64 KiB; frames of at most twice it whole) in the runs started from now on;
    returns the size it replaces. ValueError for a size the extension refuses;
    RuntimeError when the extension is not available."""
    loaded = _loaded()
    if loaded is None:
        raise RuntimeError("kvlife.native._frames is not available")
    previous: int = loaded[0].set_piece(nbytes)
    return previous


STREAM_RUN = 1024
"""The shortest contiguous run of a strided source the extension's ``stream_copy``
streams (:mod:`kvlife.native.copies`); a build with another value is another version."""


@dataclass(frozen=True, slots=True)
class FrameRead:
    """One frame of a run to read: where it is, where it lands, what it must be."""

    fd: int
    offset: int
    header: np.ndarray
    """Writable, aligned: the frame's header lands here."""
    body: np.ndarray
    """Writable, aligned, a multiple of the alignment long: the payload lands here."""
    nbytes: int
    """The payload's length (the rest of ``body`` is padding)."""
    header_want: bytes
    """The header bytes the catalog row says the frame was written with."""
    checksum: bytes
    """The row's xxh3-128 of the payload (16 bytes, as ``xxhash`` digests)."""


@dataclass(frozen=True, slots=True)
class FrameOutcome:
    status: int
    """OK, HEADER_DIFFERS, CHECKSUM_MISMATCH, TRUNCATED or READ_ERROR."""
    errno: int
    """The read's errno (READ_ERROR only)."""
    got: int
    """Bytes the read returned."""


HASH_SYMBOLS = ("XXH3_128bits_dispatch", "XXH3_128bits")
"""The xxhash extension's one-shot xxh3-128, best first: the ``_dispatch`` entry picks
the widest vector unit the CPU has at run time (AVX2 here: 2 MiB in 74 against 87 µs,
16 MiB in 0.82 against 1.05 ms, in cache); builds without it export the plain one."""


STREAM_SYMBOLS = (
    ("XXH3_createState",),
    ("XXH3_freeState",),
    ("XXH3_128bits_reset",),
    ("XXH3_128bits_update_dispatch", "XXH3_128bits_update"),
    ("XXH3_128bits_digest",),
)
"""The same extension's streaming xxh3-128 (create, free, reset, update, digest; the
first name of each that it exports): a run's last frame is verified with it piece by
piece as it lands (``_frames.c``, ``read_split``), so that only its last piece's hash
follows its last byte."""


def _xxhash_lib() -> ctypes.CDLL | None:
    lib_path = getattr(getattr(xxhash, "_xxhash", None), "__file__", None)
    if lib_path is None:
        return None
    try:
        return ctypes.CDLL(lib_path)
    except OSError:
        return None


def _address(lib: ctypes.CDLL, name: str) -> int | None:
    fn = getattr(lib, name, None)
    addr: int | None = ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None
    return addr or None


def _hash_addresses() -> list[int]:
    """The addresses of :data:`HASH_SYMBOLS` the xxhash package's extension exports."""
    lib = _xxhash_lib()
    if lib is None:
        return []
    return [a for a in (_address(lib, name) for name in HASH_SYMBOLS) if a]


def _stream_addresses() -> tuple[int, ...] | None:
    """The addresses of :data:`STREAM_SYMBOLS` (the first exported name of each), or
    None where one is missing."""
    lib = _xxhash_lib()
    if lib is None:
        return None
    found = []
    for names in STREAM_SYMBOLS:
        addr = next((a for a in (_address(lib, n) for n in names) if a), None)
        if addr is None:
            return None
        found.append(addr)
    return tuple(found)


def _set_stream(module: ModuleType, samples: list[bytes]) -> None:
    """Hand the extension the streaming hash if it hashes ``samples`` as xxhash does in
    pieces of every size tried; else none (every frame is then verified whole)."""
    addrs = _stream_addresses()
    if addrs is None:
        return
    module.set_stream(*addrs)
    for s in samples:
        want = xxhash.xxh3_128_digest(s)
        for piece in (1, 7, 64, 4096, 1 << 16, 1 << 20):
            if len(s) > 4096 and piece < 64:
                continue  # byte by byte over a MiB: slow, and covered by the small ones
            if module.xxh3_128_stream(s, piece) != want:
                module.set_stream(0, 0, 0, 0, 0)
                return


@cache
def _loaded() -> tuple[ModuleType, int] | None:
    """The extension and the hash's address, checked; None when either is missing or
    the address does not hash as xxhash does."""
    if os.environ.get("KVLIFE_NATIVE", "1") == "0":
        return None
    try:
        from kvlife.native import _frames  # type: ignore[attr-defined]
    except ImportError:
        return None
    statuses = (OK, HEADER_DIFFERS, CHECKSUM_MISMATCH, TRUNCATED, READ_ERROR)
    names = ("OK", "HEADER_DIFFERS", "CHECKSUM_MISMATCH", "TRUNCATED", "READ_ERROR")
    if (
        tuple(getattr(_frames, name, None) for name in names) != statuses
        or not hasattr(_frames, "set_piece")
        or getattr(_frames, "MIN_PIECE", None) != 64 << 10
        or getattr(_frames, "STREAM_RUN", None) != STREAM_RUN
        or not all(
            hasattr(_frames, f)
            for f in (
                "spans",
                "start_direct",
                "disjoint",
                "DIRECT_STEPS",
                "DIRECT_PROGRESS",
                "set_stream",
                "streamed",
                "stream_copy",
                "copy_sealed",
            )
        )
    ):
        return None  # an extension built from another version of this file
    rng = np.random.default_rng(28)
    samples = [
        rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for n in (0, 1, 17, 240, 241, 4096, 1 << 20)
    ]
    for addr in _hash_addresses():  # the first that hashes as xxhash does
        if all(_frames.xxh3_128(s, addr) == xxhash.xxh3_128_digest(s) for s in samples):
            _set_stream(_frames, samples)
            _frames.set_piece(DEFAULT_PIECE)
            return _frames, addr
    return None


def streamed() -> int:
    """Frames this process verified piece by piece as they landed (a run's last frame
    larger than twice the piece, :data:`DEFAULT_PIECE`, where the streaming hash checked
    out); 0 without the extension."""
    module = native_module()
    return int(module.streamed()) if module is not None else 0


def available() -> bool:
    """Whether runs of frames are read by the extension (else the Python path)."""
    return _loaded() is not None


def native_module() -> ModuleType | None:
    """The checked extension (its other helpers: :mod:`kvlife.native.spans`), or None
    where :func:`available` is False."""
    loaded = _loaded()
    return loaded[0] if loaded is not None else None


def read_run(
    frames: Sequence[FrameRead], depth: int, on_frame: Callable[[int, FrameOutcome], bool]
) -> int:
    """Read and verify ``frames`` with up to ``depth`` reads in flight, the interpreter
    lock released but for ``on_frame(i, outcome)``, called in this thread, in order, as
    soon as frame ``i`` is verified (the reads after it go on meanwhile). It returns
    whether it took the frame: False stops the run there (no further frame read, none
    delivered), as does an exception it raises, which is raised here once the reads in
    flight ended. Returns how many frames were taken. Raises RuntimeError when the
    extension is not available (callers ask :func:`available` first) and ValueError for
    a frame whose buffers do not fit it."""
    if not callable(on_frame):
        raise TypeError(f"on_frame must be callable, not {type(on_frame).__name__}")
    loaded = _loaded()
    if loaded is None:
        raise RuntimeError("kvlife.native._frames is not available")
    module, addr = loaded

    def took(i: int, status: int, err: int, got: int) -> bool:
        return on_frame(i, FrameOutcome(status, err, got))

    taken: int = module.read_run(
        [(f.fd, f.offset, f.header, f.body, f.nbytes, f.header_want, f.checksum) for f in frames],
        max(1, min(depth, MAX_DEPTH)),
        addr,
        took,
    )
    return taken


class DirectRun(Protocol):
    """Direct frame reads under way (:func:`start_direct`)."""

    @property
    def reading(self) -> int:
        """Frames being read (their files opened); 0 once the run is spent."""
        ...

    def step(self) -> bool:
        """Verify the next frame in order, the interpreter lock released (the reads
        after it go on): whether it read whole and verified. False from the first that
        did not, and once every frame was stepped; the run is not spent."""
        ...

    def progress(self, at_least: int) -> int:
        """Bytes of the next frame to step that landed, not verified until ``step`` says
        so, the interpreter lock released while it waits. A frame read in pieces
        (:data:`DEFAULT_PIECE`): those hashed so far, once at least ``at_least`` were or its
        read ended (hashing what lands meanwhile, as ``step`` would). A frame read
        whole: its whole payload once it landed. 0 where its header differs or its read
        failed, a frame in pieces landed before it was asked, or none is left."""
        ...

    def finish(self) -> int:
        """Verify the frames in order, the interpreter lock released; how many from the
        first read whole and verified (the first that did not ends it, and no read
        after it starts; frames ``step`` verified are not checked again). The run is
        spent: its files closed, its buffers let go."""
        ...

    def close(self) -> None:
        """Stop without verifying, once the reads in flight ended (idempotent)."""
        ...


DirectFrame = tuple[str, int, np.ndarray, int, bytes, bytes]
"""One frame a direct run reads: its segment file's path, its offset, the buffer its
payload lands in (writable, C-contiguous, whole aligned pages), the payload's length, the
header bytes it was written with and its xxh3-128 (a tuple: a load builds a few, cold)."""


def start_direct(frames: Sequence[DirectFrame], depth: int) -> DirectRun:
    """Open each frame's file (once per path: O_DIRECT where it can, no link followed,
    a regular file only) and start reading the frames with up to ``depth`` reads in
    flight, at least one, before returning: the caller works meanwhile, then calls
    ``finish``. Frames from the first whose file cannot be opened are not read.
    RuntimeError when the extension is not available; ValueError for a frame whose
    offset or buffer O_DIRECT cannot take (nothing read)."""
    loaded = _loaded()
    if loaded is None:
        raise RuntimeError("kvlife.native._frames is not available")
    module, addr = loaded
    run: DirectRun = module.start_direct(frames, max(1, min(depth, MAX_DEPTH)), addr)
    return run
