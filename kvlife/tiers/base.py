"""The Tier interface: one narrow seam that every storage tier implements.

Stores are two-phase: :meth:`Tier.prepare_store` reserves capacity (or reports the
shortfall as a typed result, never by raising), :meth:`Tier.commit_store` writes the
payloads, makes them as durable as the tier promises and only then makes them visible;
on any failure nothing of the batch is visible and the reservation is released.
Reads verify whatever the tier can verify and raise
:class:`~kvlife.core.errors.ChecksumMismatch` rather than return wrong bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, ReplicaReadError
from kvlife.core.identity import ChunkKey


@dataclass(frozen=True, slots=True)
class ReplicaMeta:
    """What a tier records about one replica besides its bytes."""

    key: ChunkKey
    """Chunk key."""
    dtype: str
    """numpy dtype name of the stored array."""
    shape: tuple[int, ...]
    """Shape of the stored array."""
    transform: str = "exact"
    """Representation (``exact`` for the engine's own bytes)."""
    info: bytes = b""
    """Opaque object metadata persisted with the replica (identity fields for recovery)."""

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise InvalidArgument(f"replica key must be 32 bytes, got {len(self.key)}")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"replica shape {self.shape} has a negative dimension")

    @property
    def nbytes(self) -> int:
        n = np.dtype(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class CapacityShortfall:
    """Returned by prepare_store when the batch does not fit."""

    need_bytes: int
    """Bytes that must be freed before the batch fits."""


@dataclass(slots=True)
class Reservation:
    """Capacity reserved for one batch by prepare_store."""

    tier: str
    metas: list[ReplicaMeta]
    nbytes: int
    state: Any = field(default=None)
    """Tier-private bookkeeping."""
    done: bool = False


ReadResult = np.ndarray | ChecksumMismatch | ReplicaReadError
"""Per replica: the verified array, the mismatch that proves it corrupt, or the I/O
error that kept it from being read (a miss, the replica is kept)."""


class Tier(ABC):
    """A place that holds replicas: host DRAM, local disk, a remote store."""

    name: str
    capacity_bytes: int

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes charged against the capacity (reserved ones included)."""

    @abstractmethod
    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        """Reserve room for ``metas``; nothing is visible yet."""

    @abstractmethod
    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        """Write, make durable, then publish. On failure: raise, publish nothing, release."""

    @abstractmethod
    def cancel_store(self, reservation: Reservation) -> None:
        """Release a reservation without writing."""

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def meta(self, key: ChunkKey) -> ReplicaMeta:
        """Metadata of a held replica (ReplicaNotFound if absent)."""

    @abstractmethod
    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        """Read replicas in order, into ``outs`` where given, else into new arrays.

        A replica that fails verification yields its ChecksumMismatch; the others are
        unaffected. ReplicaNotFound is raised for a key the tier does not hold.
        """

    @abstractmethod
    def delete(self, key: ChunkKey) -> int:
        """Drop a replica; return the bytes it held (ReplicaNotFound if absent)."""

    @abstractmethod
    def replica_keys(self) -> list[ChunkKey]: ...

    def footprint(self, nbytes: int) -> int:
        """Capacity a replica of ``nbytes`` payload bytes takes (framing included)."""
        return nbytes

    def close(self) -> None:
        """Release files and threads."""

    def read(self, key: ChunkKey) -> np.ndarray:
        """One replica as a new array; raises ChecksumMismatch on corruption."""
        (result,) = self.read_batch([key])
        if isinstance(result, np.ndarray):
            return result
        raise result

    def store(self, metas: Sequence[ReplicaMeta], payloads: Sequence[np.ndarray]) -> bool:
        """prepare + commit in one call; False (nothing stored) when it does not fit."""
        res = self.prepare_store(metas)
        if isinstance(res, CapacityShortfall):
            return False
        self.commit_store(res, payloads)
        return True


def check_payloads(metas: Sequence[ReplicaMeta], payloads: Sequence[np.ndarray]) -> None:
    """Raise InvalidArgument unless every payload matches its meta's dtype and shape."""
    if len(metas) != len(payloads):
        raise InvalidArgument(f"{len(metas)} replica metas but {len(payloads)} payloads")
    for meta, arr in zip(metas, payloads, strict=True):
        if arr.dtype != np.dtype(meta.dtype) or arr.shape != meta.shape:
            raise InvalidArgument(
                f"payload for {meta.key.hex()[:16]}… is {arr.dtype}{list(arr.shape)}, "
                f"its meta says {meta.dtype}{list(meta.shape)}"
            )
