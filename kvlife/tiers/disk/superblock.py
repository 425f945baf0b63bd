"""The superblock: the catalog generation the disk tier last acknowledged, kept outside SQLite.

SQLite stops reading its write-ahead log at the first frame whose checksum fails, so a
flipped, truncated or deleted ``catalog.sqlite-wal`` silently rolls the catalog back to
an older state, and an invalidated chunk would be served again. The catalog therefore
carries a *generation*, bumped by every transaction that deletes rows, and after each
such commit the tier records the new generation here, fsynced, before the delete is
acknowledged. An open that finds the catalog behind the superblock knows it lost
acknowledged deletions and refuses (:class:`CatalogRolledBack`) instead of serving.

Layout: two copies of one 4 KiB slot (file offsets 0 and 4096), each::

    magic 8s "KVLSUPER" | format version u16 | reserved u16 | reserved u32
    | generation u64 | checksum u64 (xxh3-64 of the bytes before it)

A write goes to the slot that does not hold the newest valid generation, then
``fdatasync``: a torn write can only damage the older copy, so the newest acknowledged
generation always survives in one of them. Every write goes through the
:class:`~kvlife.tiers.disk.fileio.FileIO` seam.
"""

from __future__ import annotations

import contextlib
import errno
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from kvlife.core.errors import KVLifeError, StorePathError
from kvlife.tiers.buffers import ALIGN, aligned_empty
from kvlife.tiers.disk.fileio import FileIO

MAGIC = b"KVLSUPER"
SUPERBLOCK_VERSION = 1
SLOT_BYTES = ALIGN
SLOTS = 2
FILE_NAME = "superblock"

_BODY = struct.Struct("<8sHHIQ")
_CHECK = struct.Struct("<Q")


class SuperblockError(KVLifeError):
    """The superblock is missing or both of its copies are damaged while a catalog exists,
    so nothing proves that the catalog holds every acknowledged deletion."""

    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        super().__init__(
            f"superblock {path} {detail}: nothing proves that the catalog beside it holds "
            "every acknowledged invalidation, so the store is not served. Restore the "
            f"superblock, or run `kvlife check --fix {path.parent.parent}` (it rewrites the "
            "superblock; a catalog that ever deleted rows is emptied, since it cannot be "
            "proven current)."
        )


class CatalogRolledBack(KVLifeError):
    """The catalog is older than the generation the superblock acknowledged: the tail of
    its write-ahead log (deletions, invalidations) was lost."""

    def __init__(self, catalog: Path, have: int, acknowledged: int) -> None:
        self.path = catalog
        self.have = have
        self.acknowledged = acknowledged
        super().__init__(
            f"catalog {catalog} is at generation {have} but generation {acknowledged} was "
            "acknowledged (superblock): its write-ahead log lost committed deletions, so "
            "invalidated KV could come back. Nothing was served or changed. Restore "
            f"{catalog.name}-wal, or run `kvlife check --fix {catalog.parent.parent}` "
            "(it drops every replica of this store; segments are deleted)."
        )


@dataclass(frozen=True, slots=True)
class SuperblockState:
    """What reading the superblock found."""

    exists: bool
    """The file is there."""
    generations: tuple[int | None, ...]
    """Per slot: the generation its copy holds, None when that copy does not verify."""
    problems: tuple[str, ...] = field(default=())
    """Per damaged copy, why."""

    @property
    def generation(self) -> int | None:
        """The newest generation a valid copy holds (None: no copy verifies)."""
        valid = [g for g in self.generations if g is not None]
        return max(valid) if valid else None


def pack_slot(generation: int) -> bytes:
    body = _BODY.pack(MAGIC, SUPERBLOCK_VERSION, 0, 0, generation)
    slot = body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    return slot + bytes(SLOT_BYTES - len(slot))


def unpack_slot(data: bytes) -> int:
    """The generation a slot holds; raises ValueError naming the failed check."""
    used = _BODY.size + _CHECK.size
    if len(data) < used:
        raise ValueError(f"copy truncated to {len(data)} bytes")
    body = data[: _BODY.size]
    (check,) = _CHECK.unpack(data[_BODY.size : used])
    if check != xxhash.xxh3_64_intdigest(body):
        raise ValueError("copy checksum mismatch")
    magic, version, _, _, generation = _BODY.unpack(body)
    if magic != MAGIC:
        raise ValueError("bad magic")
    if version != SUPERBLOCK_VERSION:
        raise ValueError(f"format version {version}, this kvlife reads {SUPERBLOCK_VERSION}")
    return int(generation)


def read_superblock(path: Path) -> SuperblockState:
    """Read both copies with plain reads (no file is created or changed)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return SuperblockState(False, (None,) * SLOTS, ("is missing",))
    except OSError as exc:
        raise StorePathError(f"cannot read superblock {path}: {exc}") from exc
    gens: list[int | None] = []
    problems: list[str] = []
    for i in range(SLOTS):
        try:
            gens.append(unpack_slot(data[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]))
        except ValueError as exc:
            gens.append(None)
            problems.append(f"copy {i}: {exc}")
    return SuperblockState(True, tuple(gens), tuple(problems))


class Superblock:
    """The writable superblock of one disk tier directory."""

    def __init__(self, path: Path, io: FileIO) -> None:
        self.path = path
        self._io = io
        self._fd: int | None = None
        self._buf = aligned_empty(SLOT_BYTES)
        self._lock = threading.Lock()
        """Writers come from the catalog (under its lock) and from check --fix."""
        self._state = read_superblock(path)

    def read(self) -> SuperblockState:
        """What the file held when this object was made, updated by every write since."""
        return self._state

    def reread(self) -> SuperblockState:
        """Read the file again (an audit must see damage done since the open)."""
        with self._lock:
            self._state = read_superblock(self.path)
            return self._state

    def write(self, generation: int) -> None:
        """Record ``generation`` durably in the copy that does not hold the newest one."""
        with self._lock:
            gens = list(self._state.generations)
            newest = self._state.generation
            slot = 0 if newest is None else 1 - gens.index(newest)
            self._write_slot(slot, generation)
            gens[slot] = generation
            self._state = SuperblockState(True, tuple(gens))

    def write_both(self, generation: int) -> None:
        """Write ``generation`` into both copies, one after the other (repairs a damaged
        copy; the first write lands where the newest valid copy is not)."""
        self.write(generation)
        self.write(generation)

    def _write_slot(self, slot: int, generation: int) -> None:
        try:
            if self._fd is None:
                created = not self.path.exists()
                self._fd = self._io.open(self.path, create=True)
                if self._io.size(self._fd) < SLOTS * SLOT_BYTES:
                    self._io.truncate(self._fd, SLOTS * SLOT_BYTES)
                    self._io.fdatasync(self._fd)
                if created:
                    self._io.fsync_dir(self.path.parent)
            self._buf[:] = np.frombuffer(pack_slot(generation), dtype=np.uint8)
            written = self._io.pwritev(self._fd, [self._buf], slot * SLOT_BYTES)
            if written != SLOT_BYTES:
                raise OSError(errno.EIO, f"short write: {written} of {SLOT_BYTES} bytes")
            self._io.fdatasync(self._fd)
        except OSError as exc:
            raise StorePathError(f"cannot write superblock {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                with contextlib.suppress(OSError):
                    self._io.close(fd)
