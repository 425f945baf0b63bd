"""Attacks on the streaming copy's strided sources (commit 364bc3c):
kvlife/native/_frames.c ``stream_copy(dst, src) -> bool`` now takes ``src`` as any
strided buffer (``PyBUF_STRIDES``), finds its innermost contiguous run (trailing axes
whose stride equals the run so far), walks the outer axes in C order and streams each
run of at least ``STREAM_RUN`` bytes into the C-contiguous ``dst``; it returns False,
copying nothing, for an empty source, a short run, more than 64 outer axes or a source
whose byte span meets ``dst``'s. kvlife/native/copies.py calls it for ndarrays and
falls back to ``np.copyto``; a served put's client (kvlife/client/puts.py) hands it the
strided chunk views of one KV tensor.

The promises under attack: for every strided source (negative strides, stride 0, odd
strides on length-1 axes, Fortran order, permuted axes, rows that overlap one another,
trailing axes that merge only partly, 32 and 64 dimensions, misaligned bases,
non-native byte order, runs of 1023/1024/1025 bytes) the bytes are ``np.copyto``'s and
nothing outside ``dst`` is written; where it says False nothing at all is written; it
reads nothing outside the source's elements (sources flush against ``PROT_NONE``
pages); a source sharing memory with ``dst`` is never streamed; a second thread cannot
free either side while the GIL is released; and through a real ``kvlife serve`` puts of
one KV tensor in several layouts (runs shorter and longer than 1 KiB, reversed,
permuted, broadcast, torch-permuted) load back exact with a clean audit.

Held: all of the above (``copies.stream_copy`` only hands the extension ndarrays).
Noted, and changed since: a length-1 axis with an odd stride (numpy keeps such strides
on arrays that are not C-contiguous) stopped the merge of trailing axes, so a source
whose contiguous run is 2 KiB was refused as a run of 512 bytes (np.copyto then: the
same bytes, slower); such axes now merge whatever their stride.

Found broken, and fixed (``test_the_extension_survives_buffers_that_export_no_strides``):
the extension dereferenced ``src.strides`` unconditionally, but an exporter may leave
``strides`` NULL for a C-contiguous buffer even under ``PyBUF_STRIDES`` (CPython's own
ctypes does: ``(ctypes.c_char * 131072)()``). ``_frames.stream_copy(np.zeros(131072,
np.uint8), (ctypes.c_char * 131072)())`` killed the process with SIGSEGV (NULL
dereference); a source without strides is now one contiguous run. It was not reachable
through ``kvlife.native.copies.stream_copy`` or a put (they pass ndarrays only, and
numpy always fills strides), only by calling the extension directly.
"""

from __future__ import annotations

import gc
import mmap
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout
from kvlife.native import frames
from kvlife.native.copies import STREAM_BYTES, stream_copy
from tests.attack.served import identities, served
from tests.attack.stream_rig import (
    Counting,
    child_finishes,
    counted,
    file_mmap,
    needs_native,
    sent_verbs,
)
from tests.server.conftest import quiet

pytestmark = pytest.mark.usefixtures("server_hashes_puts")  # the notices' path

MiB = 1 << 20
counting = counted()
GUARD = 96
"""Bytes of sentinel on each side of a destination (a write there is a bug)."""
RUN = 1024
"""``STREAM_RUN`` as the commit defines it (checked against the module below)."""


@pytest.fixture
def native() -> Any:
    module = frames.native_module()
    if module is None:
        pytest.skip("no C extension built")
    assert module.STREAM_RUN == RUN == frames.STREAM_RUN
    return module


def _bytes(a: np.ndarray) -> np.ndarray:
    """``a``'s values as C-ordered bytes (NaN payloads compared as bytes)."""
    c = np.ascontiguousarray(a)
    return c.reshape(-1).view(np.uint8) if c.size else np.zeros(0, np.uint8)


def _guarded(like: np.ndarray, at: int, fill: int = 0xA5) -> tuple[np.ndarray, np.ndarray]:
    """(memory with ``GUARD`` sentinel bytes either side, a C-contiguous array of
    ``like``'s shape and dtype inside it ``at`` bytes past the guard)."""
    mem = np.full(like.nbytes + 2 * GUARD + 64, fill, np.uint8)
    inner = mem[GUARD + at : GUARD + at + like.nbytes]
    return mem, inner.view(like.dtype).reshape(like.shape)


def _longest_run(src: np.ndarray) -> int:
    """An upper bound on the innermost contiguous run of ``src`` in bytes, made
    independently of the extension's rule: length-1 axes skipped (their strides do not
    matter), C-contiguous arrays whole."""
    if src.flags.c_contiguous:
        return src.nbytes
    run = src.itemsize
    for n, s in zip(reversed(src.shape), reversed(src.strides), strict=True):
        if n == 1:
            continue
        if s != run:
            break
        run *= n
    return run


def _span(a: np.ndarray) -> tuple[int, int]:
    lo, hi = np.lib.array_utils.byte_bounds(a)
    return int(lo), int(hi)


