"""Attacks on the streaming copy of a served put (commit c84cf4d):
kvlife/native/_frames.c ``stream_copy`` (SSE2 non-temporal stores, the GIL released,
memmove where the buffers overlap), kvlife/native/copies.py ``stream_copy`` (the
extension for C-contiguous same-dtype same-shape arrays of at least ``STREAM_BYTES``,
``np.copyto`` otherwise) and its use by kvlife/client/puts.py (a staged put's
``copy_telling``/``_copy_units`` and the two-phase ``_prepare``).

The promise under attack: the copy is ``np.copyto``'s, byte for byte and error for
error, whatever the dtype, size, alignment, memory behind either side or overlap; it
never writes a byte outside the destination; a second thread cannot pull the memory
out from under it while the GIL is released; and through a real ``kvlife serve`` every
put streamed this way loads back exact, the audit is clean, a chunk written again after
its ``put_written`` notice is still caught, and a client without the extension
(``KVLIFE_NATIVE=0``) puts the same bytes.

Found broken, and fixed (copies.py now leaves ``dtype.hasobject`` to ``np.copyto``;
``test_arrays_of_references_are_copied_as_copyto_copies_them``): arrays of a dtype
that holds references (``object``, a structured dtype with an object field, numpy 2's
``StringDType``) are C-contiguous, of one dtype and export a buffer, so copies.py hands them to the
extension, which copies the raw pointers without taking references: the destination
holds borrowed ``PyObject*`` (a double free when both arrays die: the process
segfaults) or arena offsets into the source's string allocator (``MemoryError`` on
read). ``np.copyto`` copies them correctly. No served put reaches this today (a KV
layout's dtypes are numeric and ``Wire.view`` cannot view the arena as objects), but
``kvlife.native.copies.stream_copy`` promises ``np.copyto``'s result for any array.

Differs, not asserted as a bug: a structured dtype with gaps between its fields gets
the source's gap bytes from the streaming copy, where ``np.copyto`` copies the fields
only and leaves the destination's (the fields are equal; no KV dtype has gaps).
"""

from __future__ import annotations

import gc
import mmap
import os
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvlife.client.puts as client_puts
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
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
from tests.server.conftest import ROOT, ServerProc, quiet

pytestmark = pytest.mark.usefixtures("server_hashes_puts")  # the notices' path

MiB = 1 << 20
counting = counted()
GUARD = 128
"""Bytes of sentinel on each side of a destination (any write there is a bug)."""


def _outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:  # compared, not raised
        return f"{type(exc).__name__}: {exc}"
    return "ok"


# --------------------------------------------------------------------------- bytes

# every dtype a KV cache could hold (bfloat16 and float8 are held as uint16 / uint8, as
# kvlife.core.payload does), non-native byte order, and the other plain dtypes numpy
# exports a buffer of
DTYPES = [
    np.dtype(d)
    for d in (
        "<f2",
        "<f4",
        "<f8",
        "<u2",
        "i1",
        "u1",
        "?",
        "<c8",
        ">f2",
        ">f4",
        "<M8[s]",
        "<m8[ns]",
        "V3",
        "S5",
        "<U3",
        [("k", "<f2"), ("v", "u1")],
    )
]
SIZES = [STREAM_BYTES + d for d in (-130, -1, 0, 1, 15, 16, 17, 63, 64, 65, 130)] + [
    3 * STREAM_BYTES + 77
]


@needs_native
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_every_dtype_size_and_misalignment_gives_copyto_s_bytes_and_nothing_outside(
    dt: np.dtype[Any], counting: Counting
) -> None:
    """Random bytes (every bit pattern: NaN payloads, bools that are not 0 or 1, bad
    datetimes) at sizes around the streaming threshold and the 16- and 64-byte steps of
    the loop, destination and source misaligned by 0..63 bytes: the destination holds
    exactly what np.copyto writes, the guard bytes on either side are untouched, and the
    large ones went through the extension."""
    rng = np.random.default_rng(DTYPES.index(dt))
    for nbytes in SIZES:
        n = nbytes // dt.itemsize
        size = n * dt.itemsize
        for dst_at in (0, 1, 7, 15, 16, 33, 48, 63):
            src_at = (dst_at * 7 + 5) % 64
            src_mem = rng.integers(0, 256, size + 64, dtype=np.uint8)
            src = src_mem[src_at : src_at + size].view(dt)
            got = np.full(size + 2 * GUARD, 0xA5, np.uint8)
            want = got.copy()
            before = len(counting.calls)
            stream_copy(got[GUARD + dst_at : GUARD + dst_at + size].view(dt), src)
            np.copyto(want[GUARD + dst_at : GUARD + dst_at + size].view(dt), src)
            assert np.array_equal(got, want), (dt, nbytes, dst_at, src_at)
            assert len(counting.calls) - before == (size >= STREAM_BYTES), "streamed"


