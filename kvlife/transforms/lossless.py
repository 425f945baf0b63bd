"""Lossless transform: byte-shuffle, then zstd (level 1) or lz4; decodes bit-exact.

Byte-shuffle splits each element into byte planes (all low bytes, then all high bytes):
the high byte of a float16 (sign, exponent, two mantissa bits) varies little across a
KV chunk, so its plane compresses well while the low mantissa plane is close to random.
The shuffle is a serial numba loop (about 13 GB/s for float16, memory-bound: numpy's
strided copies are several times slower, and a parallel loop loses more to waking threads
on a busy machine than it gains).

Payload (version 2): a table of (kind, length) per byte plane, then the planes, each
either raw (when a trial on its first 64 KiB does not shrink) or cut into blocks of
``BLOCK`` bytes compressed independently: a block count, the block size and each block's
compressed length (u32), then the blocks. Blocks are compressed and decompressed on a
small thread pool (zstd and lz4 release the GIL), so a plane uses every core; the output
does not depend on the number of threads. Codec errors and a decompressed size that does
not match the descriptor's shape are :class:`~kvlife.transforms.base.TransformError`.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Self, TypeVar

import lz4.block
import numpy as np
import zstandard
from numba import njit
from numpy.typing import NDArray

from kvlife.core.errors import LayoutMismatch
from kvlife.transforms.base import Exactness, Param, Transform, TransformDescriptor, TransformError
from kvlife.transforms.registry import register_transform

CODECS = ("zstd", "lz4")
SAMPLE = 1 << 16
"""Bytes of a plane compressed as a trial: a plane that does not shrink there is stored raw."""
RAW_IF_ABOVE = 0.97
"""Trial ratio above which a plane is stored raw (the low mantissa bytes of KV are near
random; compressing them costs most of the time and saves nothing)."""
BLOCK = 1 << 20
"""Plane bytes per independently compressed block (the unit of parallelism)."""
_PLANE = struct.Struct("<BQ")  # per plane: 0 raw / 1 compressed blocks, stored length
_BLOCKS = struct.Struct("<II")  # compressed plane: block count, block size; then u32 lengths
_T = TypeVar("_T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _map(fn: Callable[[int], _T], n: int) -> list[_T]:
    """``[fn(i) for i in range(n)]`` on the module's thread pool (one per process, sized to
    the CPUs, created on first use); a single item runs inline."""
    global _pool
    if n <= 1:
        return [fn(i) for i in range(n)]
    with _pool_lock:
        if _pool is None:
            workers = min(
                8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
            )
            _pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kvlife-lossless")
    return list(_pool.map(fn, range(n)))


@njit(cache=True)
def _shuffle(
    src: NDArray[np.uint8], dst: NDArray[np.uint8], itemsize: int
) -> None:  # pragma: no cover
    """Byte planes of ``src`` into ``dst``: plane j holds byte j of every element."""
    n = src.size // itemsize
    for i in range(n):
        for j in range(itemsize):
            dst[j * n + i] = src[i * itemsize + j]


@njit(cache=True)
def _unshuffle_plane(
    plane: NDArray[np.uint8], dst: NDArray[np.uint8], itemsize: int, j: int
) -> None:  # pragma: no cover
    """Byte plane ``j`` back into its place in every element of ``dst``."""
    for i in range(plane.size):
        dst[i * itemsize + j] = plane[i]


@njit(cache=True)
def _split16(
    src: NDArray[np.uint16], lo: NDArray[np.uint8], hi: NDArray[np.uint8]
) -> None:  # pragma: no cover
    """The two byte planes of 2-byte elements (float16, bfloat16): a vectorised loop."""
    for i in range(src.size):
        v = src[i]
        lo[i] = v & 0xFF
        hi[i] = v >> 8


@njit(cache=True)
def _join16(
    lo: NDArray[np.uint8], hi: NDArray[np.uint8], dst: NDArray[np.uint16]
) -> None:  # pragma: no cover
    """Inverse of :func:`_split16`."""
    for i in range(dst.size):
        dst[i] = np.uint16(lo[i]) | (np.uint16(hi[i]) << 8)


@njit(cache=True)
def _split32(src: NDArray[np.uint32], planes: NDArray[np.uint8]) -> None:  # pragma: no cover
    """The four byte planes (rows of ``planes``) of 4-byte elements (float32)."""
    for i in range(src.size):
        v = src[i]
        planes[0, i] = v & 0xFF
        planes[1, i] = (v >> 8) & 0xFF
        planes[2, i] = (v >> 16) & 0xFF
        planes[3, i] = v >> 24


@njit(cache=True)
def _join32(planes: NDArray[np.uint8], dst: NDArray[np.uint32]) -> None:  # pragma: no cover
    """Inverse of :func:`_split32`."""
    for i in range(dst.size):
        dst[i] = (
            np.uint32(planes[0, i])
            | (np.uint32(planes[1, i]) << 8)
            | (np.uint32(planes[2, i]) << 16)
            | (np.uint32(planes[3, i]) << 24)
        )


@register_transform
class LosslessTransform(Transform):
    """Byte-shuffle + zstd/lz4 over any fixed-size numeric dtype."""

    name = "lossless"
    version = 2
    exactness = Exactness.LOSSLESS

    def __init__(self, codec: str = "zstd", level: int = 1, shuffle: bool = True) -> None:
        if codec not in CODECS:
            raise TransformError(f"lossless codec must be one of {CODECS}, got {codec!r}")
        if codec == "zstd" and not 1 <= level <= 22:
            raise TransformError(f"zstd level must be in 1..22, got {level}")
        self.codec = codec
        self.level = level
        self.shuffle = shuffle

    def params(self) -> Mapping[str, Param]:
        return {"codec": self.codec, "level": self.level, "shuffle": self.shuffle}

    @classmethod
    def from_params(cls, params: Mapping[str, Param]) -> Self:
        unknown = set(params) - {"codec", "level", "shuffle"}
        if unknown:
            raise TransformError(f"lossless does not know parameters {sorted(unknown)}")
        codec = params.get("codec", "zstd")
        level = params.get("level", 1)
        shuffle = params.get("shuffle", True)
        if not (isinstance(codec, str) and type(level) is int and isinstance(shuffle, bool)):
            raise TransformError(f"lossless parameters have wrong types: {dict(params)}")
        return cls(codec, level, shuffle)

    def check_input(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> None:
        if dtype.hasobject or dtype.itemsize == 0:
            raise LayoutMismatch(f"lossless cannot store dtype {dtype}")

    def payload_nbytes(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int:
        # a plane is compressed only if that makes it smaller: at worst raw, plus the table
        n = int(np.prod(shape)) * dtype.itemsize
        return n + _PLANE.size * (dtype.itemsize if self.shuffle else 1)

    def _encode(self, array: NDArray[np.generic]) -> NDArray[np.uint8]:
        raw = array.reshape(-1).view(np.uint8)
        k = array.dtype.itemsize if self.shuffle else 1
        n = raw.size // k
        head = _PLANE.size * k
        # the planes are split straight into the payload buffer, where a raw plane stays:
        # compressed planes are written over their raw bytes and later planes moved down
        buf = np.empty(head + raw.size, np.uint8)
        body = buf[head:]
        if k == 2:
            _split16(raw.view(np.uint16), body[:n], body[n:])
        elif k == 4:
            _split32(raw.view(np.uint32), body.reshape(4, -1))
        elif k > 1:
            _shuffle(raw, body, k)
        else:
            np.copyto(body, raw)
        planes = [body[j * n : (j + 1) * n] for j in range(k)]
        # which planes are worth compressing: a trial on their first bytes
        trials = [p[:SAMPLE] for p in planes]
        sizes = _map(lambda j: len(self._compress(trials[j])), k)
        chosen = [
            j for j in range(k) if trials[j].size and sizes[j] <= RAW_IF_ABOVE * trials[j].size
        ]
        nblk = -(-n // BLOCK)
        blocks = _map(
            lambda i: self._compress(planes[chosen[i // nblk]][(i % nblk) * BLOCK :][:BLOCK]),
            len(chosen) * nblk,
        )
        pos = head
        for j in range(k):
            src = head + j * n
            kind, length = 0, n
            if j in chosen:
                mine = blocks[chosen.index(j) * nblk :][:nblk]
                table = _BLOCKS.pack(nblk, BLOCK) + struct.pack(f"<{nblk}I", *map(len, mine))
                length = len(table) + sum(map(len, mine))
                if length < n:
                    kind = 1
                    at = pos
                    for part in (table, *mine):
                        buf[at : at + len(part)] = np.frombuffer(part, np.uint8)
                        at += len(part)
                else:
                    length = n
            if kind == 0 and pos != src:
                buf[pos : pos + n] = buf[src : src + n]  # numpy copes with the overlap
            _PLANE.pack_into(buf.data, j * _PLANE.size, kind, length)
            pos += length
        return buf[:pos]

    def _compress(self, data: NDArray[np.uint8]) -> bytes:
        if self.codec == "zstd":
            out: bytes = zstandard.ZstdCompressor(level=self.level).compress(data.data)
            return out
        packed: bytes = lz4.block.compress(data.data, store_size=False)
        return packed

    def _decode(
        self, payload: NDArray[np.uint8], desc: TransformDescriptor, out: NDArray[np.generic]
    ) -> None:
        dst = out.reshape(-1).view(np.uint8)
        k = out.dtype.itemsize if self.shuffle else 1
        n = dst.size // k
        pos = k * _PLANE.size
        planes: list[NDArray[np.uint8]] = []
        if payload.size < pos:
            raise TransformError(f"lossless payload of {payload.size} bytes lacks its plane table")
        for j in range(k):
            kind, length = _PLANE.unpack_from(payload.data, j * _PLANE.size)
            part = payload[pos : pos + length]
            pos += length
            if part.size != length or kind not in (0, 1):
                raise TransformError(f"lossless plane {j} has a bad table entry ({kind}, {length})")
            plane = self._decompress_blocks(part, n, j) if kind == 1 else part
            if plane.size != n:
                raise TransformError(
                    f"lossless/{self.codec} plane {j} holds {plane.size} bytes, expected {n}"
                )
            planes.append(plane)
        if pos != payload.size:
            raise TransformError(f"lossless payload has {payload.size - pos} trailing bytes")
        if k == 1:
            np.copyto(dst, planes[0])
        elif k == 2:
            _join16(planes[0], planes[1], dst.view(np.uint16))
        elif k == 4:
            _join32(np.stack(planes), dst.view(np.uint32))
        else:
            for j, plane in enumerate(planes):
                _unshuffle_plane(plane, dst, k, j)

    def _decompress_blocks(self, part: NDArray[np.uint8], n: int, j: int) -> NDArray[np.uint8]:
        """One compressed plane of ``n`` bytes: its block table, then its blocks in parallel."""
        if part.size < _BLOCKS.size:
            raise TransformError(f"lossless plane {j} lacks its block table")
        nblk, block = _BLOCKS.unpack_from(part.data)
        if block < 1 or nblk != -(-n // block) or part.size < _BLOCKS.size + 4 * nblk:
            raise TransformError(
                f"lossless plane {j}: {nblk} blocks of {block} bytes do not make {n} bytes"
            )
        lengths = np.frombuffer(part.data, "<u4", nblk, _BLOCKS.size).astype(np.int64)
        ends = _BLOCKS.size + 4 * nblk + np.cumsum(lengths)
        if nblk and ends[-1] != part.size:
            raise TransformError(f"lossless plane {j}: block lengths do not add up")
        starts = ends - lengths
        plane = np.empty(n, np.uint8)

        def one(i: int) -> None:
            want = min(block, n - i * block)
            got = self._decompress(part[starts[i] : ends[i]], want)
            if got.size != want:
                raise TransformError(f"lossless plane {j} block {i} holds {got.size} bytes")
            plane[i * block : i * block + want] = got

        _map(one, nblk)
        return plane

    def _decompress(self, part: NDArray[np.uint8], n: int) -> NDArray[np.uint8]:
        try:
            if self.codec == "zstd":
                raw = zstandard.ZstdDecompressor().decompress(part.data, max_output_size=n)
            else:
                raw = lz4.block.decompress(part.data, uncompressed_size=n)
        except (zstandard.ZstdError, lz4.block.LZ4BlockError) as exc:
            raise TransformError(f"lossless/{self.codec} plane does not decompress: {exc}") from exc
        return np.frombuffer(raw, dtype=np.uint8)
