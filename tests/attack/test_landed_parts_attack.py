"""Red team of landed parts (commits 5491a2d, aa48e77): a streamed served load into
C-contiguous buffers (or new arrays) asks for ``early`` parts ``[i, offset, dtype,
shape, bytes]``, the client copies those bytes at once and, when chunk ``i``'s own part
names the same extent, copies only the rest.

Attacked here: a chunk whose frame fails after its landed bytes were copied and that
the store's load then reads again into the same extent (a real ``kvlife serve`` parked
before the publication, :mod:`tests.attack.frame_loads_rig`); sizes around the split
(4 KiB to 4 MiB, one to eight chunks), DRAM and disk hits mixed, shared buffers, new
arrays (read-only, exact), buffers of another dtype or shape, aliased buffers, two
clients loading at once, ``load_async`` handing out chunks, the server killed after
landed parts went out; and the client's handling of landed parts a server should not
send (out of order, past the chunk, growing in shape, after the chunk's own part, for
a load into shared buffers, unasked), driven through ``Loads._load_mapped`` with a stub
wire whose "arena" is a numpy buffer.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.bench.server.loads import shared_chunks
from kvlife.client import RemoteStore
from kvlife.client import loads as client_loads
from kvlife.core.errors import InvalidArgument, KVLifeError, ProtocolError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.native import frames as native
from kvlife.results import ChunkHit, LookupResult
from kvlife.server.loads import FRAME_DEPTH
from tests.attack.frame_loads_rig import GatedServer, gated_server
from tests.conftest import prompt_kv
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import copy_spy, disk_server

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

BIG = 1 << 40


def _layout(chunk_bytes: int) -> KVLayout:
    """float16, 2 layers x 4 heads x 64 dims: 2 KiB per token."""
    tokens = chunk_bytes // (2 * 2 * 4 * 64 * 2)
    assert tokens * 2 * 2 * 4 * 64 * 2 == chunk_bytes
    return KVLayout(
        num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=tokens
    )


def _ident(layout: KVLayout, name: str) -> ModelIdentity:
    return ModelIdentity(layout=layout, model_id=name, weights_digest="w0", tokenizer_digest="t0")


def _chunks(kv: np.ndarray, layout: KVLayout, n: int) -> list[bytes]:
    t = layout.tokens_per_chunk
    return [np.ascontiguousarray(kv[:, :, :, i * t : (i + 1) * t, :]).tobytes() for i in range(n)]


def _put(
    store: RemoteStore, ident: ModelIdentity, seed: int, n: int, *, evict: bool = True
) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """``n`` chunks put, flushed and (``evict``) evicted from DRAM: disk hits."""
    layout = ident.layout
    tokens, kv = prompt_kv(seed, n * layout.tokens_per_chunk, layout)
    store.put_prompt(ident, PUBLIC, tokens, kv)
    store.flush()
    if evict:
        store.evict("dram", BIG)
    return tokens, kv, _chunks(kv, layout, n)


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(destination address, start, end) of every piecewise copy the client made."""
    return copy_spy(monkeypatch)


# --------------------------------------------------------------------------- re-read

MB_LAYOUT = _layout(MiB)
MB_IDENT = _ident(MB_LAYOUT, "landed-attack-gated")


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedServer]:
    with gated_server(tmp_path_factory.mktemp("landed-gated"), dram=16 * MiB, disk=96 * MiB) as srv:
        yield srv


@pytest.mark.parametrize("change", ["healed", "reput_other"])
@pytest.mark.parametrize("into", ["buffers", "new arrays"])
def test_a_chunk_reread_into_its_extent_after_its_frame_failed_keeps_no_landed_bytes(
    gated: GatedServer, change: str, into: str, copied: list[tuple[int, int, int]]
) -> None:
    """Chunk 0's frame is damaged on disk: its landed bytes (all of them: a frame read
    whole) go to the client, its hash fails, and the load parks before its publication.
    Meanwhile the damage is undone (a transient fault) or the prompt is invalidated and
    put again with other KV. The publication's store load reads chunk 0 again, into the
    same extent, and the final reply grants it there: the client must copy it whole,
    never keep the failed frame's landed bytes (found by this red team, mended
    meanwhile in d5003cf: ``_Early.forget`` before the final reply's grants)."""
    base = (
        7000 + 10 * ["healed", "reput_other"].index(change) + ["buffers", "new arrays"].index(into)
    )
    # The server tells chunk 0's landed bytes only if it asks for them before a reader
    # thread of the run, idle once every frame is read, has hashed the frame and found
    # it damaged (then it tells nothing and the attack does not happen). A reader takes
    # the next frame to read before any check: three frames per reader (FRAME_DEPTH of
    # them) keep every reader reading a while after chunk 0 landed, and a busy machine
    # gets a few tries.
    for attempt in range(ATTEMPTS):
        copied.clear()
        if _reread_after_failed_frame(gated, change, into, base + 100 * attempt, copied):
            return
    raise AssertionError(
        f"{ATTEMPTS} loads and the landed bytes of chunk 0 were never copied before its "
        "frame failed: the attack never happened"
    )


