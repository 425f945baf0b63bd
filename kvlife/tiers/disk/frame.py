"""Replica frames: the on-disk form of one replica inside a segment file.

Layout (all integers little-endian)::

    header, HEADER_BYTES long (zero padded):
      magic 8s "KVLFRAME" | format version u16 | flags u16 | payload length u64
      | key 32s | payload checksum 16s (xxh3-128) | dtype 16s | ndim u8 | shape 8 x u64
      | transform 24s | header checksum u64 (xxh3-64 of the bytes before it)
    payload, padded with zeros to a multiple of ALIGN

A frame starts at a multiple of ALIGN in its segment. A frame whose payload is
:data:`ALIGNED_FROM` bytes or more is placed so that its payload starts at a multiple of
:data:`PAYLOAD_ALIGN` (its header in the ALIGN bytes before): the bytes skipped before
it (:func:`frame_pad`, zeros, written with it) belong to no frame. Rows name frames by
offset, so a store written before this placement reads the same.

The header names the replica completely, so a frame can be checked on its own; the
header checksum catches a torn or overwritten header, the payload checksum a torn or
overwritten payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvlife.core.errors import StoreFormatError
from kvlife.tiers.buffers import ALIGN, aligned_empty, round_up

MAGIC = b"KVLFRAME"
FRAME_VERSION = 1
HEADER_BYTES = ALIGN
MAX_NDIM = 8
TRANSFORM_BYTES = 24
"""Room for the transform name in a header."""
DTYPE_BYTES = 16

PAYLOAD_ALIGN = 64 << 10
"""Alignment in its segment of a large frame's payload. Measured on the development
VM's virtual disk (2026-12-04, issue 28; ``docs/store.md``): frames of 2 MiB payloads
laid back to back (a 2 MiB + 4 KiB stride) wrote 8-10 % and read 7-15 % slower than the
same payloads at 2 MiB offsets, and as fast as those once each payload started at a
multiple of 64 KiB with its header in the page before."""

ALIGNED_FROM = 2 << 20
"""Payloads of this many bytes and more are placed at :data:`PAYLOAD_ALIGN` (their
padding at most 60 KiB: 3 % of a payload of this size, where the gain was measured);
smaller frames stay back to back."""

_BODY = struct.Struct("<8sHHQ32s16s16sB8Q24s")
_HCHECK = struct.Struct("<Q")
HEADER_USED = _BODY.size + _HCHECK.size


class FrameError(Exception):
    """A frame that does not verify (the message says which check failed)."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    key: bytes
    payload_len: int
    checksum: bytes
    dtype: str
    shape: tuple[int, ...]
    transform: str
    version: int = FRAME_VERSION

    @property
    def frame_len(self) -> int:
        return frame_len(self.payload_len)


def frame_len(payload_len: int) -> int:
    return HEADER_BYTES + round_up(payload_len)


def frame_pad(tail: int, payload_len: int) -> int:
    """Bytes to skip after ``tail`` (where the segment ends, a multiple of ALIGN) before a
    frame of ``payload_len``: its payload then starts at a multiple of PAYLOAD_ALIGN."""
    if payload_len < ALIGNED_FROM:
        return 0
    return -(tail + HEADER_BYTES) % PAYLOAD_ALIGN


_ZEROS: np.ndarray | None = None


def padding(nbytes: int) -> np.ndarray:
    """``nbytes`` (< PAYLOAD_ALIGN, a multiple of ALIGN) of aligned zeros to write as a
    frame's padding: a view of one read-only buffer shared by every writer."""
    global _ZEROS
    if _ZEROS is None:
        zeros = aligned_empty(PAYLOAD_ALIGN)
        zeros[:] = 0
        zeros.flags.writeable = False
        _ZEROS = zeros
    return _ZEROS[:nbytes]


def frame_room(payload_len: int) -> int:
    """The most a frame of ``payload_len`` takes in a segment, its padding included:
    what a live frame is counted as (so that a segment whose only garbage is padding,
    which a copy would keep, is not worth compacting) and what a batch reserves."""
    pad = PAYLOAD_ALIGN - ALIGN if payload_len >= ALIGNED_FROM else 0
    return frame_len(payload_len) + pad


