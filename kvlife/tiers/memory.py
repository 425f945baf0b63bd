"""Host-DRAM tier: arrays held in process memory under a byte budget.

Stores copy the caller's array once (the caller may reuse its buffer; a stored replica
must never change under a reader) into 4096-aligned memory, so that a write-back to
the disk tier goes out by direct I/O without a staging copy. ``commit_adopt`` takes
over arrays nobody else writes (fresh disk reads) without copying. Reads into a
caller's buffer are one copy; reads without a buffer hand back a read-only view of the
held array, no copy. No pickling.
DRAM is trusted like the engine's own memory: replicas here carry no checksum; one is
computed when a replica is written to a checksummed tier.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import ReplicaMeta, Reservation, check_payloads
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.held import HeldTier


@dataclass(slots=True)
class _Held:
    meta: ReplicaMeta
    array: np.ndarray
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
        """Keep ``raw`` if no one else references its memory and ``room`` allows."""
        owner = raw.base
        # references: raw.base, the local name, getrefcount's argument
        if owner is None or sys.getrefcount(owner) > 3 or raw.nbytes > room:
            return
        self._free.setdefault(raw.nbytes, []).append(raw)
        self.nbytes += raw.nbytes

    def shrink(self, limit: int) -> None:
        """Drop pooled buffers until at most ``limit`` bytes are pooled."""
        for size in sorted(self._free, reverse=True):
            stack = self._free[size]
            while stack and self.nbytes > limit:
                stack.pop()
                self.nbytes -= size


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
            copies = []
            raws = []
            with self._lock:
                for arr in payloads:
                    raws.append(self._pool.take(arr.nbytes))
                # Shrink only after taking: the batch's own reservation is what the pooled
                # buffers are for; shrinking first to the room left beside it emptied the
                # pool whenever a batch filled the tier, and every put paid fresh pages.
                self._pool.shrink(self.capacity_bytes - self._used - self._reserved)
            for arr, raw in zip(payloads, raws, strict=True):
                held = raw.view(arr.dtype).reshape(arr.shape)
                np.copyto(held, arr)
                held.flags.writeable = False
                copies.append(held)
        except BaseException:
            self.cancel_store(reservation)
            raise
        self._publish(reservation, copies, raws)

    def commit_adopt(self, reservation: Reservation, arrays: Sequence[np.ndarray]) -> None:
        """Publish arrays the caller hands over for good (no copy): they are made
        read-only. For buffers nobody else writes, e.g. freshly read disk replicas."""
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        try:
            check_payloads(reservation.metas, arrays)
        except BaseException:
            self.cancel_store(reservation)
            raise
        for arr in arrays:
            arr.flags.writeable = False
        self._publish(reservation, arrays, [None] * len(arrays))

    def _publish(
        self,
        reservation: Reservation,
        copies: Sequence[np.ndarray],
        raws: Sequence[np.ndarray | None],
    ) -> None:
        held = [
            _Held(meta, arr, raw)
            for meta, arr, raw in zip(reservation.metas, copies, raws, strict=True)
        ]
        self._install(reservation, held)

    def delete(self, key: ChunkKey) -> int:
        with self._lock:
            held = self._take(key)
            nbytes = held.meta.nbytes
            raw = held.raw
            del held  # drop our view so that only outside views keep the buffer alive
            if raw is not None:
                room = self.capacity_bytes - self._used - self._reserved - self._pool.nbytes
                self._pool.give(raw, room)
            return nbytes