def _check_one(native: Any, src: np.ndarray, at: int) -> bool:
    """The extension, then copies.stream_copy, into guarded destinations at offset
    ``at``: np.copyto's bytes and nothing outside; False leaves everything untouched,
    and a source whose runs are all shorter than STREAM_RUN is never streamed."""
    mem, dst = _guarded(src, at)
    before = mem.copy()
    streamed = bool(native.stream_copy(dst, src))
    if streamed:
        want = before.copy()
        want[GUARD + at : GUARD + at + src.nbytes] = _bytes(src)
        assert np.array_equal(mem, want), (src.shape, src.strides, src.dtype, at)
    else:
        assert np.array_equal(mem, before), ("False but written", src.shape, src.strides)
    if _longest_run(src) < RUN:
        assert not streamed, ("a run under STREAM_RUN streamed", src.shape, src.strides)
    mem2, dst2 = _guarded(src, at, 0x3C)
    ref, dref = _guarded(src, at, 0x3C)
    stream_copy(dst2, src)
    np.copyto(dref, src)
    assert np.array_equal(mem2, ref), ("wrapper", src.shape, src.strides, src.dtype, at)
    return streamed


# ------------------------------------------------------------------ random strides

FUZZ_DTYPES = ["u1", "<f2", ">f2", "<f4", ">u4", "<c16", "?", "V3", "S1100", "V1024"]


def _random_source(rng: np.random.Generator) -> np.ndarray:
    """A strided view of random bytes: each axis sliced with a step of either sign
    (some reversed), a random base offset (misaligned), sometimes the axes permuted,
    one of them broadcast (stride 0) or a length-1 axis given an odd stride."""
    dt = np.dtype(str(rng.choice(FUZZ_DTYPES)))
    ndim = int(rng.integers(1, 6))
    shape = [int(rng.integers(1, 4)) for _ in range(ndim)]
    inner_max = max(1, 2600 // dt.itemsize)
    shape[-1] = int(rng.integers(1, inner_max + 1))
    if ndim > 1 and rng.random() < 0.4:  # two trailing axes whose product is ~1 KiB
        shape[-2] = int(rng.integers(1, 9))
        shape[-1] = max(1, int(rng.integers(96, 300)) // dt.itemsize)
    steps = [int(rng.choice([1, 1, 1, 2, -1, -2, 3])) for _ in range(ndim)]
    pads = [int(rng.integers(0, 3)) for _ in range(ndim)]
    base_shape = [n * abs(s) + p for n, s, p in zip(shape, steps, pads, strict=True)]
    nbytes = int(np.prod(base_shape)) * dt.itemsize
    off = int(rng.integers(0, 17))
    mem = rng.integers(0, 256, nbytes + 32, dtype=np.uint8)
    base = mem[off : off + nbytes].view(dt).reshape(base_shape)
    cut = []
    for n, s, b in zip(shape, steps, base_shape, strict=True):
        room = b - n * abs(s)
        first = int(rng.integers(0, room + 1))
        if s > 0:
            cut.append(slice(first, first + n * s, s))
        else:
            start = b - 1 - first
            stop = start + n * s
            cut.append(slice(start, stop if stop >= 0 else None, s))
    src = base[tuple(cut)]
    roll = rng.random()
    if roll < 0.2 and ndim > 1:
        src = src.transpose(rng.permutation(ndim))
    elif roll < 0.35:
        ax = int(rng.integers(0, ndim))
        one = tuple(slice(0, 1) if i == ax else slice(None) for i in range(ndim))
        shp = list(src.shape)
        shp[ax] = int(rng.integers(1, 4))
        src = np.broadcast_to(src[one], shp)
    elif roll < 0.5:
        ax = int(rng.integers(0, ndim + 1))
        odd = int(rng.choice([-7, 3, 13, 1 << 20]))
        src = as_strided(
            src,
            shape=(*src.shape[:ax], 1, *src.shape[ax:]),
            strides=(*src.strides[:ax], odd, *src.strides[ax:]),
            writeable=False,
        )
    return src


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_random_strided_sources_give_copyto_s_bytes_and_nothing_outside(
    native: Any, seed: int
) -> None:
    """Hundreds of random strided views (reversed, stepped, permuted, broadcast, odd
    strides on length-1 axes, misaligned, byte-swapped, items of 1 to 1100 bytes):
    whatever the extension decides, its bytes are np.copyto's with the guards intact,
    False writes nothing, short runs are never streamed; copies.stream_copy gives
    np.copyto's bytes. Some of each kind were streamed."""
    rng = np.random.default_rng(1000 + seed)
    streamed = 0
    for _ in range(350):
        src = _random_source(rng)
        streamed += _check_one(native, src, int(rng.integers(0, 33)))
    assert streamed > 20, streamed


def _strided(
    dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], seed: int = 0
) -> np.ndarray:
    """A view of random bytes with exactly these strides (any sign, overlapping rows
    allowed), its lowest element at a misaligned address."""
    dt = np.dtype(dtype)
    neg = sum((n - 1) * -s for n, s in zip(shape, strides, strict=True) if s < 0)
    pos = sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0)
    mem = np.random.default_rng(seed).integers(0, 256, neg + pos + dt.itemsize + 8, np.uint8)
    first = mem[3 + neg : 3 + neg + dt.itemsize].view(dt)
    return as_strided(first, shape=shape, strides=strides, writeable=False)


