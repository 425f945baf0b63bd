"""Direct disk reads, client side (issue 28): the frames a lookup named, read and
verified here while the server confirms the chunks live in them. Why this serves no
wrong KV, and the server's side: :mod:`kvlife.store.direct`.

A lookup asked with ``direct`` names each disk hit's frame: the segment file, the
offset and the header the frame was written with (:func:`parse_frames` checks it once:
its own checksum, the hit's key, an exact replica). A load of hits that are all named,
into buffers O_DIRECT can fill (C-contiguous, aligned, the frame's dtype and shape),
reads them with the extension's native run (:func:`read_frames`): the header read is
compared byte for byte with the named one, and the payload's xxh3-128 with the checksum
that header holds, while the load's one request asks the server to confirm them. Each
segment file is opened for the load and closed after it: a descriptor kept open would
keep a segment that compaction removed on the disk.
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
from kvlife.native.spans import spans
from kvlife.tiers.buffers import ALIGN
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED, FrameError, unpack_header
from kvlife.tiers.disk.native_reads import headers

DEPTH = 1
"""Frame reads in flight (the checksum of one overlaps the read of the next), as in the
disk tier's pipelined reads of a served load (:data:`kvlife.tiers.disk.reader.RUN_DEPTH`)."""


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
            and seg >= 0
            and off >= 0
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
    """Whether a load of hits with these frames into ``outs`` can read them here: the
    extension is built, every hit has a frame, and every buffer is its frame's payload
    (dtype, shape), C-contiguous, writable and aligned for O_DIRECT (else the load goes
    through the server, which stages such reads)."""
    if not frames or len(frames) != len(outs) or not native.available():
        return False
    for f, out in zip(frames, outs, strict=True):
        if f is None or out.dtype != f.dtype or out.shape != f.shape or out.nbytes != f.nbytes:
            return False
    for span, out in zip(spans(list(outs)), outs, strict=True):
        if not (span.c_contiguous and span.writable) or span.low % ALIGN or out.nbytes % ALIGN:
            return False
    return True


def _open(path: str) -> int:
    """``path`` for reading, O_DIRECT where its filesystem takes it; OSError unless it
    is a regular file. Opened without blocking (a FIFO named there would wait for a
    writer, the connection's lock held): a regular file's reads block as ever."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_frames(frames: Sequence[Frame], outs: Sequence[np.ndarray]) -> int:
    """Read and verify each frame into its buffer (:func:`usable` said they fit), in
    order; how many from the first verified. A frame that does not (moved, torn,
    rewritten, of another format), or whose file cannot be opened or read, ends it:
    that chunk and the ones after it are left to the server."""
    fds: dict[str, int] = {}
    try:
        reads: list[native.FrameRead] = []
        with headers(len(frames)) as hdrs:
            for i, (f, out) in enumerate(zip(frames, outs, strict=True)):
                fd = fds.get(f.path)
                if fd is None:
                    try:
                        fd = fds[f.path] = _open(f.path)
                    except (OSError, ValueError):
                        break  # gone since the lookup (compacted): the rest from the server
                body = out.reshape(-1).view(np.uint8)
                head = hdrs[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                reads.append(
                    native.FrameRead(fd, f.off, head, body, f.nbytes, f.header, f.checksum)
                )
            if not reads:
                return 0
            try:
                return native.read_run(reads, DEPTH, _whole)
            except (OSError, ValueError):
                return 0
    finally:
        for fd in fds.values():
            os.close(fd)


def _whole(i: int, outcome: native.FrameOutcome) -> bool:
    """A frame is taken when it read whole and matched its header and checksum."""
    return outcome.status == native.OK


def confirmed(r: Any, n: int) -> int:
    """A direct load's reply: how many chunks the server confirmed (ProtocolError for a
    reply of anything else)."""
    got = r.get("confirmed") if isinstance(r, dict) else None
    if type(got) is not int or not 0 <= got <= n:
        raise errors.ProtocolError(f"direct load reply is not a count of 0..{n}: {str(r)[:64]}")
    return got
