"""Opening a disk tier directory: what of it is served again after a restart or a crash.

Open never deletes a byte that may hold committed data (docs/recovery.md).
:func:`open_catalog` refuses a missing catalog beside segment data
(:class:`~kvlife.tiers.disk.catalog.CatalogMissing`), one SQLite finds damaged
(:class:`~kvlife.tiers.disk.catalog.CatalogCorrupt`), and one behind the generation
the superblock acknowledged, i.e. a lost write-ahead log tail
(:class:`~kvlife.tiers.disk.superblock.CatalogRolledBack`); a catalog *ahead* of the
superblock (the process died between a commit and its superblock write) is recorded.
:func:`recover` then checks every row (its fields and row checksum, its segment, its
frame header; with ``verify_on_open="full"`` also its payload) and fills the segment
table with the rows that pass. Rows that fail are quarantined in the catalog (never
served, reported once as lost, deleted only by ``check --fix``); the segments holding
them are never reclaimed at runtime. Segment files no row names are moved to
``quarantine/`` (a zero-byte one, which holds no frame, is removed).

Recovery runs before the tier serves anything, so it takes no lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from kvlife.core.errors import StorePathError
from kvlife.core.identity import ChunkKey
from kvlife.tiers.disk.audit import check_frame
from kvlife.tiers.disk.catalog import Catalog, CatalogCorrupt, CatalogMissing
from kvlife.tiers.disk.counters import DiskStats, LostReplicas
from kvlife.tiers.disk.fileio import FileIO, os_error
from kvlife.tiers.disk.frame import frame_room
from kvlife.tiers.disk.segments import Segment, SegmentTable, segment_files
from kvlife.tiers.disk.superblock import FILE_NAME as SUPERBLOCK_FILE
from kvlife.tiers.disk.superblock import CatalogRolledBack, Superblock, SuperblockError

CATALOG_FILE = "catalog.sqlite"


def has_segment_data(segdir: Path) -> bool:
    """True if any segment file in ``segdir`` holds a byte."""
    for path in segment_files(segdir).values():
        try:
            if path.stat().st_size > 0:
                return True
        except OSError as exc:
            raise StorePathError(f"cannot stat segment {path}: {exc}") from exc
    return False


def open_catalog(directory: Path, segdir: Path, io: FileIO) -> tuple[Catalog, Superblock]:
    """The catalog (created for a directory with no data yet) and the superblock of a
    tier directory, checked against each other (see the module docstring)."""
    catalog_path = directory / CATALOG_FILE
    has_data = has_segment_data(segdir)
    if has_data and not catalog_path.exists():
        raise CatalogMissing(catalog_path, segdir)
    superblock = Superblock(directory / SUPERBLOCK_FILE, io)
    try:
        catalog = Catalog(
            catalog_path,
            create=not has_data,
            superblock=superblock,
            initial_generation=superblock.read().generation or 0,
        )
    except BaseException:
        superblock.close()
        raise
    try:
        check_catalog(catalog, superblock)
    except BaseException:
        catalog.close()
        superblock.close()
        raise
    return catalog, superblock


def check_catalog(catalog: Catalog, superblock: Superblock) -> None:
    """Refuse a catalog SQLite finds damaged, or one older than the generation the
    superblock acknowledged (its write-ahead log lost committed deletions)."""
    problems = catalog.integrity()
    if problems:
        raise CatalogCorrupt(catalog.path, "integrity check: " + "; ".join(problems[:3]))
    state = superblock.read()
    have, acked = catalog.generation, state.generation
    if acked is None:
        if have > 0:
            detail = "is missing" if not state.exists else "; ".join(state.problems)
            raise SuperblockError(superblock.path, detail)
        # Generation 0: no row was ever deleted, so there is nothing to roll back.
        superblock.write_both(0)
        return
    if have < acked:
        raise CatalogRolledBack(catalog.path, have, acked)
    if have > acked:  # the process died between a commit and its superblock write
        superblock.write(have)
    if None in superblock.read().generations:
        superblock.write(have)  # restore the second copy


def recover(
    table: SegmentTable,
    catalog: Catalog,
    io: FileIO,
    *,
    verify: Literal["none", "header", "full"],
    quarantine_dir: Path,
    stats: DiskStats,
    lost: LostReplicas,
) -> None:
    """Read the catalog into an empty segment table and mark; delete nothing. Rows that
    fail (a field, the row checksum, the frame) are quarantined in the catalog and
    reported once through ``lost``; segment files no row names are set aside."""
    for sid, path in sorted(segment_files(table.segdir).items()):
        table.sid_floor = max(table.sid_floor, sid)
        try:
            fd = io.open(path, create=False)
        except OSError as exc:
            raise os_error(exc, f"opening segment {path}") from exc
        table.segments[sid] = Segment(sid, path, fd, io.size(fd))
    referenced: set[int] = set()
    marks: list[tuple[int, str]] = []
    for s in catalog.scan():
        if s.seg is not None:
            referenced.add(s.seg)
        problem = s.quarantine or s.problem
        if not problem and s.row is not None:
            seg = table.segments.get(s.row.seg)
            problem = check_frame(
                s.row,
                None if seg is None else seg.fd,
                0 if seg is None else seg.length,
                io,
                header=verify != "none",
                full=verify == "full",
            )
        if problem:
            if s.seg is not None:
                table.held[s.seg] = table.held.get(s.seg, 0) + 1
            if s.quarantine is None:  # found now: report it, once
                marks.append((s.rowid, problem))
                lost.add(ChunkKey(s.key), f"quarantined on open: {problem}")
            continue
        assert s.row is not None
        table.rows[ChunkKey(s.row.key)] = s.row
        table.segments[s.row.seg].live += frame_room(s.row.nbytes)
    catalog.quarantine(marks)
    stats.recovered = len(table.rows)
    stats.recovery_dropped = len(marks)
    stats.rows_quarantined = sum(table.held.values())
    for seg in list(table.segments.values()):
        if seg.id not in referenced and _set_aside(table, seg, io, quarantine_dir):
            stats.segments_quarantined += 1


def _set_aside(table: SegmentTable, seg: Segment, io: FileIO, quarantine_dir: Path) -> bool:
    """Take a segment no row names out of the store: a zero-byte file (an active
    segment that never got a frame) is removed, any other is moved to quarantine/
    (True)."""
    del table.segments[seg.id]
    try:
        io.close(seg.fd)
        if seg.length == 0:
            io.unlink(seg.path)
            return False
        quarantine_dir.mkdir(exist_ok=True)
        dst = quarantine_dir / seg.path.name
        n = 0
        while dst.exists():
            n += 1
            dst = quarantine_dir / f"{seg.path.name}.{n}"
        io.rename(seg.path, dst)
        io.fsync_dir(quarantine_dir)
        io.fsync_dir(table.segdir)
    except OSError as exc:
        raise os_error(exc, f"moving unreferenced segment {seg.path} to quarantine") from exc
    return True
