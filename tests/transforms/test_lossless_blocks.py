"""Lossless planes cut into blocks (compressed in parallel): bit-exact round trips across
block edges, and a damaged block table is a typed error even when re-checksummed."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.transforms import EncodedPayload, TransformDescriptor, TransformError, decode, lossless
from kvlife.transforms.registry import make_transform


def _kv(n: int, dtype: type[np.generic], seed: int = 0) -> np.ndarray:
    x = np.cumsum(np.random.default_rng(seed).standard_normal((1, 2, 2, n, 16)), axis=3) * 0.1
    return x.astype(dtype)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 300),
    block=st.integers(64, 3000),
    f16=st.booleans(),
    codec=st.sampled_from(["zstd", "lz4"]),
)
def test_blocks_round_trip_bit_exact(n: int, block: int, f16: bool, codec: str) -> None:
    x = _kv(n, np.float16 if f16 else np.float32)
    old = lossless.BLOCK
    lossless.BLOCK = block
    try:
        enc = make_transform("lossless", {"codec": codec}).encode(x)
    finally:
        lossless.BLOCK = old
    out = np.empty_like(x)
    decode(EncodedPayload.from_frame(enc.to_frame()), out)  # decoder reads the block size
    assert np.array_equal(out.view(np.uint8), x.view(np.uint8))


def _resign(enc: EncodedPayload, payload: bytes) -> EncodedPayload:
    d = enc.descriptor
    p = np.frombuffer(payload, np.uint8)
    desc = TransformDescriptor(
        d.name, d.version, d.dtype, d.shape, d.params, p.size, xxhash.xxh3_64_intdigest(p.data)
    )
    return EncodedPayload(desc, p)


def test_forged_block_table_is_typed_error() -> None:
    x = _kv(2000, np.float16)
    old = lossless.BLOCK
    lossless.BLOCK = 4096
    try:
        enc = make_transform("lossless").encode(x)
    finally:
        lossless.BLOCK = old
    payload = bytes(enc.payload_view())
    kinds = [struct.unpack_from("<BQ", payload, 9 * j)[0] for j in range(2)]
    assert 1 in kinds  # the high byte plane is compressed, in several blocks
    j = kinds.index(1)
    start = 18 + sum(struct.unpack_from("<BQ", payload, 9 * i)[1] for i in range(j))
    nblk, block = struct.unpack_from("<II", payload, start)
    assert nblk > 1 and block == 4096
    out = np.empty_like(x)
    for offset, value in ((0, nblk + 1), (4, 1000), (8, 3), (12, 1 << 30)):
        bad = bytearray(payload)
        struct.pack_into("<I", bad, start + offset, value)
        with pytest.raises(TransformError):
            decode(_resign(enc, bytes(bad)), out)


@pytest.mark.parametrize("f16", [True, False])
def test_raw_plane_after_a_compressed_one_moves_down_intact(f16: bool) -> None:
    # low bytes constant (compressible), the others random (stored raw): the raw planes
    # are moved down over the bytes the compressed plane no longer needs
    rng = np.random.default_rng(5)
    dt = np.uint16 if f16 else np.uint32
    bits = rng.integers(0, np.iinfo(dt).max, (2, 2, 3, 700, 8), dtype=dt) & ~dt(0xFF)
    old = lossless.BLOCK
    lossless.BLOCK = 1000
    try:
        enc = make_transform("lossless").encode(bits)
    finally:
        lossless.BLOCK = old
    payload = bytes(enc.payload_view())
    k = bits.dtype.itemsize
    kinds = [struct.unpack_from("<BQ", payload, 9 * j)[0] for j in range(k)]
    assert kinds[0] == 1 and kinds[-1] == 0
    out = np.empty_like(bits)
    decode(enc, out)
    assert np.array_equal(out, bits)
