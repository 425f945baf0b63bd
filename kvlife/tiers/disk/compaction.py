"""Compaction of the disk tier: the space of deleted replicas back, without a pause.

Deleted replicas leave garbage in their segment. A segment whose last live frame goes is
unlinked at once (:mod:`kvlife.tiers.disk.segments`); when a batch does not fit,
:meth:`Compactor.make_room` copies the live frames of the sealed segments with the most
garbage to the active segment (each frame verified first: one that fails is dropped,
reported as lost, never copied), makes the copies durable, relocates their rows in one
catalog transaction, and only then retires the old segment. Segments that hold
quarantined rows, or that reads are in flight on, are left alone. If the garbage is in
the active segment, it is sealed and compacted like any other, so that a batch that
fits the live budget is never refused. The bytes compaction reads and writes are
counted (:class:`~kvlife.tiers.disk.counters.DiskStats`).

Runs under the tier's write mutex (it is the writer of the moment); the tier lock is
taken only to choose, place, count and publish, never across a read, write or fsync.
"""

from __future__ import annotations

import dataclasses
import errno

from kvlife.core.identity import ChunkKey
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.catalog import Catalog, CatalogRow
from kvlife.tiers.disk.counters import DiskStats, LostReplicas
from kvlife.tiers.disk.fileio import FileIO, os_error
from kvlife.tiers.disk.frame import HEADER_BYTES, frame_len, frame_room, padding
from kvlife.tiers.disk.segments import Segment, SegmentTable


class Compactor:
    """Reclaims garbage in one disk tier's segments (under its write mutex)."""

    def __init__(
        self,
        table: SegmentTable,
        catalog: Catalog,
        io: FileIO,
        capacity_bytes: int,
        stats: DiskStats,
        lost: LostReplicas,
    ) -> None:
        self._table = table
        self.catalog = catalog
        self.io = io
        self._capacity = capacity_bytes
        self.stats = stats
        self._lost = lost

    def make_room(self, need: int) -> None:
        """Copy live frames out of the most wasteful sealed segments until ``need`` fits.
        Segments with reads in flight are left for later (a reader that pins one after
        this choice only delays its unlink).

        The candidates are chosen again after each segment: copies may seal the active
        segment with garbage in it (they roll to a new one when it is full), and that
        segment is a candidate too, so that a batch that fits the live budget is never
        refused. Each segment is compacted once per call at most."""
        table = self._table
        done: set[int] = set()
        while table.used_bytes() + need > self._capacity:
            with table.lock:
                candidates = [
                    s
                    for s in table.segments.values()
                    if s.length > s.live
                    and s.id not in done
                    and not s.doomed
                    and s.readers == 0  # its space would not come back until they leave
                    and s.id not in table.held  # holds quarantined rows
                ]
                sealed = [s for s in candidates if s is not table.active]
            if sealed:
                seg = min(sealed, key=lambda s: s.live / max(s.length, 1))
            elif candidates:
                # the garbage is in the active segment: seal it and compact it like any
                # other
                seg = candidates[0]
                table.roll()
            else:
                return
            done.add(seg.id)
            self._compact_segment(seg)

    def _compact_segment(self, seg: Segment) -> None:
        table = self._table
        start = table.lengths()
        try:
            self._copy_live_frames(seg)
        except OSError as exc:
            table.rollback(start)  # the copies are garbage; rows still point home
            with table.lock:
                retired = table.reap()
            table.remove(retired)
            raise os_error(exc, f"compacting segment {seg.path.name}") from exc

    def _copy_live_frames(self, seg: Segment) -> None:
        """Move the live frames of ``seg`` to the active segment, then retire ``seg``.

        Reads of ``seg`` may run meanwhile: its rows are replaced (never mutated, a
        reader holds the old one) only once the copies are durable and cataloged, and
        the file is unlinked when its last reader leaves.
        """
        table = self._table
        with table.lock:
            rows = sorted((r for r in table.rows.values() if r.seg == seg.id), key=lambda r: r.off)
        moves: list[tuple[bytes, int, int]] = []
        dropped: list[tuple[CatalogRow, str]] = []
        touched: set[int] = set()
        copied = 0
        for row in rows:
            flen = frame_len(row.nbytes)
            frame = aligned_empty(flen)
            got = self.io.preadv(seg.fd, [frame], row.off)
            with table.lock:
                self.stats.compaction_bytes_read += got
            problem = (
                f"truncated: {got} of {flen} bytes"
                if got < flen
                else row.verify(
                    frame.data[:HEADER_BYTES],
                    [frame[HEADER_BYTES : HEADER_BYTES + row.nbytes]],
                )
            )
            if problem:
                dropped.append((row, problem))
                continue
            dst, off, pad = table.place(row.nbytes)
            written = self.io.pwritev(dst.fd, [padding(pad), frame] if pad else [frame], off - pad)
            if written != pad + flen:
                raise OSError(errno.EIO, f"short write: {written} of {pad + flen} bytes")
            touched.add(dst.id)
            copied += pad + flen
            moves.append((row.key, dst.id, off))
        for sid in touched:
            self.io.fdatasync(table.segments[sid].fd)
        table.sync_dir()
        self.catalog.relocate(moves)
        self.catalog.delete([r.key for r, _ in dropped])
        with table.lock:
            self.stats.compaction_bytes_written += copied
            for row, problem in dropped:
                self._lost.add(ChunkKey(row.key), f"corrupt: {problem} (found by compaction)")
            rows_now = table.rows
            for key, sid, off in moves:
                ck = ChunkKey(key)
                rows_now[ck] = dataclasses.replace(rows_now[ck], seg=sid, off=off)
                table.segments[sid].live += frame_room(rows_now[ck].nbytes)
            for row, _ in dropped:
                del rows_now[ChunkKey(row.key)]
            seg.live = 0
            retired = [seg] if table.retire(seg) else []
            retired += table.reap()  # a segment the copies sealed, emptied while active
        table.remove(retired)
