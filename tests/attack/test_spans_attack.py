"""Attacks on where a load's buffers lie (issue 28, commits ab17c85 and 68922de):
``kvlife/native/_frames.c``'s ``spans`` reads each object's buffer (PyBUF_RECORDS_RO)
and gives ``(low, high, flags)`` as ``np.byte_bounds`` and ``ndarray.flags`` would;
``kvlife.native.spans`` wraps it with numpy as the fallback; ``check_outs`` (a load's
output buffers: writable, no two sharing memory), ``Loads._targets`` (which shared
buffer each output lies in) and the disk reader's ``_direct_runs`` (O_DIRECT pieces)
rest on it.

numpy is the oracle throughout (``byte_bounds``, ``flags``, ``np.shares_memory``), and
both paths (the extension, and numpy with the extension patched away) are held to it.
The promise held against: a wrong span must never let two chunks land in one piece of
memory (wrong KV served as success), nor a direct read land anywhere but in ``out``.

Found by this file, fixed after it (kvlife/store/overlap.py, kvlife/native/spans.py,
``spans`` in _frames.c):

* ``check_outs`` compared each buffer (sorted by low address) only with its predecessor
  and with the one reaching furthest: a buffer that overlapped an earlier one that was
  neither was missed, and a load into such buffers reported success with wrong KV
  (``test_check_outs_finds_an_overlap_with_a_buffer_that_is_neither_neighbour`` and the
  tests after it).
* A writable array numpy marks warn-on-write (``np.broadcast_arrays``' broadcast
  results) is exported read-only, so the extension called it read-only where numpy's
  flags and the fallback call it writable: the two paths disagreed, and check_outs'
  verdict depended on whether the extension is built. The flags now come from numpy.
* A zero-itemsize array with non-zero strides was C-contiguous to the extension
  (``PyBuffer_IsContiguous`` calls any buffer of length 0 contiguous) and not to numpy.
* An exporter that gives ``strides == NULL`` (ctypes arrays) had every stride taken as
  0 by the C function: a span of one item, whatever the array's length.
* Pre-existing, outside the seam: check_outs did not look inside one buffer, so a
  self-overlapping writable view was loaded into and wrong KV served; it is refused.
"""

from __future__ import annotations

import array
import ctypes
import gc
import mmap
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.array_utils import byte_bounds
from numpy.lib.stride_tricks import as_strided

from kvlife.client.loads import Loads
from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.native import frames
from kvlife.native.spans import Span, spans
from kvlife.store import KVStore
from kvlife.store.args import check_outs
from kvlife.tiers.buffers import ALIGN, aligned_empty
from kvlife.tiers.disk.reader import _direct_runs, _native_runs
from tests.conftest import TINY, prompt_kv

needs_native = pytest.mark.skipif(not frames.available(), reason="extension not built")
pytestmark = [
    # reading the writeable flag of a broadcast_arrays result warns; np.matrix warns
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),
]

PATHS = ["native", "numpy"]
"""``spans`` through the extension, and through numpy (the extension patched away)."""


@contextmanager
def path(which: str) -> Iterator[None]:
    """``which`` path for the block: "numpy" patches the extension away."""
    if which == "native":
        if not frames.available():
            pytest.skip("extension not built")
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frames, "native_module", lambda: None)
        yield


def oracle(arr: np.ndarray) -> Span:
    """numpy's answer: byte_bounds (an array with no element: an empty span at its data
    pointer) and the array's own flags."""
    flags = arr.flags
    if arr.size == 0:
        low = int(arr.__array_interface__["data"][0])
        return Span(low, low, bool(flags.writeable), bool(flags.c_contiguous))
    low, high = byte_bounds(arr)
    return Span(int(low), int(high), bool(flags.writeable), bool(flags.c_contiguous))


def agrees(got: Span, arr: np.ndarray) -> bool:
    want = oracle(arr)
    if (got.writable, got.c_contiguous) != (want.writable, want.c_contiguous):
        return False
    if arr.size == 0:
        return got.low == got.high
    return (got.low, got.high) == (want.low, want.high)


def native_raw(objs: Sequence[object]) -> list[Any]:
    module = frames.native_module()
    assert module is not None
    return cast(list[Any], module.spans(objs))


def shares_any(arrays: Sequence[np.ndarray]) -> bool:
    return any(
        a.size and b.size and np.shares_memory(a, b)
        for i, a in enumerate(arrays)
        for b in arrays[i + 1 :]
    )


# ---------------------------------------------------------------------------------------
# spans() against numpy on arrays whose buffer export might differ from numpy's view


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _view_of_readonly() -> np.ndarray:
    base = _readonly(np.arange(10.0))
    return base[1:7:2]


