"""Direct disk reads (issue 28): a client made with ``direct_reads`` reads its disk
hits' frames from the server's segment files itself, verified, while the server
confirms them live (kvlife.store.direct, kvlife.client.direct). Real servers, real
segment files: a frame corrupted on the disk, an invalidation and a rewrite between
the lookup and the load, buffers O_DIRECT cannot fill. Never a wrong byte kept."""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.client import RemoteStore
from kvlife.client.direct import (
    DEPTH,
    LARGE_CHUNK,
    LARGE_DEPTH,
    depth_for,
    parse_frames,
    unreachable,
)
from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import InvalidArgument, ProtocolError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.server import protocol
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED, FrameHeader, pack_header
from tests.conftest import prompt_kv
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import (
    OUT_OF_REACH,
    client_pair,
    disk_server,
    out_of_reach_server,
    put_on_disk,
)
from tests.server.tenants import TOKENS, USER, as_, write_config

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_chunk=32)
"""8 KiB chunks: a whole number of pages, as O_DIRECT reads them."""
N = LAYOUT.tokens_per_chunk
CHUNKS = 3


def _identity() -> ModelIdentity:
    return ModelIdentity(
        layout=LAYOUT, model_id="direct", weights_digest="w0", tokenizer_digest="t0"
    )


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    server = disk_server(tmp_path / "store")
    yield server
    server.stop()


@pytest.fixture
def clients(srv: ServerProc) -> Iterator[tuple[RemoteStore, RemoteStore]]:
    with client_pair(srv) as pair:
        yield pair


