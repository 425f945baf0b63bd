"""The one audit of a disk tier, for a closed store and for an open one alike.

:func:`audit` checks, and changes nothing:

- the catalog's SQLite ``PRAGMA integrity_check``;
- the catalog's generation against both superblock copies;
- every row: its fields and row checksum, then its frame (inside the segment file, the
  header against the row, the payload's xxh3-128), one segment at a time;
- the rows an earlier open quarantined;
- segment files no row refers to (orphans), and the files in ``quarantine/``.

Only where it reads from differs, an :class:`AuditSource`:

:class:`DirectorySource` (``kvlife check PATH``, :func:`audit_directory`)
    a closed store. The catalog is opened with a SQLite ``mode=ro`` URI (SQLite may
    create its ``-shm`` index; no data file is written), segment files are opened
    read-only and read with plain reads. No recovery runs, nothing is quarantined,
    moved or deleted. A shared ``flock`` on ``PATH/LOCK`` is held throughout, so it
    refuses (:class:`~kvlife.core.errors.StoreLockedError`) while a process has the
    store open, and a store cannot be opened while it runs.
:class:`TierSource` (``DiskTier.check``: ``kvlife check --socket``, ``check --fix``)
    an open tier, beside serving. Integrity and quarantined rows come from a second,
    read-only SQLite connection (a snapshot under WAL); the rows checked are those the
    tier serves (the catalog's, as open verified them); the generation is compared
    while no deleting transaction is between its commit and its superblock write (the
    catalog's own lock, held across one read of the superblock's two 4 KiB copies).
    Each segment is pinned while its rows are checked, as a read pins it, so an
    invalidation meanwhile deletes rows and the file goes when the audit leaves it. A
    row deleted or moved while it was checked is not reported. The tier lock is held
    only to list rows, pin, unpin and tell current rows and known segments; neither it
    nor the write mutex is held across any audit I/O.

What the audit found is the :class:`Findings`: the report, plus what a repair
(:mod:`kvlife.tiers.disk.repair`) needs to act on exactly what was checked.
:func:`check_frame` is also recovery's frame check at open.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.core.errors import KVLifeError, StoreLockedError, StorePathError
from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import AuditReport
from kvlife.tiers.buffers import ALIGN, aligned_empty
from kvlife.tiers.disk.catalog import Catalog, CatalogMissing, CatalogRow
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES, frame_len
from kvlife.tiers.disk.segments import SegmentTable, segment_files
from kvlife.tiers.disk.superblock import FILE_NAME as SUPERBLOCK_FILE
from kvlife.tiers.disk.superblock import Superblock, SuperblockState, read_superblock

CATALOG_FILE = "catalog.sqlite"
QUARANTINE_DIR = "quarantine"

Progress = Callable[[int], object] | None
"""Called with each replica's byte count as it is checked."""


def check_frame(
    row: CatalogRow,
    fd: int | None,
    length: int,
    io: FileIO,
    *,
    header: bool = True,
    full: bool = True,
) -> str:
    """Empty if the frame a row names matches it, else what is wrong.

    ``fd`` and ``length`` are the row's segment file (None: there is none). Always
    checks that the frame lies inside the file; with ``header`` reads the frame header
    and checks it against the row, with ``full`` the payload's checksum too. Reads go
    through ``io`` into an aligned buffer, so ``fd`` may be open for direct I/O.
    """
    if fd is None:
        return f"segment seg-{row.seg:08d} is missing"
    flen = frame_len(row.nbytes)
    if row.off % ALIGN or row.off + HEADER_BYTES + row.nbytes > length:
        return f"frame at {row.off} (+{flen}) lies beyond the segment's {length} bytes"
    if not header and not full:
        return ""
    buf = aligned_empty(flen if full else HEADER_BYTES)
    try:
        got = io.preadv(fd, [buf], row.off)
    except OSError as exc:
        return f"read failed: {exc}"
    if got < (HEADER_BYTES + row.nbytes if full else HEADER_BYTES):
        return f"truncated: {got} bytes"
    payload = [buf[HEADER_BYTES : HEADER_BYTES + row.nbytes]] if full else None
    return row.verify(buf.data[:HEADER_BYTES], payload)


# ---------------------------------------------------------------------- the audit


