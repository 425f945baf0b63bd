"""Attacks on the client's seals (commit 3bcff18, issue 28): kvlife/native/_frames.c
``copy_sealed(dst, src) -> 16 bytes | None`` (stream_copy's copy, each 32 KiB block of
``src`` hashed by xxh3-128 just before it is copied), kvlife/native/copies.py
``copy_sealed``/``sealing``, kvlife/client/puts.py ``Puts._put`` (a staged put of at
most ``SEAL_PUT_BYTES`` copies each chunk with ``copy_sealed`` and sends the seals with
``put_commit`` instead of ``put_written`` notices), kvlife/server/puts.py
``put_commit``/``_take_seals``/``_hash_written`` (protocol 4).

The promises under attack: the seal is the xxh3-128 of the C-order bytes for every
shape, stride, dtype, size and alignment, or None and nothing written (never a crash);
a served put on the new path loads back byte for byte with a clean audit for every KV
form, with chunks already held, in pieces, at the real 32 MiB threshold and from
threads sharing a client; a wrong seal never makes wrong KV served or persisted as
good (the audit, ``--verify-dram-on-load``, demotion and write-through catch it); seals
of a wrong length are a typed error that aborts the put and loses nothing; a source
written during its copy, a client killed mid-put, a copy that fails and an invalidation
racing the deferred put leave nothing behind.

Found broken and fixed since:

- ``test_seals_the_decoder_refuses_still_abort_the_deferred_put``: a ``put_commit``
  whose ``seals`` the request decoder refuses (fewer than 16 bytes, or not bytes) got
  a typed ProtocolError, but the handler never ran, so the deferred put stayed
  prepared: its chunks stayed TENTATIVE and another client's put of the same prompt
  stored nothing (``in_flight``) until this session sent another deferred put or
  ended. Now a refused ``put_commit`` aborts the deferred put (``Session.refused``).

Found broken at 3bcff18 and fixed since by 6dc9396 (``kvlife/store/executor.py``: a
seal the caller vouched for is verified on the write-through copy;
``kvlife/store/writes.py``: a put whose own chunks fail their seal on that copy fails),
held by
``test_on_a_write_through_server_a_wrong_seal_fails_the_put_and_nothing_reaches_disk``.
At 3bcff18 the write-through copy of a put's own chunks took the client's seal as the
disk frame's checksum unverified (``_copy``'s ``fresh`` excepted them): the put
reported ``stored=3``, the frames went to disk with checksums that are not their
bytes, and after ``check()`` dropped the DRAM replicas the prompt still looked up as a
hit (disk).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import kvlife.client.puts as client_puts
from kvlife.client import RemoteStore
from kvlife.core.errors import KVLifeError, ProtocolError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.native import frames
from kvlife.native.copies import STREAM_BYTES, copy_sealed, sealing
from kvlife.server import protocol
from tests.attack.served import identities, served
from tests.attack.stream_rig import child_finishes, needs_native
from tests.attack.test_stream_copy_strided_attack import (
    GUARD,
    _guarded,
    _named_sources,
    _random_source,
    _tensor,
)
from tests.server.conftest import ROOT, ServerProc, child_env, quiet

MiB = 1 << 20
BLOCK = 32 << 10
"""``SEALED_BLOCK`` of the extension."""
RUN = 1024
"""``STREAM_RUN`` of the extension."""


def _c_bytes(a: Any) -> bytes:
    """The C-order bytes of an array (a copy for a strided view)."""
    c = np.ascontiguousarray(a)
    return c.reshape(-1).view(np.uint8).tobytes() if c.size else b""


def _xxh(a: Any) -> bytes:
    return bytes(xxhash.xxh3_128_digest(_c_bytes(a)))


@pytest.fixture
def native() -> Any:
    module = frames.native_module()
    if module is None:
        pytest.skip("no C extension built")
    assert module.STREAM_RUN == RUN
    return module


@pytest.fixture
def seals_on() -> None:
    """The new path must be the one taken (the extension and its streaming hash)."""
    if not sealing():
        pytest.skip("no extension: the client does not seal")


# ------------------------------------------------------------------------ copy_sealed


def _check_sealed(native: Any, src: np.ndarray, at: int) -> bool:
    """copy_sealed into a guarded destination at offset ``at``: a seal is the xxh3-128 of
    the C-order bytes, the bytes are np.copyto's and nothing outside is written; None
    writes nothing; it seals exactly where stream_copy streams; copies.copy_sealed
    always gives the bytes and their seal. Whether the extension sealed."""
    want = _c_bytes(src)
    digest = bytes(xxhash.xxh3_128_digest(want))
    mem, dst = _guarded(src, at)
    before = mem.copy()
    seal = native.copy_sealed(dst, src)
    if seal is not None:
        assert bytes(seal) == digest, (src.shape, src.strides, src.dtype, at)
        expect = before.copy()
        expect[GUARD + at : GUARD + at + len(want)] = np.frombuffer(want, np.uint8)
        assert np.array_equal(mem, expect), ("bytes or guards", src.shape, src.strides)
    else:
        assert np.array_equal(mem, before), ("None but written", src.shape, src.strides)
    _, dst2 = _guarded(src, at)
    assert bool(native.stream_copy(dst2, src)) == (seal is not None), "not stream_copy's rule"
    mem3, dst3 = _guarded(src, at, 0x3C)
    assert copy_sealed(dst3, src) == digest
    assert _c_bytes(dst3) == want
    assert (mem3[:GUARD] == 0x3C).all() and (mem3[GUARD + at + len(want) :] == 0x3C).all()
    return seal is not None


@needs_native
@pytest.mark.parametrize("seed", range(2))
def test_random_strided_sources_are_sealed_with_the_hash_of_their_c_order_bytes(
    native: Any, seed: int
) -> None:
    """Hundreds of random strided views (reversed, stepped, permuted, broadcast, odd
    strides on length-1 axes, misaligned, byte-swapped, items of 1 to 1100 bytes): the
    seal is the xxh3-128 of the bytes np.copyto would give, the guards hold, None writes
    nothing and comes exactly where stream_copy says False."""
    rng = np.random.default_rng(7000 + seed)
    sealed = sum(
        _check_sealed(native, _random_source(rng), int(rng.integers(0, 33))) for _ in range(250)
    )
    assert sealed > 15, sealed


@needs_native
@pytest.mark.parametrize(
    ("what", "make", "expect"), list(_named_sources()), ids=[w for w, _, _ in _named_sources()]
)
def test_named_strided_layouts_are_sealed_exactly(
    native: Any, what: str, make: Callable[[], np.ndarray], expect: bool | None
) -> None:
    """Runs of 1023/1024/1025 bytes, stride 0, rows overlapping in the source, partial
    merges, 1 KiB items, byte-swapped, a 0-d item, at three alignments: the seal is the
    hash of the C-order bytes, and it is sealed exactly where it must stream."""
    src = make()
    for at in (0, 1, 15):
        sealed = _check_sealed(native, src, at)
        if expect is not None:
            assert sealed is expect, (what, src.shape, src.strides)


_SIZES = sorted(
    {k * BLOCK + d for k in range(1, 5) for d in (-65, -64, -63, -1, 0, 1, 63, 64, 65)}
    | {RUN, RUN + 1, STREAM_BYTES, 3 * BLOCK // 2}
)


@needs_native
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    size=st.one_of(st.sampled_from(_SIZES), st.integers(1, 200_000)),
    run=st.sampled_from([0, RUN - 1, RUN, RUN + 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7]),
    gap=st.integers(1, 70),
    src_at=st.integers(0, 63),
    dst_at=st.integers(0, 63),
    seed=st.integers(0, 2**16),
)
def test_sizes_and_runs_around_the_hash_block_are_sealed_exactly(
    native: Any, size: int, run: int, gap: int, src_at: int, dst_at: int, seed: int
) -> None:
    """Contiguous sources of every size around the 32 KiB hash block and the 64-byte
    copy step (``run`` 0), or rows of ``run`` bytes with a gap after each (the block
    split falls inside a row, rows of exactly 1 KiB, of 1023 bytes: refused), both at
    any misalignment of source and destination: the seal is xxh3-128 of the bytes."""
    rng = np.random.default_rng(seed)
    if run == 0:
        mem = rng.integers(0, 256, size + src_at, np.uint8)
        src = mem[src_at:]
    else:
        rows = max(1, size // run)
        rows = min(rows, max(1, 400_000 // run))
        mem = rng.integers(0, 256, rows * (run + gap) + src_at, np.uint8)
        src = mem[src_at:][: rows * (run + gap)].reshape(rows, run + gap)[:, :run]
    sealed = _check_sealed(native, src, dst_at)
    assert sealed is ((run == 0 and size >= RUN) or run >= RUN)


@needs_native
@pytest.mark.parametrize("ndim", [33, 64])
def test_sources_of_many_dimensions_are_sealed_exactly(native: Any, ndim: int) -> None:
    """Up to numpy's 64 dimensions: a tensor of 1 KiB rows on seven length-2 axes,
    some reversed, padded to ``ndim`` with length-1 axes of odd strides: sealed, the
    digest the hash of its C-order bytes."""
    rng = np.random.default_rng(ndim)
    for _ in range(3):
        base = rng.integers(0, 256, 2**7 * 1024 + 5, np.uint8)[5:].reshape((2,) * 7 + (1024,))
        flips = tuple(
            slice(None, None, -1) if rng.random() < 0.5 else slice(None) for _ in range(7)
        )
        src = base[(*flips, slice(None))]
        shape, strides = list(src.shape), list(src.strides)
        while len(shape) < ndim:
            at = int(rng.integers(0, len(shape)))
            shape.insert(at, 1)
            strides.insert(at, int(rng.choice([-7, 3, 13, 4099])))
        src = as_strided(src, shape=shape, strides=strides, writeable=False)
        assert src.ndim == ndim
        assert _check_sealed(native, src, int(rng.integers(0, 16)))


@needs_native
def test_a_source_in_the_destination_s_buffer_is_refused_and_copies_falls_back(
    native: Any,
) -> None:
    """A source sharing any byte with the destination (the same bytes, shifted by one,
    by a row, a strided view across it, stride 0 on it) gets None and nothing moves;
    copies.copy_sealed then gives np.copyto's result and the seal of what landed. One
    that only touches it (adjacent) is sealed."""
    rng = np.random.default_rng(5)
    n = 3 * BLOCK + 100
    cases: list[tuple[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], bool]] = [
        ("same bytes", lambda b: (b[:n], b[:n]), False),
        ("shifted by 1", lambda b: (b[1 : n + 1], b[:n]), False),
        ("shifted back by 1", lambda b: (b[:n], b[1 : n + 1]), False),
        ("shifted by a block", lambda b: (b[BLOCK : BLOCK + n], b[:n]), False),
        (
            "strided rows across it",
            lambda b: (
                b[2048 : 2048 + 40 * 2048].reshape(40, 2048),
                b[: 40 * 4096].reshape(40, 4096)[:, 1024:3072],
            ),
            False,
        ),
        (
            "stride 0 on its first byte",
            lambda b: (
                b[4096 : 4096 + 40 * 2048].reshape(40, 2048),
                as_strided(b[4096:], (40, 2048), (0, 1)),
            ),
            False,
        ),
        ("adjacent after", lambda b: (b[:n], b[n : 2 * n]), True),
        ("adjacent before", lambda b: (b[n : 2 * n], b[:n]), True),
    ]
    for what, cut, ok in cases:
        buf = rng.integers(0, 256, 3 * n, np.uint8)
        dst, src = cut(buf)
        assert dst.nbytes == src.nbytes, what
        before = buf.copy()
        seal = native.copy_sealed(dst, src)
        if not ok:
            assert seal is None, what
            assert np.array_equal(buf, before), (what, "written though refused")
        else:
            assert seal is not None and bytes(seal) == _xxh(_before_src(before, buf, src)), what
        buf[:] = before
        ref = before.copy()
        rdst, rsrc = cut(ref)
        np.copyto(rdst, rsrc)
        got = copy_sealed(dst, src)
        assert np.array_equal(buf, ref), (what, "not np.copyto's result")
        assert got == _xxh(rdst), what


def _before_src(before: np.ndarray, buf: np.ndarray, src: np.ndarray) -> np.ndarray:
    """``src``'s values as they were in ``before`` (a view of ``buf``)."""
    off = src.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    return as_strided(before[off:], src.shape, src.strides)


