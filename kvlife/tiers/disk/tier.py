"""The disk tier (:class:`DiskTier`): replicas framed and packed into large segment
files, with a crash-safe SQLite catalog, under one directory.

The tier implements the :class:`~kvlife.tiers.base.Tier` interface and its capability
interfaces by composing rooms that each do one job:

- :mod:`~kvlife.tiers.disk.segments`: the segment table (segment files, the row of every
  served replica, reserved bytes) and the tier lock that guards it; pins, retirement,
  unlinks deferred to a segment's last reader;
- :mod:`~kvlife.tiers.disk.writer`: frames and the commit protocol (frames written,
  segments fdatasync'ed, rows cataloged, then published), and deletes;
- :mod:`~kvlife.tiers.disk.reader`: verified reads beside one writer;
- :mod:`~kvlife.tiers.disk.compaction`: the space of deleted replicas back;
- :mod:`~kvlife.tiers.disk.recovery`: open (the catalog against the superblock, every
  row checked, what fails quarantined, never deleted);
- :mod:`~kvlife.tiers.disk.audit`: the one audit, of a closed store (``kvlife check``)
  and of this open tier (:meth:`DiskTier.check`) alike;
  :mod:`~kvlife.tiers.disk.repair`: ``check --fix``;
- :mod:`~kvlife.tiers.disk.links`: the prefix links the tier keeps;
- :mod:`~kvlife.tiers.disk.counters`: byte and event counters, lost-replica reports;
- and the formats and seams under them: :mod:`~kvlife.tiers.disk.catalog`,
  :mod:`~kvlife.tiers.disk.superblock`, :mod:`~kvlife.tiers.disk.frame`,
  :mod:`~kvlife.tiers.disk.fileio`.

Locks. Writers (stores and their compaction, deletes, kept links, counters, the repairs
of ``check --fix``) take the write mutex, one at a time, and hold it across their I/O.
The tier lock guards in-memory metadata only: looking rows up, pinning and unpinning
segments, placing a frame, publishing, counting. It is never held across a system call
on a file: no read, write, fsync, file creation or unlink, and no read of an audit. A
read therefore never waits for another thread's I/O, and an audit (which takes neither
lock across its reads) never blocks serving. The catalog's own transaction lock is
never taken under the tier lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from kvlife.core.errors import InvalidArgument, StorePathError
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.tiers.base import (
    AuditReport,
    CapacityShortfall,
    ChecksumsWrites,
    Durability,
    KeepsEdges,
    PersistsCounters,
    PipelinedReads,
    ReadResult,
    ReplicaMeta,
    ReportsLostReplicas,
    Reservation,
    SupportsAudit,
    SupportsBatchDelete,
    Tier,
)
from kvlife.tiers.buffers import ALIGN, StagingPool
from kvlife.tiers.disk.audit import TierSource, audit
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.compaction import Compactor
from kvlife.tiers.disk.counters import DiskStats, LostReplicas
from kvlife.tiers.disk.fileio import FileIO, probe_direct_io
from kvlife.tiers.disk.frame import frame_room
from kvlife.tiers.disk.links import Links
from kvlife.tiers.disk.reader import Reader
from kvlife.tiers.disk.recovery import open_catalog, recover
from kvlife.tiers.disk.repair import Repairs
from kvlife.tiers.disk.segments import SegmentTable, segment_name
from kvlife.tiers.disk.writer import Writer

MiB = 1 << 20


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


class DiskTier(
    Tier,
    SupportsBatchDelete,
    SupportsAudit,
    ReportsLostReplicas,
    PersistsCounters,
    KeepsEdges,
    ChecksumsWrites,
    PipelinedReads,
):
    """Segment files plus a SQLite catalog under one directory (the module docstring
    says how it is built and what its locks guard)."""

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
        self._segdir_abs = ""
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
        self._write_mutex = threading.RLock()
        """One writer at a time, held across its I/O (reentrant: check --fix deletes)."""
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
        self._audit_source = TierSource(
            self.directory, self.io, self._table, self.catalog, self.superblock
        )
        self._repairs = Repairs(
            self._table,
            self.catalog,
            self.superblock,
            self._writer,
            self.io,
            self.quarantine_dir,
            self._lost,
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
        return frame_room(nbytes)

    @property
    def segment_count(self) -> int:
        return len(self._table.segments)

    @property
    def live_bytes(self) -> int:
        return self._table.live_bytes()

    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        need = sum(frame_room(m.nbytes) for m in metas)
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
        row = self._table.row(key)
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

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        return self._reader.read_batch(keys, outs)

    def read_pipelined(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[np.ndarray | None],
        done: Callable[[int, ReadResult], None],
        proceed: Callable[[], bool] | None = None,
    ) -> int:
        """Reads back to back in this thread, each verified on a helper meanwhile
        (:meth:`Reader.read_pipelined <kvlife.tiers.disk.reader.Reader.read_pipelined>`)."""
        return self._reader.read_pipelined(keys, outs, done, proceed)

    def reads_runs_natively(self) -> bool:
        return self._reader.native()

    def frame_rows(self, keys: Sequence[ChunkKey]) -> list[CatalogRow | None]:
        """The row of each key's frame as it is now (None: no replica here): where a
        reader outside the tier finds the frame and what it must verify to (rows are
        replaced, never changed: one handed out stays what it was)."""
        with self._lock:
            return [self._table.rows.get(k) for k in keys]

    def segment_path(self, sid: int) -> Path:
        """The file of segment ``sid``, an absolute path (a store opened by a relative
        one is named to readers in other directories; it may be gone by the time it is
        opened)."""
        return self._segdir.absolute() / segment_name(sid)

    def segment_file(self, sid: int) -> str:
        """:meth:`segment_path` as a string, its directory made absolute once (a load
        names its frames' files in the server's hot path: two path objects each cost
        10-20 µs there)."""
        if not self._segdir_abs:
            self._segdir_abs = str(self._segdir.absolute())
        return f"{self._segdir_abs}/{segment_name(sid)}"

    # ------------------------------------------------------------------ deletes and reclaim

    def delete(self, key: ChunkKey) -> int:
        return self.delete_batch([key])[0]

    def delete_batch(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Delete replicas in one catalog transaction; returns payload bytes per key.

        Until the rows leave the segment table a concurrent reader may still read
        them; their bytes stay intact until the segment is unlinked, which waits for
        its readers.
        """
        return self.delete_forgetting(keys, ())

    def delete_forgetting(self, keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        with self._write_mutex:
            return self._writer.delete(keys, forget)

    # ------------------------------------------------------------------ audit

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> AuditReport:
        """The disk audit (:mod:`kvlife.tiers.disk.audit`) of this open tier, beside
        serving; with ``fix``, then the repairs (:mod:`kvlife.tiers.disk.repair`) under
        the write mutex. ``progress`` is called with each replica's byte count as it is
        checked."""
        found = audit(self._audit_source, progress)
        if fix:
            with self._write_mutex:
                self._repairs.fix(found)
        return found.report

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