def _unaligned_f8() -> np.ndarray:
    raw = np.zeros(8 * 5 + 1, np.uint8)
    arr = raw[1:].view(np.float64)
    assert not arr.flags.aligned
    return arr


def _odd_strides() -> np.ndarray:
    raw = np.zeros(64, np.uint8)
    return np.ndarray((3, 2), np.dtype("<f8"), buffer=raw, offset=5, strides=(13, 3))


def _negative_odd_strides() -> np.ndarray:
    raw = np.zeros(200, np.uint8)
    return np.ndarray((4, 3), np.dtype(">i4"), buffer=raw, offset=120, strides=(-27, 7))


def _empty_with_strides() -> np.ndarray:
    return as_strided(np.zeros(10), shape=(0, 3), strides=(800, -8))


def _empty_negative_slice() -> np.ndarray:
    return np.arange(12.0).reshape(3, 4)[::-1, 2:2]


def _size_one_axes_odd_strides() -> np.ndarray:
    # C-contiguous for numpy (axes of length 1 do not count), whatever their strides
    arr = as_strided(np.zeros(12), shape=(1, 3, 1, 4), strides=(-1000, 32, 7, 8))
    assert arr.flags.c_contiguous
    return arr


def _memmap(tmp: Path, mode: Literal["r", "c", "w+"]) -> np.ndarray:
    file = tmp / f"mm-{mode}.bin"
    if not file.exists():
        file.write_bytes(bytes(80))
    mapped: np.ndarray = np.memmap(file, dtype="f8", mode=mode, shape=(10,))
    return mapped


EXOTIC: dict[str, Callable[[Path], np.ndarray]] = {
    "big-endian": lambda _: np.zeros((3, 2), ">f8"),
    "object": lambda _: np.empty(4, object),
    "datetime": lambda _: np.zeros(3, "M8[s]"),
    "timedelta-strided": lambda _: np.zeros(6, "m8[ns]")[::-2],
    "bool": lambda _: np.zeros(5, bool)[1::2],
    "complex": lambda _: np.zeros((2, 3), "c16").T,
    "longdouble": lambda _: np.zeros(3, np.longdouble),
    "clongdouble": lambda _: np.zeros(3, np.clongdouble)[::-1],
    "float16": lambda _: np.zeros(7, np.float16)[1:],
    "unicode": lambda _: np.zeros(3, "U3"),
    "bytes": lambda _: np.zeros(3, "S5")[::2],
    "void": lambda _: np.zeros(4, "V3"),
    "struct-packed": lambda _: np.zeros(3, [("a", "u1"), ("b", "<f8")]),
    "struct-aligned": lambda _: np.zeros(3, np.dtype([("a", "i4"), ("b", "u1")], align=True)),
    "struct-non-native": lambda _: np.zeros(3, [("a", ">i4"), ("b", "u1")]),
    "struct-object-field": lambda _: np.zeros(3, [("a", object), ("b", "u1")]),
    "struct-offsets-reversed": lambda _: np.zeros(
        3, np.dtype({"names": ["a", "b"], "formats": ["u1", "u1"], "offsets": [1, 0]})
    ),
    "field-view": lambda _: np.zeros(3, [("a", "u1"), ("b", "<f8")])["b"],
    "multi-field-view": lambda _: np.zeros(3, [("a", "u1"), ("b", "<f8"), ("c", "u2")])[["a", "c"]],
    "subarray-dtype": lambda _: np.zeros(3, [("a", "i4", (2,))]),
    "string-dtype": lambda _: np.array(["a", "bb"], dtype=np.dtypes.StringDType()),
    "recarray": lambda _: np.zeros(3, [("a", "u1"), ("b", "<f8")]).view(np.recarray),
    "0-d": lambda _: np.array(5.0),
    "0-d read-only": lambda _: _readonly(np.array(5.0)),
    "empty with strides": lambda _: _empty_with_strides(),
    "empty negative slice": lambda _: _empty_negative_slice(),
    "unaligned float64": lambda _: _unaligned_f8(),
    "strides not multiples of itemsize": lambda _: _odd_strides(),
    "negative odd strides": lambda _: _negative_odd_strides(),
    "size-1 axes odd strides": lambda _: _size_one_axes_odd_strides(),
    "as_strided overlap": lambda _: as_strided(np.zeros(8), shape=(4, 3), strides=(8, 8)),
    "broadcast_to": lambda _: np.broadcast_to(np.zeros(3), (4, 3)),
    "read-only": lambda _: _readonly(np.zeros((2, 2))),
    "view of read-only": lambda _: _view_of_readonly(),
    "frombuffer bytes": lambda _: np.frombuffer(b"abcdefgh", np.uint8),
    "frombuffer bytearray": lambda _: np.frombuffer(bytearray(16), np.uint16)[::3],
    "matrix": lambda _: np.asmatrix(np.zeros((3, 4)))[:, ::2],
    "masked": lambda _: np.ma.masked_array(np.zeros(6), mask=[False, True] * 3)[::2],
    "memmap w+": lambda tmp: _memmap(tmp, "w+")[::3],
    "memmap r": lambda tmp: _memmap(tmp, "r"),
    "memmap c": lambda tmp: _memmap(tmp, "c"),
}


