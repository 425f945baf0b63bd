"""The disk tier's reads of a run of frames through the C extension (issue 28).

:func:`read_frames` lays out where each frame lands (exactly as the Python path's
``Reader._land``: straight into an aligned caller buffer, else a staging buffer, else a
new array's memory), hands the run to :func:`kvlife.native.frames.read_run` (reads and
checksums outside the interpreter lock, the checksum of one frame overlapping the reads
of the next) and turns each frame's status into what the Python path returns for it:
the verified array, or the same typed miss with the same message. A header that is not
byte for byte the one the row was written with is judged by ``CatalogRow.verify``
(another format version's header can be valid).

Used only where the tier's :class:`~kvlife.tiers.disk.fileio.FileIO` reads with its
own ``preadv``: a subclass or a patched one (the fault-injection seam of the tests)
reads through it, on the Python path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvlife.core.errors import ChecksumMismatch, ReplicaReadError
from kvlife.native import frames as native
from kvlife.native.copies import stream_copy
from kvlife.tiers.base import ReadResult, read_only
from kvlife.tiers.buffers import StagingPool, aligned_empty, round_up
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES
from kvlife.tiers.disk.segments import Segment

_PLAIN_PREADV = FileIO.preadv
"""FileIO's own ``preadv``, as imported (a class-level patch replaces the attribute)."""


def usable(io: FileIO) -> bool:
    """Whether reads through ``io`` may take the native path: its ``preadv`` is
    FileIO's own (not a subclass's, not one patched on the object or the class: a
    test's faults go through it)."""
    return getattr(io.preadv, "__func__", None) is _PLAIN_PREADV and native.available()


KEPT_HEADERS = 64
"""Frame headers' room a thread keeps between runs at most (256 KiB)."""

_local = threading.local()


@contextmanager
def headers(n: int) -> Iterator[np.ndarray]:
    """Aligned room for ``n`` frame headers, for one run: this thread's buffer, grown
    when a run needs more (up to :data:`KEPT_HEADERS`), unless a run of this thread is
    using it (a ``take`` that reads again): one allocation per thread, not one per run
    (an aligned allocation was 17 us of a served load's set-up; issue 28). Nothing
    keeps a header once its frame was handed out."""
    need = HEADER_BYTES * max(n, 1)
    held: np.ndarray | None = getattr(_local, "headers", None)
    if n > KEPT_HEADERS or getattr(_local, "busy", False):
        yield aligned_empty(need)
        return
    if held is None or held.nbytes < need:
        held = _local.headers = aligned_empty(need)
    _local.busy = True
    try:
        yield held
    finally:
        _local.busy = False


@dataclass(slots=True)
class _Planned:
    row: CatalogRow
    out: np.ndarray | None
    payload: np.ndarray
    staged: np.ndarray | None


def single_run(out: np.ndarray | None, runs: list[np.ndarray] | None) -> bool:
    """Whether a frame for ``out`` lands in one buffer (the native path's case): no
    buffer, an unaligned one (staged), or an aligned one of one piece."""
    return out is None or runs is None or len(runs) == 1


def read_frames(
    rows: Sequence[CatalogRow],
    segs: Sequence[Segment],
    outs: Sequence[np.ndarray | None],
    runs: Sequence[list[np.ndarray] | None],
    bodies: Sequence[np.ndarray | None],
    staging: StagingPool,
    depth: int,
    got: list[int],
    where: Callable[[CatalogRow], str],
    take: Callable[[int, ReadResult], bool],
) -> int:
    """Read and verify one frame per row, ``depth`` reads in flight, and hand each
    outcome, in order, to ``take(i, result)`` as soon as it is known (the reads after it
    go on meanwhile); ``take`` returns False to stop there (frame ``i`` not taken, no
    further one read). ``runs[i]``: the aligned pieces of ``outs[i]`` (one, by
    :func:`single_run`) or None (staged); ``bodies[i]``: a new array's memory where
    ``outs[i]`` is None. Bytes read are added to ``got`` for every frame handed out whose
    read returned whole. Returns how many frames were taken."""
    with headers(len(rows)) as hdrs:
        planned: list[_Planned] = []
        reads: list[native.FrameRead] = []
        try:
            for i, (row, seg, out) in enumerate(zip(rows, segs, outs, strict=True)):
                staged = None
                run = runs[i]
                if out is not None and run is not None:
                    body = run[0]
                elif out is not None:
                    staged = staging.get(round_up(row.nbytes))
                    body = staged[: round_up(row.nbytes)]
                else:
                    taken = bodies[i]
                    assert taken is not None
                    body = taken[: round_up(row.nbytes)]
                planned.append(_Planned(row, out, body[: row.nbytes], staged))
                reads.append(
                    native.FrameRead(
                        seg.fd,
                        row.off,
                        hdrs[i * HEADER_BYTES : (i + 1) * HEADER_BYTES],
                        body,
                        row.nbytes,
                        row.header(),
                        row.checksum,
                    )
                )

            def on_frame(i: int, o: native.FrameOutcome) -> bool:
                hdr = hdrs[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                return take(i, _result(planned[i], o, hdr, got, where))

            return native.read_run(reads, depth, on_frame)
        finally:
            for p in planned:
                if p.staged is not None:
                    staging.put(p.staged)


def _result(
    p: _Planned,
    o: native.FrameOutcome,
    hdr: np.ndarray,
    got: list[int],
    where: Callable[[CatalogRow], str],
) -> ReadResult:
    row = p.row
    if o.status == native.READ_ERROR:
        return ReplicaReadError(
            row.key.hex(), where(row), str(OSError(o.errno, os.strerror(o.errno)))
        )
    if o.status == native.TRUNCATED:
        need = HEADER_BYTES + row.nbytes
        return ChecksumMismatch(row.key.hex(), where(row), f"truncated: {o.got} of {need} bytes")
    got.append(o.got)
    if o.status == native.CHECKSUM_MISMATCH:
        return ChecksumMismatch(row.key.hex(), where(row), "payload checksum mismatch")
    if o.status == native.HEADER_DIFFERS:
        problem = row.verify(hdr.data, [p.payload])
        if problem:
            return ChecksumMismatch(row.key.hex(), where(row), problem)
    elif o.status != native.OK:  # the extension returns no other status
        raise RuntimeError(f"native read returned status {o.status}")
    if p.out is None:  # a new array: read-only from the start, for good
        return read_only(p.payload).view(np.dtype(row.dtype)).reshape(row.shape)
    if p.staged is not None:
        stream_copy(p.out, p.payload.view(np.dtype(row.dtype)).reshape(row.shape))
    return p.out
