"""Direct disk reads, client side (issue 28): the frames a lookup named, read and
verified here while the server confirms the chunks live in them. Why this serves no
wrong KV, and the server's side: :mod:`kvlife.store.direct`.

A lookup asked with ``direct`` names each disk hit's frame: the segment file, the
offset and the header the frame was written with (:func:`parse_frames` checks it once:
its own checksum, the hit's key, an exact replica). A load of hits that are all named,
into buffers O_DIRECT can fill (C-contiguous, aligned, the frame's dtype and shape),
starts reading them in the extension's threads (:func:`start_reads`) before the load's
one request asks the server to confirm them, and verifies them (the header read compared
byte for byte with the named one, the payload's xxh3-128 with the checksum that header
holds) once the reply is in. Each segment file is opened for the load and closed after
it: a descriptor kept open would keep a segment that compaction removed on the disk.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlife.core import errors
from kvlife.core.errors import StoreFormatError
from kvlife.core.objects import EXACT
from kvlife.native import frames as native
from kvlife.tiers.buffers import ALIGN
from kvlife.tiers.disk.frame import HEADER_USED, FrameError, unpack_header

DEPTH = 4
"""The most frame reads in flight (the checksum of one overlaps the reads after it):
runs of chunks smaller than :data:`LARGE_CHUNK` keep this many, runs of larger ones
:data:`LARGE_DEPTH` (:func:`depth_for`).

4, not 1 (issue 28, 2026-12-07, one server pinned to CPU 1, this client on CPU 0, loads
without buffers of a prompt's disk hits, depths alternated load by load with the same
load through the server and raw reads of the same bytes, 30 rounds; ratios of raw
reads): 64 KiB x 32 chunks 0.91 / 1.26 / 1.49 at depth 1 / 2 / 4 (through the server
0.86), 256 KiB x 16 1.14 / 1.45 / 1.59 (1.15), 1 MiB x 8 1.27 / 1.56 / 1.67 (1.53), 2 MiB
x 4 0.87 / 0.97 / 0.95 (0.69), 16 MiB x 4 0.94 at every depth (0.92). At one read in
flight this device's fixed cost per read (60-85 µs) is paid chunk after chunk, and
loads of chunks of 1 MiB or less read directly were slower than through the server,
whose reads of such chunks overlap."""

LARGE_CHUNK = 2 << 20
"""Chunks of at least this many bytes are read :data:`LARGE_DEPTH` at a time."""

LARGE_DEPTH = 2
"""Frame reads in flight for chunks of :data:`LARGE_CHUNK` and more.

Two, not four (2026-12-08, the slower machine of issue 28: the extension's verified
reads of a prompt's frames alone, into a shared buffer on a huge-page tmpfs, depths
alternated run by run with raw reads of the same frames, 40 rounds; ratios of those
raw reads at depth 1 / 2 / 4): 256 KiB x 32 0.95 / 1.08 / 1.21, 1 MiB x 8 0.96 / 1.06 /
1.01, 2 MiB x 4 0.90 / 0.94 / 0.83, 16 MiB x 4 0.92 / 0.92 / 0.85. Four large reads in
flight finish together, and the checksums of all but the first wait for the last read
instead of overlapping the reads after them (each read's bytes come from memory, not
from the caches: a 2 MiB hash right after its read took 150-216 µs, as long as one of
memory the caches had dropped, 196-214 µs). The earlier figures agree at 2 MiB (0.97
at depth 2, 0.95 at 4) and found no depth better at 16 MiB."""


@dataclass(frozen=True, slots=True)
class Frame:
    """Where one hit's frame is and what it must verify to."""

    path: str
    seg: int
    off: int
    header: bytes
    """The used bytes of its header, as the server's row says the frame was written."""
    checksum: bytes
    nbytes: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


def depth_for(frames: Sequence[Frame]) -> int:
    """Frame reads in flight for a run of ``frames``: :data:`DEPTH`, or
    :data:`LARGE_DEPTH` where its largest frame is of :data:`LARGE_CHUNK` or more."""
    largest = max((f.nbytes for f in frames), default=0)
    return LARGE_DEPTH if largest >= LARGE_CHUNK else DEPTH