@dataclass(slots=True)
class Listing:
    """What a source's catalog holds, as the audit checks it."""

    generation: int | None = None
    """The catalog's generation (None: no catalog was read)."""
    superblock: SuperblockState | None = None
    """The superblock as read against ``generation`` (None: nothing to compare, e.g. a
    catalog of format 1, which has no generation)."""
    integrity: list[str] = field(default_factory=list)
    """``PRAGMA integrity_check`` messages (empty: sound)."""
    problems: list[str] = field(default_factory=list)
    """What kept the catalog from being read (missing, damaged beyond reading)."""
    rows: list[CatalogRow] = field(default_factory=list)
    """Rows to check against their frames."""
    unreadable: list[tuple[bytes, str]] = field(default_factory=list)
    """Rows whose fields or row checksum fail: (key as stored, what is wrong)."""
    quarantined: list[tuple[int, bytes, str]] = field(default_factory=list)
    """Rows an earlier open quarantined: (rowid, key as stored, why)."""
    referenced: set[int] | None = field(default_factory=set)
    """Segment ids some row names (None: unknown, so no file is called an orphan)."""


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """A segment file open for the audit's reads."""

    fd: int | None
    """Its descriptor; None when it cannot be read (``problem`` says why)."""
    length: int
    problem: str = ""
    """Why none of its frames can be checked (every row in it is bad)."""


class AuditSource(ABC):
    """Where one audit reads from: a closed store's directory or an open tier."""

    def __init__(self, disk: Path, io: FileIO) -> None:
        self.segdir = disk / "segments"
        self.quarantine_dir = disk / QUARANTINE_DIR
        self.superblock_path = disk / SUPERBLOCK_FILE
        self.io = io

    @abstractmethod
    def read_catalog(self, files: dict[int, Path]) -> Listing:
        """The catalog's rows and state, read consistently and without changing it
        (``files``: the segment files found, by id)."""

    @abstractmethod
    def segment(self, sid: int) -> contextlib.AbstractContextManager[SegmentFile | None]:
        """Segment ``sid`` open for reading while the context lasts; None when it went
        since the rows were listed (its rows moved or were deleted: none is checked)."""

    @abstractmethod
    def current(self, found: list[tuple[CatalogRow, str]]) -> list[tuple[CatalogRow, str]]:
        """The checked rows (with their problems) that are still the source's rows."""

    @abstractmethod
    def orphans(self, files: dict[int, Path], referenced: set[int] | None) -> list[str]:
        """Names of the segment files in ``files`` that belong to no segment."""


@dataclass(slots=True)
class Findings:
    """What one audit found: the report, and what a repair acts on."""

    report: AuditReport
    integrity: list[str] = field(default_factory=list)
    """``PRAGMA integrity_check`` messages (a repair rebuilds the indexes)."""
    bad: dict[ChunkKey, CatalogRow] = field(default_factory=dict)
    """Rows whose frame failed, exactly as they were checked."""
    quarantined_rowids: list[int] = field(default_factory=list)


def audit(source: AuditSource, progress: Progress = None) -> Findings:
    """Audit what ``source`` reads (see the module docstring); changes nothing."""
    report = AuditReport()
    found = Findings(report)
    report.quarantined_files.extend(quarantine_files(source.quarantine_dir))
    files = segment_files(source.segdir)
    listing = source.read_catalog(files)
    report.generation = listing.generation
    found.integrity = listing.integrity
    report.problems.extend(f"catalog integrity: {m}" for m in listing.integrity)
    if listing.generation is not None and listing.superblock is not None:
        report.problems.extend(
            generation_problems(listing.generation, listing.superblock, source.superblock_path)
        )
    report.problems.extend(listing.problems)
    for key, problem in listing.unreadable:
        report.rows += 1
        report.problems.append(problem)
        report.bad_keys.append(key)
    by_seg: dict[int, list[CatalogRow]] = {}
    for row in listing.rows:
        by_seg.setdefault(row.seg, []).append(row)
    for sid, rows in sorted(by_seg.items()):
        for row, problem in source.current(_check_segment(source, sid, rows, progress)):
            report.rows += 1
            if not problem:
                report.ok += 1
                continue
            report.problems.append(f"{row.key.hex()[:16]}… seg-{row.seg:08d}@{row.off}: {problem}")
            report.bad_keys.append(row.key)
            found.bad[ChunkKey(row.key)] = row
    report.quarantined.extend(f"{k.hex()[:16]}…: {why}" for _, k, why in listing.quarantined)
    found.quarantined_rowids = [rowid for rowid, _, _ in listing.quarantined]
    report.orphan_segments.extend(source.orphans(files, listing.referenced))
    return found


