"""Short pauses of the garbage collector in a long-lived ``kvlife serve`` (issue 28: the
tails of served calls).

CPython's full collection walks every object it tracks and stops every thread while it
does. The store keeps about nine such objects per chunk it indexes (its record, the
record's identity, replicas and their maps, the index's sets), and a full collection
runs each time a quarter more objects have lived long: with 256,000 chunks indexed an
embedded store's puts stopped for up to 0.49 s, 0.26 s at 128,000 (docs/server.md,
Known limits, "Collector pauses").

:class:`HeapPolicy` freezes what survives each full collection (``gc.freeze``): later
full collections walk only what was made since, and what is frozen is still freed the
moment its last reference goes (a record the store drops, an extent whose last view
dies). A frozen object that later becomes part of an unreachable reference cycle (a
session's handlers after it closes, a traceback holding an extent's view) is not
freed by those collections, so every ``whole_every_s`` a whole collection (everything
unfrozen, collected, frozen again) runs from a thread of its own: the one long pause
left, and the longest a cycle's memory waits.

Full collections may run after every collection of the middle generation
(:data:`FULL_EVERY`), so that each walks less.

Only the process that owns the server installs it (:func:`kvlife.server.server.run`):
a library must not change the collector of the process it is embedded in.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

from kvlife.core.logs import log_event

log = logging.getLogger("kvlife.serve")

_OLDEST = len(gc.get_threshold()) - 1
"""The generation a full collection collects (2)."""

FULL_EVERY = 1
"""A full collection may follow every collection of the middle generation (Python's
default: every tenth), as long as a quarter more objects lived long since the last
(Python's own rule): each then walks what one middle collection promoted, not ten.
Measured (docs/server.md, "Collector pauses"): the served puts' p99 4.6-10.4 ms at
32,000-256,000 chunks in three ``kvlife bench pauses`` runs, as without the policy
(whose longest puts took up to 975 ms); 9.5-15.3 ms with every tenth (scratch)."""

WHOLE_EVERY_S = 600.0
"""Seconds between whole collections (the longest a frozen cycle's memory waits)."""
MAX_WHOLE_EVERY_S = 86_400.0 * 365
"""The longest interval taken (a year; a longer wait overflows the timer's clock)."""


def whole_every_problem(seconds: float) -> str:
    """Why ``seconds`` cannot be ``--gc-whole-every`` / ``gc_whole_every_s`` (empty: it
    can; 0 leaves Python's collector as it is)."""
    if not 0 <= seconds <= MAX_WHOLE_EVERY_S:
        return f"must be >= 0 and at most {MAX_WHOLE_EVERY_S:g}, got {seconds!r}"
    return ""


class HeapPolicy:
    """Freeze the survivors of every full collection; a whole collection on a timer."""

    def __init__(self, whole_every_s: float = WHOLE_EVERY_S) -> None:
        problem = whole_every_problem(whole_every_s) or (
            "" if whole_every_s > 0 else "must be > 0 (0: no policy at all)"
        )
        if problem:
            raise ValueError(f"whole_every_s {problem}")
        self.whole_every_s = whole_every_s
        self.full_collections = 0
        """Full collections that froze their survivors."""
        self.whole_collections = 0
        """Whole collections (everything unfrozen, collected, frozen again)."""
        self.whole_collected = 0
        """Objects the whole collections found unreachable (frozen cycles among them)."""
        self.last_whole_ms = 0.0
        self._stop = threading.Event()
        self._whole = threading.Lock()
        """One whole collection at a time (the timer's, ``state``'s, a full arena's): a
        collection asked for while another runs would return at once, collecting
        nothing."""
        self._thread: threading.Thread | None = None
        self._thresholds = gc.get_threshold()

    def start(self) -> HeapPolicy:
        gc.collect()  # what the start left behind goes now, not frozen
        gc.freeze()
        self._thresholds = gc.get_threshold()
        young, middle, _ = self._thresholds
        gc.set_threshold(young, middle, FULL_EVERY)
        gc.callbacks.append(self._on_collection)
        self._thread = threading.Thread(target=self._whole_loop, name="kvlife-gc", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        gc.unfreeze()
        gc.set_threshold(*self._thresholds)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != _OLDEST:
            return
        # every object left in the oldest generation survived this collection: live
        gc.freeze()
        self.full_collections += 1

    def whole(self) -> int:
        """Collect everything, frozen or not, then freeze the survivors; the number of
        unreachable objects found."""
        with self._whole:
            t0 = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            gc.freeze()
            self.last_whole_ms = (time.perf_counter() - t0) * 1e3
            self.whole_collections += 1
            self.whole_collected += found
        return found

    def _whole_loop(self) -> None:
        while not self._stop.wait(self.whole_every_s):
            found = self.whole()
            log_event(
                log,
                "gc_whole",
                unreachable=found,
                ms=round(self.last_whole_ms, 1),
                frozen=gc.get_freeze_count(),
            )

    def figures(self) -> dict[str, float]:
        return {
            "gc_frozen_objects": gc.get_freeze_count(),
            "gc_full_collections": self.full_collections,
            "gc_whole_collections": self.whole_collections,
            "gc_whole_collected": self.whole_collected,
            "gc_last_whole_ms": round(self.last_whole_ms, 3),
        }
