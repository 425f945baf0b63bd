"""A power-cut file seam: what is not durable is held apart, and a cut throws it away.

A SIGKILL keeps the kernel's page cache, so a crash test that kills the writer process
never checks the order of writes and syncs. :class:`PowerCutIO` (a
:class:`~kvlife.tiers.disk.fileio.FileIO`, in the spirit of LazyFS) does: it keeps

- file data written (``pwritev``) or cut (``truncate``) since the last ``fdatasync`` of
  that file, in memory, apart from the real file;
- directory entries created (``open(create=True)``), removed (``unlink``) or moved
  (``rename``/``replace``) since the last ``fsync_dir`` of the directory, as a log that
  can be undone (removed files wait in a stash directory).

Reads (``preadv``, ``size``) are served from the real file with the pending writes laid
over it, so the store sees its own writes as it would through a page cache. The real
files hold exactly what is durable: ``fdatasync`` applies a file's pending data to it,
``fsync_dir`` makes the directory's pending entries permanent.

:meth:`PowerCutIO.cut` (called on demand, or armed with :meth:`PowerCutIO.arm` to fire
before or after the k-th call of an operation) cuts the power: pending data is dropped
(or, with ``persist > 0``, a random share of its 4 KiB pages reaches the disk anyway, as
a partial write-back would leave it; pages of files the store still holds open), pending
directory changes are undone (newly created files vanish, unlinked files come back,
renames go back), every file the seam opened is closed, and from then on the seam is
dead: calls that read or promise durability (``open``, ``preadv``, ``size``,
``fdatasync``, ``fsync_dir``, ``rename``) fail with ``EIO``; calls that would only have
reached a page cache that no longer matters (``pwritev``, ``truncate``, ``unlink``,
``close``) are accepted and do nothing. So no later action of the dead store instance
can change the disk, and closing it still releases its lock.

Files outside the seam. The disk tier's SQLite catalog does not write through
:class:`FileIO`. It runs in WAL mode with ``synchronous=FULL``, so every committed
transaction is on disk when the commit returns: the model keeps all of it. The catalog
files named in ``catalogs`` are copied byte for byte at the instant of the cut and put
back by :meth:`PowerCutIO.settle`, which a test calls after closing the dead store (whose
close may still write to SQLite, as no process could after a real power cut). What this
does not model: a lost SQLite commit (SQLite's own fsync ordering is trusted), damage to
directories the store created with ``mkdir``, and the loss of a file's data that was
fdatasync'ed while its directory entry was not (it vanishes with the entry, the strict
POSIX reading).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from kvlife.tiers.disk.fileio import FileIO

PAGE = 4096
"""Granularity of a partial write-back (``persist``)."""

CUT_OPS = ("open", "pwritev", "truncate", "fdatasync", "unlink", "fsync_dir", "rename")
"""Operations a cut can be armed on (and that :attr:`PowerCutIO.counted` counts): the
calls that change what is pending or durable."""

When = Literal["before", "after"]


class PowerCut(OSError):
    """What every failing call of a dead seam raises (an ``EIO``)."""

    def __init__(self, doing: str) -> None:
        super().__init__(errno.EIO, f"power cut: the device is gone ({doing})")


@dataclass(slots=True)
class _Write:
    offset: int
    data: bytes


@dataclass(slots=True)
class _Truncate:
    length: int


@dataclass(slots=True)
class _File:
    """One inode's pending (not yet durable) data operations, oldest first."""

    ops: list[_Write | _Truncate] = field(default_factory=list)


@dataclass(slots=True)
class _Entry:
    """A directory change not yet made durable by ``fsync_dir``."""

    kind: Literal["create", "unlink", "rename"]
    path: Path
    """The name created, removed, or renamed to."""
    src: Path | None = None
    """Renames: the old name."""
    stash: Path | None = None
    """Where the removed file (or the file a rename replaced) waits."""
    dirs: set[Path] = field(default_factory=set)
    """Directories still to be synced before the change is durable."""


