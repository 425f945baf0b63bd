"""Shared-memory DRAM tier: replicas in arena files under ``/dev/shm`` that other
processes map (the data plane of ``kvlife serve``).

The tier has its own arena and may keep more (:meth:`ShmTier.add_arena`: a tenant's,
given to its Unix user, :mod:`kvlife.server.shm_arenas`); :attr:`ShmTier.home` picks each
new replica's arena from its metadata, and a payload that is not a sealed extent of that
arena is copied there, so a replica never lies in an arena its readers may not map.

The arena is a file in shared memory (mode 0600) mapped ``MAP_SHARED``; a first-fit
allocator with coalescing hands out page-aligned extents (:class:`Slot`). Extents are
freed when the last numpy view of them dies (a weak finalizer on the view's base, as in
:class:`~kvlife.tiers.buffers.RecyclingPool`), so an extent that a reader (a server
session copying it to a client) still holds is never reused under it, even after its
replica was deleted. Freed extents are merged with their neighbours and reused.

The finalizer takes no lock: the cyclic garbage collector runs it on whatever thread
allocated when a collection fell due, and that thread may be inside :meth:`Arena.alloc`
holding the arena's lock (a non-reentrant lock taken there deadlocked the server for
good). It only appends the extent to a queue; every allocation and every figure drains
the queue under the lock first (docs/server.md, "Finalizers").

Two budgets: the tier's ``capacity_bytes`` bounds the extents of its replicas (whole
pages, :meth:`ShmTier.footprint`; placement evicts against it, as for
:class:`~kvlife.tiers.memory.MemoryTier`); the arena is larger by ``staging_bytes``,
the room for extents that are not replicas yet or any more (puts being written by
clients, disk reads handed to clients, deleted replicas a reader still holds). A put
whose payload already is a sealed arena extent (a client wrote it there) is adopted
without a copy; any other payload is copied into a new extent.
Every replica is sealed with the xxh3-128 of its bytes when published
(:class:`~kvlife.tiers.held.HeldTier`): a client that writes an extent after its put
committed is caught where the seal is verified (demotion, flush, check, and every load
with ``verify_dram_on_load``), never persisted or served as the bytes it committed.
"""

from __future__ import annotations

import bisect
import collections
import errno
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvlife.core.errors import InvalidArgument, NotPermitted, StorageFullError
from kvlife.core.identity import ChunkKey
from kvlife.native.copies import copy_sealed, stream_copy
from kvlife.native.spans import c_address
from kvlife.tiers.base import ReplicaMeta, Reservation, check_payloads, read_only, sealed_meta
from kvlife.tiers.buffers import ALIGN, advise_huge, round_up
from kvlife.tiers.held import HeldTier

SHM_DIR = Path("/dev/shm")
HUGE_OPTIONS = ("huge=always", "huge=within_size", "huge=advise")
"""tmpfs mount options under which the arena gets transparent huge pages."""


def huge_pages(directory: Path) -> bool:
    """Whether files in ``directory`` live on a tmpfs mounted with huge pages.

    Direct I/O into (and out of) 4 KiB shared-memory pages was measured at 0.5-0.7x the
    rate into private huge-page memory here; a tmpfs mounted ``huge=always`` (or
    ``within_size``) gives the arena 2 MiB pages, and disk reads land at full speed.
    """
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    target = str(directory.resolve())
    best, huge = "", False
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best = point
            huge = tail[0] == "tmpfs" and any(o in tail[2].split(",") for o in HUGE_OPTIONS)
    return huge


