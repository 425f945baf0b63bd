"""One connection of a RemoteStore to ``kvlife serve``, its mapping of the server's
arena, and how replies become typed errors."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
from typing import Any

from kvlife.core import errors
from kvlife.core.errors import KVLifeError, RemoteError
from kvlife.core.identity import KEY_BYTES, ChunkKey

FOREVER_S = 7 * 86400.0
"""The socket timeout of a client that asked for none."""
StagedShape = tuple[object, ...]
"""A chunk's dtype name and shape: the staged extents of one kind."""


def split_keys(blob: bytes) -> list[ChunkKey]:
    return [ChunkKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES)]


def error_from_reply(kind: object, message: object) -> KVLifeError:
    """The typed error the server named (RemoteError for a name this client lacks)."""
    cls = getattr(errors, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, KVLifeError)):
        return RemoteError(f"{kind}: {message}")
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(message))
    return exc


class Connection:
    """One connection and its mapping of the server's arena."""

    def __init__(self, path: str, timeout: float | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # a timeout makes every wait a poll for input (protocol.POLL_WAIT_S says why);
        # no timeout asked: a week
        self.sock.settimeout(timeout if timeout is not None else FOREVER_S)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.rid = itertools.count(1)
        self.arena: mmap.mmap | None = None
        self.arena_bytes = 0
        self.hello: dict[str, Any] = {}
        self.releases: list[int] = []
        """Load grants to give back with the next request."""
        self.epoch = 0
        """Which connection of its RemoteStore this is (pending puts remember it)."""
        self.buffers: list[tuple[int, int, int, mmap.mmap]] = []
        """Shared output buffers of this connection: (address, size, id, mapping)."""
        self.staged: dict[StagedShape, list[Any]] = {}
        """Arena extents the server staged for this connection's next puts, by chunk
        dtype and shape: [id, offset] each."""

    def map_arena(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
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