@dataclass(frozen=True, slots=True)
class CutPoint:
    """Where an armed cut fires: before or after the ``nth`` call (1-based) of ``op``,
    or of any operation in :data:`CUT_OPS` when ``op`` is None."""

    nth: int
    op: str | None = None
    when: When = "after"

    def __post_init__(self) -> None:
        if self.nth < 1:
            raise ValueError(f"nth counts from 1, got {self.nth}")
        if self.op is not None and self.op not in CUT_OPS:
            raise ValueError(f"cannot cut at {self.op!r}: one of {', '.join(CUT_OPS)}")
        if self.when not in ("before", "after"):
            raise ValueError(f"when is 'before' or 'after', got {self.when!r}")


def _norm(path: Path) -> Path:
    return Path(os.path.abspath(path))


class PowerCutIO(FileIO):
    """A FileIO that holds what is not durable apart and can lose it in a power cut.

    ``catalogs``: SQLite databases beside the segment files (kept at the cut as
    committed; see the module docstring). ``stash``: a directory for unlinked files until
    their removal is durable (default: a new temporary directory). ``persist``: the
    chance that each pending 4 KiB page of data reaches the disk anyway at the cut
    (0, the default, drops all of it). ``seed`` seeds that choice.
    """

    def __init__(
        self,
        *,
        catalogs: Sequence[Path] = (),
        stash: Path | None = None,
        persist: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(direct=False)
        if not 0.0 <= persist <= 1.0:
            raise ValueError(f"persist is a probability, got {persist}")
        self._lock = threading.RLock()
        self._catalogs = [_norm(p) for p in catalogs]
        self._stash = Path(tempfile.mkdtemp(prefix="kvlife-powercut-")) if stash is None else stash
        self._stash.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        """Chance that a pending 4 KiB page reaches the disk at the cut (may be changed
        until then)."""
        self._rng = random.Random(seed)
        self._names = itertools.count()
        self._files: dict[tuple[int, int], _File] = {}
        self._fds: dict[int, _File] = {}
        self._entries: list[_Entry] = []
        self._armed: CutPoint | None = None
        self._snapshot: dict[Path, bytes | None] = {}
        self._cut_after = ""
        self.dead = False
        """True once the power is cut."""
        self.cut_at: str = ""
        """What the cut happened at, e.g. ``"after fdatasync #3 (call 17)"``; empty before."""
        self.counted: dict[str, int] = {}
        """Calls per operation of :data:`CUT_OPS` so far (before the cut)."""
        self.total = 0
        """Calls of all :data:`CUT_OPS` so far (the index a cut with ``op=None`` counts)."""

    # ------------------------------------------------------------------ control

    def arm(self, point: CutPoint) -> None:
        """Cut the power at ``point`` (counting from now: calls so far do not count)."""
        with self._lock:
            if self.dead:
                raise RuntimeError("the power is already cut")
            base = self.total if point.op is None else self.counted.get(point.op, 0)
            self._armed = CutPoint(base + point.nth, point.op, point.when)

    def cut(self, reason: str = "on demand") -> None:
        """Cut the power now: drop what is not durable, undo pending directory changes,
        close every file the seam opened, and fail calls from here on."""
        with self._lock:
            if self.dead:
                return
            self._snapshot_catalogs()
            if self.persist > 0.0:
                self._partial_write_back()
            for f in self._files.values():
                f.ops.clear()
            for entry in reversed(self._entries):
                self._undo(entry)
            self._entries.clear()
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
            self._files.clear()
            self.dead = True
            self.cut_at = reason

    def settle(self) -> None:
        """Put the catalog files back as they were at the cut. Call it after the dead
        store is closed; afterwards the directory holds what the power cut left."""
        with self._lock:
            if not self.dead:
                raise RuntimeError("settle() comes after a cut")
            for path, data in self._snapshot.items():
                if data is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(data)
            for db in self._catalogs:
                Path(f"{db}-shm").unlink(missing_ok=True)  # rebuilt from the WAL on open
            shutil.rmtree(self._stash, ignore_errors=True)

    @property
    def pending_bytes(self) -> int:
        """Bytes written and not yet durable."""
        with self._lock:
            return sum(
                len(op.data) for f in self._files.values() for op in f.ops if isinstance(op, _Write)
            )

    @property
    def pending_entries(self) -> int:
        """Directory changes not yet durable."""
        with self._lock:
            return len(self._entries)

    def _fires(self, op: str) -> CutPoint | None:
        """Count a call; the armed point if the cut fires at this call."""
        self.counted[op] = self.counted.get(op, 0) + 1
        self.total += 1
        a = self._armed
        if a is None:
            return None
        n = self.total if a.op is None else (self.counted[op] if a.op == op else 0)
        if n != a.nth:
            return None
        self._armed = None
        return a

    def _enter(self, op: str, *, fails_dead: bool = True) -> bool:
        """Start a call (lock held). True: the seam is dead and the call is accepted
        without effect. Raises: the seam is dead, or the cut fires before this call.
        False: the call goes on, and :meth:`_leave` cuts after it if so armed."""
        if self.dead:
            if fails_dead:
                raise PowerCut(op)
            return True
        self._cut_after = ""
        point = self._fires(op)
        if point is not None:
            where = f"{op} #{self.counted[op]} (call {self.total})"
            if point.when == "before":
                self.cut(f"before {where}")
                raise PowerCut(op)
            self._cut_after = where
        return False

    @contextlib.contextmanager
    def _call(self, op: str, *, fails_dead: bool = True) -> Iterator[bool]:
        """One seam call under the lock: yields True when the seam is dead and the call is
        to be accepted without effect; cuts after the call (even one that raised) when
        the cut is armed after it."""
        with self._lock:
            dead = self._enter(op, fails_dead=fails_dead)
            try:
                yield dead
            finally:
                if not dead:
                    self._leave(op)

    def _leave(self, op: str) -> None:
        where, self._cut_after = self._cut_after, ""
        if where:
            self.cut(f"after {where}")
            raise PowerCut(op)

    # ------------------------------------------------------------------ the seam

    def open(self, path: Path, create: bool) -> int:
        with self._call("open"):
            path = _norm(path)
            existed = path.exists()
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
            st = os.fstat(fd)
            self._fds[fd] = self._files.setdefault((st.st_dev, st.st_ino), _File())
            if create and not existed:
                self._entries.append(_Entry("create", path, dirs={path.parent}))
            return fd

    def pwritev(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        with self._call("pwritev", fails_dead=False) as dead:
            if dead:
                return sum(b.nbytes for b in buffers)
            data = b"".join(bytes(np.ascontiguousarray(b).data) for b in buffers)
            self._file(fd).ops.append(_Write(offset, data))
            return len(data)

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        with self._lock:
            if self.dead:
                raise PowerCut("preadv")
            want = sum(b.nbytes for b in buffers)
            data, size = self._view(fd, offset, want)
            got = max(0, min(want, size - offset))
            pos = 0
            for b in buffers:
                if pos >= got:
                    break
                flat = b.reshape(-1).view(np.uint8)
                k = min(flat.nbytes, got - pos)
                flat[:k] = np.frombuffer(data, dtype=np.uint8, count=k, offset=pos)
                pos += k
            return got

    def fdatasync(self, fd: int) -> None:
        with self._call("fdatasync"):
            f = self._file(fd)
            for op in f.ops:
                if isinstance(op, _Write):
                    os.pwrite(fd, op.data, op.offset)
                else:
                    os.ftruncate(fd, op.length)
            f.ops.clear()

    def truncate(self, fd: int, length: int) -> None:
        with self._call("truncate", fails_dead=False) as dead:
            if dead:
                return
            self._file(fd).ops.append(_Truncate(length))

    def close(self, fd: int) -> None:
        with self._lock:
            if self.dead:
                return  # the cut closed it already (and the number may be reused)
            if self._fds.pop(fd, None) is None:
                raise OSError(errno.EBADF, f"fd {fd} was not opened through the seam")
            os.close(fd)  # pending data stays with the inode, as in a page cache

    def unlink(self, path: Path) -> None:
        with self._call("unlink", fails_dead=False) as dead:
            if dead:
                return
            path = _norm(path)
            if path.exists():
                stash = self._stash_file(path)
                self._entries.append(_Entry("unlink", path, stash=stash, dirs={path.parent}))

    def fsync_dir(self, directory: Path) -> None:
        with self._call("fsync_dir"):
            d = _norm(directory)
            keep: list[_Entry] = []
            for entry in self._entries:
                entry.dirs.discard(d)
                if entry.dirs:
                    keep.append(entry)
                elif entry.stash is not None:
                    self._forget(entry.stash)  # the removal is durable now
            self._entries = keep

    def rename(self, src: Path, dst: Path) -> None:
        """Move ``src`` to ``dst``, replacing it (durable once both directories are synced)."""
        with self._call("rename"):
            src, dst = _norm(src), _norm(dst)
            if not src.exists():
                raise FileNotFoundError(errno.ENOENT, "no file to rename", str(src))
            stash = self._stash_file(dst) if dst.exists() else None
            os.rename(src, dst)
            self._entries.append(
                _Entry("rename", dst, src=src, stash=stash, dirs={src.parent, dst.parent})
            )

    def replace(self, src: Path, dst: Path) -> None:
        """Same as :meth:`rename` (``os.replace`` semantics)."""
        self.rename(src, dst)

    def size(self, fd: int) -> int:
        with self._lock:
            if self.dead:
                raise PowerCut("size")
            return self._view(fd, 0, 0)[1]

    # ------------------------------------------------------------------ internals

    def _file(self, fd: int) -> _File:
        f = self._fds.get(fd)
        if f is None:
            raise OSError(errno.EBADF, f"fd {fd} was not opened through the seam")
        return f

    def _view(self, fd: int, offset: int, n: int) -> tuple[bytes, int]:
        """Bytes ``[offset, offset+n)`` and the file size as the store sees them: the real
        (durable) file with the pending operations applied in order."""
        f = self._file(fd)
        size = os.fstat(fd).st_size
        buf = bytearray(os.pread(fd, n, offset) if n else b"")
        buf.extend(bytes(n - len(buf)))
        end = offset + n
        for op in f.ops:
            if isinstance(op, _Truncate):
                lo = max(op.length, offset)
                if lo < end:
                    buf[lo - offset :] = bytes(end - lo)  # cut away: reads zeros if extended
                size = op.length
            else:
                lo, hi = max(op.offset, offset), min(op.offset + len(op.data), end)
                if lo < hi:
                    buf[lo - offset : hi - offset] = op.data[lo - op.offset : hi - op.offset]
                size = max(size, op.offset + len(op.data))
        return bytes(buf), size

    def _stash_file(self, path: Path) -> Path:
        stash = self._stash / f"{next(self._names):08d}-{path.name}"
        shutil.move(path, stash)
        return stash

    def _forget(self, stash: Path) -> None:
        """Delete a stashed file for good (its inode number may then be reused)."""
        st = os.stat(stash)
        self._files.pop((st.st_dev, st.st_ino), None)
        stash.unlink()

    def _undo(self, entry: _Entry) -> None:
        if entry.kind == "create":
            entry.path.unlink(missing_ok=True)
        elif entry.kind == "unlink":
            assert entry.stash is not None
            shutil.move(entry.stash, entry.path)
        else:
            assert entry.src is not None
            if entry.path.exists():
                os.rename(entry.path, entry.src)
            if entry.stash is not None:
                shutil.move(entry.stash, entry.path)

    def _partial_write_back(self) -> None:
        for fd, f in self._fds.items():
            for op in f.ops:
                if not isinstance(op, _Write):
                    continue
                for lo in range(0, len(op.data), PAGE):
                    if self._rng.random() < self.persist:
                        os.pwrite(fd, op.data[lo : lo + PAGE], op.offset + lo)

    def _snapshot_catalogs(self) -> None:
        self._snapshot = {}
        for db in self._catalogs:
            for suffix in ("", "-wal", "-journal"):
                p = Path(f"{db}{suffix}")
                self._snapshot[p] = p.read_bytes() if p.exists() else None
