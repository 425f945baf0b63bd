"""The limits of the machine that benchmarks measure kvlife against, in the same run.

Raw sequential writes and reads of a batch of objects (O_DIRECT where the directory
allows it), ``np.copyto`` into warm buffers, and copies into freshly allocated arrays
(the first-touch page faults any allocating path pays), and the same copies sealed
(xxh3-128) on one thread or with the hash on a second thread (:func:`sealed_copy`,
:class:`SplitSealer`: the ceilings of a verified put), and raw reads with each piece
copied out and hashed as it lands (:class:`ReadCopier`: the ceiling of a served load
into the caller's own buffers). Used by ``kvlife bench io``,
``kvlife bench ttft`` and ``kvlife bench server``.

:func:`machine_figures` measures the machine itself, the same way in every benchmark
(``io``, ``server``, ``remote``, ``concurrency``): memcpy, raw O_DIRECT write and read,
and a Python loop's speed, written beside the ratios (JSON key ``"machine"``, one line
of the table), so that two machines' ratios can be compared: a ratio that falls on a
machine whose Python loop is 3x slower points at per-chunk Python, one that falls with
its raw read speed at the device.

The CPU budget (issue 28): :func:`process_cpu`, :func:`thread_cpu` and
:func:`tasks_cpu_seconds` (another process's threads) measure CPU time over a timed
window, :func:`cpu_per_chunk` turns it into µs per chunk (user and system apart),
:func:`hash_cpu_per_chunk` measures the checksum every load verifies,
:func:`cpus_available` how many CPUs the process gets now, and :func:`cpu_ceiling` the
ratio to raw reads that no verified load could pass with them (``kvlife bench
concurrency``; ``kvlife bench server`` reports the per-chunk CPU of its disk loads).
"""

from __future__ import annotations

import os
import resource
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def raw_write(path: Path, payloads: Sequence[np.ndarray], direct: bool) -> float:
    """Seconds to write ``payloads`` back to back into a new file, then fdatasync it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        off = 0
        for p in payloads:
            n = os.pwrite(fd, p.data, off)
            if n != p.nbytes:
                raise OSError(f"short raw write: {n} of {p.nbytes} bytes")
            off += n
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: Path, outs: Sequence[np.ndarray], direct: bool) -> float:
    """Seconds to read the objects of ``path`` (laid out back to back) into ``outs``."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        off = 0
        for o in outs:
            n = os.preadv(fd, [o.data], off)
            if n != o.nbytes:
                raise OSError(f"short raw read: {n} of {o.nbytes} bytes")
            off += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_frame_reads(
    frames: Sequence[tuple[str, int]], heads: Sequence[np.ndarray], outs: Sequence[np.ndarray]
) -> float:
    """Seconds to read each frame's own bytes (``(path, offset)``: its header into
    ``heads[i]``, its payload into ``outs[i]``, one ``preadv`` each, O_DIRECT, nothing
    verified), each file opened once: the device's time for the very bytes a disk load
    of those frames reads, where the raw file of :func:`raw_read` holds the same
    payloads at other places on the disk."""
    fds: dict[str, int] = {}
    try:
        t0 = time.perf_counter()
        for (path, off), head, out in zip(frames, heads, outs, strict=True):
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
            n = os.preadv(fd, [head.data, out.data], off)
            if n != head.nbytes + out.nbytes:
                raise OSError(f"short frame read: {n} of {head.nbytes + out.nbytes} bytes")
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def _each(
    dst: Sequence[np.ndarray],
    src: Sequence[np.ndarray],
    op: Callable[[np.ndarray, np.ndarray], object],
) -> float:
    """Seconds to run ``op(d, s)`` on each destination and its source, in order."""
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        op(d, s)
    return time.perf_counter() - t0


def memcpy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> float:
    """Seconds to ``np.copyto`` each source object into its (warm) destination."""
    return _each(dst, src, np.copyto)


