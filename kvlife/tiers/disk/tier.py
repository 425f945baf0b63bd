"""The disk tier: replicas framed and packed into large segment files.

Writes go to the active segment with aligned O_DIRECT ``pwritev`` where the filesystem
allows it (buffered I/O elsewhere), pipelined through one I/O thread so that checksums
and staging copies overlap the device. A batch is committed in this order: frames
written, segment fdatasync'ed, catalog rows inserted in one SQLite transaction, entries
made visible. Reads verify the frame header against the catalog row and the payload's
xxh3-128 before anything is handed out.

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
import errno
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np

from kvlife.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    ReplicaNotFound,
    ReplicaReadError,
    StorageFullError,
    StorePathError,
)
from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import (
    AuditReport,
    CapacityShortfall,
    Durability,
    PersistsCounters,
    ReadResult,
    ReplicaMeta,
    ReportsLostReplicas,
    Reservation,
    SupportsAudit,
    SupportsBatchDelete,
    Tier,
    TierName,
    check_payloads,
)
from kvlife.tiers.buffers import (
    ALIGN,
    StagingPool,
    aligned_empty,
    aligned_runs,
    is_aligned,
    prefault,
)
from kvlife.tiers.disk.catalog import Catalog, CatalogCorrupt, CatalogMissing, CatalogRow
from kvlife.tiers.disk.fileio import FileIO, probe_direct_io
from kvlife.tiers.disk.frame import (
    HEADER_BYTES,
    FrameError,
    FrameHeader,
    frame_len,
    pack_header,
    parts_checksum,
    payload_checksum,
    unpack_header,
    verify_frame,
)
from kvlife.tiers.disk.superblock import FILE_NAME as SUPERBLOCK_FILE
from kvlife.tiers.disk.superblock import CatalogRolledBack, Superblock, SuperblockError

MiB = 1 << 20
_SEG_RE = re.compile(r"^seg-(\d{8})\.kvs$")
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
    """Frames in flight between the caller's thread and the I/O thread."""

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


@dataclass(slots=True)
class _Segment:
    id: int
    path: Path
    fd: int
    length: int
    live: int = 0


@dataclass(slots=True)
class _PendingRead:
    future: Future[int]
    row: CatalogRow
    header: np.ndarray
    """Buffer whose first HEADER_BYTES receive the frame header."""
    payload: list[np.ndarray]
    """uint8 views that receive the payload, in order."""
    out: np.ndarray | None
    """Caller's buffer (filled in place or by copy), None for a new array."""
    staged: np.ndarray | None
    """Staging buffer to give back to the pool."""


@dataclass(slots=True)
class DiskStats:
    """Byte and event counters of a disk tier since it was opened."""

    frames_written: int = 0
    bytes_written: int = 0
    payload_bytes_written: int = 0
    bytes_read: int = 0
    compaction_bytes_read: int = 0
    compaction_bytes_written: int = 0
    segments_reclaimed: int = 0
    recovered: int = 0
    recovery_dropped: int = 0
    """Rows this open found bad and quarantined (each reported once by take_lost)."""
    rows_quarantined: int = 0
    """Quarantined rows in the catalog at open (not served; ``check --fix`` deletes them)."""
    segments_quarantined: int = 0
    """Unreferenced segment files this open moved to ``quarantine/``."""


CheckReport = AuditReport
"""The disk tier's audit result (the capability's report type)."""


