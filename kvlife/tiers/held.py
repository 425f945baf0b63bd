"""What the two DRAM tiers share: replicas held as arrays in this process, under a byte
budget, with reservations for stores in flight, each sealed with the xxh3-128 of its
bytes when it is published.

:class:`~kvlife.tiers.memory.MemoryTier` (process memory) and
:class:`~kvlife.tiers.shm.ShmTier` (a shared-memory arena) differ in where a replica's
bytes live and what happens when it is deleted; the bookkeeping (budget, reservations,
lookups by key, reads into buffers or as read-only views, the seal and its audit) is
this class's.

Why a seal on memory: a held replica can change without any tier writing it (a caller
that forced a returned view writable, a server client writing an arena extent after its
put committed). Reads stay at memory speed (a view or one copy, unverified); the store
verifies the seal where the bytes leave memory for good (demotion, flush), in ``check``,
and on every load when asked to (``verify_dram_on_load``), so a changed replica is caught
and dropped instead of persisted or reported healthy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, ReplicaNotFound
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.native.copies import stream_copy
from kvlife.tiers.base import (
    AuditReport,
    CapacityShortfall,
    ChecksumsWrites,
    ReadResult,
    ReplicaMeta,
    ReportsLostReplicas,
    Reservation,
    SealedInMemory,
    SupportsAdopt,
    SupportsAudit,
    Tier,
    seal_of,
)


class Held(Protocol):
    """A held replica: its metadata (``checksum``: its seal) and its read-only array."""

    @property
    def meta(self) -> ReplicaMeta: ...

    @property
    def array(self) -> np.ndarray: ...


H = TypeVar("H", bound=Held)


class HeldTier(
    Tier,
    SupportsAdopt,
    SealedInMemory,
    SupportsAudit,
    ReportsLostReplicas,
    ChecksumsWrites,
    Generic[H],
):
    """Replicas as arrays in this process, at most ``capacity_bytes`` of footprint."""

    def __init__(self, capacity_bytes: int, name: str) -> None:
        self.name = TierName(name)
        self.capacity_bytes = capacity_bytes
        self._held: dict[ChunkKey, H] = {}
        self._used = 0
        self._reserved = 0
        self._lock = threading.Lock()
        self._lost: list[tuple[ChunkKey, str]] = []

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
                    self._dispose(old)
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

    def _dispose(self, held: H) -> None:
        """A replica left the tier (under the lock): give its memory back where the
        tier can (views of it may still be alive; they keep its memory)."""

    def delete(self, key: ChunkKey) -> int:
        with self._lock:
            held = self._take(key)
            self._dispose(held)
            return held.meta.nbytes

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
        """Into ``outs`` where given (one copy), else the held array itself: read-only
        from the start, and its flag cannot be set back (no copy; it keeps its memory
        alive for as long as the caller holds it)."""
        return self._read(keys, outs, verify=False)

    def read_verified(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        """``read_batch`` that first checks each replica against its seal: one that
        changed since it was sealed is a ChecksumMismatch (nothing copied out of it)."""
        return self._read(keys, outs, verify=True)

    def _read(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None, verify: bool
    ) -> list[ReadResult]:
        results: list[ReadResult] = []
        for i, key in enumerate(keys):
            # the array is referenced under the lock: a delete racing this read then
            # sees a live view and never recycles the memory under it
            with self._lock:
                held = self._held.get(key)
                if held is None:
                    raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
                array, seal = held.array, held.meta.checksum
            if verify:
                problem = _unsealed(array, seal)
                if problem:
                    results.append(ChecksumMismatch(key.hex(), self.name, problem))
                    continue
            out = outs[i] if outs is not None else None
            if out is None:
                results.append(array)
                continue
            if out.shape != array.shape or out.dtype != array.dtype:
                raise InvalidArgument(
                    f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
                    f"{array.dtype}{list(array.shape)}"
                )
            stream_copy(out, array)  # streaming stores: 1.3x-1.7x np.copyto here
            results.append(out)
        return results

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> AuditReport:
        """Verify every held replica against its seal, beside serving (the tier lock is
        held only to list the replicas and to drop bad ones). A replica that fails is
        dropped at once, fix or not: it is a copy in memory that must never be served
        or made durable; it is reported through :meth:`take_lost` (the store counts it
        and invalidates it) and listed in the report."""
        report = AuditReport()
        with self._lock:
            snapshot = list(self._held.items())
        bad: list[tuple[ChunkKey, H, str]] = []
        for key, held in snapshot:
            with self._lock:  # still held? then its memory stays while it is hashed
                if self._held.get(key) is not held:
                    continue
                array = held.array
            if progress is not None:
                progress(held.meta.nbytes)
            report.rows += 1
            problem = _unsealed(array, held.meta.checksum)
            del array
            if problem:
                bad.append((key, held, problem))
            else:
                report.ok += 1
        dropped = 0
        with self._lock:
            for key, held, problem in bad:
                report.problems.append(f"{self.name} {key.hex()[:16]}…: {problem}")
                report.bad_keys.append(key)
                if self._held.get(key) is held:  # not replaced since it was checked
                    self._take(key)
                    self._dispose(held)
                    self._lost.append((key, f"{problem} (found by check)"))
                    dropped += 1
        if dropped:
            report.actions.append(f"dropped {dropped} {self.name} replicas that failed their seal")
        return report

    def take_lost(self) -> list[tuple[ChunkKey, str]]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def replica_keys(self) -> list[ChunkKey]:
        return list(self._held)

    def _seal(self, meta: ReplicaMeta, array: np.ndarray, hashed: bytes = b"") -> bytes:
        """The seal of a replica being published: the checksum its writer vouches for,
        else ``hashed`` (the tier's own hash of the bytes, made while copying) or a hash
        now; with ``verify_checksum`` the bytes must match the writer's checksum."""
        if meta.checksum_given:
            return meta.checksum
        seal = hashed or seal_of(array)
        if meta.verify_checksum and meta.checksum and seal != meta.checksum:
            raise ChecksumMismatch(
                meta.key.hex(),
                f"{self.name} write",
                "the payload no longer matches the checksum it was sealed with",
            )
        return seal


def _unsealed(array: np.ndarray, seal: bytes) -> str:
    """Empty if ``array`` still matches its seal, else what is wrong."""
    if not seal:
        return "replica carries no seal"
    if seal_of(array) != seal:
        return "payload changed in memory after it was sealed (xxh3-128 mismatch)"
    return ""
