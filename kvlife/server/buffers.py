"""Shared output buffers: shared-memory files the server makes for one session, so that
a load lands straight in the client's memory (disk reads by O_DIRECT, no copy in the
client)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from kvlife.core.errors import ProtocolError, StorageFullError
from kvlife.core.identity import KVLayout
from kvlife.core.payload import numpy_dtype
from kvlife.tiers.buffers import advise_huge, round_up


class SharedBuffer:
    """A shared-memory file the server made for one session's output buffers: loads
    into it land there directly (disk reads by O_DIRECT), with no copy by the client.
    The file goes with the session (and a dead server's with the next start)."""

    def __init__(self, path: Path, nbytes: int) -> None:
        size = round_up(nbytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            advise_huge(self.mmap)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise StorageFullError(f"cannot make a shared buffer of {size} bytes: {exc}") from exc
        finally:
            os.close(fd)
        self.path = path
        self.size = size

    def view(self, off: int, layout: KVLayout) -> np.ndarray:
        n = layout.chunk_nbytes
        if not 0 <= off <= self.size - n:
            raise ProtocolError(f"[{off}, +{n}) is outside the session's buffer of {self.size}")
        raw = np.frombuffer(self.mmap, np.uint8, count=n, offset=off)
        return raw.view(numpy_dtype(layout.dtype)).reshape(layout.chunk_shape)

    def drop(self) -> None:
        self.path.unlink(missing_ok=True)  # the mapping lives on while views are in use
