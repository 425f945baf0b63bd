"""The disk tier: replicas framed and packed into large segment files.

Writes go to the active segment with aligned O_DIRECT ``pwritev`` where the filesystem
allows it (buffered I/O elsewhere): consecutive frames in one vectored call of up to
8 MiB, queued to the writer's I/O thread so that checksums and staging copies of the
next frames overlap the device. A batch is committed in this order: frames written,
segment fdatasync'ed, catalog rows inserted in one SQLite transaction, entries made
visible. Reads verify the frame header against the catalog row and the payload's
xxh3-128 before anything is handed out.

Concurrency: writers (stores, deletes, compaction, counters) are serialized by a write
mutex; the tier lock guards metadata only and is never held across a read, a write or
an fsync. Reads run in the caller's thread (plus helpers sharing ``io_depth``), so they
neither wait for a writer's I/O nor for each other; each pins the segments it reads, and
a segment emptied by deletes or compaction is unlinked when its last reader leaves.

Deleted replicas leave garbage in their segment. A segment whose last live replica goes
is unlinked at once; when space runs short, sealed segments with the most garbage are
compacted (live frames copied to the active segment, rows relocated in one transaction,
then the old file unlinked). The bytes compaction reads and writes are counted.

Open never deletes a byte that may hold committed data (docs/recovery.md): it refuses a
catalog SQLite finds damaged or one behind the superblock's generation (a lost
write-ahead log tail), then checks every row (its fields and row checksum, its
segment, its frame header; ``verify_on_open="full"`` also payloads). Rows that fail are
quarantined in the catalog (never served, reported once through
:meth:`DiskTier.take_lost`, deleted only by ``check(fix=True)``); segments holding them
are never reclaimed at runtime. Segment files no row names are moved to
``quarantine/`` (a zero-byte one, which holds no frame, is removed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np

from kvlife.core.errors import (
    InvalidArgument,
    StorePathError,
)
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.tiers.base import (
    AuditReport,
    CapacityShortfall,
    ChecksumsWrites,
    Durability,
    KeepsEdges,
    PersistsCounters,
    ReadResult,
    ReplicaMeta,
    ReportsLostReplicas,
    Reservation,
    SupportsAudit,
    SupportsBatchDelete,
    Tier,
)
from kvlife.tiers.buffers import (
    ALIGN,
    StagingPool,
)
from kvlife.tiers.disk.audit import check_frame
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.compaction import Compactor
from kvlife.tiers.disk.counters import DiskStats, LostReplicas
from kvlife.tiers.disk.fileio import FileIO, probe_direct_io
from kvlife.tiers.disk.frame import (
    frame_len,
)
from kvlife.tiers.disk.links import Links
from kvlife.tiers.disk.reader import Reader
from kvlife.tiers.disk.recovery import open_catalog, recover
from kvlife.tiers.disk.segments import SegmentTable, segment_files
from kvlife.tiers.disk.writer import Writer

MiB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """Settings of one disk tier."""

    capacity_bytes: int
    """Budget for segment files (live frames plus garbage awaiting reclaim)."""
    segment_bytes: int = 256 * MiB
    """Target size of a segment file; a larger frame gets a segment of its own."""
    direct_io: bool | None = None
    """Use O_DIRECT: None detects, True requires it, False never uses it."""
    verify_on_open: Literal["none", "header", "full"] = "header"
    """What recovery checks for each catalog row before serving it again."""
    io_depth: int = 4
    """Frames in flight per call: a writer's frames queued for its I/O thread; a
    reader's frames read at once by its own thread and helpers."""
    read_pool_bytes: int = 1 << 30
    """Most idle memory kept warm for reads into new arrays (recycled when the arrays
    are garbage collected; never more than was handed out at once). 0 disables."""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise InvalidArgument(f"disk capacity must be > 0 bytes, got {self.capacity_bytes}")
        if self.segment_bytes < ALIGN or self.segment_bytes % ALIGN:
            raise InvalidArgument(
                f"segment_bytes must be a positive multiple of {ALIGN}, got {self.segment_bytes}"
            )
        if self.verify_on_open not in ("none", "header", "full"):
            raise InvalidArgument(f"verify_on_open {self.verify_on_open!r} is not none/header/full")
        if self.io_depth < 1:
            raise InvalidArgument(f"io_depth must be >= 1, got {self.io_depth}")
        if self.read_pool_bytes < 0:
            raise InvalidArgument(f"read_pool_bytes must be >= 0, got {self.read_pool_bytes}")