@pytest.mark.parametrize("which", PATHS)
@pytest.mark.parametrize("name", sorted(EXOTIC))
def test_spans_are_numpys_on_exotic_arrays(tmp_path: Path, name: str, which: str) -> None:
    arr = EXOTIC[name](tmp_path)
    with path(which):
        got = spans([arr])
    assert len(got) == 1
    assert agrees(got[0], arr), (name, got[0], oracle(arr))


@needs_native
def test_the_extension_reads_the_exotic_arrays_itself_or_says_none(tmp_path: Path) -> None:
    """Where the extension answers at all it is numpy's answer (a None goes to the
    fallback); datetimes and dtypes the buffer protocol cannot spell export nothing."""
    arrs = {name: make(tmp_path) for name, make in EXOTIC.items()}
    raw = native_raw(list(arrs.values()))
    for (name, arr), got in zip(arrs.items(), raw, strict=True):
        if got is None:
            continue
        low, high, flags = got
        span = Span(low, high, bool(flags & 1), bool(flags & 2))
        assert agrees(span, arr), (name, span, oracle(arr))
    answered = {name for name, got in zip(arrs, raw, strict=True) if got is not None}
    assert {"big-endian", "object", "unaligned float64", "matrix", "memmap r"} <= answered
    assert "datetime" not in answered and "string-dtype" not in answered


@pytest.mark.parametrize("which", PATHS)
def test_a_warn_on_write_array_is_as_writable_as_numpy_says(which: str) -> None:
    """FAILS on the native path. ``np.broadcast_arrays`` gives its broadcast results
    writable (``flags.writeable`` True; a write warns) but numpy exports them read-only
    through the buffer protocol: the extension calls them read-only, numpy's flags and
    the fallback writable. check_outs then refuses such a buffer as read-only when the
    extension is built and accepts it when it is not; spans() promises numpy's flags,
    the same either way."""
    _, arr = np.broadcast_arrays(np.zeros((2, 3)), np.zeros(3))
    assert arr.flags.writeable
    with path(which):
        got = spans([arr])[0]
    assert got.writable == bool(arr.flags.writeable)
    assert agrees(got, arr)


@needs_native
def test_check_outs_gives_one_verdict_on_a_warn_on_write_buffer_by_either_path() -> None:
    """FAILS: the same buffers, the extension built or not, must get the same verdict."""
    plain = np.zeros((2, 3))
    _, arr = np.broadcast_arrays(plain, np.zeros(3))
    verdicts: list[str] = []
    for which in PATHS:
        with path(which):
            try:
                check_outs([arr, np.zeros(3)])
                verdicts.append("accepted")
            except InvalidArgument as e:
                verdicts.append(str(e))
    assert verdicts[0] == verdicts[1], verdicts


@pytest.mark.parametrize("which", PATHS)
def test_a_zero_itemsize_strided_array_is_not_contiguous(which: str) -> None:
    """FAILS on the native path: an array of a zero-itemsize dtype with stride 8 is not
    C-contiguous to numpy, but its buffer's length is 0 and ``PyBuffer_IsContiguous``
    calls every buffer of length 0 contiguous. (No bytes to read into, so no wrong KV;
    ``_direct_runs`` takes the one-piece path and reshapes a copy.)"""
    arr = as_strided(np.zeros(4, []), shape=(3,), strides=(8,))
    assert arr.itemsize == 0 and not arr.flags.c_contiguous
    with path(which):
        got = spans([arr])[0]
    assert agrees(got, arr), (got, oracle(arr))


# ---------------------------------------------------------------------------------------
# a property: arbitrary strided views of a raw buffer (odd offsets, odd and negative
# strides, every dtype kind the buffer protocol spells and some it does not)