@needs_native
def test_bad_destinations_are_typed_errors_before_any_byte_moves(native: Any) -> None:
    """The extension: a read-only or non-contiguous destination, or one of another
    length, is a typed error (BufferError, ValueError, TypeError) and writes nothing;
    an empty copy is None. copies.copy_sealed: a non-contiguous destination is
    copied by numpy and sealed as its C-order bytes; another dtype is cast as np.copyto
    casts and sealed as what landed; a read-only one is ValueError; empty is the hash of
    no bytes."""
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, 2 * STREAM_BYTES, np.uint8)
    ro = np.zeros_like(src)
    ro.flags.writeable = False
    big = np.zeros(4 * STREAM_BYTES, np.uint8)
    strided = big[::2]
    cases: list[tuple[str, object, object]] = [
        ("read-only array", ro, src),
        ("bytes", bytes(src.nbytes), src),
        ("strided dst", strided, src),
        ("shorter", np.zeros(src.nbytes - 1, np.uint8), src),
        ("longer", np.zeros(src.nbytes + 1, np.uint8), src),
        ("src not a buffer", np.zeros(16, np.uint8), 12),
        ("dst not a buffer", None, src),
    ]
    for what, dst, s in cases:
        keep = np.array(dst, copy=True) if isinstance(dst, np.ndarray) else None
        with pytest.raises((BufferError, ValueError, TypeError)):
            native.copy_sealed(dst, s)
        if isinstance(dst, np.ndarray):
            assert keep is not None and np.array_equal(dst, keep), what
    assert native.copy_sealed(np.zeros(0, np.uint8), np.zeros(0, np.uint8)) is None
    assert copy_sealed(np.zeros(0, np.uint8), np.zeros(0, np.uint8)) == bytes(
        xxhash.xxh3_128_digest(b"")
    )
    # the wrapper: numpy's rules, sealed as what landed
    s2 = rng.integers(0, 256, (64, 2048), np.uint8)
    d2 = np.zeros((2048, 64), np.uint8).T
    assert copy_sealed(d2, s2) == _xxh(s2) and np.array_equal(d2, s2)
    d3 = np.zeros((64, 2048), np.float32)
    assert copy_sealed(d3, s2) == _xxh(d3) and np.array_equal(d3, s2.astype(np.float32))
    with pytest.raises(ValueError):
        copy_sealed(ro, src)
    assert not ro.any()
    # a raw byte copy between buffers of other types, sealed as the bytes
    d4 = bytearray(src.nbytes)
    assert bytes(native.copy_sealed(d4, memoryview(src.tobytes()))) == _xxh(src)
    assert bytes(d4) == src.tobytes()


