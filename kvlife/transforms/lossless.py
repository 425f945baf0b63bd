"""Lossless transform: byte-shuffle, then zstd (level 1) or lz4; decodes bit-exact.

Byte-shuffle splits each element into byte planes (all low bytes, then all high bytes):
the high byte of a float16 (sign, exponent, two mantissa bits) varies little across a
KV chunk, so its plane compresses well while the low mantissa plane is close to random.
The shuffle is a numba loop because numpy's transpose-copy is several times slower.

Payload: the compressed shuffled bytes. Codec errors and a decompressed size that does
not match the descriptor's shape are :class:`~kvlife.transforms.base.TransformError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

import lz4.block
import numpy as np
import zstandard
from numba import njit
from numpy.typing import NDArray

from kvlife.core.errors import LayoutMismatch
from kvlife.transforms.base import Exactness, Param, Transform, TransformDescriptor, TransformError
from kvlife.transforms.registry import register_transform

CODECS = ("zstd", "lz4")


@njit(cache=True)
def _shuffle(
    src: NDArray[np.uint8], dst: NDArray[np.uint8], itemsize: int
) -> None:  # pragma: no cover
    n = src.size // itemsize
    for j in range(itemsize):
        base = j * n
        for i in range(n):
            dst[base + i] = src[i * itemsize + j]


@njit(cache=True)
def _unshuffle(
    src: NDArray[np.uint8], dst: NDArray[np.uint8], itemsize: int
) -> None:  # pragma: no cover
    n = dst.size // itemsize
    for j in range(itemsize):
        base = j * n
        for i in range(n):
            dst[i * itemsize + j] = src[base + i]


@register_transform
class LosslessTransform(Transform):
    """Byte-shuffle + zstd/lz4 over any fixed-size numeric dtype."""

    name = "lossless"
    version = 1
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
        # worst case: incompressible data stored in raw blocks plus the codec's frame
        n = int(np.prod(shape)) * dtype.itemsize
        return n + n // 255 + 64

    def _planes(self, array: NDArray[np.generic]) -> NDArray[np.uint8]:
        raw = array.reshape(-1).view(np.uint8)
        if not self.shuffle or array.dtype.itemsize == 1:
            return raw
        dst = np.empty_like(raw)
        _shuffle(raw, dst, array.dtype.itemsize)
        return dst

    def _encode(self, array: NDArray[np.generic]) -> bytes:
        planes = self._planes(array)
        if self.codec == "zstd":
            out: bytes = zstandard.ZstdCompressor(level=self.level).compress(planes.data)
            return out
        packed: bytes = lz4.block.compress(planes, store_size=False)
        return packed

    def _decode(
        self, payload: NDArray[np.uint8], desc: TransformDescriptor, out: NDArray[np.generic]
    ) -> None:
        nbytes = out.nbytes
        try:
            if self.codec == "zstd":
                raw = zstandard.ZstdDecompressor().decompress(payload.data, max_output_size=nbytes)
            else:
                raw = lz4.block.decompress(payload, uncompressed_size=nbytes)
        except (zstandard.ZstdError, lz4.block.LZ4BlockError) as exc:
            raise TransformError(
                f"lossless/{self.codec} payload does not decompress: {exc}"
            ) from exc
        if len(raw) != nbytes:
            raise TransformError(
                f"lossless/{self.codec} payload decompressed to {len(raw)} bytes, expected {nbytes}"
            )
        src = np.frombuffer(raw, dtype=np.uint8)
        dst = out.reshape(-1).view(np.uint8)
        if not self.shuffle or out.dtype.itemsize == 1:
            np.copyto(dst, src)
        else:
            _unshuffle(src, dst, out.dtype.itemsize)
