"""Locks of a store: the directory lock (one process per store directory) and the
sequencer that executes plans in the order they were made.

Plans are made under the store's index lock, which is never held across I/O; each plan
takes a ticket there, and its I/O runs when the sequencer reaches that ticket. So plans
execute in the order their decisions assumed (an eviction's room is free before the put
that counted on it), while lookups and loads never wait for them.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvlife.core.errors import StoreClosedError, StoreLockedError, StorePathError

_HELD_HERE: dict[str, int] = {}
"""Store directories this process holds open (resolved path -> holder pid)."""
_HELD_LOCK = threading.Lock()


def take_dir_lock(path: Path) -> IO[str]:
    """Lock ``path`` for this process (StoreLockedError names the holder)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        real = str(path.resolve())
        fh = (path / "LOCK").open("a+", encoding="utf-8")
    except OSError as exc:
        raise StorePathError(f"cannot create or open the store at {path}: {exc}") from exc
    with _HELD_LOCK:
        if real in _HELD_HERE:
            fh.close()
            raise StoreLockedError(
                f"store {path} is already open in this process; close it first or share "
                "the open KVStore between threads"
            )
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise StoreLockedError(
                f"store {path} is open in another process (pid {holder}); a kvlife store "
                "directory is used by one process at a time"
            ) from None
        _HELD_HERE[real] = os.getpid()
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def drop_dir_lock(path: Path, fh: IO[str]) -> None:
    with _HELD_LOCK:
        _HELD_HERE.pop(str(path.resolve()), None)
        if not fh.closed:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()


class Sequencer:
    """Tickets taken in plan order; :meth:`turn` waits for a ticket's turn."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0
        self._closed = ""
        """Why no ticket is given any more (empty: open)."""

    def take(self) -> int:
        """The next ticket; StoreClosedError once :meth:`close` was called (a plan made
        after its store began to close never runs on tiers that are closing)."""
        with self._cond:
            if self._closed:
                raise StoreClosedError(self._closed)
            ticket = self._next
            self._next += 1
            return ticket

    @contextmanager
    def turn(self, ticket: int) -> Iterator[None]:
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()

    def close(self, reason: str) -> None:
        """Give no ticket any more (``reason``: the error's text); those given still run."""
        with self._cond:
            self._closed = reason

    def idle(self) -> bool:
        with self._cond:
            return self._serving == self._next

    def wait_idle(self) -> None:
        """Wait until every ticket taken so far has run."""
        with self._cond:
            target = self._next
            while self._serving < target:
                self._cond.wait()