_CHILD = r"""
import ctypes, sys, threading, gc
import numpy as np, xxhash
from kvlife.native import frames
from kvlife.native.copies import copy_sealed, sealing

m = frames.native_module()
assert m is not None and sealing()
# exporters that give no strides (ctypes): one contiguous run
for kind in ("chars", "rows", "structs"):
    if kind == "chars":
        src = (ctypes.c_char * 131072)()
    elif kind == "rows":
        src = ((ctypes.c_char * 2048) * 64)()
    else:
        class Item(ctypes.Structure):
            _fields_ = [("a", ctypes.c_char * 2048)]
        src = (Item * 64)()
    ctypes.memmove(src, bytes(range(256)) * 512, 131072)
    dst = np.zeros(131072, np.uint8)
    try:
        seal = m.copy_sealed(dst, src)
    except (TypeError, BufferError, ValueError) as exc:
        print(kind, "refused", type(exc).__name__, flush=True)
        assert not dst.any()
        continue
    want = bytes(src)
    if seal is None:
        assert not dst.any()
    else:
        assert bytes(seal) == xxhash.xxh3_128_digest(want), kind
        assert dst.tobytes() == want, kind
    print(kind, "sealed" if seal is not None else "none", flush=True)

# a thread drops every reference and collects while the sealed copy runs without the GIL
for _ in range(3):
    kv = np.random.default_rng(1).integers(0, 256, (8, 2, 8, 512, 256), np.uint8)
    src = kv[::-1, :, :, 100:356]
    want = np.ascontiguousarray(src).tobytes()
    out = bytearray(len(want))
    dst = np.frombuffer(out, np.uint8).reshape(src.shape)
    got = []
    started = threading.Event()
    def run(d, s):
        started.set()
        got.append(m.copy_sealed(d, s))
    th = threading.Thread(target=run, args=(dst, src))
    th.start()
    started.wait()
    del dst, src, kv
    gc.collect()
    th.join(60)
    assert bytes(out) == want
    assert bytes(got[0]) == xxhash.xxh3_128_digest(want)

# a thread keeps rewriting the source while sealed copies run: no crash, guards hold
base = np.full((64, 3, 4096), 0x11, np.uint8)
src = base[::-1, 1]
mem = np.full(src.nbytes + 200, 0xA5, np.uint8)
dst = mem[100 : 100 + src.nbytes].reshape(src.shape)
stop = threading.Event()
def write():
    k = 0
    while not stop.is_set():
        base.fill((0x11, 0x22)[k % 2])
        k += 1
th = threading.Thread(target=write)
th.start()
try:
    for _ in range(200):
        seal = m.copy_sealed(dst, src)
        assert seal is not None and len(bytes(seal)) == 16
        assert (mem[:100] == 0xA5).all() and (mem[100 + src.nbytes :] == 0xA5).all()
        assert np.isin(dst, (0x11, 0x22)).all()
finally:
    stop.set()
    th.join(30)
base[:] = 7
assert bytes(m.copy_sealed(dst, src)) == xxhash.xxh3_128_digest(np.ascontiguousarray(src).tobytes())
print("done", flush=True)
"""


@needs_native
def test_the_extension_survives_strideless_exporters_dropped_references_and_writers() -> None:
    """In a child process (a crash would take pytest down): ctypes sources that export
    no strides are sealed as their bytes (or refused, nothing written); every reference
    to source and destination dropped and collected during a sealed copy without the
    GIL: the bytes and the seal are exact; a thread rewriting the source during sealed
    copies: no crash, nothing written outside, every byte one the source held."""
    out = child_finishes(_CHILD)
    assert "chars sealed" in out, out


_NO_NATIVE_CHILD = r"""
import sys
import numpy as np, xxhash
from kvlife.native import copies, frames
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.server import protocol

assert frames.native_module() is None and not copies.sealing()
rng = np.random.default_rng(3)
kv = rng.integers(0, 256, (4, 2, 3, 300, 100), np.uint8)
for src in (kv, kv[::-1, :, :, 5:200], kv.transpose(0, 1, 2, 4, 3)):
    dst = np.empty(src.shape, np.uint8)
    want = xxhash.xxh3_128_digest(np.ascontiguousarray(src).tobytes())
    assert copies.copy_sealed(dst, src) == want
    assert np.array_equal(dst, src)
sent = []
pack = protocol.pack
def spy(msg):
    if isinstance(msg, list) and len(msg) == 3:
        sent.append((msg[1], dict(msg[2])))
    return pack(msg)
protocol.pack = spy
layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=64)
ident = ModelIdentity(layout=layout, model_id="no-native", weights_digest="w", tokenizer_digest="t")
r = RemoteStore(sys.argv[1])
for k in range(2):
    tokens = list(range(10_000 * k, 10_000 * k + 192))
    data = rng.integers(0, 256, (2, 2, 4, 192, 128), np.uint8).view(np.float16)
    assert r.put_prompt(ident, PUBLIC, tokens, data[:, :, :, ::-1]).stored == 3
    got = r.load(r.lookup(ident, PUBLIC, tokens))
    assert got.loaded == 3
    for i, a in enumerate(got.arrays):
        want = data[:, :, :, ::-1][:, :, :, 64 * i : 64 * (i + 1)]
        assert np.array_equal(a.view(np.uint16), want.view(np.uint16))
commits = [a for v, a in sent if v == "put_commit"]
assert commits and all("seals" not in a for a in commits), commits
assert r.check().clean
r.close()
print("done", flush=True)
"""


# ------------------------------------------------------------------------- served

server, remote = served("client-seals", dram=64 * MiB, disk=96 * MiB, staging=48 * MiB)
_identity = identities("seals")


def test_a_client_without_the_extension_does_not_seal_and_still_puts_exact(
    server: ServerProc,
) -> None:
    """``sealing()`` is False without the extension (KVLIFE_NATIVE=0): copies.copy_sealed
    still gives the bytes and their hash, and the client's staged puts tell the server
    what is written instead of sending seals; they load exact, the audit is clean."""
    child_finishes(_NO_NATIVE_CHILD, str(server.socket), native=False, timeout=120)


class Sent:
    """What this process's clients send from now on: each request's (verb, args)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        pack = protocol.pack

        def spy(msg: object) -> bytes:
            if isinstance(msg, list) and len(msg) == 3 and isinstance(msg[1], str):
                with self.lock:
                    self.requests.append((msg[1], dict(msg[2])))
            return pack(msg)

        monkeypatch.setattr(protocol, "pack", spy)

    def verbs(self) -> list[str]:
        return [v for v, _ in self.requests]

    def seals(self) -> list[bytes]:
        """The seals of every put_commit that carried some."""
        return [bytes(a["seals"]) for v, a in self.requests if v == "put_commit" and "seals" in a]

    def clear(self) -> None:
        self.requests.clear()


class NativeSeals:
    """The extension's ``copy_sealed`` as copies.py sees it, its seals counted."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.sealed = 0
        self.refused = 0

    def copy_sealed(self, dst: Any, src: Any) -> Any:
        seal = self.module.copy_sealed(dst, src)
        if seal is None:
            self.refused += 1
        else:
            self.sealed += 1
        return seal

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


