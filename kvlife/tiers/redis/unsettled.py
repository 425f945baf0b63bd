"""Publishes whose outcome is unknown, kept until they are settled.

A publish script's connection can fail after the script was sent: it may have run (its
records visible) or not, and the writer cannot tell. Such a write raises, and its
records, with the names of the payloads they would name, wait here until the tier can
read the index again (:meth:`UnknownOutcomes.settle`, at the tier's next write, its
``settle_removals`` or its ``close``): the tier takes back, with a fenced delete, the
records that are still the write's, and removes the payloads no record names. The
same holds for the take-back of a batch part of which published, when the take-back's
own replies are lost. Thread-safe.

A settlement never runs beside a write of the same tier (:class:`SettleGate`): on the
Redis tier two writes of the same bytes under the same lease publish records equal byte
for byte, and the fenced delete of one would take the other; so a settlement spares
the records its host holds, and a write waits for a settlement under way, which runs
only while no write is between its publish and its host holding the records (found by a
red team, 2026-12-06: a settlement in one thread took a replica another thread had
just published).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from kvlife.core.errors import RemoteTierError
from kvlife.globalindex import RemoteRecord

Settle = Callable[[list[RemoteRecord], list[str]], int]
"""A tier's settlement of one write (its records, its payloads' names): how many of the
records it took back. RemoteTierError: the index cannot be read yet (tried again)."""


class UnknownOutcomes:
    """The writes of unknown outcome of one tier, and their counts."""

    def __init__(self) -> None:
        self._entries: list[tuple[list[RemoteRecord], list[str]]] = []
        self._lock = threading.Lock()
        self._settling = 0
        """Entries a :meth:`settle` took and is settling."""
        self.publishes_unknown = 0
        """Records whose publish had an unknown outcome."""
        self.taken_back = 0
        """Of them, records found published and taken back."""

    def __bool__(self) -> bool:
        """Whether an entry waits (without the lock: a hint for the hot path)."""
        return bool(self._entries)

    def add(self, records: list[RemoteRecord], payloads: list[str]) -> None:
        with self._lock:
            self._entries.append((list(records), list(payloads)))
            self.publishes_unknown += len(records)

    def pending(self) -> int:
        """Entries not settled yet, those being settled included."""
        with self._lock:
            return len(self._entries) + self._settling

    def settle(self, settle_one: Settle) -> None:
        """Settle the waiting entries in order with ``settle_one``; one whose index
        cannot be read yet (RemoteTierError) waits for the next call, as does every
        entry after one that raised anything else (raised)."""
        with self._lock:
            todo, self._entries = self._entries, []
            took = len(todo)
            self._settling += took
        left: list[tuple[list[RemoteRecord], list[str]]] = []
        try:
            while todo:
                records, payloads = todo[0]
                try:
                    taken = settle_one(records, payloads)
                except RemoteTierError:
                    left.append(todo.pop(0))
                    continue
                todo.pop(0)
                with self._lock:
                    self.taken_back += taken
        finally:  # what was not settled (an index still unreachable, an error) stays
            with self._lock:
                self._entries[:0] = left + todo
                self._settling -= took

    def counts(self) -> dict[str, int]:
        with self._lock:
            pending = len(self._entries) + self._settling
            return {
                "publishes_unknown": self.publishes_unknown,
                "unknown_taken_back": self.taken_back,
                "unknown_pending": pending,
            }


class SettleGate:
    """Keeps one tier's writes (from before their publish until their host holds the
    records) and its settlements apart. Writes run beside each other; a write waits
    for a settlement under way; a settlement runs only when no write is in flight,
    else it is skipped (tried again at the next write or ``settle_removals``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writes = 0
        self._settling = False

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            while self._settling:
                self._cond.wait()
            self._writes += 1
        try:
            yield
        finally:
            with self._cond:
                self._writes -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def settling(self) -> Iterator[bool]:
        """Yields whether the settlement may run now (no write in flight, no other
        settlement); writes wait until it is done."""
        with self._cond:
            now = not self._writes and not self._settling
            if now:
                self._settling = True
        try:
            yield now
        finally:
            if now:
                with self._cond:
                    self._settling = False
                    self._cond.notify_all()
