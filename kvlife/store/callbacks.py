"""Code of the caller's that the store runs inside its own work: an event sink's
``emit`` (inside a put's or a load's plan, often under the store's lock or a sequencer
turn) and ``check()``'s ``progress`` (inside the audit, which ``close`` waits for).

``close()`` waits for the work under way; called from inside such a callback it would
wait for the very call that runs it (a self-deadlock inside a put's turn; inside the
audit it stopped waiting and closed the tiers under it, and the audit reported healthy
replicas as problems). :class:`Callbacks` tells, per thread, whether the store is
running one, and ``close`` then closes on a thread of its own (:mod:`kvlife.store.lifecycle`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Callbacks:
    """Whether this thread is inside a callback of one store (a depth: a callback may
    call the store, which runs another)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def enter(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def leave(self) -> None:
        self._local.depth -= 1

    def inside(self) -> bool:
        return bool(getattr(self._local, "depth", 0))

    def wrap(self, fn: Callable[[int], object] | None) -> Callable[[int], object] | None:
        """``fn`` (an audit's ``progress``) run as a callback of this store."""
        if fn is None:
            return None
        call = fn

        def called(n: int) -> object:
            self.enter()
            try:
                return call(n)
            finally:
                self.leave()

        return called
