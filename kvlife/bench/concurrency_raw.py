"""Raw concurrent read limit: aligned O_DIRECT ``os.preadv`` from T threads at queue depth T.

The limit that kvlife's concurrent loads are measured against (``kvlife bench
concurrency``): what the device gives to plain reads issued the way the disk tier issues
them, fio-style. A file of ``file_bytes`` is written once (real data, no holes, made
durable); then, for each queue depth Q, Q threads each read ``block_bytes`` blocks at
random aligned offsets with synchronous ``os.preadv`` into their own warm aligned buffer,
so Q reads are in flight at once (``os.preadv`` releases the GIL). The page cache is
bypassed with O_DIRECT; where the filesystem refuses O_DIRECT (tmpfs) the reads are
buffered and the file's cached pages are dropped with ``posix_fadvise(DONTNEED)`` before
each point, which is as close as an unprivileged process gets (the result says so).

:func:`measure_raw_concurrency` returns a :class:`RawConcurrencyResult`.

:class:`RawFile` issues the same reads for a fixed time instead of a fixed count, from a
file prepared once, so that ``kvlife bench concurrency`` can alternate short slices of
raw reads with slices of its loads (paired: the device's swings from one second to the
next hit both alike); with a paced raw writer beside the reads (O_DIRECT ``pwrite`` of
the same block size and ``fdatasync``, same directory) it also gives the device's read
limit under a given write load (:class:`RawSlice`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvlife.bench.limits import process_cpu
from kvlife.core.errors import InvalidArgument, StorePathError
from kvlife.tiers.buffers import ALIGN, aligned_empty, prefault
from kvlife.tiers.disk.fileio import probe_direct_io

MiB = 1 << 20
DEFAULT_QUEUE_DEPTHS = (1, 4, 16)
_FILL_CHUNK = 8 * MiB


@dataclass(frozen=True, slots=True)
class RawReadPoint:
    """Aggregate throughput of Q threads reading at once (queue depth Q)."""

    queue_depth: int
    """Reads in flight at once (one synchronous preadv per thread)."""
    threads: int
    """Reader threads (equal to the queue depth)."""
    block_bytes: int
    """Bytes per read."""
    reads: int
    """Reads completed, over all threads."""
    seconds: float
    """Wall time from the common start until the last thread finished."""
    gbps: float
    """Aggregate throughput, 1e9 bytes per second."""
    iops: float
    """Aggregate reads per second."""
    latency_p50_us: float
    """Median time of one preadv, microseconds."""
    latency_p99_us: float
    """99th percentile time of one preadv, microseconds."""
    cpu_user_s: float = 0.0
    """CPU seconds of the whole process in user mode from the common start until the
    last thread finished (the reads run alone in it: their cost, with the threads')."""
    cpu_system_s: float = 0.0
    """The same in the kernel (the system calls, O_DIRECT's page pinning and I/O)."""


@dataclass(frozen=True, slots=True)
class RawConcurrencyResult:
    """The raw concurrent read limit at each queue depth, from one prepared file."""

    direct_io: bool
    """True if the reads bypassed the page cache with O_DIRECT."""
    file_bytes: int
    """Size of the prepared file the random offsets fall in."""
    block_bytes: int
    """Bytes per read."""
    points: tuple[RawReadPoint, ...]
    """One per queue depth, in the order asked."""
    note: str = ""
    """Why the figures may not be device figures (buffered fallback), else empty."""

    def point(self, queue_depth: int) -> RawReadPoint:
        """The point measured at ``queue_depth`` (InvalidArgument if none was)."""
        for p in self.points:
            if p.queue_depth == queue_depth:
                return p
        raise InvalidArgument(
            f"queue depth {queue_depth} was not measured (measured: "
            f"{', '.join(str(p.queue_depth) for p in self.points)})"
        )

    def to_json(self) -> dict[str, object]:
        """JSON-able form (points as a list of objects)."""
        return asdict(self) | {"points": [asdict(p) for p in self.points]}


def measure_raw_concurrency(
    directory: str | Path,
    *,
    file_bytes: int = 1 << 30,
    block_bytes: int = 2 * MiB,
    queue_depths: Sequence[int] = DEFAULT_QUEUE_DEPTHS,
    reads_per_point: int = 256,
    seed: int = 0,
    direct: bool | None = None,
) -> RawConcurrencyResult:
    """Measure raw aligned preadv throughput at each queue depth in ``queue_depths``.

    The prepared file is made in ``directory`` (which should be the store's, so that
    the limit and kvlife share a device) and removed afterwards. ``reads_per_point``
    reads are split evenly over the threads of a point (at least one each). ``direct``
    None uses O_DIRECT where the filesystem accepts it; True requires it.
    """
    where = Path(directory)
    _check_args(file_bytes, block_bytes, queue_depths, reads_per_point)
    if not where.is_dir():
        raise StorePathError(f"{where} is not a directory")
    can_direct = probe_direct_io(where)
    if direct and not can_direct:
        raise StorePathError(f"{where} does not accept O_DIRECT (direct=True)")
    use_direct = can_direct if direct is None else bool(direct)
    note = (
        ""
        if use_direct
        else f"{where} reads are buffered (no O_DIRECT); cached pages are dropped with "
        "posix_fadvise(DONTNEED) before each point, which the kernel may not fully honour"
    )
    fd_name, name = tempfile.mkstemp(prefix=".kvlife-raw-concurrency-", suffix=".bin", dir=where)
    os.close(fd_name)
    path = Path(name)
    try:
        _prepare(path, file_bytes, use_direct)
        rng = np.random.default_rng(seed)
        points = tuple(
            _measure_point(path, file_bytes, block_bytes, qd, reads_per_point, rng, use_direct)
            for qd in queue_depths
        )
    finally:
        path.unlink(missing_ok=True)
    return RawConcurrencyResult(use_direct, file_bytes, block_bytes, points, note)


def _check_args(
    file_bytes: int, block_bytes: int, queue_depths: Sequence[int], reads_per_point: int
) -> None:
    if block_bytes <= 0 or block_bytes % ALIGN:
        raise InvalidArgument(
            f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}"
        )
    if file_bytes < block_bytes or file_bytes % block_bytes:
        raise InvalidArgument(
            f"file_bytes must be a positive multiple of block_bytes ({block_bytes}), "
            f"got {file_bytes}"
        )
    if not queue_depths or any(not isinstance(q, int) or q < 1 for q in queue_depths):
        raise InvalidArgument(f"queue_depths must be integers >= 1, got {list(queue_depths)}")
    if reads_per_point < 1:
        raise InvalidArgument(f"reads_per_point must be >= 1, got {reads_per_point}")


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0))