def _kv(shape: tuple[int, ...], dtype: str = "<f2", seed: int = 1) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    return (
        np.random.default_rng(seed)
        .integers(0, 256, n * dt.itemsize, np.uint8)
        .view(dt)
        .reshape(shape)
    )


def _named_sources() -> Iterator[tuple[str, Callable[[], np.ndarray], bool | None]]:
    """(what, the source, whether the extension must stream it: None where either
    answer is right)."""

    # runs around STREAM_RUN, rows of a KV chunk cut along T
    def rows_of(run: int) -> Callable[[], np.ndarray]:
        return lambda: _kv((2, 2, 3, 3 * run), "u1")[:, :, :, run : 2 * run]

    for run in (1023, 1024, 1025):
        yield f"chunk rows of {run} bytes", rows_of(run), run >= RUN
    yield "chunk of a KV tensor", lambda: _kv((2, 2, 4, 96, 64))[:, :, :, 16:48], True
    yield (
        "chunk, T reversed (run of one token: 128 B)",
        lambda: _kv((2, 2, 4, 96, 64))[:, :, :, ::-1][:, :, :, 16:48],
        False,
    )
    yield (
        "chunk, T reversed, head of 1 KiB",
        lambda: _kv((2, 2, 2, 24, 512))[:, :, :, ::-1][:, :, :, 4:20],
        True,
    )
    yield "chunk, heads reversed", lambda: _kv((2, 2, 4, 96, 64))[:, :, ::-1, 16:48], True
    yield "chunk, k/v swapped", lambda: _kv((2, 2, 4, 96, 64))[:, ::-1, :, 16:48], True
    yield "chunk, layers reversed by 2", lambda: _kv((4, 2, 4, 96, 64))[::-2, :, :, 16:48], True
    yield "head_dim reversed (inner stride -2)", lambda: _kv((2, 2, 4, 32, 64))[..., ::-1], False
    yield "everything reversed", lambda: _kv((2, 2, 4, 32, 64))[::-1, ::-1, ::-1, ::-1, ::-1], False
    yield (
        "k and v one tensor (stride 0)",
        lambda: np.broadcast_to(_kv((2, 1, 4, 32, 64)), (2, 2, 4, 32, 64)),
        True,
    )
    yield (
        "one head broadcast to 8 (stride 0)",
        lambda: np.broadcast_to(_kv((2, 2, 1, 32, 64)), (2, 2, 8, 32, 64)),
        True,
    )
    yield (
        "one token broadcast (inner run 128 B)",
        lambda: np.broadcast_to(_kv((2, 2, 4, 1, 64)), (2, 2, 4, 32, 64)),
        False,
    )
    yield "a scalar broadcast", lambda: np.broadcast_to(_kv((1,), "V1024"), (200,)), True
    yield "Fortran order", lambda: np.asfortranarray(_kv((64, 64, 16))), False
    yield "Fortran, big items", lambda: np.asfortranarray(_kv((8, 16), "V1024")), True
    yield "transposed rows of 2 KiB", lambda: _kv((8, 3, 2048), "u1").transpose(1, 0, 2), True
    yield "transposed, inner axis not innermost", lambda: _kv((2048, 40), "u1").T, False
    # outer stride smaller than the run: rows that overlap each other in the source
    yield "rows overlapping by all but 16 B", lambda: _strided("u1", (40, 2048), (16, 1)), True
    yield "rows overlapping, outer stride -1", lambda: _strided("u1", (70, 1500), (-1, 1)), True
    yield "rows overlapping, outer stride 0", lambda: _strided("u1", (70, 1500), (0, 1)), True
    # trailing axes that merge only partly
    yield "merge 3 of 3 axes to 4 KiB", lambda: _kv((5, 8, 4, 256), "u1")[:, :4], True
    yield "merge 2 of 3 axes to 1 KiB", lambda: _kv((5, 8, 4, 256), "u1")[:, ::2], True
    yield "merge 2 of 3 to 512 B", lambda: _kv((5, 8, 2, 256), "u1")[:, ::2], False
    yield "merge stops at a gap of 1", lambda: _kv((5, 4, 3, 257), "u1")[:, :, :, :256], False
    yield (
        "merge blocked by a 1-axis of odd stride",
        lambda: _strided("u1", (4, 1, 2048), (4099, 13, 1)),
        True,
    )
    yield (
        "1-axis of stride == run (merged)",
        lambda: _strided("u1", (4, 1, 1024), (5000, 1024, 1)),
        True,
    )
    yield (
        # 2 KiB contiguous across length-1 axes of odd strides (merged since; either
        # way the bytes are np.copyto's)
        "1-axes of odd strides inside a 2 KiB run",
        lambda: _strided("u1", (3, 1, 4, 1, 512), (9000, -77, 512, 3, 1)),
        None,
    )
    yield "items of 1 KiB, stepped", lambda: _kv((300,), "V1024")[::2], True
    yield "items of 1 KiB, reversed", lambda: _kv((300,), "V1024")[::-1], True
    yield "items of 1023 B, reversed", lambda: _kv((300,), "V1023")[::-1], False
    yield "items of 1100 B (S), 2-D stepped", lambda: _kv((30, 12), "S1100")[::3, 1::2], True
    yield "big-endian floats, chunk", lambda: _kv((2, 2, 4, 96, 64), ">f4")[:, :, :, 8:40], True
    yield "big-endian, T reversed", lambda: _kv((2, 2, 4, 96, 64), ">f4")[:, :, :, ::-1], False
    yield "complex, stepped rows", lambda: _kv((64, 128), "<c16")[::3], True
    yield "bools, stepped rows", lambda: _kv((64, 4096), "?")[1::2], True
    yield "0-d item of 64 KiB", lambda: _kv((1,), f"V{STREAM_BYTES}")[0, ...], True
    yield (
        "one row, misaligned by 1",
        lambda: _kv((STREAM_BYTES + 1,), "u1")[1:].reshape(1, -1),
        True,
    )