CheckReport = AuditReport
"""The disk tier's audit result (the capability's report type)."""


class DiskTier(
    Tier,
    SupportsBatchDelete,
    SupportsAudit,
    ReportsLostReplicas,
    PersistsCounters,
    KeepsEdges,
    ChecksumsWrites,
):
    """Segment files plus a SQLite catalog under one directory."""

    def __init__(
        self,
        directory: str | Path,
        config: DiskTierConfig,
        *,
        name: str = "disk",
        fileio: FileIO | None = None,
    ) -> None:
        self.name = TierName(name)
        self.durability = Durability.DURABLE
        self.config = config
        self.capacity_bytes = config.capacity_bytes
        self.directory = Path(directory)
        self._segdir = self.directory / "segments"
        try:
            self._segdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorePathError(
                f"cannot create disk tier directory {self._segdir}: {exc}"
            ) from exc
        direct = config.direct_io
        if direct is None:
            direct = probe_direct_io(self._segdir)
        elif direct and not probe_direct_io(self._segdir):
            raise StorePathError(f"{self._segdir} does not support O_DIRECT (direct_io=True)")
        self.direct_io = direct
        self.io = fileio if fileio is not None else FileIO(direct)
        self.io.direct = direct
        self.stats = DiskStats()
        self._table = SegmentTable(
            self.name, self._segdir, self.io, config.segment_bytes, self.stats
        )
        self._lock = self._table.lock
        self._lost = LostReplicas()
        self._staging = StagingPool(keep=config.io_depth + 1)
        self._write_mutex = threading.RLock()  # check --fix deletes while holding it
        self._closed = False
        self.quarantine_dir = self.directory / "quarantine"
        self.catalog, self.superblock = open_catalog(self.directory, self._segdir, self.io)
        self._links = Links(self.catalog, self._lock)
        self._reader = Reader(
            self.name,
            self._table,
            self.io,
            self._staging,
            config.io_depth,
            config.read_pool_bytes,
            self.stats,
        )
        self._compactor = Compactor(
            self._table, self.catalog, self.io, self.capacity_bytes, self.stats, self._lost
        )
        self._writer = Writer(
            self.name,
            self._table,
            self.catalog,
            self._links,
            self.io,
            self._staging,
            config.io_depth,
            self.stats,
        )
        try:
            recover(
                self._table,
                self.catalog,
                self.io,
                verify=config.verify_on_open,
                quarantine_dir=self.quarantine_dir,
                stats=self.stats,
                lost=self._lost,
            )
            self._links.load()
            self._table.roll()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ capacity

    @property
    def used_bytes(self) -> int:
        return self._table.used_bytes()

    def footprint(self, nbytes: int) -> int:
        return frame_len(nbytes)

    @property
    def segment_count(self) -> int:
        return len(self._table.segments)

    @property
    def live_bytes(self) -> int:
        return self._table.live_bytes()

    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        need = sum(frame_len(m.nbytes) for m in metas)
        with self._write_mutex:  # compaction writes: one writer at a time
            with self._lock:
                fits = self.used_bytes + need <= self.capacity_bytes
                short = self.live_bytes + self._table.reserved + need - self.capacity_bytes
            if not fits:
                if short > 0:
                    return CapacityShortfall(short)
                self._compactor.make_room(need)
            with self._lock:
                if self.used_bytes + need > self.capacity_bytes:
                    return CapacityShortfall(self.used_bytes + need - self.capacity_bytes)
                self._table.reserved += need
        return Reservation(self.name, list(metas), need)

    def cancel_store(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.done:
                self._table.reserved -= reservation.nbytes
                reservation.done = True

    # ------------------------------------------------------------------ writes

    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        with self._write_mutex:
            self._writer.commit(reservation, payloads)

    # ------------------------------------------------------------------ reads

    def contains(self, key: ChunkKey) -> bool:
        return key in self._table.rows

    def meta(self, key: ChunkKey) -> ReplicaMeta:
        row = self._row(key)
        return ReplicaMeta(
            ChunkKey(row.key),
            row.dtype,
            row.shape,
            row.transform,
            row.info,
            row.checksum,
            row.form,
            born=row.born,
        )

    def _row(self, key: ChunkKey) -> CatalogRow:
        return self._table.row(key)

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        return self._reader.read_batch(keys, outs)

    # ------------------------------------------------------------------ deletes and reclaim

    def delete(self, key: ChunkKey) -> int:
        return self.delete_batch([key])[0]

    def delete_batch(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Delete replicas in one catalog transaction; returns payload bytes per key.

        Until the rows leave the in-memory index a concurrent reader may still read
        them; their bytes stay intact until the segment is unlinked, which waits for
        its readers.
        """
        return self.delete_forgetting(keys, ())

    def delete_forgetting(self, keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        with self._write_mutex:
            return self._writer.delete(keys, forget)

    # ------------------------------------------------------------------ audit

    def _check_row(self, row: CatalogRow, *, full: bool, header: bool) -> str:
        seg = self._table.segments.get(row.seg)
        if seg is None:
            return check_frame(row, None, 0, self.io)
        return check_frame(row, seg.fd, seg.length, self.io, header=header, full=full)

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> CheckReport:
        """Audit the catalog (SQLite integrity, generation against the superblock), every
        row against its frame (payload checksums included), the quarantined rows, and
        list segment files no row refers to and files in quarantine/.

        The audit runs beside serving: the catalog is read through a second, read-only
        connection (a snapshot, under WAL), rows are checked one segment at a time with
        that segment pinned (as a read pins it), and the tier lock is held only to list
        rows and to pin or unpin; neither it nor the write mutex is held across a read.
        A row deleted or moved while it was checked is not reported.

        With ``fix`` (under the write mutex, after the audit): drop bad rows that are
        still the ones checked, and quarantined rows, delete orphan segments and the
        quarantined files, rebuild damaged indexes, rewrite a damaged superblock copy;
        ``report.actions`` says what was done. ``progress`` is called with each
        replica's byte count as it is checked."""
        report = CheckReport()
        with self.catalog.snapshot() as snap:
            integrity = snap.integrity()
            quarantined = snap.quarantined()
        report.problems.extend(f"catalog integrity: {m}" for m in integrity)
        with self.catalog.settled() as generation:
            state = self.superblock.reread()
        report.generation = generation
        report.problems.extend(f"superblock {p}" for p in state.problems)
        if state.generation is not None and state.generation != generation:
            report.problems.append(
                f"superblock generation {state.generation}, catalog {generation}"
            )
        files = segment_files(self._segdir)
        with self._lock:
            rows = list(self._table.rows.values())
        by_seg: dict[int, list[CatalogRow]] = {}
        for row in rows:
            by_seg.setdefault(row.seg, []).append(row)
        bad: dict[ChunkKey, CatalogRow] = {}
        for sid, seg_rows in sorted(by_seg.items()):
            for row, problem in self._check_segment(sid, seg_rows, progress):
                report.rows += 1
                if not problem:
                    report.ok += 1
                    continue
                report.problems.append(
                    f"{row.key.hex()[:16]}… seg-{row.seg:08d}@{row.off}: {problem}"
                )
                report.bad_keys.append(row.key)
                bad[ChunkKey(row.key)] = row
        report.quarantined.extend(f"{k.hex()[:16]}…: {why}" for _, k, why in quarantined)
        with self._lock:
            for sid, path in sorted(files.items()):
                seg = self._table.segments.get(sid)
                if seg is None and sid not in self._table.held and path.exists():
                    report.orphan_segments.append(path.name)  # no segment of this tier
                elif seg is not None and seg.unlink_failed:
                    report.orphan_segments.append(path.name)  # emptied, its unlink failed
        report.quarantined_files.extend(self._quarantine_files())
        if fix:
            with self._write_mutex:
                self._fix(report, integrity, [rowid for rowid, _, _ in quarantined], bad)
        return report

    def _check_segment(
        self,
        sid: int,
        rows: list[CatalogRow],
        progress: Callable[[int], object] | None,
    ) -> list[tuple[CatalogRow, str]]:
        """Check the rows of one segment with the segment pinned; returns each row that
        is still current afterwards with its problem (empty: it verified)."""
        with self._lock:
            seg = self._table.pin(sid)
        if seg is None:
            return []  # emptied since the rows were listed: they moved or went
        found: list[tuple[CatalogRow, str]] = []
        try:
            for row in rows:
                if progress is not None:
                    progress(row.nbytes)
                found.append((row, self._check_row(row, full=True, header=True)))
        finally:
            with self._lock:
                retired = self._table.unpin([seg])
                # a row deleted or moved meanwhile is not the store's to report any more
                rows_now = self._table.rows
                current = [(r, p) for r, p in found if rows_now.get(ChunkKey(r.key)) is r]
            self._table.remove(retired, quiet=True)
        return current

    def _quarantine_files(self) -> list[str]:
        try:
            return sorted(p.name for p in self.quarantine_dir.iterdir() if p.is_file())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorePathError(f"cannot list {self.quarantine_dir}: {exc}") from exc

    def _fix(
        self,
        report: CheckReport,
        integrity: list[str],
        rowids: list[int],
        bad: dict[ChunkKey, CatalogRow],
    ) -> None:
        """Repair what the audit found (under the write mutex: no writer runs)."""
        if integrity:
            self.catalog.reindex()
            report.actions.append("rebuilt the catalog's indexes")
        with self._lock:  # only rows still as checked: a key written again since is new
            doomed = [k for k, row in bad.items() if self._table.rows.get(k) is row]
            for key in doomed:
                self._lost.add(key, "dropped by check --fix")
        if doomed:
            self.delete_batch(doomed)
            report.actions.append(f"dropped {len(doomed)} bad replicas")
        if rowids:
            self.catalog.delete_quarantined(rowids)  # counted when they were quarantined
            report.actions.append(f"deleted {len(rowids)} quarantined catalog rows")
            table = self._table
            with self._lock:
                held, table.held = table.held, {}
            for sid in held:
                seg = table.segments.get(sid)
                if seg is not None and seg.live == 0 and seg is not table.active:
                    table.unlink(seg)
        for name in report.orphan_segments:
            sid = int(name[4:12])
            seg = self._table.segments.get(sid)
            with contextlib.suppress(FileNotFoundError):
                self.io.unlink(seg.path if seg is not None else self._segdir / name)
            if seg is not None:
                with self._lock:
                    if self._table.segments.get(sid) is seg:
                        del self._table.segments[sid]
                        self.stats.segments_reclaimed += 1
        if report.orphan_segments:
            report.actions.append(f"deleted {len(report.orphan_segments)} orphan segments")
        for name in report.quarantined_files:
            with contextlib.suppress(FileNotFoundError):
                self.io.unlink(self.quarantine_dir / name)
        if report.quarantined_files:
            report.actions.append(f"deleted {len(report.quarantined_files)} quarantined files")
            with contextlib.suppress(OSError):  # left if something else was put there
                self.quarantine_dir.rmdir()
        if None in self.superblock.read().generations or (
            self.superblock.read().generation != self.catalog.generation
        ):
            self.superblock.write_both(self.catalog.generation)
            report.actions.append(f"rewrote the superblock at generation {self.catalog.generation}")
        report.fixed = True

    def details(self) -> dict[str, object]:
        return {
            "direct_io": self.direct_io,
            "live_bytes": self.live_bytes,
            "segments": self.segment_count,
            **asdict(self.stats),
        }

    def kept_parent(self, child: bytes) -> bytes | None:
        return self._links.parent(child)

    def keep_edges(self, links: Sequence[tuple[bytes, bytes]]) -> None:
        with self._write_mutex:
            self._links.keep(links)

    def load_edges(self) -> list[tuple[bytes, bytes]]:
        return self._links.all()

    def forget_edges(self, children: Sequence[bytes]) -> None:
        with self._write_mutex:
            self._links.forget(children)

    def load_counters(self) -> dict[str, int]:
        with self._write_mutex:  # the catalog connection is not read mid-transaction
            return self.catalog.load_counters()

    def save_counters(self, counters: dict[str, int]) -> None:
        with self._write_mutex:  # one catalog transaction at a time
            self.catalog.save_counters(counters)

    def take_lost(self) -> list[tuple[ChunkKey, str]]:
        """Replicas this tier dropped on its own (recovery, compaction, check), with why."""
        return self._lost.take()

    def replica_keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._table.rows)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # The rest outside the tier lock: it waits for the I/O thread and does file I/O.
        self._writer.close()
        self._reader.close()
        self._table.close()
        self.catalog.close()
        self.superblock.close()
