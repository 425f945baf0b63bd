"""Red team of direct disk reads (issue 28): a client made with ``direct_reads`` reads
its disk hits' frames from the server's segment files itself, verified, while the
server confirms them live (kvlife.client.direct, kvlife.store.direct,
kvlife.server.loads). Real servers, real segment files, real sockets: frames mutated to
point elsewhere (another chunk's frame, /dev/zero, a FIFO, a directory, a symlink, a
copy), raw requests with malformed ``direct`` lists and ``direct_kept`` words,
invalidations racing the load, rewrites of the same prompt with other bytes,
compaction, eviction and a server restart between the lookup and the load, buffers the
direct path must not take, and a server with principals. The promise: never a wrong
byte kept, never a hang, never a crashed server, every chunk counted once."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client.connection import Connection
from kvlife.client.direct import Frame
from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import InvalidArgument, KVLifeError, StoreUnavailable
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind, token_bytes
from kvlife.server import protocol
from kvlife.tiers.disk.frame import HEADER_BYTES
from kvlife.transforms.contract import Accept
from tests.conftest import prompt_kv
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import client_pair, disk_server
from tests.server.tenants import TOKENS, USER, as_, write_config

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_chunk=32)
"""8 KiB chunks: a whole number of pages, as O_DIRECT reads them."""
N = LAYOUT.tokens_per_chunk
CHUNKS = 3
KiB = 1 << 10
HANG_S = 5.0
"""How long a load may take before it counts as hung."""


def _identity() -> ModelIdentity:
    return ModelIdentity(
        layout=LAYOUT, model_id="direct-attack", weights_digest="w0", tokenizer_digest="t0"
    )


def _ns(tag: str) -> Namespace:
    """A namespace of the test's own: invalidating it touches no other test's chunks."""
    return Namespace(NamespaceKind.ORGANISATION, f"attack-{tag}")


def _start(
    path: Path, disk: int = 64 * MiB, extra: tuple[str, ...] = (), dram: int = 4 * MiB
) -> ServerProc:
    return disk_server(path, dram=dram, disk=disk, extra=extra)


@pytest.fixture(scope="module")
def shared_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for the attacks that touch only their own namespace."""
    server = _start(tmp_path_factory.mktemp("direct-attack") / "store", dram=16 * MiB)
    yield server
    server.stop()


@pytest.fixture
def clients(shared_srv: ServerProc) -> Iterator[tuple[RemoteStore, RemoteStore]]:
    """(a plain client, a client with direct reads) of the shared server."""
    with client_pair(shared_srv) as pair:
        yield pair
    assert shared_srv.alive()


def _chunks(kv: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]) for i in range(CHUNKS)]