def _prepare(path: Path, file_bytes: int, direct: bool) -> None:
    """Fill the file with real (non-zero, non-hole) data and make it durable."""
    chunk = aligned_empty(min(_FILL_CHUNK, file_bytes))
    chunk[:] = np.random.default_rng(1).integers(1, 256, size=chunk.size, dtype=np.uint8)
    fd = _open(path, os.O_WRONLY | os.O_TRUNC, direct)
    try:
        off = 0
        while off < file_bytes:
            n = min(chunk.size, file_bytes - off)
            written = os.pwrite(fd, chunk[:n].data, off)
            if written != n:
                raise StorePathError(f"short write preparing {path}: {written} of {n} bytes")
            off += n
        os.fdatasync(fd)
        _drop_cache(fd, direct)
    finally:
        os.close(fd)


def _drop_cache(fd: int, direct: bool) -> None:
    if not direct and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _measure_point(
    path: Path,
    file_bytes: int,
    block_bytes: int,
    qd: int,
    reads_per_point: int,
    rng: np.random.Generator,
    direct: bool,
) -> RawReadPoint:
    per_thread = max(1, reads_per_point // qd)
    blocks = file_bytes // block_bytes
    offsets = rng.integers(0, blocks, size=(qd, per_thread)) * block_bytes
    buffers = [aligned_empty(block_bytes) for _ in range(qd)]
    for b in buffers:  # fault the pages in now, not inside a timed read
        prefault(b)
    fd = _open(path, os.O_RDONLY, direct)
    try:
        _drop_cache(fd, direct)
        start = threading.Barrier(qd + 1)
        latencies = np.zeros((qd, per_thread))
        errors: list[BaseException] = []

        def reader(t: int) -> None:
            view = [buffers[t].data]
            start.wait()
            try:
                for i, off in enumerate(offsets[t].tolist()):
                    t0 = time.perf_counter()
                    got = os.preadv(fd, view, off)
                    latencies[t, i] = time.perf_counter() - t0
                    if got != block_bytes:
                        raise StorePathError(f"short raw read: {got} of {block_bytes} bytes")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(t,), daemon=True) for t in range(qd)]
        for th in threads:
            th.start()
        start.wait()
        cpu0 = process_cpu()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - t0
        cpu = process_cpu() - cpu0
    finally:
        os.close(fd)
    if errors:
        err = errors[0]
        if isinstance(err, OSError) and not isinstance(err, StorePathError):
            raise StorePathError(f"raw read of {path} failed: {err}") from err
        raise err
    reads = qd * per_thread
    lat_us = latencies.reshape(-1) * 1e6
    return RawReadPoint(
        queue_depth=qd,
        threads=qd,
        block_bytes=block_bytes,
        reads=reads,
        seconds=seconds,
        gbps=reads * block_bytes / seconds / 1e9,
        iops=reads / seconds,
        latency_p50_us=float(np.percentile(lat_us, 50)),
        latency_p99_us=float(np.percentile(lat_us, 99)),
        cpu_user_s=cpu.user,
        cpu_system_s=cpu.system,
    )


