"""Repairs: what ``kvlife check --fix`` changes, the only path that deletes outside the
runtime's own deletes (docs/recovery.md).

A fix is two steps. :func:`prepare_repair`, on the closed store under an exclusive
``flock``, fixes what stops the store from opening: it rebuilds damaged indexes
(``REINDEX``) and resolves a catalog that cannot be proven current (behind the
superblock, or no superblock after rows were deleted) by dropping every replica, since
any of them might have been invalidated. Then the store is opened (recovery quarantines
what fails and sets orphans aside) and its tier audited with ``check(fix=True)``:
:class:`Repairs` acts on the :class:`~kvlife.tiers.disk.audit.Findings` of that audit,
under the tier's write mutex (no writer runs), dropping only rows that are still the
ones checked, deleting quarantined rows, orphan segments and quarantined files,
rebuilding damaged indexes and rewriting a damaged superblock copy. The tier lock is
held only to look at and change the segment table, never across a delete or an unlink.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvlife.tiers.disk.audit import CATALOG_FILE, Findings, disk_directory, store_locked
from kvlife.tiers.disk.catalog import Catalog, CatalogCorrupt, CatalogMissing
from kvlife.tiers.disk.counters import LostReplicas
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.recovery import has_segment_data
from kvlife.tiers.disk.segments import SegmentTable
from kvlife.tiers.disk.superblock import FILE_NAME as SUPERBLOCK_FILE
from kvlife.tiers.disk.superblock import Superblock
from kvlife.tiers.disk.writer import Writer


def prepare_repair(path: str | Path) -> list[str]:
    """Fix what keeps the store at ``path`` from opening; returns what was done.

    Rebuilds the catalog's indexes when SQLite's integrity check fails (and raises
    :class:`CatalogCorrupt` if that does not cure it), and when the catalog cannot be
    proven current (behind the superblock's generation, or the superblock lost after
    rows were deleted) drops every row, since any of them may be a replica whose
    invalidation was lost; the next open then sets the segments aside and the fix
    deletes them. A missing catalog beside segment data is not repaired
    (:class:`CatalogMissing`: restore it, or move the segments away).
    """
    root = Path(path)
    disk = disk_directory(root)
    actions: list[str] = []
    with store_locked(root, exclusive=True):
        catalog_path = disk / CATALOG_FILE
        segdir = disk / "segments"
        has_data = has_segment_data(segdir)
        if not catalog_path.exists():
            if has_data:
                raise CatalogMissing(catalog_path, segdir)
            return actions
        sb = Superblock(disk / SUPERBLOCK_FILE, FileIO(direct=False))
        try:
            cat = Catalog(
                catalog_path, create=not has_data, initial_generation=sb.read().generation or 0
            )
        except BaseException:
            sb.close()
            raise
        try:
            problems = cat.integrity()
            if problems:
                cat.reindex()
                still = cat.integrity()
                if still:
                    raise CatalogCorrupt(
                        catalog_path,
                        "integrity check still fails after rebuilding the indexes: "
                        + "; ".join(still[:3]),
                    )
                actions.append(f"rebuilt the catalog's indexes ({problems[0]})")
            state = sb.read()
            have, acked = cat.generation, state.generation
            if (acked is None and have > 0) or (acked is not None and have < acked):
                why = (
                    f"the superblock is lost ({'; '.join(state.problems)})"
                    if acked is None
                    else f"its generation {have} is behind the acknowledged {acked}"
                )
                n = cat.drop_all(acked or 0)
                actions.append(
                    f"dropped all {n} catalog rows: the catalog cannot be proven current "
                    f"({why}), so any row might be a replica whose invalidation was lost"
                )
            if state.generation != cat.generation or None in state.generations:
                sb.write_both(cat.generation)
                actions.append(f"rewrote the superblock at generation {cat.generation}")
        finally:
            cat.close()
            sb.close()
    return actions


class Repairs:
    """``check --fix`` on an open disk tier: acts on what its audit found."""

    def __init__(
        self,
        table: SegmentTable,
        catalog: Catalog,
        superblock: Superblock,
        writer: Writer,
        io: FileIO,
        quarantine_dir: Path,
        lost: LostReplicas,
    ) -> None:
        self._table = table
        self._catalog = catalog
        self._superblock = superblock
        self._writer = writer
        self._io = io
        self._quarantine_dir = quarantine_dir
        self._lost = lost

    def fix(self, found: Findings) -> None:
        """Repair what the audit found; ``found.report.actions`` says what was done.
        The caller holds the tier's write mutex: no writer runs meanwhile."""
        report = found.report
        table = self._table
        if found.integrity:
            self._catalog.reindex()
            report.actions.append("rebuilt the catalog's indexes")
        with table.lock:  # only rows still as checked: a key written again since is new
            doomed = [k for k, row in found.bad.items() if table.rows.get(k) is row]
        for key in doomed:
            self._lost.add(key, "dropped by check --fix")
        if doomed:
            self._writer.delete(doomed, ())
            report.actions.append(f"dropped {len(doomed)} bad replicas")
        if found.quarantined_rowids:
            rowids = found.quarantined_rowids
            self._catalog.delete_quarantined(rowids)  # counted when they were quarantined
            report.actions.append(f"deleted {len(rowids)} quarantined catalog rows")
            with table.lock:
                held, table.held = table.held, {}
                empty = [
                    seg
                    for sid in held
                    if (seg := table.segments.get(sid)) is not None
                    and seg.live == 0
                    and seg is not table.active
                ]
            for seg in empty:
                table.unlink(seg)
        self._delete_orphans(report.orphan_segments)
        if report.orphan_segments:
            report.actions.append(f"deleted {len(report.orphan_segments)} orphan segments")
        for name in report.quarantined_files:
            with contextlib.suppress(FileNotFoundError):
                self._io.unlink(self._quarantine_dir / name)
        if report.quarantined_files:
            report.actions.append(f"deleted {len(report.quarantined_files)} quarantined files")
            with contextlib.suppress(OSError):  # left if something else was put there
                self._quarantine_dir.rmdir()
        state = self._superblock.read()
        generation = self._catalog.generation
        if None in state.generations or state.generation != generation:
            self._superblock.write_both(generation)
            report.actions.append(f"rewrote the superblock at generation {generation}")
        report.fixed = True

    def _delete_orphans(self, names: list[str]) -> None:
        """Unlink the orphan segment files the audit listed: files of no segment, and
        emptied segments whose unlink failed (then dropped from the table)."""
        table = self._table
        for name in names:
            sid = int(name[4:12])
            with table.lock:
                seg = table.segments.get(sid)
                # Under the write mutex no segment is created, so a file of no segment
                # now is still one; one that became a segment since the audit is kept.
                keep = (seg is None and table.known(sid)) or (
                    seg is not None and not seg.unlink_failed
                )
            if keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                self._io.unlink(seg.path if seg is not None else table.segdir / name)
            if seg is not None:
                table.forget(seg)
