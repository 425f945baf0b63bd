"""Aligned memory for direct I/O and zero-copy hand-offs between tiers.

O_DIRECT needs buffer addresses, lengths and file offsets aligned (512 bytes here,
4096 to be safe everywhere). Arrays allocated through :func:`aligned_empty` can go from
the DRAM tier to the disk tier, and from the disk into an engine's buffer, without a
staging copy.

Buffers of 2 MiB and more are anonymous mappings aligned to 2 MiB and advised for
transparent huge pages: direct I/O from 4 KiB pages pins and maps 512 pages per 2 MiB and
measured 10-20% slower here than from huge pages. Fresh memory is expensive on first
touch (page faults, and on a VM the host's faults too: reading 16 MiB objects into fresh
arrays ran at a fifth of the device's speed), so :class:`RecyclingPool` hands out new
arrays whose memory comes back to the pool when the last view of one is garbage
collected.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import weakref

import numpy as np

ALIGN = 4096
"""Alignment of offsets, lengths and buffer addresses for direct I/O."""


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


HUGE_PAGE = 2 << 20
"""Size of a transparent huge page on x86-64 and arm64 (4 KiB base pages)."""


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is ``align``-aligned (and, from
    2 MiB up, huge-page aligned and advised for huge pages)."""
    if nbytes >= HUGE_PAGE and HUGE_PAGE % align == 0:
        mapping, offset = _huge_mapping(nbytes)
        return np.frombuffer(mapping, np.uint8)[offset : offset + nbytes]
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes]


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with ``nbytes`` at a 2 MiB-aligned offset (returned).

    Only the whole huge pages are advised, so a frame of 2 MiB + 4 KiB does not take a
    second huge page for its last 4 KiB. The spare virtual space costs no memory.
    """
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = (-np.frombuffer(mapping, np.uint8).ctypes.data) % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole:
        advise_huge(mapping, offset, whole)
    return mapping, offset


def advise_huge(mapping: mmap.mmap, offset: int = 0, length: int | None = None) -> None:
    """Advise ``length`` bytes of ``mapping`` from ``offset`` for transparent huge pages
    (a shared mapping: what a tmpfs mounted ``huge=advise`` waits for). THP compiled out
    or disabled: 4 KiB pages, the same bytes."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mapping.madvise(advice, offset, len(mapping) - offset if length is None else length)


def is_aligned(arr: np.ndarray, align: int = ALIGN) -> bool:
    return arr.ctypes.data % align == 0 and arr.nbytes % align == 0


def contiguous_tail(arr: np.ndarray) -> tuple[int, int]:
    """``(k, nbytes)``: ``arr``'s axes from ``k`` on are contiguous together, one run of
    ``nbytes`` bytes for each index of the axes before ``k`` (axes of length 1 count as
    contiguous; ``k == ndim``: each element is a run of its own)."""
    nbytes = arr.itemsize
    k = arr.ndim
    for axis in range(arr.ndim - 1, -1, -1):
        if arr.shape[axis] != 1 and arr.strides[axis] != nbytes:
            break
        nbytes *= arr.shape[axis]
        k = axis
    return k, nbytes


def aligned_runs(arr: np.ndarray, max_runs: int = 1000) -> list[np.ndarray] | None:
    """``arr``'s memory as uint8 views in C order, one per contiguous trailing block, if
    every block is aligned for direct I/O and there are at most ``max_runs`` of them
    (a vectored read or write takes 1024 pieces); else None.

    A chunk slice of a per-layer KV buffer, ``buf[:, :, :, t0:t1, :]``, is such an array:
    a disk read can land in it directly instead of in a staging copy.
    """
    k, expected = contiguous_tail(arr)
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
    At most ``keep`` buffers are kept idle, or more while they total at most
    ``keep_bytes`` (a write pipeline of many small frames has many in flight).
    """

    def __init__(self, keep: int, keep_bytes: int = 64 << 20) -> None:
        self._free: list[np.ndarray] = []
        self._keep = keep
        self._keep_bytes = keep_bytes
        self._idle = 0
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    self._idle -= buf.nbytes
                    return self._free.pop(i)
        return aligned_empty(round_up(nbytes))

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            self._idle += buf.nbytes
            if len(self._free) > self._keep and self._idle > self._keep_bytes:
                self._free.sort(key=lambda b: b.nbytes)
                while len(self._free) > self._keep and self._idle > self._keep_bytes:
                    self._idle -= self._free.pop(0).nbytes


class RecyclingPool:
    """Aligned buffers handed out as new arrays, recycled when their last view dies.

    A reader that returns new arrays (``read_batch`` without output buffers) would pay
    the first-touch cost of fresh memory on every object. Each array handed out is backed
    by a pool-owned mapping exported through a fresh memoryview; numpy makes that
    memoryview the base of the array and of every view derived from it, so a weak
    finalizer on it learns exactly when no view of the memory is left, and only then the
    mapping goes back to the pool, still warm.

    Idle memory is bounded twice: never more than ``keep_bytes``, and never more than the
    most this pool ever had handed out at once (its caller's own peak), so an idle pool
    holds no memory its caller did not recently use.
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[tuple[mmap.mmap, int]]] = {}
        self.idle_bytes = 0
        self._out = 0
        self._peak = 0
        self.reused = 0
        """Hand-outs served by recycled memory (for tests and diagnostics)."""
        self._lock = threading.Lock()
        self._given: collections.deque[tuple[mmap.mmap, int, int]] = collections.deque()
        """Buffers whose last view died: the finalizer only appends here (it takes no
        lock: the collector may run it on a thread inside ``take``); ``take`` and
        ``clear`` put them back under the lock."""

    def take(self, nbytes: int) -> np.ndarray:
        """A new aligned uint8 array of ``nbytes`` (its contents are undefined)."""
        size = round_up(max(nbytes, 1))
        with self._lock:
            self._drain()
            stack = self._free.get(size)
            found = stack.pop() if stack else None
            if found is not None:
                self.idle_bytes -= size
                self.reused += 1
            self._out += size
            self._peak = max(self._peak, self._out)
        if found is None:
            found = _huge_mapping(size) if size >= HUGE_PAGE else (_small_mapping(size), 0)
        mapping, offset = found
        whole = np.frombuffer(mapping, np.uint8)
        fin = weakref.finalize(whole.base, self._give, mapping, offset, size)
        fin.atexit = False
        return whole[offset : offset + nbytes]

    def _give(self, mapping: mmap.mmap, offset: int, size: int) -> None:
        # a finalizer: no lock, no I/O (docs/server.md, "Finalizers")
        self._given.append((mapping, offset, size))

    def _drain(self) -> None:
        """Take back the buffers given back since (the caller holds ``_lock``)."""
        while self._given:
            mapping, offset, size = self._given.popleft()
            self._out -= size
            limit = min(self.keep_bytes, self._peak)
            # Idle buffers of other sizes make room first: the size just given back is
            # the one in use now (KV chunks of one model have one size).
            for other in sorted(self._free, reverse=True):
                if self.idle_bytes + size <= limit:
                    break
                stack = self._free[other]
                while other != size and stack and self.idle_bytes + size > limit:
                    stack.pop()
                    self.idle_bytes -= other
            if self.idle_bytes + size <= limit:
                self._free.setdefault(size, []).append((mapping, offset))
                self.idle_bytes += size
            # else the mapping is dropped here and unmapped with its last reference

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            self._drain()
            self._free.clear()
            self.idle_bytes = 0


def _small_mapping(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