def _check_segment(
    source: AuditSource, sid: int, rows: list[CatalogRow], progress: Progress
) -> list[tuple[CatalogRow, str]]:
    """Check the rows of one segment; each with its problem (empty: it verified)."""
    found: list[tuple[CatalogRow, str]] = []
    with source.segment(sid) as seg:
        if seg is None:
            return found  # emptied since the rows were listed: they moved or went
        for row in rows:
            if progress is not None:
                progress(row.nbytes)
            problem = seg.problem or check_frame(row, seg.fd, seg.length, source.io)
            found.append((row, problem))
    return found


def generation_problems(have: int, state: SuperblockState, path: Path) -> list[str]:
    """What is wrong between a catalog at generation ``have`` and its superblock."""
    acked = state.generation
    if acked is None:
        if have > 0:
            return [
                f"superblock {path} {'; '.join(state.problems)} and the catalog is at "
                f"generation {have}: nothing proves the catalog holds every acknowledged "
                "deletion"
            ]
        return [f"superblock {path} {p}" for p in state.problems]
    problems: list[str] = []
    if have < acked:
        problems.append(
            f"catalog generation {have} is behind the acknowledged generation {acked} "
            "(superblock): the write-ahead log lost committed deletions"
        )
    elif have > acked:
        problems.append(
            f"superblock generation {acked} trails the catalog's {have} (the next open records it)"
        )
    problems.extend(f"superblock {path} {p}" for p in state.problems)
    return problems


def quarantine_files(qdir: Path) -> list[str]:
    """Names of the files recovery set aside in ``qdir``."""
    try:
        return sorted(p.name for p in qdir.iterdir() if p.is_file())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorePathError(f"cannot list {qdir}: {exc}") from exc


# ---------------------------------------------------------------------- an open tier


class TierSource(AuditSource):
    """An open disk tier, audited beside serving (see the module docstring)."""

    def __init__(
        self,
        disk: Path,
        io: FileIO,
        table: SegmentTable,
        catalog: Catalog,
        superblock: Superblock,
    ) -> None:
        super().__init__(disk, io)
        self._table = table
        self._catalog = catalog
        self._superblock = superblock

    def read_catalog(self, files: dict[int, Path]) -> Listing:
        with self._catalog.snapshot() as snap:
            integrity = snap.integrity()
            quarantined = snap.quarantined()
        with self._catalog.settled() as generation:
            state = self._superblock.reread()
        with self._table.lock:
            rows = list(self._table.rows.values())
        return Listing(generation, state, integrity, rows=rows, quarantined=quarantined)

    @contextlib.contextmanager
    def segment(self, sid: int) -> Iterator[SegmentFile | None]:
        table = self._table
        with table.lock:
            seg = table.pin(sid)
        if seg is None:
            yield None
            return
        try:
            yield SegmentFile(seg.fd, seg.length)
        finally:
            with table.lock:
                retired = table.unpin([seg])
            table.remove(retired, quiet=True)

    def current(self, found: list[tuple[CatalogRow, str]]) -> list[tuple[CatalogRow, str]]:
        # a row deleted or moved meanwhile is not the store's to report any more
        with self._table.lock:
            rows = self._table.rows
            return [(r, p) for r, p in found if rows.get(ChunkKey(r.key)) is r]

    def orphans(self, files: dict[int, Path], referenced: set[int] | None) -> list[str]:
        table = self._table
        unknown: list[int] = []
        failed: set[int] = set()
        with table.lock:
            for sid in files:
                seg = table.segments.get(sid)
                if seg is not None and seg.unlink_failed:
                    failed.add(sid)  # emptied, its unlink failed
                elif not table.known(sid):
                    unknown.append(sid)  # no segment of this tier, unless it went since
        gone = {sid for sid in unknown if not files[sid].exists()}  # outside the lock
        return [
            files[sid].name
            for sid in sorted(files)
            if sid in failed or (sid in unknown and sid not in gone)
        ]