ATTEMPTS = 5


def _reread_after_failed_frame(
    gated: GatedServer,
    change: str,
    into: str,
    seed: int,
    copied: list[tuple[int, int, int]],
) -> bool:
    """One load of the attack above, its every chunk checked against the live KV;
    whether the landed bytes of chunk 0 were copied (the attack happened)."""
    n = 3 * FRAME_DEPTH
    with contextlib.ExitStack() as stack:
        mine = gated.client()
        other = gated.client()
        stack.callback(mine.close)
        stack.callback(other.close)
        tokens, _, first = _put(other, MB_IDENT, seed, n)
        _, kv_b = prompt_kv(seed + 1, n * MB_LAYOUT.tokens_per_chunk, MB_LAYOUT)
        second = _chunks(kv_b, MB_LAYOUT, n)
        lk = mine.lookup(MB_IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": n}
        by_key = {f.key: f for f in scan_frames(gated.path)}
        frame = by_key[lk.hits[0].key]
        at = frame.payload_offset + 4096 + 7
        flip(frame.segment, at, 1)
        outs = [np.zeros(MB_LAYOUT.chunk_shape, np.float16) for _ in range(n)]
        gated.arm("wait")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["res"] = mine.load(lk, outs if into == "buffers" else None)
            except BaseException as exc:
                box["exc"] = exc

        t = threading.Thread(target=run)
        t.start()
        try:
            gated.parked()
            if change == "healed":
                flip(frame.segment, at, 1)
            else:
                other.invalidate(namespace=PUBLIC)
                other.put_prompt(MB_IDENT, PUBLIC, tokens, kv_b)
                other.flush()
                other.evict("dram", BIG)
        finally:
            gated.release()
            t.join(60)
        assert "exc" not in box, box.get("exc")
        res = box["res"]
        live = first if change == "healed" else second
        for i, arr in enumerate(res.arrays):
            assert arr.tobytes() == live[i], f"chunk {i} handed out with bytes it never had"
        other.invalidate(namespace=PUBLIC)
        return any(s == 0 and e == MiB for _, s, e in copied)


# --------------------------------------------------------------------------- sizes


@pytest.fixture(scope="module")
def big() -> Iterator[ServerProc]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="landed-attack-") as d:
        srv = disk_server(Path(d) / "store", dram=32 * MiB, disk=160 * MiB)
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture
def client(big: ServerProc) -> Iterator[RemoteStore]:
    c = big.client()
    yield c
    with contextlib.suppress(Exception):
        c.invalidate(namespace=PUBLIC)
    c.close()


SIZES = [
    (4 << 10, 8),
    (512 << 10, 3),
    ((512 << 10) + (4 << 10), 2),
    (MiB, 1),
    (MiB, 4),
    (4 * MiB, 2),
]


