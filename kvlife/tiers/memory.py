"""Host-DRAM tier: arrays held in process memory under a byte budget.

Stores copy the caller's array once (the caller may reuse its buffer; a stored replica
must never change under a reader) into 4096-aligned memory, so that a write-back to
the disk tier goes out by direct I/O without a staging copy. The copy and the replica's
seal (the xxh3-128 of its bytes, :class:`~kvlife.tiers.base.SealedInMemory`) run block by
block, each block hashed while it is still in cache. ``commit_adopt`` takes over arrays
nobody can write (fresh disk reads, the store's own copies) without copying; a seal the
store hands over with them (the checksum a disk read just verified) is not recomputed.

Every held array is a read-only export of its memory (:func:`~kvlife.tiers.base.read_only`):
reads without a buffer hand it out, no copy, and no holder can make it writable again.
Reads into a caller's buffer are one copy. No pickling.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey
from kvlife.native.copies import copy_sealed as native_copy_sealed
from kvlife.native.copies import sealing as native_sealing
from kvlife.native.copies import stream_copy
from kvlife.tiers.base import (
    ReplicaMeta,
    Reservation,
    check_payloads,
    read_only,
    seal_of,
    sealed_meta,
)
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.held import HeldTier

SEAL_BLOCK = 256 << 10
"""Bytes copied and hashed at a time: small enough to be hashed from cache."""


@dataclass(slots=True)
class _Held:
    meta: ReplicaMeta
    array: np.ndarray
    """The replica: a read-only export of its memory (``owner`` is its base)."""
    owner: np.ndarray
    """The flat read-only array every view of ``array`` refers to (its references tell
    whether a view of the memory is still alive)."""
    raw: np.ndarray | None
    """The aligned byte buffer under ``array`` when this tier allocated it (recyclable)."""


class _BufferPool:
    """Warm aligned buffers of freed replicas, reused by later stores of the same size.

    A fresh buffer costs a page fault per page on first touch, about as much as the copy
    into it. Buffers are recycled only when no view of them is alive, and the pool never
    holds more than the tier's unused budget, so the tier's memory stays within it.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self.nbytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        stack = self._free.get(nbytes)
        if stack:
            self.nbytes -= nbytes
            return stack.pop()
        return aligned_empty(nbytes)

    def give(self, raw: np.ndarray, room: int) -> None:
        """Keep ``raw`` (no view of it may be alive) if ``room`` allows."""
        if raw.nbytes <= room:
            self._free.setdefault(raw.nbytes, []).append(raw)
            self.nbytes += raw.nbytes

    def shrink(self, limit: int) -> None:
        """Drop pooled buffers until at most ``limit`` bytes are pooled."""
        for size in sorted(self._free, reverse=True):
            stack = self._free[size]
            while stack and self.nbytes > limit:
                stack.pop()
                self.nbytes -= size


def copy_sealed(raw: np.ndarray, arr: np.ndarray, block: int = SEAL_BLOCK) -> bytes:
    """Copy ``arr`` into the aligned bytes ``raw`` and return the xxh3-128 of the copy
    (:func:`~kvlife.tiers.base.seal_of` of ``raw``, the same digest). A chunk larger
    than ``block``, where the extension's sealed copy is available, goes to
    :func:`kvlife.native.copies.copy_sealed`: each block hashed and then streamed from
    the cache, the interpreter lock released (a source whose contiguous runs are under
    1 KiB, which the extension refuses, is copied and then hashed whole). Without the
    extension each block of at most ``block`` bytes is hashed right after it is copied,
    so that the hash reads it from cache, not back from memory."""
    dst = raw.view(arr.dtype).reshape(arr.shape)
    if arr.nbytes <= block:
        np.copyto(dst, arr)
        return seal_of(raw)
    if native_sealing():
        return native_copy_sealed(dst, arr)
    h = xxhash.xxh3_128()
    if arr.flags.c_contiguous:  # byte ranges: the fewest Python steps per block
        src, out = arr.reshape(-1).view(np.uint8).data, raw.data
        for i in range(0, arr.nbytes, block):
            piece = out[i : i + block]
            piece[:] = src[i : i + block]
            h.update(piece)
        return bytes(h.digest())
    for d, s in _blocks(dst, arr, block):
        np.copyto(d, s)
        h.update(d.data)  # a run of whole leading rows of the contiguous copy: contiguous
    return bytes(h.digest())