def parse_frames(value: object, keys: Sequence[bytes]) -> tuple[Frame | None, ...]:
    """A lookup reply's ``frames`` (one per hit: ``[path, segment, offset, header]`` or
    nil). Each header must parse (its own checksum), name the hit's key and an exact
    replica; a frame that does not is ProtocolError, as is anything else of another
    shape: a frame that verifies against its header then holds that key's bytes."""
    if not isinstance(value, list) or len(value) != len(keys):
        raise errors.ProtocolError("lookup reply's frames are not one per hit")
    out: list[Frame | None] = []
    for key, f in zip(keys, value, strict=True):
        if f is None:
            out.append(None)
            continue
        if not (isinstance(f, list) and len(f) == 4):
            raise errors.ProtocolError(f"lookup reply's frame is not 4 fields: {str(f)[:64]}")
        path, seg, off, header = f
        if not (
            type(path) is str
            and os.path.isabs(path)
            and "\0" not in path
            and type(seg) is int
            and type(off) is int
            and 0 <= seg < 1 << 63
            and 0 <= off < 1 << 63
            and off % ALIGN == 0
            and type(header) is bytes
            and len(header) == HEADER_USED
        ):
            raise errors.ProtocolError(f"lookup reply's frame of other types: {str(f)[:64]}")
        try:
            h = unpack_header(header)
            kind = np.dtype(h.dtype)
        except (FrameError, StoreFormatError, TypeError) as exc:
            raise errors.ProtocolError(f"lookup reply's frame header: {exc}") from None
        if h.key != key or h.transform != EXACT.name:
            raise errors.ProtocolError("lookup reply's frame header names another chunk")
        out.append(Frame(path, seg, off, header, h.checksum, h.payload_len, kind, h.shape))
    return tuple(out)


def usable(frames: Sequence[Frame | None], outs: Sequence[np.ndarray]) -> bool:
    """Whether a load of hits with these frames into ``outs`` may read them here: the
    extension is built, every hit has a frame, and every buffer is its frame's payload
    (dtype, shape). Whether O_DIRECT can fill each buffer (C-contiguous, writable, whole
    aligned pages) the extension checks as it starts (:func:`start_reads`, ValueError:
    the load goes through the server, which stages such reads)."""
    if not frames or len(frames) != len(outs) or not native.available():
        return False
    for f, out in zip(frames, outs, strict=True):
        if f is None or out.dtype != f.dtype or out.shape != f.shape or out.nbytes != f.nbytes:
            return False
    return True


def start_reads(frames: Sequence[Frame], outs: Sequence[np.ndarray]) -> native.DirectRun:
    """Start reading each frame into its buffer (:func:`usable` said they fit; a buffer
    O_DIRECT cannot fill is ValueError, nothing read): the extension opens each segment
    file once (O_DIRECT where it can, no link followed, a regular file only, without
    blocking: a FIFO named there would wait for a writer) and its threads read while
    the caller sends its request and reads the reply. Its
    ``finish()`` verifies them in order: the header read byte for byte against the
    named one, the payload's xxh3-128 against the checksum that header holds, and
    returns how many from the first verified. A frame that does not (moved, torn,
    rewritten, of another format), or whose file cannot be opened or read, ends it:
    that chunk and the ones after it are left to the server."""
    return native.start_direct(
        [
            (f.path, f.off, out, f.nbytes, f.header, f.checksum)
            for f, out in zip(frames, outs, strict=True)
        ],
        depth_for(frames),
    )


PASSING = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})
"""Errors of an open that say nothing of where the files are (this process or the
machine out of descriptors or memory for a moment): they turn no direct reads off."""


def unreachable(path: str) -> str | None:
    """Why this process cannot read the server's segment files at all, asked where a
    load's run opened none (its first frame's file, ``path``, did not open): the file's
    folder is not there or not a folder here (the server in another mount namespace, a
    container without its volume, another host), or the file is there and will not
    open or is not a regular file (another user's, a link). None where only the file is
    gone (a segment compacted away since the lookup: the next lookup names others) or
    it opens now, or failed for a reason of the moment (:data:`PASSING`)."""
    folder = os.path.dirname(path)
    try:
        if not stat.S_ISDIR(os.stat(folder).st_mode):
            return f"{folder} is not a folder here"
    except OSError as exc:
        return None if exc.errno in PASSING else f"{folder}: {exc.strerror or exc}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return None if exc.errno in PASSING else f"{path}: {exc.strerror or exc}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{path} is not a regular file"
    finally:
        os.close(fd)
    return None


def read_frames(frames: Sequence[Frame], outs: Sequence[np.ndarray]) -> int:
    """:func:`start_reads` and its ``finish()`` at once: how many frames, from the first,
    were read and verified into ``outs``."""
    return start_reads(frames, outs).finish()


def confirmed(r: Any, n: int) -> int:
    """A direct load's reply: how many chunks the server confirmed (ProtocolError for a
    reply of anything else)."""
    got = r.get("confirmed") if isinstance(r, dict) else None
    if type(got) is not int or not 0 <= got <= n:
        raise errors.ProtocolError(f"direct load reply is not a count of 0..{n}: {str(r)[:64]}")
    return got