@needs_native
@pytest.mark.parametrize("nbytes", [STREAM_BYTES, STREAM_BYTES + 1, 2 * STREAM_BYTES + 63])
@pytest.mark.parametrize(
    "shift", [-4097, -64, -17, -1, 0, 1, 16, 63, 4096, "n-1", "1-n", "n", "-n"]
)
def test_overlapping_and_adjacent_buffers_give_copyto_s_bytes(
    nbytes: int, shift: int | str
) -> None:
    """Source and destination sharing bytes, either way round, by a byte, a line, a
    page, all but a byte, or exactly (the extension's memmove path), or just touching
    (``n``, ``-n``: not overlapping, streamed): np.copyto's result (which copies the
    source as it was before the copy), and nothing outside the destination."""
    edges = {"n-1": nbytes - 1, "1-n": 1 - nbytes, "n": nbytes, "-n": -nbytes}
    by = edges[shift] if isinstance(shift, str) else shift
    mem = np.random.default_rng(nbytes + by).integers(0, 256, 3 * nbytes + 10_000, np.uint8)
    want = mem.copy()
    s0 = nbytes + 5000
    d0 = s0 + by
    np.copyto(want[d0 : d0 + nbytes], want[s0 : s0 + nbytes].copy())
    stream_copy(mem[d0 : d0 + nbytes], mem[s0 : s0 + nbytes])
    assert np.array_equal(mem, want)


