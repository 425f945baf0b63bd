"""A streamed load's landed bytes told before the chunk verified (issue 28): the chunk a
frame load reads in pieces (the run's last, larger than twice ``native.DEFAULT_PIECE``) has its
landed bytes sent in parts ``[i, offset, dtype, shape, bytes]`` as they land, and the
client copies them into the caller's buffer (or a new array) while the rest is read;
its own part, once it verified, copies the rest. Real ``kvlife serve`` processes, real
segment files. The contract: the bytes handed out are the stored ones; a chunk whose
frame fails after its first bytes were copied is a counted miss, nothing of it kept;
buffers the client cannot copy into byte by byte ask for no early parts; a malformed
landed part is a ProtocolError."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlife.client import RemoteStore, replies
from kvlife.client import loads as client_loads
from kvlife.core.errors import ProtocolError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.native import frames as native
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.conftest import prompt_kv
from tests.helpers.stream_spy import count_streamed
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import copy_spy, disk_server, put_on_disk

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

LAYOUT = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=512)
"""6 MiB chunks: the last frame of a load is read in pieces (more than twice the server's
piece, ``native.DEFAULT_PIECE``: pieces of 3, 2 and 1 MiB)."""
N = LAYOUT.tokens_per_chunk
CHUNKS = 3
IDENT = ModelIdentity(layout=LAYOUT, model_id="landed", weights_digest="w0", tokenizer_digest="t0")


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    server = disk_server(tmp_path / "store", dram=24 * MiB, disk=128 * MiB)
    yield server
    server.stop()


@pytest.fixture
def client(srv: ServerProc) -> Iterator[RemoteStore]:
    c = srv.client()
    yield c
    c.close()


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """The byte ranges the client copied out of extents in pieces (landed parts and the
    rest after them), in order: (the destination's data address, start, end)."""
    return copy_spy(monkeypatch)


def _on_disk(store: RemoteStore, seed: int) -> tuple[np.ndarray, list[bytes]]:
    return put_on_disk(store, IDENT, CHUNKS, seed)


@pytest.mark.parametrize("into", ["buffers", "new arrays"])
def test_landed_bytes_are_copied_before_the_chunk_verified(
    client: RemoteStore, copied: list[tuple[int, int, int]], into: str
) -> None:
    """Each chunk's bytes are copied once they landed, before it verified: a chunk read
    whole in one landed part (its own part copies nothing more), the last one, read in
    pieces, in landed parts at halves of what is left and the rest after it verified;
    every byte handed out is the stored one."""
    tokens, stored = _on_disk(client, 1)
    size = len(stored[-1])
    for _ in range(3):  # until the server reached the last frame while it was read
        copied.clear()
        lk = client.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        outs = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
        res = client.load(lk, outs if into == "buffers" else None)
        assert res.loaded == CHUNKS
        assert [a.tobytes() for a in res.arrays] == stored
        if into == "buffers":
            assert all(a is o for a, o in zip(res.arrays, outs, strict=True))
        else:
            assert not any(a.flags.writeable for a in res.arrays)
        by_chunk = [[(a, b) for d, a, b in copied if d == arr.ctypes.data] for arr in res.arrays]
        for ranges in by_chunk[:-1]:  # read whole: landed whole, nothing left after
            assert ranges == [(0, size), (size, size)]
        last = [r for r in by_chunk[-1] if r[0] < r[1]]
        if len(last) >= 2:  # a landed part at half of it (3 MiB), the rest after
            break
    else:
        raise AssertionError(f"the last chunk never came in landed pieces: {copied}")
    # in order, contiguous, from 0 to the chunk's end: landed parts, then the rest
    assert last[0][0] == 0 and last[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(last))
    assert last[-1][1] - last[-1][0] <= size // 2


def test_a_chunk_whose_frame_fails_after_its_landed_bytes_were_copied_is_a_miss(
    srv: ServerProc, client: RemoteStore, copied: list[tuple[int, int, int]]
) -> None:
    """The last payload byte of the last chunk's frame damaged on disk: its first bytes
    land and are copied, then it fails its checksum: the load keeps the chunks before
    it, counts it corrupt, and hands out nothing of it. (The server tells landed parts
    of the frame only if it asks while the frame is read; a busy machine gets a few
    prompts, each load held to the contract.)"""
    for attempt in range(5):
        copied.clear()
        tokens, stored = _on_disk(client, 2 + 100 * attempt)
        lk = client.lookup(IDENT, PUBLIC, tokens)
        last = {f.key: f for f in scan_frames(srv.path)}[lk.hits[-1].key]
        flip(last.segment, last.offset + HEADER_BYTES + len(stored[-1]) - 1, 1)
        outs = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
        res = client.load(lk, outs)
        assert res.loaded == CHUNKS - 1
        assert [a.tobytes() for a in res.arrays] == stored[:-1]
        assert len(res.corrupt) == 1
        damaged = [(a, b) for d, a, b in copied if d == outs[-1].ctypes.data]
        if damaged:
            # landed parts only, in order from byte 0: they may reach the chunk's end (its
            # last piece hashed before the reader marked the read done), and what the
            # client copied is no data (the chunk is the counted miss above)
            assert damaged[0][0] == 0 and damaged[-1][1] <= len(stored[-1])
            assert all(a[1] == b[0] for a, b in itertools.pairwise(damaged))
            return
    raise AssertionError("five loads and the damaged chunk's landed bytes were never copied")


def test_buffers_the_client_cannot_copy_into_by_bytes_ask_for_no_landed_parts(
    client: RemoteStore, copied: list[tuple[int, int, int]]
) -> None:
    """A buffer that is not C-contiguous (a transposed view): the client does not ask for
    landed parts, and the chunks are copied whole, every byte the stored one."""
    tokens, stored = _on_disk(client, 3)
    lk = client.lookup(IDENT, PUBLIC, tokens)
    shape = LAYOUT.chunk_shape
    outs = [np.zeros(shape[::-1], np.float16).T for _ in range(CHUNKS)]
    assert not outs[0].flags.c_contiguous
    res = client.load(lk, outs)
    assert res.loaded == CHUNKS
    assert [np.ascontiguousarray(a).tobytes() for a in res.arrays] == stored
    assert copied == []


def test_a_client_that_turns_landed_parts_off_copies_each_chunk_once_verified(
    client: RemoteStore, copied: list[tuple[int, int, int]]
) -> None:
    """``early`` off (what ``kvlife bench server`` times beside): C-contiguous buffers,
    yet no landed part is asked for or copied, every byte handed out the stored one;
    on again, the next load copies landed parts."""
    tokens, stored = _on_disk(client, 4)
    lk = client.lookup(IDENT, PUBLIC, tokens)
    outs = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
    client._loads.early = False
    res = client.load(lk, outs)
    assert res.loaded == CHUNKS and [a.tobytes() for a in res.arrays] == stored
    assert copied == []
    client._loads.early = True
    for o in outs:
        o[...] = 0
    res = client.load(client.lookup(IDENT, PUBLIC, tokens), outs)
    assert res.loaded == CHUNKS and [a.tobytes() for a in res.arrays] == stored
    assert copied  # landed parts, then the rest


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.lists(st.one_of(st.integers(-2, 1 << 40), st.text(max_size=3)), max_size=6),
        st.tuples(
            st.integers(-1, 3),
            st.integers(-1, 1 << 20),
            st.just("<f2"),
            st.just([2, 2]),
            st.integers(-1, 64),
        ),
    )
)
def test_a_landed_part_that_is_not_chunk_offset_dtype_shape_bytes_is_a_protocol_error(
    p: object,
) -> None:
    """Whatever the server sends as a landed part: five fields of the right kinds with
    a count of bytes > 0, or ProtocolError (never another exception)."""
    try:
        i, off, dtype, shape, upto = replies.landed_part(p)
    except ProtocolError:
        return
    assert isinstance(i, int) and off >= 0 and upto > 0 and dtype and isinstance(shape, tuple)


