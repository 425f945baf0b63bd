"""The ledger: every lifecycle move of the store goes through :meth:`Ledger.move`, which
checks it against the transition table, counts TENTATIVE objects and emits the event.

A sink whose ``emit`` raises (an event file on a full disk, a subscriber's bug) never
stops a move: the move is the store's state, applied before the event is built, and a
move left half-done under the index lock (an object written but never indexed, its put
never finished) would wedge the store. The event is dropped instead, counted in
``events_dropped``, and the first failure logged."""

from __future__ import annotations

import logging
import threading
import time

from kvlife.core.events import ChunkFacts, DetailedSink, EventSink, LifecycleEvent, NullSink
from kvlife.core.lifecycle import Move, ObjectState, check_move
from kvlife.core.objects import ObjectRecord
from kvlife.results import StoreCounters
from kvlife.store.callbacks import Callbacks

log = logging.getLogger(__name__)


class Ledger:
    """Moves, events and counters of one store (callers hold the store's index lock)."""

    def __init__(self, sink: EventSink | None, callbacks: Callbacks | None = None) -> None:
        self.sink: EventSink = sink if sink is not None else NullSink()
        self.callbacks = callbacks if callbacks is not None else Callbacks()
        """Marks this thread inside the sink's ``emit`` (a ``close()`` from there closes on
        a thread of its own: :mod:`kvlife.store.callbacks`)."""
        self._emitting = not isinstance(self.sink, NullSink)
        kinds = self.sink.kinds()
        self._wanted = None if kinds is None else frozenset(m for m in Move if m.value in kinds)
        """The moves the sink wants (None: all): no event is built for another."""
        # a sink that also wants each chunk's parent and size (the KV-events publisher)
        self._detailed = self.sink if isinstance(self.sink, DetailedSink) else None
        self._seq = 0
        self.tentative = 0
        self.counters = StoreCounters()
        self._emit_lock = threading.Lock()

    def move(
        self,
        rec: ObjectRecord,
        move: Move,
        *,
        tier: str = "",
        dst: str = "",
        nbytes: int = 0,
        reason: str = "",
        request_id: str = "",
        transform: str = "exact",
    ) -> None:
        old_state = rec.state
        new_state = check_move(rec.key, old_state, move)
        if new_state is not old_state:
            if new_state is ObjectState.TENTATIVE:
                self.tentative += 1
            elif old_state is ObjectState.TENTATIVE:
                self.tentative -= 1
        rec.state = new_state
        if not self._emitting or (self._wanted is not None and move not in self._wanted):
            return
        with self._emit_lock:
            self._seq += 1
            event = LifecycleEvent(
                time=time.time(),
                seq=self._seq,
                kind=move.value,
                key=rec.key.hex(),
                state=new_state.value if new_state else "",
                tier=tier,
                dst_tier=dst,
                nbytes=nbytes,
                transform=transform,
                namespace=rec.info.namespace,
                model=rec.info.weights_digest,
                reason=reason,
                request_id=request_id,
            )
            self.callbacks.enter()
            try:
                if self._detailed is not None:
                    info = rec.info
                    facts = ChunkFacts(bytes(info.parent), info.ntokens, info.adapter_id)
                    self._detailed.emit_detailed(event, facts)
                else:
                    self.sink.emit(event)
            except Exception as exc:  # the move stands; the log misses it (counted)
                self.counters.events_dropped += 1
                if self.counters.events_dropped == 1:
                    log.warning(
                        "kvlife: the event sink failed (%s: %s); events are dropped and "
                        "counted in events_dropped, the store goes on",
                        type(exc).__name__,
                        exc,
                    )
            finally:
                self.callbacks.leave()

    def flush(self) -> None:
        """Flush the sink. A sink whose flush fails (an event file on a full disk) lost
        the events it held: counted as one more in ``events_dropped`` (how many it held is
        the sink's to know) and logged; the store's own state is unaffected, so a close
        goes on and raises nothing for it."""
        self.callbacks.enter()  # the sink's code: a close() from it closes on another thread
        try:
            self.sink.flush()
        except Exception as exc:
            self.counters.events_dropped += 1
            log.warning(
                "kvlife: the event sink failed to flush (%s: %s); the events it held are "
                "lost (counted in events_dropped)",
                type(exc).__name__,
                exc,
            )
        finally:
            self.callbacks.leave()