def _blocks(
    dst: np.ndarray, src: np.ndarray, block: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``dst`` (C-contiguous) and ``src`` (same shape, any strides) as pairs of blocks
    that cover them in C order, each at most ``block`` bytes where the strides
    allow: runs of rows of the leading axes merged (a chunk cut from a KV tensor,
    ``kv[:, :, :, t0:t1]``, merges them; a row of 2 MiB hashed whole would no longer
    be in cache, issue 28), else each index of the first axis in turn."""
    if src.nbytes <= block or src.ndim <= 1:
        yield dst, src
        return
    inner, k = src.itemsize, src.ndim  # the bytes of one row of the last ndim - k axes
    while k > 1 and inner * src.shape[k - 1] <= block:
        k -= 1
        inner *= src.shape[k]
    try:
        rows = src.reshape((-1, *src.shape[k:]), copy=False)
    except ValueError:  # the leading axes do not merge without a copy
        for i in range(src.shape[0]):
            yield from _blocks(dst[i], src[i], block)
        return
    into = dst.reshape(rows.shape)
    step = max(1, block // inner)
    for i in range(0, rows.shape[0], step):
        yield into[i : i + step], rows[i : i + step]


class MemoryTier(HeldTier[_Held]):
    """Replicas in host DRAM, at most ``capacity_bytes`` of payload."""

    def __init__(self, capacity_bytes: int, name: str = "dram") -> None:
        if capacity_bytes < 0:
            raise InvalidArgument(f"memory tier capacity must be >= 0, got {capacity_bytes}")
        super().__init__(capacity_bytes, name)
        self._pool = _BufferPool()

    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        try:
            check_payloads(reservation.metas, payloads)
            held: list[_Held] = []
            raws = []
            with self._lock:
                for arr in payloads:
                    raws.append(self._pool.take(arr.nbytes))
                # Shrink only after taking: the batch's own reservation is what the pooled
                # buffers are for; shrinking first to the room left beside it emptied the
                # pool whenever a batch filled the tier, and every put paid fresh pages.
                self._pool.shrink(self.capacity_bytes - self._used - self._reserved)
            for meta, arr, raw in zip(reservation.metas, payloads, raws, strict=True):
                if meta.checksum_given:  # vouched for: no hash
                    stream_copy(raw.view(arr.dtype).reshape(arr.shape), arr)
                    seal = meta.checksum
                else:
                    seal = self._seal(meta, raw, copy_sealed(raw, arr))
                frozen = read_only(raw)
                held.append(
                    _Held(
                        sealed_meta(meta, seal),
                        frozen.view(arr.dtype).reshape(arr.shape),
                        frozen,
                        raw,
                    )
                )
        except BaseException:
            self.cancel_store(reservation)
            raise
        self._install(reservation, held)

    def commit_adopt(self, reservation: Reservation, arrays: Sequence[np.ndarray]) -> None:
        """Publish arrays the caller hands over for good (no copy): nobody may write them
        any more; they are kept as read-only exports. A checksum in a meta is taken as
        the seal (the bytes were verified against it where they came from); else the
        array is hashed."""
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        try:
            check_payloads(reservation.metas, arrays)
            held = []
            for meta, arr in zip(reservation.metas, arrays, strict=True):
                flat = read_only(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                seal = self._seal(meta, flat)
                held.append(
                    _Held(
                        sealed_meta(meta, seal),
                        flat.view(arr.dtype).reshape(arr.shape),
                        flat,
                        None,
                    )
                )
        except BaseException:
            self.cancel_store(reservation)
            raise
        self._install(reservation, held)

    def _dispose(self, held: _Held) -> None:
        raw = held.raw
        # references: held's own slot and getrefcount's argument (array); the array's
        # base, held's slot and the argument (owner). More: a view is alive somewhere.
        if raw is None or sys.getrefcount(held.array) > 2 or sys.getrefcount(held.owner) > 3:
            return
        room = self.capacity_bytes - self._used - self._reserved - self._pool.nbytes
        self._pool.give(raw, room)

    def delete(self, key: ChunkKey) -> int:
        return super().delete(key)
