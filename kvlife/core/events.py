"""Lifecycle events and the sinks that receive them.

Every lifecycle move emits one :class:`LifecycleEvent`. Events go to a pluggable
:class:`EventSink`; a JSON-lines sink and an in-memory sink (drained with ``take()``) are
built in. The same record is written by the live store and, later, by the simulator.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

EVENT_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """One lifecycle move of one object or replica."""

    time: float
    """Wall-clock (live) or virtual (simulated) time in seconds."""
    seq: int
    """Sequence number, strictly increasing per store; orders events with equal time."""
    kind: str
    """The move (a :class:`~kvlife.core.lifecycle.Move` value)."""
    key: str
    """Chunk key, hex."""
    state: str
    """Object state after the move."""
    tier: str = ""
    """Tier the move happened in (source tier for offloads)."""
    dst_tier: str = ""
    """Destination tier of an offload, else empty."""
    nbytes: int = 0
    """Bytes moved or held."""
    transform: str = "exact"
    """Representation of the replica."""
    namespace: str = ""
    """Namespace of the object."""
    model: str = ""
    """Weights digest (model version) of the object."""
    reason: str = ""
    """Why (for example ``corrupt``, ``evicted``, ``invalidated:weights``)."""
    request_id: str = ""
    """Request that caused the move, if known."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["v"] = EVENT_SCHEMA_VERSION
        return d


class EventSink(ABC):
    """Receiver of lifecycle events. Implementations must be cheap: they are on the hot path."""

    @abstractmethod
    def emit(self, event: LifecycleEvent) -> None: ...

    def kinds(self) -> frozenset[str] | None:
        """The moves (:class:`~kvlife.core.lifecycle.Move` values) this sink wants; None:
        every one. The store builds no event for a move no sink wants, so a sink that
        wants a few rare moves costs the hot path nothing (asked once, at open)."""
        return None

    def flush(self) -> None:
        """Make emitted events durable or visible (default: nothing to do)."""

    def close(self) -> None:
        self.flush()


class NullSink(EventSink):
    """Drops every event."""

    def emit(self, event: LifecycleEvent) -> None:
        return None


class FanOutSink(EventSink):
    """Sends every event to each of several sinks, in order (a server's recent-events
    ring, its log lines, a KV-events publisher)."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def emit(self, event: LifecycleEvent) -> None:
        for sink in self.sinks:
            sink.emit(event)

    def kinds(self) -> frozenset[str] | None:
        wanted: set[str] = set()
        for sink in self.sinks:
            got = sink.kinds()
            if got is None:
                return None
            wanted |= got
        return frozenset(wanted)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class MemorySink(EventSink):
    """Keeps events in memory until the caller drains them with :meth:`take`."""

    def __init__(self) -> None:
        self._events: list[LifecycleEvent] = []
        self._lock = threading.Lock()

    def emit(self, event: LifecycleEvent) -> None:
        with self._lock:
            self._events.append(event)

    def take(self) -> list[LifecycleEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class JsonlSink(EventSink):
    """Appends one JSON object per event to a file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: IO[str] = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def emit(self, event: LifecycleEvent) -> None:
        line = json.dumps(event.to_dict(), separators=(",", ":"))
        with self._lock:
            self._fh.write(line + "\n")

    def flush(self) -> None:
        with self._lock:
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


def read_jsonl(path: str | Path) -> list[LifecycleEvent]:
    """Read events written by :class:`JsonlSink`."""
    events = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            d = json.loads(line)
            d.pop("v", None)
            events.append(LifecycleEvent(**d))
    return events
