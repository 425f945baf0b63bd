"""Red team of direct reads turning themselves off (issue 28): a client made with
``direct_reads`` whose direct load opens not one segment file (``run.reading == 0``)
loads through the server, counts the chunks in ``direct_fallbacks`` and, where
:func:`kvlife.client.direct.unreachable` says the server's files are out of this
process's reach, stops asking lookups for frames (``Loads._none_opened``,
``RemoteStore.direct_reads_off``). Real servers (one in a private mount namespace,
:func:`tests.server.direct_rig.out_of_reach_server`), real segment files.

Attacked: several threads loading (``load`` and ``load_async``, shared buffers and new
arrays) while the first out-of-reach load turns direct reads off, lookups made with
frames before the switch loaded after it; a segment file unlinked between lookup and
load on a reachable server (must stay on), or replaced by a link, a FIFO or a folder
(turns off, exact data); the server killed during the fallback load and restarted in
its namespace; a lookup of a server whose store has since moved; the client's file
descriptors exhausted for a moment; the counts (``direct_fallbacks``, the server's
``loads`` and ``direct_loads``) and read-only new arrays throughout.

Found, both mended: a transient failure to open any file here (EMFILE: the process at
its descriptor limit for a moment) was taken by ``unreachable`` as "out of reach" and
turned direct reads off for good (``direct.PASSING``, commit 9793abb); and a lookup
answered by a server whose store has since moved (the client reconnected to the store
at its new path) named the old path, and loading it turned direct reads off for the
server now, whose files are in reach (``Loads._none_opened`` now judges reachability
only from a lookup answered on the current connection, as ``kept`` does). Each is
kept below as a regression test. Never a wrong byte: only direct reads lost.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import resource
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client import direct as client_direct
from kvlife.client import loads as client_loads
from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import StoreUnavailable
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.results import LoadResult
from tests.conftest import prompt_kv
from tests.server.conftest import ServerProc
from tests.server.direct_rig import OUT_OF_REACH, client_pair, disk_server, out_of_reach_server

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_chunk=32)
"""8 KiB chunks: whole pages, as O_DIRECT reads them."""
N = LAYOUT.tokens_per_chunk
CHUNKS = 3
HANG_S = 20.0


def _ident() -> ModelIdentity:
    return ModelIdentity(
        layout=LAYOUT, model_id="direct-off", weights_digest="w0", tokenizer_digest="t0"
    )


def _on_disk(plain: RemoteStore, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A prompt of CHUNKS chunks put, flushed and evicted from DRAM: its tokens, chunks."""
    tokens, kv = prompt_kv(seed, CHUNKS * N, LAYOUT)
    assert plain.put_prompt(_ident(), PUBLIC, tokens, kv).stored == CHUNKS
    plain.flush()
    plain.evict("dram", 1 << 40)
    chunks = [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]) for i in range(CHUNKS)]
    return tokens, chunks


def _lookup(store: RemoteStore, tokens: np.ndarray) -> RemoteLookup:
    lk = store.lookup(_ident(), PUBLIC, tokens)
    assert isinstance(lk, RemoteLookup) and lk.tiers() == {"disk": CHUNKS}
    return lk


def _shared(store: RemoteStore) -> list[np.ndarray]:
    raw = store.alloc_buffer(CHUNKS * LAYOUT.chunk_nbytes)
    n = LAYOUT.chunk_nbytes
    return [
        raw[i * n : (i + 1) * n].view(np.float16).reshape(LAYOUT.chunk_shape) for i in range(CHUNKS)
    ]


def _exact(res: LoadResult, chunks: list[np.ndarray], *, new: bool) -> None:
    """Every chunk loaded, byte for byte, from disk; new arrays read-only."""
    assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}, res
    for got, want in zip(res.arrays, chunks, strict=True):
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        assert got.flags.writeable == (not new)


def _segment(lk: RemoteLookup) -> str:
    paths = {f.path for f in lk.frames if f is not None}
    assert len(paths) == 1, paths
    return paths.pop()


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    server = disk_server(tmp_path / "store")
    yield server
    server.stop()


@pytest.fixture
def clients(srv: ServerProc) -> Iterator[tuple[RemoteStore, RemoteStore]]:
    with client_pair(srv) as pair:
        yield pair