@pytest.mark.parametrize(("size", "n"), SIZES)
@pytest.mark.parametrize("into", ["buffers", "new arrays"])
def test_disk_loads_of_every_size_hand_out_the_stored_bytes_counted_once(
    client: RemoteStore, copied: list[tuple[int, int, int]], size: int, n: int, into: str
) -> None:
    """Chunks of 4 KiB to 4 MiB, one to eight of them: every byte handed out the stored
    one, new arrays read-only, counted once; a chunk of 512 KiB or less gets no landed
    part; a larger one's piecewise copies run from byte 0 to its end without a gap."""
    ident = _ident(_layout(size), f"sizes-{size}-{n}-{into}")
    tokens, _, stored = _put(client, ident, size % 997 + n, n)
    before = copy.deepcopy(client.counters)
    lk = client.lookup(ident, PUBLIC, tokens)
    assert lk.tiers() == {"disk": n}
    outs = [np.full(ident.layout.chunk_shape, 7, np.float16) for _ in range(n)]
    res = client.load(lk, outs if into == "buffers" else None)
    assert res.loaded == n and res.corrupt == [] and res.vanished == 0
    assert [a.tobytes() for a in res.arrays] == stored
    if into == "buffers":
        assert all(a is o for a, o in zip(res.arrays, outs, strict=True))
    else:
        assert not any(a.flags.writeable for a in res.arrays)
    after = client.counters
    assert after.loads - before.loads == 1
    assert after.tier("disk").loaded - before.tier("disk").loaded == n
    assert after.frame_loads - before.frame_loads == n
    if size <= 512 << 10:
        assert copied == []
    for arr in res.arrays:
        ranges = [(s, e) for d, s, e in copied if d == arr.ctypes.data and s < e]
        if ranges:
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_dram_hits_after_disk_hits_get_no_landed_parts(
    client: RemoteStore, copied: list[tuple[int, int, int]]
) -> None:
    """Two chunks on disk, then two more in DRAM: the disk ones may come early, the DRAM
    ones are never frame-loaded; every byte the stored one."""
    ident = _ident(MB_LAYOUT, "mixed")
    t = MB_LAYOUT.tokens_per_chunk
    tokens, kv = prompt_kv(31, 4 * t, MB_LAYOUT)
    client.put_prompt(ident, PUBLIC, tokens[: 2 * t], kv[:, :, :, : 2 * t, :])
    client.flush()
    client.evict("dram", BIG)
    client.put_prompt(ident, PUBLIC, tokens, kv)
    client.flush()
    stored = _chunks(kv, MB_LAYOUT, 4)
    lk = client.lookup(ident, PUBLIC, tokens)
    assert [h.tier for h in lk.hits] == ["disk", "disk", "dram", "dram"]
    outs = [np.zeros(MB_LAYOUT.chunk_shape, np.float16) for _ in range(4)]
    res = client.load(lk, outs)
    assert res.loaded == 4 and [a.tobytes() for a in res.arrays] == stored
    dram = {outs[2].ctypes.data, outs[3].ctypes.data}
    assert not [c for c in copied if c[0] in dram]


