"""What each principal's own requests did: the counters a tenant sees through the
server (an admin sees every principal's and the store's).

Every figure here is counted from a principal's own requests and the replies they got,
which depend only on what it may read, so no figure a tenant sees moves with another
tenant's objects. The names are :class:`~kvlife.results.StoreCounters` fields, so a
client reads them as it reads the store's.
"""

from __future__ import annotations

import threading
from collections import defaultdict

FIELDS = (
    "puts",
    "chunks_stored",
    "chunks_already_present",
    "chunks_dropped",
    "lookups",
    "lookup_chunks_hit",
    "lookup_chunks_miss",
    "lookup_chunks_refused",
    "loads",
)
"""The counters kept per principal (StoreCounters names)."""


class TenantCounters:
    """Counters per principal name, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: defaultdict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))

    def add(self, principal: str, **deltas: int) -> None:
        with self._lock:
            row = self._by[principal]
            for k, v in deltas.items():
                row[k] += v

    def of(self, principal: str) -> dict[str, int]:
        """One principal's counters (zeros if it did nothing yet)."""
        with self._lock:
            return dict(self._by[principal])

    def every(self) -> dict[str, dict[str, int]]:
        """Every principal's counters (an admin's view)."""
        with self._lock:
            return {k: dict(v) for k, v in sorted(self._by.items())}
