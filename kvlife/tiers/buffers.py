"""Aligned memory for direct I/O and zero-copy hand-offs between tiers.

O_DIRECT needs buffer addresses, lengths and file offsets aligned (512 bytes here,
4096 to be safe everywhere). Arrays allocated through :func:`aligned_empty` can go from
the DRAM tier to the disk tier, and from the disk into an engine's buffer, without a
staging copy.
"""

from __future__ import annotations

import threading

import numpy as np

ALIGN = 4096
"""Alignment of offsets, lengths and buffer addresses for direct I/O."""


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is ``align``-aligned."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes]


def is_aligned(arr: np.ndarray, align: int = ALIGN) -> bool:
    return arr.ctypes.data % align == 0 and arr.nbytes % align == 0


def aligned_runs(arr: np.ndarray, max_runs: int = 1000) -> list[np.ndarray] | None:
    """``arr``'s memory as uint8 views in C order, one per contiguous trailing block, if
    every block is aligned for direct I/O and there are at most ``max_runs`` of them
    (a vectored read or write takes 1024 pieces); else None.

    A chunk slice of a per-layer KV buffer, ``buf[:, :, :, t0:t1, :]``, is such an array:
    a disk read can land in it directly instead of in a staging copy.
    """
    expected = arr.itemsize
    k = arr.ndim
    for axis in range(arr.ndim - 1, -1, -1):
        if arr.shape[axis] != 1 and arr.strides[axis] != expected:
            break
        expected *= arr.shape[axis]
        k = axis
    outer = arr.shape[:k]
    count = 1
    for d in outer:
        count *= d
    if count > max_runs or expected % ALIGN:
        return None
    runs = []
    for idx in np.ndindex(*outer):
        run = arr[idx].reshape(-1).view(np.uint8)
        if run.ctypes.data % ALIGN:
            return None
        runs.append(run)
    return runs


def prefault(buf: np.ndarray) -> None:
    """Touch every page of a fresh buffer so its page faults happen here, not inside a
    device read or a copy that is being timed against the device."""
    flat = buf.reshape(-1).view(np.uint8)
    flat[::PAGE] = 0


PAGE = 4096


class StagingPool:
    """Reusable aligned buffers for frames that cannot go straight from the caller's memory.

    Fresh memory costs a page fault per page on first touch, which at 16 MiB frames costs
    as much as the write itself; reusing a few warm buffers avoids it. ``get`` returns a
    buffer at least as large as asked (slice it); ``put`` gives the whole buffer back.
    """

    def __init__(self, keep: int) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        return aligned_empty(round_up(nbytes))

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                self._free.sort(key=lambda b: b.nbytes)
                del self._free[0]