@needs_native
@pytest.mark.parametrize(
    ("what", "make", "expect"), list(_named_sources()), ids=[w for w, _, _ in _named_sources()]
)
def test_named_strided_layouts_are_copied_exactly(
    native: Any, what: str, make: Callable[[], np.ndarray], expect: bool | None
) -> None:
    """Each layout named (negative strides on every axis in turn, stride 0, rows that
    overlap one another in the source, trailing axes that merge partly, odd strides on
    length-1 axes, items of a KiB, runs of 1023/1024/1025 bytes, byte-swapped, a 0-d
    item): np.copyto's bytes at three destination alignments, nothing outside, and
    streamed exactly where its run reaches STREAM_RUN."""
    src = make()
    for at in (0, 1, 15):
        streamed = _check_one(native, src, at)
        if expect is not None:
            assert streamed is expect, (what, src.shape, src.strides)


@needs_native
@pytest.mark.parametrize("ndim", [32, 33, 63, 64])
def test_sources_of_many_dimensions_are_walked_exactly(native: Any, ndim: int) -> None:
    """Up to numpy's 64 dimensions (the extension's odometer holds 64 outer axes):
    items of 1 KiB, seven axes of length 2 with odd strides of either sign, the rest
    length 1 with odd strides (blocking every merge), reversed copies too: np.copyto's
    bytes, streamed."""
    rng = np.random.default_rng(ndim)
    for _ in range(4):
        shape = [1] * ndim
        for ax in rng.choice(ndim, 7, replace=False):
            shape[int(ax)] = 2
        strides = [
            int(rng.choice([1, 3, 5, 9, 17, 33, 65])) * RUN * int(rng.choice([1, -1]))
            + (int(rng.integers(-9, 10)) if n == 1 else 0)
            for n in shape
        ]
        src = _strided("V1024", tuple(shape), tuple(strides), seed=ndim)
        assert src.ndim == ndim
        assert _check_one(native, src, 5)
        assert _check_one(native, src[tuple(slice(None, None, -1) for _ in range(ndim))], 0)


@needs_native
def test_numpy_refuses_more_than_64_dimensions() -> None:
    """The extension's "more than 64 outer axes" guard cannot be reached from numpy
    or memoryview (both stop at 64): a record of why no test drives it."""
    with pytest.raises(ValueError):
        np.zeros([1] * 65)
    with pytest.raises((ValueError, TypeError)):
        memoryview(bytes(1)).cast("B", [1] * 65)


# ------------------------------------------------------------------------ overlap


