"""One contract suite for the store's public API, run against the embedded KVStore and
against a RemoteStore talking to a real ``kvlife serve`` process.

Each test uses its own namespace, so the remote variant shares one server per module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvlife
from kvlife.core.errors import (
    InvalidArgument,
    LayoutMismatch,
    PartialChunkError,
    StoreClosedError,
)
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB, ServerProc

N = TINY.tokens_per_chunk
_ns = itertools.count()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path_factory.mktemp("contract") / "store").start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(params=["embedded", "remote"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "embedded":
        s: Any = KVStore.open(tmp_path / "store", dram_bytes=8 * MiB, disk_bytes=64 * MiB)
    else:
        srv: ServerProc = request.getfixturevalue("shared_server")
        s = kvlife.connect(srv.socket)
    yield s
    s.close()


@pytest.fixture
def ns() -> Namespace:
    return Namespace(NamespaceKind.USER, f"u{next(_ns)}")


def chunks_of(kv: np.ndarray, n: int) -> list[np.ndarray]:
    return [kv[:, :, :, i * N : (i + 1) * N, :] for i in range(n)]


def test_put_lookup_load_returns_every_byte(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(1, 4 * N + 5)
    res = store.put_prompt(ident, ns, tokens, kv[:, :, :, : 4 * N])
    assert (res.chunks, res.stored, res.already_present, res.dropped) == (4, 4, 0, 0)
    assert res.tokens_stored_or_present == 4 * N and len(res.keys) == 4
    lk = store.lookup(ident, ns, tokens)
    assert len(lk.hits) == 4 and lk.chunks_total == 4 and lk.tokens == 4 * N
    assert [h.key for h in lk.hits] == res.keys
    assert [h.start for h in lk.hits] == [0, N, 2 * N, 3 * N]
    got = store.load(lk)
    assert got.complete and got.loaded == 4 and sum(got.tiers.values()) == 4
    for a, b in zip(got.arrays, chunks_of(kv, 4), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    again = store.put_prompt(ident, ns, tokens, kv[:, :, :, : 4 * N])
    assert (again.stored, again.already_present) == (0, 4)


def test_load_fills_callers_buffers(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(2, 3 * N)
    store.put_prompt(ident, ns, tokens, kv)
    lk = store.lookup(ident, ns, tokens)
    outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in range(3)]
    got = store.load(lk, outs)
    assert got.loaded == 3
    for out, a, b in zip(outs, got.arrays, chunks_of(kv, 3), strict=True):
        assert a is out and np.array_equal(out, b)
    with pytest.raises(InvalidArgument, match="output buffers"):
        store.load(lk, outs[:2])


def test_prepared_put_is_invisible_until_commit(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(3, 2 * N)
    pending = store.prepare_put(ident, ns, tokens, kv)
    assert store.lookup(ident, ns, tokens).hits == []
    res = store.commit_put(pending)
    assert res.stored == 2
    assert len(store.lookup(ident, ns, tokens).hits) == 2
    with pytest.raises(InvalidArgument, match="already committed or aborted"):
        store.commit_put(pending)


def test_aborted_put_leaves_nothing(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(4, 2 * N)
    pending = store.prepare_put(ident, ns, tokens, kv)
    store.abort_put(pending, "changed my mind")
    assert store.lookup(ident, ns, tokens).hits == []
    assert store.info().objects_by_state["tentative"] == 0
    with pytest.raises(InvalidArgument):
        store.abort_put(pending)
    # the keys are free again
    assert store.put_prompt(ident, ns, tokens, kv).stored == 2


def test_put_async_and_load_async(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(5, 3 * N)
    fut = store.put_async(store.prepare_put(ident, ns, tokens, kv))
    assert fut.result(timeout=30).stored == 3
    lk = store.lookup(ident, ns, tokens)
    handle = store.load_async(lk)
    assert len(handle) == 3
    first = handle.chunk(0, timeout=30)
    assert first is not None and np.array_equal(first, chunks_of(kv, 1)[0])
    res = handle.wait(timeout=30)
    assert handle.done() and res.loaded == 3 and handle.completed() == 3
    for a, b in zip(res.arrays, chunks_of(kv, 3), strict=True):
        assert np.array_equal(a, b)
    with pytest.raises(InvalidArgument):
        handle.chunk(3)


def test_get_is_lookup_plus_load(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(6, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    got = store.get(ident, ns, tokens)
    assert got.loaded == 2 and np.array_equal(got.arrays[1], chunks_of(kv, 2)[1])


def test_invalidate_by_namespace_and_prefix(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(7, 3 * N)
    res = store.put_prompt(ident, ns, tokens, kv)
    assert store.invalidate(prefix=res.keys[1]) == 2
    assert len(store.lookup(ident, ns, tokens).hits) == 1
    assert store.invalidate(namespace=ns) == 1
    assert store.lookup(ident, ns, tokens).hits == []


def test_identity_changes_miss(store: Any, ns: Namespace) -> None:
    tokens, kv = prompt_kv(8, 2 * N)
    store.put_prompt(tiny_identity(), ns, tokens, kv)
    assert store.lookup(tiny_identity(weights_digest="w1"), ns, tokens).hits == []
    other = Namespace(NamespaceKind.USER, f"other{next(_ns)}")
    assert store.lookup(tiny_identity(), other, tokens).hits == []


def test_flush_evict_and_load_from_disk(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(9, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    assert store.flush() >= 2
    store.evict("dram", 8 * MiB)
    lk = store.lookup(ident, ns, tokens)
    assert lk.tiers() == {"disk": 2}
    got = store.load(lk)
    assert got.tiers == {"disk": 2}
    for a, b in zip(got.arrays, chunks_of(kv, 2), strict=True):
        assert np.array_equal(a, b)
    store.drain()  # promotion back into DRAM
    assert store.lookup(ident, ns, tokens).tiers() == {"dram": 2}


def test_vanished_between_lookup_and_load(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(10, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    lk = store.lookup(ident, ns, tokens)
    store.invalidate(namespace=ns)
    got = store.load(lk)
    assert got.loaded == 0 and got.vanished == 2 and not got.complete


def test_bad_kv_is_a_typed_error_and_stores_nothing(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(11, 2 * N)
    with pytest.raises(LayoutMismatch):
        store.put_prompt(ident, ns, tokens, kv.astype(np.float32))
    with pytest.raises(LayoutMismatch):
        store.put_prompt(ident, ns, tokens, kv[:1])
    with pytest.raises(PartialChunkError):
        store.put_prompt(ident, ns, tokens, [kv[:, :, :, :N], kv[:, :, :, N : N + 3]])
    assert store.lookup(ident, ns, tokens).hits == []
    assert store.info().objects_by_state["tentative"] == 0


def test_info_and_counters(store: Any, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(12, 2 * N)
    before = store.counters.lookups
    store.put_prompt(ident, ns, tokens, kv)
    store.lookup(ident, ns, tokens)
    assert store.counters.lookups == before + 1
    info = store.info()
    assert [t.name for t in info.tiers] == ["dram", "disk"]
    assert info.objects_by_state["indexed"] >= 2
    assert list(store.tier_names) == ["dram", "disk"]


def test_closed_store_refuses_calls(store: Any, ns: Namespace) -> None:
    store.close()
    with pytest.raises(StoreClosedError):
        store.lookup(tiny_identity(), ns, [1] * N)
    store.close()  # idempotent


def test_context_manager_closes(store: Any, ns: Namespace) -> None:
    with store as s:
        assert s is store
    with pytest.raises(StoreClosedError):
        store.info()


def test_a_forked_child_gets_its_own_session(shared_server: ServerProc, ns: Namespace) -> None:
    import os

    store = kvlife.connect(shared_server.socket)
    ident = tiny_identity()
    tokens, kv = prompt_kv(30, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    before = store.server_state()["sessions"]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            got = store.get(ident, ns, tokens)
            ok = got.loaded == 2 and np.array_equal(got.arrays[1], kv[:, :, :, N:])
            ok = ok and store.server_state()["sessions"] == before + 1
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get(ident, ns, tokens).loaded == 2  # the parent's connection is intact
    store.close()