def _odd_pairs() -> Iterator[tuple[str, Callable[[], np.ndarray], object]]:
    """(what, a fresh destination, the source): sides np.copyto takes but the streaming
    path must either stream exactly or leave to np.copyto."""
    n = 2 * STREAM_BYTES + 3
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, n, np.uint8)
    ro = src.copy()
    ro.flags.writeable = False
    yield "read-only source", lambda: np.zeros(n, np.uint8), ro
    yield "reversed source", lambda: np.zeros(n, np.uint8), src[::-1]
    yield "reversed destination", lambda: np.zeros(2 * n, np.uint8)[::-2], src
    grid = src[: 256 * 512].reshape(256, 512)
    yield "Fortran source", lambda: np.zeros((256, 512), np.uint8), np.asfortranarray(grid)
    yield "Fortran destination", lambda: np.zeros((256, 512), np.uint8, order="F"), grid
    yield "transposed both", lambda: np.zeros((512, 256), np.uint8).T, grid.T.copy().T
    yield "broadcast row", lambda: np.zeros((3, n), np.uint8), src
    yield "broadcast scalar", lambda: np.zeros(n, np.uint8), np.uint8(7)
    yield "stride-0 source", lambda: np.zeros(n, np.uint8), np.broadcast_to(src[:1], (n,))
    yield "1 x n", lambda: np.zeros((1, n), np.uint8), src.reshape(1, n)
    yield "0 bytes", lambda: np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    yield "n x 0", lambda: np.zeros((n, 0), np.uint8), np.zeros((n, 0), np.uint8)
    yield "bytearray source", lambda: np.zeros(n, np.uint8), np.frombuffer(bytearray(src), np.uint8)
    yield "bytearray destination", lambda: np.frombuffer(bytearray(n), np.uint8), src
    yield "bytes destination (read-only)", lambda: np.frombuffer(bytes(n), np.uint8), src
    mm = file_mmap(n)
    yield "mmap destination", lambda: np.frombuffer(mm, np.uint8), src
    mro = file_mmap(n, mmap.ACCESS_READ)
    yield "read-only mmap source", lambda: np.zeros(n, np.uint8), np.frombuffer(mro, np.uint8)
    yield "read-only mmap destination", lambda: np.frombuffer(mro, np.uint8), src
    half = src[: n // 2 * 2].view("<f2")
    yield "byte-swapping copy", lambda: np.zeros(n // 2, ">f2"), half
    yield "same-kind cast", lambda: np.zeros(n // 2, "<f4"), half
    yield "unsafe cast refused", lambda: np.zeros(n // 2, "i1"), half
    yield "shapes that do not broadcast", lambda: np.zeros(n + 1, np.uint8), src
    yield "masked source", lambda: np.zeros(n, np.uint8), np.ma.masked_array(src, src % 2 == 0)
    sub = src.view(np.recarray)
    yield "ndarray subclass source", lambda: np.zeros(n, np.uint8), sub


@needs_native
def test_odd_memory_layouts_and_owners_match_copyto_in_bytes_and_errors(
    counting: Counting,
) -> None:
    """Views of mmaps (writable and read-only), bytearray- and bytes-backed arrays,
    read-only sources, reversed, Fortran-ordered, broadcast and 0-byte arrays, casts and
    byte swaps, subclasses: the same bytes as np.copyto or the same error (type and
    message), and the destination untouched on an error."""
    for what, make, src in _odd_pairs():
        got, want = make(), make()
        out = _outcome(lambda got=got, src=src: stream_copy(got, src))  # type: ignore[misc]
        ref = _outcome(lambda want=want, src=src: np.copyto(want, src))  # type: ignore[misc]
        assert out == ref, what
        if want.size:
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert counting.calls, "some of them were streamed"


@needs_native
def test_the_extension_itself_refuses_what_it_cannot_copy_before_writing() -> None:
    """The extension called directly (as copies.py does): a read-only or
    non-contiguous destination, lengths that differ, a str: each a
    TypeError/BufferError/ValueError (what copies.py catches) and no byte moved; a
    source whose contiguous runs are shorter than STREAM_RUN, or that shares memory
    with the destination: False (copies.py then calls np.copyto), no byte moved."""
    module = frames.native_module()
    assert module is not None
    src = np.ones(STREAM_BYTES, np.uint8)
    ro = np.zeros(STREAM_BYTES, np.uint8)
    ro.flags.writeable = False
    strided = np.zeros(2 * STREAM_BYTES, np.uint8)
    for dst, s in (
        (ro, src),
        (strided[::2], src),
        (np.zeros(STREAM_BYTES, np.uint8), np.ones(STREAM_BYTES + 1, np.uint8)),
        (np.zeros(STREAM_BYTES, np.uint8), "x" * STREAM_BYTES),
        (bytes(STREAM_BYTES), src),
    ):
        with pytest.raises((TypeError, BufferError, ValueError)):
            module.stream_copy(dst, s)
    out = np.zeros(STREAM_BYTES, np.uint8)
    assert module.stream_copy(out, np.ones(2 * STREAM_BYTES, np.uint8)[::2]) is False
    assert not out.any()
    assert module.stream_copy(strided[1 : STREAM_BYTES + 1], strided[:STREAM_BYTES]) is False
    assert not ro.any() and not strided.any()


PADDED = [
    np.dtype({"names": ["a", "b"], "formats": ["u1", "<f4"], "offsets": [0, 4], "itemsize": 12}),
    np.dtype({"names": ["h"], "formats": ["<f2"], "offsets": [2], "itemsize": 8}),
]


@needs_native
@pytest.mark.parametrize("dt", PADDED, ids=str)
def test_structured_dtypes_with_padding_copy_every_field_exactly(dt: np.dtype[Any]) -> None:
    """A structured dtype with gaps between its fields: every field holds np.copyto's
    bytes (the gaps are not values: np.copyto leaves the destination's, the streaming
    copy writes the source's; no KV dtype has any) and nothing outside is written."""
    n = 2 * STREAM_BYTES // dt.itemsize + 1
    src = np.random.default_rng(4).integers(0, 256, n * dt.itemsize, np.uint8).view(dt)
    got = np.full(n * dt.itemsize + 2 * GUARD, 0xA5, np.uint8)
    want = got.copy()
    stream_copy(got[GUARD:-GUARD].view(dt), src)
    np.copyto(want[GUARD:-GUARD].view(dt), src)
    for field in dt.names or ():
        g = got[GUARD:-GUARD].view(dt)[field]
        w = want[GUARD:-GUARD].view(dt)[field]
        assert np.array_equal(
            np.ascontiguousarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8)
        )
    assert (got[:GUARD] == 0xA5).all() and (got[-GUARD:] == 0xA5).all()


# ---------------------------------------------------------------------- references

_REFS_CHILD = """
import gc, sys
import numpy as np
from numpy.dtypes import StringDType
from kvlife.native.copies import STREAM_BYTES, stream_copy

kind = sys.argv[1]
n = STREAM_BYTES // 8 + 3
if kind == "object":
    src = np.array([object() for _ in range(n)], dtype=object)
    ref = np.empty(n, dtype=object)
elif kind == "struct":
    dt = np.dtype([("k", "<f2"), ("o", "O")])
    src = np.empty(n, dt)
    src["o"] = [object() for _ in range(n)]
    ref = np.empty(n, dt)
else:
    src = np.array(["a fairly long string, out of line %d" % i for i in range(n)], StringDType())
    ref = np.empty(n, StringDType())
dst = np.empty_like(ref)
assert dst.nbytes >= STREAM_BYTES and dst.flags.c_contiguous
np.copyto(ref, src)
expect = src.tolist()
if kind != "string":
    item = src[0] if kind == "object" else src[0]["o"]
    before = sys.getrefcount(item)
stream_copy(dst, src)
if kind != "string":
    assert sys.getrefcount(item) == before + 1, "the copy holds no reference of its own"
    del item
del src, ref
gc.collect()
junk = [bytearray(40) for _ in range(4 * n)]  # reuse whatever was freed
assert dst.tolist() == expect if kind == "string" else len(dst.tolist()) == n
del dst, junk
gc.collect()
print("done", flush=True)
"""


@needs_native
@pytest.mark.parametrize("kind", ["object", "struct", "string"])
def test_arrays_of_references_are_copied_as_copyto_copies_them(kind: str) -> None:
    """Found by attack (kvlife/native/copies.py, fixed): a C-contiguous array of at
    least STREAM_BYTES whose dtype holds references (object, a structured dtype with an
    object field, numpy 2's StringDType) exports a buffer, so it was streamed as raw
    bytes: the destination's pointers were the source's without a reference taken
    (freeing both frees each object twice: SIGSEGV), and StringDType's out-of-line
    strings pointed into the source's allocator (MemoryError on read). np.copyto takes
    the references. Run in a child process (the corruption would take pytest down);
    such arrays now go to np.copyto (``dst.dtype.hasobject``)."""
    child_finishes(_REFS_CHILD, kind)


# --------------------------------------------------------------------- concurrency


@needs_native
def test_a_second_thread_cannot_free_what_a_copy_without_the_gil_reads_or_writes() -> None:
    """While copies of 8 MiB into a view of a file's mmap run (the GIL released), a
    second thread keeps trying to close and shrink that mmap and to resize the source
    in place (the source's only other reference is a list): the mmap is never closed or
    shrunk, a resize lands only between two copies (the copy after it sees the new shape
    and np.copyto's ValueError; the loop puts a fresh source back), there is no crash,
    and the last copy's bytes are exact. np.copyto, alternated with it, is treated the
    same."""
    n = 8 * MiB
    mm = file_mmap(n)
    dst = np.frombuffer(mm, np.uint8)
    want = np.random.default_rng(1).integers(0, 256, n, np.uint8)
    box = [want.copy()]
    stop = threading.Event()
    outcomes: dict[str, set[str]] = {"close": set(), "shrink": set(), "resize": set()}

    def resize() -> None:
        box[0].resize(n // 2)

    def attack() -> None:
        tries: dict[str, Callable[[], object]] = {
            "close": mm.close,
            "shrink": lambda: mm.resize(n // 2),
            "resize": resize,
        }
        while not stop.is_set():
            for name, fn in tries.items():
                outcomes[name].add(_outcome(fn).split(":")[0])
            time.sleep(0)

    t = threading.Thread(target=attack)
    t.start()
    copies = 0
    try:
        end = time.monotonic() + 0.6
        while time.monotonic() < end or copies < 5:
            for copy in (stream_copy, np.copyto):
                try:
                    copy(dst, box[0])
                    copies += 1
                except ValueError:  # resized between two copies
                    assert box[0].shape == (n // 2,)
                    box[0] = want.copy()
    finally:
        stop.set()
        t.join(30)
    assert outcomes["close"] == {"BufferError"} and outcomes["shrink"] == {"BufferError"}
    assert outcomes["resize"] <= {"ok", "ValueError"}, outcomes
    assert not mm.closed and len(mm) == n and copies >= 5
    box[0] = want.copy()
    stream_copy(dst, box[0])
    assert np.array_equal(dst, want)


@needs_native
def test_dropping_every_reference_during_the_copy_keeps_the_memory_until_it_ends() -> None:
    """A copy into a view of a file's mmap runs in a thread while this thread drops its
    references to the view, the mmap and the source and collects: the copy keeps them
    alive (its buffer exports hold references), so the file holds every byte after."""
    n = 16 * MiB
    rng = np.random.default_rng(2)
    for round_ in range(4):
        with tempfile.TemporaryFile() as f:
            f.truncate(n)
            mm = mmap.mmap(f.fileno(), n)
            dst = np.frombuffer(mm, np.uint8)
            src = rng.integers(0, 256, n, np.uint8)
            want = src.tobytes()
            started = threading.Event()

            def run(d: np.ndarray, s: np.ndarray, started: threading.Event) -> None:
                started.set()
                stream_copy(d, s)

            th = threading.Thread(target=run, args=(dst, src, started))
            th.start()
            started.wait()
            del dst, src, mm
            gc.collect()
            th.join(30)
            del th
            gc.collect()
            f.seek(0)
            assert f.read() == want, round_


@needs_native
def test_threads_streaming_into_one_mapping_at_once_each_land_their_own_bytes() -> None:
    """Four threads copy into disjoint, oddly aligned pieces of one shared mapping at
    once, again and again (their non-temporal stores and fences interleaved): every
    piece holds its own thread's bytes and the gaps between them are untouched."""
    n = 4 * MiB
    mm = mmap.mmap(-1, 4 * (n + 4096))
    whole = np.frombuffer(mm, np.uint8)
    whole[:] = 0x5A
    rng = np.random.default_rng(3)
    starts = [i * (n + 4096) + 1 + 17 * i for i in range(4)]
    srcs = [rng.integers(0, 256, n, np.uint8) for _ in range(4)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(6):
                stream_copy(whole[starts[i] : starts[i] + n], srcs[i])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    want = np.full(len(whole), 0x5A, np.uint8)
    for s, src in zip(starts, srcs, strict=True):
        want[s : s + n] = src
    assert np.array_equal(whole, want)


# ------------------------------------------------------------------------- served


server, remote = served("stream-copy", dram=96 * MiB, disk=128 * MiB, staging=48 * MiB)
_identity = identities("stream")


_HELD = {"bfloat16": "<u2", "float8_e4m3fn": "u1", "float8_e5m2": "u1"}


def _kv(layout: KVLayout, nchunks: int, form: str, seed: int) -> tuple[object, np.ndarray]:
    """(KV as put_prompt is given it, the same values as one C-contiguous array).
    Forms: ``chunks`` (a list of C-contiguous chunk arrays: streamed whole),
    ``misaligned`` (chunks at odd addresses, read-only), ``tensor`` (one array: a
    strided view per chunk unless there is one chunk), ``torch`` (a CPU tensor)."""
    dt = np.dtype(_HELD.get(layout.dtype, layout.dtype))
    n = layout.tokens_per_chunk
    shape = (layout.num_layers, 2, layout.num_kv_heads, nchunks * n, layout.head_dim)
    nbytes = int(np.prod(shape)) * dt.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    full = raw.view(dt).reshape(shape)
    pieces = [np.ascontiguousarray(full[:, :, :, i * n : (i + 1) * n]) for i in range(nchunks)]
    if form == "chunks":
        return pieces, full
    if form == "misaligned":
        out = []
        for i, p in enumerate(pieces):
            at = 1 + (i * 5) % 15
            buf = bytes(at) + p.tobytes()
            out.append(np.frombuffer(buf, dt, offset=at).reshape(p.shape))
        assert not out[0].flags.writeable
        assert dt.itemsize == 1 or not out[0].flags.aligned
        return out, full
    if form == "torch":
        import torch

        t = torch.from_numpy(full.view(np.int16) if dt.itemsize == 2 else full.view(np.uint8))
        if layout.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t, full
    return full, full


def _loads_exact(remote: RemoteStore, ident: ModelIdentity, tokens: list[int], full: Any) -> None:
    n = ident.layout.tokens_per_chunk
    got = remote.load(remote.lookup(ident, PUBLIC, tokens))
    assert got.loaded == len(tokens) // n
    for i, a in enumerate(got.arrays):
        want = np.ascontiguousarray(full[:, :, :, i * n : (i + 1) * n])
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), want.view(np.uint8)), i


def _clean(remote: RemoteStore) -> None:
    report = remote.check()
    assert report.clean, report
    state = quiet(remote)
    assert state["unreplied_errors"] == 0 and state["internal_errors"] == 0


# (layout, chunks, KV form): rows exactly STREAM_BYTES, rows just over and just under it
# (not a multiple of 16 or 64 bytes), a single-row chunk, chunks of 4 MiB (notices
# during the put, pieces of heads in its last step), every KV dtype
SERVED = [
    pytest.param(
        KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=64),
        4,
        "chunks",
        id="f16-row-64KiB-chunks",
    ),
    pytest.param(
        KVLayout(num_layers=3, num_kv_heads=2, head_dim=40, dtype="float32", tokens_per_chunk=103),
        3,
        "misaligned",
        id="f32-row-64KiB+384-misaligned-readonly",
    ),
    pytest.param(
        KVLayout(num_layers=3, num_kv_heads=1, head_dim=32767, dtype="uint8", tokens_per_chunk=1),
        5,
        "misaligned",
        id="u8-row-64KiB-2-misaligned",
    ),
    pytest.param(
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="int8", tokens_per_chunk=1024),
        1,
        "tensor",
        id="i8-one-row-one-chunk-tensor",
    ),
    pytest.param(
        KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16", tokens_per_chunk=16),
        3,
        "torch",
        id="bf16-torch-tensor-strided-chunks",
    ),
    pytest.param(
        KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16", tokens_per_chunk=16),
        1,
        "torch",
        id="bf16-torch-one-chunk",
    ),
    pytest.param(
        KVLayout(
            num_layers=1, num_kv_heads=3, head_dim=1000, dtype="float8_e4m3fn", tokens_per_chunk=33
        ),
        2,
        "chunks",
        id="f8-row-198000",
    ),
    pytest.param(
        KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_chunk=256),
        2,
        "chunks",
        id="f16-4MiB-chunks-notices",
    ),
]


@needs_native
@pytest.mark.parametrize(("layout", "nchunks", "form"), SERVED)
def test_served_puts_streamed_into_the_arena_load_exact_and_audit_clean(
    remote: RemoteStore,
    monkeypatch: pytest.MonkeyPatch,
    counting: Counting,
    layout: KVLayout,
    nchunks: int,
    form: str,
) -> None:
    """A two-phase put (the first of its shape: ``_prepare``'s copy) then two staged
    puts of the same shape (``copy_telling``), new KV each time, through a real
    ``kvlife serve``: the copies of C-contiguous pieces went through the extension, the
    server sealed what they wrote (the audit is clean: the seals verify) and every chunk
    loads back byte for byte."""
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    verbs = sent_verbs(monkeypatch)
    puts: list[tuple[list[int], np.ndarray]] = []
    for k in range(3):
        tokens = list(range(100_000 * k, 100_000 * k + nchunks * n))
        kv, full = _kv(layout, nchunks, form, seed=k + 10 * nchunks)
        before = len(counting.calls)
        res = remote.put_prompt(ident, PUBLIC, tokens, kv)
        assert res.stored == nchunks
        streamed = counting.calls[before:]
        contiguous = form != "tensor" and (form != "torch" or nchunks == 1)
        if contiguous or nchunks == 1:
            assert streamed and all(c >= STREAM_BYTES for c in streamed), "streamed"
        puts.append((tokens, full))
    assert verbs.count("prepare_put") == 1 and verbs.count("put") == 2, verbs
    if layout.chunk_nbytes * nchunks > client_puts.WRITTEN_NOTICE_BYTES:
        assert "put_written" in verbs
    _clean(remote)
    for tokens, full in puts:
        _loads_exact(remote, ident, tokens, full)


@needs_native
def test_a_chunk_streamed_again_after_its_notice_is_caught_by_its_seal(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, counting: Counting
) -> None:
    """With the streaming copy on (rows of 64 KiB, a notice after each): once the last
    chunk's copy begins and the server has taken the notices before, chunk 0 is written
    again in its extent by the same streaming copy. The server's seal of chunk 0 is the
    hash of the bytes the notice found, so the audit reports it; the other chunks
    verify."""
    layout = KVLayout(
        num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=64
    )
    row = layout.chunk_nbytes // layout.num_layers
    assert row == STREAM_BYTES
    monkeypatch.setattr(remote._puts, "notice_bytes", row)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    first, _ = _kv(layout, 3, "chunks", seed=1)
    remote.put_prompt(ident, PUBLIC, list(range(3 * n)), first)  # stages 3 extents
    assert remote.check().clean
    wire = remote._wire
    view = wire.view
    extents: list[np.ndarray] = []
    rewritten: list[int] = []

    def spy_view(*args: Any) -> np.ndarray:
        extents.append(view(*args))
        return extents[-1]

    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        if len(extents) == 3 and not rewritten:
            conn = wire.conn
            assert conn is not None
            wire.roundtrip(conn, "state", {})  # the notices before were taken
            raw = extents[0].reshape(-1).view(np.uint8)
            before = len(counting.calls)
            stream_copy(raw, ~raw)  # chunk 0 again, every bit flipped, streamed
            rewritten.append(len(counting.calls) - before)
        stream_copy(dst, src)

    verbs = sent_verbs(monkeypatch)
    monkeypatch.setattr(wire, "view", spy_view)
    monkeypatch.setattr(client_puts, "stream_copy", copy)
    second, _ = _kv(layout, 3, "chunks", seed=2)
    tokens = list(range(500_000, 500_000 + 3 * n))
    before = len(counting.calls)
    res = remote.put_prompt(ident, PUBLIC, tokens, second)
    monkeypatch.setattr(client_puts, "stream_copy", stream_copy)
    monkeypatch.setattr(wire, "view", view)
    assert res.stored == 3 and len(extents) == 3 and rewritten == [1], "the staged path"
    assert verbs.count("put") == 1 and verbs.count("put_written") >= 2, verbs
    assert len(counting.calls) - before >= 4, "the put's rows were streamed"
    report = remote.check()
    assert not report.clean
    assert len(report.problems) == 1 and "after it was sealed" in report.problems[0]


_NO_NATIVE_CHILD = """
import sys
import numpy as np
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.native import frames
from kvlife.native.copies import STREAM_BYTES, stream_copy

assert frames.native_module() is None and not frames.available()
rng = np.random.default_rng(7)
for size in (STREAM_BYTES - 1, STREAM_BYTES, 3 * STREAM_BYTES + 5):
    src = rng.integers(0, 256, size + 9, np.uint8)[9:]
    got = np.zeros(size + 3, np.uint8)
    want = got.copy()
    stream_copy(got[1:-2], src)
    np.copyto(want[1:-2], src)
    assert np.array_equal(got, want)
layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16",
                  tokens_per_chunk=64)
ident = ModelIdentity(layout=layout, model_id="no-native", weights_digest="w",
                      tokenizer_digest="t")
n = layout.tokens_per_chunk
r = RemoteStore(sys.argv[1], timeout=30)
puts = []
for k in range(3):
    tokens = list(range(700_000 + 10_000 * k, 700_000 + 10_000 * k + 3 * n))
    kv = rng.integers(0, 1 << 16, (2, 2, 4, 3 * n, 64), np.uint16).view(np.float16)
    chunks = [np.ascontiguousarray(kv[:, :, :, i * n:(i + 1) * n]) for i in range(3)]
    assert r.put_prompt(ident, PUBLIC, tokens, chunks).stored == 3
    puts.append((tokens, chunks))
for tokens, chunks in puts:
    got = r.load(r.lookup(ident, PUBLIC, tokens))
    assert got.loaded == 3
    for a, c in zip(got.arrays, chunks):
        assert np.array_equal(a.view(np.uint16), c.view(np.uint16))
assert r.check().clean
r.close()
print("done", flush=True)
"""


def test_a_client_without_the_extension_puts_the_same_bytes(server: ServerProc) -> None:
    """KVLIFE_NATIVE=0 in a client process: copies.py has no extension and copies with
    np.copyto; its two-phase and staged puts through the same server load back exact
    and the audit is clean."""
    child_finishes(textwrap.dedent(_NO_NATIVE_CHILD), str(server.socket), native=False, timeout=120)


def test_the_built_extension_carries_stream_copy() -> None:
    """Guard for the tests above: where an extension is built (and not switched off) it
    loads and has ``stream_copy`` (one built from an older _frames.c is refused whole by
    kvlife.native.frames, which would silently turn every native test here into a
    skip)."""
    if not list((ROOT / "kvlife" / "native").glob("_frames*.so")):
        pytest.skip("no C extension built")
    if os.environ.get("KVLIFE_NATIVE") == "0":
        pytest.skip("KVLIFE_NATIVE=0: the extension is off")
    module = frames.native_module()
    assert module is not None and hasattr(module, "stream_copy")