class Allocator:
    """First-fit extents of an address range, ``ALIGN``-aligned, neighbours coalesced.

    ``alloc`` returns an offset or None (no free extent is large enough); ``free`` gives
    an extent back. Not thread-safe on its own (:class:`Arena` locks it).
    """

    def __init__(self, size: int) -> None:
        self.size = size // ALIGN * ALIGN
        self._starts: list[int] = [0] if self.size else []
        self._lens: dict[int, int] = {0: self.size} if self.size else {}
        self.used = 0
        self.extents = 0
        """Extents handed out and not yet freed."""

    def alloc(self, nbytes: int) -> int | None:
        need = round_up(max(nbytes, 1))
        for i, start in enumerate(self._starts):
            length = self._lens[start]
            if length >= need:
                del self._lens[start]
                if length == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._lens[start + need] = length - need
                self.used += need
                self.extents += 1
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        need = round_up(max(nbytes, 1))
        if offset % ALIGN or offset < 0 or offset + need > self.size:
            raise InvalidArgument(f"extent [{offset}, +{need}) is not in this arena")
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + need:
            raise InvalidArgument(f"extent at {offset} freed twice (overlaps a free extent)")
        if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] > offset:
            raise InvalidArgument(f"extent at {offset} freed twice (overlaps a free extent)")
        self.used -= need
        self.extents -= 1
        start, length = offset, need
        if i < len(self._starts) and self._starts[i] == offset + need:  # merge right
            length += self._lens.pop(self._starts[i])
            del self._starts[i]
        if i > 0:  # merge left
            left = self._starts[i - 1]
            if left + self._lens[left] == start:
                self._lens[left] += length
                return
        self._starts.insert(i, start)
        self._lens[start] = length

    @property
    def largest_free(self) -> int:
        return max(self._lens.values(), default=0)


class Backed:
    """The ranges of a sparse arena whose pages are allocated: sorted, disjoint, merged
    where they touch. Pages once allocated stay (the file is never punched), so an
    extent inside a range needs no ``fallocate`` when it is handed out again: first-fit
    reuses the low offsets, and the ranges merge into few. Not thread-safe on its own
    (:class:`Arena` locks it)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def covers(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self._starts, lo) - 1
        return i >= 0 and self._ends[i] >= hi

    def add(self, lo: int, hi: int) -> None:
        i = bisect.bisect_left(self._ends, lo)  # the first range that reaches lo
        j = bisect.bisect_right(self._starts, hi)  # past the last that starts by hi
        if i < j:
            lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
        self._starts[i:j] = [lo]
        self._ends[i:j] = [hi]

    def __len__(self) -> int:
        return len(self._starts)


@dataclass(frozen=True, slots=True)
class Slot:
    """One allocated extent of the arena."""

    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Owner:
    """Who may map an arena file besides the server: its owner and group, and its mode
    (0600: the owner only; 0660: the group too)."""

    uid: int
    gid: int
    mode: int = 0o600


UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
"""errno of a filesystem that cannot allocate ahead (its pages fault in as before)."""


def allocate_pages(fd: int, size: int, offset: int = 0) -> bool:
    """Allocate the pages of ``[offset, +size)`` of a shared-memory file now (OSError
    ENOSPC where the filesystem has no room for them): a sparse file on a full tmpfs
    maps fine, and the first write to a page it cannot back kills the writer with
    SIGBUS (a client's put, the engine; or the server copying a load into it). False:
    the filesystem cannot allocate ahead, and its pages are left to fault in as before."""
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as exc:
        if exc.errno not in UNSUPPORTED:
            raise
        return False
    return True


def held(path: Path) -> bool:
    """True if a live process holds ``path``'s arena lock (:class:`Arena` takes it when it
    makes the file and keeps it until it removes the file), or if that cannot be told
    (the file is not ours to open); False if the file is gone or nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock if it was taken
    return False


def _close_descriptor(fd: int) -> None:
    """An arena's finalizer: closing its descriptor drops its lock (no Python lock taken,
    no file opened or written; docs/server.md, "Finalizers")."""
    os.close(fd)


