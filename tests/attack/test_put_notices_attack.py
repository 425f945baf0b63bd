"""Attacks on the staged put's ``put_written`` notices (kvlife/client/puts.py:
``notice_points``, ``copy_telling``, ``_copy_units``, ``Puts._put``'s ``write``;
kvlife/server/puts.py: ``put_written``, ``_hash_written``, ``put_commit``): the last
notice step told at halves down to ``TAIL_NOTICE_BYTES`` and copied in pieces of whole
heads, so that a notice can fall inside a row.

The promise under attack: never serve wrong KV. Every notice counts only bytes already
copied (the extents' prefix holds exactly the caller's bytes when it goes out), copies
go in order and never touch bytes told, counts increase and stay below the put, every
byte lands where it belongs, the server's seal of a chunk is the hash of exactly the
bytes it holds, loads return the caller's bytes and the audit is clean. KV is given as
strided, reversed, transposed and sliced views, in 1-, 2- and 4-byte dtypes, with rows
larger than the tail and not a multiple of it, heads larger than the tail, single-layer
and single-head layouts, one chunk and many, chunks the server already holds, and the
notice settings pushed to their ends."""

from __future__ import annotations

import threading
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlife.client.puts as client_puts
from kvlife.client import RemoteStore
from kvlife.client.puts import copy_telling, notice_points, notice_step
from kvlife.core.identity import PUBLIC, ChunkKey, KVLayout, ModelIdentity
from kvlife.native.copies import stream_copy
from kvlife.results import PutResult
from kvlife.server import protocol
from kvlife.server.puts import _hash_written, _Staged
from kvlife.store.writes import PendingPut
from tests.attack.served import identities, served
from tests.server.conftest import quiet

pytestmark = pytest.mark.usefixtures("server_hashes_puts")  # the notices' path

