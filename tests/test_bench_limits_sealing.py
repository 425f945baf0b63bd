"""The verified put's ceilings that ``kvlife bench server`` measures beside its put points
(:func:`kvlife.bench.limits.sealed_copy`, :class:`kvlife.bench.limits.SplitSealer`): they
copy every byte and hash every byte, or they are not the ceiling of a verified put."""

from __future__ import annotations

import threading
from unittest import mock

import numpy as np
import pytest
import xxhash

from kvlife.bench.limits import SplitSealer, sealed_copy
from kvlife.native import copies as native_copies


def _objects(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, n, dtype=np.uint16) for n in sizes]


@pytest.mark.parametrize("piece", [1 << 12, 3 * (1 << 12) + 2, 1 << 20])
def test_the_split_sealer_copies_and_hashes_every_byte(piece: int) -> None:
    src = _objects([1 << 15, 5000, 1], 1)
    dst = [np.zeros_like(s) for s in src]
    hashed: list[bytes] = []
    real = xxhash.xxh3_128_digest

    def spy(data: memoryview) -> bytes:
        # the sealer's own calls only: the first copy may load the native extension,
        # which checks its hash against this function on samples of its own
        if threading.current_thread().name == "split-sealer":
            hashed.append(bytes(data))
        return real(data)

    with mock.patch.object(xxhash, "xxh3_128_digest", spy), SplitSealer(piece) as sealer:
        took = sealer.copy(dst, src)
    assert took > 0
    for d, s in zip(dst, src, strict=True):
        assert np.array_equal(d, s)
    # every piece hashed, in order, from the destination: together the copied bytes
    assert b"".join(hashed) == b"".join(s.tobytes() for s in src)


def test_the_one_thread_ceiling_copies_and_seals_every_object() -> None:
    src = _objects([1 << 17, 4096, 777], 2)
    dst = [np.zeros_like(s) for s in src]
    sealed: list[tuple[bytes, bytes]] = []
    real = native_copies.copy_sealed

    def spy(d: np.ndarray, s: np.ndarray) -> bytes:
        seal = real(d, s)
        sealed.append((d.tobytes(), seal))
        return seal

    with mock.patch.object(native_copies, "copy_sealed", spy):
        assert sealed_copy(dst, src) > 0
    assert [np.array_equal(d, s) for d, s in zip(dst, src, strict=True)] == [True] * 3
    # every object copied and sealed once, in order, with the digest of its bytes
    assert [b for b, _ in sealed] == [s.tobytes() for s in src]
    assert [seal for _, seal in sealed] == [xxhash.xxh3_128_digest(s.tobytes()) for s in src]


def test_the_split_sealer_refuses_a_destination_it_could_not_write_in_place() -> None:
    src = _objects([64], 3)
    dst = [np.zeros((64, 2), np.uint16)[:, 0]]
    with SplitSealer(16) as sealer, pytest.raises(ValueError, match="contiguous"):
        sealer.copy(dst, src)