# ---------------------------------------------------------------------- paired slices


@dataclass(frozen=True, slots=True)
class RawSlice:
    """Raw reads at one queue depth for a fixed time, optionally with a paced raw writer
    beside them (:meth:`RawFile.read_slice`)."""

    queue_depth: int
    seconds: float
    """Wall time from the common start until the last reader finished."""
    reads: int
    gbps: float
    """Aggregate read throughput, 1e9 bytes per second."""
    write_target_bps: float
    """Bytes per second the writer was paced at (0: no writer)."""
    written_bytes: int
    """Bytes the writer wrote (and made durable with fdatasync) meanwhile."""
    write_bps: float
    """What the writer achieved: ``written_bytes`` over the slice's wall time."""


class RawFile:
    """A prepared file (real data, durable) for raw read slices, made in ``directory``
    and removed by :meth:`close`; the reads are the ones :func:`measure_raw_concurrency`
    issues (aligned O_DIRECT ``os.preadv`` of ``block_bytes`` at random offsets from Q
    threads), but for a fixed time, so that they can alternate with other work.

    With ``write_bps`` > 0, :meth:`read_slice` runs a raw writer beside the reads: one
    thread that appends ``block_bytes`` with aligned O_DIRECT ``os.pwrite`` to a new
    file in the same directory, ``batch_blocks`` blocks then one ``fdatasync``, paced
    at ``write_bps`` (it writes as fast as it can when the device cannot keep that
    pace; ``write_bps`` of the result says what it got), starting a new file every
    ``segment_bytes`` as the disk tier rolls its segments.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        file_bytes: int = 1 << 30,
        block_bytes: int = 2 * MiB,
        direct: bool | None = None,
        segment_bytes: int = 256 * MiB,
    ) -> None:
        where = Path(directory)
        _check_args(file_bytes, block_bytes, (1,), 1)
        if segment_bytes < block_bytes:
            raise InvalidArgument(
                f"segment_bytes must be >= block_bytes ({block_bytes}), got {segment_bytes}"
            )
        if not where.is_dir():
            raise StorePathError(f"{where} is not a directory")
        can_direct = probe_direct_io(where)
        if direct and not can_direct:
            raise StorePathError(f"{where} does not accept O_DIRECT (direct=True)")
        self.directory = where
        self.direct = can_direct if direct is None else bool(direct)
        self.file_bytes = file_bytes
        self.block_bytes = block_bytes
        self.segment_bytes = segment_bytes
        fd, name = tempfile.mkstemp(prefix=".kvlife-raw-slices-", suffix=".bin", dir=where)
        os.close(fd)
        self.path = Path(name)
        try:
            _prepare(self.path, file_bytes, self.direct)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        self._wbuf = aligned_empty(block_bytes)
        self._wbuf[:] = np.random.default_rng(2).integers(1, 256, block_bytes, dtype=np.uint8)

    def __enter__(self) -> RawFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the prepared file."""
        self.path.unlink(missing_ok=True)

    def read_slice(
        self,
        qd: int,
        seconds: float,
        rng: np.random.Generator,
        *,
        write_bps: float = 0.0,
        batch_blocks: int = 1,
    ) -> RawSlice:
        """Q threads read for ``seconds`` (each finishes the read it started), with the
        paced raw writer beside them when ``write_bps`` > 0."""
        if qd < 1 or seconds <= 0 or write_bps < 0 or batch_blocks < 1:
            raise InvalidArgument(
                f"bad raw slice: qd={qd}, seconds={seconds}, write_bps={write_bps}, "
                f"batch_blocks={batch_blocks}"
            )
        block = self.block_bytes
        blocks = self.file_bytes // block
        buffers = [aligned_empty(block) for _ in range(qd)]
        for b in buffers:
            prefault(b)
        seeds = rng.integers(0, 1 << 62, size=qd)
        counts = [0] * qd
        written = [0]
        errors: list[BaseException] = []
        stop = threading.Event()
        start = threading.Barrier(qd + 1 + int(write_bps > 0))
        fd = _open(self.path, os.O_RDONLY, self.direct)
        end = [0.0]

        def reader(t: int) -> None:
            view = [buffers[t].data]
            offs = np.random.default_rng(int(seeds[t]))
            try:
                start.wait()
                while time.perf_counter() < end[0]:
                    off = int(offs.integers(0, blocks)) * block
                    got = os.preadv(fd, view, off)
                    if got != block:
                        raise StorePathError(f"short raw read: {got} of {block} bytes")
                    counts[t] += 1
            except BaseException as exc:
                errors.append(exc)

        def writer() -> None:
            try:
                start.wait()
                self._write_paced(write_bps, batch_blocks, stop, written)
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=reader, args=(t,), daemon=True) for t in range(qd)]
        if write_bps > 0:
            workers.append(threading.Thread(target=writer, daemon=True))
        try:
            for w in workers:
                w.start()
            t0 = time.perf_counter()
            end[0] = t0 + seconds
            start.wait()
            for w in workers[:qd]:
                w.join()
            wall = time.perf_counter() - t0
            stop.set()
            for w in workers[qd:]:
                w.join()
        finally:
            stop.set()
            os.close(fd)
        if errors:
            err = errors[0]
            if isinstance(err, OSError) and not isinstance(err, StorePathError):
                raise StorePathError(f"raw slice in {self.directory} failed: {err}") from err
            raise err
        reads = sum(counts)
        return RawSlice(
            queue_depth=qd,
            seconds=wall,
            reads=reads,
            gbps=reads * block / wall / 1e9,
            write_target_bps=write_bps,
            written_bytes=written[0],
            write_bps=written[0] / wall,
        )

    @contextlib.contextmanager
    def writing(self, bps: float, batch_blocks: int = 1) -> Iterator[list[int]]:
        """The paced raw writer of :meth:`read_slice` on a thread of its own while the
        block runs (none at 0 bytes/s): what it wrote, in bytes (a one-item list, read
        after the block), beside whatever else the block measures."""
        written = [0]
        if bps <= 0:
            yield written
            return
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                self._write_paced(bps, batch_blocks, stop, written)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            yield written
        finally:
            stop.set()
            thread.join()
        if errors:
            raise errors[0]

    def _write_paced(
        self, bps: float, batch_blocks: int, stop: threading.Event, written: list[int]
    ) -> None:
        """Append blocks (``batch_blocks``, then fdatasync) at ``bps`` until ``stop``."""
        block = self.block_bytes
        half = batch_blocks * block / 2  # each batch due when its middle is: no burst at 0
        view = self._wbuf.data
        t0 = time.perf_counter()
        fd = -1
        name = ""
        off = 0
        try:
            while not stop.is_set():
                due = t0 + (written[0] + half) / bps
                wait = due - time.perf_counter()
                if wait > 0:
                    stop.wait(wait)
                    continue
                if fd < 0 or off + batch_blocks * block > self.segment_bytes:
                    if fd >= 0:
                        os.close(fd)
                        os.unlink(name)
                    fd, name = _new_file(self.directory)
                    fd = _reopen(fd, name, self.direct)
                    off = 0
                for _ in range(batch_blocks):
                    n = os.pwrite(fd, view, off)
                    if n != block:
                        raise StorePathError(f"short raw write: {n} of {block} bytes")
                    off += n
                os.fdatasync(fd)
                written[0] += batch_blocks * block
        finally:
            if fd >= 0:
                os.close(fd)
                os.unlink(name)


def _new_file(where: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=".kvlife-raw-writer-", suffix=".bin", dir=where)


def _reopen(fd: int, name: str, direct: bool) -> int:
    """``name`` (made by mkstemp, open as ``fd``) reopened for O_DIRECT writes."""
    os.close(fd)
    try:
        return _open(Path(name), os.O_WRONLY, direct)
    except BaseException:
        os.unlink(name)
        raise
