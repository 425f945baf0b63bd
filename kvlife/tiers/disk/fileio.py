"""File I/O seam of the disk tier: direct I/O detection, aligned buffers, fault injection.

Every byte the disk tier moves goes through a :class:`FileIO`. Tests substitute a
subclass that fails chosen calls (ENOSPC, EIO) to prove that a failure leaves nothing
half-visible. O_DIRECT is used where the filesystem accepts it; where it does not
(tmpfs answers EINVAL) the tier falls back to buffered I/O plus fdatasync.
:func:`os_error` turns an ``OSError`` of the seam into the typed error a caller sees.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvlife.core.errors import StorageFullError, StorePathError
from kvlife.tiers.buffers import ALIGN, aligned_empty


def probe_direct_io(directory: Path) -> bool:
    """True if files in ``directory`` accept aligned O_DIRECT writes and reads."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return False
    try:
        buf = aligned_empty(ALIGN)
        os.pwrite(fd, buf.data, 0)
        os.preadv(fd, [buf.data], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


class FileIO:
    """Thin wrapper over the os calls the disk tier needs (the fault-injection seam)."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct

    def open(self, path: Path, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o644)

    def pwritev(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        return os.pwritev(fd, [b.data for b in buffers], offset)

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        return os.preadv(fd, [b.data for b in buffers], offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        os.close(fd)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def rename(self, src: Path, dst: Path) -> None:
        """Move a file (recovery sets segments aside in ``quarantine/`` this way)."""
        os.rename(src, dst)

    def fsync_dir(self, directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size


def os_error(exc: OSError, doing: str) -> Exception:
    """The typed error for ``exc`` raised while ``doing``: a full device is
    StorageFullError (nothing of what was being done was stored), anything else
    StorePathError."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"device full (ENOSPC) while {doing}; nothing of it was stored")
    return StorePathError(f"I/O error while {doing}: {exc}")
