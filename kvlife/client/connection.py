"""One connection of a RemoteStore to ``kvlife serve``, its mapping of the server's
arena, and how replies become typed errors."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
import time
from typing import Any

import msgpack

from kvlife.core import errors
from kvlife.core.errors import KVLifeError, RemoteError
from kvlife.server import protocol

FOREVER_S = 7 * 86400.0
"""The socket timeout of a client that asked for none."""
StagedShape = tuple[object, ...]
"""A chunk's dtype name and shape: the staged extents of one kind."""


def _epochs() -> itertools.count[int]:
    """Connection numbers from a random start (a lookup carried to another process
    meets numbers of its own there), counted up in this process."""
    return itertools.count(int.from_bytes(os.urandom(6), "little") << 16)


_EPOCHS = _epochs()


def _reseed() -> None:
    global _EPOCHS
    _EPOCHS = _epochs()  # a forked child does not count on from its parent's numbers


os.register_at_fork(after_in_child=_reseed)


def next_epoch() -> int:
    """A number no other connection of this process had: every client's connections
    share one count (two clients each on their first connection, to two servers that
    took the same socket in turn, must not take each other's lookups for their own:
    issue 28's red team)."""
    return next(_EPOCHS)


def error_from_reply(kind: object, message: object) -> KVLifeError:
    """The typed error the server named (RemoteError for a name this client lacks)."""
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, KVLifeError)):
        return RemoteError(f"{kind}: {message}")
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(message))
    return exc


def connect(path: str, timeout: float) -> socket.socket:
    """A connected socket with ``timeout`` set. The connect itself waits for the
    server's backlog: a socket with a timeout connects without blocking, and a Unix
    socket whose listen queue is full then fails at once with EAGAIN (a burst of clients
    got spurious failures from a healthy server), so that is retried, backing off, until
    ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # a timeout makes every wait a poll for input (protocol.POLL_WAIT_S says why)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:  # the listen queue is full: the server is accepting
            sock.close()
            if time.monotonic() + delay > deadline:
                raise
        except OSError:
            sock.close()
            raise
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


class Connection:
    """One connection and its mapping of the server's arena."""

    def __init__(self, path: str, timeout: float | None) -> None:
        # no timeout asked: a week
        self.sock = connect(path, timeout if timeout is not None else FOREVER_S)
        self.pending = False
        """A request is out whose final reply was not read: an error now leaves the
        stream out of step, and the connection is dropped (the server then releases
        whatever the exchange granted)."""
        self.rid = itertools.count(1)
        self.arena: mmap.mmap | None = None
        self.arena_bytes = 0
        self.hello: dict[str, Any] = {}
        self.releases: list[int] = []
        """Load grants to give back with the next request."""
        self.epoch = 0
        """Which connection this is, unique in the process (:func:`next_epoch`; pending
        puts and lookups remember it)."""
        self.buffers: list[tuple[int, int, int, mmap.mmap]] = []
        """Shared output buffers of this connection: (address, size, id, mapping)."""
        self.staged: dict[StagedShape, list[Any]] = {}
        """Arena extents the server staged for this connection's next puts, by chunk
        dtype and shape: [id, offset] each."""

    def refusal(self) -> KVLifeError | None:
        """Why the server closed this connection, when it said so before closing (a
        connection shed for a budget: ``[0, False, [class, message]]``); None if not."""
        try:
            self.sock.settimeout(0.5)
            body = protocol.recv_frame(self.sock)
            reply = msgpack.unpackb(body, raw=False) if body is not None else None
        except (OSError, ValueError, KVLifeError, msgpack.UnpackException):
            return None
        if type(reply) is list and len(reply) == 3 and reply[0] == 0 and reply[1] is False:
            with contextlib.suppress(TypeError, ValueError):
                kind, message = reply[2]
                return error_from_reply(kind, message)
        return None

    def map_arena(self, path: str, size: int, populate: bool = True) -> None:
        """Map the session's arena. ``populate``: every page mapped now (the server's own
        arena, whose pages all exist). A principal's arena is mapped without: it is
        sparse, and populating a shared mapping allocates every page of the file (each
        principal's arena as large as the whole arena, made whole by its first client);
        the server allocates each extent's pages as it hands it out, and this side
        faults in those it touches."""
        fd = os.open(path, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.arena = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self.arena_bytes = size

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.arena is not None:
            with contextlib.suppress(BufferError):
                self.arena.close()  # views still alive keep it mapped until they die