@pytest.fixture
def native_seals(monkeypatch: pytest.MonkeyPatch) -> NativeSeals:
    module = frames.native_module()
    if module is None or not sealing():
        pytest.skip("no extension: the client does not seal")
    wrapper = NativeSeals(module)
    monkeypatch.setattr(frames, "native_module", lambda: wrapper)
    return wrapper


def _chunks(kv: Any, n: int, count: int) -> list[np.ndarray]:
    full = kv if isinstance(kv, np.ndarray) else None
    assert full is not None
    return [full[:, :, :, i * n : (i + 1) * n] for i in range(count)]


def _loads_exact(
    remote: RemoteStore, ident: ModelIdentity, tokens: list[int], chunks: list[np.ndarray]
) -> None:
    got = remote.load(remote.lookup(ident, PUBLIC, tokens))
    assert got.loaded == len(chunks), got
    for i, (a, want) in enumerate(zip(got.arrays, chunks, strict=True)):
        assert _c_bytes(np.asarray(a)) == _c_bytes(want), i


def _clean(remote: RemoteStore, sessions: int = 1) -> dict[str, Any]:
    report = remote.check()
    assert report.clean, report
    state = quiet(remote, sessions)
    assert state["unreplied_errors"] == 0 and state["internal_errors"] == 0
    assert state["tentative"] == 0 and state["puts"] == 0
    return state


def _layout(L: int, H: int, D: int, dtype: str, n: int) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype, tokens_per_chunk=n)


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, np.uint8)
    out: np.ndarray = raw.view(dt).reshape(shape)
    return out


