"""The server's live figures that no store counter holds: request latency histograms and
a ring of recent lifecycle events.

Both are cheap to feed on the hot path (a request costs two clock reads, a bisect and an
add; an event one append), need no optional package, and are read only when asked: by
the ``stats`` verb (``kvlife top``) and by the Prometheus collector at scrape time
(:mod:`kvlife.server.prometheus`).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from typing import Any

from kvlife.core.events import EventSink, LifecycleEvent

LATENCY_BOUNDS: tuple[float, ...] = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds (seconds, inclusive) of the latency buckets; one more bucket, +Inf,
follows. A load from the arena takes tens of microseconds, a disk read milliseconds."""

TIMED_VERBS: dict[str, str] = {
    "lookup": "lookup",
    "load": "load",
    "prepare_put": "store_prepare",
    "put": "store_prepare",
    "commit_put": "store_commit",
    "put_commit": "store_commit",
    "put_inline": "store_commit",
}
"""Verbs whose handling time is observed, and the histogram each goes to: a put is
prepared (objects created, extents reserved) then committed (sealed, written, indexed);
``put_inline`` does both in one request, counted as a commit."""


class Latency:
    """One histogram: a count per bucket of :data:`LATENCY_BOUNDS` (+Inf last), and the
    sum of the observed seconds."""

    __slots__ = ("_counts", "_lock", "_sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BOUNDS) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect_left(LATENCY_BOUNDS, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``counts`` per bucket (not cumulative; +Inf last), ``sum`` and ``count``."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        return {"counts": counts, "sum": total, "count": sum(counts)}


RECENT_KINDS = frozenset(
    {"offload", "evict", "invalidate", "corrupt", "abort", "refuse", "transform"}
)
"""The moves the ring keeps: what changes where KV lives or whether it is served
(demotions and promotions, evictions, invalidations, corruption, aborted puts, refused
replicas), not the per-chunk steps of every put and load (put, write, seal, commit,
index, load, delete), which would cost every request an event and flood the view, nor
the recovery of every object at open (the server logs one line for it)."""


class RecentEvents(EventSink):
    """The last ``size`` lifecycle events of the store of :data:`RECENT_KINDS` (a ring;
    the ledger calls :meth:`emit` under its lock, so it only appends)."""

    def __init__(self, size: int = 256) -> None:
        self._ring: deque[LifecycleEvent] = deque(maxlen=size)
        self._lock = threading.Lock()

    def emit(self, event: LifecycleEvent) -> None:
        with self._lock:
            self._ring.append(event)

    def kinds(self) -> frozenset[str]:
        return RECENT_KINDS

    def after(self, seq: int, limit: int) -> list[LifecycleEvent]:
        """The last ``limit`` events whose sequence number is above ``seq``, oldest first."""
        with self._lock:
            events = [e for e in self._ring if e.seq > seq]
        return events[-limit:] if limit > 0 else []


class LiveFigures:
    """What a server observes itself: latency per :data:`TIMED_VERBS` histogram and the
    recent events (fed by the store's event sink)."""

    def __init__(self, ring: int = 256) -> None:
        self.latency: dict[str, Latency] = {name: Latency() for name in set(TIMED_VERBS.values())}
        self.events = RecentEvents(ring)

    def observe(self, verb: str, seconds: float) -> None:
        """One request of ``verb`` handled in ``seconds`` (ignored if it is not timed)."""
        name = TIMED_VERBS.get(verb)
        if name is not None:
            self.latency[name].observe(seconds)

    def latencies(self) -> dict[str, dict[str, Any]]:
        return {name: h.snapshot() for name, h in sorted(self.latency.items())}


def quantile(q: float, counts: list[int]) -> float | None:
    """The ``q`` quantile of a histogram of :data:`LATENCY_BOUNDS` buckets (``counts``
    per bucket, not cumulative), interpolated linearly inside its bucket as Prometheus'
    ``histogram_quantile`` does; the last finite bound if it falls in +Inf; None for an
    empty histogram."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i >= len(LATENCY_BOUNDS):
                return LATENCY_BOUNDS[-1]
            lo = LATENCY_BOUNDS[i - 1] if i else 0.0
            hi = LATENCY_BOUNDS[i]
            return lo + (hi - lo) * (rank - seen) / n
        seen += n
    return LATENCY_BOUNDS[-1]
