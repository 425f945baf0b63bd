"""Recompute-only records: round trip, verification, unknown version."""

from __future__ import annotations

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.transforms.base import TransformError, UnknownTransform
from kvlife.transforms.recompute import RecomputeRecord, prefill_flops


@given(
    start=st.integers(0, 1 << 40),
    tokens=st.integers(0, 1 << 20),
    seconds=st.floats(0, 1e6, allow_nan=False),
)
def test_round_trip(start: int, tokens: int, seconds: float) -> None:
    rec = RecomputeRecord(start, tokens, prefill_flops(135_000_000, tokens), seconds)
    assert RecomputeRecord.from_bytes(rec.to_bytes()) == rec


def test_damage_and_unknown_version() -> None:
    data = bytearray(RecomputeRecord(0, 512, 1e12, 0.05).to_bytes())
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        with pytest.raises(TransformError):
            RecomputeRecord.from_bytes(bytes(damaged))
    with pytest.raises(TransformError):
        RecomputeRecord.from_bytes(bytes(data[:5]))
    body = msgpack.packb(["recompute", 2, 0, 512, 1e12, 0.05])
    future = b"KVRC" + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body
    with pytest.raises(UnknownTransform):
        RecomputeRecord.from_bytes(future)


def test_invariants() -> None:
    with pytest.raises(InvalidArgument):
        RecomputeRecord(0, -1, 0.0, 0.0)
    with pytest.raises(InvalidArgument):
        RecomputeRecord(0, 1, float("nan"), 0.0)
    with pytest.raises(InvalidArgument):
        prefill_flops(-1, 3)