def _as_kv(layout: KVLayout, form: str, ntokens: int, seed: int) -> tuple[object, np.ndarray]:
    """(the KV put_prompt is given, its values as numpy [L, 2, H, T, D]); the forms of
    the strided attack's ``_tensor`` plus a bfloat16 torch tensor, a list of chunks
    broadcast from one token (stride 0), and the KV of an int8 layout given reversed."""
    if form == "torch-bf16-permuted":
        import torch

        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        stored = _rand(np.random.default_rng(seed), (L, H, 2, ntokens, D), np.uint16)
        t = torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16).permute(0, 2, 1, 3, 4)
        return t, stored.transpose(0, 2, 1, 3, 4)
    if form == "list-token-broadcast":
        n = layout.tokens_per_chunk
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        dt = {"float16": np.float16, "int8": np.int8, "uint8": np.uint8}[layout.dtype]
        rng = np.random.default_rng(seed)
        chunks = [
            np.broadcast_to(_rand(rng, (L, 2, H, 1, D), dt), (L, 2, H, n, D))
            for _ in range(ntokens // n)
        ]
        return chunks, np.concatenate(chunks, axis=3)
    return _tensor(layout, ntokens, form, seed)


# (layout, chunks, form, whether the extension must seal every chunk)
FORMS = [
    pytest.param(_layout(2, 4, 64, "float16", 64), 3, "plain", True, id="f16-128KiB-plain"),
    pytest.param(_layout(2, 4, 64, "float16", 64), 3, "t-reversed", False, id="f16-T-reversed"),
    pytest.param(_layout(2, 4, 64, "float16", 64), 3, "heads-reversed", True, id="f16-heads-rev"),
    pytest.param(_layout(3, 4, 64, "float16", 64), 2, "layers-reversed", True, id="f16-layers-rev"),
    pytest.param(_layout(2, 4, 64, "float16", 64), 3, "kv-broadcast", True, id="f16-kv-stride-0"),
    pytest.param(_layout(2, 4, 64, "float16", 64), 2, "t-major", False, id="f16-T-major"),
    pytest.param(_layout(2, 4, 64, "float16", 64), 2, "fortran", False, id="f16-fortran"),
    pytest.param(_layout(1, 2, 512, "float16", 32), 3, "t-reversed", True, id="f16-T-rev-run-1KiB"),
    pytest.param(_layout(1, 2, 512, "float16", 32), 3, "t-major", True, id="f16-T-major-run-1KiB"),
    pytest.param(_layout(2, 32, 41, "uint8", 25), 3, "plain", True, id="u8-run-1025"),
    pytest.param(_layout(2, 33, 31, "uint8", 33), 3, "plain", False, id="u8-run-1023"),
    pytest.param(_layout(2, 8, 128, "float16", 16), 3, "torch-heads-major", True, id="torch-f16"),
    pytest.param(
        _layout(2, 8, 128, "bfloat16", 16), 3, "torch-bf16-permuted", None, id="torch-bf16"
    ),
    pytest.param(
        _layout(1, 2, 512, "float16", 16), 3, "list-token-broadcast", True, id="list-stride-0"
    ),
    pytest.param(_layout(2, 2, 8, "float16", 16), 4, "t-reversed", False, id="tiny-fallback"),
    pytest.param(_layout(2, 4, 128, "int8", 300), 2, "plain", True, id="i8-600KiB-chunks"),
]


@pytest.mark.parametrize(("layout", "nchunks", "form", "native_all"), FORMS)
def test_sealed_puts_of_every_kv_form_send_the_chunks_hashes_and_load_exact(
    remote: RemoteStore,
    monkeypatch: pytest.MonkeyPatch,
    native_seals: NativeSeals,
    layout: KVLayout,
    nchunks: int,
    form: str,
    native_all: bool | None,
) -> None:
    """A first put stages extents, the second goes the new path: exactly ``put`` and
    ``put_commit`` are sent (no ``put_written``), the commit's seals are the xxh3-128 of
    each chunk's C-order bytes in order, the extension sealed every chunk where its run
    reaches 1 KiB (and none where it cannot), the audit is clean and every chunk of
    both puts loads back byte for byte."""
    ident = _identity(layout)
    n = layout.tokens_per_chunk
    sent = Sent(monkeypatch)
    puts: list[tuple[list[int], np.ndarray]] = []
    for k in range(2):
        ntokens = nchunks * n
        tokens = list(range(1_000_000 * (k + 1), 1_000_000 * (k + 1) + ntokens))
        kv, full = _as_kv(layout, form, ntokens, seed=31 * k + nchunks)
        sent.clear()
        before = native_seals.sealed
        res = remote.put_prompt(ident, PUBLIC, tokens, kv)
        assert res.stored == nchunks
        puts.append((tokens, full))
    assert sent.verbs() == ["put", "put_commit"], sent.verbs()
    want = b"".join(_xxh(c) for c in _chunks(full, n, nchunks))
    assert sent.seals() == [want]
    sealed = native_seals.sealed - before
    if native_all is True:
        assert sealed == nchunks, (form, sealed)
    elif native_all is False:
        assert sealed == 0, (form, sealed)
    _clean(remote)
    for tokens, full in puts:
        _loads_exact(remote, ident, tokens, _chunks(full, n, nchunks))


def _lying(chunks: set[int]) -> Callable[[np.ndarray, np.ndarray], bytes]:
    """A copy_sealed that copies right and lies about the seals of ``chunks`` (by their
    order in each put)."""
    real = copy_sealed
    seen = [0]

    def lie(dst: np.ndarray, src: np.ndarray) -> bytes:
        seal = real(dst, src)
        i = seen[0]
        seen[0] += 1
        return bytes(b ^ 0x5A for b in seal) if i in chunks else seal

    return lie


BIG = _layout(2, 4, 64, "float16", 64)
"""Chunks of 128 KiB: the extension seals them."""


def _prompt(
    rng: np.random.Generator, start: int, nchunks: int, layout: KVLayout = BIG
) -> tuple[list[int], np.ndarray]:
    n = layout.tokens_per_chunk
    shape = (layout.num_layers, 2, layout.num_kv_heads, nchunks * n, layout.head_dim)
    dt = {"float16": np.float16, "uint8": np.uint8, "int8": np.int8}[layout.dtype]
    return list(range(start, start + nchunks * n)), _rand(rng, shape, dt)


def test_chunks_the_server_holds_ignore_the_client_s_seals(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """Chunks 0 and 1 of five are held already; the put of all five sends a seal for
    each (the client cannot know), lying about every one: the held chunks keep their
    verified seals (the audit finds exactly the three new ones, nothing else), and the
    honest repeat of the put stores them exact and clean."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(11)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 5))  # stages five extents
    tokens, kv = _prompt(rng, 50_000, 5)
    keys = remote.put_prompt(ident, PUBLIC, tokens[: 2 * n], kv[:, :, :, : 2 * n]).keys
    sent = Sent(monkeypatch)
    monkeypatch.setattr(client_puts, "copy_sealed", _lying({0, 1, 2, 3, 4}))
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "copy_sealed", copy_sealed)
    assert res.stored == 3 and res.already_present == 2
    assert len(sent.seals()) == 1 and len(sent.seals()[0]) == 5 * 16
    report = remote.check()
    assert set(report.bad_keys) == set(res.keys[2:]), report
    assert not set(report.bad_keys) & set(keys)
    _loads_exact(remote, ident, tokens[: 2 * n], _chunks(kv, n, 2))
    assert remote.lookup(ident, PUBLIC, tokens).tokens == 2 * n, "the three were dropped"
    again = remote.put_prompt(ident, PUBLIC, tokens, kv)
    assert again.stored == 3 and again.already_present == 2
    _clean(remote)
    _loads_exact(remote, ident, tokens, _chunks(kv, n, 5))


def test_a_prompt_put_in_pieces_is_sealed_piece_by_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """A server whose client put share is a few chunks: a prompt of fourteen chunks
    goes in pieces, each after the first on staged extents with its own seals (16 bytes
    a chunk of that piece, the hashes of its chunks, in order), later pieces chained;
    every chunk loads exact and the audit is clean."""
    srv = ServerProc(
        tmp_path / "pieces", dram=8 * MiB, staging=4 * MiB, extra=("--session-put-share", "0.1")
    ).start()
    store = srv.client()
    try:
        ident = _identity(BIG)
        n = BIG.tokens_per_chunk
        per = store._puts.piece_chunks(BIG)
        assert 1 < per < 7, per
        rng = np.random.default_rng(12)
        sent = Sent(monkeypatch)
        tokens, kv = _prompt(rng, 0, 14)
        res = store.put_prompt(ident, PUBLIC, tokens, kv)
        assert res.stored == 14
        chunks = _chunks(kv, n, 14)
        seals = sent.seals()
        assert len(seals) >= 2, sent.verbs()
        hashes = [_xxh(c) for c in chunks]
        # each sealed piece is a run of the prompt's chunks, in order
        joined = b"".join(hashes)
        at = 0
        for s in seals:
            assert len(s) % 16 == 0 and len(s) // 16 <= per
            found = joined.find(s, at)
            assert found >= 0 and found % 16 == 0, "seals not the hashes of a piece"
            at = found + len(s)
        assert any(a.get("chained") for v, a in sent.requests if v == "put"), "chained pieces"
        _clean(store)
        _loads_exact(store, ident, tokens, chunks)
    finally:
        store.close()
        srv.stop()


def test_the_seal_threshold_is_inclusive(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """``SEAL_PUT_BYTES`` set to exactly a put's bytes: sealed (seals, no notices); one
    byte less: told (notices, no seals); both load exact, the audit clean."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(13)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 3))
    total = 3 * BIG.chunk_nbytes
    monkeypatch.setattr(remote._puts, "notice_bytes", 1)  # a notice per row when told
    monkeypatch.setattr(client_puts, "NOTICES_PER_PUT", 1 << 30)
    sent = Sent(monkeypatch)
    done = []
    for k, limit in enumerate((total, total - 1)):
        monkeypatch.setattr(client_puts, "SEAL_PUT_BYTES", limit)
        sent.clear()
        tokens, kv = _prompt(rng, 100_000 * (k + 1), 3)
        assert remote.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
        if limit == total:
            assert sent.verbs() == ["put", "put_commit"] and len(sent.seals()) == 1
        else:
            assert "put_written" in sent.verbs() and not sent.seals(), sent.verbs()
        done.append((tokens, kv))
    _clean(remote)
    for tokens, kv in done:
        _loads_exact(remote, ident, tokens, _chunks(kv, n, 3))


def test_puts_at_and_just_above_the_real_32_MiB_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """The real ``SEAL_PUT_BYTES`` (32 MiB): two chunks of exactly 16 MiB are sealed by
    the client (seals of both, the hashes of their bytes); two chunks of 16 MiB and 32
    KiB are told to the server (``put_written``, no seals). Each shape's second put is
    staged; all load exact, the audit is clean."""
    assert 32 * MiB == client_puts.SEAL_PUT_BYTES
    srv = ServerProc(tmp_path / "big", dram=160 * MiB, staging=96 * MiB, disk=128 * MiB).start()
    try:
        exact = _layout(8, 8, 128, "float16", 512)
        above = _layout(8, 8, 128, "float16", 513)
        assert 2 * exact.chunk_nbytes == 32 * MiB < 2 * above.chunk_nbytes
        for layout in (exact, above):
            store = srv.client()  # a fresh client: its staged extents its own
            try:
                ident = _identity(layout)
                n = layout.tokens_per_chunk
                rng = np.random.default_rng(layout.tokens_per_chunk)
                first = _prompt(rng, 0, 2, layout)
                store.put_prompt(ident, PUBLIC, *first)
                sent = Sent(monkeypatch)
                tokens, kv = _prompt(rng, 10_000, 2, layout)
                assert store.put_prompt(ident, PUBLIC, tokens, kv).stored == 2
                assert sent.verbs()[0] == "put", sent.verbs()
                if layout is exact:
                    assert "put_written" not in sent.verbs()
                    assert sent.seals() == [b"".join(_xxh(c) for c in _chunks(kv, n, 2))]
                else:
                    assert "put_written" in sent.verbs() and not sent.seals()
                monkeypatch.undo()
                _clean(store)
                _loads_exact(store, ident, tokens, _chunks(kv, n, 2))
                _loads_exact(store, ident, first[0], _chunks(first[1], n, 2))
            finally:
                store.close()
    finally:
        srv.stop()


def test_threads_sharing_one_client_each_send_their_own_seals(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """Four threads put through one RemoteStore at once (reversed, stepped and plain
    views): every put_commit's seals are the hashes of one put's chunks in order (never
    another's, never mixed), the audit is clean, every put loads exact."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    remote.put_prompt(ident, PUBLIC, *_prompt(np.random.default_rng(0), 0, 3))
    sent = Sent(monkeypatch)
    errors: list[BaseException] = []
    done: list[tuple[list[int], np.ndarray]] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        rng = np.random.default_rng(200 + t)
        try:
            for k in range(4):
                tokens, kv = _prompt(rng, 1_000_000 * (t + 1) + 10_000 * k, 3)
                view = (kv, kv[:, :, ::-1], kv[:, ::-1])[(t + k) % 3]
                assert remote.put_prompt(ident, PUBLIC, tokens, view).stored == 3
                with lock:
                    done.append((tokens, np.ascontiguousarray(view)))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert len(done) == 16
    wanted = {b"".join(_xxh(c) for c in _chunks(kv, n, 3)) for _, kv in done}
    got = sent.seals()
    assert got, "some puts were sealed"
    assert set(got) <= wanted, "a put_commit carried seals that are not one put's"
    _clean(remote)
    for tokens, kv in done:
        _loads_exact(remote, ident, tokens, _chunks(kv, n, 3))


# ------------------------------------------------------------------- wrong seals


@pytest.mark.parametrize(
    "shape",
    ["15-bytes-each", "17-bytes-each", "one-seal-short", "one-seal-extra", "a-MiB"],
)
def test_seals_of_a_wrong_length_abort_the_put_and_leave_nothing(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None, shape: str
) -> None:
    """A ``put_commit`` whose seals are not 16 bytes a chunk (but within the decoder's
    bounds) is a ProtocolError: the deferred put is aborted (nothing TENTATIVE, nothing
    pending, nothing indexed), its extents are freed (the arena holds the replicas and
    the extents still staged, no more), another client can store the prompt at once,
    and this session goes on (the same prompt stored whole by its next put)."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(14)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 3))  # stages three extents
    real = copy_sealed
    seen = [0]

    def wrong(dst: np.ndarray, src: np.ndarray) -> bytes:
        seal = real(dst, src)
        seen[0] += 1
        if shape == "15-bytes-each":
            return seal[:15]
        if shape == "17-bytes-each":
            return seal + b"!"
        if shape == "one-seal-short":
            return seal if seen[0] < 3 else b""
        if shape == "one-seal-extra":
            return seal + (seal if seen[0] == 3 else b"")
        return seal * (MiB // 48)

    monkeypatch.setattr(client_puts, "copy_sealed", wrong)
    tokens, kv = _prompt(rng, 40_000, 3)
    with pytest.raises(ProtocolError, match="seals"):
        remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "copy_sealed", real)
    state = quiet(remote)
    assert state["tentative"] == 0 and state["puts"] == 0, state
    assert state["arena_extents"] == state["shm_replicas"] + state["staged"], state
    assert remote.lookup(ident, PUBLIC, tokens).hits == []
    other = RemoteStore(remote._wire.socket_path, timeout=30)
    try:
        res = other.put_prompt(ident, PUBLIC, tokens, kv)
        assert res.stored == 3 and res.in_flight == 0
    finally:
        other.close()
    t2, kv2 = _prompt(rng, 41_000, 3)
    assert remote.put_prompt(ident, PUBLIC, t2, kv2).stored == 3
    _clean(remote)
    _loads_exact(remote, ident, tokens, _chunks(kv, n, 3))
    _loads_exact(remote, ident, t2, _chunks(kv2, n, 3))


@pytest.mark.parametrize("seals", ["empty", "15-bytes-one-chunk", "not-bytes"])
def test_seals_the_decoder_refuses_still_abort_the_deferred_put(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None, seals: str
) -> None:
    """A ``put_commit`` whose ``seals`` fail the request decoder (no bytes at all, 15
    bytes for a one-chunk put, a string): a typed ProtocolError, and the put must be
    gone as for any other wrong length: nothing TENTATIVE, another client stores the
    prompt. Reproducer: a staged put of one chunk whose ``copy_sealed`` returns 15
    bytes (or every chunk's ``b""``); ``server_state()['tentative']`` stays at the put's
    chunk count and another client's ``put_prompt`` of it gives ``stored=0,
    in_flight=1``."""
    ident = _identity(BIG)
    nchunks = 1 if seals == "15-bytes-one-chunk" else 3
    rng = np.random.default_rng(15)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, nchunks))  # stages the extents
    real = copy_sealed
    if seals == "not-bytes":
        pack = protocol.pack

        def spy(msg: object) -> bytes:
            if isinstance(msg, list) and len(msg) == 3 and msg[1] == "put_commit":
                msg = [msg[0], msg[1], {"seals": "x" * 16 * nchunks}]
            return pack(msg)

        monkeypatch.setattr(protocol, "pack", spy)
    else:
        cut = 0 if seals == "empty" else 15
        monkeypatch.setattr(client_puts, "copy_sealed", lambda d, s: real(d, s)[:cut])
    tokens, kv = _prompt(rng, 60_000, nchunks)
    with pytest.raises(ProtocolError, match="seals"):
        remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.undo()
    other = RemoteStore(remote._wire.socket_path, timeout=30)
    try:
        state = quiet(other, sessions=2)
        assert state["tentative"] == 0, f"{state['tentative']} chunks left TENTATIVE"
        res = other.put_prompt(ident, PUBLIC, tokens, kv)
        assert res.stored == nchunks and res.in_flight == 0, res
    finally:
        other.close()


def test_a_commit_with_seals_and_no_deferred_put_is_a_typed_error(remote: RemoteStore) -> None:
    """``put_commit`` with seals when no deferred put is waiting (none sent, or its
    commit done): ProtocolError each time, and the session goes on."""
    ident = _identity(BIG)
    for _ in range(2):
        with pytest.raises(ProtocolError, match="deferred"):
            remote._wire.call("put_commit", {"seals": bytes(16)})
    tokens, kv = _prompt(np.random.default_rng(16), 0, 2)
    assert remote.put_prompt(ident, PUBLIC, tokens, kv).stored == 2
    with pytest.raises(ProtocolError, match="deferred"):
        remote._wire.call("put_commit", {"seals": bytes(32)})
    _clean(remote)


def test_a_seal_that_is_not_the_bytes_is_found_by_the_audit_and_dropped(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """DRAM only: a put whose second chunk's seal is a lie is stored (the DRAM tier takes
    the seal as given); the audit reports exactly that chunk and drops it, so the prompt
    looks up only as far as chunk 0, which loads exact; nothing of it was persisted."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(17)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 3))
    monkeypatch.setattr(client_puts, "copy_sealed", _lying({1}))
    tokens, kv = _prompt(rng, 70_000, 3)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "copy_sealed", copy_sealed)
    assert res.stored == 3
    report = remote.check()
    assert report.bad_keys == [res.keys[1]], report
    assert remote.lookup(ident, PUBLIC, tokens).tokens == n
    _loads_exact(remote, ident, tokens[:n], _chunks(kv, n, 1))
    assert remote.check().clean, "dropped by the first audit"


def test_with_verify_dram_on_load_a_wrongly_sealed_chunk_is_a_miss_never_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """``--verify-dram-on-load``: the chunk whose seal is a lie is a corrupt miss,
    counted (``sealed_mismatch``) and invalidated; the chunks before it load exact,
    none after it is served."""
    srv = ServerProc(tmp_path / "verify", extra=("--verify-dram-on-load",)).start()
    store = srv.client()
    try:
        ident = _identity(BIG)
        n = BIG.tokens_per_chunk
        rng = np.random.default_rng(18)
        store.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 4))
        monkeypatch.setattr(client_puts, "copy_sealed", _lying({2}))
        tokens, kv = _prompt(rng, 80_000, 4)
        res = store.put_prompt(ident, PUBLIC, tokens, kv)
        monkeypatch.setattr(client_puts, "copy_sealed", copy_sealed)
        assert res.stored == 4
        got = store.load(store.lookup(ident, PUBLIC, tokens))
        assert got.loaded == 2 and got.corrupt == [res.keys[2]], got
        for a, want in zip(got.arrays, _chunks(kv, n, 2), strict=True):
            assert _c_bytes(np.asarray(a)) == _c_bytes(want)
        assert store.counters.sealed_mismatch == 1
        assert store.lookup(ident, PUBLIC, tokens).tokens == 2 * n
        state = quiet(store)
        assert state["tentative"] == 0 and state["internal_errors"] == 0
    finally:
        store.close()
        srv.stop()


def test_on_a_write_through_server_a_wrong_seal_fails_the_put_and_nothing_reaches_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """``--write-through``: a put whose last chunk's seal is a lie fails, typed; none of
    it is visible, nothing is TENTATIVE; after a restart (what disk holds) the prompt is
    not there and the audit is clean; the honest put of the same prompt then stores it
    exact. (At 3bcff18 the put reported stored=3 and wrote the chunk to disk with the
    client's checksum unverified.)"""
    path = tmp_path / "wt"
    srv = ServerProc(path, extra=("--write-through",)).start()
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(19)
    first = _prompt(rng, 0, 3)
    tokens, kv = _prompt(rng, 90_000, 3)
    try:
        store = srv.client()
        store.put_prompt(ident, PUBLIC, *first)
        monkeypatch.setattr(client_puts, "copy_sealed", _lying({2}))
        with pytest.raises(KVLifeError):
            store.put_prompt(ident, PUBLIC, tokens, kv)
        monkeypatch.setattr(client_puts, "copy_sealed", copy_sealed)
        assert store.lookup(ident, PUBLIC, tokens).hits == []
        state = quiet(store)
        assert state["tentative"] == 0 and state["puts"] == 0
        store.close()
    finally:
        srv.stop()
    srv = ServerProc(path, extra=("--write-through",)).start()
    try:
        store = srv.client()
        assert store.lookup(ident, PUBLIC, tokens).hits == [], "persisted"
        assert store.check().clean
        _loads_exact(store, ident, first[0], _chunks(first[1], n, 3))
        assert store.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
        _clean(store)
        _loads_exact(store, ident, tokens, _chunks(kv, n, 3))
        store.close()
    finally:
        srv.stop()


def test_a_demotion_checks_a_client_seal_before_the_chunk_reaches_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """A DRAM tier of eight chunks: a put whose middle chunk's seal is a lie, then puts
    that push it down to disk. The demotion verifies the seal: the chunk is counted
    (``sealed_mismatch``) and dropped, never written to disk; the prompt looks up as
    far as chunk 0, which loads exact (from disk). A put still in DRAM when the server
    stops, its chunk 0 a lie, is not flushed (an honest one beside it is); the restart
    finds neither wrongly sealed chunk, and a clean audit."""
    path = tmp_path / "small"
    srv = ServerProc(path, dram=1 * MiB, staging=4 * MiB).start()
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(20)
    try:
        store = srv.client()
        store.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 3))
        monkeypatch.setattr(client_puts, "copy_sealed", _lying({1}))
        tokens, kv = _prompt(rng, 100_000, 3)
        res = store.put_prompt(ident, PUBLIC, tokens, kv)
        monkeypatch.setattr(client_puts, "copy_sealed", copy_sealed)
        assert res.stored == 3
        for k in range(4):  # twelve more chunks: everything before goes down
            assert store.put_prompt(ident, PUBLIC, *_prompt(rng, 200_000 + 1000 * k, 3)).stored == 3
        store.drain()
        assert store.counters.sealed_mismatch == 1
        assert store.lookup(ident, PUBLIC, tokens).tokens == n
        got = store.load(store.lookup(ident, PUBLIC, tokens))
        assert got.loaded == 1 and got.tiers.get("disk", 0) == 1, got
        assert _c_bytes(np.asarray(got.arrays[0])) == _c_bytes(_chunks(kv, n, 1)[0])
        _clean(store)
        # still in DRAM when the server stops (SIGTERM flushes): a lie on chunk 0, then
        # an honest prompt
        monkeypatch.setattr(client_puts, "copy_sealed", _lying({0}))
        lied, lied_kv = _prompt(rng, 300_000, 3)
        assert store.put_prompt(ident, PUBLIC, lied, lied_kv).stored == 3
        monkeypatch.setattr(client_puts, "copy_sealed", copy_sealed)
        honest, honest_kv = _prompt(rng, 400_000, 3)
        assert store.put_prompt(ident, PUBLIC, honest, honest_kv).stored == 3
        assert store.lookup(ident, PUBLIC, lied).tokens == 3 * n, "held in DRAM"
        store.close()
    finally:
        srv.stop()
    srv = ServerProc(path, dram=1 * MiB, staging=4 * MiB).start()
    try:
        store = srv.client()
        assert store.lookup(ident, PUBLIC, tokens).tokens == n
        assert store.lookup(ident, PUBLIC, lied).tokens == 0, "flushed against its seal"
        _loads_exact(store, ident, honest, _chunks(honest_kv, n, 3))  # the flush ran
        assert store.check().clean
        store.close()
    finally:
        srv.stop()


def test_notices_then_seals_keep_the_server_s_hash_where_it_began_hashing(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """A client that mixes both (a ``put_written`` after chunks 0 and 1, covering chunk
    0 and half of chunk 1, then lying seals for all four with its commit): the server
    keeps its own hash of chunk 0 (hashed whole) and of chunk 1 (hashing begun: finished
    from where it stopped), and takes the client's seals for chunks 2 and 3 only; the
    audit finds exactly those two."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    size = BIG.chunk_nbytes
    rng = np.random.default_rng(21)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 4))
    wire = remote._wire
    real = copy_sealed
    seen = [0]

    def mixed(dst: np.ndarray, src: np.ndarray) -> bytes:
        seal = real(dst, src)
        seen[0] += 1
        if seen[0] == 2:
            conn = wire.conn
            assert conn is not None
            conn.sock.sendall(protocol.pack([0, "put_written", {"bytes": size + size // 2}]))
        return bytes(b ^ 0xFF for b in seal)

    monkeypatch.setattr(client_puts, "copy_sealed", mixed)
    tokens, kv = _prompt(rng, 110_000, 4)
    res = remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "copy_sealed", real)
    assert res.stored == 4 and seen[0] == 4
    report = remote.check()
    assert set(report.bad_keys) == set(res.keys[2:]), report
    _loads_exact(remote, ident, tokens[: 2 * n], _chunks(kv, n, 2))
    state = quiet(remote)
    assert state["unreplied_errors"] == 0 and state["internal_errors"] == 0


# ------------------------------------------------------------------------- races


def test_a_source_written_during_its_sealed_copy_is_caught_exactly_where_it_differs(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, native_seals: NativeSeals
) -> None:
    """A thread keeps inverting the KV tensor while its sealed puts copy it (1 MiB
    chunks, the copies without the GIL): the bytes that landed and the seal sent may
    differ (a block rewritten between its hash and its copy). The audit then reports
    exactly the chunks whose landed bytes are not their seal, no other; every chunk
    before the first such one loads as the bytes that landed."""
    layout = _layout(4, 8, 128, "float16", 64)
    assert layout.chunk_nbytes == 1 * MiB
    ident = _identity(layout)
    rng = np.random.default_rng(22)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 4, layout))
    landed: list[tuple[np.ndarray, bytes]] = []

    def spy(dst: np.ndarray, src: np.ndarray) -> bytes:
        seal = copy_sealed(dst, src)
        landed.append((dst, seal))
        return seal

    monkeypatch.setattr(client_puts, "copy_sealed", spy)
    mismatched = 0
    for k in range(4):
        tokens, kv = _prompt(rng, 500_000 + 10_000 * k, 4, layout)
        raw = kv.view(np.uint16)
        stop = threading.Event()

        def flip(raw: np.ndarray = raw, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                np.invert(raw, out=raw)

        landed.clear()
        th = threading.Thread(target=flip)
        th.start()
        try:
            res = remote.put_prompt(ident, PUBLIC, tokens, kv)
        finally:
            stop.set()
            th.join(30)
        assert res.stored == 4 and len(landed) == 4
        snap = [(_c_bytes(d), s) for d, s in landed]
        bad = [i for i, (b, s) in enumerate(snap) if bytes(xxhash.xxh3_128_digest(b)) != s]
        mismatched += len(bad)
        report = remote.check()
        assert set(report.bad_keys) == {res.keys[i] for i in bad}, (bad, report)
        good = bad[0] if bad else 4
        got = remote.load(remote.lookup(ident, PUBLIC, tokens))
        assert got.loaded == good
        for i, a in enumerate(got.arrays):
            assert _c_bytes(np.asarray(a)) == snap[i][0], i
    assert native_seals.sealed >= 16
    print(f"chunks whose source changed between hash and copy: {mismatched}")


_KILLED_CHILD = r"""
import sys
import numpy as np
import kvlife.client.puts as cp
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=64)
ident = ModelIdentity(
    layout=layout, model_id="seals-killed", weights_digest="w", tokenizer_digest="t"
)
r = RemoteStore(sys.argv[1])
rng = np.random.default_rng(1)
first = rng.integers(0, 256, (2, 2, 4, 192, 128), np.uint8).view(np.float16)
r.put_prompt(ident, PUBLIC, list(range(192)), first)
real = cp.copy_sealed
calls = []
def blocking(dst, src):
    calls.append(1)
    if len(calls) == 2:
        print("copying", flush=True)
        sys.stdin.read()
    return real(dst, src)
cp.copy_sealed = blocking
kv = rng.integers(0, 256, (2, 2, 4, 192, 128), np.uint8).view(np.float16)
r.put_prompt(ident, PUBLIC, list(range(5000, 5192)), kv)
"""


def test_a_client_killed_between_its_put_and_its_commit_leaves_nothing(
    server: ServerProc, seals_on: None
) -> None:
    """A client process SIGKILLed while it copies its sealed put (the deferred ``put``
    was taken, its ``put_commit`` never sent): the server aborts it with the session:
    nothing TENTATIVE or pending, the arena holds only the replicas, the prompt misses,
    and another client stores it whole."""
    watcher = server.client()
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(server.socket)],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"copying"
        before = quiet(watcher, sessions=2)
        assert before["tentative"] == 3, "the deferred put was prepared"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        state = quiet(watcher, sessions=1)
        assert state["tentative"] == 0 and state["puts"] == 0
        assert state["arena_extents"] == state["shm_replicas"] + state["staged"], state
        layout = BIG
        ident = ModelIdentity(
            layout=layout, model_id="seals-killed", weights_digest="w", tokenizer_digest="t"
        )
        tokens = list(range(5000, 5192))
        assert watcher.lookup(ident, PUBLIC, tokens).hits == []
        raw = np.random.default_rng(2).integers(0, 256, (2, 2, 4, 192, 128), np.uint8)
        kv = raw.view(np.float16)
        assert watcher.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
        _clean(watcher)
        _loads_exact(watcher, ident, tokens, _chunks(kv, 64, 3))
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
        watcher.close()


def test_a_sealed_copy_that_fails_midway_drops_the_put_and_the_client_goes_on(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """``copy_sealed`` raises on the second chunk (after the deferred ``put`` went out):
    the error reaches the caller, the connection is dropped so the server aborts the put
    (nothing TENTATIVE, nothing indexed), and the client's next put reconnects and
    stores the same prompt exact."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(23)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 3))
    real = copy_sealed
    seen = [0]

    def failing(dst: np.ndarray, src: np.ndarray) -> bytes:
        seen[0] += 1
        if seen[0] == 2:
            raise MemoryError("the copy failed")
        return real(dst, src)

    monkeypatch.setattr(client_puts, "copy_sealed", failing)
    tokens, kv = _prompt(rng, 120_000, 3)
    with pytest.raises(MemoryError):
        remote.put_prompt(ident, PUBLIC, tokens, kv)
    monkeypatch.setattr(client_puts, "copy_sealed", real)
    assert remote.lookup(ident, PUBLIC, tokens).hits == []
    state = quiet(remote)
    assert state["tentative"] == 0 and state["puts"] == 0
    assert remote.put_prompt(ident, PUBLIC, tokens, kv).stored == 3
    _clean(remote)
    _loads_exact(remote, ident, tokens, _chunks(kv, n, 3))


def test_an_invalidation_during_a_sealed_copy_stores_none_of_it(
    remote: RemoteStore, monkeypatch: pytest.MonkeyPatch, seals_on: None
) -> None:
    """Another client invalidates the model's chunks while this one copies its sealed
    put (the deferred ``put`` taken, its chunks TENTATIVE): the commit, seals and all,
    stores none of them, nothing of it is visible or left TENTATIVE, the arena holds no
    more than the replicas and the staged extents, and the next sealed put goes on
    exact."""
    ident = _identity(BIG)
    n = BIG.tokens_per_chunk
    rng = np.random.default_rng(24)
    remote.put_prompt(ident, PUBLIC, *_prompt(rng, 0, 3))
    other = RemoteStore(remote._wire.socket_path, timeout=30)
    wire = remote._wire
    real = copy_sealed
    seen = [0]

    def racing(dst: np.ndarray, src: np.ndarray) -> bytes:
        seen[0] += 1
        if seen[0] == 2:
            conn = wire.conn
            assert conn is not None
            assert wire.roundtrip(conn, "state", {})["tentative"] == 3
            assert other.invalidate(model=ident.model_id) >= 3
        return real(dst, src)

    try:
        monkeypatch.setattr(client_puts, "copy_sealed", racing)
        sent = Sent(monkeypatch)
        tokens, kv = _prompt(rng, 130_000, 3)
        res = remote.put_prompt(ident, PUBLIC, tokens, kv)
        monkeypatch.setattr(client_puts, "copy_sealed", real)
        assert len(sent.seals()) == 1
        assert res.stored == 0 and res.tokens_stored_or_present == 0, res
        assert remote.lookup(ident, PUBLIC, tokens).hits == []
        state = quiet(other, sessions=2)
        assert state["tentative"] == 0
        assert state["arena_extents"] == state["shm_replicas"] + state["staged"], state
        t2, kv2 = _prompt(rng, 131_000, 3)
        assert remote.put_prompt(ident, PUBLIC, t2, kv2).stored == 3
        _clean(remote, sessions=2)
        _loads_exact(remote, ident, t2, _chunks(kv2, n, 3))
    finally:
        other.close()


def test_the_child_scripts_are_plain_python() -> None:
    """Guard: the child scripts compile (a syntax error would read as a crash)."""
    for code in (_CHILD, _NO_NATIVE_CHILD, _KILLED_CHILD):
        compile(textwrap.dedent(code), "<child>", "exec")