MiB = 1 << 20


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` in C order (a copy for a non-contiguous view)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _view_of(data: np.ndarray, how: int) -> np.ndarray:
    """A view of ``data``'s values with unusual strides, of the same shape and values:
    0 contiguous, 1 reversed along every axis, 2 transposed-then-copied (the copy lies in
    memory as (tokens, dim, layers, kv, heads)), 3 a sliced window of a larger tensor
    with steps on every axis, 4 reversed along the token and the dim axes only."""
    if how == 0:
        return data
    if how == 1:
        big = np.ascontiguousarray(data[::-1, ::-1, ::-1, ::-1, ::-1])
        return big[::-1, ::-1, ::-1, ::-1, ::-1]
    if how == 2:
        t = np.ascontiguousarray(data.transpose(3, 4, 0, 1, 2))
        return t.transpose(2, 3, 4, 0, 1)
    if how == 3:
        shape = tuple(2 * s + 1 for s in data.shape)
        big = np.zeros(shape, data.dtype)
        big[1::2, 1::2, 1::2, 1::2, 1::2] = data
        return big[1::2, 1::2, 1::2, 1::2, 1::2]
    big = np.ascontiguousarray(data[:, :, :, ::-1, ::-1])
    return big[:, :, :, ::-1, ::-1]


DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "uint8": np.uint8}


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random values whose bytes are random too (every bit pattern of the dtype)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    out: np.ndarray = raw.view(dtype).reshape(shape)
    return out


# --------------------------------------------------------------------------- unit


class _Recorder:
    """The copy of kvlife/client/puts.py (its ``stream_copy``): every call is checked to
    write the next bytes of the put in order (its destination a contiguous run of one
    extent starting where the copy before ended) and recorded."""

    def __init__(self, dsts: list[np.ndarray]) -> None:
        self.dsts = dsts
        self.size = dsts[0].nbytes
        self.end = 0
        """Bytes of the put written so far (in order)."""
        self.told = 0

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        assert dst.flags.c_contiguous, "a piece is contiguous in the extent"
        ptr = dst.__array_interface__["data"][0]
        for i, ext in enumerate(self.dsts):
            base = ext.__array_interface__["data"][0]
            if base <= ptr < base + self.size:
                start = i * self.size + ptr - base
                break
        else:
            raise AssertionError("a copy outside every extent")
        assert start == self.end, f"copy at byte {start}, the put is written to {self.end}"
        assert start >= self.told, "a copy into bytes already told written"
        assert start + dst.nbytes <= (i + 1) * self.size, "a copy across extents"
        np.copyto(dst, src)
        self.end = start + dst.nbytes


def _check_copy_telling(
    dims: tuple[int, int, int, int, int],
    count: int,
    step: int,
    points: list[int],
    dtype: Any,
    how: int,
    seed: int,
) -> list[int]:
    """``copy_telling`` of ``count`` chunks of ``dims`` into zeroed extents, every copy
    and every notice checked (see the module docstring); the counts told."""
    layers, kv, heads, tokens, dim = dims
    rng = np.random.default_rng(seed)
    data = _view_of(_random(rng, (layers, kv, heads, tokens * count, dim), dtype), how)
    chunks = [data[:, :, :, i * tokens : (i + 1) * tokens] for i in range(count)]
    want = np.concatenate([_bytes(c) for c in chunks])
    total = want.size
    # the extents lie in one buffer, filled with the complement of what they will hold
    # (a byte not yet copied never equals the caller's)
    buf = np.empty(total, np.uint8)
    buf[:] = ~want
    size = total // count
    dsts = [
        buf[i * size : (i + 1) * size].view(dtype).reshape(chunks[0].shape) for i in range(count)
    ]
    rec = _Recorder(dsts)
    told: list[int] = []

    def tell(done: int) -> None:
        assert 0 < done < total, (done, total)
        assert not told or done > told[-1], ("counts increase", told, done)
        assert done <= rec.end, ("told bytes not copied", done, rec.end)
        assert np.array_equal(buf[:done], want[:done]), "a told byte differs from the KV"
        assert not np.any(buf[done : rec.end] != want[done : rec.end])
        told.append(done)
        rec.told = done

    setattr(client_puts, "stream_copy", rec.copyto)  # noqa: B010 - not exported
    try:
        copy_telling(iter(dsts), chunks, step, points, tell)
    finally:
        setattr(client_puts, "stream_copy", stream_copy)  # noqa: B010
    assert rec.end == total, "every byte copied"
    assert np.array_equal(buf, want), "every byte where it belongs"
    # every point is told at or after it, or only the end of the put passes it
    for p in points:
        assert any(t >= p for t in told) or rec.end == total
    return told


_dims = st.tuples(
    st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(1, 6)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dims=_dims,
    count=st.integers(1, 5),
    step=st.integers(1, 3000),
    tail=st.integers(1, 700),
    dtype=st.sampled_from(list(DTYPES.values())),
    how=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_copy_telling_tells_only_bytes_copied_with_notice_points(
    dims: tuple[int, int, int, int, int],
    count: int,
    step: int,
    tail: int,
    dtype: Any,
    how: int,
    seed: int,
) -> None:
    """With the points the put uses (every step, then halves down to the tail), from
    views of every stride kind and dtype: each count told is already copied, in order,
    exact; copies are contiguous, in order, never into told bytes; every byte lands."""
    itemsize = np.dtype(dtype).itemsize
    total = int(np.prod(dims)) * count * itemsize
    points = notice_points(total, step, tail)
    told = _check_copy_telling(dims, count, step, points, dtype, how, seed)
    tokens, dim = dims[3], dims[4]
    head = tokens * dim * itemsize
    # in the last step (pieces of whole heads) each point is told within a head of it
    fine = total - step
    for p in points:
        before = max((t for t in told if t < p), default=0)
        after = [t for t in told if t >= p]
        if before >= fine and after:
            assert after[0] - p < head, (p, told, head)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dims=_dims,
    count=st.integers(1, 4),
    step=st.integers(1, 5000),
    data=st.data(),
    dtype=st.sampled_from(list(DTYPES.values())),
    how=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_copy_telling_tells_only_bytes_copied_with_arbitrary_points(
    dims: tuple[int, int, int, int, int],
    count: int,
    step: int,
    data: st.DataObject,
    dtype: Any,
    how: int,
    seed: int,
) -> None:
    """Points anywhere inside the put (any increasing list, bunched in one head, at
    byte 1 and at the last byte), any step: never a count of bytes not copied."""
    total = int(np.prod(dims)) * count * np.dtype(dtype).itemsize
    if total < 2:
        return
    points = sorted(set(data.draw(st.lists(st.integers(1, total - 1), max_size=40))))
    _check_copy_telling(dims, count, step, points, dtype, how, seed)


@given(
    total=st.integers(1, 1 << 34),
    least=st.integers(-2, 1 << 24),
    per=st.integers(1, 1 << 10),
    tail=st.integers(1, 1 << 22),
)
def test_notice_points_are_inside_the_put_increasing_and_few(
    total: int, least: int, per: int, tail: int
) -> None:
    """Whatever ``notice_bytes`` (none, one byte), ``NOTICES_PER_PUT`` and tail: the
    points increase strictly and lie strictly inside the put, at most about ``per`` a
    put plus the halvings (never one notice per byte of a large put)."""
    saved = client_puts.NOTICES_PER_PUT
    client_puts.NOTICES_PER_PUT = per
    try:
        step = notice_step(total, least)
    finally:
        client_puts.NOTICES_PER_PUT = saved
    if least <= 0:
        assert step > total
    if step > 0 and total // step > 4096:
        return  # a tiny step asked for on purpose: each step is a point
    points = notice_points(total, step, tail)
    assert all(0 < a < b < total for a, b in pairwise(points))
    assert all(0 < p < total for p in points)
    assert len(points) <= total // step + (total.bit_length() + 1)


def _fake_staged(views: list[np.ndarray], new: list[ChunkKey | None]) -> tuple[_Staged, PendingPut]:
    keys = [k if k is not None else ChunkKey(bytes([200 + i])) for i, k in enumerate(new)]
    pending = PendingPut(keys, 1, "attack")
    layout = KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=views[0].size, dtype="uint8", tokens_per_chunk=1
    )
    staged = _Staged(pending, list(range(len(views))), views, layout, [], [0] * len(views), new)
    return staged, pending


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 300),
    mask=st.lists(st.booleans(), min_size=1, max_size=6),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_the_server_seals_a_chunk_with_the_hash_of_its_bytes_whatever_the_notices(
    size: int, mask: list[bool], data: st.DataObject, seed: int
) -> None:
    """``_hash_written`` fed any non-decreasing notices (repeated counts, counts at
    chunk ends, at byte 1, at the last byte), then the commit's: every new chunk is
    sealed with the xxh3-128 of its bytes, the present ones (None) not at all. The
    bytes after the last notice are written only after it (as a client does)."""
    rng = np.random.default_rng(seed)
    count = len(mask)
    total = size * count
    want = rng.integers(0, 256, total, dtype=np.uint8)
    buf = np.zeros(total, np.uint8)
    views = [buf[i * size : (i + 1) * size] for i in range(count)]
    new = [ChunkKey(bytes([i])) if m else None for i, m in enumerate(mask)]
    staged, pending = _fake_staged(views, new)
    notices = sorted(data.draw(st.lists(st.integers(0, total), max_size=12)))
    written = 0
    for upto in notices:
        buf[written:upto] = want[written:upto]  # the client copies, then tells
        written = max(written, upto)
        _hash_written(staged, upto)
    buf[written:] = want[written:]
    _hash_written(staged, total)  # the commit
    for i, key in enumerate(new):
        if key is None:
            assert ChunkKey(bytes([200 + i])) not in pending.seals
            continue
        assert (
            pending.seals[key]
            == xxhash.xxh3_128(want[i * size : (i + 1) * size].tobytes()).digest()
        )
    assert set(pending.seals) == {k for k in new if k is not None}


# --------------------------------------------------------------------------- served


server, remote = served("put-notices", dram=64 * MiB, staging=32 * MiB)
_identity = identities("notices")


def _staged_put(
    remote: RemoteStore,
    monkeypatch: pytest.MonkeyPatch,
    ident: ModelIdentity,
    tokens: list[int],
    kv: np.ndarray,
) -> tuple[PutResult, list[int]]:
    """A put that must go into staged extents, watched: each copy writes the next bytes
    of the put in order (never told bytes), each ``put_written`` counts bytes whose
    extents hold exactly the caller's bytes when it goes out, the counts increase and
    stay below the put. The counts told."""
    layout = ident.layout
    n = layout.tokens_per_chunk
    nchunks = len(tokens) // n
    want = np.concatenate([_bytes(kv[:, :, :, i * n : (i + 1) * n]) for i in range(nchunks)])
    total = want.size
    size = layout.chunk_nbytes
    wire = remote._wire
    view = wire.view
    extents: list[np.ndarray] = []
    told: list[int] = []
    pos = {"end": 0}

    def spy_view(*args: Any) -> np.ndarray:
        extents.append(view(*args))
        return extents[-1]

    def written_prefix(upto: int) -> bool:
        for i in range(-(-upto // size)):
            end = min(size, upto - i * size)
            got = extents[i].reshape(-1).view(np.uint8)[:end]
            if not np.array_equal(got, want[i * size : i * size + end]):
                return False
        return True

    pack = protocol.pack

    def spy_pack(msg: object) -> bytes:
        if isinstance(msg, list) and msg[1] == "put_written":
            done = msg[2]["bytes"]
            assert 0 < done < total, (done, total)
            assert not told or done > told[-1], (told, done)
            assert done <= pos["end"], ("told bytes not yet copied", done, pos["end"])
            assert len(extents) * size >= done
            assert written_prefix(done), f"put_written {done}: the extents differ from the KV"
            told.append(done)
        return pack(msg)

    class Numpy:
        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        @staticmethod
        def copyto(dst: np.ndarray, src: np.ndarray) -> None:
            assert dst.flags.c_contiguous
            ext = extents[-1]
            off = dst.__array_interface__["data"][0] - ext.__array_interface__["data"][0]
            start = (len(extents) - 1) * size + off
            assert off >= 0 and off + dst.nbytes <= size
            assert start == pos["end"], ("out of order", start, pos["end"])
            assert not told or start >= told[-1]
            np.copyto(dst, src)
            pos["end"] = start + dst.nbytes

    with monkeypatch.context() as m:
        m.setattr(wire, "view", spy_view)
        m.setattr(client_puts, "stream_copy", Numpy.copyto)
        m.setattr(protocol, "pack", spy_pack)
        res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    assert len(extents) == nchunks and pos["end"] == total, "the staged path, every byte"
    return res, told


def _loads_exact(
    remote: RemoteStore, ident: ModelIdentity, tokens: list[int], kv: np.ndarray
) -> None:
    n = ident.layout.tokens_per_chunk
    got = remote.load(remote.lookup(ident, PUBLIC, tokens))
    assert got.loaded == len(tokens) // n
    for i, a in enumerate(got.arrays):
        assert np.array_equal(_bytes(a), _bytes(kv[:, :, :, i * n : (i + 1) * n]))


def _clean(remote: RemoteStore) -> None:
    report = remote.check()
    assert report.clean, report
    state = quiet(remote)
    assert state["unreplied_errors"] == 0 and state["internal_errors"] == 0


# (layout, chunks, notice_bytes, NOTICES_PER_PUT, tail, view kind)
CASES = [
    pytest.param(  # float32, a row (23040 B) many tails long and not a multiple of it
        KVLayout(num_layers=3, num_kv_heads=3, head_dim=40, dtype="float32", tokens_per_chunk=24),
        4,
        69120,
        16,
        1000,
        1,
        id="f32-rows-not-multiple-of-tail-reversed",
    ),
    pytest.param(  # int8, one layer and one head: a head (16 KiB) four tails long
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="int8", tokens_per_chunk=256),
        3,
        1,
        1 << 30,
        4 << 10,
        2,
        id="int8-one-layer-one-head-head-over-tail-transposed",
    ),
    pytest.param(  # bfloat16 (held as uint16), a step no row multiple, a tail no head's
        KVLayout(num_layers=5, num_kv_heads=2, head_dim=16, dtype="bfloat16", tokens_per_chunk=32),
        6,
        7000,
        16,
        3000,
        3,
        id="bf16-odd-step-odd-tail-sliced",
    ),
    pytest.param(  # one chunk: the step covers it, no notice at all
        KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=64),
        1,
        1,
        16,
        16 << 10,
        4,
        id="f16-one-chunk",
    ),
    pytest.param(  # one chunk, notices inside it (a step of a row), a tail of one byte
        KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="uint8", tokens_per_chunk=16),
        1,
        1,
        1 << 30,
        1,
        1,
        id="u8-one-chunk-tail-one-byte",
    ),
    pytest.param(  # many small chunks, a notice every byte asked for, tail of one byte
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=16),
        24,
        1,
        1 << 30,
        1,
        3,
        id="f16-24-chunks-every-row-tail-one-byte",
    ),
    pytest.param(  # default notice settings, chunks of 2 MiB (rows of 256 KiB = the tail)
        KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype="float16", tokens_per_chunk=128),
        3,
        client_puts.WRITTEN_NOTICE_BYTES,
        16,
        client_puts.TAIL_NOTICE_BYTES,
        4,
        id="f16-2MiB-chunks-defaults",
    ),
]


@pytest.mark.parametrize(("layout", "nchunks", "least", "per", "tail", "how"), CASES)
def test_a_staged_put_tells_only_written_bytes_and_seals_the_callers_kv(
    remote: RemoteStore,
    monkeypatch: pytest.MonkeyPatch,
    layout: KVLayout,
    nchunks: int,
    least: int,
    per: int,
    tail: int,
    how: int,
) -> None:
    """Second put of a shape (staged extents), KV as an unusual view: each notice counts
    bytes already copied and exact, the audit is clean and the chunks load exact."""
    monkeypatch.setattr(remote._puts, "notice_bytes", least)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", per)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", tail)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    rng = np.random.default_rng(nchunks * 1000 + how)
    dtype = np.uint16 if layout.dtype == "bfloat16" else DTYPES[layout.dtype]
    shape = (layout.num_layers, 2, layout.num_kv_heads, nchunks * n, layout.head_dim)
    first = list(range(nchunks * n))
    remote.put_prompt(ident, PUBLIC, first, _random(rng, shape, dtype))  # stages extents
    tokens = list(range(10**6, 10**6 + nchunks * n))
    kv = _view_of(_random(rng, shape, dtype), how)
    res, told = _staged_put(remote, monkeypatch, ident, tokens, kv)
    assert res.stored == nchunks
    if nchunks > 1 or least == 1:
        assert told, "notices were sent"
    _clean(remote)
    _loads_exact(remote, ident, tokens, kv)


def test_present_chunks_are_not_hashed_and_the_new_ones_seal_exact(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks 0 and 1 of five held by the server already (their extents are written but
    not hashed); the halved notices fall inside the last chunk's rows; then the same
    put again (every chunk present: nothing sealed, nothing stored)."""
    layout = KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=24, dtype="float16", tokens_per_chunk=40
    )
    monkeypatch.setattr(remote._puts, "notice_bytes", layout.chunk_nbytes // 3)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", 500)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    rng = np.random.default_rng(9)
    shape = (3, 2, 2, 5 * n, 24)
    remote.put_prompt(ident, PUBLIC, list(range(5 * n)), _random(rng, shape, np.float16))
    tokens = list(range(7000, 7000 + 5 * n))
    kv = _view_of(_random(rng, shape, np.float16), 1)
    remote.put_prompt(ident, PUBLIC, tokens[: 2 * n], kv[:, :, :, : 2 * n])  # 0 and 1
    res, told = _staged_put(remote, monkeypatch, ident, tokens, kv)
    assert res.stored == 3 and res.already_present == 2
    size = layout.chunk_nbytes
    assert any(4 * size < t for t in told) and any(t % size for t in told)
    _clean(remote)
    _loads_exact(remote, ident, tokens, kv)
    again, _ = _staged_put(remote, monkeypatch, ident, tokens, np.ascontiguousarray(kv))
    assert again.stored == 0 and again.already_present == 5
    _clean(remote)
    _loads_exact(remote, ident, tokens, kv)


def test_the_same_shape_put_again_and_again_reuses_extents_and_stays_exact(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged extents go round (present chunks' extents back to the pool, refills):
    eight puts in a row of the same shape, each told at halves down to a quarter head,
    with differing chunk counts of one shape; every one loads exact, the audit clean."""
    layout = KVLayout(
        num_layers=2, num_kv_heads=3, head_dim=16, dtype="float32", tokens_per_chunk=32
    )
    head = 32 * 16 * 4
    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 4)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", head // 4)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    rng = np.random.default_rng(3)
    remote.put_prompt(
        ident, PUBLIC, list(range(4 * n)), _random(rng, (2, 2, 3, 4 * n, 16), np.float32)
    )
    puts = []
    for k in range(8):
        tokens = list(range(10_000 * (k + 1), 10_000 * (k + 1) + 4 * n))
        kv = _view_of(_random(rng, (2, 2, 3, 4 * n, 16), np.float32), k % 5)
        res, told = _staged_put(remote, monkeypatch, ident, tokens, kv)
        assert res.stored == 4 and told
        puts.append((tokens, kv))
    _clean(remote)
    for tokens, kv in puts:
        _loads_exact(remote, ident, tokens, kv)


def test_threads_sharing_a_client_never_mix_their_notices(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads put through one client at once, each told at halves down to a byte:
    a ``put_written`` of one put never lands on another's (the seals would not match);
    the audit is clean and every put loads exact."""
    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", tokens_per_chunk=64
    )
    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", 1)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    shape = (2, 2, 2, 3 * n, 32)
    remote.put_prompt(
        ident, PUBLIC, list(range(3 * n)), _random(np.random.default_rng(0), shape, np.float16)
    )
    errors: list[BaseException] = []
    done: list[tuple[list[int], np.ndarray]] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        rng = np.random.default_rng(100 + t)
        try:
            for k in range(5):
                base = 1_000_000 * (t + 1) + 1000 * k
                tokens = list(range(base, base + 3 * n))
                kv = _view_of(_random(rng, shape, np.float16), (t + k) % 5)
                res = remote.put_prompt(ident, PUBLIC, tokens, kv)
                assert res.stored == 3
                with lock:
                    done.append((tokens, kv))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert len(done) == 20
    _clean(remote)
    for tokens, kv in done:
        _loads_exact(remote, ident, tokens, kv)


def test_a_source_that_aliases_itself_is_copied_as_the_caller_sees_it(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV given as a broadcast view (stride 0 on the token axis: every token the same
    bytes) and with k and v the same memory (stride 0 on axis 1): the extents and the
    seals hold what the caller's view shows, element by element."""
    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_chunk=32
    )
    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", 100)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    rng = np.random.default_rng(11)
    shape = (2, 2, 2, 3 * n, 16)
    remote.put_prompt(ident, PUBLIC, list(range(3 * n)), _random(rng, shape, np.float16))
    base = _random(rng, (2, 1, 2, 1, 16), np.float16)
    kv = np.broadcast_to(base, shape)
    assert kv.strides[1] == 0 and kv.strides[3] == 0
    tokens = list(range(50_000, 50_000 + 3 * n))
    res, told = _staged_put(remote, monkeypatch, ident, tokens, kv)
    assert res.stored == 3 and told
    _clean(remote)
    _loads_exact(remote, ident, tokens, kv)


def test_a_put_in_pieces_tells_each_piece_its_own_bytes(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt put in pieces of two chunks (each its own staged put, chained): the
    notices of a piece count that piece's bytes only (below two chunks, increasing from
    its ``put``), the chained pieces seal exact and the whole prompt loads exact."""
    layout = KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_chunk=32
    )
    monkeypatch.setattr(remote._puts, "notice_bytes", 1)
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 8)
    monkeypatch.setattr(client_puts, "TAIL_NOTICE_BYTES", 64)
    monkeypatch.setattr(remote._puts, "piece_chunks", lambda layout: 2)
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    rng = np.random.default_rng(21)
    shape = (3, 2, 2, 7 * n + 5, 16)  # seven chunks and a trailing partial one
    remote.put_prompt(ident, PUBLIC, list(range(7 * n + 5)), _random(rng, shape, np.float16))
    pieces: list[list[int]] = []
    pack = protocol.pack

    def spy(msg: object) -> bytes:
        if isinstance(msg, list) and msg[1] == "put":
            pieces.append([])
        if isinstance(msg, list) and msg[1] == "put_written":
            pieces[-1].append(msg[2]["bytes"])
        return pack(msg)

    tokens = list(range(90_000, 90_000 + 7 * n + 5))
    kv = _view_of(_random(rng, shape, np.float16), 3)
    monkeypatch.setattr(protocol, "pack", spy)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(protocol, "pack", pack)
    assert res.stored == 7 and len(res.keys) == 7
    assert len(pieces) == 4, "every piece a staged put"
    sizes = [2, 2, 2, 1]
    for told, count in zip(pieces, sizes, strict=True):
        assert all(0 <= a < b for a, b in pairwise([0, *told]))
        assert all(t < count * layout.chunk_nbytes for t in told)
    assert all(pieces[:3])
    _clean(remote)
    _loads_exact(remote, ident, tokens[: 7 * n], kv[:, :, :, : 7 * n])