def test_loads_into_shared_buffers_get_no_landed_parts(
    client: RemoteStore, copied: list[tuple[int, int, int]]
) -> None:
    ident = _ident(MB_LAYOUT, "shared")
    tokens, _, stored = _put(client, ident, 41, 3)
    outs = shared_chunks(client, MB_LAYOUT, 3)
    res = client.load(client.lookup(ident, PUBLIC, tokens), outs)
    assert res.loaded == 3 and [a.tobytes() for a in res.arrays] == stored
    assert copied == []


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_a_buffer_that_does_not_fit_is_the_same_invalid_argument_with_or_without_early(
    client: RemoteStore, copied: list[tuple[int, int, int]], bad: str
) -> None:
    """A C-contiguous buffer of another dtype or shape (early parts asked for) raises
    InvalidArgument as a non-contiguous one (none asked for) does; no landed byte is
    copied into it; the client loads again after, exact."""
    ident = _ident(MB_LAYOUT, f"misfit-{bad}")
    tokens, _, stored = _put(client, ident, 51, 2)
    shape = MB_LAYOUT.chunk_shape
    if bad == "dtype":
        wrong = np.zeros(shape, np.float32)
        strided = np.zeros(shape[::-1], np.float32).T
    else:
        wrong = np.zeros((*shape[:-1], shape[-1] // 2), np.float16)
        strided = np.zeros(wrong.shape[::-1], np.float16).T
    for odd in (wrong, strided):
        lk = client.lookup(ident, PUBLIC, tokens)
        outs = [np.zeros(shape, np.float16), odd]
        with pytest.raises(InvalidArgument):
            client.load(lk, outs)
    assert not [c for c in copied if c[0] == wrong.ctypes.data]
    assert not wrong.any()
    res = client.load(client.lookup(ident, PUBLIC, tokens), None)
    assert res.loaded == 2 and [a.tobytes() for a in res.arrays] == stored


def test_aliased_and_overlapping_buffers_are_refused_before_any_landed_byte(
    client: RemoteStore, copied: list[tuple[int, int, int]]
) -> None:
    """The same buffer for two chunks, and two chunks' buffers overlapping by half:
    InvalidArgument, and no byte copied into them (early or not)."""
    ident = _ident(MB_LAYOUT, "aliased")
    tokens, _, stored = _put(client, ident, 61, 2)
    shape = MB_LAYOUT.chunk_shape
    a = np.zeros(shape, np.float16)
    count = int(np.prod(shape))
    flat = np.zeros(count + count // 2, np.float16)
    o0, o1 = flat[:count].reshape(shape), flat[count // 2 :].reshape(shape)
    for outs in ([a, a], [o0, o1]):
        with pytest.raises(InvalidArgument):
            client.load(client.lookup(ident, PUBLIC, tokens), outs)
    assert copied == [] and not a.any() and not flat.any()
    res = client.load(client.lookup(ident, PUBLIC, tokens), None)
    assert [x.tobytes() for x in res.arrays] == stored


def test_load_async_hands_out_no_chunk_whose_frame_failed(
    big: ServerProc, client: RemoteStore
) -> None:
    """Chunk 1 of 3 damaged in its last payload byte (its landed bytes copied into the
    caller's buffer before its hash fails): the handle gives chunk 0 exact, chunk 1 and
    2 as misses; the result counts one loaded and names chunk 1 corrupt."""
    ident = _ident(MB_LAYOUT, "async-damaged")
    tokens, _, stored = _put(client, ident, 71, 3)
    lk = client.lookup(ident, PUBLIC, tokens)
    by_key = {f.key: f for f in scan_frames(big.path)}
    frame = by_key[lk.hits[1].key]
    flip(frame.segment, frame.payload_offset + MiB - 1, 1)
    outs = [np.zeros(MB_LAYOUT.chunk_shape, np.float16) for _ in range(3)]
    seen: list[int] = []
    handle = client.load_async(lk, outs)
    first = handle.chunk(0, timeout=30)
    assert first is not None and first.tobytes() == stored[0]
    res = handle.wait(timeout=30)
    seen = [i for i in range(3) if handle.chunk(i, timeout=30) is not None]
    assert seen == [0]
    assert res.loaded == 1 and res.corrupt == [lk.hits[1].key]
    assert res.arrays[0].tobytes() == stored[0]


def test_two_clients_loading_at_once_get_their_own_bytes(big: ServerProc) -> None:
    """Two clients, each in its own thread, load their own 3 x 1 MiB disk prompts five
    times, early parts in buffers and in new arrays: every byte their own."""
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        c = big.client()
        try:
            ident = _ident(MB_LAYOUT, f"pair-{k}")
            tokens, _, stored = _put(c, ident, 80 + k, 3)
            shape = MB_LAYOUT.chunk_shape
            for r in range(5):
                bufs = None if r % 2 else [np.zeros(shape, np.float16) for _ in range(3)]
                res = c.load(c.lookup(ident, PUBLIC, tokens), bufs)
                assert res.loaded == 3 and [a.tobytes() for a in res.arrays] == stored
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors


def test_the_server_killed_after_landed_parts_went_out_is_a_typed_error(tmp_path: Path) -> None:
    """The load parks before its publication with chunk 0's landed bytes sent; the server
    is killed (SIGKILL): the client raises a KVLifeError, nothing is loaded; after a
    restart a new load is exact."""
    srv = GatedServer(
        tmp_path / "store", tmp_path / "gate", promote=False, dram=16 * MiB, disk=64 * MiB
    )
    srv.start()
    try:
        c = srv.client()
        ident = _ident(MB_LAYOUT, "killed")
        tokens, _, stored = _put(c, ident, 91, 2)
        lk = c.lookup(ident, PUBLIC, tokens)
        frame = {f.key: f for f in scan_frames(srv.path)}[lk.hits[0].key]
        flip(frame.segment, frame.payload_offset + 100, 1)  # chunk 0 lands, then fails
        srv.arm("wait")
        box: dict[str, Any] = {}
        outs = [np.zeros(MB_LAYOUT.chunk_shape, np.float16) for _ in range(2)]

        def run() -> None:
            try:
                box["res"] = c.load(lk, outs)
            except BaseException as exc:
                box["exc"] = exc

        t = threading.Thread(target=run)
        t.start()
        srv.parked()
        srv.kill()
        t.join(60)
        assert isinstance(box.get("exc"), KVLifeError), box
        flip(frame.segment, frame.payload_offset + 100, 1)
        srv.disarm()
        srv.start()
        c2 = srv.client()
        try:
            res = c2.load(c2.lookup(ident, PUBLIC, tokens), outs)
            assert res.loaded == 2 and [a.tobytes() for a in res.arrays] == stored
        finally:
            c2.close()
        with contextlib.suppress(Exception):
            c.close()
    finally:
        srv.disarm()
        srv.stop()


# --------------------------------------------------------------------------- stub wire

SMALL = (4, 256)
"""A stub chunk: 4 x 256 float16, 2 KiB."""
CHUNK_BYTES = 2048


class _Conn:
    epoch = 0
    arena = True


class _StubWire:
    """What ``Loads._load_mapped`` uses of a Wire: a numpy "arena", and a call that feeds
    the given parts (a callable in them runs instead, e.g. to change the arena) and
    returns the given reply."""

    def __init__(self, parts: Sequence[object], reply: dict[str, Any]) -> None:
        rng = np.random.default_rng(5)
        self.arena = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
        self.parts = parts
        self.reply = reply
        self.args: dict[str, Any] = {}
        self.released: list[int] = []
        self.disowned = 0
        self.conn = None

    def mapped(self) -> bool:
        return True

    def view(self, conn: object, off: int, dtype: str, shape: Sequence[int]) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        return self.arena[off : off + n].view(dt).reshape(tuple(shape))

    def call_on(
        self,
        verb: str,
        args: dict[str, Any],
        on_part: Callable[[object, list[Any]], None] | None = None,
        after_send: object = None,
    ) -> tuple[dict[str, Any], _Conn]:
        self.args = dict(args)
        conn = _Conn()
        for p in self.parts:
            if callable(p):
                p()
            else:
                assert on_part is not None
                on_part(conn, p)  # type: ignore[arg-type]
        return self.reply, conn

    def release(self, load: int, conn: object) -> None:
        self.released.append(load)

    def disown(self, conn: object) -> None:
        self.disowned += 1

    def bytes_at(self, off: int) -> bytes:
        return self.arena[off : off + CHUNK_BYTES].tobytes()


def _reply(streamed: int, grants: list[list[Any]], n: int = 2) -> dict[str, Any]:
    return {
        "load": 9,
        "grants": grants,
        "streamed": streamed,
        "confirmed": 0,
        "requested": n,
        "tiers": {"disk": n},
        "corrupt": b"",
        "vanished": 0,
        "read_errors": 0,
    }


def _lookup(n: int = 2) -> LookupResult:
    from kvlife.core.identity import KEY_BYTES, ChunkKey
    from kvlife.core.objects import TierName

    hits = [
        ChunkHit(i, ChunkKey(bytes([i + 1]) * KEY_BYTES), i * 4, TierName("disk")) for i in range(n)
    ]
    return LookupResult(hits, n, 4)


def _stub_load(wire: _StubWire, outs: Sequence[np.ndarray] | None, n: int = 2) -> Any:
    loads = client_loads.Loads(wire)  # type: ignore[arg-type]
    return loads._load_mapped(_lookup(n), outs, "", None)


def _outs(n: int = 2) -> list[np.ndarray]:
    return [np.zeros(SMALL, np.float16) for _ in range(n)]


def _landed(
    i: int, off: int, upto: int, shape: Sequence[int] = SMALL, dtype: str = "<f2"
) -> list[Any]:
    return [i, off, dtype, list(shape), upto]


def _part(i: int, off: int) -> list[Any]:
    return [i, off, "<f2", list(SMALL)]


A, B, C = 0, 8192, 16384
"""Three extents of the stub arena."""


@pytest.mark.parametrize(
    ("parts", "why"),
    [
        ([_landed(1, A, 100)], "a landed part for chunk 1 before chunk 0"),
        ([_landed(0, A, CHUNK_BYTES + 1)], "past the chunk's size"),
        ([_part(0, A), _landed(0, A, 100)], "after the chunk's own part"),
        ([_landed(2, A, 100)], "for a chunk the load has not"),
        ([_landed(0, A, 0)], "of no bytes"),
        ([_landed(0, A, -5)], "of bytes < 0"),
        ([[0, -1, "<f2", list(SMALL), 10]], "at an offset < 0"),
        ([[0, A, "O", list(SMALL), 10]], "of an object dtype"),
        ([[True, A, "<f2", list(SMALL), 10]], "chunk number True"),
    ],
)
@pytest.mark.parametrize("into", ["buffers", "new arrays"])
def test_a_landed_part_a_server_should_not_send_is_a_protocol_error(
    parts: list[object], why: str, into: str
) -> None:
    wire = _StubWire(parts, _reply(0, [[A, "<f2", list(SMALL)], [B, "<f2", list(SMALL)]]))
    with pytest.raises(ProtocolError):
        _stub_load(wire, _outs() if into == "buffers" else None)


@pytest.mark.parametrize("into", ["buffers", "new arrays"])
def test_landed_bytes_of_a_chunk_granted_in_the_final_reply_are_not_kept(into: str) -> None:
    """Chunk 0's landed bytes told from extent A, then A rewritten (the store's re-read
    after the frame failed) and chunk 0 granted in the final reply at A: the handed-out
    bytes are A's now, none of the landed ones (mended in d5003cf)."""
    wire = _StubWire([], _reply(0, [[A, "<f2", list(SMALL)], [B, "<f2", list(SMALL)]]))

    def reread() -> None:
        wire.arena[A : A + CHUNK_BYTES] ^= 0x5A

    wire.parts = [_landed(0, A, CHUNK_BYTES), reread]
    res = _stub_load(wire, _outs() if into == "buffers" else None)
    assert res.loaded == 2
    assert [a.tobytes() for a in res.arrays] == [wire.bytes_at(A), wire.bytes_at(B)]


def test_landed_bytes_then_the_chunk_streamed_from_another_extent_start_over() -> None:
    wire = _StubWire([], _reply(2, []))

    def moved() -> None:
        wire.arena[A : A + CHUNK_BYTES] = 0

    wire.parts = [_landed(0, A, 1000), moved, _part(0, C), _part(1, B)]
    res = _stub_load(wire, _outs())
    assert [a.tobytes() for a in res.arrays] == [wire.bytes_at(C), wire.bytes_at(B)]


def test_landed_parts_shrinking_or_changing_shape_never_keep_other_bytes() -> None:
    """For one extent: a landed part, a smaller one, one of twice the shape (a buggy
    server), then the chunk's own part: a ProtocolError or the extent's bytes, never a
    ValueError or other bytes."""
    wire = _StubWire([], _reply(1, [[B, "<f2", list(SMALL)]]))
    wire.parts = [
        _landed(0, A, 1000),
        _landed(0, A, 10),
        _landed(0, A, 3000, shape=(8, 256)),
        _part(0, A),
    ]
    try:
        res = _stub_load(wire, _outs())
    except ProtocolError:
        return
    assert [a.tobytes() for a in res.arrays] == [wire.bytes_at(A), wire.bytes_at(B)]


def test_a_streamed_chunk_invalidated_after_its_landed_bytes_is_a_miss() -> None:
    """Landed bytes and the own part of chunk 0, but the final reply counts no streamed
    chunk and grants nothing: nothing handed out, the grant released."""
    wire = _StubWire([_landed(0, A, 500), _part(0, A)], _reply(0, []))
    res = _stub_load(wire, None)
    assert res.loaded == 0 and res.arrays == [] and wire.released == [9]


@pytest.mark.parametrize("odd", ["strided", "other dtype"])
def test_landed_parts_nobody_asked_for_or_that_do_not_fit_are_not_copied(odd: str) -> None:
    """Buffers the client cannot copy bytes into (a transposed view: no early asked) or
    a landed part of another dtype than the buffer: nothing copied early, the chunks
    exact from their own parts."""
    outs = _outs()
    parts: list[object]
    if odd == "strided":
        outs[0] = np.zeros(SMALL[::-1], np.float16).T
        parts = [_landed(0, A, 1000), _part(0, A), _part(1, B)]
    else:
        parts = [_landed(0, A, 1000, shape=(CHUNK_BYTES,), dtype="|u1"), _part(0, A), _part(1, B)]
    wire = _StubWire(parts, _reply(2, []))
    res = _stub_load(wire, outs)
    assert ("early" in wire.args) is (odd != "strided")
    assert [np.ascontiguousarray(a).tobytes() for a in res.arrays] == [
        wire.bytes_at(A),
        wire.bytes_at(B),
    ]


def test_new_arrays_from_landed_bytes_are_read_only_and_exact() -> None:
    wire = _StubWire(
        [_landed(0, A, 1024), _landed(0, A, 2000), _part(0, A)],
        _reply(1, [[B, "<f2", list(SMALL)]]),
    )
    res = _stub_load(wire, None)
    assert [a.tobytes() for a in res.arrays] == [wire.bytes_at(A), wire.bytes_at(B)]
    assert not any(a.flags.writeable for a in res.arrays)