class Arena:
    """A shared-memory file mapped into this process, with an allocator.

    ``owner``: the file is given to that Unix user and group with that mode before it is
    mapped (a tenant's arena, :mod:`kvlife.server.shm_arenas`); None: the server's own,
    0600. ``populate_pages``: map it populated (every page resident from the start)."""

    def __init__(
        self,
        path: Path,
        size: int,
        *,
        populate_pages: bool = True,
        owner: Owner | None = None,
    ) -> None:
        if size <= 0:
            raise InvalidArgument(f"arena size must be > 0, got {size}")
        size = round_up(size)
        self.path = Path(path)
        self.owner = owner
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise InvalidArgument(f"arena {self.path} exists already (another server?)") from None
        except OSError as exc:
            raise StorageFullError(f"cannot create the arena {self.path}: {exc}") from exc
        try:
            # held for the arena's life (the descriptor stays open until unlink): the
            # kernel drops the lock when this process dies, however it dies, so an
            # unlocked arena is one nobody serves (:func:`held`, the sweep of
            # :mod:`kvlife.server.stale_arenas`)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if owner is not None:
                # given away before it holds a byte or is mapped by anyone
                try:
                    os.fchown(fd, owner.uid, owner.gid)
                    os.fchmod(fd, owner.mode)
                except PermissionError as exc:
                    raise NotPermitted(
                        f"cannot give the arena {self.path} to uid {owner.uid} gid "
                        f"{owner.gid}: {exc} (a server with principals of other Unix users "
                        "needs CAP_CHOWN, e.g. runs as root)"
                    ) from None
            os.ftruncate(fd, size)
            if populate_pages:
                allocate_pages(fd, size)
            # populated: the pages exist (and are mapped here) before the first put, so
            # no copy into the arena pays first-touch faults
            populate = getattr(mmap, "MAP_POPULATE", 0) if populate_pages else 0
            self.mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        except NotPermitted:
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise StorageFullError(f"cannot map the arena {self.path}: {exc}") from exc
        self._release = weakref.finalize(self, _close_descriptor, fd)
        """Closes the file's descriptor, and so drops its lock, once: at :meth:`unlink`,
        or when the arena is collected without it."""
        self._fd = -1 if populate_pages else fd
        """The same descriptor where the arena is sparse, to allocate each extent's pages
        as it is handed out (:meth:`alloc`); -1: populated (every page allocated when
        made), a filesystem that cannot allocate ahead, or unlinked."""
        self._fd_lock = threading.Lock()
        """Held around each ``fallocate`` and the descriptor's close, so that a closed
        number (reused by another file) is never allocated into."""
        advise_huge(self.mmap)
        self.huge_pages = huge_pages(self.path.parent)
        self.size = size
        self._alloc = Allocator(size)
        self._lock = threading.Lock()
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        """Extents whose last view died, not yet given back to the allocator: the
        finalizer only appends here (``deque.append`` is atomic and takes no lock), the
        holder of ``_lock`` drains it."""
        # generations start at a random point: hints of another server's arena (a client
        # that reconnected) name no extent of this one
        self._gen = int.from_bytes(os.urandom(6), "little") << 8
        self._gens: dict[int, int] = {}
        """Generation of each allocated extent by offset: unique per allocation, so an
        offset and a generation name one extent's lifetime (a client's copy from a
        lookup's hint is valid when both still match once the extent is pinned)."""
        self._base = np.frombuffer(self.mmap, np.uint8).ctypes.data
        self.unbacked = 0
        """Extents of a sparse arena refused because the filesystem had no room for
        their pages (:meth:`alloc` returned None: no room, as for a full arena)."""
        self._backed = Backed()
        """Where a sparse arena's pages are allocated already (no ``fallocate`` there)."""

    def alloc(self, nbytes: int, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> np.ndarray | None:
        """A writable view of a new extent shaped ``shape`` (None when none fits, or
        when the filesystem has no room for a sparse arena's pages of it). The extent is
        freed when the last view of it dies."""
        got = self.alloc_many(nbytes, dtype, shape, 1)
        return got[0][0] if got else None

    def alloc_many(
        self, nbytes: int, dtype: npt.DTypeLike, shape: tuple[int, ...], count: int
    ) -> list[tuple[np.ndarray, int]]:
        """Up to ``count`` new extents as :meth:`alloc` makes them, each with its offset
        (fewer when the arena runs out of room): one lock for all, and no offset to
        look up afterwards (a served put stages one per chunk; issue 28)."""
        offs: list[int] = []
        with self._lock:
            self._drain()
            for _ in range(count):
                off = self._alloc.alloc(nbytes)
                if off is None:
                    break
                self._gen += 1
                self._gens[off] = self._gen
                offs.append(off)
        for i, off in enumerate(offs):
            # a sparse arena: its pages allocated before anyone writes (asked per extent:
            # the first may find the filesystem cannot allocate ahead, and stop asking)
            if self._fd >= 0 and not self._back(off, nbytes):
                self._give_back(offs[i + 1 :], nbytes)  # in order: the first fit
                del offs[i:]
                break
        out = []
        try:
            for off in offs:
                raw = np.frombuffer(self.mmap, np.uint8, count=nbytes, offset=off)
                view = raw.view(dtype).reshape(shape)
                fin = weakref.finalize(raw.base, self._free, off, nbytes)
                fin.atexit = False
                out.append((view, off))
        except BaseException:  # (a shape the bytes do not fill) no extent is lost
            self._give_back(offs[len(out) :], nbytes)  # those with no view yet
            out.clear()  # the others go back with their views
            raise
        return out

    def _give_back(self, offs: list[int], nbytes: int) -> None:
        """Extents allocated and never handed out (no view of them made)."""
        with self._lock:
            for off in offs:
                self._free_extent(off, nbytes)

    def _free_extent(self, offset: int, nbytes: int) -> None:
        """An extent free again, its generation forgotten (the caller holds ``_lock``)."""
        self._alloc.free(offset, nbytes)
        self._gens.pop(offset, None)

    def _back(self, offset: int, nbytes: int) -> bool:
        """Allocate the pages of a sparse arena's new extent before anyone writes it
        (whoever writes first: a client's put, the server's copy of a load); False, the
        extent given back and counted in :attr:`unbacked`, where the filesystem has no
        room for them. One ``fallocate`` per extent not yet inside an allocated range
        (:class:`Backed`); an extent reused there costs a lookup."""
        end = offset + round_up(max(nbytes, 1))
        with self._lock:
            if self._backed.covers(offset, end):
                return True
        try:
            with self._fd_lock:
                if self._fd < 0:  # unlinked meanwhile: the server is closing
                    raise OSError(errno.EBADF, "the arena was removed")
                if not allocate_pages(self._fd, end - offset, offset):
                    self._fd = -1  # cannot allocate ahead: faults in as before
                    return True
            with self._lock:
                self._backed.add(offset, end)
            return True
        except OSError:
            with self._lock:
                self._free_extent(offset, nbytes)
                self.unbacked += 1
            return False

    def _free(self, offset: int, nbytes: int) -> None:
        # a finalizer: no lock, no I/O (it may run inside alloc, under _lock, on a
        # collection the allocation set off); the next holder of _lock frees it
        self._freed.append((offset, nbytes))

    def _drain(self) -> None:
        """Give the queued extents back to the allocator (the caller holds ``_lock``)."""
        freed = self._freed
        while freed:
            offset, nbytes = freed.popleft()
            self._free_extent(offset, nbytes)

    def generation(self, offset: int) -> int:
        """The generation of the extent allocated at ``offset`` now (0: none is)."""
        return self._gens.get(offset, 0)

    def offset_of(self, arr: np.ndarray) -> int | None:
        """Offset of ``arr``'s data in the arena if it is a contiguous view of it."""
        addr = c_address(arr)
        if addr is None or not (self._base <= addr and addr + arr.nbytes <= self._base + self.size):
            return None
        return addr - self._base

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._drain()
            return self._alloc.used

    @property
    def extents(self) -> int:
        with self._lock:
            self._drain()
            return self._alloc.extents

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._drain()
            return {
                "arena_bytes": self.size,
                "arena_used_bytes": self._alloc.used,
                "arena_extents": self._alloc.extents,
                "arena_largest_free": self._alloc.largest_free,
                "arena_huge_pages": int(self.huge_pages),
                "arena_unbacked": self.unbacked,
            }

    def unlink(self) -> None:
        """Remove the file (mappings live on), then drop its lock: never an unlocked
        arena under its name while this process serves it."""
        self.path.unlink(missing_ok=True)
        with self._fd_lock:
            self._fd = -1
            self._release()


Home = Callable[[ReplicaMeta], "Arena | None"]
"""Which arena a replica lives in, from its metadata (None: the tier's own)."""


@dataclass(slots=True)
class _Held:
    meta: ReplicaMeta
    array: np.ndarray
    hint: tuple[int, int]
    """The replica's extent: (offset, generation)."""
    arena: Arena
    """The arena it lies in."""


class ShmTier(HeldTier[_Held]):
    """Replicas in a shared-memory arena, at most ``capacity_bytes`` of payload."""

    def __init__(
        self, capacity_bytes: int, name: str, arena_path: Path, staging_bytes: int
    ) -> None:
        if capacity_bytes < 0 or staging_bytes < 0:
            raise InvalidArgument(
                f"shm tier needs capacity and staging >= 0, got {capacity_bytes}, {staging_bytes}"
            )
        super().__init__(capacity_bytes, name)
        self.arena = Arena(arena_path, capacity_bytes + staging_bytes)
        """The tier's own arena (0600, the server's): every replica without tenants."""
        self.arenas: dict[str, Arena] = {}
        """Further arenas by name (a tenant's: :mod:`kvlife.server.shm_arenas`)."""
        self.home: Home | None = None
        """Which arena a new replica lives in (None: always :attr:`arena`). A payload
        that is a sealed extent of its home arena is adopted; any other is copied there
        (so a replica never lies in an arena its readers may not map)."""
        self.adopted = 0
        """Payloads published without a copy (already in the arena)."""
        self.home_overflow = 0
        """Replicas copied into the tier's own arena because their home (a tenant's
        arena) had no room."""

    def add_arena(self, name: str, arena: Arena) -> None:
        """Keep ``arena`` with the tier (its figures, and removed when it closes)."""
        with self._lock:
            if name in self.arenas:
                raise InvalidArgument(f"the shm tier has an arena {name!r} already")
            self.arenas[name] = arena

    def all_arenas(self) -> list[Arena]:
        with self._lock:
            return [self.arena, *self.arenas.values()]

    def footprint(self, nbytes: int) -> int:
        """Extents are whole pages: that is what a replica takes of the budget."""
        return round_up(max(nbytes, 1))

    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        try:
            check_payloads(reservation.metas, payloads)
            homes = [self._home(meta) for meta in reservation.metas]
            # each replica's extent: (array, arena, offset, the hash of a copy made as it
            # was copied); a copy its home arena had no room for went to the tier's own
            # (overflow)
            placed = [
                self._into_arena(arena, arr, not meta.checksum_given)
                for meta, arena, arr in zip(reservation.metas, homes, payloads, strict=True)
            ]
            # sealed as published (the xxh3-128 of the extent's bytes, or the checksum
            # the store vouches for); kept as a read-only export of the extent
            seals = [
                self._seal(meta, arr, hashed)
                for meta, (arr, _, _, hashed) in zip(reservation.metas, placed, strict=True)
            ]
        except BaseException:
            self.cancel_store(reservation)
            raise
        held = []
        for meta, (arr, arena, off, _), seal in zip(reservation.metas, placed, seals, strict=True):
            sealed = sealed_meta(meta, seal)
            held.append(_Held(sealed, read_only(arr), (off, arena.generation(off)), arena))
        self._install(reservation, held)

    def commit_adopt(self, reservation: Reservation, arrays: Sequence[np.ndarray]) -> None:
        """Arrays that are arena extents are taken as they are; others are copied in."""
        self.commit_store(reservation, arrays)

    def _home(self, meta: ReplicaMeta) -> Arena:
        home = self.home(meta) if self.home is not None else None
        return home if home is not None else self.arena

    def _into_arena(
        self, arena: Arena, arr: np.ndarray, hash_copy: bool
    ) -> tuple[np.ndarray, Arena, int, bytes]:
        """The replica's extent holding ``arr``: the array, its arena, its offset there
        (``arr`` itself where it is a sealed extent of ``arena``, else a copy) and, for
        a copy with ``hash_copy``, the xxh3-128 of the bytes copied (else empty). A copy
        streams into the extent by the extension, each block hashed first where asked
        (:func:`kvlife.native.copies.copy_sealed`: the source is read once)."""
        off = arena.offset_of(arr)
        if off is not None and not arr.flags.writeable:
            self.adopted += 1  # a sealed extent (a put a client wrote): no copy
            return arr, arena, off, b""
        dst = arena.alloc(arr.nbytes, arr.dtype, arr.shape)
        if dst is None and arena is not self.arena:
            # a tenant's arena is full: the tier's own, which no client maps, holds it
            # (its principal is served copies of it, as of a shared scope's replica)
            dst = self.arena.alloc(arr.nbytes, arr.dtype, arr.shape)
            if dst is not None:
                self.home_overflow += 1
                arena = self.arena
        if dst is None:
            raise StorageFullError(
                f"arena {arena.path} has no free extent of {arr.nbytes} bytes ({arena.stats()})"
            )
        hashed = b""
        if hash_copy:
            hashed = copy_sealed(dst, arr)
        else:
            stream_copy(dst, arr)
        dst.flags.writeable = False
        at = arena.offset_of(dst)
        assert at is not None  # an extent of the arena it was allocated in
        return dst, arena, at, hashed

    def hint(self, key: ChunkKey, arena: Arena | None = None) -> tuple[int, int] | None:
        """Where the replica of ``key`` lies now in ``arena`` (default: the tier's own):
        (offset, generation), or None (not held, or in another arena)."""
        held = self._held.get(key)
        if held is None or held.arena is not (arena if arena is not None else self.arena):
            return None
        return held.hint

    def hints(self, keys: Sequence[ChunkKey], arena: Arena) -> list[tuple[int, int]]:
        """:meth:`hint` of every key at once, (0, 0) for a key not held in ``arena``: a
        served lookup's hints, one comprehension over the C-level probes of the keys."""
        none = (0, 0)
        return [
            none if held is None or held.arena is not arena else held.hint
            for held in map(self._held.get, keys)
        ]

    def delete(self, key: ChunkKey) -> int:
        with self._lock:
            return self._take(key).meta.nbytes
        # the extent goes back to the arena when the last view of it dies

    def arena_stats(self) -> dict[str, int]:
        """The tier's own arena's figures, with the used bytes and extents of every
        arena added up (``arena_arenas``: how many arenas)."""
        arenas = self.all_arenas()
        figures = arenas[0].stats()
        for arena in arenas[1:]:
            more = arena.stats()
            figures["arena_used_bytes"] += more["arena_used_bytes"]
            figures["arena_extents"] += more["arena_extents"]
            figures["arena_unbacked"] += more["arena_unbacked"]
        figures["arena_arenas"] = len(arenas)
        return figures

    def details(self) -> dict[str, object]:
        return {**self.arena_stats(), "arena": str(self.arena.path), "adopted": self.adopted}

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        for arena in self.all_arenas():
            arena.unlink()