DTYPES: list[Any] = [
    "u1",
    "?",
    "<i2",
    ">i4",
    "<f8",
    ">f8",
    "e",
    "c8",
    ">c16",
    "g",
    "M8[ms]",
    "m8[s]",
    "V5",
    "S3",
    "<U2",
    [("a", "u1"), ("b", ">f4")],
    np.dtype([("a", "u1"), ("b", "<i8")], align=True),
]


@st.composite
def raw_views(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(-40, 40), min_size=ndim, max_size=ndim))
    below = sum(-(n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0 and n)
    above = sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0 and n)
    offset = below + draw(st.integers(0, 7))
    flat = np.zeros(offset + above + dtype.itemsize + 8, np.uint8)
    arr = np.ndarray(tuple(shape), dtype, buffer=flat, offset=offset, strides=tuple(strides))
    if draw(st.booleans()):
        arr.flags.writeable = False
    return arr


@given(st.lists(raw_views(), min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_spans_are_numpys_on_raw_strided_views_by_either_path(arrays: list[np.ndarray]) -> None:
    got = spans(arrays)
    assert len(got) == len(arrays)
    assert all(map(agrees, got, arrays)), [(g, oracle(a)) for g, a in zip(got, arrays, strict=True)]
    with path("numpy"):
        again = spans(arrays)
    assert all(map(agrees, again, arrays))


# ---------------------------------------------------------------------------------------
# the C function on objects that are not arrays, and its references


@needs_native
def test_the_extension_on_buffers_that_are_not_arrays() -> None:
    """Any exporter: numpy's view of the same buffer (np.asarray of a memoryview keeps
    its memory and strides) is the oracle; an object that exports nothing is None."""
    mapping = mmap.mmap(-1, 4096)
    try:
        objs: list[Any] = [
            b"abcdef",
            bytearray(10),
            memoryview(b"abcdefgh")[::-3],
            memoryview(bytearray(24)).cast("i", (2, 3)),
            memoryview(bytearray(24)).cast("i", (2, 3))[::-1],
            memoryview(bytearray(8)).cast("d", ()),
            memoryview(b"")[:],
            array.array("d", [1.0, 2.0, 3.0]),
            mapping,
            np.float64(3.0),
        ]
        raw = native_raw(objs)
        for obj, got in zip(objs, raw, strict=True):
            assert got is not None, obj
            view = memoryview(obj)
            want = np.asarray(view)
            low, high, flags = got
            assert bool(flags & 1) == (not view.readonly), obj
            assert bool(flags & 2) == view.c_contiguous, obj
            if want.size == 0:
                assert low == high, obj
            else:
                assert (low, high) == tuple(byte_bounds(want)), obj
            view.release()
        nothing: list[Any] = [None, 5, 2.5, "str", [1, 2], (3,), object(), {1: 2}]
        assert native_raw(nothing) == [None] * len(nothing)
    finally:
        mapping.close()  # BufferError if an export were left unreleased


@needs_native
def test_the_extension_on_an_exporter_that_gives_no_strides() -> None:
    """FAILS: ctypes arrays export their buffer with ``strides == NULL`` even when
    strides are asked for (the buffer protocol's way of saying C-contiguous); the C
    function then takes every stride as 0, and a 3-int array spans 4 bytes, a 2x3 one
    4 as well, instead of 12 and 24."""
    for obj in ((ctypes.c_int * 3)(), (ctypes.c_int * 3 * 2)(), (ctypes.c_double * 5)()):
        view = memoryview(obj)
        low = ctypes.addressof(obj)
        assert native_raw([obj]) == [(low, low + view.nbytes, 3)], obj
        view.release()


@needs_native
def test_the_extension_releases_every_buffer_it_reads() -> None:
    grow = bytearray(8)
    view = memoryview(bytearray(16))
    mapping = mmap.mmap(-1, 4096)
    native_raw([grow, view, mapping, grow])
    grow.extend(b"more")  # BufferError while an export is held
    view.release()
    mapping.close()
    assert len(grow) == 12


@needs_native
def test_the_extension_wants_a_sequence_and_takes_any_sequence() -> None:
    module = frames.native_module()
    assert module is not None
    for bad in (5, None, 2.5, object()):
        with pytest.raises(TypeError):
            module.spans(bad)
    a = np.zeros(5)
    want = native_raw([a, a])
    assert native_raw((a, a)) == want
    assert module.spans(x for x in (a, a)) == want
    assert native_raw([]) == []
    rows = np.arange(6.0).reshape(2, 3)  # a 2-d array is a sequence of its rows
    assert native_raw(cast(Any, rows)) == native_raw([rows[0], rows[1]])
    assert native_raw(cast(Any, "ab")) == [None, None]


@needs_native
def test_the_extension_keeps_no_references() -> None:
    a = np.zeros(5)
    objs: list[Any] = [a, None, a[::-1], 7, b"xy", a]
    gc.collect()
    gc.disable()  # no collection frees a None-holding object while None is counted
    try:
        before = [sys.getrefcount(o) for o in (a, None, b"xy")]
        for _ in range(5000):
            out = native_raw(objs)
        del out
        after = [sys.getrefcount(o) for o in (a, None, b"xy")]
    finally:
        gc.enable()
    assert after[0] == before[0] and after[2] == before[2]
    assert abs(after[1] - before[1]) < 100  # a leaked None a call: 5000 or more
    result = native_raw([a])
    twin = [tuple(int(x) for x in result[0])]  # built in Python: the counts to expect
    assert sys.getrefcount(result) == sys.getrefcount(twin)
    assert sys.getrefcount(result[0]) == sys.getrefcount(twin[0])
    assert all(
        sys.getrefcount(x) == sys.getrefcount(y)
        for x, y in zip(result[0], twin[0], strict=True)
        if x > 256
    )


@needs_native
def test_many_arrays_in_one_call() -> None:
    arrays = [np.zeros(3)[::-1] if i % 2 else np.zeros(i % 5) for i in range(20_000)]
    got = spans(arrays)
    assert len(got) == len(arrays)
    assert all(map(agrees, got[::997], arrays[::997]))


@needs_native
def test_huge_strides_do_not_crash_the_extension() -> None:
    """as_strided views whose reach passes 2**63 (no memory behind them: never read).
    The extension's (shape-1)*stride is a signed overflow in C and its answer is not
    byte_bounds' (Python ints); only that it answers, within a machine word, is held."""
    x = np.zeros(1)
    for shape, strides in [((2**32 + 1,), (2**32,)), ((2**32 + 1,), (-(2**32),))]:
        y = as_strided(x, shape=shape, strides=strides)
        (got,) = native_raw([y])
        low, high, _ = got
        assert 0 <= low < 2**64 and 0 <= high < 2**64


@pytest.mark.parametrize("which", PATHS)
def test_spans_follow_an_array_mutated_between_calls(which: str) -> None:
    """numpy caches an array's buffer info: a reshape in place, new strides, a cleared
    or restored writeable flag must show in the next call."""
    a = np.zeros(12)
    with path(which):
        assert agrees(spans([a])[0], a)
        a.shape = (3, 4)
        assert agrees(spans([a])[0], a)
        b = a[:, ::2]
        assert agrees(spans([b])[0], b)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            b.strides = (8, 8)
        assert agrees(spans([b])[0], b) and not spans([b])[0].c_contiguous
        a.flags.writeable = False
        assert not spans([a])[0].writable
        a.flags.writeable = True
        assert spans([a])[0].writable
        a.shape = (12,)
        assert agrees(spans([a])[0], a)


# ---------------------------------------------------------------------------------------
# check_outs: exactly what np.shares_memory and the writeable flag refuse


def _neither_neighbour() -> list[np.ndarray]:
    """Three uint8 views of one base: A touches bytes 0 and 50, B bytes 10 and 99, C
    byte 50. Sorted by low address: A, B, C; B reaches furthest, so C is compared with
    B only, and A (which shares byte 50 with C) with nothing after B."""
    base = np.zeros(100, np.uint8)
    return [base[0:51:50], base[10:100:89], base[50:51]]


@pytest.mark.parametrize("which", PATHS)
def test_check_outs_finds_an_overlap_with_a_buffer_that_is_neither_neighbour(
    which: str,
) -> None:
    """FAILS (both paths): outs 0 and 2 share a byte, check_outs accepts them."""
    outs = _neither_neighbour()
    assert np.shares_memory(outs[0], outs[2])
    assert not np.shares_memory(outs[0], outs[1]) and not np.shares_memory(outs[1], outs[2])
    with path(which), pytest.raises(InvalidArgument, match="share memory"):
        check_outs(outs)


@pytest.mark.parametrize("which", PATHS)
def test_check_outs_finds_it_among_kv_shaped_views(which: str) -> None:
    """FAILS (both paths): the same with float views of a 2-d buffer: column 0 of rows
    0-1, column 1 of rows 0 and 2, row 1's first two; outs 0 and 2 share ``base[1, 0]``."""
    base = np.zeros((3, 4))
    outs = [base[:2, 0], base[::2, 1], base[1, :2]]
    assert np.shares_memory(outs[0], outs[2])
    with path(which), pytest.raises(InvalidArgument, match="share memory"):
        check_outs(outs)


def test_a_load_into_buffers_that_share_memory_is_refused(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """FAILS: end to end, a load into three chunk-shaped strided views of one buffer,
    where outs 0 and 2 share one element (out 0's last, out 2's first) and out 1 (in
    between, reaching furthest) shares nothing, reports every chunk loaded while out 0
    holds chunk 2's first value: wrong KV served as success."""
    n = TINY.tokens_per_chunk
    tokens, kv = prompt_kv(1, 3 * n)
    size = int(np.prod(TINY.chunk_shape))
    base = np.zeros(6 * size, np.float16)
    outs = [
        base[0::3][:size].reshape(TINY.chunk_shape),
        base[1::3][:size].reshape(TINY.chunk_shape),
        base[3 * (size - 1) :: 3][:size].reshape(TINY.chunk_shape),
    ]
    assert all(np.shares_memory(o, base) for o in outs)
    assert np.shares_memory(outs[0], outs[2]) and not shares_any(outs[:2])
    assert not np.shares_memory(outs[1], outs[2])
    store = KVStore.open(
        tmp_path, dram_bytes=8 * TINY.chunk_nbytes, disk_bytes=1 << 24, segment_bytes=1 << 20
    )
    with store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens)
        assert len(hit.hits) == 3
        try:
            store.load(hit, outs)
        except InvalidArgument:
            return
        want = [kv[:, :, :, i * n : (i + 1) * n, :] for i in range(3)]
        wrong = [i for i in range(3) if not np.array_equal(outs[i], want[i])]
        pytest.fail(f"load accepted buffers sharing memory; chunks {wrong} hold wrong KV")


@st.composite
def strided_views(draw: st.DrawFn) -> list[np.ndarray]:
    """1-d and 2-d strided views (steps of either sign) of one small base."""
    base = np.zeros(64, np.uint8)
    out: list[np.ndarray] = []
    for _ in range(draw(st.integers(2, 6))):
        start = draw(st.integers(0, 63))
        step = draw(st.sampled_from([1, 2, 3, 5, 7, 11, 17, -1, -3, -13]))
        count = draw(st.integers(0, 8))
        view = base[start::step][:count]
        if view.size >= 4 and view.size % 2 == 0 and draw(st.booleans()):
            view = view.reshape(2, -1)[:, :: draw(st.sampled_from([1, -1]))]
        out.append(view)
    return out


@pytest.mark.parametrize("which", PATHS)
@given(outs=strided_views())
@settings(max_examples=400, deadline=None)
def test_check_outs_refuses_exactly_the_buffers_that_share_memory(
    which: str, outs: list[np.ndarray]
) -> None:
    """FAILS (both paths, same bug): views of one base, refused iff two share memory."""
    with path(which):
        if shares_any(outs):
            with pytest.raises(InvalidArgument, match="share memory"):
                check_outs(outs)
        else:
            check_outs(outs)


@pytest.mark.parametrize("which", PATHS)
def test_check_outs_names_the_buffers_by_their_place_among_nones(which: str) -> None:
    a = np.zeros(8)
    with path(which):
        with pytest.raises(InvalidArgument, match="output buffers 1 and 3 share memory"):
            check_outs([None, a[::2], None, a[2:4], np.zeros(8)])
        with pytest.raises(InvalidArgument, match="output buffer 2 is read-only"):
            check_outs([None, np.zeros(2), _readonly(np.zeros(2))])
        with pytest.raises(InvalidArgument, match="output buffer 1 is read-only"):
            check_outs([np.zeros(2), _view_of_readonly()])


@pytest.mark.parametrize("which", PATHS)
def test_check_outs_accepts_what_shares_nothing(which: str) -> None:
    """Interleaved strides, empty arrays (even one passed twice, even inside another:
    they share no memory), views at odd offsets, and unrelated arrays pass."""
    base = np.zeros(40)
    empty = base[5:5]
    raw = np.zeros(81, np.uint8)
    outs: list[np.ndarray | None] = [
        base[0::2],
        base[1::2],
        empty,
        empty,
        base[3:3],
        None,
        raw[1:41].view(np.float64),
        raw[41:81].view(np.float64)[::-1],
        np.ascontiguousarray(np.zeros((2, 3)).T).T,
    ]
    with path(which):
        check_outs(outs)


@pytest.mark.parametrize("which", PATHS)
def test_check_outs_refuses_what_is_not_an_array_or_read_only(which: str, tmp_path: Path) -> None:
    a = np.zeros(4)
    with path(which):
        for bad in (bytearray(8), memoryview(bytearray(8)), [0.0, 1.0], 3.0):
            with pytest.raises(InvalidArgument, match="not an array"):
                check_outs([a, cast(Any, bad)])
        for ro in (
            np.broadcast_to(np.zeros(3), (2, 3)),
            np.frombuffer(b"12345678", np.uint8),
            _memmap(tmp_path, "r"),
            _readonly(np.array(1.0)),
        ):
            with pytest.raises(InvalidArgument, match="read-only"):
                check_outs([a, ro])
        check_outs([a, _memmap(tmp_path, "c"), _memmap(tmp_path, "w+")])


def test_a_self_overlapping_output_buffer_is_refused(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    n = TINY.tokens_per_chunk
    tokens, kv = prompt_kv(2, 2 * n)
    flat = np.zeros(int(np.prod(TINY.chunk_shape)), np.float16)
    inner = flat.reshape(TINY.chunk_shape).strides
    aliased = as_strided(flat, shape=TINY.chunk_shape, strides=(0, *inner[1:]))
    assert aliased.flags.writeable
    store = KVStore.open(
        tmp_path, dram_bytes=8 * TINY.chunk_nbytes, disk_bytes=1 << 24, segment_bytes=1 << 20
    )
    with store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        hit = store.lookup(identity, PUBLIC, tokens)
        outs = [aliased, np.empty(TINY.chunk_shape, np.float16)]
        with pytest.raises(InvalidArgument, match="output buffer 0 overlaps itself"):
            store.load(hit, outs)  # else: wrong KV served as success


# ---------------------------------------------------------------------------------------
# the disk reader's pieces: a direct read lands in ``out``'s memory, in C order


def _aligned_views(draw: st.DrawFn) -> np.ndarray:
    """Views of an aligned (layers, 2, heads, tokens, dim) uint16 buffer: whole, a
    token range, reversed or transposed axes, an offset that breaks alignment."""
    shape = (2, 2, 2, 8, 1024)  # one token row of one head: 2 KiB
    buf = aligned_empty(int(np.prod(shape)) * 2 + 2 * ALIGN).view(np.uint16)
    skip = draw(st.sampled_from([0, 0, 1, 2048]))
    arr = buf[skip : skip + int(np.prod(shape))].reshape(shape)
    kind = draw(st.sampled_from(["whole", "tokens", "reversed", "transposed", "rows"]))
    if kind == "tokens":
        t0 = draw(st.integers(0, 7))
        arr = arr[:, :, :, t0 : draw(st.integers(t0, 8)), :]
    elif kind == "reversed":
        arr = arr[::-1]
    elif kind == "transposed":
        arr = arr.transpose(1, 0, 2, 3, 4)
    elif kind == "rows":
        arr = arr[:, :, :, ::2, :]
    return arr


@st.composite
def aligned_views(draw: st.DrawFn) -> np.ndarray:
    return _aligned_views(draw)


def _lands_in_order(out: np.ndarray, runs: list[np.ndarray]) -> None:
    """Bytes written through the runs, in order, are ``out``'s bytes in C order."""
    total = sum(r.nbytes for r in runs)
    assert total == out.nbytes
    pattern = (np.arange(total, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)
    at = 0
    for run in runs:
        assert run.flags.writeable and run.dtype == np.uint8 and run.ndim == 1
        assert run.flags.c_contiguous and np.shares_memory(run, out)
        lo, hi = byte_bounds(run)
        olo, ohi = byte_bounds(out)
        assert olo <= lo and hi <= ohi
        assert lo % ALIGN == 0 and run.nbytes % ALIGN == 0
        run[:] = pattern[at : at + run.nbytes]
        at += run.nbytes
    assert np.array_equal(np.ascontiguousarray(out).view(np.uint8).reshape(-1), pattern)


@pytest.mark.parametrize("which", PATHS)
@given(out=aligned_views())
@settings(max_examples=80, deadline=None)
def test_direct_runs_land_in_out_in_c_order(which: str, out: np.ndarray) -> None:
    with path(which):
        runs = _direct_runs(out)
        given_span = _direct_runs(out, spans([out])[0])
    numpy_says = oracle(out)
    assert (runs is None) == (given_span is None)
    if numpy_says.c_contiguous and out.nbytes:
        single = numpy_says.low % ALIGN == 0 and out.nbytes % ALIGN == 0
        assert (runs is not None and len(runs) == 1) == single
    if runs is not None and out.nbytes:
        _lands_in_order(out, runs)


@pytest.mark.parametrize("which", PATHS)
def test_native_runs_match_each_buffer_with_its_own_span(which: str) -> None:
    """One spans() call for the buffers that are not None, handed out in order: a
    mismatch would pair one buffer with another's address."""
    shape = (2, 4096)
    a = aligned_empty(2 * 4096)
    b = aligned_empty(2 * 4096 + ALIGN)[1 : 1 + 2 * 4096]  # C-contiguous, not aligned
    c = aligned_empty(2 * 4096)
    outs: list[np.ndarray | None] = [None, a.reshape(shape), None, c.reshape(shape)]
    with path(which):
        runs = _native_runs(outs)
        assert runs is not None
        assert runs[0] is None and runs[2] is None
        for out, got in zip(outs, runs, strict=True):
            if out is not None:
                assert got is not None
                _lands_in_order(out, got)
        staged = _native_runs([None, b.reshape(shape), a.reshape(shape)])
        assert staged is not None and staged[0] is None and staged[1] is None  # b: staged
        assert staged[2] is not None
        _lands_in_order(a.reshape(shape), staged[2])
        pieces = aligned_empty(4 * 8192).reshape(2, 2, 8192)[:, :, :4096]  # 4 aligned runs
        assert _native_runs([a.reshape(shape), pieces]) is None


# ---------------------------------------------------------------------------------------
# the client's shared-buffer targets: the right buffer and offset, or None

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, dtype="float16", tokens_per_chunk=2)


def _loads(buffers: list[tuple[int, int, int, object]]) -> Loads:
    wire = SimpleNamespace(conn=SimpleNamespace(buffers=buffers))
    return Loads(cast(Any, wire))


@pytest.mark.parametrize("which", PATHS)
@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_targets_give_the_buffer_and_offset_of_contiguous_outputs_only(
    which: str, data: st.DataObject
) -> None:
    shape = LAYOUT.chunk_shape
    chunk = int(np.prod(shape))
    shared = [np.zeros(6 * chunk, np.float16), np.zeros(3 * chunk, np.float16)]
    buffers: list[tuple[int, int, int, object]] = [
        (int(s.ctypes.data), s.nbytes, 10 + i, None) for i, s in enumerate(shared)
    ]
    outs: list[np.ndarray] = []
    want: list[int] | None = []
    for _ in range(data.draw(st.integers(1, 4))):
        which_buf = data.draw(st.integers(0, 2))  # 2: private memory
        kind = data.draw(st.sampled_from(["contiguous", "flipped", "strided", "size-1 axis"]))
        src = shared[which_buf] if which_buf < 2 else np.zeros(3 * chunk, np.float16)
        start = data.draw(st.integers(0, src.size - 2 * chunk))
        if kind == "contiguous":
            out = src[start : start + chunk].reshape(shape)
        elif kind == "size-1 axis":  # C-contiguous for numpy: the length-1 layer axis
            inner = src[start : start + chunk].reshape(shape)
            out = as_strided(inner, shape=shape, strides=(-4096, *inner.strides[1:]))
        elif kind == "flipped":
            out = src[start : start + chunk].reshape(shape)[:, ::-1]
        else:
            out = src[start : start + 2 * chunk : 2].reshape(shape)
        outs.append(out)
        contiguous = kind in ("contiguous", "size-1 axis")
        if want is not None and contiguous and which_buf < 2:
            want += [10 + which_buf, int(out.ctypes.data) - buffers[which_buf][0]]
        else:
            want = None
    with path(which):
        got = _loads(buffers)._targets(outs, LAYOUT)
    assert got == want
    if got is not None:  # each offset is where the output's bytes really are
        for out, (bid, off) in zip(outs, zip(got[::2], got[1::2], strict=True), strict=True):
            src = shared[bid - 10]
            assert np.shares_memory(out, src)
            view = src.view(np.uint8)[off : off + out.nbytes]
            assert view.ctypes.data == byte_bounds(out)[0]


@pytest.mark.parametrize("which", PATHS)
def test_targets_refuse_an_output_reaching_past_its_buffer(which: str) -> None:
    shape = LAYOUT.chunk_shape
    chunk = int(np.prod(shape))
    big = np.zeros(3 * chunk, np.float16)
    buffers: list[tuple[int, int, int, object]] = [
        (int(big.ctypes.data), 2 * chunk * 2 - 2, 1, None)
    ]
    inside = big[chunk - 1 : 2 * chunk - 1].reshape(shape)
    past = big[chunk : 2 * chunk].reshape(shape)  # its last element is outside
    with path(which):
        assert _loads(buffers)._targets([inside], LAYOUT) == [1, (chunk - 1) * 2]
        assert _loads(buffers)._targets([past], LAYOUT) is None
        assert _loads(buffers)._targets([inside.astype(np.float32)], LAYOUT) is None