def _put_on_disk(
    plain: RemoteStore, ns: Namespace, seed: int, tokens: np.ndarray | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """A prompt of CHUNKS chunks put, flushed and evicted from DRAM (``tokens``: these
    tokens with the seed's KV, i.e. the same chunk keys with other bytes)."""
    t, kv = prompt_kv(seed, CHUNKS * N, LAYOUT)
    if tokens is not None:
        t = tokens
    res = plain.put_prompt(_identity(), ns, t, kv)
    assert res.stored == CHUNKS
    plain.flush()
    plain.evict("dram", 1 << 40)
    return t, _chunks(kv)


def _lookup(store: RemoteStore, ns: Namespace, tokens: np.ndarray) -> RemoteLookup:
    lk = store.lookup(_identity(), ns, tokens)
    assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
    return lk


def _aligned(n: int = CHUNKS) -> list[np.ndarray]:
    """Page-aligned buffers of the process's own memory, one per chunk, filled with a
    pattern no chunk holds (a byte left from here is never taken for KV)."""
    out = []
    for _ in range(n):
        room = np.empty(LAYOUT.chunk_nbytes + 4096, np.uint8)
        at = (-room.ctypes.data) % 4096
        buf = room[at : at + LAYOUT.chunk_nbytes].view(np.float16).reshape(LAYOUT.chunk_shape)
        buf.view(np.uint16)[...] = 0x7E01  # a NaN pattern
        out.append(buf)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def _check_prefix(arrays: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Every chunk handed out holds exactly the bytes its position was put with."""
    assert len(arrays) <= len(want)
    for i, got in enumerate(arrays):
        assert _same(got, want[i]), f"chunk {i} holds wrong bytes"


def _frames(lk: RemoteLookup) -> list[Frame]:
    out = [f for f in lk.frames if f is not None]
    assert len(out) == CHUNKS
    return out


def _with_frames(lk: RemoteLookup, frames: list[Frame]) -> RemoteLookup:
    return dataclasses.replace(lk, frames=tuple(frames))


def _kept(n: object) -> bytes:
    return protocol.pack([0, "direct_kept", {"chunks": n}])


def _send(*frames: bytes) -> Callable[[Connection], None]:
    def after(conn: Connection) -> None:
        conn.sock.sendall(b"".join(frames))

    return after


def _direct_args(lk: RemoteLookup, where: list[int] | None = None) -> dict[str, Any]:
    return {
        "keys": b"".join(h.key for h in lk.hits),
        "starts": [h.start for h in lk.hits],
        "chunks_total": lk.chunks_total,
        "direct": [x for f in _frames(lk) for x in (f.seg, f.off)] if where is None else where,
    }


def _events(store: RemoteStore) -> tuple[int, int]:
    st = store.server_state()
    return int(st["unreplied_errors"]), int(st["internal_errors"])


# --------------------------------------------------------------------------- frames


def _mutations(tmp: Path, fs: list[Frame]) -> dict[str, tuple[list[Frame], int]]:
    """Frames that name somewhere else than where the chunk is, each with how many
    leading chunks are kept from this client's read (verified here and confirmed
    there; the rest go through the server): a frame that verifies against its header
    holds that key's bytes."""
    f0, f1, f2 = fs
    zero = "/dev/zero"
    directory = tmp / "a-directory"
    directory.mkdir()
    link = tmp / "a-link"
    link.symlink_to(f1.path)
    copy = tmp / "a-copy"
    shutil.copyfile(f1.path, copy)
    torn = tmp / "a-torn-copy"
    with open(f1.path, "rb") as src, open(torn, "wb") as dst:
        dst.write(src.read(f1.off + HEADER_BYTES + 100))
    r = dataclasses.replace
    return {
        # chunk 1 named at chunk 2's frame with its own header: not chunk 1's bytes
        "other-chunk's-offset": ([f0, r(f1, seg=f2.seg, off=f2.off), f2], 1),
        # whole frames swapped: each verifies, but not as the hit it is named for
        "swapped-frames": ([f1, f0, f2], 0),
        "dev-zero": ([f0, r(f1, path=zero), f2], 1),
        "a-directory": ([f0, r(f1, path=str(directory)), f2], 1),
        "a-symlink": ([f0, r(f1, path=str(link)), f2], 1),
        "missing-file": ([f0, r(f1, path=str(tmp / "nothing-here")), f2], 1),
        "offset-past-the-end": ([f0, r(f1, off=f1.off + (1 << 30)), f2], 1),
        "offset-one-page-on": ([f0, r(f1, off=f1.off + 4096), f2], 1),
        "torn-copy": ([f0, r(f1, path=str(torn)), f2], 1),
        # a byte-identical copy elsewhere: its bytes are chunk 1's, rightly kept
        "a-copy": ([f0, r(f1, path=str(copy)), f2], 3),
        # a path no file system takes: the client's own read fails, not the load
        "nul-in-path": ([f0, r(f1, path=f1.path + "\x00x"), f2], 1),
    }


MUTATIONS = [
    "other-chunk's-offset",
    "swapped-frames",
    "dev-zero",
    "a-directory",
    "a-symlink",
    "missing-file",
    "offset-past-the-end",
    "offset-one-page-on",
    "torn-copy",
    "a-copy",
    "nul-in-path",
]


@pytest.mark.parametrize("how", MUTATIONS)
def test_frames_mutated_to_name_anything_else_never_keep_wrong_bytes(
    clients: tuple[RemoteStore, RemoteStore], tmp_path: Path, how: str
) -> None:
    # Found by this red team, mended: kvlife/client/direct.py _open/read_frames caught
    # only OSError; os.open raises ValueError for a path holding a NUL byte, which escapes
    # read_frames, so the load raises instead of going through the server (and the
    # direct_kept word is never sent: the server keeps the confirmation pending).
    plain, mine = clients
    ns = _ns(f"mut-{how}")
    tokens, chunks = _put_on_disk(plain, ns, 100 + MUTATIONS.index(how))
    lk = _lookup(mine, ns, tokens)
    frames, most = _mutations(tmp_path, _frames(lk))[how]
    before = mine.counters
    fallbacks = mine.direct_fallbacks()
    outs = _aligned()
    res = mine.load(_with_frames(lk, frames), outs)
    # every chunk still loads (the rest through the server), each with its own bytes
    assert res.loaded == CHUNKS and res.corrupt == [] and res.tiers == {"disk": CHUNKS}
    _check_prefix(res.arrays, chunks)
    _check_prefix(outs, chunks)
    after = mine.counters
    kept = after.direct_loads - before.direct_loads
    assert kept == most
    assert mine.direct_fallbacks() - fallbacks == CHUNKS - kept
    assert after.tier("disk").loaded - before.tier("disk").loaded == CHUNKS  # each once
    assert after.corrupt == before.corrupt  # nothing on the disk was wrong
    # the session is in step: a fresh lookup's load without buffers (read directly
    # into new arrays since 2026-12-07) pairs up and counts its own chunks, no more
    more = mine.direct_fallbacks()
    again = mine.load(mine.lookup(_identity(), ns, tokens), None)
    assert again.loaded == CHUNKS
    _check_prefix(again.arrays, chunks)
    assert mine.counters.direct_loads == after.direct_loads + CHUNKS
    assert mine.direct_fallbacks() == more


def test_a_frame_named_at_a_fifo_does_not_hang_the_load(
    clients: tuple[RemoteStore, RemoteStore], tmp_path: Path
) -> None:
    """A FIFO opened for reading blocks until a writer comes (O_NONBLOCK aside): a frame
    path the client opens must not wait forever on one."""
    # Found by this red team, mended: kvlife/client/direct.py _open opened the path
    # O_RDONLY without O_NONBLOCK (and read_frames checked no S_ISREG before): open(2)
    # of a FIFO blocks until a writer opens it, so the load (and the RemoteStore's wire lock) hangs.
    plain, mine = clients
    ns = _ns("fifo")
    tokens, chunks = _put_on_disk(plain, ns, 200)
    lk = _lookup(mine, ns, tokens)
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    f0, f1, f2 = _frames(lk)
    bad = _with_frames(lk, [f0, dataclasses.replace(f1, path=str(fifo)), f2])
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["res"] = mine.load(bad, _aligned())
        except BaseException as exc:  # reported below
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    hung = t.is_alive()
    if hung:  # a writer lets the blocked open return (and the test end)
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            t.join(30)
        finally:
            os.close(fd)
    assert not hung, f"a load with a frame at a FIFO hung for {HANG_S} s"
    assert "exc" not in box, box.get("exc")
    res = box["res"]
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, chunks)


