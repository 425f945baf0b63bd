"""``kvlife.store.overlap.shared_pair`` against brute force: every element's bytes of
every buffer, on views of one base array (slices with steps, negative strides,
transposes, as_strided overlaps), in groups of two and of many, and with the run cap
forced down to its pairwise fallback."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from kvlife.native.spans import spans
from kvlife.store import overlap
from kvlife.store.overlap import shared_pair
from tests.helpers.memory_oracle import self_overlaps, share


def _truth(arrays: list[np.ndarray]) -> tuple[set[int], set[tuple[int, int]]]:
    selves = {i for i, a in enumerate(arrays) if self_overlaps(a)}
    pairs = {
        (i, j)
        for i in range(len(arrays))
        for j in range(i + 1, len(arrays))
        if share(arrays[i], arrays[j])
    }
    return selves, pairs


@st.composite
def views_of_one_base(draw: st.DrawFn) -> list[np.ndarray]:
    dtype = np.dtype(draw(st.sampled_from(["u1", "<f2", ">i4", "f8", "c16"])))
    base = np.zeros(draw(st.integers(8, 96)), dtype)
    out = []
    for _ in range(draw(st.integers(2, 6))):
        start = draw(st.integers(0, len(base) - 1))
        stop = draw(st.integers(start, len(base)))
        step = draw(st.sampled_from([1, 1, 2, 3, 5, -1, -2]))
        arr = base[start:stop:step] if step > 0 else base[start:stop][::step]
        kind = draw(st.sampled_from(["flat", "grid", "strided", "transposed"]))
        if kind == "grid" and arr.size >= 4 and arr.size % 2 == 0:
            arr = arr.reshape(2, -1)
        elif kind == "transposed" and arr.size >= 4 and arr.size % 2 == 0:
            arr = arr.reshape(2, -1).T
        elif kind == "strided" and arr.size:
            rows = draw(st.integers(1, 4))
            row_stride = draw(st.integers(0, 3)) * arr.itemsize
            width = draw(st.integers(1, max(1, min(arr.size, 4))))
            arr = as_strided(arr, shape=(rows, width), strides=(row_stride, arr.strides[0]))
        out.append(arr)
    return out


def _check(arrays: list[np.ndarray]) -> None:
    selves, pairs = _truth(arrays)
    got = shared_pair(arrays, spans(arrays))
    if not selves and not pairs:
        assert got is None
    elif got is None:
        raise AssertionError(f"missed: self {selves}, pairs {pairs}")
    elif got[0] == got[1]:
        assert got[0] in selves
    else:
        assert got in pairs


@given(views_of_one_base())
@settings(max_examples=500, deadline=None)
def test_shared_pair_agrees_with_brute_force(arrays: list[np.ndarray]) -> None:
    _check(arrays)


@given(views_of_one_base())
@settings(max_examples=500, deadline=None)
def test_the_runs_check_agrees_with_brute_force(arrays: list[np.ndarray]) -> None:
    """Groups of three or more cut into runs at once (as groups of more than 32 are)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(overlap, "PAIRWISE", 0)
        _check(arrays)


@given(views_of_one_base())
@settings(max_examples=200, deadline=None)
def test_the_pairwise_fallback_agrees_too(arrays: list[np.ndarray]) -> None:
    """With the run cap at one run, groups are checked pair by pair; a buffer whose
    strides do not prove it free of itself is refused (never accepted unchecked)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(overlap, "MAX_RUNS", 1)
        selves, pairs = _truth(arrays)
        got = shared_pair(arrays, spans(arrays))
    if got is None:
        assert not selves and not pairs
    elif got[0] != got[1]:
        assert got in pairs


def test_chunk_slices_of_one_kv_buffer() -> None:
    """The HF engine's outputs: token slices of one (layers, 2, heads, T, dim) buffer,
    every span overlapping every other: disjoint slices pass, an overlap is found."""
    buf = np.zeros((4, 2, 3, 64, 8), np.float16)
    slices = [buf[:, :, :, t : t + 8] for t in range(0, 64, 8)]
    assert shared_pair(slices, spans(slices)) is None
    bad = [*slices, buf[:, :, :, 20:28]]
    assert shared_pair(bad, spans(bad)) in {(2, 8), (3, 8)}
    many = [buf[:, :, :, t : t + 1] for t in range(64)]  # 64 buffers: cut into runs
    assert shared_pair(many, spans(many)) is None
    assert shared_pair([*many, buf[1, 0, 2, 40:42]], spans([*many, buf[1, 0, 2, 40:42]])) in {
        (40, 64),
        (41, 64),
    }
    mixed = [buf[0, 0, 0, :8], buf[1, 1, 2, 56:], buf[0, 0, 0, 4:6]]  # 0 and 2 share
    assert shared_pair(mixed, spans(mixed)) == (0, 2)
