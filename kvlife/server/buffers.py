"""Shared output buffers: shared-memory files the server makes for one session, so that
a load lands straight in the client's memory (disk reads by O_DIRECT, no copy in the
client).

A buffer's pages are allocated when it is made (``posix_fallocate``; no room:
StorageFullError, no file left): the server is the first to write it (a load into it),
and a write to a page a full tmpfs cannot back would kill the server with SIGBUS."""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import numpy as np

from kvlife.core.errors import ProtocolError, StorageFullError
from kvlife.core.identity import KVLayout
from kvlife.core.payload import numpy_dtype
from kvlife.tiers.buffers import advise_huge, round_up
from kvlife.tiers.shm import Owner, allocate_pages

NAME_TRIES = 4
"""Random names tried before a buffer is refused (each is new with odds of 2**-64)."""


class SharedBuffer:
    """A shared-memory file the server made for one session's output buffers: loads
    into it land there directly (disk reads by O_DIRECT), with no copy by the client.
    The file goes with the session (and a dead server's with the next start).

    Its name is the arena's, ``-buf-`` and 16 random hex digits, created with
    ``O_EXCL | O_NOFOLLOW``: a name no one can predict, and a file no one made first (a
    same-user file at a predictable name once turned ``alloc_buffer`` into an internal
    error). The server's mapping keeps one descriptor open (Python's ``mmap`` holds a
    duplicate), which is why buffers count against the descriptor budget."""

    def __init__(self, path: Path, size: int, buf: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.mmap = buf

    @classmethod
    def create(cls, prefix: Path, nbytes: int, owner: Owner | None = None) -> SharedBuffer:
        """A new buffer of ``nbytes`` (whole pages) at ``<prefix>-<random>``, given to
        ``owner`` (the owner of the session's arena: a tenant's) before it is sized;
        StorageFullError naming why when it cannot be made (no memory, no descriptor,
        no free name)."""
        size = round_up(nbytes)
        for _ in range(NAME_TRIES):
            path = Path(f"{prefix}-{secrets.token_hex(8)}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue
            except OSError as exc:
                raise StorageFullError(f"cannot create a shared buffer at {path}: {exc}") from None
            try:
                if owner is not None:
                    os.fchown(fd, owner.uid, owner.gid)
                    os.fchmod(fd, owner.mode)
                os.ftruncate(fd, size)
                # the server writes a load into it first (a copy, or a disk read): a page
                # the filesystem cannot back would kill the server with SIGBUS there, so
                # every page is allocated now (ENOSPC: refused, nothing left)
                allocate_pages(fd, size)
                buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                advise_huge(buf)
            except OSError as exc:
                path.unlink(missing_ok=True)
                raise StorageFullError(
                    f"cannot make a shared buffer of {size} bytes: {exc}"
                ) from None
            finally:
                os.close(fd)
            return cls(path, size, buf)
        raise StorageFullError(f"no free name for a shared buffer after {NAME_TRIES} tries")

    def view(self, off: int, layout: KVLayout) -> np.ndarray:
        n = layout.chunk_nbytes
        if not 0 <= off <= self.size - n:
            raise ProtocolError(f"[{off}, +{n}) is outside the session's buffer of {self.size}")
        raw = np.frombuffer(self.mmap, np.uint8, count=n, offset=off)
        return raw.view(numpy_dtype(layout.dtype)).reshape(layout.chunk_shape)

    def drop(self) -> None:
        self.path.unlink(missing_ok=True)  # the mapping lives on while views are in use
