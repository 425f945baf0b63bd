"""Attacks on the streaming copies OUT of an arena or a replica (commit 31deddd):
``kvlife/client/copies.py`` ``copy_into`` (a granted chunk into the caller's buffer),
``kvlife/client/loads.py`` ``_copy_bytes`` (landed parts) and the hinted DRAM copy
(``after``), ``kvlife/tiers/held.py`` ``_read`` (a DRAM replica into a caller's buffer)
and ``kvlife/tiers/memory.py`` ``copy_sealed`` (a put's chunk larger than a block sealed
by the extension: each block of the SOURCE hashed, then streamed).

The promise under attack: every byte a load reports loaded is the stored byte, whatever
the caller's buffer (transposed, a strided cut of a larger tensor, unaligned, of an odd
byte count); a buffer that cannot take a chunk is a typed InvalidArgument before any
chunk is handed out, and the session goes on; the memory tier's seal verifies against
what it stored, and where a caller changes its source while it is copied, the mismatch
is counted (a verified load misses it, ``check`` drops it), never handed out as a
healthy replica; a hinted load racing an invalidation and a put of other bytes under the
same keys hands out whole stored versions only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, ChunkKey, KVLayout, ModelIdentity
from kvlife.core.objects import TierName
from kvlife.core.payload import numpy_dtype
from kvlife.native import frames as native
from kvlife.store import KVStore
from kvlife.tiers.base import seal_of
from kvlife.tiers.memory import MemoryTier
from tests.conftest import prompt_kv
from tests.helpers.stream_spy import count_streamed
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import disk_server, put_on_disk

pytestmark = pytest.mark.skipif(not native.available(), reason="the extension is not built")

SERVED = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=128)
"""512 KiB chunks: streamed (>= 64 KiB), whole 64-byte lines."""
LANDED = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=512)
"""6 MiB chunks: a disk load's last frame is read in pieces, its landed bytes copied early."""
ODD = KVLayout(num_layers=3, num_kv_heads=5, head_dim=37, dtype="float16", tokens_per_chunk=131)
"""290,820-byte chunks (more than a 256 KiB seal block; 4 mod 16): runs of 9,694 bytes."""
SHORT = KVLayout(num_layers=16, num_kv_heads=32, head_dim=8, dtype="float16", tokens_per_chunk=32)
"""512 KiB chunks whose runs in a token cut of a KV tensor are 512 bytes (< 1 KiB)."""
WIDE = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", tokens_per_chunk=128)
BF16 = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", tokens_per_chunk=256)
CHUNKS = 3


def _ident(layout: KVLayout, tag: str) -> ModelIdentity:
    return ModelIdentity(
        layout=layout, model_id=f"out-{tag}", weights_digest="w", tokenizer_digest="t"
    )


def _kv(layout: KVLayout, seed: int, chunks: int = CHUNKS) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, kv) in the layout's numpy dtype, every bit pattern random."""
    n = layout.tokens_per_chunk * chunks
    tokens, kv = prompt_kv(seed, n, layout)
    dt = numpy_dtype(layout.dtype)
    if kv.dtype != dt:
        kv = (
            kv.astype(dt)
            if dt.kind == "f"
            else np.random.default_rng(seed).integers(0, 1 << 16, kv.shape).astype(dt)
        )
    return tokens, kv


def _chunk(kv: np.ndarray, layout: KVLayout, i: int) -> bytes:
    n = layout.tokens_per_chunk
    return np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n]).tobytes()