def _overlap_cases(n: int) -> Iterator[tuple[str, slice, Callable[[np.ndarray], np.ndarray]]]:
    """(what, dst as a slice of one buffer of 4 n bytes, src as a view of the same
    buffer): sharing bytes with dst or not, spans that meet dst's or only touch it."""
    rows = n // 2048
    half = rows // 2 * 2048
    yield "clear after", slice(0, n), lambda b: b[n : 3 * n].reshape(rows, 2, 2048)[:, 1]
    yield (
        "clear before, reversed",
        slice(2 * n, 3 * n),
        lambda b: b[: 2 * n].reshape(rows, 2, 2048)[::-1, 0],
    )
    yield "touching after", slice(n, 2 * n), lambda b: b[2 * n : 3 * n].reshape(rows, 2048)[::-1]
    yield "touching before", slice(n, 2 * n), lambda b: b[:n].reshape(rows, 2048)[::-1]
    # rows on both sides of dst, none of its bytes: spans meet, no byte shared
    yield (
        "rows either side, stride 0",
        slice(n, 2 * n),
        lambda b: as_strided(b[n - 2048 :], shape=(rows // 2, 2, 2048), strides=(0, n + 2048, 1)),
    )
    yield (
        "halves either side, reversed",
        slice(n, 2 * n),
        lambda b: as_strided(
            b[n - half :], shape=(2, rows // 2, 2048), strides=(n + half, 2048, 1)
        )[::-1, ::-1],
    )
    yield (
        "every other row of dst's bytes",
        slice(n, 2 * n),
        lambda b: b[n // 2 : n // 2 + 2 * n].reshape(rows, 2, 2048)[:, 0],
    )
    yield "dst's rows reversed", slice(n, 2 * n), lambda b: b[n : 2 * n].reshape(rows, 2048)[::-1]
    yield "dst itself", slice(n, 2 * n), lambda b: b[n : 2 * n].reshape(rows, 2048)
    yield "a row on", slice(n, 2 * n), lambda b: b[n + 2048 : 2 * n + 2048].reshape(rows, 2048)
    yield (
        "a byte back, stepped",
        slice(n, 2 * n),
        lambda b: b[n - 1 : 3 * n - 1].reshape(rows, 2, 2048)[:, 0],
    )
    yield (
        "stride 0 on dst's first row",
        slice(n, 2 * n),
        lambda b: as_strided(b[n:], shape=(rows, 2048), strides=(0, 1)),
    )
    yield (
        "last byte shared, reversed",
        slice(n, 2 * n),
        lambda b: b[2 * n - 1 : 3 * n - 1].reshape(rows, 2048)[::-1],
    )


_OVERLAPS = list(_overlap_cases(32 * 2048))


@needs_native
@pytest.mark.parametrize("case", range(len(_OVERLAPS)), ids=[w for w, _, _ in _OVERLAPS])
def test_sources_in_the_destination_s_own_buffer_give_copyto_s_result(
    native: Any, counting: Counting, case: int
) -> None:
    """dst a C-contiguous slice of one buffer, src a strided view of the same buffer
    (sharing dst's bytes, its span meeting dst's without a byte shared, or clear of
    it): copies.stream_copy leaves the whole buffer as np.copyto does (np.copyto copies
    a source that shares memory before writing); the extension never streams a source
    whose span meets dst's (and writes nothing then), and streams one clear of it."""
    n = 32 * 2048
    what, dslice, make = _OVERLAPS[case]
    buf = np.random.default_rng(case).integers(0, 256, 4 * n, np.uint8)
    want = buf.copy()
    wsrc = make(want)
    np.copyto(want[dslice].reshape(wsrc.shape), wsrc)
    got = buf.copy()
    src = make(got)
    dst = got[dslice].reshape(src.shape)
    lo, hi = _span(src)
    dlo, dhi = _span(dst)
    meets = lo < dhi and dlo < hi
    before = len(counting.calls)
    stream_copy(dst, src)
    assert np.array_equal(got, want), what
    assert (len(counting.calls) > before) is (not meets), what
    raw = buf.copy()
    rsrc = make(raw)
    assert native.stream_copy(raw[dslice].reshape(rsrc.shape), rsrc) is (not meets), what
    if meets:
        assert np.array_equal(raw, buf), what


# -------------------------------------------------------------- memory at the edge

_FENCED_CHILD = r"""
import ctypes, mmap, sys
import numpy as np
from kvlife.native import frames

m = frames.native_module()
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
P = mmap.PAGESIZE
keep = []

def fenced(nbytes):
    # an anonymous mapping whose first and last pages are PROT_NONE; nbytes between
    pages = -(-nbytes // P)
    mm = mmap.mmap(-1, (pages + 2) * P)
    whole = np.frombuffer(mm, np.uint8)
    addr = whole.ctypes.data
    assert libc.mprotect(addr, P, 0) == 0
    assert libc.mprotect(addr + (pages + 1) * P, P, 0) == 0
    keep.append(mm)
    return whole, P, P + pages * P

rng = np.random.default_rng(0)
streamed = 0
for rows, run in [(4, 1024), (3, 1025), (7, 4096), (2, 3069), (1, 65536), (33, 2048)]:
    nbytes = rows * run
    whole, start, end = fenced(nbytes)
    for at in (start, end - nbytes):  # flush against the guard before, then after
        raw = whole[at : at + nbytes]
        raw[:] = rng.integers(0, 256, nbytes, np.uint8)
        g = raw.reshape(rows, run)
        for src in (g, g[::-1], g[::-2], g[1::2], g[:, ::-1], g[::-1, ::-1],
                    np.broadcast_to(g[-1:], (3, run)), np.broadcast_to(g[:1], (3, run)),
                    g.reshape(rows, 1, run)[::-1], g.T.T[::-1][::-1]):
            if src.size == 0:
                continue
            dst = np.full(src.shape, 0x5A, np.uint8)
            ok = m.stream_copy(dst, src)
            streamed += bool(ok)
            exact = np.array_equal(dst, src) if ok else (dst == 0x5A).all()
            assert exact, (rows, run, src.strides)
    dwhole, start, end = fenced(nbytes)
    for at in (start, end - nbytes):  # the destination flush against a guard
        d = dwhole[at : at + nbytes].reshape(rows, run)
        src = rng.integers(0, 256, (rows * 2, run + 5), np.uint8)[::-2, 3 : run + 3]
        assert m.stream_copy(d, src) and np.array_equal(d, src)
print("done", streamed, flush=True)
"""


@needs_native
def test_sources_flush_against_inaccessible_pages_are_read_within_their_elements() -> None:
    """Sources whose first or last byte touches a PROT_NONE page, read reversed,
    stepped, broadcast from the first or last row, with a length-1 axis: any read past
    an element (a span or run computed wrong for negative strides, a 64-byte load past
    a run's end) faults. Also destinations flush against a guard. Run in a child (a
    fault would take pytest down): it finishes, every copy exact or refused."""
    out = child_finishes(_FENCED_CHILD)
    assert int(out.split()[-1]) > 50


_NO_STRIDES_CHILD = r"""
import ctypes, sys
import numpy as np
from kvlife.native import frames

m = frames.native_module()
kind = sys.argv[1]
if kind == "chars":
    src = (ctypes.c_char * 131072)()
elif kind == "rows":
    src = ((ctypes.c_char * 2048) * 64)()
else:
    class Item(ctypes.Structure):
        _fields_ = [("a", ctypes.c_char * 2048)]
    src = (Item * 64)()
ctypes.memmove(src, bytes(range(256)) * 512, 131072)
view = memoryview(src)
print(kind, view.ndim, view.shape, view.strides, flush=True)
dst = np.zeros(131072, np.uint8)
try:
    ok = m.stream_copy(dst, src)
except (TypeError, BufferError, ValueError) as exc:
    print("refused", type(exc).__name__, flush=True)
else:
    want = np.frombuffer(bytes(src), np.uint8)
    assert np.array_equal(dst, want) if ok else not dst.any(), ok
print("done", flush=True)
"""


@needs_native
@pytest.mark.parametrize("kind", ["chars", "rows", "structs"])
def test_the_extension_survives_buffers_that_export_no_strides(kind: str) -> None:
    """Found broken (kvlife/native/_frames.c ``stream_copy``, commit 364bc3c; fixed:
    no strides is one contiguous run): the extension read ``src.strides[d]`` for every
    axis, but an exporter may leave
    ``strides`` NULL for a C-contiguous buffer under ``PyBUF_STRIDES`` (CPython's
    ctypes arrays do; memoryview fills them in, so memoryview(src).strides looks fine).
    Reproducer: ``kvlife.native._frames.stream_copy(np.zeros(131072, np.uint8),
    (ctypes.c_char * 131072)())``: SIGSEGV then. Before the commit (``"y*"``) the same call
    copied the bytes. The extension's own contract (the attack suite's
    ``test_the_extension_itself_refuses_what_it_cannot_copy_before_writing``) is an
    error or False and nothing written, or the bytes: never a crash. Not reachable
    through ``kvlife.native.copies.stream_copy`` (ndarrays only). Run in a child."""
    child_finishes(_NO_STRIDES_CHILD, kind)


@needs_native
def test_an_ndarray_over_a_ctypes_buffer_is_copied_exactly(counting: Counting) -> None:
    """The same ctypes memory wrapped as an ndarray (what copies.py is given): numpy
    exports its strides, so it is streamed, strided or not, exactly."""
    import ctypes

    raw = ((ctypes.c_char * 2048) * 64)()
    ctypes.memmove(raw, bytes(range(256)) * 512, 131072)
    arr = np.ctypeslib.as_array(raw).view(np.uint8).reshape(64, 2048)
    for src in (arr, arr[::-1], arr[::2], arr[::-2]):
        got = np.zeros(src.shape, np.uint8)
        stream_copy(got, src)
        assert np.array_equal(got, src)
    assert len(counting.calls) >= 2


# --------------------------------------------------------------------- concurrency


@needs_native
def test_a_thread_writing_the_source_cannot_make_the_copy_write_outside(native: Any) -> None:
    """While strided copies (reversed rows of 4 KiB from a larger tensor) run without
    the GIL, a second thread keeps overwriting the whole source tensor: no crash, the
    guard bytes either side of the destination stay intact, every byte of the
    destination is one the source held at some time; after the writer stops the copy
    is exact."""
    base = np.full((64, 3, 4096), 0x11, np.uint8)
    src = base[::-1, 1]
    mem, dst = _guarded(src, 7)
    stop = threading.Event()
    values = (0x11, 0x22)

    def write() -> None:
        k = 0
        while not stop.is_set():
            base.fill(values[k % 2])
            k += 1

    th = threading.Thread(target=write)
    th.start()
    try:
        end = time.monotonic() + 0.5
        copies = 0
        while time.monotonic() < end or copies < 10:
            assert native.stream_copy(dst, src)
            copies += 1
            assert (mem[:GUARD] == 0xA5).all() and (mem[GUARD + 7 + src.nbytes :] == 0xA5).all()
            assert np.isin(dst, values).all()
    finally:
        stop.set()
        th.join(30)
    base[:] = np.random.default_rng(9).integers(0, 256, base.shape, np.uint8)
    assert native.stream_copy(dst, src) and np.array_equal(dst, src)


@needs_native
def test_mmaps_behind_a_strided_source_and_its_destination_stay_while_it_copies() -> None:
    """The source is a reversed, stepped view of one mmap, the destination a view of
    another; a second thread keeps trying to close and shrink both while copies run
    without the GIL: every try is a BufferError (the copy's exports, and the arrays',
    hold them), no crash, the last copy exact."""
    n = 8 * MiB
    smm, dmm = file_mmap(2 * n), file_mmap(n)
    whole = np.frombuffer(smm, np.uint8).reshape(-1, 2, 4096)
    whole[:] = np.random.default_rng(3).integers(0, 256, whole.shape, np.uint8)
    src = whole[::-1, 1]
    dst = np.frombuffer(dmm, np.uint8).reshape(src.shape)
    stop = threading.Event()
    seen: set[str] = set()

    def attack() -> None:
        while not stop.is_set():
            for fn in (smm.close, dmm.close, lambda: smm.resize(4096), lambda: dmm.resize(4096)):
                try:
                    fn()
                    seen.add("ok")
                except Exception as exc:  # recorded
                    seen.add(type(exc).__name__)
            time.sleep(0)

    th = threading.Thread(target=attack)
    th.start()
    try:
        for _ in range(6):
            stream_copy(dst, src)
    finally:
        stop.set()
        th.join(30)
    assert seen == {"BufferError"}, seen
    assert not smm.closed and not dmm.closed
    assert np.array_equal(dst, src)


@needs_native
def test_dropping_every_reference_during_a_strided_copy_keeps_the_memory() -> None:
    """A strided copy (layers reversed, a T-slice of a KV tensor in an mmap) runs in a
    thread while this one drops every reference to the source, its mmap and the
    destination's mmap and collects: the copy's buffer exports keep them alive and the
    destination's file holds every byte after."""
    rng = np.random.default_rng(4)
    for round_ in range(3):
        with tempfile.TemporaryFile() as f:
            kv_mm = mmap.mmap(-1, 16 * MiB)
            kv = np.frombuffer(kv_mm, np.uint8).reshape(8, 2, 8, 512, 256)
            kv[:] = rng.integers(0, 256, kv.shape, np.uint8)
            src = kv[::-1, :, :, 100:356]
            want = np.ascontiguousarray(src).tobytes()
            f.truncate(len(want))
            mm = mmap.mmap(f.fileno(), len(want))
            dst = np.frombuffer(mm, np.uint8).reshape(src.shape)
            started = threading.Event()

            def run(d: np.ndarray, s: np.ndarray, started: threading.Event) -> None:
                started.set()
                stream_copy(d, s)

            th = threading.Thread(target=run, args=(dst, src, started))
            th.start()
            started.wait()
            del dst, src, mm, kv, kv_mm
            gc.collect()
            th.join(30)
            del th
            gc.collect()
            f.seek(0)
            assert f.read() == want, round_


# ------------------------------------------------------------------------- served


server, remote = served("stream-strided", dram=64 * MiB, disk=96 * MiB, staging=32 * MiB)
_identity = identities("strided")


_NP = {"float16": "<f2", "float32": "<f4", "uint8": "u1", "int8": "i1"}


def _tensor(layout: KVLayout, ntokens: int, form: str, seed: int) -> tuple[object, np.ndarray]:
    """(one KV tensor for the whole prompt as put_prompt is given it, its values as a
    numpy view [layers, 2, heads, T, head_dim]). Forms: ``plain``; ``t-reversed``,
    ``heads-reversed``, ``layers-reversed`` (a negative stride on that axis);
    ``kv-broadcast`` (k and v one array: stride 0); ``t-major`` (stored [T, layers, 2,
    heads, head_dim], transposed: a run per token); ``fortran`` (no run at all);
    ``torch-heads-major`` (a float16 torch tensor stored [layers, heads, 2, T, dim],
    permuted)."""
    dt = np.dtype(_NP[layout.dtype])
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    shape = (L, 2, H, ntokens, D)
    rng = np.random.default_rng(seed)

    def rand(s: tuple[int, ...]) -> np.ndarray:
        return rng.integers(0, 256, int(np.prod(s)) * dt.itemsize, np.uint8).view(dt).reshape(s)

    if form == "plain":
        full = rand(shape)
    elif form == "t-reversed":
        full = rand(shape)[:, :, :, ::-1]
    elif form == "heads-reversed":
        full = rand(shape)[:, :, ::-1]
    elif form == "layers-reversed":
        full = rand((2 * L, 2, H, ntokens, D))[::-2]
    elif form == "kv-broadcast":
        full = np.broadcast_to(rand((L, 1, H, ntokens, D)), shape)
    elif form == "t-major":
        full = rand((ntokens, L, 2, H, D)).transpose(1, 2, 3, 0, 4)
    elif form == "fortran":
        full = np.asfortranarray(rand(shape))
    elif form == "torch-heads-major":
        import torch

        stored = rand((L, H, 2, ntokens, D))
        t = torch.from_numpy(stored.view(np.int16)).view(torch.float16).permute(0, 2, 1, 3, 4)
        return t, stored.transpose(0, 2, 1, 3, 4)
    else:
        raise AssertionError(form)
    assert full.shape == shape
    return full, full


def _run_of(full: np.ndarray, n: int) -> int:
    """The innermost contiguous run of one chunk of ``full`` (bytes)."""
    return _longest_run(full[:, :, :, :n])


def _layout(L: int, H: int, D: int, dtype: str, n: int) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype, tokens_per_chunk=n)


# (layout, chunks, form): runs of exactly 1 KiB, 1023 and 1025 bytes (rows just over
# 64 KiB), a run of 512 bytes with rows of 64 KiB (the extension asked, says False), a
# run per token of 1 KiB (T-major), negative strides on T/heads/layers, stride 0 on k/v,
# Fortran order, a permuted torch tensor
SERVED = [
    pytest.param(_layout(2, 32, 32, "uint8", 32), 3, "plain", id="u8-run-1024"),
    pytest.param(_layout(2, 33, 31, "uint8", 33), 3, "plain", id="u8-run-1023"),
    pytest.param(_layout(2, 32, 41, "uint8", 25), 3, "plain", id="u8-run-1025"),
    pytest.param(_layout(2, 64, 64, "float32", 2), 4, "plain", id="f32-run-512-rows-64KiB"),
    pytest.param(_layout(2, 8, 128, "float16", 16), 4, "plain", id="f16-run-4KiB"),
    pytest.param(_layout(2, 8, 128, "float16", 16), 3, "t-reversed", id="f16-T-reversed"),
    pytest.param(
        _layout(1, 2, 512, "float16", 32), 3, "t-reversed", id="f16-T-reversed-1KiB-heads"
    ),
    pytest.param(_layout(2, 8, 128, "float16", 16), 3, "heads-reversed", id="f16-heads-reversed"),
    pytest.param(_layout(3, 8, 128, "float16", 16), 2, "layers-reversed", id="f16-layers-reversed"),
    pytest.param(_layout(2, 8, 128, "float16", 16), 3, "kv-broadcast", id="f16-kv-stride-0"),
    pytest.param(_layout(1, 2, 512, "float16", 32), 3, "t-major", id="f16-T-major-run-1KiB"),
    pytest.param(_layout(2, 8, 128, "float16", 16), 2, "t-major", id="f16-T-major-run-256"),
    pytest.param(_layout(2, 8, 128, "float16", 16), 2, "fortran", id="f16-fortran"),
    pytest.param(
        _layout(2, 8, 128, "float16", 16), 3, "torch-heads-major", id="f16-torch-permuted"
    ),
    pytest.param(_layout(2, 4, 128, "int8", 300), 2, "plain", id="i8-chunks-of-600KiB"),
]


@needs_native
@pytest.mark.parametrize(("layout", "nchunks", "form"), SERVED)
def test_served_puts_of_one_kv_tensor_load_exact_and_audit_clean(
    remote: RemoteStore,
    monkeypatch: pytest.MonkeyPatch,
    counting: Counting,
    layout: KVLayout,
    nchunks: int,
    form: str,
) -> None:
    """A two-phase put (``_prepare``: whole strided chunks) then a staged put
    (``copy_telling``: rows and heads of them) of one KV tensor each, through a real
    ``kvlife serve``: the strided pieces were streamed where their run reaches
    STREAM_RUN and left to np.copyto where it does not, every chunk loads back byte
    for byte and the audit is clean."""
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    verbs = sent_verbs(monkeypatch)
    puts: list[tuple[list[int], np.ndarray]] = []
    for k in range(2):
        ntokens = nchunks * n + min(3, n - 1)  # a partial chunk left off the end
        tokens = list(range(1_000_000 * (k + 1), 1_000_000 * (k + 1) + ntokens))
        kv, full = _tensor(layout, ntokens, form, seed=17 * k + nchunks)
        run = _run_of(full, n)
        before, refused = len(counting.calls), counting.refused
        res = remote.put_prompt(ident, PUBLIC, tokens, kv)
        assert res.stored == nchunks
        streamed = counting.calls[before:]
        if run >= RUN:  # strided pieces among them (a chunk is a slice of the tensor)
            assert not all(counting.contiguous[before:]), (form, run)
        else:
            assert not streamed, (form, run, streamed)
        if run < RUN and layout.chunk_nbytes >= STREAM_BYTES:
            assert counting.refused > refused, "the extension was asked, and said False"
        puts.append((tokens[: nchunks * n], full))
    assert verbs.count("prepare_put") == 1 and verbs.count("put") == 1, verbs
    report = remote.check()
    assert report.clean, report
    state = quiet(remote)
    assert state["unreplied_errors"] == 0 and state["internal_errors"] == 0
    for tokens, full in puts:
        got = remote.load(remote.lookup(ident, PUBLIC, tokens))
        assert got.loaded == nchunks
        for i, a in enumerate(got.arrays):
            want = full[:, :, :, i * n : (i + 1) * n]
            assert np.array_equal(_bytes(np.asarray(a)), _bytes(want)), (form, i)


def test_the_child_scripts_are_plain_python() -> None:
    """Guard: the child scripts above compile (a syntax error there would read as a
    crash of the extension)."""
    for code in (_FENCED_CHILD, _NO_STRIDES_CHILD):
        compile(textwrap.dedent(code), "<child>", "exec")
