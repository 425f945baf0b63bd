"""Reads of the disk tier: verified, in the caller's thread, beside one writer.

A read looks its rows up and pins their segments under the tier lock, then reads and
verifies each frame without it (the header against the catalog row, the payload's
xxh3-128 against the row's checksum) before anything is handed out: the verified array,
or a typed miss (:class:`~kvlife.core.errors.ChecksumMismatch`,
:class:`~kvlife.core.errors.ReplicaReadError`), never wrong bytes. A frame goes
straight into the caller's buffer when its memory is aligned, else through a staging
buffer; without a buffer into a new array from memory recycled once earlier results
were garbage collected, returned read-only.

Reads neither wait for the writer's I/O nor for each other. The tier's ``io_depth`` is
shared among concurrent callers: one caller alone gets ``io_depth - 1`` helper threads
(from a pool of :data:`READ_HELPERS` shared by the tier), and every caller of two or
more frames gets at least one (:data:`PIPELINE`), so that its checksum of one frame
overlaps the read of the next: N callers keep max(2N, io_depth) reads in flight.

``read_pipelined`` reads a run of frames the other way round: one after another in the
caller's thread, each issued as soon as the one before it returned, each verified on a
thread of the tier's check pool (:data:`CHECKERS`, never the read helpers) meanwhile,
so the reading thread never waits for a checksum (the store uses it for a load on one
CPU, where a helper that had to issue the next read could not run before the reader's
checksum was done). Each read after the first looks its row up again and stops the run
at one deleted or replaced since (an invalidation took it: not read).

A read in the caller's thread signals :func:`~kvlife.tiers.base.device_read_returned`
as soon as its ``preadv`` returned, before the frame is verified: a caller that reads
one chunk at a time (the store's ``load_async`` with a depth) submits its next read
from there, so that the checksum overlaps it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, ReplicaReadError
from kvlife.core.identity import ChunkKey
from kvlife.native.copies import stream_copy
from kvlife.native.spans import Span, spans
from kvlife.tiers.base import ReadResult, device_read_returned, read_only
from kvlife.tiers.buffers import (
    ALIGN,
    RecyclingPool,
    StagingPool,
    aligned_empty,
    aligned_runs,
    round_up,
)
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.counters import DiskStats
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES
from kvlife.tiers.disk.native_reads import read_frames, single_run, usable
from kvlife.tiers.disk.segments import Segment, SegmentTable

READ_HELPERS = 16
"""Threads shared by all readers of a tier to keep more than one read of a call in flight."""

PIPELINE = 2
"""Reads of one call in flight at least (when it has that many frames), however many
callers share ``io_depth``: with one, a caller's checksum of frame i and its Python
ran before the read of frame i + 1 was issued, so each caller left the device idle
for that long per frame (issue 28)."""

RUN_DEPTH = 1
"""Reads in flight of one ``read_pipelined`` run on the native path (the Python path
reads one at a time too). Measured (issue 28, 2026-12-04, two servers alternated call
by call, 4-chunk loads into ordinary / shared buffers, ratio to raw reads): two in
flight 0.545 / 0.628 against 0.542 / 0.646 at 2 MiB, 0.611 / 0.775 against 0.656 /
0.780 at 16 MiB (and 0.548 / 0.655 against 0.570 / 0.667, 0.663 / 0.828 against
0.748 / 0.832)."""

BATCH_DEPTH = 2
"""Reads in flight of one ``read_batch`` on the native path at most. A batch of as many
frames as reads in flight issues them all at once; on this virtual disk they end
together and their checks run one after another after the last (docs/store.md). Measured
(issue 28, 2026-12-04, machine alone, the tier's ``read_batch`` into buffers, depths
alternated call by call, median ms): 4 x 2 MiB 2.98 / 2.88 / 3.28 at two / three / four
in flight (and 2.81 against 3.06 at two and four), 4 x 16 MiB 18.2 / 18.3 / 19.7, 16 x 2
MiB 10.4 / 10.2 / 10.4; one in flight 3.25, 19.7, 10.8.