def payload_checksum(data: np.ndarray) -> bytes:
    """xxh3-128 of a contiguous array's bytes (read in place, no copy)."""
    return bytes(xxhash.xxh3_128_digest(data.data))


def parts_checksum(parts: list[np.ndarray]) -> bytes:
    """xxh3-128 of the concatenation of contiguous arrays, without concatenating."""
    if len(parts) == 1:
        return payload_checksum(parts[0])
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part.data)
    return bytes(h.digest())


def pack_header(h: FrameHeader, out: memoryview) -> None:
    """Write the header into the first HEADER_BYTES of ``out`` (the rest zeroed)."""
    out[:HEADER_USED] = header_used(h)
    out[HEADER_USED:HEADER_BYTES] = bytes(HEADER_BYTES - HEADER_USED)


def header_used(h: FrameHeader) -> bytes:
    """The header's first HEADER_USED bytes (its fields and their checksum): what
    :func:`pack_header` writes before the zeroed rest, and what a remote record holds."""
    if len(h.shape) > MAX_NDIM:
        raise ValueError(f"replica has {len(h.shape)} dimensions, frames hold {MAX_NDIM}")
    shape = list(h.shape) + [0] * (MAX_NDIM - len(h.shape))
    body = _BODY.pack(
        MAGIC,
        h.version,
        0,
        h.payload_len,
        h.key,
        h.checksum,
        h.dtype.encode(),
        len(h.shape),
        *shape,
        h.transform.encode(),
    )
    return body + _HCHECK.pack(xxhash.xxh3_64_intdigest(body))


def unpack_header(buf: memoryview | bytes) -> FrameHeader:
    """Parse and check a header; raise FrameError or StoreFormatError."""
    if len(buf) < HEADER_USED:
        raise FrameError(f"header truncated to {len(buf)} bytes")
    body = bytes(buf[: _BODY.size])
    if body[:8] != MAGIC:
        raise FrameError("bad magic")
    (hcheck,) = _HCHECK.unpack(bytes(buf[_BODY.size : HEADER_USED]))
    if hcheck != xxhash.xxh3_64_intdigest(body):
        raise FrameError("header checksum mismatch")
    fields = _BODY.unpack(body)
    version = fields[1]
    if version > FRAME_VERSION:
        raise StoreFormatError(
            f"frame format version {version} is newer than this kvlife reads ({FRAME_VERSION})"
        )
    ndim = fields[7]
    if ndim > MAX_NDIM:
        raise FrameError(f"header claims {ndim} dimensions")
    return FrameHeader(
        key=fields[4],
        payload_len=fields[3],
        checksum=fields[5],
        dtype=fields[6].rstrip(b"\0").decode(),
        shape=tuple(fields[8 : 8 + ndim]),
        transform=fields[16].rstrip(b"\0").decode(),
        version=version,
    )


def verify_frame(
    hdr: memoryview | bytes,
    payload: list[np.ndarray] | None,
    *,
    key: bytes,
    nbytes: int,
    checksum: bytes,
    dtype: str,
    shape: tuple[int, ...],
    transform: str,
) -> str:
    """Empty string if a frame's header (and ``payload``, when given) matches what its
    catalog row says in every field, else what differs. Never raises on damaged bytes."""
    try:
        h = unpack_header(hdr)
    except (FrameError, StoreFormatError, UnicodeDecodeError) as exc:
        return f"header: {exc}"
    if h.key != key:
        return "header names another key"
    if h.payload_len != nbytes or h.checksum != checksum:
        return "header disagrees with the catalog"
    if h.dtype != dtype or h.shape != shape or h.transform != transform:
        return (
            f"header says {h.dtype}{list(h.shape)} {h.transform!r}, the catalog "
            f"{dtype}{list(shape)} {transform!r}"
        )
    if payload is not None and parts_checksum(payload) != checksum:
        return "payload checksum mismatch"
    return ""