# ---------------------------------------------------------------------- a closed store


class DirectorySource(AuditSource):
    """A closed store's disk directory, read without changing a byte."""

    def __init__(self, disk: Path) -> None:
        super().__init__(disk, FileIO(direct=False))
        self.catalog_path = disk / CATALOG_FILE
        self._files: dict[int, Path] = {}
        self._sizes: dict[int, int] = {}

    def read_catalog(self, files: dict[int, Path]) -> Listing:
        self._files = files
        self._sizes = {sid: _size(p) for sid, p in files.items()}
        has_data = any(n > 0 for n in self._sizes.values())
        sb = read_superblock(self.superblock_path)
        if not self.catalog_path.exists() or _size(self.catalog_path) == 0:
            state = "missing" if not self.catalog_path.exists() else "empty"
            problem = str(CatalogMissing(self.catalog_path, self.segdir, state))
            return Listing(problems=[problem] if has_data else [])
        try:
            cat = Catalog(self.catalog_path, readonly=True)
        except CatalogMissing as exc:
            return Listing(problems=[str(exc)] if has_data else [])
        except KVLifeError as exc:
            return Listing(problems=[str(exc)], referenced=None)
        listing = Listing(cat.generation, sb if cat.version >= 2 else None)
        try:
            listing.integrity = cat.integrity()
            scanned = cat.scan()
        except KVLifeError as exc:
            listing.problems.append(str(exc))
            return listing
        finally:
            cat.close()
        refs: set[int] = set()
        for s in scanned:
            if s.seg is not None:
                refs.add(s.seg)
            if s.quarantine is not None:
                listing.quarantined.append((s.rowid, s.key, s.quarantine))
            elif s.row is None or s.problem:
                listing.unreadable.append((s.key, s.problem))
            else:
                listing.rows.append(s.row)
        listing.referenced = refs
        return listing

    @contextlib.contextmanager
    def segment(self, sid: int) -> Iterator[SegmentFile | None]:
        path = self._files.get(sid)
        if path is None:
            yield SegmentFile(None, 0, f"segment seg-{sid:08d} is missing")
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            yield SegmentFile(None, 0, f"read failed: {exc}")
            return
        try:
            yield SegmentFile(fd, self._sizes[sid])
        finally:
            os.close(fd)

    def current(self, found: list[tuple[CatalogRow, str]]) -> list[tuple[CatalogRow, str]]:
        return found  # nothing changes a closed store under its audit

    def orphans(self, files: dict[int, Path], referenced: set[int] | None) -> list[str]:
        if referenced is None:
            return []
        return [
            p.name
            for sid, p in sorted(files.items())
            if sid not in referenced and self._sizes[sid] > 0
        ]


def disk_directory(path: Path) -> Path:
    """The disk tier directory of the store at ``path`` (StorePathError if none)."""
    disk = path / "disk"
    if not disk.is_dir():
        raise StorePathError(f"{path} is not a kvlife store (no disk/ directory)")
    return disk


@contextlib.contextmanager
def store_locked(path: Path, exclusive: bool) -> Iterator[None]:
    """Hold the ``flock`` on ``PATH/LOCK`` (shared or exclusive) for a closed-store
    command; StoreLockedError while a process has the store open."""
    lock = path / "LOCK"
    try:
        flags = os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY
        fd = os.open(lock, flags, 0o644)
    except FileNotFoundError:
        yield  # never opened by a store: nobody to exclude
        return
    except OSError as exc:
        raise StorePathError(f"cannot open {lock}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(
                f"store {path} is open in another process; check it after that process closes it"
            ) from None
        yield
    finally:
        os.close(fd)


def audit_directory(path: str | Path, progress: Progress = None) -> AuditReport:
    """Audit the closed store at ``path`` without changing it (see the module docstring).

    Damage is reported in the result; only an unusable directory (not a store,
    unreadable, open in another process) raises, always a
    :class:`~kvlife.core.errors.KVLifeError`.
    """
    root = Path(path)
    disk = disk_directory(root)
    with store_locked(root, exclusive=False):
        return audit(DirectorySource(disk), progress).report


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError as exc:
        raise StorePathError(f"cannot stat {p}: {exc}") from exc
