"""A fault-injecting file seam: fail chosen calls with a chosen errno, or stall them.

:class:`FaultyIO` is a :class:`~kvlife.tiers.disk.fileio.FileIO` (pass it to
``KVStore.open(..., fileio=...)``) that does the real I/O until a fault is armed:

- ``arm(op, err, after=n, once=False)`` lets ``n`` more calls of ``op`` succeed, then
  fails calls of it with ``OSError(err)``: every call until :meth:`FaultyIO.disarm`
  (sticky, the default: a full or dead device stays so), or only the one (``once``: a
  transient error);
- ``stall(op, after=n)`` blocks the ``n+1``-th next call of ``op`` on a
  :class:`threading.Event` until the test releases it, so a test can prove that other
  threads make progress while one is stuck inside a disk read or an fsync.

Both take ``path="glob"`` to hit only calls on files (or directories) whose name
matches, e.g. ``"seg-*.kvs"`` for segment files and not a superblock beside them.
Every call is counted per operation (``calls``) and every injected failure too
(``injected``), so a test can assert that its fault really fired.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np

from kvlife.tiers.disk.fileio import FileIO


class FileOp(StrEnum):
    """The calls of the file seam (equal to the :class:`FileIO` method names)."""

    OPEN = "open"
    PWRITEV = "pwritev"
    PREADV = "preadv"
    FDATASYNC = "fdatasync"
    TRUNCATE = "truncate"
    CLOSE = "close"
    UNLINK = "unlink"
    FSYNC_DIR = "fsync_dir"
    SIZE = "size"


def file_op(op: FileOp | str) -> FileOp:
    """``op`` as a :class:`FileOp`; a name that is no seam call raises ``ValueError``."""
    try:
        return FileOp(op)
    except ValueError:
        names = ", ".join(o.value for o in FileOp)
        raise ValueError(f"{op!r} is not a file seam call (one of {names})") from None


def _matches(pattern: str | None, path: Path | None) -> bool:
    return pattern is None or (path is not None and fnmatch.fnmatchcase(path.name, pattern))


@dataclass(slots=True)
class _Fault:
    err: int
    after: int
    """Calls still let through before the fault fires."""
    once: bool
    path: str | None
    """Glob on the file name the fault is limited to (None: every file)."""


@dataclass(slots=True)
class Stall:
    """One call held inside the seam until :meth:`release` (see :meth:`FaultyIO.stall`)."""

    op: FileOp
    after: int
    """Calls of ``op`` still let through before the one that stalls."""
    timeout_s: float
    """A stalled call waits at most this long, then fails with ``ETIMEDOUT`` (so a broken
    test cannot hang forever)."""
    entered: threading.Event = field(default_factory=threading.Event)
    """Set once a call is blocked in the seam."""
    released: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    path: str | None = None
    """Glob on the file name the stall is limited to (None: every file)."""

    def wait_entered(self, timeout_s: float = 10.0) -> bool:
        """Wait until a call is blocked in the stall; False if none came in time."""
        return self.entered.wait(timeout_s)

    def release(self) -> None:
        """Let the stalled call (or the one still to come) go through."""
        self.released.set()


class FaultyIO(FileIO):
    """A FileIO that fails or stalls chosen calls once armed (thread-safe)."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__(direct=direct)
        self._lock = threading.Lock()
        self._faults: dict[FileOp, _Fault] = {}
        self._stalls: list[Stall] = []
        self._paths: dict[int, Path] = {}
        self.calls: dict[str, int] = {}
        """Calls per operation name, failed and stalled ones included."""
        self.injected: dict[str, int] = {}
        """Injected failures per operation name."""

    def arm(
        self,
        op: FileOp | str,
        err: int,
        after: int = 0,
        *,
        once: bool = False,
        path: str | None = None,
    ) -> None:
        """Fail calls of ``op`` with ``OSError(err)`` after ``after`` more succeed.

        Sticky until :meth:`disarm` unless ``once``. ``path`` limits the fault (and the
        count of ``after``) to files whose name matches the glob. Re-arming an op
        replaces its fault.
        """
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        if err not in errno.errorcode:
            raise ValueError(f"{err} is not an errno")
        with self._lock:
            self._faults[file_op(op)] = _Fault(err, after, once, path)

    def stall(
        self,
        op: FileOp | str,
        after: int = 0,
        timeout_s: float = 30.0,
        *,
        path: str | None = None,
    ) -> Stall:
        """Block the call of ``op`` that comes after ``after`` more (on files matching
        ``path``, if given), until released."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        stall = Stall(file_op(op), after, timeout_s, path=path)
        with self._lock:
            self._stalls.append(stall)
        return stall

    def disarm(self, op: FileOp | str | None = None) -> None:
        """Remove the faults (of ``op``, or all) and release the stalls not yet hit."""
        with self._lock:
            if op is None:
                self._faults.clear()
                stalls, self._stalls = self._stalls, []
            else:
                name = file_op(op)
                self._faults.pop(name, None)
                stalls = [s for s in self._stalls if s.op is name]
                self._stalls = [s for s in self._stalls if s.op is not name]
        for s in stalls:
            s.release()

    def _enter(self, op: FileOp, path: Path | None) -> None:
        """Count the call, then stall or fail it as armed."""
        stall: Stall | None = None
        with self._lock:
            self.calls[op.value] = self.calls.get(op.value, 0) + 1
            for s in self._stalls:
                if s.op is op and _matches(s.path, path):
                    if s.after > 0:
                        s.after -= 1
                    else:
                        stall = s
                        self._stalls.remove(s)
                    break
        if stall is not None:
            stall.entered.set()
            if not stall.released.wait(stall.timeout_s):
                stall.timed_out = True
                raise OSError(errno.ETIMEDOUT, f"stalled {op.value} never released")
        with self._lock:
            fault = self._faults.get(op)
            if fault is None or not _matches(fault.path, path):
                return
            if fault.after > 0:
                fault.after -= 1
                return
            if fault.once:
                del self._faults[op]
            self.injected[op.value] = self.injected.get(op.value, 0) + 1
        err = fault.err
        raise OSError(err, f"injected {errno.errorcode[err]}: {os.strerror(err)}")

    def _path(self, fd: int) -> Path | None:
        with self._lock:
            return self._paths.get(fd)

    def open(self, path: Path, create: bool) -> int:
        self._enter(FileOp.OPEN, path)
        fd = super().open(path, create)
        with self._lock:
            self._paths[fd] = path
        return fd

    def pwritev(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        # One call per buffer, so that "after n calls" can fail mid-batch whether or not
        # the disk tier groups consecutive frames into one vectored write.
        path = self._path(fd)
        done = 0
        for buf in buffers:
            self._enter(FileOp.PWRITEV, path)
            done += super().pwritev(fd, [buf], offset + done)
        return done

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        self._enter(FileOp.PREADV, self._path(fd))
        return super().preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        self._enter(FileOp.FDATASYNC, self._path(fd))
        super().fdatasync(fd)

    def truncate(self, fd: int, length: int) -> None:
        self._enter(FileOp.TRUNCATE, self._path(fd))
        super().truncate(fd, length)

    def close(self, fd: int) -> None:
        self._enter(FileOp.CLOSE, self._path(fd))
        super().close(fd)
        with self._lock:
            self._paths.pop(fd, None)

    def unlink(self, path: Path) -> None:
        self._enter(FileOp.UNLINK, path)
        super().unlink(path)

    def fsync_dir(self, directory: Path) -> None:
        self._enter(FileOp.FSYNC_DIR, directory)
        super().fsync_dir(directory)

    def size(self, fd: int) -> int:
        self._enter(FileOp.SIZE, self._path(fd))
        return super().size(fd)
