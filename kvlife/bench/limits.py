"""The limits of the machine that benchmarks measure kvlife against, in the same run.

Raw sequential writes and reads of a batch of objects (O_DIRECT where the directory
allows it), ``np.copyto`` into warm buffers, and copies into freshly allocated arrays
(the first-touch page faults any allocating path pays). Used by ``kvlife bench io``,
``kvlife bench ttft`` and ``kvlife bench server``.

:func:`machine_figures` measures the machine itself, the same way in every benchmark
(``io``, ``server``, ``remote``, ``concurrency``): memcpy, raw O_DIRECT write and read,
and a Python loop's speed, written beside the ratios (JSON key ``"machine"``, one line
of the table), so that two machines' ratios can be compared: a ratio that falls on a
machine whose Python loop is 3x slower points at per-chunk Python, one that falls with
its raw read speed at the device.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
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


def memcpy(dst: Sequence[np.ndarray], src: Sequence[np.ndarray]) -> float:
    """Seconds to ``np.copyto`` each source object into its (warm) destination."""
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        np.copyto(d, s)
    return time.perf_counter() - t0


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
) -> dict[str, float | int | bool]:
    """The machine's own speeds, measured the same way by every ``kvlife bench``, so that
    the ratios of two machines can be compared: memcpy (``np.copyto`` into a warm buffer),
    raw sequential write (``pwrite`` of MACHINE_BLOCK from aligned memory, then
    ``fdatasync``) and raw read of the same file, O_DIRECT where ``directory`` allows it,
    and a Python loop's speed. Each is the best of ``best_of`` tries (GB/s = 1e9 B/s).

    A scratch file is made in ``directory`` and removed.
    """
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
        write = min(raw_write(path, srcs, direct) for _ in range(best_of))
        read = min(raw_read(path, dsts, direct) for _ in range(best_of))
    finally:
        path.unlink(missing_ok=True)
    if not np.array_equal(src[:: max(1, nbytes // 4096)], dst[:: max(1, nbytes // 4096)]):
        raise RuntimeError("machine figures: the raw read came back with wrong bytes")
    loop_iters = PYTHON_LOOP_ITERS // 10 if quick else PYTHON_LOOP_ITERS
    return {
        "memcpy_gbps": nbytes / copy / 1e9,
        "raw_write_gbps": nbytes / write / 1e9,
        "raw_read_gbps": nbytes / read / 1e9,
        "python_loop_mips": max(python_loop_mips(loop_iters) for _ in range(best_of)),
        "direct_io": direct,
        "bytes": nbytes,
        "block_bytes": block,
        "cpu_count": os.cpu_count() or 0,
    }


MACHINE_KEYS = ("memcpy_gbps", "raw_write_gbps", "raw_read_gbps", "python_loop_mips")
"""The figures every benchmark's JSON carries under ``"machine"``."""


def format_machine(fig: Mapping[str, object]) -> str:
    """One line for a benchmark's table: the machine figures its ratios were taken on."""
    raw = "raw O_DIRECT" if fig.get("direct_io") else "raw buffered"
    block = fig.get("block_bytes")
    calls = f"{block / (1 << 20):g} MiB calls" if isinstance(block, int) else "calls"
    return (
        f"machine: memcpy {fig['memcpy_gbps']:.2f} GB/s, {raw} write "
        f"{fig['raw_write_gbps']:.2f} / read {fig['raw_read_gbps']:.2f} GB/s "
        f"({calls}), Python loop "
        f"{fig['python_loop_mips']:.1f} M iterations/s, {fig['cpu_count']} CPUs"
    )