def _buffer(kind: str, layout: KVLayout) -> np.ndarray:
    """A writable buffer of one chunk's shape and dtype, of an awkward kind, full of 0x5A."""
    shape, dt = layout.chunk_shape, numpy_dtype(layout.dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    if kind == "c":
        out = np.empty(shape, dt)
    elif kind == "transposed":
        out = np.empty(shape[::-1], dt).T
    elif kind == "token cut":  # a chunk's place in a larger KV tensor
        big = np.empty((*shape[:3], 3 * shape[3], shape[4]), dt)
        out = big[:, :, :, shape[3] : 2 * shape[3]]
    elif kind == "every other":
        out = np.empty((*shape[:4], 2 * shape[4]), dt)[..., ::2]
    elif kind == "unaligned":  # C-contiguous, its data one byte past an aligned address
        out = np.frombuffer(bytearray(nbytes + 1), dt, offset=1).reshape(shape)
        assert not out.flags.aligned and out.flags.c_contiguous and out.flags.writeable
    else:
        raise AssertionError(kind)
    out[...] = np.frombuffer(b"\x5a" * dt.itemsize, dt)[0]  # no stored chunk is all 0x5A
    return out


KINDS = ["c", "transposed", "token cut", "every other", "unaligned"]


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes the extension's stream_copy copied in this process from now on."""
    module = native.native_module()
    assert module is not None
    return count_streamed(monkeypatch, module)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    server = disk_server(tmp_path / "store", dram=32 * MiB, disk=128 * MiB)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(srv: ServerProc) -> Iterator[RemoteStore]:
    c = srv.client()
    try:
        yield c
    finally:
        c.close()


# ------------------------------------------------------------------ served loads


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_served_loads_into_awkward_buffers_hand_out_the_stored_bytes(
    client: RemoteStore, tier: str, streamed: list[int]
) -> None:
    """DRAM hits (the hinted copy) and disk hits (grants, landed parts of 6 MiB chunks)
    into transposed, strided, unaligned and plain buffers: every byte the stored one."""
    layout = SERVED if tier == "dram" else LANDED
    ident = _ident(layout, f"awk-{tier}")
    if tier == "dram":
        tokens, kv = _kv(layout, 11)
        client.put_prompt(ident, PUBLIC, tokens, kv)
        stored = [_chunk(kv, layout, i) for i in range(CHUNKS)]
    else:
        tokens, stored = put_on_disk(client, ident, CHUNKS, 12)
    for kind in KINDS:
        lk = client.lookup(ident, PUBLIC, tokens)
        assert lk.tiers() == {tier: CHUNKS}, kind
        outs = [_buffer(kind, layout) for _ in range(CHUNKS)]
        streamed.clear()
        res = client.load(lk, outs)
        assert res.loaded == CHUNKS and not res.corrupt, kind
        assert [_bytes(o) for o in outs] == stored, f"{tier} load into {kind} buffers"
        assert all(a is o for a, o in zip(res.arrays, outs, strict=True)), kind
        if kind in ("c", "unaligned"):  # the seam itself was exercised
            assert sum(streamed) >= CHUNKS * (layout.chunk_nbytes - (64 << 10)), kind


def test_served_chunks_of_an_odd_byte_count_load_exact(client: RemoteStore) -> None:
    """Chunks of 215,340 bytes (not a multiple of 16 or 64), DRAM and disk, plain and
    unaligned buffers: the streaming copy's head and tail bytes are the stored ones."""
    layout = KVLayout(
        num_layers=3, num_kv_heads=5, head_dim=37, dtype="float16", tokens_per_chunk=97
    )
    assert layout.chunk_nbytes % 16 and layout.chunk_nbytes > 64 << 10
    ident = _ident(layout, "odd-served")
    tokens, kv = _kv(layout, 13)
    client.put_prompt(ident, PUBLIC, tokens, kv)
    stored = [_chunk(kv, layout, i) for i in range(CHUNKS)]
    for tier in ("dram", "disk"):
        if tier == "disk":
            client.flush()
            client.evict("dram", 1 << 40)
        for kind in ("c", "unaligned"):
            lk = client.lookup(ident, PUBLIC, tokens)
            assert lk.tiers() == {tier: CHUNKS}
            outs = [_buffer(kind, layout) for _ in range(CHUNKS)]
            res = client.load(lk, outs)
            assert res.loaded == CHUNKS
            assert [_bytes(o) for o in outs] == stored, f"{tier} {kind}"
        res = client.load(client.lookup(ident, PUBLIC, tokens))  # new arrays
        assert [a.tobytes() for a in res.arrays] == stored


def _bad_buffers(
    layout: KVLayout,
) -> list[tuple[str, Callable[[], list[np.ndarray]], tuple[str, ...]]]:
    """(what, outs, words the InvalidArgument must name)."""
    dt = numpy_dtype(layout.dtype)
    other = np.dtype(np.float64 if dt == np.float32 else np.float32)

    def good() -> list[np.ndarray]:
        return [_buffer("c", layout) for _ in range(CHUNKS)]

    def read_only() -> list[np.ndarray]:
        outs = good()
        outs[1].flags.writeable = False
        return outs

    def twice() -> list[np.ndarray]:
        outs = good()
        return [outs[0], outs[1], outs[0]]

    def overlapping() -> list[np.ndarray]:
        n = layout.tokens_per_chunk
        big = np.zeros((*layout.chunk_shape[:3], 3 * n, layout.head_dim), dt)
        return [big[:, :, :, 0:n], big[:, :, :, n // 2 : n // 2 + n], big[:, :, :, 2 * n :]]

    def wrong_dtype() -> list[np.ndarray]:
        outs = good()
        outs[1] = np.zeros(layout.chunk_shape, other)
        return outs

    def wrong_shape() -> list[np.ndarray]:
        outs = good()
        s = layout.chunk_shape
        outs[1] = np.zeros((*s[:3], s[3] - 1, s[4]), dt)
        return outs

    shape = str(list(layout.chunk_shape))
    return [
        ("read-only", read_only, ("read-only",)),
        ("one buffer twice", twice, ("share memory",)),
        ("overlapping cuts", overlapping, ("share memory",)),
        ("wrong dtype", wrong_dtype, (other.name, dt.name)),
        ("wrong shape", wrong_shape, (dt.name, shape)),
    ]


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_served_loads_refuse_unfit_buffers_typed_and_the_session_goes_on(
    client: RemoteStore, tier: str
) -> None:
    """A read-only buffer, one buffer twice, overlapping cuts, a wrong dtype or shape:
    InvalidArgument naming what is wrong (dtype and shape both named), and the next load
    on the same client loads every stored byte."""
    ident = _ident(SERVED, f"bad-{tier}")
    tokens, kv = _kv(SERVED, 14)
    client.put_prompt(ident, PUBLIC, tokens, kv)
    if tier == "disk":
        client.flush()
        client.evict("dram", 1 << 40)
    stored = [_chunk(kv, SERVED, i) for i in range(CHUNKS)]
    for what, make, words in _bad_buffers(SERVED):
        lk = client.lookup(ident, PUBLIC, tokens)
        assert lk.tiers() == {tier: CHUNKS}, what
        with pytest.raises(InvalidArgument) as err:
            client.load(lk, make())
        for word in words:
            assert word in str(err.value), f"{what}: {err.value}"
        outs = [_buffer("c", SERVED) for _ in range(CHUNKS)]
        res = client.load(client.lookup(ident, PUBLIC, tokens), outs)
        assert res.loaded == CHUNKS and [_bytes(o) for o in outs] == stored, f"after {what}"


# ------------------------------------------------------------------ in-process memory tier


def _cut(kv: np.ndarray, how: str) -> np.ndarray:
    """kv as a put hands it over: contiguous, or a token cut of a larger tensor."""
    if how == "contiguous":
        return kv
    t = kv.shape[3]
    big = np.zeros((*kv.shape[:3], t + 2 * 7, kv.shape[4]), kv.dtype)
    big[:, :, :, 7 : 7 + t] = kv
    return big[:, :, :, 7 : 7 + t]


@pytest.mark.parametrize(
    "layout,how",
    [
        (SERVED, "contiguous"),
        (SERVED, "token cut"),
        (SHORT, "token cut"),
        (ODD, "contiguous"),
        (ODD, "token cut"),
        (WIDE, "token cut"),
        (BF16, "contiguous"),
    ],
    ids=["contig", "cut", "short-runs", "odd", "odd-cut", "float32-cut", "bf16"],
)
@pytest.mark.parametrize("verify", [False, True])
def test_memory_tier_puts_seal_what_they_hold_and_load_exact(
    tmp_path: Path, layout: KVLayout, how: str, verify: bool
) -> None:
    """Puts of chunks larger than a seal block (contiguous, strided with runs longer and
    shorter than 1 KiB, odd byte counts, float32, bfloat16): ``check`` finds every seal
    good, and loads into buffers of every kind (and new arrays) are the put's bytes."""
    if layout.chunk_nbytes <= 256 << 10:
        layout = KVLayout(
            num_layers=layout.num_layers * 2,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            tokens_per_chunk=layout.tokens_per_chunk,
        )
    assert layout.chunk_nbytes > 256 << 10
    ident = _ident(layout, "mem")
    tokens, kv = _kv(layout, 21)
    src = _cut(kv, how)
    stored = [_chunk(kv, layout, i) for i in range(CHUNKS)]
    store = KVStore.open(
        tmp_path / "s", dram_bytes=64 * MiB, disk_bytes=0, verify_dram_on_load=verify
    )
    try:
        assert store.put_prompt(ident, PUBLIC, tokens, src).stored == CHUNKS
        report = store.check()
        assert report.problems == [] and report.ok == report.rows == CHUNKS
        for kind in KINDS:
            outs = [_buffer(kind, layout) for _ in range(CHUNKS)]
            res = store.load(store.lookup(ident, PUBLIC, tokens), outs)
            assert res.loaded == CHUNKS and [_bytes(o) for o in outs] == stored, kind
        res = store.load(store.lookup(ident, PUBLIC, tokens))
        assert [a.tobytes() for a in res.arrays] == stored
        for what, make, words in _bad_buffers(layout):
            with pytest.raises(InvalidArgument) as err:
                store.load(store.lookup(ident, PUBLIC, tokens), make())
            assert all(w in str(err.value) for w in words), f"{what}: {err.value}"
        assert store.counters.corrupt == 0
    finally:
        store.close()


def test_memory_tier_put_racing_a_changing_source_never_serves_an_unsealed_chunk(
    tmp_path: Path,
) -> None:
    """A caller thread keeps changing the source while ``put_prompt`` copies it (the
    extension hashes each block of the source, then streams it: the copy may differ
    from what was hashed). Whatever lands: a verified load hands out only bytes that
    match their seal, and every replica whose bytes do not match its seal is counted
    corrupt (by that load or by ``check``), none left in service."""
    layout = KVLayout(
        num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=256
    )
    ident = _ident(layout, "race")
    rng = np.random.default_rng(5)
    kv = rng.standard_normal((8, 2, 4, 4 * 256, 64)).astype(np.float16)
    store = KVStore.open(
        tmp_path / "s", dram_bytes=512 * MiB, disk_bytes=0, verify_dram_on_load=True
    )
    stop = threading.Event()

    def change() -> None:
        flat = kv.reshape(-1).view(np.uint16)
        while not stop.is_set():
            np.add(flat, 1, out=flat)

    mutator = threading.Thread(target=change, daemon=True)
    prompts: list[np.ndarray] = []
    try:
        mutator.start()
        for _ in range(24):
            tokens = rng.integers(0, 50_000, 4 * 256)
            assert store.put_prompt(ident, PUBLIC, tokens, kv).stored == 4
            prompts.append(tokens)
        stop.set()
        mutator.join()
        tier = store._core.tiers[TierName("dram")]
        assert isinstance(tier, MemoryTier)
        held = dict(tier._held)
        seals = {k: h.meta.checksum for k, h in held.items()}
        unsealed = {k for k, h in held.items() if seal_of(h.owner) != h.meta.checksum}
        assert store.counters.evicted == 0 and len(held) == 24 * 4
        for tokens in prompts:
            lk = store.lookup(ident, PUBLIC, tokens)
            outs = [np.empty(layout.chunk_shape, np.float16) for _ in lk.hits]
            res = store.load(lk, outs)
            for hit, out in zip(lk.hits[: res.loaded], outs, strict=False):
                assert hit.key not in unsealed, "a replica failing its seal was served"
                assert seal_of(out) == seals[ChunkKey(hit.key)], "served bytes differ from the seal"
        report = store.check()
        assert report.ok + store.counters.corrupt == len(held)
        assert store.counters.corrupt == len(unsealed), (store.counters.corrupt, len(unsealed))
        assert not set(tier.replica_keys()) & unsealed
    finally:
        stop.set()
        store.close()


# ------------------------------------------------------------------ hinted loads racing


def test_hinted_loads_racing_invalidation_and_new_bytes_hand_out_whole_versions(
    tmp_path: Path,
) -> None:
    """Client A looks up (hints) and loads DRAM hits into its buffers by the streaming
    copy while client B invalidates the model and puts other bytes under the same keys,
    over and over: every chunk A reports loaded is one whole stored version of it."""
    srv = ServerProc(tmp_path / "race", dram=48 * MiB, disk=64 * MiB, staging=16 * MiB).start()
    a, b = srv.client(), srv.client()
    ident = _ident(SERVED, "hint-race")
    tokens, v0 = _kv(SERVED, 31)
    _, v1 = _kv(SERVED, 32)
    versions = [{_chunk(v, SERVED, i) for v in (v0, v1)} for i in range(CHUNKS)]
    a.put_prompt(ident, PUBLIC, tokens, v0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            k = 0
            while not stop.is_set():
                b.invalidate(model=ident.model_id)
                b.put_prompt(ident, PUBLIC, tokens, (v0, v1)[k % 2])
                k += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=churn, daemon=True)
    loads = loaded = 0
    try:
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            lk = a.lookup(ident, PUBLIC, tokens)
            if not lk.hits:
                continue
            outs = [_buffer("c", SERVED) for _ in lk.hits]
            res = a.load(lk, outs)
            loads += 1
            loaded += res.loaded
            for i, arr in enumerate(res.arrays):
                assert arr.tobytes() in versions[i], (
                    f"chunk {i} of load {loads}: not a stored version"
                )
        stop.set()
        t.join(timeout=30)
        assert not errors, errors
        assert loads > 20 and loaded > 0, (loads, loaded)
    finally:
        stop.set()
        for c in (a, b):
            c.close()
        srv.stop()