def test_frame_fields_that_disagree_with_the_file_are_not_taken(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """A frame whose checksum field is not its payload's, or whose header is not the
    one on the disk: the header read must match byte for byte, the payload the
    checksum."""
    plain, mine = clients
    ns = _ns("fields")
    tokens, chunks = _put_on_disk(plain, ns, 210)
    lk = _lookup(mine, ns, tokens)
    f0, f1, f2 = _frames(lk)
    before = mine.counters.direct_loads
    bad = _with_frames(lk, [f0, dataclasses.replace(f1, checksum=bytes(16)), f2])
    res = mine.load(bad, _aligned())
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, chunks)
    assert mine.counters.direct_loads - before == 1
    h = bytearray(f1.header)
    h[-1] ^= 1
    bad = _with_frames(lk, [f0, dataclasses.replace(f1, header=bytes(h)), f2])
    res = mine.load(bad, _aligned())
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, chunks)
    assert mine.counters.direct_loads - before == 2


# --------------------------------------------------------------------------- raw wire


def test_malformed_direct_lists_are_typed_errors_and_count_nothing(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("malformed")
    tokens, _ = _put_on_disk(plain, ns, 300)
    lk = _lookup(mine, ns, tokens)
    wire = mine._wire
    fs = _frames(lk)
    good = [x for f in fs for x in (f.seg, f.off)]
    before = mine.counters
    _, internal = _events(mine)
    bad: list[object] = [
        good[:-1],  # odd
        good[:2],  # fewer than one per key
        good + good[:2],  # more
        [-1, 0] * CHUNKS,
        [2**64 - 1, 0] * CHUNKS,
        [2**63, 0] * CHUNKS,
        ["1", 0] * CHUNKS,
        [1.0, 0] * CHUNKS,
        [True, 0] * CHUNKS,
        [None, 0] * CHUNKS,
        [[1], 0] * CHUNKS,
        {"seg": 1},
        None,
        b"\x00" * 16,
        "direct",
    ]
    for where in bad:
        args = _direct_args(lk, [])
        args["direct"] = where
        with pytest.raises(KVLifeError):
            wire.call_on("load", args)
    # well formed but naming nothing live: confirmed none, counted none
    for where in ([2**63 - 1, 2**63 - 1] * CHUNKS, [0, 0] * CHUNKS, good[2:4] * CHUNKS):
        r, _ = wire.call_on("load", _direct_args(lk, where), None, _send(_kept(CHUNKS)))
        assert r == {"confirmed": 0}
    # keys of no chunk at all
    r, _ = wire.call_on(
        "load",
        {
            "keys": b"\x01" * 32 * CHUNKS,
            "starts": [0, N, 2 * N],
            "chunks_total": CHUNKS,
            "direct": good,
        },
        None,
        _send(_kept(CHUNKS)),
    )
    assert r == {"confirmed": 0}
    # no keys, no frames
    r, _ = wire.call_on(
        "load",
        {"keys": b"", "starts": [], "chunks_total": 0, "direct": []},
        None,
        _send(_kept(0)),
    )
    assert r == {"confirmed": 0}
    after = mine.counters
    assert after.direct_loads == before.direct_loads
    assert after.tier("disk").loaded == before.tier("disk").loaded
    assert _events(mine)[1] == internal  # no handler failed
    # lookup options of the wrong type are refused, not taken as True
    args = {
        "identity": protocol.encode_identity(_identity()),
        "namespace": str(ns),
        "tokens": token_bytes(tokens),
    }
    for value in (1, "yes", None, [True]):
        with pytest.raises(KVLifeError):
            wire.call_on("lookup", {**args, "opts": {"direct": value}})
    r, _ = wire.call_on("lookup", {**args, "opts": {"direct": False}})
    assert "frames" not in r and len(r["tiers"]) == CHUNKS
    assert mine.counters.direct_loads == before.direct_loads
    assert _events(mine)[1] == internal


def test_malformed_direct_kept_words_are_ignored_and_counted_as_unreplied(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("kept")
    tokens, _ = _put_on_disk(plain, ns, 310)
    lk = _lookup(mine, ns, tokens)
    wire = mine._wire
    before = mine.counters
    unreplied, internal = _events(mine)
    words = [
        _kept(-1),
        _kept(1 << 22),
        _kept(2**64 - 1),
        _kept("3"),
        _kept(None),
        _kept(3.0),
        _kept(True),
        protocol.pack([0, "direct_kept", {}]),
        protocol.pack([0, "direct_kept", {"chunks": 1, "more": 2}]),
        protocol.pack([0, "direct_kept", [3]]),
    ]
    # each one alone, with no direct load before it
    for w in words:
        wire.call_on("info", {}, None, _send(w))
    # and each one as the word that follows a direct load (all confirmed)
    for w in words:
        r, _ = wire.call_on("load", _direct_args(lk), None, _send(w))
        assert r == {"confirmed": CHUNKS}
    # the session is still in step and the server alive
    assert mine.lookup(_identity(), ns, tokens).tiers() == {"disk": CHUNKS}
    u2, i2 = _events(mine)
    assert i2 == internal
    assert u2 - unreplied == 2 * len(words)  # each refused, none answered
    after = mine.counters
    assert after.direct_loads == before.direct_loads


def test_direct_kept_asking_for_a_reply_is_answered_and_counts_once(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("kept-reply")
    tokens, _ = _put_on_disk(plain, ns, 320)
    lk = _lookup(mine, ns, tokens)
    wire = mine._wire
    before = mine.counters.direct_loads
    r, _ = wire.call_on("load", _direct_args(lk))
    assert r == {"confirmed": CHUNKS}
    assert wire.call("direct_kept", {"chunks": 2}) is None
    assert mine.counters.direct_loads - before == 2
    assert wire.call("direct_kept", {"chunks": 2}) is None  # twice: once
    assert mine.counters.direct_loads - before == 2


def test_a_word_of_kept_chunks_on_another_session_counts_nothing(
    clients: tuple[RemoteStore, RemoteStore], shared_srv: ServerProc
) -> None:
    plain, mine = clients
    ns = _ns("other-session")
    tokens, _ = _put_on_disk(plain, ns, 330)
    lk = _lookup(mine, ns, tokens)
    before = mine.counters.direct_loads
    r, _ = mine._wire.call_on("load", _direct_args(lk))  # confirmed, no word yet
    assert r == {"confirmed": CHUNKS}
    other = RemoteStore(shared_srv.socket, timeout=30, direct_reads=True)
    try:
        other._wire.call_on("info", {}, None, _send(_kept(CHUNKS)))
        assert other.counters.direct_loads == before
    finally:
        other.close()
    # the word on its own session still counts its own load, once
    mine._wire.call_on("info", {}, None, _send(_kept(1)))
    assert mine.counters.direct_loads - before == 1


def test_a_word_after_a_refused_direct_load_counts_nothing(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """The word follows the direct load it is about. A direct load the server refused
    confirmed nothing, so the word after it counts nothing: not the chunks an earlier
    load confirmed whose client never said what it kept (its read failed)."""
    # Found by this red team, mended (every load now clears it): kvlife/server/loads.py
    # Loads._confirm_direct/direct_kept: self.confirmed was only replaced by a direct
    # load that got as far as confirming, never cleared by a refused one (load_keys or
    # the length check raise first) nor by any other
    # request; a later direct_kept then counts the stale confirmation (direct_loads,
    # tier loaded, LOAD moves) for chunks no client said it kept.
    plain, mine = clients
    ns = _ns("refused")
    tokens, _ = _put_on_disk(plain, ns, 340)
    lk = _lookup(mine, ns, tokens)
    wire = mine._wire
    before = mine.counters
    r, _ = wire.call_on("load", _direct_args(lk))  # its word never comes
    assert r == {"confirmed": CHUNKS}
    odd = _direct_args(lk)
    odd["direct"] = odd["direct"][:-1]
    with pytest.raises(KVLifeError):
        wire.call_on("load", odd, None, _send(_kept(CHUNKS)))
    after = mine.counters
    assert after.direct_loads - before.direct_loads == 0
    assert after.tier("disk").loaded - before.tier("disk").loaded == 0


# --------------------------------------------------------------------------- races


def test_a_rewrite_with_other_bytes_between_lookup_and_load_serves_the_new_bytes(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """Same tokens, same keys, other KV (a recomputation): the lookup's frames still
    verify (the old frames are on the disk, in the active segment), but they are not
    the chunks' frames any more; the old bytes are never kept."""
    plain, mine = clients
    ns = _ns("rewrite")
    tokens, old = _put_on_disk(plain, ns, 400)
    lk = _lookup(mine, ns, tokens)
    assert plain.invalidate(namespace=ns) == CHUNKS
    _, new = _put_on_disk(plain, ns, 401, tokens=tokens)
    assert not any(_same(a, b) for a, b in zip(old, new, strict=True))
    before = mine.counters.direct_loads
    res = mine.load(lk, _aligned())
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, new)
    assert mine.counters.direct_loads == before


def test_a_client_that_read_before_an_invalidation_is_confirmed_nothing_after_it(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """The read and the confirmation are concurrent: here the read comes first, then
    the invalidation and a rewrite with other bytes, then the server handles the load
    (a busy server). The frames read verify, but the server confirms none of them."""
    from kvlife.client.direct import read_frames

    plain, mine = clients
    ns = _ns("read-first")
    tokens, old = _put_on_disk(plain, ns, 410)
    lk = _lookup(mine, ns, tokens)
    outs = _aligned()
    assert read_frames(_frames(lk), outs) == CHUNKS
    _check_prefix(outs, old)
    assert plain.invalidate(namespace=ns) == CHUNKS
    _put_on_disk(plain, ns, 411, tokens=tokens)
    before = mine.counters.direct_loads
    r, _ = mine._wire.call_on("load", _direct_args(lk), None, _send(_kept(CHUNKS)))
    assert r == {"confirmed": 0}
    assert mine.counters.direct_loads == before


class _Churn(threading.Thread):
    """Invalidates a namespace, says so, then puts the prompt again with other bytes."""

    def __init__(self, writer: RemoteStore, ns: Namespace, tokens: np.ndarray, seed: int):
        super().__init__(daemon=True)
        self.writer, self.ns, self.tokens, self.seed = writer, ns, tokens, seed
        self.invalidated = threading.Event()
        self.new: list[np.ndarray] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            time.sleep(0.0005 * (self.seed % 4))
            self.writer.invalidate(namespace=self.ns)
            self.invalidated.set()
            self.new = _put_on_disk(self.writer, self.ns, self.seed, tokens=self.tokens)[1]
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_invalidations_racing_direct_loads_never_serve_the_invalidated_bytes(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """Another thread invalidates the prompt and puts it again with other bytes while
    direct loads run. A load that began after invalidate() returned never hands out the
    old bytes; any load hands out only bytes some version was put with, by position."""
    plain, mine = clients
    ns = _ns("race")
    writer = RemoteStore(plain._wire.socket_path, timeout=30)
    try:
        tokens, prev = _put_on_disk(plain, ns, 500)
        for it in range(12):
            lk = _lookup(mine, ns, tokens)
            churn = _Churn(writer, ns, tokens, 501 + it)
            churn.start()
            if it % 3 == 0:
                churn.invalidated.wait(10)
            after_inv = churn.invalidated.is_set()
            res = mine.load(lk, _aligned())
            churn.join(30)
            assert churn.error is None, churn.error
            for i, got in enumerate(res.arrays):
                if after_inv:
                    assert not _same(got, prev[i]), f"iteration {it}: invalidated chunk {i}"
                assert _same(got, prev[i]) or _same(got, churn.new[i]), f"iteration {it}: {i}"
            prev = churn.new
    finally:
        writer.close()


def test_a_chunk_invalidated_midway_keeps_only_the_chunks_before_it(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("midway")
    tokens, chunks = _put_on_disk(plain, ns, 520)
    lk = _lookup(mine, ns, tokens)
    before = mine.counters
    assert plain.invalidate(prefix=lk.hits[1].key) == CHUNKS - 1
    res = mine.load(lk, _aligned())
    assert res.loaded == 1
    _check_prefix(res.arrays, chunks)
    after = mine.counters
    assert after.direct_loads - before.direct_loads == 1


def test_an_async_direct_load_hands_out_right_bytes(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("async")
    tokens, chunks = _put_on_disk(plain, ns, 530)
    lk = _lookup(mine, ns, tokens)
    f0, f1, f2 = _frames(lk)
    for frames, kept in (
        ([f0, f1, f2], CHUNKS),
        ([f0, f1, dataclasses.replace(f2, path="/dev/zero")], 2),
    ):
        before = mine.counters.direct_loads
        handle = mine.load_async(_with_frames(lk, frames), _aligned())
        for i in range(CHUNKS):
            got = handle.chunk(i, timeout=30)
            assert got is not None and _same(got, chunks[i])
        res = handle.wait()
        assert res.loaded == CHUNKS
        assert mine.counters.direct_loads - before == kept


# --------------------------------------------------------------------------- buffers


def test_buffers_the_direct_path_must_not_take(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("buffers")
    tokens, chunks = _put_on_disk(plain, ns, 600)
    lk = _lookup(mine, ns, tokens)
    before = mine.counters.direct_loads
    # the same buffer three times, and overlapping slices: refused, nothing read
    one = _aligned(1)[0]
    with pytest.raises(InvalidArgument):
        mine.load(lk, [one, one, one])
    room = np.empty(CHUNKS * LAYOUT.chunk_nbytes + 8192, np.uint8)
    at = (-room.ctypes.data) % 4096
    half = LAYOUT.chunk_nbytes // 2
    overl = [
        room[at + i * half : at + i * half + LAYOUT.chunk_nbytes]
        .view(np.float16)
        .reshape(LAYOUT.chunk_shape)
        for i in range(CHUNKS)
    ]
    with pytest.raises(InvalidArgument):
        mine.load(lk, overl)
    # read-only: refused
    ro = _aligned()
    ro[1].flags.writeable = False
    with pytest.raises(InvalidArgument):
        mine.load(lk, ro)
    assert mine.counters.direct_loads == before
    # not C-contiguous (a transposed view of aligned memory): through the server
    tr = []
    for _ in range(CHUNKS):
        r = np.empty(LAYOUT.chunk_nbytes + 4096, np.uint8)
        a = (-r.ctypes.data) % 4096
        base = r[a : a + LAYOUT.chunk_nbytes].view(np.float16).reshape(LAYOUT.chunk_shape[::-1])
        tr.append(base.T)
    res = mine.load(lk, tr)
    assert res.loaded == CHUNKS
    for got, want in zip(tr, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # another dtype of the same size, or a flat shape: never filled with raw frame bytes
    for outs in (
        [b.view(np.uint16) for b in _aligned()],
        [b.reshape(-1) for b in _aligned()],
    ):
        try:
            res = mine.load(lk, outs)
        except KVLifeError:
            continue
        assert res.loaded == CHUNKS
        for got, want in zip(res.arrays, chunks, strict=True):
            assert np.array_equal(
                np.asarray(got, np.float64).reshape(-1),
                np.asarray(want, np.float64).reshape(-1),
                equal_nan=True,
            )
    assert mine.counters.direct_loads == before  # none of them read here


@pytest.mark.parametrize(
    ("layout", "direct"),
    [
        # 2 MiB chunks: frames padded so that each payload starts at 64 KiB
        (
            KVLayout(
                num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_chunk=64
            ),
            True,
        ),
        # chunks of no whole number of pages: O_DIRECT cannot fill them, the server does
        (
            KVLayout(
                num_layers=2, num_kv_heads=3, head_dim=6, dtype="float16", tokens_per_chunk=32
            ),
            False,
        ),
    ],
    ids=["padded-2MiB", "not-page-sized"],
)
def test_other_chunk_sizes_load_right_bytes(
    clients: tuple[RemoteStore, RemoteStore], layout: KVLayout, direct: bool
) -> None:
    plain, mine = clients
    ident = ModelIdentity(
        layout=layout, model_id="direct-sizes", weights_digest="w1", tokenizer_digest="t1"
    )
    ns = _ns(f"size-{layout.chunk_nbytes}")
    n = layout.tokens_per_chunk
    tokens, kv = prompt_kv(620, 2 * n, layout)
    assert plain.put_prompt(ident, ns, tokens, kv).stored == 2
    plain.flush()
    plain.evict("dram", 1 << 40)
    want = [np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :]) for i in range(2)]
    lk = mine.lookup(ident, ns, tokens)
    assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": 2}
    outs = []
    for _ in range(2):
        room = np.empty(layout.chunk_nbytes + 4096, np.uint8)
        at = (-room.ctypes.data) % 4096
        outs.append(
            room[at : at + layout.chunk_nbytes].view(np.float16).reshape(layout.chunk_shape)
        )
    before = mine.counters.direct_loads
    res = mine.load(lk, outs)
    assert res.loaded == 2
    for got, w in zip(res.arrays, want, strict=True):
        assert _same(got, w)
    assert mine.counters.direct_loads - before == (2 if direct else 0)


# --------------------------------------------------------------------------- servers


def _reconnect(store: RemoteStore) -> None:
    """The first call after the server went away fails (its connection is dead); the
    next one connects again."""
    with contextlib.suppress(StoreUnavailable):
        store.info()
    store.info()


def test_a_lookup_from_before_a_restart_onto_a_new_store_at_the_same_path(
    tmp_path: Path,
) -> None:
    """The server restarts on a fresh store at the same path and the same prompt is put
    with other bytes: the same segment file name, the same segment id and offsets, a
    frame of the same key. The old lookup's frames must not be trusted (another epoch);
    the load serves the new bytes."""
    path = tmp_path / "store"
    srv = _start(path)
    plain = srv.client()
    mine = RemoteStore(srv.socket, timeout=30, direct_reads=True)
    ns = _ns("restart")
    try:
        tokens, old = _put_on_disk(plain, ns, 700)
        lk = _lookup(mine, ns, tokens)
        # the server killed between the lookup and the load: a typed error, no hang
        srv.kill()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["res"] = mine.load(lk, _aligned())
            except BaseException as exc:  # checked below
                box["exc"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(HANG_S)
        assert not t.is_alive(), "a direct load to a killed server hung"
        assert isinstance(box.get("exc"), StoreUnavailable), box
        # a same-store restart: the frames are where they were; loaded through the new
        # server (another connection's lookup) with the right bytes
        srv.start()
        _reconnect(plain)
        res = mine.load(lk, _aligned())  # its connection was dropped: a new one
        assert res.loaded == CHUNKS
        _check_prefix(res.arrays, old)
        assert mine.counters.direct_loads == 0
        # a fresh store at the same path
        srv.stop()
        shutil.rmtree(path)
        srv.start()
        _reconnect(plain)
        _reconnect(mine)
        _, new = _put_on_disk(plain, ns, 701, tokens=tokens)
        fresh = _lookup(mine, ns, tokens)
        assert [(f.seg, f.off) for f in _frames(fresh)] == [(f.seg, f.off) for f in _frames(lk)]
        res = mine.load(lk, _aligned())
        assert res.loaded == CHUNKS
        _check_prefix(res.arrays, new)
        assert mine.counters.direct_loads == 0
        # a new client (its first connection: the same epoch number as the old lookup's)
        other = RemoteStore(srv.socket, timeout=30, direct_reads=True)
        try:
            res = other.load(lk, _aligned())
            assert res.loaded == CHUNKS
            _check_prefix(res.arrays, new)
        finally:
            other.close()
    finally:
        for c in (mine, plain):
            with contextlib.suppress(Exception):
                c.close()
        srv.stop()


def test_a_transforming_disk_tier_names_and_confirms_no_frames(tmp_path: Path) -> None:
    """int8 replicas on the disk: a frame of one is no exact chunk (it needs the
    store's decoder). None is named, and a guessed ``direct`` load is confirmed none."""
    srv = _start(tmp_path / "store", extra=("--disk-transform", "int8"))
    plain = srv.client()
    mine = RemoteStore(srv.socket, timeout=30, direct_reads=True)
    ns = _ns("int8")
    try:
        tokens, chunks = _put_on_disk(plain, ns, 850)
        lk = mine.lookup(_identity(), ns, tokens, accept=Accept.lossy())
        assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
        assert all(h.transform == "int8" for h in lk.hits)
        assert all(f is None for f in lk.frames)
        res = mine.load(lk, _aligned())
        assert res.loaded == CHUNKS
        for got, want in zip(res.arrays, chunks, strict=True):
            assert not _same(got, want)  # int8's bytes, decoded
            assert np.allclose(got, want, atol=0.1, rtol=0.1)
        confirmed = 0
        for h in lk.hits:
            for k in range(24):
                args = {
                    "keys": bytes(h.key),
                    "starts": [h.start],
                    "chunks_total": lk.chunks_total,
                    "direct": [1, k * 4096],
                }
                r, _ = mine._wire.call_on("load", args, None, _send(_kept(1)))
                confirmed += int(r["confirmed"])
        assert confirmed == 0
        assert mine.counters.direct_loads == 0
    finally:
        for c in (mine, plain):
            with contextlib.suppress(Exception):
                c.close()
        srv.stop()


def test_a_server_given_a_relative_store_path_names_frames_a_client_can_read(
    tmp_path: Path,
) -> None:
    """``kvlife serve store`` (a path relative to the server's working directory): the
    lookup's frames name files the client opens from its own working directory, so they
    must be absolute, and a direct-reads client's lookups and loads must work."""
    # Found by this red team, mended (DiskTier.segment_path is absolute): kvlife/store/
    # direct.py frame_hints named `str(tier.segment_path(row.seg))`,
    # and kvlife/tiers/disk/tier.py DiskTier keeps `Path(directory)` as given: the
    # server opened with a relative PATH (kvlife/ops/config/serve.py serve_config:
    # `path = Path(args.path)`, never resolved) names relative segment paths, which
    # kvlife/client/direct.py parse_frames refuses as ProtocolError: every lookup with
    # a disk hit from a direct-reads client fails.
    root = Path(__file__).resolve().parents[2]  # the server's working directory
    srv = ServerProc(
        Path(os.path.relpath(tmp_path / "store", root)),
        dram=4 * MiB,
        extra=("--write-through", "--no-promote"),
    )
    srv.socket = tmp_path / "store.sock"
    srv.pid_file = tmp_path / "store.pid"
    srv.log = tmp_path / "store.log"
    srv.start()
    plain = srv.client()
    mine = RemoteStore(srv.socket, timeout=30, direct_reads=True)
    ns = _ns("relative")
    try:
        tokens, chunks = _put_on_disk(plain, ns, 860)
        lk = _lookup(mine, ns, tokens)
        assert all(os.path.isabs(f.path) for f in _frames(lk))
        res = mine.load(lk, _aligned())
        assert res.loaded == CHUNKS
        _check_prefix(res.arrays, chunks)
        assert mine.counters.direct_loads == CHUNKS
    finally:
        for c in (mine, plain):
            with contextlib.suppress(Exception):
                c.close()
        srv.stop()


def test_eviction_and_compaction_between_lookup_and_load(tmp_path: Path) -> None:
    """A disk tier of a few frames: a put that does not fit compacts the segment the
    lookup's frames are in (copied to a new segment, the old one removed), then the
    whole tier is evicted. Never a wrong byte, never a chunk counted twice."""
    frame = HEADER_BYTES + LAYOUT.chunk_nbytes
    srv = _start(tmp_path / "store", disk=8 * frame)
    plain = srv.client()
    mine = RemoteStore(srv.socket, timeout=30, direct_reads=True)
    a, b, c = _ns("a"), _ns("b"), _ns("c")
    try:
        tokens, chunks = _put_on_disk(plain, a, 800)
        lk = _lookup(mine, a, tokens)
        _put_on_disk(plain, b, 801)
        assert plain.invalidate(namespace=b) == CHUNKS
        tc, _ = _put_on_disk(plain, c, 802)
        fresh = mine.lookup(_identity(), a, tokens)
        assert isinstance(fresh, RemoteLookup)
        moved = [(f.seg, f.off) for f in fresh.frames if f is not None]
        before = mine.counters
        res = mine.load(lk, _aligned())
        _check_prefix(res.arrays, chunks)
        after = mine.counters
        if fresh.tiers() == {"disk": CHUNKS}:
            assert res.loaded == CHUNKS
            if moved != [(f.seg, f.off) for f in _frames(lk)]:  # compacted: none confirmed
                assert after.direct_loads == before.direct_loads
        assert after.tier("disk").loaded - before.tier("disk").loaded == res.loaded
        # the whole disk tier evicted after the lookup: a miss, nothing kept
        lk = _lookup(mine, c, tc)
        plain.evict("disk", 1 << 40)
        before = mine.counters
        outs = _aligned()
        res = mine.load(lk, outs)
        assert res.loaded == 0 and res.arrays == []
        assert mine.counters.direct_loads == before.direct_loads
    finally:
        for cl in (mine, plain):
            with contextlib.suppress(Exception):
                cl.close()
        assert srv.alive()
        srv.stop()


@pytest.fixture(scope="module")
def tenant_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A server with principals; bob is this Unix user, so his sessions map his own
    arena (hints, shared buffers)."""
    tmp = tmp_path_factory.mktemp("direct-tenants")
    config = write_config(tmp / "tenants.toml", bob_uid=os.geteuid())
    srv = ServerProc(
        tmp / "store",
        dram=4 * MiB,
        extra=("--tenants", str(config), "--write-through", "--no-promote"),
    ).start()
    yield srv
    srv.stop()


def _bob_on_disk(
    srv: ServerProc, ns: Namespace, seed: int
) -> tuple[RemoteStore, np.ndarray, np.ndarray]:
    bob = RemoteStore(srv.socket, timeout=30, token=TOKENS["bob"], direct_reads=True)
    assert bob._wire.connected().arena is not None  # he maps his arena
    tokens, kv = prompt_kv(seed, CHUNKS * N, LAYOUT)
    assert bob.put_prompt(_identity(), ns, tokens, kv).stored == CHUNKS
    with as_(srv, "root") as root:
        root.flush()
        root.evict("dram", 1 << 40)
    return bob, tokens, kv


def test_a_server_with_principals_names_no_frames_to_a_principal_that_maps_its_arena(
    tenant_srv: ServerProc,
) -> None:
    """The segment files hold every tenant's frames: no frame is named to any
    principal, even one that maps an arena, and his loads are the server's reads."""
    # Found by this red team, mended (loads.direct_reads): Loads.lookup named frames
    # whenever the lookup asked
    # ("direct") and the session maps an arena (`arena = ctx.arena if ctx.mapped`,
    # then `if direct and arena is not None and hits`); with principals, a session
    # whose peer may map its principal's arena has ctx.mapped True
    # (kvlife/server/context.py SessionContext.bind), so the reply names the segment
    # files that hold every tenant's frames. Nothing there checks ctx.tenancy.
    bob, tokens, kv = _bob_on_disk(tenant_srv, USER["bob"], 900)
    try:
        lk = bob.lookup(_identity(), USER["bob"], tokens)
        assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
        named = [f.path for f in lk.frames if f is not None]
        res = bob.load(lk, _aligned())
        assert res.loaded == CHUNKS
        _check_prefix(res.arrays, _chunks(kv))
        assert named == [], f"a server with principals named frames: {named[:1]}"
        bob.lookup(_identity(), USER["bob"], tokens)  # his session read his last word
        with as_(tenant_srv, "root") as root:
            assert root.counters.direct_loads == 0
    finally:
        bob.close()


def test_a_server_with_principals_confirms_no_direct_load(tenant_srv: ServerProc) -> None:
    """A principal that sends a ``direct`` load anyway (frames guessed: segment 1, one
    frame after another) is confirmed nothing and counted nothing."""
    # Found by this red team, mended (loads.direct_reads): Loads._confirm_direct refused
    # only sessions that
    # map no arena (`if not self.ctx.mapped`); with principals, bob's session maps his
    # own arena, so it confirms the guessed frames of his chunks and direct_kept then
    # counts them as direct loads.
    ns = Namespace(NamespaceKind.ORGANISATION, "globex")
    bob, tokens, _ = _bob_on_disk(tenant_srv, ns, 901)
    try:
        lk = bob.lookup(_identity(), ns, tokens)
        assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
        frame = HEADER_BYTES + LAYOUT.chunk_nbytes
        with as_(tenant_srv, "root") as root:
            before = root.counters.direct_loads
        confirmed = 0
        for h in lk.hits:
            for k in range(4 * CHUNKS):
                args = {
                    "keys": bytes(h.key),
                    "starts": [h.start],
                    "chunks_total": lk.chunks_total,
                    "direct": [1, k * frame],
                }
                try:
                    r, _ = bob._wire.call_on("load", args, None, _send(_kept(1)))
                except KVLifeError:
                    continue
                confirmed += int(r.get("confirmed", 0))
        bob.lookup(_identity(), ns, tokens)  # his session read his last word
        with as_(tenant_srv, "root") as root:
            after = root.counters.direct_loads
        assert confirmed == 0 and after == before
    finally:
        bob.close()


def test_a_principal_that_maps_no_arena_is_refused_a_direct_load(tenant_srv: ServerProc) -> None:
    """alice (a token only) loads through the socket: a ``direct`` load is a typed
    refusal, and her session goes on."""
    with as_(tenant_srv, "alice") as alice:
        tokens, kv = prompt_kv(902, CHUNKS * N, LAYOUT)
        assert alice.put_prompt(_identity(), USER["alice"], tokens, kv).stored == CHUNKS
        lk = alice.lookup(_identity(), USER["alice"], tokens)
        assert isinstance(lk, RemoteLookup) and lk.frames == ()
        args = {
            "keys": b"".join(h.key for h in lk.hits),
            "starts": [h.start for h in lk.hits],
            "chunks_total": lk.chunks_total,
            "direct": [1, 0] * CHUNKS,
        }
        with pytest.raises(KVLifeError):
            alice._wire.call_on("load", args, None, _send(_kept(CHUNKS)))
        res = alice.load(lk)
        assert res.loaded == CHUNKS
        _check_prefix(res.arrays, _chunks(kv))
