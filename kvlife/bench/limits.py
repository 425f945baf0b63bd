"""The limits of the machine that benchmarks measure kvlife against, in the same run.

Raw sequential writes and reads of a batch of objects (O_DIRECT where the directory
allows it), ``np.copyto`` into warm buffers, and copies into freshly allocated arrays
(the first-touch page faults any allocating path pays). Used by ``kvlife bench io``,
``kvlife bench ttft`` and ``kvlife bench server``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
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