def test_unreachable_says_why_for_a_socket_and_a_folder_behind_a_dangling_link(
    tmp_path: Path,
) -> None:
    """A socket where the segment file should be (opening it is ENXIO), and a segment
    folder that is a link to nothing, are out of reach; a folder that is a link to a
    real folder is in reach (the server's store may sit behind one)."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "seg-00000001.kvs").write_bytes(b"x" * 4096)
    linked = tmp_path / "linked"
    os.symlink(real, linked)
    assert client_direct.unreachable(str(linked / "seg-00000001.kvs")) is None
    assert client_direct.unreachable(str(linked / "seg-00000002.kvs")) is None  # compacted
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    why = client_direct.unreachable(str(dangling / "seg-00000001.kvs"))
    assert why is not None and str(dangling) in why, why
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(real / "seg-00000003.kvs"))
        why = client_direct.unreachable(str(real / "seg-00000003.kvs"))
        assert why is not None and "seg-00000003.kvs" in why, why
    finally:
        sock.close()


@OUT_OF_REACH
def test_loads_on_several_threads_while_the_first_turns_direct_reads_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Six loads of lookups that named frames, three by ``load`` on threads of their
    own and three by ``load_async``, into shared buffers and new arrays, all at once;
    ``unreachable`` slowed so that every load is between its refused start and the
    switch together. Each is exact, new arrays read-only (those handed to a handle's
    chunk too), every chunk counted once as a fallback, the switch logged once, the
    server counts six loads and no direct one. A lookup made before the switch and
    loaded after it goes through the server too, counted, not logged again."""
    real = client_direct.unreachable

    def slow(path: str) -> str | None:
        time.sleep(0.1)
        return real(path)

    monkeypatch.setattr(client_direct, "unreachable", slow)
    caplog.set_level(logging.WARNING, logger="kvlife.client")
    srv = out_of_reach_server(tmp_path / "store")
    try:
        with client_pair(srv) as (plain, mine):
            tokens, chunks = _on_disk(plain, 41)
            lks = [_lookup(mine, tokens) for _ in range(7)]
            assert all(f is not None for lk in lks for f in lk.frames)
            outs = [_shared(mine) if i % 2 == 0 else None for i in range(6)]
            before = plain.counters
            gate = threading.Barrier(4)

            def sync(i: int) -> LoadResult:
                gate.wait(timeout=HANG_S)
                return mine.load(lks[i], outs[i])

            with ThreadPoolExecutor(3) as ex:
                futs = [ex.submit(sync, i) for i in range(3)]
                gate.wait(timeout=HANG_S)
                handles = [mine.load_async(lks[i], outs[i]) for i in range(3, 6)]
                for i, h in zip(range(3, 6), handles, strict=True):
                    for c in range(CHUNKS):
                        got = h.chunk(c, timeout=HANG_S)
                        assert got is not None
                        assert np.array_equal(got.view(np.uint16), chunks[c].view(np.uint16))
                        assert got.flags.writeable == (outs[i] is not None)
                results = [f.result(timeout=HANG_S) for f in futs]
                results += [h.wait(timeout=HANG_S) for h in handles]
            for res, out in zip(results, outs, strict=True):
                _exact(res, chunks, new=out is None)
            why = mine.direct_reads_off()
            assert why is not None and str(tmp_path / "store") in why, why
            assert mine.direct_fallbacks() == 6 * CHUNKS
            warned = [r for r in caplog.records if "direct reads off" in r.getMessage()]
            assert len(warned) == 1, warned
            # a lookup that named frames before the switch, loaded after it
            _exact(mine.load(lks[6], None), chunks, new=True)
            assert mine.direct_fallbacks() == 7 * CHUNKS
            assert not _lookup(mine, tokens).frames
            assert len([r for r in caplog.records if "direct reads off" in r.getMessage()]) == 1
            after = plain.counters
            assert after.loads - before.loads == 7
            assert after.direct_loads == before.direct_loads
    finally:
        srv.stop()


@pytest.mark.parametrize("bufs", ["shared", "new"])
def test_a_segment_unlinked_between_lookup_and_load_leaves_direct_reads_on(
    clients: tuple[RemoteStore, RemoteStore], tmp_path: Path, bufs: str
) -> None:
    """Compaction's removal (the file unlinked; the server reads on through its open
    file): the load goes through the server, exact, counted; direct reads stay on, and
    once the file is back the next load reads directly (the server counts it)."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 42)
    lk = _lookup(mine, tokens)
    path = _segment(lk)
    keep = tmp_path / "kept-link"
    os.link(path, keep)
    os.unlink(path)
    try:
        res = mine.load(lk, _shared(mine) if bufs == "shared" else None)
    finally:
        os.link(keep, path)
    _exact(res, chunks, new=bufs == "new")
    assert mine.direct_fallbacks() == CHUNKS
    assert mine.direct_reads_off() is None
    # counted by the loading session's connection: its ``direct_kept`` (no reply) is
    # handled before its next request, not before another connection's (a race that
    # failed once on a slow machine)
    before = mine.counters.direct_loads
    again = _lookup(mine, tokens)
    assert all(f is not None for f in again.frames)
    _exact(mine.load(again, _shared(mine) if bufs == "shared" else None), chunks, new=bufs == "new")
    assert mine.counters.direct_loads - before == CHUNKS
    assert mine.direct_fallbacks() == CHUNKS


@pytest.mark.parametrize(("kind", "bufs"), [("link", "new"), ("fifo", "shared"), ("folder", "new")])
def test_a_segment_replaced_by_a_link_fifo_or_folder_turns_direct_reads_off(
    clients: tuple[RemoteStore, RemoteStore], tmp_path: Path, kind: str, bufs: str
) -> None:
    """The segment file's name now a link to it, a FIFO (no writer: opening it must not
    wait) or a folder: nothing opens here, the load goes through the server exact and
    within the hang bound, and direct reads turn off, saying which file."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 43)
    lk = _lookup(mine, tokens)
    path = _segment(lk)
    moved = tmp_path / "moved.kvs"
    os.rename(path, moved)
    if kind == "link":
        os.symlink(moved, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)
    before = plain.counters
    try:
        t0 = time.monotonic()
        res = mine.load(lk, _shared(mine) if bufs == "shared" else None)
        assert time.monotonic() - t0 < HANG_S
    finally:
        if kind == "folder":
            os.rmdir(path)
        else:
            os.unlink(path)
        os.rename(moved, path)
    _exact(res, chunks, new=bufs == "new")
    why = mine.direct_reads_off()
    assert why is not None and os.path.basename(path) in why, why
    assert mine.direct_fallbacks() == CHUNKS
    after = plain.counters
    assert after.loads - before.loads == 1 and after.direct_loads == before.direct_loads
    # off for good: the file is back, yet lookups name no frames and load exact
    later = _lookup(mine, tokens)
    assert not later.frames
    _exact(mine.load(later, None), chunks, new=True)
    assert mine.direct_fallbacks() == CHUNKS