def test_the_rest_is_copied_after_landed_bytes_only_from_the_same_extent() -> None:
    """The client's bookkeeping of a chunk's landed bytes (``_Early``): the rest starts
    after them only for the same chunk, extent, dtype and shape; another extent (the
    chunk re-read elsewhere), another chunk, another shape, or the final reply's grants
    (``forget``: a chunk granted there failed its frame and was read again) start over
    at byte 0."""
    src = np.arange(16, dtype=np.float16).reshape(4, 4)
    out = np.zeros_like(src)
    early = client_loads._Early(lambda shape, dtype: np.empty(shape, dtype))
    dst = early.target(2, 4096, src, out)
    assert dst is out
    early.upto = 10
    assert early.taken(2, 8192, src) == (0, None)  # another extent
    dst = early.target(2, 4096, src, out)
    early.upto = 10
    assert early.taken(3, 4096, src) == (0, None)  # another chunk
    early.target(2, 4096, src, out)
    early.upto = 10
    start, held = early.taken(2, 4096, src)
    assert start == 10 and held is out
    early.target(2, 4096, src, out)
    early.upto = 10
    early.forget()  # the final reply's grants: a chunk granted there is copied whole
    assert early.taken(2, 4096, src) == (0, None)
    early.target(2, 4096, src, out)
    early.upto = 10
    wider = np.zeros(32, np.float16)  # the same extent named with another shape
    assert early.target(2, 4096, wider, None) is not out
    assert early.upto == 0
    assert early.target(0, 0, src, np.zeros((4, 4), np.float32)) is None  # does not fit
    assert early.target(0, 0, src, np.zeros((4, 4), np.float16).T) is None  # not C order


def test_a_load_into_the_callers_buffers_copies_out_by_streaming_stores(
    client: RemoteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte a disk load hands to the caller's own (C-contiguous) buffers is copied
    out of the arena by the extension's streaming copy (landed parts and whole chunks
    alike), and is the stored byte; a DRAM load copied from the lookup's hints too."""
    module = native.native_module()
    if module is None:
        pytest.skip("the native extension is not built")
    streamed = count_streamed(monkeypatch, module)
    tokens, stored = _on_disk(client, 5)
    lk = client.lookup(IDENT, PUBLIC, tokens)
    outs = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
    streamed.clear()  # the put's own copies
    res = client.load(lk, outs)
    assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}
    assert [o.tobytes() for o in outs] == stored
    # the tail of a chunk shorter than a streamed piece is copied by np.copyto
    assert sum(streamed) >= CHUNKS * LAYOUT.chunk_nbytes - CHUNKS * (64 << 10)
    tokens, kv = prompt_kv(6, CHUNKS * N, LAYOUT)
    client.put_prompt(IDENT, PUBLIC, tokens, kv)  # in DRAM (and written through)
    lk = client.lookup(IDENT, PUBLIC, tokens)
    assert lk.tiers() == {"dram": CHUNKS}
    streamed.clear()
    res = client.load(lk, outs)
    assert res.loaded == CHUNKS
    for i, o in enumerate(outs):
        assert np.array_equal(o, kv[:, :, :, i * N : (i + 1) * N])
    assert sum(streamed) == CHUNKS * LAYOUT.chunk_nbytes
