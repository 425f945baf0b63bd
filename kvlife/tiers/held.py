"""What the two DRAM tiers share: replicas held as arrays in this process, under a byte
budget, with reservations for stores in flight.

:class:`~kvlife.tiers.memory.MemoryTier` (process memory) and
:class:`~kvlife.tiers.shm.ShmTier` (a shared-memory arena) differ in where a replica's
bytes live and what happens when it is deleted; the bookkeeping (budget, reservations,
lookups by key, reads into buffers or as read-only views) is this class's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from kvlife.core.errors import InvalidArgument, ReplicaNotFound
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.tiers.base import (
    CapacityShortfall,
    ReadResult,
    ReplicaMeta,
    Reservation,
    SupportsAdopt,
    Tier,
)


class Held(Protocol):
    """A held replica: its metadata and its read-only array."""

    @property
    def meta(self) -> ReplicaMeta: ...

    @property
    def array(self) -> np.ndarray: ...


H = TypeVar("H", bound=Held)


class HeldTier(Tier, SupportsAdopt, Generic[H]):
    """Replicas as arrays in this process, at most ``capacity_bytes`` of footprint."""

    def __init__(self, capacity_bytes: int, name: str) -> None:
        self.name = TierName(name)
        self.capacity_bytes = capacity_bytes
        self._held: dict[ChunkKey, H] = {}
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used + self._reserved

    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        need = sum(self.footprint(m.nbytes) for m in metas)
        with self._lock:
            over = self._used + self._reserved + need - self.capacity_bytes
            if over > 0:
                return CapacityShortfall(over)
            self._reserved += need
        return Reservation(self.name, list(metas), need)

    def cancel_store(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.done:
                self._reserved -= reservation.nbytes
                reservation.done = True

    def _install(self, reservation: Reservation, held: Sequence[H]) -> None:
        """Publish a reservation's replicas (replacing older ones of the same keys)."""
        with self._lock:
            self._reserved -= reservation.nbytes
            for h in held:
                old = self._held.pop(h.meta.key, None)
                if old is not None:
                    self._used -= self.footprint(old.meta.nbytes)
                self._held[h.meta.key] = h
                self._used += self.footprint(h.meta.nbytes)
            reservation.done = True

    def _take(self, key: ChunkKey) -> H:
        """Remove ``key``'s replica from the budget (the caller holds the lock)."""
        held = self._held.pop(key, None)
        if held is None:
            raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
        self._used -= self.footprint(held.meta.nbytes)
        return held

    def contains(self, key: ChunkKey) -> bool:
        return key in self._held

    def meta(self, key: ChunkKey) -> ReplicaMeta:
        held = self._held.get(key)
        if held is None:
            raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
        return held.meta

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        """Into ``outs`` where given (one copy), else the read-only held array itself
        (no copy; it keeps its memory alive for as long as the caller holds it)."""
        results: list[ReadResult] = []
        for i, key in enumerate(keys):
            held = self._held.get(key)
            if held is None:
                raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
            out = outs[i] if outs is not None else None
            if out is None:
                results.append(held.array)
                continue
            if out.shape != held.array.shape or out.dtype != held.array.dtype:
                raise InvalidArgument(
                    f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
                    f"{held.array.dtype}{list(held.array.shape)}"
                )
            np.copyto(out, held.array)
            results.append(out)
        return results

    def replica_keys(self) -> list[ChunkKey]:
        return list(self._held)
