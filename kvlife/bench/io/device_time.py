"""Seconds the disk tier spends inside the device's write calls during ``kvlife bench
io``'s disk stores: a :class:`~kvlife.tiers.disk.fileio.FileIO` that times its
``pwritev`` and ``fdatasync`` (the tier's writes run on its I/O thread, so the sum is
kept under a lock). A store's time minus this is what kvlife adds around the device
(its checksums, headers, the catalog); the raw write's time against this is how fast
the device took the tier's writes against the raw file's."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from kvlife.tiers.disk.fileio import FileIO


class DeviceTimedIO(FileIO):
    """A FileIO that adds up the seconds spent in ``pwritev`` and ``fdatasync``."""

    def __init__(self, direct: bool) -> None:
        super().__init__(direct)
        self._lock = threading.Lock()
        self._seconds = 0.0

    @property
    def seconds(self) -> float:
        """Seconds spent in the device's write calls so far."""
        with self._lock:
            return self._seconds

    def _add(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        with self._lock:
            self._seconds += dt

    def pwritev(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        t0 = time.perf_counter()
        try:
            return super().pwritev(fd, buffers, offset)
        finally:
            self._add(t0)

    def fdatasync(self, fd: int) -> None:
        t0 = time.perf_counter()
        try:
            super().fdatasync(fd)
        finally:
            self._add(t0)