def _on_disk(plain: RemoteStore, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A prompt of CHUNKS chunks put, flushed and evicted from DRAM: its tokens and chunks."""
    tokens, kv = prompt_kv(seed, CHUNKS * N, LAYOUT)
    plain.put_prompt(_identity(), PUBLIC, tokens, kv)
    plain.flush()
    plain.evict("dram", 1 << 40)
    chunks = [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]) for i in range(CHUNKS)]
    return tokens, chunks


def _lookup(store: RemoteStore, tokens: np.ndarray) -> RemoteLookup:
    lk = store.lookup(_identity(), PUBLIC, tokens)
    assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
    return lk


def _outs(store: RemoteStore, bufs: str) -> list[np.ndarray] | None:
    """The shared buffers of ``store``'s session, or none (``new``: the load reads into
    arrays of the client's pool and hands them out)."""
    return _shared(store) if bufs == "shared" else None


BUFS = pytest.mark.parametrize("bufs", ["shared", "new"])


@BUFS
def test_load_async_reads_directly_too(clients: tuple[RemoteStore, RemoteStore], bufs: str) -> None:
    """``load_async`` runs the same load on the client's pool: each chunk is handed out
    once read, verified and confirmed, and the server counts the direct loads."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 21)
    lk = _lookup(mine, tokens)
    before = plain.counters.direct_loads
    handle = mine.load_async(lk, _outs(mine, bufs))
    for i, want in enumerate(chunks):
        got = handle.chunk(i, timeout=30)
        assert got is not None and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    res = handle.wait(timeout=30)
    assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}
    assert mine.counters.direct_loads - before == CHUNKS
    assert mine.direct_fallbacks() == 0


def _shared(store: RemoteStore, layout: KVLayout = LAYOUT, count: int = CHUNKS) -> list[np.ndarray]:
    """``count`` chunk buffers of ``layout`` in one shared buffer of ``store``'s session."""
    raw = store.alloc_buffer(count * layout.chunk_nbytes)
    n = layout.chunk_nbytes
    return [
        raw[i * n : (i + 1) * n].view(np.float16).reshape(layout.chunk_shape) for i in range(count)
    ]


def _aligned() -> list[np.ndarray]:
    """Page-aligned buffers of the process's own memory (not the server's)."""
    out = []
    for _ in range(CHUNKS):
        room = np.empty(LAYOUT.chunk_nbytes + 4096, np.uint8)
        at = (-room.ctypes.data) % 4096
        out.append(room[at : at + LAYOUT.chunk_nbytes].view(np.float16).reshape(LAYOUT.chunk_shape))
    return out


def test_buffers_a_direct_load_refuses_stay_as_they_were(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """A direct-reads client's ``load`` into buffers sharing memory, one read-only, not
    arrays at all or too few is InvalidArgument, and nothing was read into any of them
    (no direct read started). Then the same load into good buffers is read directly
    and exact."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 31)
    lk = _lookup(mine, tokens)
    before = plain.counters.direct_loads
    fill = np.float16(7.0)
    one = _aligned()
    ro = _aligned()
    ro[2].flags.writeable = False
    cases: dict[str, list[Any]] = {
        "share memory": [one[0], one[1], one[0]],
        "read-only": ro,
        "not an array": [*one[:2], bytearray(LAYOUT.chunk_nbytes)],
        "output buffers for": one[:2],
    }
    for why, outs in cases.items():
        for o in outs:
            if isinstance(o, np.ndarray) and o.flags.writeable:
                o[...] = fill
        with pytest.raises(InvalidArgument, match=why):
            mine.load(lk, outs)
        for o in outs:
            if isinstance(o, np.ndarray) and o.flags.writeable:
                assert (o == fill).all(), f"{why}: a refused load wrote into a buffer"
    assert plain.counters.direct_loads == before
    outs = _aligned()
    res = mine.load(lk, outs)
    # counted when the server reads the word after the reply: this session's next call
    assert res.loaded == CHUNKS and mine.counters.direct_loads == before + CHUNKS
    for got, want in zip(outs, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("where", ["shared", "own", "new"])
def test_a_direct_load_reads_the_frames_here_and_the_server_counts_it(
    clients: tuple[RemoteStore, RemoteStore], where: str
) -> None:
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 1)
    lk = _lookup(mine, tokens)
    assert len(lk.frames) == CHUNKS and all(f is not None for f in lk.frames)
    before = plain.counters
    # "new": no buffers (what the vLLM worker asks): read into arrays of the client's
    # pool, page-aligned, which the load hands out
    outs = _shared(mine) if where == "shared" else _aligned() if where == "own" else None
    res = mine.load(lk, outs)
    assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}
    for got, want in zip(res.arrays, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        # new arrays are handed out read-only (every load without buffers does)
        assert got.flags.writeable == (where != "new") and got.shape == LAYOUT.chunk_shape
    # counted once the server read the client's word of what it kept (the frame after
    # the request): its own session's next request is answered after that
    after = mine.counters
    assert after.direct_loads - before.direct_loads == CHUNKS
    assert after.loads - before.loads == 1
    assert after.tier("disk").loaded - before.tier("disk").loaded == CHUNKS
    assert mine.direct_fallbacks() == 0


BIG = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_chunk=256)
"""2 MiB chunks: read :data:`LARGE_DEPTH` at a time (smaller ones :data:`DEPTH`)."""


@BUFS
def test_large_chunks_are_read_two_at_a_time_exact_and_counted(tmp_path: Path, bufs: str) -> None:
    """A run of 2 MiB frames keeps fewer reads in flight than one of small frames (four
    large reads finish together and their checksums then wait for the last); read so,
    a direct load of five of them is exact, read here and counted by the server."""
    assert BIG.chunk_nbytes == LARGE_CHUNK and LARGE_DEPTH < DEPTH
    ident = ModelIdentity(
        layout=BIG, model_id="direct-big", weights_digest="w", tokenizer_digest="t"
    )
    srv = disk_server(tmp_path / "store", dram=16 * MiB)
    try:
        with client_pair(srv) as (plain, mine):
            n = 5
            tokens, want = put_on_disk(plain, ident, n, 61)
            lk = mine.lookup(ident, PUBLIC, tokens)
            assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": n}
            frames = [f for f in lk.frames if f is not None]
            assert len(frames) == n and depth_for(frames) == LARGE_DEPTH
            small = _lookup(mine, _on_disk(plain, 62)[0])
            assert depth_for([f for f in small.frames if f is not None]) == DEPTH
            before = mine.counters.direct_loads
            res = mine.load(lk, _shared(mine, BIG, n) if bufs == "shared" else None)
            assert res.loaded == n and res.tiers == {"disk": n}
            assert [a.tobytes() for a in res.arrays] == want
            assert mine.direct_fallbacks() == 0
            assert mine.counters.direct_loads - before == n
    finally:
        srv.stop()


def test_a_plain_client_is_named_no_frames(clients: tuple[RemoteStore, RemoteStore]) -> None:
    plain, _ = clients
    tokens, chunks = _on_disk(plain, 2)
    lk = _lookup(plain, tokens)
    assert lk.frames == ()
    outs = _shared(plain)
    assert plain.load(lk, outs).loaded == CHUNKS
    assert np.array_equal(outs[2].view(np.uint16), chunks[2].view(np.uint16))
    assert plain.counters.direct_loads == 0


def test_buffers_o_direct_cannot_fill_go_through_the_server(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 3)
    lk = _lookup(mine, tokens)
    room = np.empty(CHUNKS * LAYOUT.chunk_nbytes + 4096 + 2, np.uint8)
    at = (-room.ctypes.data) % 4096 + 2  # two bytes off a page
    outs = [
        room[at + i * LAYOUT.chunk_nbytes : at + (i + 1) * LAYOUT.chunk_nbytes]
        .view(np.float16)
        .reshape(LAYOUT.chunk_shape)
        for i in range(CHUNKS)
    ]
    strided = [  # aligned, but every other element: not one run of bytes
        aligned_empty(2 * LAYOUT.chunk_nbytes).view(np.float16)[::2].reshape(LAYOUT.chunk_shape)
        for _ in range(CHUNKS)
    ]
    assert not strided[0].flags.c_contiguous
    for bufs in (outs, strided):
        res = mine.load(lk, bufs)
        assert res.loaded == CHUNKS
        for got, want in zip(bufs, chunks, strict=True):
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert mine.counters.direct_loads == 0  # the server read them
    assert mine.direct_fallbacks() == 0  # not a direct load that fell back: none was tried


def _flip(path: str, at: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), at)
        os.fsync(fd)
    finally:
        os.close(fd)


@BUFS
def test_a_frame_corrupted_on_disk_is_never_kept_and_the_server_counts_it(
    clients: tuple[RemoteStore, RemoteStore],
    bufs: str,
) -> None:
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 4)
    lk = _lookup(mine, tokens)
    f = lk.frames[1]
    assert f is not None
    _flip(f.path, f.off + HEADER_BYTES + 100)  # a payload byte of chunk 1
    res = mine.load(lk, _outs(mine, bufs))
    assert res.loaded == 1  # chunk 0 read here; chunk 1 failed here and at the server
    assert np.array_equal(res.arrays[0].view(np.uint16), chunks[0].view(np.uint16))
    assert res.corrupt == [lk.hits[1].key]
    assert mine.direct_fallbacks() == CHUNKS - 1
    c = mine.counters
    assert c.direct_loads == 1 and c.corrupt == 1  # chunk 0 kept; chunk 1 caught twice


@BUFS
def test_an_invalidation_between_lookup_and_load_is_a_miss(
    clients: tuple[RemoteStore, RemoteStore],
    bufs: str,
) -> None:
    plain, mine = clients
    tokens, _ = _on_disk(plain, 5)
    lk = _lookup(mine, tokens)
    assert plain.invalidate(namespace=PUBLIC) == CHUNKS
    res = mine.load(lk, _outs(mine, bufs))
    assert res.loaded == 0 and res.arrays == []
    assert mine.counters.direct_loads == 0


@BUFS
def test_a_chunk_rewritten_elsewhere_since_the_lookup_is_loaded_from_where_it_is_now(
    clients: tuple[RemoteStore, RemoteStore],
    bufs: str,
) -> None:
    """The frames the lookup named still verify (their bytes are on the disk), but the
    chunks live in other frames now: the server confirms none, and the load takes them
    from where they are."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 6)
    lk = _lookup(mine, tokens)
    plain.invalidate(namespace=PUBLIC)
    _on_disk(plain, 6)  # the same chunks again, in new frames
    fresh = _lookup(mine, tokens)
    old = [(f.seg, f.off) for f in lk.frames if f is not None]
    assert [(f.seg, f.off) for f in fresh.frames if f is not None] != old
    res = mine.load(lk, _outs(mine, bufs))
    assert res.loaded == CHUNKS
    for got, want in zip(res.arrays, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert mine.direct_fallbacks() == CHUNKS
    assert mine.counters.direct_loads == 0


def test_a_segment_file_gone_since_the_lookup_goes_through_the_server(
    clients: tuple[RemoteStore, RemoteStore], tmp_path: Path
) -> None:
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 7)
    lk = _lookup(mine, tokens)
    f = lk.frames[0]
    assert f is not None
    moved = tmp_path / "elsewhere"
    os.rename(f.path, moved)  # as if compaction had removed it (the server keeps its fd)
    try:
        res = mine.load(lk, _shared(mine))
    finally:
        os.rename(moved, f.path)
    assert res.loaded == CHUNKS  # the server still reads it through its open file
    for got, want in zip(res.arrays, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert mine.direct_fallbacks() == CHUNKS
    assert mine.counters.direct_loads == 0
    # one file gone, its folder here: direct reads stay on, the next lookup names frames
    assert mine.direct_reads_off() is None
    assert all(f is not None for f in _lookup(mine, tokens).frames)


def test_unreachable_tells_a_segment_folder_out_of_reach_from_a_file_gone(tmp_path: Path) -> None:
    """What turns a client's direct reads off (the server's files out of this process's
    reach) and what does not (one segment compacted away since the lookup)."""
    segs = tmp_path / "segments"
    segs.mkdir()
    (segs / "00000001.seg").write_bytes(b"x" * 4096)
    os.symlink(segs / "00000001.seg", segs / "00000002.seg")
    os.mkfifo(segs / "00000003.seg")
    (segs / "00000004.seg").mkdir()
    (tmp_path / "a-file").write_bytes(b"")
    assert unreachable(str(segs / "00000001.seg")) is None  # opens now
    assert unreachable(str(segs / "00000009.seg")) is None  # gone: compacted
    for name in ("00000002.seg", "00000003.seg", "00000004.seg"):  # a link, a FIFO, a folder
        why = unreachable(str(segs / name))
        assert why is not None and name in why, why
    for folder in (tmp_path / "elsewhere" / "segments", tmp_path / "a-file"):
        why = unreachable(str(folder / "00000001.seg"))
        assert why is not None and str(folder) in why, why
    # a process out of descriptors for a moment: that says nothing of where files are
    code = (
        "import os, resource, sys\n"
        "from kvlife.client.direct import unreachable\n"
        "n = len(os.listdir('/proc/self/fd'))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n - 1, n - 1))\n"
        "try:\n"
        "    os.open(sys.argv[1], os.O_RDONLY)\n"
        "    print('opened')\n"
        "except OSError as exc:\n"
        "    print(exc.errno, unreachable(sys.argv[1]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(segs / "00000001.seg")],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    assert out == [str(errno.EMFILE), "None"], out


@OUT_OF_REACH
@BUFS
def test_segment_files_out_of_reach_turn_direct_reads_off(tmp_path: Path, bufs: str) -> None:
    """The server in its own mount namespace (a worker in a container without its
    volume): the first direct load opens no segment file here and goes through the
    server, exact; the client then stops asking for frames and says why, so later
    lookups name none and their loads take no refused start (measured before: 2.1-2.3
    ms more per lookup and load of 16 x 256 KiB or 4 x 2 MiB disk hits than a plain
    client's; docs/server.md, "Direct disk reads")."""
    srv = out_of_reach_server(tmp_path / "store")
    try:
        with client_pair(srv) as (plain, mine):
            tokens, chunks = _on_disk(plain, 31)
            before = plain.counters
            for k in range(3):
                lk = _lookup(mine, tokens)
                # the first lookup names frames (the server cannot know); none after it
                assert all(f is not None for f in lk.frames) if k == 0 else not lk.frames
                res = mine.load(lk, _outs(mine, bufs))
                assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}
                for got, want in zip(res.arrays, chunks, strict=True):
                    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
                    assert got.flags.writeable == (bufs == "shared")
                assert mine.direct_fallbacks() == CHUNKS  # the first load's, no more
            why = mine.direct_reads_off()
            assert why is not None and str(tmp_path / "store") in why, why
            after = mine.counters
            assert after.direct_loads == before.direct_loads
            assert after.loads - before.loads == 3
            # a plain client of the same server is not touched; a new direct one starts on
            assert plain.direct_reads_off() is None
            fresh = RemoteStore(srv.socket, timeout=30, direct_reads=True)
            try:
                assert all(f is not None for f in _lookup(fresh, tokens).frames)
            finally:
                fresh.close()
    finally:
        srv.stop()


def _header(key: bytes) -> bytes:
    buf = bytearray(HEADER_BYTES)
    pack_header(
        FrameHeader(key, 8192, b"c" * 16, "float16", (2, 2, 4, 32, 8), "exact"), memoryview(buf)
    )
    return bytes(buf[:HEADER_USED])


def test_lookup_frames_are_checked_before_one_is_kept() -> None:
    key, other = b"k" * 32, b"o" * 32
    good = ["/seg/1", 1, 4096, _header(key)]
    (frame,) = parse_frames([good], [key])
    assert frame is not None and frame.nbytes == 8192 and frame.checksum == b"c" * 16
    assert parse_frames([None], [key]) == (None,)
    bad_header = bytearray(_header(key))
    bad_header[30] ^= 1
    for value in (
        [["/seg/1", 1, 4096, _header(other)]],  # another chunk's frame
        [["seg/1", 1, 4096, _header(key)]],  # a relative path
        [["/seg/1", 1, 4097, _header(key)]],  # an offset O_DIRECT cannot read at
        [["/seg/1", -1, 4096, _header(key)]],
        [["/seg/1", 1, 4096, bytes(bad_header)]],  # a header that fails its checksum
        [good, good],  # not one per hit
        "frames",
    ):
        with pytest.raises(ProtocolError):
            parse_frames(value, [key])


def _nested(inner: st.SearchStrategy[object]) -> st.SearchStrategy[list[object]]:
    return st.lists(inner, max_size=5)


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.binary(max_size=300) | st.text(max_size=20),
    _nested,
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=_values, hits=st.integers(0, 3))
def test_any_frames_value_is_parsed_or_refused_as_a_protocol_error(
    value: object, hits: int
) -> None:
    keys = [bytes([i]) * 32 for i in range(hits)]
    try:
        frames = parse_frames(value, keys)
    except ProtocolError:
        return
    assert len(frames) == hits


def test_a_server_with_principals_names_no_frames(tmp_path: Path) -> None:
    """Its segment files hold every tenant's frames: its clients load through it."""
    config = write_config(tmp_path / "tenants.toml")
    srv = ServerProc(
        tmp_path / "store",
        dram=4 * MiB,
        extra=("--tenants", str(config), "--write-through", "--no-promote"),
    ).start()
    try:
        alice = RemoteStore(srv.socket, timeout=30, token=TOKENS["alice"], direct_reads=True)
        root = as_(srv, "root")
        try:
            tokens, kv = prompt_kv(8, CHUNKS * N, LAYOUT)
            alice.put_prompt(_identity(), USER["alice"], tokens, kv)
            root.flush()
            root.evict("dram", 1 << 40)
            lk = alice.lookup(_identity(), USER["alice"], tokens)
            assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
            assert lk.frames == ()
            res = alice.load(lk, _aligned())
            assert res.loaded == CHUNKS
            want = kv[:, :, :, N : 2 * N, :]
            assert np.array_equal(res.arrays[1].view(np.uint16), want.view(np.uint16))
            assert root.counters.direct_loads == 0
        finally:
            alice.close()
            root.close()
    finally:
        srv.stop()


def test_a_word_of_kept_chunks_counts_no_more_than_the_server_confirmed(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    tokens, _ = _on_disk(plain, 9)
    wire = mine._wire
    # told of no direct load: nothing counted, no reply (the next call still pairs up)
    wire.call_on("info", {}, None, lambda conn: conn.sock.sendall(_kept(10**6)))
    assert mine.counters.direct_loads == 0
    lk = _lookup(mine, tokens)
    frames = [f for f in lk.frames if f is not None]
    args = {
        "keys": b"".join(h.key for h in lk.hits),
        "starts": [h.start for h in lk.hits],
        "chunks_total": lk.chunks_total,
        # the last chunk named at another offset: two confirmed
        "direct": [x for f in frames[:-1] for x in (f.seg, f.off)] + [frames[-1].seg, 0],
    }
    r, _ = wire.call_on("load", args, None, lambda conn: conn.sock.sendall(_kept(CHUNKS)))
    assert r == {"confirmed": CHUNKS - 1}
    assert mine.counters.direct_loads == CHUNKS - 1  # not the three the client claimed
    wire.call_on("info", {}, None, lambda conn: conn.sock.sendall(_kept(CHUNKS)))
    assert mine.counters.direct_loads == CHUNKS - 1  # told twice: counted once


def _kept(n: int) -> bytes:
    return protocol.pack([0, "direct_kept", {"chunks": n}])


def test_a_lookup_whose_frames_were_swapped_after_it_came_never_yields_another_chunks_bytes(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """Hit 1 named by hit 0's whole frame (path, offset and header): the read verifies
    (it is a good frame), but the server confirms no chunk in a frame that is not its
    own, and the load takes chunk 1 from where it is."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 10)
    lk = _lookup(mine, tokens)
    swapped = dataclasses.replace(lk, frames=(lk.frames[0], lk.frames[0], lk.frames[2]))
    res = mine.load(swapped, _shared(mine))
    assert res.loaded == CHUNKS
    for got, want in zip(res.arrays, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert mine.direct_fallbacks() == CHUNKS - 1
    assert mine.counters.direct_loads == 1


@pytest.mark.parametrize("asked", [None, True, False])
def test_the_vllm_connectors_store_reads_directly_unless_told_not_to(
    clients: tuple[RemoteStore, RemoteStore], srv: ServerProc, asked: bool | None
) -> None:
    """The store a vLLM connector opens on ``kvlife.socket`` asks for frames and reads
    its disk hits itself by default (into arrays of its own, the worker's loads having
    no buffers); ``kvlife.direct_reads: false`` loads them through the server."""
    from kvlife.engines.vllm.stores import StoreAddress, open_store

    plain, _ = clients
    tokens, chunks = _on_disk(plain, 41)
    extra: dict[str, object] = {"kvlife.socket": str(srv.socket)}
    if asked is not None:
        extra["kvlife.direct_reads"] = asked
    lease = open_store(StoreAddress.from_extra_config(extra))
    try:
        store = lease.store
        lk = store.lookup(_identity(), PUBLIC, tokens)
        before = store.counters.direct_loads
        res = store.load(lk, None)
        assert res.loaded == CHUNKS
        for got, want in zip(res.arrays, chunks, strict=True):
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        direct = asked is not False
        assert isinstance(lk, RemoteLookup) and bool(lk.frames) == direct
        # counted when the server reads the word after the reply: the same session's
        # next request is answered after it (another session's may not be)
        assert store.counters.direct_loads - before == (CHUNKS if direct else 0)
    finally:
        lease.release()
