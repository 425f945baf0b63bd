"""``kvlife.native.spans``: where arrays lie, through the C extension and through numpy,
held to ``np.byte_bounds`` and ``ndarray.flags`` on every kind of view (the overlap
check of a load's output buffers rests on it: a wrong span lets two chunks land in one
buffer)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.array_utils import byte_bounds

from kvlife.core.errors import InvalidArgument
from kvlife.native import frames
from kvlife.native.spans import Span, c_address, spans
from kvlife.store.args import check_outs
from tests.helpers.memory_oracle import self_overlaps

needs_native = pytest.mark.skipif(not frames.available(), reason="extension not built")


def _agrees(got: Span, arr: np.ndarray) -> bool:
    """numpy's answer: byte_bounds for an array with elements (one with none: an empty
    span), and the array's own flags."""
    flags = (bool(arr.flags.writeable), bool(arr.flags.c_contiguous))
    if (got.writable, got.c_contiguous) != flags:
        return False
    if arr.size == 0:
        return got.low == got.high
    return (got.low, got.high) == tuple(byte_bounds(arr))


DTYPES = ["u1", "<i2", ">i4", "f8", "c16", "V3", [("a", "u1"), ("b", "<f4")]]


@st.composite
def bases(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    return np.zeros(shape, dtype)


@st.composite
def views(draw: st.DrawFn, base: np.ndarray | None = None) -> np.ndarray:
    """A view of a base array: slices with steps (negative too), transposes,
    broadcasts (zero strides, read-only), as_strided overlaps, read-only flags."""
    arr = draw(bases()) if base is None else base
    for axis in range(arr.ndim):
        n = arr.shape[axis]
        start = draw(st.integers(0, max(n - 1, 0)))
        step = draw(st.sampled_from([1, 2, 3, -1, -2]))
        idx = [slice(None)] * arr.ndim
        idx[axis] = slice(start, None, step) if step > 0 else slice(None, None, step)
        arr = arr[tuple(idx)]
    kind = draw(st.sampled_from(["plain", "transpose", "broadcast", "strided", "readonly"]))
    if kind == "transpose":
        arr = arr.transpose(draw(st.permutations(list(range(arr.ndim)))))
    elif kind == "broadcast" and arr.size:
        arr = np.broadcast_to(arr, (draw(st.integers(1, 3)), *arr.shape))
    elif kind == "strided" and arr.size:
        step = draw(st.integers(0, 2)) * arr.itemsize
        arr = np.lib.stride_tricks.as_strided(arr, shape=(draw(st.integers(1, 4)), *arr.shape),
                                              strides=(step, *arr.strides))  # fmt: skip
    elif kind == "readonly":
        arr = arr.view()
        arr.flags.writeable = False
    return arr


@given(st.lists(views(), min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_spans_are_numpys_by_either_path(arrays: list[np.ndarray]) -> None:
    got = spans(arrays)
    assert len(got) == len(arrays) and all(map(_agrees, got, arrays))
    with pytest.MonkeyPatch.context() as mp:  # the extension missing: numpy's path
        mp.setattr(frames, "native_module", lambda: None)
        got = spans(arrays)
    assert len(got) == len(arrays) and all(map(_agrees, got, arrays))


@given(views())
@settings(max_examples=300, deadline=None)
def test_c_address_is_ctypes_data_of_a_c_contiguous_array_by_either_path(arr: np.ndarray) -> None:
    """The shared-memory arena's offsets (issue 28): what ``ndarray.ctypes.data`` gives
    for every C-contiguous view, the extension present or not; None for any other."""
    want = int(arr.ctypes.data) if arr.flags.c_contiguous else None
    assert c_address(arr) == want
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frames, "native_module", lambda: None)
        assert c_address(arr) == want


@needs_native
def test_the_extension_reads_them_itself_and_gives_none_for_what_exports_no_buffer() -> None:
    module = frames.native_module()
    assert module is not None
    arrs = [np.arange(12.0).reshape(3, 4)[::-1, ::2], np.zeros(0), np.zeros((2, 3)).T]
    got = [Span(lo, hi, bool(f & 1), bool(f & 2)) for lo, hi, f in module.spans(arrs)]
    assert all(map(_agrees, got, arrs))
    dates = np.zeros(3, "M8[s]")  # numpy exports no buffer for datetimes: numpy's answer
    assert module.spans([dates]) == [None]
    assert _agrees(spans([dates])[0], dates)
    with pytest.raises(TypeError):
        module.spans(5)


def test_without_the_extension_spans_come_from_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "native_module", lambda: None)
    arrs = [np.zeros((4, 4))[:, 1::2], np.ones(3)]
    assert all(map(_agrees, spans(arrs), arrs))


@st.composite
def views_of_one_base(draw: st.DrawFn) -> list[np.ndarray]:
    base = draw(bases())
    return draw(st.lists(views(base), min_size=2, max_size=5))


@given(views_of_one_base())
@settings(max_examples=300, deadline=None)
def test_check_outs_refuses_exactly_what_numpy_says_overlaps_or_is_read_only(
    arrays: list[np.ndarray],
) -> None:
    """The load's buffer check, on spans: read-only, sharing memory with another (views
    of one base array) or with itself, is refused; anything else passes (np.shares_memory
    and every element's bytes decide overlaps exactly)."""
    readonly = any(not a.flags.writeable for a in arrays)
    shared = any(
        a.size and b.size and np.shares_memory(a, b)
        for i, a in enumerate(arrays)
        for b in arrays[i + 1 :]
    )
    if readonly or shared or any(map(self_overlaps, arrays)):
        with pytest.raises(InvalidArgument):
            check_outs(arrays)
    else:
        check_outs(arrays)
