"""The disk tier's map of its space: the segment files, the row of every replica it
serves (which segment, at what offset), the bytes reserved for batches in flight, and
the tier lock that guards all of it.

The tier lock (:attr:`SegmentTable.lock`) guards this in-memory state and nothing else:
no method here, and no caller, holds it across a system call on a file. A new
segment's file is created before the segment is installed under the lock (its id is
reserved first, so an audit listing the directory meanwhile does not take it for an
orphan); a retired segment's file is closed and unlinked after the lock is released.

Segments live as long as anything may read them. A read pins the segments it reads
(:meth:`SegmentTable.pin`); a segment whose last live frame goes is *retired*
(:attr:`Segment.doomed`) and removed by whoever leaves it last: at once when nobody
reads it, else by its last reader (:meth:`SegmentTable.unpin`). The active segment is
not retired when it empties (the writer places frames in it); once it is sealed, the
writer that sealed it retires it if it is still empty after that writer published
(:meth:`SegmentTable.reap`: frames of the sealing batch may have landed in it). A
doomed segment stays in the table until its file is gone, so its id, which is its file
name, is never reused while the old file may still be on disk. Segments that hold rows
recovery quarantined (:attr:`SegmentTable.held`) are never reclaimed at runtime: only
``check --fix`` may.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlife.core.errors import ReplicaNotFound, StorePathError
from kvlife.core.identity import ChunkKey
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.counters import DiskStats
from kvlife.tiers.disk.fileio import FileIO, os_error
from kvlife.tiers.disk.frame import frame_len, frame_pad, frame_room

SEGMENT_RE = re.compile(r"^seg-(\d{8})\.kvs$")
"""File names of segments: ``seg-`` and the id in eight digits."""


def segment_name(sid: int) -> str:
    return f"seg-{sid:08d}.kvs"


def segment_files(segdir: Path) -> dict[int, Path]:
    """The segment files in ``segdir`` by id (none when the directory does not exist)."""
    try:
        names = list(segdir.iterdir())
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise StorePathError(f"cannot list segments in {segdir}: {exc}") from exc
    found: dict[int, Path] = {}
    for p in names:
        m = SEGMENT_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


@dataclass(slots=True)
class Segment:
    """One open segment file and what the table knows of it."""

    id: int
    path: Path
    fd: int
    length: int
    """Bytes placed in it (written, or being written by the one writer)."""
    live: int = 0
    """Bytes of its frames that rows name, each counted with the padding it may need
    (:func:`~kvlife.tiers.disk.frame.frame_room`); the rest is garbage for compaction."""
    readers: int = 0
    """Reads in flight on this segment (its file must outlive them)."""
    doomed: bool = False
    """No row names it any more; removed when ``readers`` reaches 0."""
    removing: bool = False
    """Its file is being closed and unlinked (by exactly one thread)."""
    unlink_failed: bool = False
    """Emptied, but its file could not be unlinked: an orphan for ``check --fix``."""


class SegmentTable:
    """Segments, rows and reservations of one disk tier, under the tier lock.

    Attributes are read and changed under :attr:`lock` only. Placing frames
    (:meth:`place`, :meth:`roll`) is for the one writer of the moment, which holds the
    tier's write mutex.
    """

    def __init__(
        self, name: str, segdir: Path, io: FileIO, segment_bytes: int, stats: DiskStats
    ) -> None:
        self.name = name
        self.segdir = segdir
        self.io = io
        self.segment_bytes = segment_bytes
        self.stats = stats
        self.lock = threading.RLock()
        """The tier lock: metadata only, never held across file I/O."""
        self.rows: dict[ChunkKey, CatalogRow] = {}
        """The row of every replica served (rows are replaced, never changed in place:
        a reader or an audit holding one sees what it looked up)."""
        self.segments: dict[int, Segment] = {}
        self.reserved = 0
        """Bytes reserved by ``prepare_store`` and not yet committed or cancelled."""
        self.held: dict[int, int] = {}
        """Segments that hold quarantined rows (how many): never reclaimed at runtime."""
        self.sid_floor = 0
        """Highest segment id seen at open: a new segment never reuses a set-aside name."""
        self._creating: set[int] = set()
        """Ids of segments whose files are being created (reserved, not installed yet)."""
        self._active: Segment | None = None
        self._sealed: list[Segment] = []
        """Segments :meth:`roll` sealed since the writer last called :meth:`reap`: the
        writer of the moment may have placed frames in them that it has not published."""
        self._dir_dirty = False

    # ------------------------------------------------------------------ lookups

    @property
    def active(self) -> Segment:
        """The segment new frames go to."""
        seg = self._active
        if seg is None:  # only between open's recovery and its first roll
            raise RuntimeError(f"{self.name}: no active segment yet")
        return seg

    def row(self, key: ChunkKey) -> CatalogRow:
        """The row of a served replica (ReplicaNotFound if there is none)."""
        row = self.rows.get(key)
        if row is None:
            raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
        return row

    def used_bytes(self) -> int:
        with self.lock:
            return sum(s.length for s in self.segments.values()) + self.reserved

    def live_bytes(self) -> int:
        with self.lock:
            return sum(s.live for s in self.segments.values())

    def known(self, sid: int) -> bool:
        """True if ``sid`` is a segment of this table, being created, or held for
        quarantined rows: a file of that id is not an orphan (under the lock)."""
        return sid in self.segments or sid in self._creating or sid in self.held

    # ------------------------------------------------------------------ placing frames

    def lengths(self) -> dict[int, int]:
        """Every segment's length now, for :meth:`rollback`."""
        with self.lock:
            return {sid: s.length for sid, s in self.segments.items()}

    def rollback(self, start: dict[int, int]) -> None:
        """Give back the space placed since :meth:`lengths` (a write that failed: its
        frames are garbage nobody names)."""
        with self.lock:
            for sid, length in start.items():
                if sid in self.segments:
                    self.segments[sid].length = length

    def place(self, payload_len: int) -> tuple[Segment, int, int]:
        """Room for a frame of ``payload_len`` at the end of the active segment, or of a
        new one when it would pass ``segment_bytes`` (a larger frame gets a segment of
        its own): the segment, the frame's offset and the padding skipped before it
        (:func:`~kvlife.tiers.disk.frame.frame_pad`). The writer's only: the writer of
        the moment holds the write mutex."""
        flen = frame_len(payload_len)
        with self.lock:
            seg = self.active
            pad = frame_pad(seg.length, payload_len)
            if seg.length == 0 or seg.length + pad + flen <= self.segment_bytes:
                return seg, *self._extend(seg, pad, flen)
        seg = self.roll()
        with self.lock:
            return seg, *self._extend(seg, frame_pad(seg.length, payload_len), flen)

    @staticmethod
    def _extend(seg: Segment, pad: int, flen: int) -> tuple[int, int]:
        off = seg.length + pad
        seg.length = off + flen
        return off, pad

    def roll(self) -> Segment:
        """Seal the active segment and make a new, empty one active. The file is created
        outside the lock; the directory entry is made durable by the next commit's
        :meth:`sync_dir`, before any row names it."""
        with self.lock:
            sid = max(max(self.segments, default=0), max(self._creating, default=0))
            sid = max(sid, self.sid_floor) + 1
            self._creating.add(sid)
        path = self.segdir / segment_name(sid)
        try:
            try:
                fd = self.io.open(path, create=True)
                self.io.truncate(fd, 0)
            except OSError as exc:
                raise os_error(exc, f"creating segment {path}") from exc
            seg = Segment(sid, path, fd, 0)
            with self.lock:
                self.segments[sid] = seg
                if self._active is not None:
                    self._sealed.append(self._active)
                self._active = seg
                self._dir_dirty = True
        finally:
            with self.lock:
                self._creating.discard(sid)
        return seg

    def sync_dir(self) -> None:
        """fsync the segment directory if a segment was created since the last call
        (the writer's, before its catalog commit)."""
        if self._dir_dirty:
            self.io.fsync_dir(self.segdir)
            self._dir_dirty = False

    # ------------------------------------------------------------------ rows

    def publish(self, rows: Iterable[CatalogRow]) -> list[Segment]:
        """Serve ``rows`` (durable, cataloged), replacing older rows of the same keys;
        returns the segments that replacement emptied, for :meth:`remove` once the lock
        is released (under the lock)."""
        retired: list[Segment] = []
        for row in rows:
            key = ChunkKey(row.key)
            old = self.rows.pop(key, None)
            if old is not None and self.drop_live(old):
                retired.append(self.segments[old.seg])
            self.rows[key] = row
            self.segments[row.seg].live += frame_room(row.nbytes)
        return retired

    def unpublish(self, rows: Iterable[CatalogRow]) -> list[Segment]:
        """Stop serving ``rows`` (deleted from the catalog); returns the segments left
        empty, for :meth:`remove` once the lock is released (under the lock)."""
        retired: list[Segment] = []
        for row in rows:
            del self.rows[ChunkKey(row.key)]
            if self.drop_live(row):
                retired.append(self.segments[row.seg])
        return retired

    def drop_live(self, row: CatalogRow) -> bool:
        """Uncount a row's frame (under the lock); True if its segment is now retired and
        unreferenced, for the caller to remove once the lock is released."""
        seg = self.segments[row.seg]
        seg.live -= frame_room(row.nbytes)
        if (
            seg.live == 0
            and seg is not self._active
            and not seg.doomed
            and seg.id not in self.held  # holds quarantined rows: kept for check
        ):
            return self.retire(seg)
        return False

    def reap(self) -> list[Segment]:
        """Retire the segments sealed since the last call that hold no live frame (one
        emptied while it was active: :meth:`drop_live` leaves the active segment alone).
        The writer of the moment calls it once its frames are published or rolled back,
        so that no frame it placed in a sealed segment is still to be counted. Returns
        the segments to :meth:`remove` once the lock is released (under the lock)."""
        retired: list[Segment] = []
        for seg in self._sealed:
            if (
                seg.live == 0
                and seg is not self._active
                and not seg.doomed
                and self.segments.get(seg.id) is seg
                and seg.id not in self.held
                and self.retire(seg)
            ):
                retired.append(seg)
        self._sealed.clear()
        return retired

    # ------------------------------------------------------------------ readers

    def pin_rows(self, rows: Iterable[CatalogRow]) -> dict[int, Segment]:
        """Pin the segments of served rows for a read (under the lock; the segment of a
        row being served is never retired)."""
        pinned = {row.seg: self.segments[row.seg] for row in rows}
        for seg in pinned.values():
            seg.readers += 1
        return pinned

    def pin(self, sid: int) -> Segment | None:
        """Pin a segment for a read (under the lock); None if it is retired or gone,
        so that nothing of it is served any more."""
        seg = self.segments.get(sid)
        if seg is None or seg.doomed:
            return None
        seg.readers += 1
        return seg

    def unpin(self, segs: Iterable[Segment]) -> list[Segment]:
        """Unpin segments (under the lock); returns those now to :meth:`remove` (retired,
        and this was their last reader)."""
        retired: list[Segment] = []
        for seg in segs:
            seg.readers -= 1
            if seg.doomed and seg.readers == 0:
                retired.append(seg)
        return retired

    # ------------------------------------------------------------------ reclaiming

    def retire(self, seg: Segment) -> bool:
        """Doom a segment no row names any more (under the lock). True if no read is in
        flight on it, so the caller removes it now; else its last reader does."""
        seg.doomed = True
        return seg.readers == 0

    def remove(self, segs: Sequence[Segment], *, quiet: bool = False) -> None:
        """Close and unlink retired segments, outside the tier lock. A doomed segment
        stays in the table until its file is gone, so its id is not reused.

        ``quiet`` (a reader leaving): an OSError leaves the file for ``check --fix`` to
        delete as an orphan instead of failing a read that has its bytes.
        """
        if quiet:
            for seg in segs:
                with contextlib.suppress(OSError):
                    self.remove([seg])
            return
        for seg in segs:
            with self.lock:  # an audit's fix may retire the same segment: close once
                if seg.removing:
                    continue
                seg.removing = True
            with contextlib.suppress(OSError):  # the descriptor is gone either way
                self.io.close(seg.fd)
            try:
                self.io.unlink(seg.path)
            except OSError:
                # Its rows are already deleted in a committed transaction, so the caller
                # (an invalidation, an eviction) did what it promised. The file stays
                # in the table, so its id is not reused: an orphan for check --fix (or
                # quarantine at the next open), counted here.
                with self.lock:
                    self.stats.unlink_failures += 1
                    seg.unlink_failed = True
                continue
            with self.lock:
                if self.segments.get(seg.id) is seg:
                    del self.segments[seg.id]
                    self.stats.segments_reclaimed += 1

    def forget(self, seg: Segment) -> None:
        """Drop a segment whose file is gone (deleted by ``check --fix``) from the table."""
        with self.lock:
            if self.segments.get(seg.id) is seg:
                del self.segments[seg.id]
                self.stats.segments_reclaimed += 1

    def unlink(self, seg: Segment) -> None:
        """Retire a segment and remove it now unless a read is in flight on it."""
        with self.lock:
            now = self.retire(seg)
        if now:
            self.remove([seg])

    def close(self) -> None:
        """Close every segment file; an active segment that never got a frame is removed
        (open leaves no empty segment file behind). Nothing may use the table after."""
        with self.lock:
            active = self._active
            empty = active is not None and active.live == 0 and active.id in self.segments
        if empty and active is not None:
            self.unlink(active)
        with self.lock:
            segs = list(self.segments.values())
        for seg in segs:
            if not seg.removing:
                with contextlib.suppress(OSError):
                    self.io.close(seg.fd)