def streamed(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> float:
    """Seconds to copy each source object into its (warm) destination by the copy a
    served put's client makes (:func:`kvlife.native.copies.stream_copy`: non-temporal
    stores where the extension is built, else ``np.copyto``): the machine's fastest
    copy of those bytes, beside :func:`memcpy`."""
    from kvlife.native.copies import stream_copy

    return _each(dst, src, stream_copy)


def sealed_copy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> float:
    """Seconds to copy each source object into its (warm) destination and seal it
    (xxh3-128) on this thread, as fast as the machine can (:func:`_copy_sealed`): the
    least a verified put does on one CPU. With ``np.copyto`` and a hash of the copy
    here, the in-process 16 MiB put, which seals by the extension, passed it (0.92
    against 0.67 of memcpy, 2026-12-07)."""
    return _each(dst, src, _copy_sealed)


class SplitSealer:
    """A second thread that hashes what this one copied, piece by piece (the hash call
    releases the interpreter lock): :meth:`copy` is a verified put's copy and seal with
    both overlapped on two CPUs, the way a served put splits them (the client copies,
    the server hashes each MiB it is told is written), without any of the put's
    bookkeeping; the copy is the served client's (:func:`streamed`). Use as a context
    manager; the thread lives across calls."""

    def __init__(self, piece_bytes: int = 1 << 20) -> None:
        import queue

        self.piece_bytes = piece_bytes
        self._todo: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="split-sealer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import xxhash

        while (piece := self._todo.get()) is not None:
            xxhash.xxh3_128_digest(piece)
            self._done.put(len(piece))

    def copy(self, dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> float:
        """Seconds until every byte of ``src`` is copied into ``dst`` and hashed."""
        from kvlife.native.copies import stream_copy

        pieces = 0
        t0 = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            if not d.flags.c_contiguous:
                raise ValueError("SplitSealer copies into C-contiguous destinations only")
            flat_d = d.reshape(-1).view(np.uint8)
            flat_s = s.reshape(-1).view(np.uint8)
            for off in range(0, flat_d.nbytes, self.piece_bytes):
                end = off + self.piece_bytes
                stream_copy(flat_d[off:end], flat_s[off:end])
                self._todo.put(flat_d[off:end].data)
                pieces += 1
        for _ in range(pieces):
            self._done.get()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()

    def __enter__(self) -> SplitSealer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_Piece = tuple[int, int, int]
"""A piece of an object that landed: (object, start, end)."""

READ_COPY_PIECE_BYTES = 4 << 20
"""The largest read of :class:`ReadCopier` (an object of at most this many bytes is read
in one call, as :func:`raw_read` reads it). Measured on 2026-12-05 beside raw reads of
4 x 16 MiB, one copier: pieces of 4 MiB 0.87 of raw, of 2, 8 and 16 MiB 0.83, 0.80 and
0.77, of 1 MiB or less 0.53-0.67 (one read in flight: a smaller read pays its latency
more often); at 2 MiB objects one read per object did best."""


class ReadCopier:
    """The ceiling of a served disk load into the caller's own (private) buffers: a
    reader thread reads the objects of a file back to back into memory the caller does
    not hold (``stage``: what a server reads into), piece by piece, and each piece is
    copied into the caller's buffer as soon as it landed and hashed (xxh3-128, each
    block from the cache before it is streamed: :func:`_copy_sealed`), by this thread
    alone (``copiers=1``) or with
    a helper thread copying and hashing the second half of each piece (``copiers=2``:
    two CPUs' worth of copying, as a client and its server could share it). A process
    that reads on the caller's behalf cannot fill the caller's private memory but by a
    copy, and on this kind of machine that copy slows the reads beside it (their DMA
    and the copy share the memory): no served design avoids it. Nothing else here: no
    request, no store, no Python per byte. The threads live across calls (use as a
    context manager)."""

    def __init__(self, piece_bytes: int = READ_COPY_PIECE_BYTES, copiers: int = 1) -> None:
        import queue

        if piece_bytes < 4096 or piece_bytes % 4096:
            raise ValueError(f"piece of {piece_bytes} bytes: whole 4 KiB pages, at least one")
        if copiers not in (1, 2):
            raise ValueError(f"{copiers} copiers: 1 or 2")
        self.piece_bytes = piece_bytes
        self.copiers = copiers
        self._todo: queue.SimpleQueue[tuple[int, list[tuple[memoryview, int]]] | None] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[_Piece | BaseException] = queue.SimpleQueue()
        self._halves: queue.SimpleQueue[tuple[np.ndarray, np.ndarray] | None] = queue.SimpleQueue()
        self._halved: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._read, name="read-copier", daemon=True)]
        if copiers == 2:
            self._threads.append(
                threading.Thread(target=self._copy_halves, name="read-copier-2", daemon=True)
            )
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        while (job := self._todo.get()) is not None:
            fd, objects = job
            try:
                for i, (view, at) in enumerate(objects):
                    for start in range(0, len(view), self.piece_bytes):
                        end = min(start + self.piece_bytes, len(view))
                        got = os.preadv(fd, [view[start:end]], at + start)
                        if got != end - start:
                            raise OSError(f"short raw read: {got} of {end - start} bytes")
                        self._done.put((i, start, end))
            except BaseException as exc:  # told to the caller, which raises it
                self._done.put(exc)

    def _copy_halves(self) -> None:
        while (job := self._halves.get()) is not None:
            dst, src = job
            _copy_sealed(dst, src)
            self._halved.put(dst.nbytes)

    def read_copy(
        self, path: Path, stage: Sequence[np.ndarray], outs: Sequence[np.ndarray], direct: bool
    ) -> float:
        """Seconds to read the objects of ``path`` (back to back, one per ``stage``
        buffer) and have every byte copied into ``outs`` and hashed there."""
        if len(stage) != len(outs) or any(
            s.nbytes != o.nbytes or not (s.flags.c_contiguous and o.flags.c_contiguous)
            for s, o in zip(stage, outs, strict=True)
        ):
            raise ValueError("ReadCopier needs C-contiguous stage and out buffers of equal sizes")
        flat_s = [s.reshape(-1).view(np.uint8) for s in stage]
        flat_o = [o.reshape(-1).view(np.uint8) for o in outs]
        objects: list[tuple[memoryview, int]] = []
        at = 0
        for f in flat_s:
            objects.append((f.data, at))
            at += f.nbytes
        pieces = sum(-(-f.nbytes // self.piece_bytes) for f in flat_s)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        handed = 0
        try:
            t0 = time.perf_counter()
            self._todo.put((fd, objects))
            for _ in range(pieces):
                got = self._done.get()
                if isinstance(got, BaseException):
                    raise got
                i, start, end = got
                mid = end
                if self.copiers == 2 and end - start >= 2 * 4096:
                    mid = start + ((end - start) // 2 & ~4095)
                    self._halves.put((flat_o[i][mid:end], flat_s[i][mid:end]))
                    handed += 1
                _copy_sealed(flat_o[i][start:mid], flat_s[i][start:mid])
            for _ in range(handed):
                self._halved.get()
            handed = 0
            return time.perf_counter() - t0
        finally:
            for _ in range(handed):  # the helper finishes what it was handed first
                self._halved.get()
            os.close(fd)

    def close(self) -> None:
        self._todo.put(None)
        self._halves.put(None)
        for t in self._threads:
            t.join()

    def __enter__(self) -> ReadCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_sealed(dst: np.ndarray, src: np.ndarray) -> None:
    """``src`` copied into ``dst`` and hashed, the fastest way this machine has: each
    block hashed and then streamed from the cache (:func:`kvlife.native.copies.
    copy_sealed`, where the extension is built; else copied, then ``dst`` hashed). A
    served load's client copies out by streaming stores too (kvlife/client/loads.py):
    with ``np.copyto`` here the 16 MiB loads into the caller's buffers passed this
    ceiling (1.01 and 1.04 of it, 2026-12-07)."""
    from kvlife.native.copies import copy_sealed

    copy_sealed(dst, src)


def alloc_copy(src: Sequence[np.ndarray]) -> float:
    """Seconds to copy each object into a newly allocated array (what a copying put
    that allocates per object pays: the copy plus first-touch page faults)."""
    held: list[np.ndarray] = []
    t0 = time.perf_counter()
    for s in src:
        a = np.empty(s.shape, s.dtype)
        np.copyto(a, s)
        held.append(a)
    elapsed = time.perf_counter() - t0
    held.clear()
    return elapsed


MACHINE_BYTES = 64 << 20
"""Bytes each machine figure moves (a quick run moves an eighth)."""
MACHINE_BLOCK = 4 << 20
"""Bytes per raw read or write call of the machine figures."""
PYTHON_LOOP_ITERS = 1_000_000
"""Iterations of the Python loop whose speed is reported (a quick run does a tenth)."""


def python_loop_mips(iters: int = PYTHON_LOOP_ITERS) -> float:
    """Millions of iterations per second of a plain Python ``for`` loop adding integers:
    how fast this interpreter runs the per-chunk Python a data path still has."""
    t0 = time.perf_counter()
    total = 0
    for i in range(iters):
        total += i
    elapsed = time.perf_counter() - t0
    if total != iters * (iters - 1) // 2:  # keeps the loop from being anything but a loop
        raise RuntimeError("python loop miscounted")
    return iters / elapsed / 1e6


def machine_figures(
    directory: Path, quick: bool = False, best_of: int = 3
) -> dict[str, float | int | bool | str | None]:
    """The machine's own speeds, measured the same way by every ``kvlife bench``, so that
    the ratios of two machines can be compared: memcpy (``np.copyto`` into a warm buffer)
    and the streaming copy of a served put's client (:func:`streamed`),
    raw sequential write (``pwrite`` of MACHINE_BLOCK from aligned memory, then
    ``fdatasync``) and raw read of the same file, O_DIRECT where ``directory`` allows it,
    and a Python loop's speed. Each is the best of ``best_of`` tries (GB/s = 1e9 B/s).
    Beside them, how an idle CPU waits (:func:`idle_wait`): on a VM whose idle vCPUs
    halt at once, every wake-up of a waiting thread costs a VM exit.

    A scratch file is made in ``directory`` and removed.
    """
    from kvlife.native import frames
    from kvlife.tiers.buffers import aligned_empty
    from kvlife.tiers.disk.fileio import probe_direct_io

    nbytes = MACHINE_BYTES // 8 if quick else MACHINE_BYTES
    block = min(MACHINE_BLOCK, nbytes)
    src = aligned_empty(nbytes)
    src[:] = np.random.default_rng(1).integers(0, 256, size=nbytes, dtype=np.uint8)
    dst = aligned_empty(nbytes)
    dst.fill(0)
    srcs = [src[o : o + block] for o in range(0, nbytes, block)]
    dsts = [dst[o : o + block] for o in range(0, nbytes, block)]
    direct = probe_direct_io(directory)
    fd, name = tempfile.mkstemp(prefix=".kvlife-machine-", dir=directory)
    os.close(fd)
    path = Path(name)
    try:
        copy = min(memcpy([dst], [src]) for _ in range(best_of))
        stream = min(streamed([dst], [src]) for _ in range(best_of))
        write = min(raw_write(path, srcs, direct) for _ in range(best_of))
        read = min(raw_read(path, dsts, direct) for _ in range(best_of))
    finally:
        path.unlink(missing_ok=True)
    if not np.array_equal(src[:: max(1, nbytes // 4096)], dst[:: max(1, nbytes // 4096)]):
        raise RuntimeError("machine figures: the raw read came back with wrong bytes")
    loop_iters = PYTHON_LOOP_ITERS // 10 if quick else PYTHON_LOOP_ITERS
    return {
        "memcpy_gbps": nbytes / copy / 1e9,
        # the copy a served put's client makes (non-temporal stores): memcpy is not the
        # fastest copy of a buffer larger than the cache here
        "stream_copy_gbps": nbytes / stream / 1e9,
        "raw_write_gbps": nbytes / write / 1e9,
        "raw_read_gbps": nbytes / read / 1e9,
        "python_loop_mips": max(python_loop_mips(loop_iters) for _ in range(best_of)),
        "direct_io": direct,
        "bytes": nbytes,
        "block_bytes": block,
        "cpu_count": os.cpu_count() or 0,
        # whether the disk tier reads runs of frames in native code here (docs/store.md):
        # a machine without the extension reads through Python, and its ratios say so
        "native_reads": frames.available(),
    } | idle_wait()


CPUIDLE = Path("/sys/devices/system/cpu/cpuidle/current_driver")
HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def idle_wait() -> dict[str, str | int | None]:
    """How this machine's idle CPUs wait: the cpuidle driver (``cpuidle_driver``; None
    where the kernel does not say) and, under ``haltpoll`` (a KVM guest), how long an
    idle vCPU polls before it halts (``halt_poll_ns``; None elsewhere). With 0 every
    wait that finds its CPU idle ends in a VM exit and a wake-up by the host: a round
    trip to a server back to back took 76-99 µs here against 13-18 µs with 300 µs of
    polling, though the served loads' and puts' ratios stayed within their spread
    (docs/operations.md, "Idle CPUs on a VM")."""
    return {
        "cpuidle_driver": _read_text(CPUIDLE),
        "halt_poll_ns": _read_int(HALT_POLL),
    }


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


MACHINE_KEYS = (
    "memcpy_gbps",
    "stream_copy_gbps",
    "raw_write_gbps",
    "raw_read_gbps",
    "python_loop_mips",
)
"""The figures every benchmark's JSON carries under ``"machine"``."""


def format_machine(fig: Mapping[str, object]) -> str:
    """One line for a benchmark's table: the machine figures its ratios were taken on."""
    raw = "raw O_DIRECT" if fig.get("direct_io") else "raw buffered"
    block = fig.get("block_bytes")
    calls = f"{block / (1 << 20):g} MiB calls" if isinstance(block, int) else "calls"
    return (
        f"machine: memcpy {fig['memcpy_gbps']:.2f} GB/s"
        + (
            f" (streaming stores {fig['stream_copy_gbps']:.2f})"
            if "stream_copy_gbps" in fig
            else ""
        )
        + f", {raw} write "
        f"{fig['raw_write_gbps']:.2f} / read {fig['raw_read_gbps']:.2f} GB/s "
        f"({calls}), Python loop "
        f"{fig['python_loop_mips']:.1f} M iterations/s, {fig['cpu_count']} CPUs"
        + (
            ""
            if "native_reads" not in fig
            else ", disk frames read natively"
            if fig["native_reads"]
            else ", disk frames read through Python (native extension off or not built)"
        )
        + _idle_text(fig)
    )


def _idle_text(fig: Mapping[str, object]) -> str:
    driver, poll = fig.get("cpuidle_driver"), fig.get("halt_poll_ns")
    if not isinstance(driver, str):
        return ""
    if isinstance(poll, int):
        return f", idle CPUs: {driver}, polling {poll / 1000:g} µs before they halt"
    return f", idle CPUs: {driver}"


# ---------------------------------------------------------------------- CPU budget


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """CPU seconds spent, user and system (kernel) separately (``getrusage``: the
    kernel's precise runtime, split between user and system by its tick samples)."""

    user: float
    system: float

    @property
    def total(self) -> float:
        return self.user + self.system

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user - other.user, self.system - other.system)

    def __add__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user + other.user, self.system + other.system)


def process_cpu() -> CpuTimes:
    """CPU time of this whole process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return CpuTimes(r.ru_utime, r.ru_stime)


def thread_cpu() -> CpuTimes:
    """CPU time of the calling thread so far (Linux ``RUSAGE_THREAD``; elsewhere the
    thread's total from ``time.thread_time``, counted as user time)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return CpuTimes(time.thread_time(), 0.0)
    r = resource.getrusage(who)
    return CpuTimes(r.ru_utime, r.ru_stime)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


def cpu_per_chunk(spent: CpuTimes, chunks: int, wall: float) -> dict[str, float]:
    """JSON figures of ``spent`` CPU over ``chunks`` chunks in ``wall`` seconds: µs of
    user, system and both per chunk, and how many CPUs were busy on average."""
    n = max(chunks, 1)
    return {
        "user_us_per_chunk": spent.user / n * 1e6,
        "system_us_per_chunk": spent.system / n * 1e6,
        "us_per_chunk": spent.total / n * 1e6,
        "busy_cpus": spent.total / wall if wall > 0 else float("nan"),
        "chunks": chunks,
    }


HASH_SAMPLE_BYTES = 64 << 20
"""Bytes the checksum's CPU cost is measured over (more than a last-level cache, so each
chunk is hashed from memory, as a chunk that a read just put there by DMA is)."""


def hash_cpu_per_chunk(chunk_bytes: int, quick: bool = False, best_of: int = 3) -> float:
    """CPU seconds of one xxh3-128 (the checksum every load verifies) of ``chunk_bytes``
    in memory: the calling thread's CPU time over chunks that together exceed the
    last-level cache, best of ``best_of``."""
    import xxhash

    from kvlife.tiers.buffers import aligned_empty

    total = HASH_SAMPLE_BYTES // 8 if quick else HASH_SAMPLE_BYTES
    count = max(2, total // max(chunk_bytes, 1))
    bufs = [aligned_empty(chunk_bytes) for _ in range(count)]
    for i, b in enumerate(bufs):
        b.fill(i % 251 + 1)
    best = float("inf")
    for _ in range(best_of):
        t0 = time.thread_time()
        for b in bufs:
            xxhash.xxh3_128_digest(b.data)
        best = min(best, (time.thread_time() - t0) / count)
    return best


def cpu_ceiling(
    raw_us_per_chunk: float,
    hash_us_per_chunk: float,
    raw_chunks_per_s: float,
    cpus: int,
    available: float | None = None,
) -> dict[str, float]:
    """The ratio to raw reads that no design of a verified load could pass on this
    machine, from measured CPU per chunk.

    A verified load costs at least what the raw read costs (``raw_us_per_chunk``: the
    system call, the kernel's O_DIRECT work) plus the checksum of its bytes
    (``hash_us_per_chunk``; the promise is that every byte is verified). With all
    ``cpus`` CPUs doing nothing else, it completes at most cpus / (raw + hash) chunks a
    second, and never more than the device gives raw reads (``raw_chunks_per_s``):

    - ``ceiling`` = min(1, cpus / ((raw + hash) x raw chunks/s)): the bound;
    - ``ceiling_same_cpu`` = raw / (raw + hash): the bound when the raw run was itself
      CPU-bound (then no more CPU is to be had than it used), the tighter one then;
    - ``raw_busy_cpus``: CPUs the raw run kept busy (raw x raw chunks/s): near ``cpus``
      the raw run was CPU-bound and ``ceiling_same_cpu`` applies;
    - ``ceiling_available``: the bound with the CPUs measured ``available`` to this
      process in the run (:func:`cpus_available`) in place of ``cpus``: on a machine
      shared with other jobs, what a design that needs no more than raw + hash per
      chunk could reach that day.
    """
    need = (raw_us_per_chunk + hash_us_per_chunk) * 1e-6

    def bound(c: float) -> float:
        return min(1.0, c / (need * raw_chunks_per_s)) if need > 0 and raw_chunks_per_s else 1.0

    same = raw_us_per_chunk / (raw_us_per_chunk + hash_us_per_chunk) if need > 0 else 1.0
    extra = {} if available is None else {"ceiling_available": bound(available)}
    return extra | {
        "ceiling": bound(cpus),
        "ceiling_same_cpu": same,
        "raw_busy_cpus": raw_us_per_chunk * 1e-6 * raw_chunks_per_s,
        "hash_us_per_chunk": hash_us_per_chunk,
        "cpus": cpus,
    }


def cpus_available(seconds: float = 0.25) -> float:
    """CPUs this process gets now when it asks for all of them: one thread per usable
    CPU hashing memory (xxh3 releases the GIL) for ``seconds``, their CPU time over the
    wall time. About the CPU count on a quiet machine; less where other processes
    compete for the CPUs (a shared machine: the share a CPU-bound load would get)."""
    import xxhash

    buf = np.ones(1 << 20, np.uint8)
    stop = time.perf_counter() + seconds

    def spin() -> None:
        while time.perf_counter() < stop:
            xxhash.xxh3_128_digest(buf.data)

    workers = [threading.Thread(target=spin) for _ in range(usable_cpus())]
    cpu0 = process_cpu()
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return (process_cpu() - cpu0).total / (time.perf_counter() - t0)


def tasks_cpu_seconds(pid: int) -> float:
    """CPU seconds of every live thread of process ``pid`` (``/proc/PID/task/*/schedstat``:
    the scheduler's nanosecond runtime, precise where ``/proc/PID/stat`` counts 10 ms
    ticks); NaN where ``/proc`` cannot tell."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return float("nan")
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9