@OUT_OF_REACH
def test_the_server_killed_during_the_fallback_load_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server killed between the switch and the load through it: a typed error
    within the hang bound, the chunks counted as fallbacks once, direct reads off. The
    server restarted in its namespace: lookups name no frames, loads exact."""
    srv = out_of_reach_server(tmp_path / "store")
    real = client_loads.Loads._none_opened

    def then_kill(self: client_loads.Loads, lookup: RemoteLookup, path: str, n: int) -> None:
        real(self, lookup, path, n)
        srv.kill()

    try:
        with client_pair(srv) as (plain, mine):
            tokens, chunks = _on_disk(plain, 44)
            lk = _lookup(mine, tokens)
            outs = _shared(mine)
            monkeypatch.setattr(client_loads.Loads, "_none_opened", then_kill)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                mine.load(lk, outs)
            assert time.monotonic() - t0 < HANG_S
            monkeypatch.undo()
            assert mine.direct_fallbacks() == CHUNKS
            assert mine.direct_reads_off() is not None
            srv.start()
            later = _lookup(mine, tokens)
            assert not later.frames
            _exact(mine.load(later, None), chunks, new=True)
            _exact(mine.load(_lookup(mine, tokens), _shared(mine)), chunks, new=False)
            assert mine.direct_fallbacks() == CHUNKS
    finally:
        if srv.proc is not None and srv.alive():
            srv.stop()


def test_a_moment_at_the_descriptor_limit_does_not_turn_direct_reads_off(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """Every descriptor of this process taken while a direct load starts: nothing
    opens, the load goes through the server (exact), but the files are in reach: direct
    reads stay on and the next lookup names frames again."""
    plain, mine = clients
    tokens, chunks = _on_disk(plain, 45)
    lk = _lookup(mine, tokens)
    outs = _shared(mine)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    # no collection frees a descriptor meanwhile (a former test's client closing its
    # socket would let the second open through): the limit is met throughout
    gc.collect()
    gc.disable()
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        with pytest.raises(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        res = mine.load(lk, outs)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        gc.enable()
    _exact(res, chunks, new=False)
    assert mine.direct_fallbacks() == CHUNKS
    assert mine.direct_reads_off() is None, mine.direct_reads_off()
    assert all(f is not None for f in _lookup(mine, tokens).frames)


def test_a_lookup_of_a_store_since_moved_leaves_direct_reads_on(tmp_path: Path) -> None:
    """A lookup answered by a server at ``a/store``; that server stopped, its folder
    moved to ``b`` and served again there on the same socket (the client reconnects).
    The old lookup's load is exact (the same chunks, through the server), but its
    frames named the old server's files: the server now has its files in reach, and
    the client's next lookup should name frames again."""
    sock = tmp_path / "serve.sock"
    (tmp_path / "a").mkdir()
    first = _server(tmp_path / "a" / "store", sock)
    second: ServerProc | None = None
    try:
        with client_pair(first) as (plain, mine):
            tokens, chunks = _on_disk(plain, 46)
            lk = _lookup(mine, tokens)
            first.stop()
            shutil.move(tmp_path / "a", tmp_path / "b")
            second = _server(tmp_path / "b" / "store", sock)
            with contextlib.suppress(StoreUnavailable):  # the old connection's end
                mine.server_info()
            assert mine.direct_reads_off() is None and mine.direct_fallbacks() == 0
            res = mine.load(lk, _shared(mine))
            _exact(res, chunks, new=False)
            assert mine.direct_reads_off() is None, mine.direct_reads_off()
            again = _lookup(mine, tokens)
            assert all(f is not None for f in again.frames)
            assert str(tmp_path / "b") in _segment(again)
    finally:
        for s in (first, second):
            if s is not None and s.proc is not None and s.alive():
                s.stop()


def _server(path: Path, sock: Path) -> ServerProc:
    """A :func:`disk_server` at ``path`` serving on ``sock`` (outside its folder)."""
    srv = ServerProc(
        path,
        dram=4 << 20,
        disk=64 << 20,
        staging=4 << 20,
        extra=("--write-through", "--no-promote"),
    )
    srv.socket = sock
    return srv.start()
