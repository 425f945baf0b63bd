"""What the disk tier counts and what it owes the store a report of.

:class:`DiskStats` holds the byte and event counters since the tier was opened (shown by
``info`` through ``details()``); every room updates its own under the tier lock.
:class:`LostReplicas` queues the replicas the tier dropped by itself (quarantined by
recovery, found corrupt by compaction, dropped by ``check --fix``), each with why, until
the store takes them (:class:`~kvlife.tiers.base.ReportsLostReplicas`): every loss is a
counted, explained event. The store's lifetime counters live in the catalog
(:meth:`~kvlife.tiers.disk.catalog.Catalog.save_counters`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvlife.core.identity import ChunkKey


@dataclass(slots=True)
class DiskStats:
    """Byte and event counters of a disk tier since it was opened."""

    frames_written: int = 0
    bytes_written: int = 0
    payload_bytes_written: int = 0
    bytes_read: int = 0
    compaction_bytes_read: int = 0
    compaction_bytes_written: int = 0
    segments_reclaimed: int = 0
    recovered: int = 0
    recovery_dropped: int = 0
    """Rows this open found bad and quarantined (each reported once by take_lost)."""
    rows_quarantined: int = 0
    """Quarantined rows in the catalog at open (not served; ``check --fix`` deletes them)."""
    segments_quarantined: int = 0
    """Unreferenced segment files this open moved to ``quarantine/``."""
    unlink_failures: int = 0
    """Emptied segments whose file could not be unlinked (left for ``check --fix``)."""


class LostReplicas:
    """Replicas the tier dropped on its own, with why, until the store takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: list[tuple[ChunkKey, str]] = []

    def add(self, key: ChunkKey, why: str) -> None:
        with self._lock:
            self._lost.append((key, why))

    def take(self) -> list[tuple[ChunkKey, str]]:
        """Every loss since the last call (each reported exactly once)."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost
