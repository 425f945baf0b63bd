"""Red team of direct loads without buffers (issue 28): a client made with
``direct_reads`` whose ``load(lookup, None)`` / ``load_async(lookup, None)`` takes one
page-aligned array per hit from its recycling pool (``Loads._direct_arrays``), reads the
disk hits' frames straight into them, verified, and loads what it did not keep through
the server into the remaining pool arrays. Real servers, real segment files.

The promise attacked: every array handed out holds exactly the bytes its key was put
with and stays so (no later load, no native reader thread, no recycled pool memory
writes into an array a caller still holds), no two live arrays share memory, misses
and fallbacks are counted, a failed load is a typed error and no hang."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client import direct as client_direct
from kvlife.client import loads as client_loads
from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import KVLifeError, StoreUnavailable
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.conftest import prompt_kv
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import client_pair, disk_server
from tests.server.tenants import TOKENS, USER, as_, write_config

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_chunk=32)
"""8 KiB chunks: whole pages, read here."""
BIG = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_chunk=256)
"""2 MiB chunks (huge pages in the pool): reads long enough to be in flight when
something fails."""
ODD = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype="float16", tokens_per_chunk=16)
"""1.5 KiB chunks: not whole pages, so they must go through the server."""
CHUNKS = 3
HANG_S = 20.0
SENTINEL = 0x7E01
"""A NaN pattern no chunk of prompt_kv holds."""


def _ident(layout: KVLayout = LAYOUT, tag: str = "a") -> ModelIdentity:
    return ModelIdentity(
        layout=layout, model_id=f"new-arrays-{tag}", weights_digest="w0", tokenizer_digest="t0"
    )


def _ns(tag: str) -> Namespace:
    return Namespace(NamespaceKind.ORGANISATION, f"new-arrays-{tag}")


def _put_on_disk(
    plain: RemoteStore,
    ns: Namespace,
    seed: int,
    chunks: int = CHUNKS,
    layout: KVLayout = LAYOUT,
    tokens: np.ndarray | None = None,
) -> tuple[np.ndarray, list[bytes]]:
    """A prompt put, flushed and evicted from DRAM: its tokens and each chunk's bytes."""
    n = layout.tokens_per_chunk
    t, kv = prompt_kv(seed, chunks * n, layout)
    if tokens is not None:
        t = tokens
    assert plain.put_prompt(_ident(layout), ns, t, kv).stored == chunks
    plain.flush()
    plain.evict("dram", 1 << 40)
    return t, [
        np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :]).tobytes() for i in range(chunks)
    ]


def _lookup(
    store: RemoteStore, ns: Namespace, tokens: np.ndarray, layout: KVLayout = LAYOUT
) -> RemoteLookup:
    lk = store.lookup(_ident(layout), ns, tokens)
    assert isinstance(lk, RemoteLookup)
    return lk


def _check(arrays: list[np.ndarray], want: list[bytes]) -> None:
    """Every array handed out holds exactly the bytes its position was put with."""
    assert len(arrays) <= len(want)
    for i, got in enumerate(arrays):
        assert got.tobytes() == want[i], f"chunk {i} holds wrong bytes"


def _no_alias(arrays: list[np.ndarray]) -> None:
    """No two live arrays share a byte."""
    spans = sorted(
        (a.__array_interface__["data"][0], a.__array_interface__["data"][0] + a.nbytes)
        for a in arrays
    )
    for (_lo0, hi0), (lo1, _) in itertools.pairwise(spans):
        assert hi0 <= lo1, f"two live arrays share memory at {lo1:#x} (< {hi0:#x})"


def _in_thread(fn: Any, timeout: float = HANG_S) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["res"] = fn()
        except BaseException as exc:  # checked by the caller
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the load hung"
    return box


@pytest.fixture(scope="module")
def shared_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    server = disk_server(tmp_path_factory.mktemp("new-arrays") / "store", dram=16 * MiB)
    yield server
    server.stop()


@pytest.fixture
def clients(shared_srv: ServerProc) -> Iterator[tuple[RemoteStore, RemoteStore]]:
    with client_pair(shared_srv) as pair:
        yield pair
    assert shared_srv.alive()


@pytest.fixture
def own_srv(tmp_path: Path) -> Iterator[ServerProc]:
    server = disk_server(tmp_path / "store", dram=16 * MiB, disk=128 * MiB)
    yield server
    with contextlib.suppress(Exception):
        server.stop()


# ----------------------------------------------------------------------- plain loads


def test_direct_load_without_buffers_reads_here_and_counts(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    tokens, want = _put_on_disk(plain, _ns("basic"), 10)
    lk = _lookup(mine, _ns("basic"), tokens)
    assert lk.tiers() == {"disk": CHUNKS} and None not in lk.frames
    before = plain.counters.direct_loads
    fb = mine.direct_fallbacks()
    res = mine.load(lk, None)
    assert res.loaded == CHUNKS and res.requested == CHUNKS and res.tiers == {"disk": CHUNKS}
    _check(res.arrays, want)
    _no_alias(res.arrays)
    for a in res.arrays:
        assert a.__array_interface__["data"][0] % 4096 == 0
    assert mine.direct_fallbacks() == fb
    mine.info()  # the session's next request: the word of what it kept was read
    assert plain.counters.direct_loads - before == CHUNKS


def test_arrays_kept_and_mutated_across_many_loads_never_alias_or_change(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """A caller keeps every array of 12 loads (and scribbles on the first load's where
    it may); dropping some in between returns their memory to the pool. No later load
    hands out memory a kept array holds, and no kept array changes."""
    plain, mine = clients
    ns = _ns("keep")
    prompts = [_put_on_disk(plain, ns, 100 + k) for k in range(4)]
    kept: list[tuple[np.ndarray, bytes]] = []
    first = mine.load(_lookup(mine, ns, prompts[0][0]), None)
    _check(first.arrays, prompts[0][1])
    scribbled = []
    for a in first.arrays:
        if a.flags.writeable:
            a.view(np.uint16)[...] = SENTINEL  # the caller's own array: its bytes now
        scribbled.append((a, a.tobytes()))
    for k in range(12):
        tokens, want = prompts[k % 4]
        res = mine.load(_lookup(mine, ns, tokens), None)
        assert res.loaded == CHUNKS
        _check(res.arrays, want)
        if k % 3 == 2:
            del res  # dropped: back to the pool, handed out again by the next load
            gc.collect()
            continue
        kept += [(a, a.tobytes()) for a in res.arrays]
    _no_alias([a for a, _ in kept + scribbled])
    for a, b in kept + scribbled:
        assert a.tobytes() == b, "an array a caller holds changed under it"
    assert mine._loads._new_arrays.reused > 0  # the pool did recycle meanwhile


def test_many_concurrent_direct_loads_on_threads(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("threads")
    prompts = [_put_on_disk(plain, ns, 200 + k) for k in range(4)]
    lookups = [_lookup(mine, ns, t) for t, _ in prompts]
    mine.info()
    before = plain.counters.direct_loads
    fb = mine.direct_fallbacks()
    kept: list[tuple[np.ndarray, bytes]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        try:
            for k in range(12):
                p = (w + k) % 4
                if k % 2:
                    res = mine.load(lookups[p], None)
                    arrays = res.arrays
                else:
                    h = mine.load_async(lookups[p], None)
                    got = [h.chunk(i, timeout=HANG_S) for i in range(CHUNKS)]
                    arrays = [a for a in got if a is not None]
                    assert len(arrays) == CHUNKS
                _check(arrays, prompts[p][1])
                if k % 3:
                    with lock:
                        kept.extend((a, a.tobytes()) for a in arrays)
        except BaseException as exc:  # checked below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a concurrent load hung"
    assert not errors, errors[0]
    _no_alias([a for a, _ in kept])
    for a, b in kept:
        assert a.tobytes() == b
    mine.info()  # its last word read
    fell = mine.direct_fallbacks() - fb
    assert plain.counters.direct_loads - before == 4 * 12 * CHUNKS - fell


# ----------------------------------------------------------------- partial loads


def _flip(path: str, at: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


def test_a_corrupt_middle_frame_keeps_the_prefix_and_its_arrays_stay_put(
    own_srv: ServerProc,
) -> None:
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("corrupt")
        tokens, want = _put_on_disk(plain, ns, 300)
        lk = _lookup(mine, ns, tokens)
        f = lk.frames[1]
        assert f is not None
        _flip(f.path, f.off + HEADER_BYTES + 100)
        fb = mine.direct_fallbacks()
        res = mine.load(lk, None)
        assert res.loaded == 1 and res.requested == CHUNKS
        _check(res.arrays, want)
        assert res.corrupt == [lk.hits[1].key]
        assert mine.direct_fallbacks() - fb == CHUNKS - 1
        held = res.arrays[0]
        held_bytes = held.tobytes()
        # the two pool arrays not handed out went back; later loads take them
        gc.collect()
        others = []
        for k in range(4):
            t2, w2 = _put_on_disk(plain, ns, 310 + k)
            r2 = mine.load(_lookup(mine, ns, t2), None)
            assert r2.loaded == CHUNKS
            _check(r2.arrays, w2)
            others += r2.arrays
        _no_alias([held, *others])
        assert held.tobytes() == held_bytes


def test_a_truncated_segment_loads_the_frames_before_the_cut(own_srv: ServerProc) -> None:
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("trunc")
        tokens, want = _put_on_disk(plain, ns, 320)
        lk = _lookup(mine, ns, tokens)
        fs = [f for f in lk.frames if f is not None]
        assert len({f.path for f in fs}) == 1
        os.truncate(fs[2].path, fs[2].off + HEADER_BYTES + 10)
        fb = mine.direct_fallbacks()
        box = _in_thread(lambda: mine.load(lk, None))
        res = box.get("res")
        assert res is not None, box
        assert res.loaded == 2
        _check(res.arrays, want)
        assert mine.direct_fallbacks() - fb == 1
        assert res.corrupt or res.read_errors or res.vanished  # the miss is accounted


def test_an_invalidation_between_lookup_and_load_hands_out_nothing(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("inval")
    tokens, _ = _put_on_disk(plain, ns, 330)
    lk = _lookup(mine, ns, tokens)
    assert plain.invalidate(namespace=ns) == CHUNKS
    fb = mine.direct_fallbacks()
    res = mine.load(lk, None)
    assert res.loaded == 0 and res.arrays == [] and res.requested == CHUNKS
    assert mine.direct_fallbacks() - fb == CHUNKS
    h = mine.load_async(lk, None)
    assert [h.chunk(i, timeout=HANG_S) for i in range(CHUNKS)] == [None] * CHUNKS


def test_a_rewrite_between_lookup_and_load_serves_new_bytes_and_old_arrays_stay(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("rewrite")
    tokens, old = _put_on_disk(plain, ns, 340)
    lk = _lookup(mine, ns, tokens)
    first = mine.load(lk, None)
    _check(first.arrays, old)
    assert plain.invalidate(namespace=ns) == CHUNKS
    _, new = _put_on_disk(plain, ns, 341, tokens=tokens)
    res = mine.load(lk, None)  # the old frames verify but are not confirmed
    assert res.loaded in (0, CHUNKS)
    _check(res.arrays, new)
    _check(first.arrays, old)
    _no_alias(first.arrays + res.arrays)


def test_disk_eviction_between_lookup_and_load_is_a_counted_miss(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("evict")
    tokens, want = _put_on_disk(plain, ns, 350)
    lk = _lookup(mine, ns, tokens)
    fb = mine.direct_fallbacks()
    assert plain.evict("disk", 1 << 40) > 0
    res = mine.load(lk, None)
    _check(res.arrays, want)
    assert res.requested == CHUNKS and res.loaded == 0 and res.arrays == []
    assert mine.direct_fallbacks() - fb == CHUNKS  # tried here, not confirmed: counted


# ----------------------------------------------------------------- failed loads


def _sentinel_arrays(mine: RemoteStore, layout: KVLayout, n: int) -> list[np.ndarray]:
    """Arrays taken from the client's pool now, filled with a pattern no chunk holds."""
    dtype = np.dtype(np.float16)
    out = [mine._loads.new_array(layout.chunk_shape, dtype) for _ in range(n)]
    for a in out:
        a.view(np.uint16)[...] = SENTINEL
    return out


def _spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many frames each direct run started from now on was given."""
    seen: list[int] = []
    real = client_direct.start_reads

    def spy(frames: Any, outs: Any) -> Any:
        seen.append(len(frames))
        return real(frames, outs)

    monkeypatch.setattr(client_direct, "start_reads", spy)
    return seen


def _unwritten(arrays: list[np.ndarray]) -> None:
    time.sleep(0.5)  # any reader still running lands meanwhile
    for a in arrays:
        assert bool(np.all(a.view(np.uint16) == SENTINEL)), "pool memory written after recycling"


def test_a_server_killed_before_the_load_leaves_no_reader_on_recycled_arrays(
    own_srv: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reads start (the segment files are still there) and the request fails: the
    load is a typed error; the pool arrays it took go back only once its reads ended,
    so arrays taken from the pool after it are never written by them."""
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("killed")
        tokens, _ = _put_on_disk(plain, ns, 400, chunks=6, layout=BIG)
        lk = _lookup(mine, ns, tokens, BIG)
        assert None not in lk.frames and len(lk.frames) == 6
        reused = mine._loads._new_arrays.reused
        mine.load(_lookup(mine, ns, tokens, BIG), None)  # warm the pool: 6 arrays
        gc.collect()
        started = _spy_reads(monkeypatch)
        own_srv.kill()
        box = _in_thread(lambda: mine.load(lk, None))
        assert started == [6], "the direct reads did not start: the attack missed"
        assert isinstance(box.get("exc"), StoreUnavailable), box
        del box
        gc.collect()
        fresh = _sentinel_arrays(mine, BIG, 6)
        assert mine._loads._new_arrays.reused > reused
        _unwritten(fresh)


def test_a_server_killed_during_direct_loads_never_writes_handed_out_arrays(
    own_srv: ServerProc,
) -> None:
    """Async loads of 1 MiB chunks race a SIGKILL of the server: every load ends (a
    typed error or a result), nothing handed out changes afterwards, and pool memory
    taken after the failures is not written by readers of the failed loads."""
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("race-kill")
        prompts = [_put_on_disk(plain, ns, 410 + k, chunks=6, layout=BIG) for k in range(3)]
        lookups = [_lookup(mine, ns, t, BIG) for t, _ in prompts]
        handles = [mine.load_async(lk, None) for lk in lookups]
        time.sleep(0.002)
        own_srv.kill()
        got: list[tuple[np.ndarray, bytes]] = []
        for h, (_, want) in zip(handles, prompts, strict=True):
            for i in range(4):
                try:
                    a = h.chunk(i, timeout=HANG_S)
                except TimeoutError:
                    pytest.fail("a load hung after the server was killed")
                except KVLifeError:
                    break
                if a is None:
                    break
                assert a.tobytes() == want[i], "a chunk handed out holds wrong bytes"
                got.append((a, a.tobytes()))
        del handles
        gc.collect()
        fresh = _sentinel_arrays(mine, BIG, 12)
        _unwritten(fresh)
        _no_alias([a for a, _ in got] + fresh)
        for a, b in got:
            assert a.tobytes() == b


def test_an_async_handle_timed_out_and_dropped_early(own_srv: ServerProc) -> None:
    """A handle waited on with no time to spare and then dropped: the load goes on, its
    arrays are not recycled while it writes them, and later loads are right."""
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("dropped")
        tokens, want = _put_on_disk(plain, ns, 420, chunks=6, layout=BIG)
        lk = _lookup(mine, ns, tokens, BIG)
        for _ in range(5):
            h = mine.load_async(lk, None)
            with contextlib.suppress(TimeoutError):
                h.chunk(5, timeout=0.0)
            first = h.chunk(0, timeout=HANG_S)  # handed out before the load finished?
            assert first is not None and first.tobytes() == want[0]
            held = first.tobytes()
            del h
            gc.collect()
            # more loads while the dropped one may still run
            res = mine.load(lk, None)
            assert res.loaded == 6
            _check(res.arrays, want)
            _no_alias([first, *res.arrays])
            assert first.tobytes() == held


# ------------------------------------------------------------------ other shapes


def test_dram_and_disk_hits_mixed_in_one_prompt(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("mixed")
    n = LAYOUT.tokens_per_chunk
    tokens, kv = prompt_kv(500, 5 * n, LAYOUT)
    assert plain.put_prompt(_ident(), ns, tokens[: 2 * n], kv[:, :, :, : 2 * n]).stored == 2
    plain.flush()
    plain.evict("dram", 1 << 40)
    assert plain.put_prompt(_ident(), ns, tokens, kv).stored == 3
    want = [np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :]).tobytes() for i in range(5)]
    lk = _lookup(mine, ns, tokens)
    assert lk.tiers() == {"disk": 2, "dram": 3}
    fb = mine.direct_fallbacks()
    res = mine.load(lk, None)
    assert res.loaded == 5 and res.tiers == {"disk": 2, "dram": 3}
    _check(res.arrays, want)
    _no_alias(res.arrays)
    assert mine.direct_fallbacks() == fb  # nothing tried here, nothing fell back
    h = mine.load_async(lk, None)
    arrays = [h.chunk(i, timeout=HANG_S) for i in range(5)]
    assert all(a is not None for a in arrays)
    _check([a for a in arrays if a is not None], want)


# Found by this red team (2026-12-07), mended the same day: a direct load without
# buffers handed out its pool arrays writable, where every load without buffers hands
# out read-only arrays (docs/server.md, "Loads without buffers"), whether read here or
# filled by the server after a fallback (Loads._load_direct_new now seals each one as it
# is handed out, to a load_async's chunk() too).
def test_new_arrays_are_read_only_whichever_way_they_were_loaded(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """docs/server.md, "Loads without buffers ... hand out new read-only arrays"; the
    served path does (loads.py ``_load_mapped``); a direct load without buffers hands out
    its pool arrays as they are."""
    plain, mine = clients
    ns = _ns("readonly")
    tokens, want = _put_on_disk(plain, ns, 510)
    served = plain.load(_lookup(plain, ns, tokens), None)
    direct_res = mine.load(_lookup(mine, ns, tokens), None)
    _check(served.arrays, want)
    _check(direct_res.arrays, want)
    assert [a.flags.writeable for a in served.arrays] == [False] * CHUNKS
    assert [a.flags.writeable for a in direct_res.arrays] == [False] * CHUNKS
    handle = mine.load_async(_lookup(mine, ns, tokens), None)
    told = [handle.chunk(i, timeout=HANG_S) for i in range(CHUNKS)]
    assert all(a is not None and not a.flags.writeable for a in told)
    assert handle.wait(timeout=HANG_S).loaded == CHUNKS


def test_chunks_that_are_not_whole_pages_go_through_the_server(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("odd")
    assert ODD.chunk_nbytes % 4096 != 0
    tokens, want = _put_on_disk(plain, ns, 520, chunks=4, layout=ODD)
    lk = _lookup(mine, ns, tokens, ODD)
    mine.info()
    before = plain.counters.direct_loads
    for _ in range(3):
        res = mine.load(lk, None)
        assert res.loaded == 4 and res.tiers == {"disk": 4}
        _check(res.arrays, want)
        _no_alias(res.arrays)
    h = mine.load_async(lk, None)
    arrays = [h.chunk(i, timeout=HANG_S) for i in range(4)]
    _check([a for a in arrays if a is not None], want)
    assert all(a is not None for a in arrays)
    mine.info()
    assert plain.counters.direct_loads == before


@pytest.fixture(scope="module")
def tenant_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("new-arrays-tenants")
    config = write_config(tmp / "tenants.toml", bob_uid=os.geteuid())
    srv = ServerProc(
        tmp / "store",
        dram=4 * MiB,
        extra=("--tenants", str(config), "--write-through", "--no-promote"),
    ).start()
    yield srv
    srv.stop()


def test_a_server_with_principals_names_no_frames_and_loads_right_bytes(
    tenant_srv: ServerProc,
) -> None:
    bob = RemoteStore(tenant_srv.socket, timeout=30, token=TOKENS["bob"], direct_reads=True)
    try:
        ns = USER["bob"]
        n = LAYOUT.tokens_per_chunk
        tokens, kv = prompt_kv(600, CHUNKS * n, LAYOUT)
        assert bob.put_prompt(_ident(), ns, tokens, kv).stored == CHUNKS
        with as_(tenant_srv, "root") as root:
            root.flush()
            root.evict("dram", 1 << 40)
            before = root.counters.direct_loads
        want = [
            np.ascontiguousarray(kv[:, :, :, i * n : (i + 1) * n, :]).tobytes()
            for i in range(CHUNKS)
        ]
        lk = _lookup(bob, ns, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        assert [f for f in lk.frames if f is not None] == []
        res = bob.load(lk, None)
        assert res.loaded == CHUNKS
        _check(res.arrays, want)
        h = bob.load_async(lk, None)
        arrays = [h.chunk(i, timeout=HANG_S) for i in range(CHUNKS)]
        assert all(a is not None for a in arrays)
        _check([a for a in arrays if a is not None], want)
        assert bob.direct_fallbacks() == 0
        with as_(tenant_srv, "root") as root:
            assert root.counters.direct_loads == before
    finally:
        bob.close()


def test_a_fallback_that_fails_half_way_leaves_handed_out_arrays_right(
    own_srv: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 0 kept from the direct read, chunk 1 corrupt; the server dies just as the
    rest goes through it: a typed error, no hang; the chunk the async handle handed out
    before holds its bytes and pool memory taken after is not written."""
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("fallback-dies")
        tokens, want = _put_on_disk(plain, ns, 700, chunks=4, layout=BIG)
        lk = _lookup(mine, ns, tokens, BIG)
        f = lk.frames[1]
        assert f is not None
        _flip(f.path, f.off + HEADER_BYTES + 100)
        real = client_loads.Loads._load_mapped

        def dying(self: client_loads.Loads, *args: Any, **kw: Any) -> Any:
            own_srv.kill()
            return real(self, *args, **kw)

        monkeypatch.setattr(client_loads.Loads, "_load_mapped", dying)
        h = mine.load_async(lk, None)
        try:
            a0 = h.chunk(0, timeout=HANG_S)
        except KVLifeError:
            a0 = None  # failed before handing it out: nothing to keep
        with pytest.raises(KVLifeError):  # typed, not a bare OSError or a hang
            h.chunk(3, timeout=HANG_S)
        held = None if a0 is None else a0.tobytes()
        if a0 is not None:
            assert held == want[0]
        del h
        gc.collect()
        fresh = _sentinel_arrays(mine, BIG, 4)
        _unwritten(fresh)
        if a0 is not None:
            _no_alias([a0, *fresh])
            assert a0.tobytes() == held


def test_rewrites_racing_direct_loads_serve_old_or_new_bytes_only(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """One thread rewrites a prompt with other bytes, back and forth; loads without
    buffers on another thread hand out, per chunk, one of the bytes that key was put
    with, and those arrays never change afterwards."""
    plain, mine = clients
    ns = _ns("rewrite-race")
    tokens, a_bytes = _put_on_disk(plain, ns, 800)
    writer = RemoteStore(plain.socket_path, timeout=30)
    n = LAYOUT.tokens_per_chunk
    _, kv_b = prompt_kv(801, CHUNKS * n, LAYOUT)
    b_bytes = [
        np.ascontiguousarray(kv_b[:, :, :, i * n : (i + 1) * n, :]).tobytes() for i in range(CHUNKS)
    ]
    _, kv_a = prompt_kv(800, CHUNKS * n, LAYOUT)
    stop = threading.Event()
    errors: list[BaseException] = []

    def rewrite() -> None:
        try:
            k = 0
            while not stop.is_set():
                writer.invalidate(namespace=ns)
                kv = kv_b if k % 2 == 0 else kv_a
                writer.put_prompt(_ident(), ns, tokens, kv)
                writer.flush()
                writer.evict("dram", 1 << 40)
                k += 1
        except BaseException as exc:  # checked below
            errors.append(exc)

    mine.info()
    before = plain.counters.direct_loads
    t = threading.Thread(target=rewrite, daemon=True)
    t.start()
    kept: list[tuple[np.ndarray, bytes]] = []
    try:
        deadline = time.monotonic() + 6
        loads = 0
        while time.monotonic() < deadline:
            lk = mine.lookup(_ident(), ns, tokens)
            assert isinstance(lk, RemoteLookup)
            res = mine.load(lk, None)
            loads += 1
            for i, arr in enumerate(res.arrays):
                got = arr.tobytes()
                assert got in (a_bytes[i], b_bytes[i]), f"chunk {i}: bytes never put"
                kept.append((arr, got))
    finally:
        stop.set()
        t.join(30)
        writer.close()
    assert not errors, errors[0]
    assert loads > 5
    mine.info()
    assert plain.counters.direct_loads > before  # the race did go through direct reads
    _no_alias([a for a, _ in kept])
    for a, b in kept:
        assert a.tobytes() == b


def test_sub_lookups_load_their_slice_without_buffers(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """The vLLM worker loads its slice of a prompt (``lookup.sub``): each slice reads
    its own frames into its own arrays, right bytes, none shared."""
    plain, mine = clients
    ns = _ns("sub")
    tokens, want = _put_on_disk(plain, ns, 900, chunks=5)
    lk = _lookup(mine, ns, tokens)
    mine.info()
    before = plain.counters.direct_loads
    got: list[np.ndarray] = []
    for lo, hi in ((0, 2), (2, 3), (3, 5), (1, 4)):
        res = mine.load(lk.sub(lo, hi), None)
        assert res.loaded == hi - lo
        _check(res.arrays, want[lo:hi])
        got += res.arrays
    _no_alias(got)
    mine.info()
    assert plain.counters.direct_loads - before == 2 + 1 + 2 + 3


def test_a_stalled_server_times_the_load_out_typed_and_recycles_nothing_in_flight(
    own_srv: ServerProc,
) -> None:
    """The server stops (SIGSTOP) after the lookup: the direct reads land, the reply
    never comes; the load is a typed error after the client's timeout, not a hang, and
    pool memory taken after it is not written; once the server resumes, loads are
    right again."""
    plain = own_srv.client()
    mine = RemoteStore(own_srv.socket, timeout=2, direct_reads=True)
    try:
        ns = _ns("stalled")
        tokens, want = _put_on_disk(plain, ns, 950, chunks=4, layout=BIG)
        lk = _lookup(mine, ns, tokens, BIG)
        kept = mine.load(lk, None)
        _check(kept.arrays, want)
        held = [a.tobytes() for a in kept.arrays]
        os.kill(own_srv.pid, signal.SIGSTOP)
        try:
            box = _in_thread(lambda: mine.load(lk, None), timeout=30)
        finally:
            os.kill(own_srv.pid, signal.SIGCONT)
        assert isinstance(box.get("exc"), KVLifeError), box
        del box
        gc.collect()
        fresh = _sentinel_arrays(mine, BIG, 4)
        _unwritten(fresh)
        del fresh
        gc.collect()
        res = None
        for _ in range(3):  # the first call after the drop may find the dead connection
            with contextlib.suppress(StoreUnavailable):
                res = mine.load(_lookup(mine, ns, tokens, BIG), None)
                break
        assert res is not None and res.loaded == 4
        _check(res.arrays, want)
        _no_alias(kept.arrays + res.arrays)
        assert [a.tobytes() for a in kept.arrays] == held
    finally:
        with contextlib.suppress(Exception):
            os.kill(own_srv.pid, signal.SIGCONT)
        for c in (mine, plain):
            with contextlib.suppress(Exception):
                c.close()


# The vLLM connector's store reading directly by default (and not with
# kvlife.direct_reads false): tests/server/test_direct_reads.py,
# test_the_vllm_connectors_store_reads_directly_unless_told_not_to.


class _DyingRun:
    """A direct run whose ``finish()`` (run once the server's reply is in, before the
    client's word of what it kept) first kills the server."""

    def __init__(self, run: Any, srv: ServerProc) -> None:
        self.run, self.srv = run, srv

    @property
    def reading(self) -> int:
        return int(self.run.reading)

    def finish(self) -> int:
        self.srv.kill()
        return int(self.run.finish())

    def close(self) -> None:
        self.run.close()


def test_a_server_dying_between_its_reply_and_the_kept_word(
    own_srv: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server confirmed and died; the word of what was kept cannot be sent: a typed
    error (not a bare BrokenPipeError), no hang, nothing handed out, and pool memory taken
    after is never written."""
    with client_pair(own_srv) as (plain, mine):
        ns = _ns("dies-after-reply")
        tokens, _ = _put_on_disk(plain, ns, 990, chunks=4, layout=BIG)
        lk = _lookup(mine, ns, tokens, BIG)
        real = client_direct.start_reads
        monkeypatch.setattr(
            client_direct, "start_reads", lambda f, o: _DyingRun(real(f, o), own_srv)
        )
        box = _in_thread(lambda: mine.load(lk, None))
        assert not own_srv.alive()  # the attack ran: killed inside the exchange
        assert isinstance(box.get("exc"), KVLifeError), box
        del box
        gc.collect()
        fresh = _sentinel_arrays(mine, BIG, 4)
        _unwritten(fresh)


def test_fallbacks_of_concurrent_loads_are_each_counted(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    """Loads on 4 threads of lookups whose chunks were invalidated since: every chunk
    was tried here and not confirmed, so each load adds its chunks to
    ``direct_fallbacks``, none lost to the race, and none is handed out."""
    plain, mine = clients
    ns = _ns("count-race")
    tokens, _ = _put_on_disk(plain, ns, 1000)
    lk = _lookup(mine, ns, tokens)
    assert plain.invalidate(namespace=ns) == CHUNKS
    fb = mine.direct_fallbacks()
    errors: list[BaseException] = []
    handed: list[int] = []

    def worker() -> None:
        try:
            for _ in range(25):
                res = mine.load(lk, None)
                handed.append(res.loaded)
        except BaseException as exc:  # checked below
            errors.append(exc)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert not errors, errors[0]
    assert handed == [0] * 100
    assert mine.direct_fallbacks() - fb == 100 * CHUNKS