class DiskTier(Tier, SupportsBatchDelete, SupportsAudit, ReportsLostReplicas, PersistsCounters):
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
        self._lock = threading.RLock()
        self._entries: dict[ChunkKey, CatalogRow] = {}
        self._segments: dict[int, _Segment] = {}
        self._reserved = 0
        self._lost: list[tuple[ChunkKey, str]] = []
        self._dir_dirty = False
        self._pool: ThreadPoolExecutor | None = None
        self._staging = StagingPool(keep=config.io_depth + 1)
        self._closed = False
        self._pinned: dict[int, int] = {}
        """Segments that hold quarantined rows (how many): never reclaimed at runtime."""
        self.quarantine_dir = self.directory / "quarantine"
        self._sid_floor = 0
        """Highest segment id seen at open: a new segment never reuses a set-aside name."""
        catalog_path = self.directory / "catalog.sqlite"
        has_data = any(size > 0 for size in self._segment_sizes().values())
        if has_data and not catalog_path.exists():
            raise CatalogMissing(catalog_path, self._segdir)
        self.superblock = Superblock(self.directory / SUPERBLOCK_FILE, self.io)
        try:
            self.catalog = Catalog(
                catalog_path,
                create=not has_data,
                superblock=self.superblock,
                initial_generation=self.superblock.read().generation or 0,
            )
        except BaseException:
            self.superblock.close()
            raise
        try:
            self._check_catalog()
            self._recover()
            self._active = self._new_segment()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ capacity

    @property
    def used_bytes(self) -> int:
        return sum(s.length for s in self._segments.values()) + self._reserved

    def footprint(self, nbytes: int) -> int:
        return frame_len(nbytes)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def live_bytes(self) -> int:
        return sum(s.live for s in self._segments.values())

    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        need = sum(frame_len(m.nbytes) for m in metas)
        with self._lock:
            if self.used_bytes + need > self.capacity_bytes:
                short = self.live_bytes + self._reserved + need - self.capacity_bytes
                if short > 0:
                    return CapacityShortfall(short)
                self._compact(need)
                if self.used_bytes + need > self.capacity_bytes:
                    return CapacityShortfall(self.used_bytes + need - self.capacity_bytes)
            self._reserved += need
        return Reservation(self.name, list(metas), need)

    def cancel_store(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.done:
                self._reserved -= reservation.nbytes
                reservation.done = True

    # ------------------------------------------------------------------ writes

    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        with self._lock:
            try:
                check_payloads(reservation.metas, payloads)
                rows = self._write_frames(reservation.metas, payloads)
            finally:
                self._reserved -= reservation.nbytes
                reservation.done = True
            for row in rows:
                old = self._entries.pop(ChunkKey(row.key), None)
                if old is not None:
                    self._drop_live(old)
                self._entries[ChunkKey(row.key)] = row
                self._segments[row.seg].live += frame_len(row.nbytes)

    def _write_frames(
        self, metas: Sequence[ReplicaMeta], payloads: Sequence[np.ndarray]
    ) -> list[CatalogRow]:
        """Write frames, fdatasync, insert rows; on failure roll the segment tail back."""
        start = {sid: s.length for sid, s in self._segments.items()}
        rows: list[CatalogRow] = []
        touched: set[int] = set()
        inflight: list[tuple[Future[int], int, np.ndarray | None]] = []
        try:
            for meta, arr in zip(metas, payloads, strict=True):
                u8 = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                flen = frame_len(u8.nbytes)
                seg = self._segment_for(flen)
                start.setdefault(seg.id, 0)
                off = seg.length
                seg.length += flen
                touched.add(seg.id)
                checksum = payload_checksum(u8)
                header = FrameHeader(
                    meta.key, u8.nbytes, checksum, meta.dtype, meta.shape, meta.transform
                )
                bufs, staged = self._frame_buffers(header, u8, flen)
                fut = self._submit(self.io.pwritev, seg.fd, bufs, off)
                inflight.append((fut, flen, staged))
                if len(inflight) >= self.config.io_depth:
                    self._finish_write(*inflight.pop(0))
                rows.append(
                    CatalogRow(
                        meta.key,
                        seg.id,
                        off,
                        u8.nbytes,
                        checksum,
                        meta.dtype,
                        meta.shape,
                        meta.transform,
                        meta.info,
                    )
                )
            while inflight:
                self._finish_write(*inflight.pop(0))
            for sid in sorted(touched):
                self.io.fdatasync(self._segments[sid].fd)
            self._sync_dir()
            self.catalog.insert(rows)
        except BaseException as exc:
            for fut, _, staged in inflight:
                fut.exception()
                if staged is not None:
                    self._staging.put(staged)
            for sid, length in start.items():
                if sid in self._segments:
                    self._segments[sid].length = length
            if isinstance(exc, OSError):
                raise _os_error(exc, f"writing {len(metas)} replicas to {self._segdir}") from exc
            raise
        self.stats.frames_written += len(rows)
        self.stats.bytes_written += sum(frame_len(r.nbytes) for r in rows)
        self.stats.payload_bytes_written += sum(r.nbytes for r in rows)
        return rows

    def _frame_buffers(
        self, header: FrameHeader, u8: np.ndarray, flen: int
    ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Buffers for one frame: a header page + the caller's payload when that is aligned,
        else one staged copy of the whole frame (returned second, to give back later)."""
        if is_aligned(u8):
            hdr = aligned_empty(HEADER_BYTES)
            pack_header(header, hdr.data)
            return [hdr, u8], None
        staged = self._staging.get(flen)
        frame = staged[:flen]
        pack_header(header, frame.data)
        n = u8.nbytes
        np.copyto(frame[HEADER_BYTES : HEADER_BYTES + n], u8)
        frame[HEADER_BYTES + n :] = 0
        return [frame], staged

    def _finish_write(self, fut: Future[int], flen: int, staged: np.ndarray | None) -> None:
        try:
            written = fut.result()
        finally:
            if staged is not None:
                self._staging.put(staged)
        if written != flen:
            raise OSError(errno.EIO, f"short write: {written} of {flen} bytes")

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlife-io")
        return self._pool.submit(fn, *args)

    def _segment_for(self, flen: int) -> _Segment:
        seg = self._active
        if seg.length > 0 and seg.length + flen > self.config.segment_bytes:
            self._active = seg = self._new_segment()
        return seg

    def _new_segment(self) -> _Segment:
        sid = max(max(self._segments, default=0), self._sid_floor) + 1
        path = self._segdir / f"seg-{sid:08d}.kvs"
        try:
            fd = self.io.open(path, create=True)
            self.io.truncate(fd, 0)
        except OSError as exc:
            raise _os_error(exc, f"creating segment {path}") from exc
        seg = _Segment(sid, path, fd, 0)
        self._segments[sid] = seg
        self._dir_dirty = True  # made durable by the next commit, before any row names it
        return seg

    def _sync_dir(self) -> None:
        if self._dir_dirty:
            self.io.fsync_dir(self._segdir)
            self._dir_dirty = False

    # ------------------------------------------------------------------ reads

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def meta(self, key: ChunkKey) -> ReplicaMeta:
        row = self._row(key)
        return ReplicaMeta(ChunkKey(row.key), row.dtype, row.shape, row.transform, row.info)

    def _row(self, key: ChunkKey) -> CatalogRow:
        row = self._entries.get(key)
        if row is None:
            raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
        return row

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        with self._lock:
            rows = [self._row(k) for k in keys]
            results: list[ReadResult] = []
            inflight: list[_PendingRead] = []
            for i, row in enumerate(rows):
                inflight.append(self._start_read(row, outs[i] if outs is not None else None))
                if len(inflight) >= self.config.io_depth:
                    results.append(self._finish_read(inflight.pop(0)))
            while inflight:
                results.append(self._finish_read(inflight.pop(0)))
            return results

    def _start_read(self, row: CatalogRow, out: np.ndarray | None) -> _PendingRead:
        """Issue one frame read: straight into ``out`` when it is aligned, else into a
        staging buffer (then copied) or, without ``out``, into a new aligned array."""
        seg = self._segments[row.seg]
        if out is not None:
            if out.shape != row.shape or out.dtype != np.dtype(row.dtype):
                raise InvalidArgument(
                    f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
                    f"{row.dtype}{list(row.shape)}"
                )
            runs = aligned_runs(out)
            if runs is not None:  # straight into the caller's memory, even if strided
                hdr = aligned_empty(HEADER_BYTES)
                fut = self._submit(self.io.preadv, seg.fd, [hdr, *runs], row.off)
                return _PendingRead(fut, row, hdr, runs, out, None)
        flen = frame_len(row.nbytes)
        if out is not None:
            staged = self._staging.get(flen)
        else:
            staged = aligned_empty(flen)
            prefault(staged)
        frame = staged[:flen]
        fut = self._submit(self.io.preadv, seg.fd, [frame], row.off)
        payload = frame[HEADER_BYTES : HEADER_BYTES + row.nbytes]
        return _PendingRead(fut, row, frame, [payload], out, staged if out is not None else None)

    def _finish_read(self, p: _PendingRead) -> ReadResult:
        row = p.row
        where = f"{self.name} seg-{row.seg:08d}@{row.off}"
        try:
            try:
                got = p.future.result()
            except OSError as exc:
                return ReplicaReadError(row.key.hex(), where, str(exc))
            need = HEADER_BYTES + row.nbytes
            if got < need:
                return ChecksumMismatch(row.key.hex(), where, f"truncated: {got} of {need} bytes")
            self.stats.bytes_read += got
            problem = self._verify(row, p.header.data[:HEADER_BYTES], p.payload)
            if problem:
                return ChecksumMismatch(row.key.hex(), where, problem)
            if p.out is None:
                return p.payload[0].view(np.dtype(row.dtype)).reshape(row.shape)
            if p.staged is not None:
                np.copyto(p.out, p.payload[0].view(np.dtype(row.dtype)).reshape(row.shape))
            return p.out
        finally:
            if p.staged is not None:
                self._staging.put(p.staged)

    @staticmethod
    def _verify(row: CatalogRow, hdr: memoryview, payload: list[np.ndarray] | None) -> str:
        """Empty string if the frame matches its row, else what is wrong."""
        try:
            h = unpack_header(hdr)
        except FrameError as exc:
            return f"header: {exc}"
        if h.key != row.key:
            return "header names another key"
        if h.payload_len != row.nbytes or h.checksum != row.checksum:
            return "header disagrees with the catalog"
        if payload is not None and parts_checksum(payload) != row.checksum:
            return "payload checksum mismatch"
        return ""

    # ------------------------------------------------------------------ deletes and reclaim

    def delete(self, key: ChunkKey) -> int:
        return self.delete_batch([key])[0]

    def delete_batch(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Delete replicas in one catalog transaction; returns payload bytes per key."""
        with self._lock:
            rows = [self._row(k) for k in keys]
            self.catalog.delete([r.key for r in rows])
            for row in rows:
                del self._entries[ChunkKey(row.key)]
                self._drop_live(row)
            return [r.nbytes for r in rows]

    def _drop_live(self, row: CatalogRow) -> None:
        seg = self._segments[row.seg]
        seg.live -= frame_len(row.nbytes)
        if seg.live == 0 and seg is not self._active and seg.id not in self._pinned:
            self._unlink_segment(seg)

    def _unlink_segment(self, seg: _Segment) -> None:
        self.io.close(seg.fd)
        self.io.unlink(seg.path)
        del self._segments[seg.id]
        self.stats.segments_reclaimed += 1

    def _compact(self, need: int) -> None:
        """Copy live frames out of the most wasteful sealed segments until ``need`` fits."""
        candidates = sorted(
            (
                s
                for s in self._segments.values()
                if s is not self._active and s.length > s.live and s.id not in self._pinned
            ),
            key=lambda s: s.live / max(s.length, 1),
        )
        for seg in candidates:
            if self.used_bytes + need <= self.capacity_bytes:
                return
            self._compact_segment(seg)

    def _compact_segment(self, seg: _Segment) -> None:
        start = {sid: s.length for sid, s in self._segments.items()}
        try:
            self._copy_live_frames(seg)
        except OSError as exc:
            for sid, length in start.items():  # the copies are garbage; rows still point home
                if sid in self._segments:
                    self._segments[sid].length = length
            raise _os_error(exc, f"compacting segment {seg.path.name}") from exc

    def _copy_live_frames(self, seg: _Segment) -> None:
        rows = sorted((r for r in self._entries.values() if r.seg == seg.id), key=lambda r: r.off)
        moves: list[tuple[bytes, int, int]] = []
        dropped: list[CatalogRow] = []
        touched: set[int] = set()
        for row in rows:
            flen = frame_len(row.nbytes)
            frame = aligned_empty(flen)
            got = self.io.preadv(seg.fd, [frame], row.off)
            self.stats.compaction_bytes_read += got
            problem = (
                f"truncated: {got} of {flen} bytes"
                if got < flen
                else self._verify(
                    row,
                    frame.data[:HEADER_BYTES],
                    [frame[HEADER_BYTES : HEADER_BYTES + row.nbytes]],
                )
            )
            if problem:
                dropped.append(row)
                self._lost.append((ChunkKey(row.key), f"corrupt: {problem} (found by compaction)"))
                continue
            dst = self._segment_for(flen)
            off = dst.length
            dst.length += flen
            self.io.pwritev(dst.fd, [frame], off)
            touched.add(dst.id)
            self.stats.compaction_bytes_written += flen
            moves.append((row.key, dst.id, off))
        for sid in touched:
            self.io.fdatasync(self._segments[sid].fd)
        self._sync_dir()
        self.catalog.relocate(moves)
        self.catalog.delete([r.key for r in dropped])
        for key, sid, off in moves:
            row = self._entries[ChunkKey(key)]
            row.seg, row.off = sid, off
            self._segments[sid].live += frame_len(row.nbytes)
        for row in dropped:
            del self._entries[ChunkKey(row.key)]
        seg.live = 0
        self._unlink_segment(seg)

    # ------------------------------------------------------------------ recovery and audit

    def _scan_segments(self) -> dict[int, Path]:
        found: dict[int, Path] = {}
        try:
            names = list(self._segdir.iterdir())
        except OSError as exc:
            raise StorePathError(f"cannot list segments in {self._segdir}: {exc}") from exc
        for p in names:
            m = _SEG_RE.match(p.name)
            if m:
                found[int(m.group(1))] = p
        return found

    def _segment_sizes(self) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for sid, path in self._scan_segments().items():
            try:
                sizes[sid] = path.stat().st_size
            except OSError as exc:
                raise StorePathError(f"cannot stat segment {path}: {exc}") from exc
        return sizes

    def _check_catalog(self) -> None:
        """Refuse a catalog SQLite finds damaged, or one older than the generation the
        superblock acknowledged (its write-ahead log lost committed deletions)."""
        cat = self.catalog
        problems = cat.integrity()
        if problems:
            raise CatalogCorrupt(cat.path, "integrity check: " + "; ".join(problems[:3]))
        state = self.superblock.read()
        have, acked = cat.generation, state.generation
        if acked is None:
            if have > 0:
                detail = "is missing" if not state.exists else "; ".join(state.problems)
                raise SuperblockError(self.superblock.path, detail)
            # Generation 0: no row was ever deleted, so there is nothing to roll back.
            self.superblock.write_both(0)
            return
        if have < acked:
            raise CatalogRolledBack(cat.path, have, acked)
        if have > acked:  # the process died between a commit and its superblock write
            self.superblock.write(have)
        if None in self.superblock.read().generations:
            self.superblock.write(have)  # restore the second copy

    def _recover(self) -> None:
        """Read the catalog and mark; delete nothing. Rows that fail (a field, the row
        checksum, the frame) are quarantined in the catalog and reported once through
        :meth:`take_lost`; segment files no row names are moved to ``quarantine/``."""
        for sid, path in sorted(self._scan_segments().items()):
            self._sid_floor = max(self._sid_floor, sid)
            try:
                fd = self.io.open(path, create=False)
            except OSError as exc:
                raise _os_error(exc, f"opening segment {path}") from exc
            self._segments[sid] = _Segment(sid, path, fd, self.io.size(fd))
        referenced: set[int] = set()
        marks: list[tuple[int, str]] = []
        for s in self.catalog.scan():
            if s.seg is not None:
                referenced.add(s.seg)
            problem = s.quarantine or s.problem
            if not problem and s.row is not None:
                problem = self._check_row(
                    s.row,
                    full=self.config.verify_on_open == "full",
                    header=self.config.verify_on_open != "none",
                )
            if problem:
                if s.seg is not None:
                    self._pinned[s.seg] = self._pinned.get(s.seg, 0) + 1
                if s.quarantine is None:  # found now: report it, once
                    marks.append((s.rowid, problem))
                    self._lost.append((ChunkKey(s.key), f"quarantined on open: {problem}"))
                continue
            assert s.row is not None
            self._entries[ChunkKey(s.row.key)] = s.row
            self._segments[s.row.seg].live += frame_len(s.row.nbytes)
        self.catalog.quarantine(marks)
        self.stats.recovered = len(self._entries)
        self.stats.recovery_dropped = len(marks)
        self.stats.rows_quarantined = sum(self._pinned.values())
        for seg in list(self._segments.values()):
            if seg.id not in referenced:
                self._set_aside(seg)

    def _set_aside(self, seg: _Segment) -> None:
        """Take a segment no row names out of the store: a zero-byte file (an active
        segment that never got a frame) is removed, any other is moved to quarantine/."""
        del self._segments[seg.id]
        try:
            self.io.close(seg.fd)
            if seg.length == 0:
                self.io.unlink(seg.path)
                return
            self.quarantine_dir.mkdir(exist_ok=True)
            dst = self.quarantine_dir / seg.path.name
            n = 0
            while dst.exists():
                n += 1
                dst = self.quarantine_dir / f"{seg.path.name}.{n}"
            self.io.rename(seg.path, dst)
            self.io.fsync_dir(self.quarantine_dir)
            self.io.fsync_dir(self._segdir)
        except OSError as exc:
            raise _os_error(exc, f"moving unreferenced segment {seg.path} to quarantine") from exc
        self.stats.segments_quarantined += 1

    def _check_row(self, row: CatalogRow, *, full: bool, header: bool) -> str:
        seg = self._segments.get(row.seg)
        if seg is None:
            return f"segment seg-{row.seg:08d} is missing"
        flen = frame_len(row.nbytes)
        if row.off % ALIGN or row.off + HEADER_BYTES + row.nbytes > seg.length:
            return f"frame at {row.off} (+{flen}) lies beyond the segment's {seg.length} bytes"
        if not header and not full:
            return ""
        buf = aligned_empty(flen if full else HEADER_BYTES)
        try:
            got = self.io.preadv(seg.fd, [buf], row.off)
        except OSError as exc:
            return f"read failed: {exc}"
        if got < (HEADER_BYTES + row.nbytes if full else HEADER_BYTES):
            return f"truncated: {got} bytes"
        payload = [buf[HEADER_BYTES : HEADER_BYTES + row.nbytes]] if full else None
        return verify_frame(
            buf.data[:HEADER_BYTES],
            payload,
            key=row.key,
            nbytes=row.nbytes,
            checksum=row.checksum,
            dtype=row.dtype,
            shape=row.shape,
            transform=row.transform,
        )

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> CheckReport:
        """Audit the catalog (SQLite integrity, generation against the superblock), every
        row against its frame (payload checksums included), the quarantined rows, and
        list segment files no row refers to and files in quarantine/.

        With ``fix``: drop bad and quarantined rows, delete orphan segments and the
        quarantined files, rebuild damaged indexes, rewrite a damaged superblock copy;
        ``report.actions`` says what was done. ``progress`` is called with each
        replica's byte count as it is checked."""
        report = CheckReport()
        with self._lock:
            cat = self.catalog
            report.generation = cat.generation
            integrity = cat.integrity()
            report.problems.extend(f"catalog integrity: {m}" for m in integrity)
            state = self.superblock.reread()
            report.problems.extend(f"superblock {p}" for p in state.problems)
            if state.generation is not None and state.generation != cat.generation:
                report.problems.append(
                    f"superblock generation {state.generation}, catalog {cat.generation}"
                )
            for row in list(self._entries.values()):
                if progress is not None:
                    progress(row.nbytes)
                report.rows += 1
                problem = self._check_row(row, full=True, header=True)
                if problem:
                    report.problems.append(
                        f"{row.key.hex()[:16]}… seg-{row.seg:08d}@{row.off}: {problem}"
                    )
                    report.bad_keys.append(row.key)
                else:
                    report.ok += 1
            quarantined = cat.quarantined()
            report.quarantined.extend(f"{k.hex()[:16]}…: {why}" for _, k, why in quarantined)
            referenced = {r.seg for r in self._entries.values()} | set(self._pinned)
            referenced.add(self._active.id)
            for sid, path in sorted(self._scan_segments().items()):
                if sid not in referenced:
                    report.orphan_segments.append(path.name)
            report.quarantined_files.extend(self._quarantine_files())
            if fix:
                self._fix(report, integrity, [rowid for rowid, _, _ in quarantined])
        return report

    def _quarantine_files(self) -> list[str]:
        try:
            return sorted(p.name for p in self.quarantine_dir.iterdir() if p.is_file())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorePathError(f"cannot list {self.quarantine_dir}: {exc}") from exc

    def _fix(self, report: CheckReport, integrity: list[str], rowids: list[int]) -> None:
        if integrity:
            self.catalog.reindex()
            report.actions.append("rebuilt the catalog's indexes")
        if report.bad_keys:
            for key in report.bad_keys:
                self._lost.append((ChunkKey(key), "dropped by check --fix"))
            self.delete_batch([ChunkKey(k) for k in report.bad_keys])
            report.actions.append(f"dropped {len(report.bad_keys)} bad replicas")
        if rowids:
            self.catalog.delete_quarantined(rowids)  # counted when they were quarantined
            report.actions.append(f"deleted {len(rowids)} quarantined catalog rows")
            pinned, self._pinned = self._pinned, {}
            for sid in pinned:
                seg = self._segments.get(sid)
                if seg is not None and seg.live == 0 and seg is not self._active:
                    self._unlink_segment(seg)
        for name in report.orphan_segments:
            sid = int(name[4:12])
            seg = self._segments.get(sid)
            if seg is not None:
                self._unlink_segment(seg)
            else:
                self.io.unlink(self._segdir / name)
        if report.orphan_segments:
            report.actions.append(f"deleted {len(report.orphan_segments)} orphan segments")
        for name in report.quarantined_files:
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

    def load_counters(self) -> dict[str, int]:
        return self.catalog.load_counters()

    def save_counters(self, counters: dict[str, int]) -> None:
        self.catalog.save_counters(counters)

    def take_lost(self) -> list[tuple[ChunkKey, str]]:
        """Replicas this tier dropped on its own (recovery, compaction, check), with why."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def replica_keys(self) -> list[ChunkKey]:
        return list(self._entries)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            active = getattr(self, "_active", None)
            if active is not None and active.live == 0 and active.id in self._segments:
                self._unlink_segment(active)  # leave no empty segment file behind
            for seg in self._segments.values():
                with contextlib.suppress(OSError):
                    self.io.close(seg.fd)
            self.catalog.close()
            self.superblock.close()


def _os_error(exc: OSError, doing: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"device full (ENOSPC) while {doing}; nothing of it was stored")
    return StorePathError(f"I/O error while {doing}: {exc}")