Its share of ``io_depth`` when that is fewer, one at least: with four callers or more
each keeps one read in flight (the native run still reads the next frame while the
caller checks the last), so the device sees about ``io_depth`` or one per caller, as
raw reads at that queue depth do, not two per caller (the Python path's
:data:`PIPELINE`). Measured (2026-12-04, machine alone, T threads each looking up and
loading 4-chunk prompts of 2 MiB from one store, 1 s slices alternated, 8-10 rounds):
one per caller against two, 3.37 / 3.20 against 3.13 / 2.97 GB/s at T = 4, 3.14 /
3.68 against 3.04 / 3.56 at T = 8 (two callers: two each either way, 2.72 against
2.77)."""

CHECKERS = 4
"""Threads shared by all ``read_pipelined`` calls of a tier to verify the frames read
(CPU only: a stalled device read elsewhere never holds one)."""

_local = threading.local()


def _header_buffer() -> np.ndarray:
    """This thread's aligned buffer for the header of the frame it reads (a thread reads
    one frame at a time, and nothing keeps the header after the read's verification):
    one allocation per thread, not one per read."""
    hdr: np.ndarray | None = getattr(_local, "hdr", None)
    if hdr is None:
        hdr = _local.hdr = aligned_empty(HEADER_BYTES)
    return hdr


def _direct_runs(out: np.ndarray, span: Span | None = None) -> list[np.ndarray] | None:
    """``out``'s memory as the pieces a direct read lands in (:func:`aligned_runs`), the
    common case first: a C-contiguous aligned buffer is one piece, found without
    walking its axes. ``span``: where ``out`` lies, if the caller has it already."""
    if span is None:
        span = spans([out])[0]
    if span.c_contiguous:
        if out.nbytes % ALIGN or span.low % ALIGN:
            return None
        return [out.reshape(-1).view(np.uint8)]
    return aligned_runs(out)


def _check_out(row: CatalogRow, out: np.ndarray | None) -> None:
    """InvalidArgument (before anything is read) for an output buffer that does not fit
    its replica or cannot be written."""
    if out is None:
        return
    if out.shape != row.shape or out.dtype != np.dtype(row.dtype):
        raise InvalidArgument(
            f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
            f"{row.dtype}{list(row.shape)}"
        )
    if not out.flags.writeable:
        raise InvalidArgument(f"output buffer {out.dtype}{list(out.shape)} is read-only")


def _native_runs(outs: Sequence[np.ndarray | None]) -> list[list[np.ndarray] | None] | None:
    """Each buffer's aligned pieces (None: no buffer, or one to stage), or None when a
    buffer would land in several pieces (the native path reads into one)."""
    where = iter(spans([out for out in outs if out is not None]))  # one call for all
    runs = [_direct_runs(out, next(where)) if out is not None else None for out in outs]
    if all(single_run(out, r) for out, r in zip(outs, runs, strict=True)):
        return runs
    return None


def _kept(results: list[ReadResult], res: ReadResult) -> bool:
    results.append(res)
    return True


@dataclass(slots=True)
class _Landed:
    """A frame whose device read returned, not yet verified."""

    row: CatalogRow
    out: np.ndarray | None
    hdr: np.ndarray
    """Its header, read into a buffer of its own (the next read does not reuse it)."""
    payload: list[np.ndarray]
    staged: np.ndarray | None
    """The staging buffer it was read into, given back once it is checked."""


class Reader:
    """Verified reads of one disk tier, safe from many threads at once."""

    def __init__(
        self,
        name: str,
        table: SegmentTable,
        io: FileIO,
        staging: StagingPool,
        io_depth: int,
        read_pool_bytes: int,
        stats: DiskStats,
    ) -> None:
        self.name = name
        self._table = table
        self.io = io
        self._staging = staging
        self._io_depth = io_depth
        self.stats = stats
        self._new_arrays = RecyclingPool(read_pool_bytes)
        self._read_pool: ThreadPoolExecutor | None = None
        self._check_pool: ThreadPoolExecutor | None = None
        self._callers = 0
        """Reads in progress (under the tier lock): how ``io_depth`` is shared."""

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        """Verified reads, safe from many threads at once and beside one writer.

        The tier lock is held only to look the rows up and pin their segments (a pinned
        segment is unlinked by compaction or its last delete only when its last reader
        leaves); the reads run without it, in the caller's thread plus helpers. The
        tier's ``io_depth`` is shared among concurrent callers (one alone gets
        ``io_depth - 1`` helpers, each of many at least one when it reads two frames or
        more), so N callers keep max(2N, io_depth) reads in flight.
        """
        if outs is not None and len(outs) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        table = self._table
        with table.lock:
            rows = [table.row(k) for k in keys]
            pinned = table.pin_rows(rows)
            self._callers += 1
            fair = self._io_depth // self._callers
        share = max(PIPELINE, fair)
        # the native run pipelines even with one read in flight (its reader thread reads
        # on while this one checks): no floor of two per caller there
        native_depth = max(1, min(BATCH_DEPTH, fair))
        got: list[int] = []
        try:
            plan = [
                (row, pinned[row.seg], outs[i] if outs is not None else None)
                for i, row in enumerate(rows)
            ]
            for row, _, out in plan:
                _check_out(row, out)
            # new arrays are mapped here, before any read: a mapping made on a helper
            # while the others' reads fault fresh pages in waits for all of them (the
            # process's memory map lock), 27 ms per 16 MiB array measured, 0.2x of the
            # reads into recycled arrays on the first batch
            bodies = [
                self._new_arrays.take(round_up(row.nbytes)) if out is None else None
                for row, _, out in plan
            ]
            if len(plan) > 1 and usable(self.io):
                runs = _native_runs([out for _, _, out in plan])
                if runs is not None:
                    results: list[ReadResult] = []
                    read_frames(
                        rows,
                        [seg for _, seg, _ in plan],
                        [out for _, _, out in plan],
                        runs,
                        bodies,
                        self._staging,
                        native_depth,
                        got,
                        self._where,
                        lambda _, res: _kept(results, res),
                    )
                    return results
            return self._read_all(plan, bodies, got, share)
        finally:
            with table.lock:
                self._callers -= 1
                self.stats.bytes_read += sum(got)
                retired = table.unpin(pinned.values())
            table.remove(retired, quiet=True)

    def read_pipelined(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[np.ndarray | None],
        done: Callable[[int, ReadResult], None],
        proceed: Callable[[], bool] | None = None,
    ) -> int:
        """Read the frames of ``keys`` one after another in this thread, each issued as
        soon as the one before it returned, and verify each on a helper thread
        meanwhile; ``done(i, result)`` is called (on the helper, or here for a read that
        failed) once frame ``i``'s outcome is known, in no set order. Before each read
        after the first, ``proceed`` is asked and the frame's row looked up again: False,
        or a row deleted or replaced since the call began (an invalidation, an
        eviction), stops there, the frames from it on neither read nor given to
        ``done`` (the caller reads them one at a time, as ``read_batch`` would, or not at
        all). Returns, once every ``done`` has returned, how many frames were read;
        raises ReplicaNotFound (nothing read) when a key has no replica here,
        InvalidArgument (nothing read) for a buffer that does not fit its replica, and
        whatever a ``done`` raised (after the others ran).

        This thread never hashes: on a CPU shared with the verifier, the next read is
        issued while the last one's checksum runs, and the device is never idle for
        it (issue 28: the store's load of a few chunks, one at a time, handed the next
        read to another thread instead, which on one CPU could not issue it before this
        one's checksum was done; measured through ``kvlife serve``, docs/server.md)."""
        if len(outs) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        table = self._table
        with table.lock:
            rows = [table.row(k) for k in keys]
            pinned = table.pin_rows(rows)
        got: list[int] = []
        try:
            for row, out in zip(rows, outs, strict=True):
                _check_out(row, out)
            if usable(self.io):
                runs = _native_runs(outs)
                if runs is not None:
                    return self._pipeline_native(rows, pinned, outs, runs, done, proceed, got)
            return self._pipeline(rows, pinned, outs, done, proceed, got)
        finally:
            with table.lock:
                self.stats.bytes_read += sum(got)
                retired = table.unpin(pinned.values())
            table.remove(retired, quiet=True)

    def _pipeline(
        self,
        rows: list[CatalogRow],
        pinned: dict[int, Segment],
        outs: Sequence[np.ndarray | None],
        done: Callable[[int, ReadResult], None],
        proceed: Callable[[], bool] | None,
        got: list[int],
    ) -> int:
        pool = self._checker_pool()
        hdrs = aligned_empty(HEADER_BYTES * len(rows))
        checks: list[Future[None]] = []
        table = self._table

        def check(i: int, landed: _Landed) -> None:
            done(i, self._check(landed))

        read = 0
        try:
            for i, (row, out) in enumerate(zip(rows, outs, strict=True)):
                if i and proceed is not None and not proceed():
                    break
                if i:
                    with table.lock:  # gone or replaced since: not read here
                        if table.rows.get(ChunkKey(row.key)) is not row:
                            break
                read += 1
                hdr = hdrs[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                landed = self._land(row, pinned[row.seg], out, got, hdr)
                if isinstance(landed, _Landed):
                    checks.append(pool.submit(check, i, landed))
                else:
                    done(i, landed)
        finally:
            failed: BaseException | None = None
            for c in checks:  # every submitted check ends before the segments unpin
                try:
                    c.result()
                except BaseException as exc:
                    failed = failed or exc
        if failed is not None:
            raise failed
        return read

    def native(self) -> bool:
        """Whether runs are read through the C extension (:mod:`.native_reads`)."""
        return usable(self.io)

    def _pipeline_native(
        self,
        rows: list[CatalogRow],
        pinned: dict[int, Segment],
        outs: Sequence[np.ndarray | None],
        runs: list[list[np.ndarray] | None],
        done: Callable[[int, ReadResult], None],
        proceed: Callable[[], bool] | None,
        got: list[int],
    ) -> int:
        """``read_pipelined`` through the C extension: the run read and verified in one
        call outside the interpreter lock, each frame handed to ``done`` in this thread
        as soon as it is verified, once its row was looked up again (and ``proceed``
        asked): a frame whose row was deleted or replaced by then stops the run there,
        it and the frames after it not given to ``done`` (the caller reads them one at
        a time). A stricter rule than the Python path's look-up before each read: an
        invalidation that lands while a frame is read is seen too."""
        bodies = [
            self._new_arrays.take(round_up(row.nbytes)) if out is None else None
            for row, out in zip(rows, outs, strict=True)
        ]
        table = self._table
        failed: list[BaseException] = []

        def take(i: int, res: ReadResult) -> bool:
            if i:
                if proceed is not None and not proceed():
                    return False
                with table.lock:  # gone or replaced since: not handed out
                    if table.rows.get(ChunkKey(rows[i].key)) is not rows[i]:
                        return False
            try:
                done(i, res)
            except BaseException as exc:  # raised once every frame taken was given
                failed.append(exc)
            return True

        taken = read_frames(
            rows,
            [pinned[row.seg] for row in rows],
            outs,
            runs,
            bodies,
            self._staging,
            RUN_DEPTH,
            got,
            self._where,
            take,
        )
        if failed:
            raise failed[0]
        return taken

    def _read_all(
        self,
        plan: list[tuple[CatalogRow, Segment, np.ndarray | None]],
        bodies: list[np.ndarray | None],
        got: list[int],
        depth: int,
    ) -> list[ReadResult]:
        n = len(plan)
        results: list[ReadResult | None] = [None] * n
        helpers_wanted = min(depth, n) - 1
        if helpers_wanted <= 0:
            for i, (row, seg, out) in enumerate(plan):
                results[i] = self._read_one(row, seg, out, got, bodies[i])
        else:
            # Work sharing: the caller and its helpers each take the next frame. The
            # caller never waits for a helper to start, so a pool that is busy (or has a
            # worker stalled in a device read) slows a batch down but never blocks it.
            counter = itertools.count()

            def work() -> None:
                while (i := next(counter)) < n:
                    row, seg, out = plan[i]
                    results[i] = self._read_one(row, seg, out, got, bodies[i])

            pool = self._reader_pool()
            helpers = [pool.submit(work) for _ in range(helpers_wanted)]
            work()
            for h in helpers:
                if not h.cancel():
                    h.result()
        done: list[ReadResult] = []
        for r in results:
            if r is None:  # every index is taken by exactly one worker: a bug if not
                raise RuntimeError("a frame of the batch was not read")
            done.append(r)
        return done

    def _checker_pool(self) -> ThreadPoolExecutor:
        """The threads that verify ``read_pipelined``'s frames: never the read helpers,
        which a stalled device read can hold (a check never waits on the device)."""
        with self._table.lock:
            if self._check_pool is None:
                self._check_pool = ThreadPoolExecutor(
                    max_workers=CHECKERS, thread_name_prefix="kvlife-check"
                )
            return self._check_pool

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._table.lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(
                    max_workers=READ_HELPERS, thread_name_prefix="kvlife-read"
                )
            return self._read_pool

    def _read_one(
        self,
        row: CatalogRow,
        seg: Segment,
        out: np.ndarray | None,
        got: list[int],
        body: np.ndarray | None = None,
    ) -> ReadResult:
        """Read and verify one frame: straight into ``out`` when its memory is aligned,
        else into a staging buffer (then copied); without ``out`` into a recycled array
        (``body``, taken from the pool already, or taken now)."""
        landed = self._land(row, seg, out, got, _header_buffer(), body)
        return self._check(landed) if isinstance(landed, _Landed) else landed

    def _land(
        self,
        row: CatalogRow,
        seg: Segment,
        out: np.ndarray | None,
        got: list[int],
        hdr: np.ndarray,
        body: np.ndarray | None = None,
    ) -> _Landed | ReadResult:
        """The device read of one frame, its header into ``hdr``: the frame for
        :meth:`_check` to verify, or the read's typed miss. ``body``: the new array's
        memory where there is no ``out`` (None: taken from the pool now)."""
        staged: np.ndarray | None = None
        runs = _direct_runs(out) if out is not None else None
        if runs is not None:
            payload = runs
            bufs = [hdr, *runs]
        elif out is not None:
            staged = self._staging.get(round_up(row.nbytes))
            body = staged[: round_up(row.nbytes)]
            payload = [body[: row.nbytes]]
            bufs = [hdr, body] if row.nbytes else [hdr]
        else:
            if body is None:
                body = self._new_arrays.take(round_up(row.nbytes))
            payload = [body[: row.nbytes]]
            bufs = [hdr, body] if row.nbytes else [hdr]
        landed = False
        try:
            try:
                n = self.io.preadv(seg.fd, bufs, row.off)
            except OSError as exc:
                return ReplicaReadError(row.key.hex(), self._where(row), str(exc))
            finally:
                device_read_returned()  # a one-chunk-at-a-time caller submits its next read
            need = HEADER_BYTES + row.nbytes
            if n < need:
                return ChecksumMismatch(
                    row.key.hex(), self._where(row), f"truncated: {n} of {need} bytes"
                )
            got.append(n)
            landed = True
            return _Landed(row, out, hdr, payload, staged)
        finally:
            if staged is not None and not landed:
                self._staging.put(staged)

    def _check(self, landed: _Landed) -> ReadResult:
        """Verify a frame whose read returned (its header against the row, its
        payload's xxh3-128 against the row's checksum), then hand its bytes out: the
        caller's buffer (copied there from a staging buffer if it was read into one), or
        a new read-only array."""
        row, out, payload = landed.row, landed.out, landed.payload
        try:
            problem = row.verify(landed.hdr.data, payload)
            if problem:
                return ChecksumMismatch(row.key.hex(), self._where(row), problem)
            if out is None:  # a new array: read-only from the start, for good
                return read_only(payload[0]).view(np.dtype(row.dtype)).reshape(row.shape)
            if landed.staged is not None:
                stream_copy(out, payload[0].view(np.dtype(row.dtype)).reshape(row.shape))
            return out
        finally:
            if landed.staged is not None:
                self._staging.put(landed.staged)

    def _where(self, row: CatalogRow) -> str:
        return f"{self.name} seg-{row.seg:08d}@{row.off}"

    def close(self) -> None:
        """Stop the helper threads (no read may be in flight after)."""
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=True)
