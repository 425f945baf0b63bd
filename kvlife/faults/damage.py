"""Damage to a closed store's files, the way a bad disk, a stray writer or an operator does it.

The helpers find frames through the documented segment format
(:mod:`kvlife.tiers.disk.frame`) and the documented disk layout of a store at ``PATH``
(``PATH/disk/catalog.sqlite``, ``PATH/disk/segments/seg-NNNNNNNN.kvs``), never through a
running store, so a test can damage exactly one frame's header or payload and know which
key it hit. Use them on a closed store only: an open one caches file sizes and rows.

- :func:`scan_frames` lists every frame whose header verifies (a :class:`Frame` each);
- :func:`flip` inverts bytes (so they surely change), :func:`overwrite` writes given
  bytes, :func:`zero_fill` writes zeros;
- :func:`truncate`, :func:`swap_frames`, :func:`delete_segment` damage segments whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvlife.core.identity import ChunkKey
from kvlife.tiers.disk.frame import HEADER_BYTES, FrameError, frame_len, unpack_header


def segment_dir(store: Path) -> Path:
    """The segment directory of the store at ``store``."""
    return store / "disk" / "segments"


def catalog_file(store: Path) -> Path:
    """The SQLite catalog of the store at ``store`` (``-wal`` and ``-shm`` sit beside it)."""
    return store / "disk" / "catalog.sqlite"


def segment_files(store: Path) -> list[Path]:
    """The store's segment files, in segment-number order."""
    return sorted(segment_dir(store).glob("seg-*.kvs"))


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame found in a segment file."""

    segment: Path
    offset: int
    """Offset of the frame's header in the segment file."""
    key: ChunkKey
    payload_len: int

    @property
    def payload_offset(self) -> int:
        return self.offset + HEADER_BYTES

    @property
    def end(self) -> int:
        """Offset just past the frame's padding (where the next frame starts)."""
        return self.offset + frame_len(self.payload_len)


def scan_frames(store: Path) -> list[Frame]:
    """Every frame whose header verifies, in segment and offset order.

    A page whose header does not verify is skipped, and the scan goes on at the next
    page, so frames after a damaged one are still found.
    """
    frames: list[Frame] = []
    for seg in segment_files(store):
        data = seg.read_bytes()
        off = 0
        while off + HEADER_BYTES <= len(data):
            try:
                h = unpack_header(data[off : off + HEADER_BYTES])
            except FrameError:
                off += HEADER_BYTES
                continue
            frames.append(Frame(seg, off, ChunkKey(h.key), h.payload_len))
            off += frame_len(h.payload_len)
    return frames


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Write ``data`` over the bytes of ``path`` at ``offset`` (the file may grow)."""
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def flip(path: Path, offset: int, length: int) -> None:
    """Invert ``length`` bytes at ``offset`` (so they surely change)."""
    with path.open("r+b") as fh:
        fh.seek(offset)
        old = fh.read(length)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in old))


def zero_fill(path: Path, offset: int, length: int) -> None:
    """Overwrite ``length`` bytes at ``offset`` with zeros."""
    overwrite(path, offset, bytes(length))


def truncate(path: Path, length: int) -> None:
    """Cut ``path`` to ``length`` bytes."""
    os.truncate(path, length)


def swap_frames(a: Frame, b: Frame, what: Literal["payloads", "whole-frames"]) -> None:
    """Exchange two equally long frames of one segment: their payloads only (headers still
    name their own keys) or the whole frames (each header then names the other key)."""
    if a.segment != b.segment:
        raise ValueError("swap_frames swaps frames of one segment")
    if a.payload_len != b.payload_len:
        raise ValueError(f"frames differ in length ({a.payload_len} and {b.payload_len})")
    start, length = (
        (HEADER_BYTES, a.payload_len) if what == "payloads" else (0, frame_len(a.payload_len))
    )
    data = bytearray(a.segment.read_bytes())
    pa = bytes(data[a.offset + start : a.offset + start + length])
    pb = bytes(data[b.offset + start : b.offset + start + length])
    data[a.offset + start : a.offset + start + length] = pb
    data[b.offset + start : b.offset + start + length] = pa
    a.segment.write_bytes(bytes(data))


def delete_segment(path: Path) -> None:
    """Remove a segment file."""
    path.unlink()
