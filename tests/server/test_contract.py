"""The contract suite of :class:`~kvlife.store.api.StoreAPI`, run against the embedded
KVStore and against a RemoteStore talking to a real ``kvlife serve`` process.

Every test takes the store as a ``StoreAPI``, so mypy checks that the suite uses only
the API both stores promise (and that both stores are StoreAPIs);
``test_the_suite_calls_every_method`` fails when StoreAPI gains a method no test here
calls. Each test uses its own namespace, so the remote variant shares one server per
module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvlife
from kvlife.client import RemotePendingPut, RemoteStore
from kvlife.core.errors import (
    InvalidArgument,
    LayoutMismatch,
    PartialChunkError,
    StoreClosedError,
)
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.core.sources import Source, SourceSpan
from kvlife.store import KVStore, PendingPut
from kvlife.store.api import StoreAPI
from kvlife.transforms.contract import Accept
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import MiB, ServerProc

N = TINY.tokens_per_chunk
_ns = itertools.count()
Store = StoreAPI[Any]

# both stores are StoreAPIs (mypy checks these, and every test's use of ``store``)
_EMBEDDED: type[StoreAPI[PendingPut]] = KVStore
_SERVED: type[StoreAPI[RemotePendingPut]] = RemoteStore


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path_factory.mktemp("contract") / "store").start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(params=["embedded", "remote"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store
    if request.param == "embedded":
        s = KVStore.open(tmp_path / "store", dram_bytes=8 * MiB, disk_bytes=64 * MiB)
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


def test_put_lookup_load_returns_every_byte(store: Store, ns: Namespace) -> None:
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


def test_load_fills_callers_buffers(store: Store, ns: Namespace) -> None:
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


def test_prepared_put_is_invisible_until_commit(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(3, 2 * N)
    pending = store.prepare_put(ident, ns, tokens, kv)
    assert store.lookup(ident, ns, tokens).hits == []
    res = store.commit_put(pending)
    assert res.stored == 2
    assert len(store.lookup(ident, ns, tokens).hits) == 2
    with pytest.raises(InvalidArgument, match="already committed or aborted"):
        store.commit_put(pending)


def test_aborted_put_leaves_nothing(store: Store, ns: Namespace) -> None:
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


def test_put_async_and_load_async(store: Store, ns: Namespace) -> None:
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


def test_get_is_lookup_plus_load(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(6, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    got = store.get(ident, ns, tokens)
    assert got.loaded == 2 and np.array_equal(got.arrays[1], chunks_of(kv, 2)[1])


def test_invalidate_by_namespace_and_prefix(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(7, 3 * N)
    res = store.put_prompt(ident, ns, tokens, kv)
    assert store.invalidate(prefix=res.keys[1]) == 2
    assert len(store.lookup(ident, ns, tokens).hits) == 1
    assert store.invalidate(namespace=ns) == 1
    assert store.lookup(ident, ns, tokens).hits == []


def test_identity_changes_miss(store: Store, ns: Namespace) -> None:
    tokens, kv = prompt_kv(8, 2 * N)
    store.put_prompt(tiny_identity(), ns, tokens, kv)
    assert store.lookup(tiny_identity(weights_digest="w1"), ns, tokens).hits == []
    other = Namespace(NamespaceKind.USER, f"other{next(_ns)}")
    assert store.lookup(tiny_identity(), other, tokens).hits == []


def test_flush_evict_and_load_from_disk(store: Store, ns: Namespace) -> None:
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


def test_a_repeated_lookup_says_where_the_chunks_are_now(store: Store, ns: Namespace) -> None:
    """A client answers a repeated prompt with the hit records it built before where
    they say the same; a chunk that moved tier since is a new record, never the old."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(21, 3 * N)
    store.put_prompt(ident, ns, tokens, kv)
    first = store.lookup(ident, ns, tokens)
    assert first.tiers() == {"dram": 3}
    assert store.lookup(ident, ns, tokens).hits == first.hits
    assert store.flush() >= 3
    store.evict("dram", 8 * MiB)
    moved = store.lookup(ident, ns, tokens)
    assert moved.tiers() == {"disk": 3}
    assert [h.key for h in moved.hits] == [h.key for h in first.hits]
    assert [h.start for h in moved.hits] == [0, N, 2 * N]
    head = store.lookup(ident, ns, tokens[: 2 * N])  # a prefix: the same records, fewer
    assert head.hits == moved.hits[:2]
    got = store.load(moved)
    assert got.loaded == 3 and np.array_equal(got.arrays[2], chunks_of(kv, 3)[2])
    store.drain()  # the load promoted them back
    assert store.lookup(ident, ns, tokens).hits == first.hits


def test_vanished_between_lookup_and_load(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(10, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    lk = store.lookup(ident, ns, tokens)
    store.invalidate(namespace=ns)
    got = store.load(lk)
    assert got.loaded == 0 and got.vanished == 2 and not got.complete


def test_bad_kv_is_a_typed_error_and_stores_nothing(store: Store, ns: Namespace) -> None:
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


def test_info_and_counters(store: Store, ns: Namespace) -> None:
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


def test_closed_store_refuses_calls(store: Store, ns: Namespace) -> None:
    store.close()
    with pytest.raises(StoreClosedError):
        store.lookup(tiny_identity(), ns, [1] * N)
    store.close()  # idempotent


def test_context_manager_closes(store: Store, ns: Namespace) -> None:
    with store as s:
        assert s is store
    with pytest.raises(StoreClosedError):
        store.info()


def test_a_prompt_continues_from_its_parent(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(13, 4 * N)
    head = store.put_prompt(ident, ns, tokens[: 2 * N], kv[:, :, :, : 2 * N])
    tail = store.put_prompt(
        ident, ns, tokens[2 * N :], kv[:, :, :, 2 * N :], start=2 * N, parent=head.keys[-1]
    )
    assert tail.stored == 2
    whole = store.lookup(ident, ns, tokens)
    assert [h.key for h in whole.hits] == head.keys + tail.keys
    # a position out of an array (numpy integer) is taken by either store
    rest = store.lookup(ident, ns, tokens[2 * N :], start=np.int64(2 * N), parent=head.keys[-1])  # type: ignore[arg-type]
    assert [h.key for h in rest.hits] == tail.keys and [h.start for h in rest.hits] == [
        2 * N,
        3 * N,
    ]
    got = store.load(rest)
    assert np.array_equal(got.arrays[1], chunks_of(kv, 4)[3])
    assert store.lookup(ident, ns, tokens[2 * N :]).hits == []  # another parent: a miss


def test_extra_keys_are_part_of_the_identity(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(14, 2 * N)
    assert store.put_prompt(ident, ns, tokens, kv, extra_keys=[b"image-1"]).stored == 2
    assert store.lookup(ident, ns, tokens).hits == []
    assert store.lookup(ident, ns, tokens, extra_keys=[b"image-2"]).hits == []
    assert len(store.lookup(ident, ns, tokens, extra_keys=[b"image-1"]).hits) == 2


def test_a_lossy_accept_takes_exact_replicas_too(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(15, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    lk = store.lookup(ident, ns, tokens, accept=Accept.lossy())
    assert len(lk.hits) == 2 and lk.accept == Accept.lossy()
    assert [h.transform for h in lk.hits] == ["exact", "exact"]
    got = store.load(lk)
    assert got.loaded == 2 and np.array_equal(got.arrays[0], chunks_of(kv, 1)[0])


def test_load_async_into_buffers_chunk_by_chunk(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(16, 3 * N)
    store.put_prompt(ident, ns, tokens, kv)
    store.flush()
    store.evict("dram", 8 * MiB)  # disk reads, one in flight at a time
    outs = [np.zeros(TINY.chunk_shape, np.float16) for _ in range(3)]
    handle = store.load_async(store.lookup(ident, ns, tokens), outs, depth=1)
    for i, want in enumerate(chunks_of(kv, 3)):
        got = handle.chunk(i, timeout=30)
        assert got is outs[i] and np.array_equal(got, want)
    res = handle.wait(timeout=30)
    assert res.loaded == 3 and res.tiers == {"disk": 3}
    assert all(a is o for a, o in zip(res.arrays, outs, strict=True))


def test_put_async_of_a_finished_put_is_refused(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(17, N)
    pending = store.prepare_put(ident, ns, tokens, kv)
    assert store.put_async(pending).result(timeout=30).stored == 1
    with pytest.raises(InvalidArgument, match="already committed or aborted"):
        store.put_async(pending).result(timeout=30)


def test_invalidate_by_model_version_and_adapter(store: Store, ns: Namespace) -> None:
    tokens, kv = prompt_kv(18, N)
    old = tiny_identity(weights_digest=f"w-{ns.name}")
    tuned = tiny_identity(adapter_id=f"a-{ns.name}", adapter_digest="d0")
    base = tiny_identity()
    for ident in (old, tuned, base):
        assert store.put_prompt(ident, ns, tokens, kv).stored == 1
    assert store.invalidate(weights_digest=f"w-{ns.name}") == 1
    assert store.invalidate(adapter_id=f"a-{ns.name}") == 1
    assert store.lookup(old, ns, tokens).hits == [] and store.lookup(tuned, ns, tokens).hits == []
    assert len(store.lookup(base, ns, tokens).hits) == 1


def test_sources_are_identity_and_invalidate_by_source(store: Store, ns: Namespace) -> None:
    """Issue 26: a prompt's upstream sources are part of its chunks' keys (a new
    version misses) and ``invalidate(source=...)`` removes exactly the chunks that
    depend on the source at the versions named, through either store."""
    ident = tiny_identity()
    doc = f"doc-{ns.name}"
    tokens, kv = prompt_kv(21, 3 * N)
    v1 = [SourceSpan(Source("sys"), 0, N), SourceSpan(Source(doc, 1), N, 3 * N)]
    v2 = [SourceSpan(Source("sys"), 0, N), SourceSpan(Source(doc, 2), N, 3 * N)]
    assert store.put_prompt(ident, ns, tokens, kv, sources=v1).stored == 3
    assert len(store.lookup(ident, ns, tokens, sources=v2).hits) == 1  # the sys chunk
    assert store.lookup(ident, ns, tokens).hits == []  # no sources: other keys
    pending = store.prepare_put(ident, ns, tokens, kv, sources=v2)
    assert store.commit_put(pending).stored == 2
    assert store.invalidate(source=doc, before_version=2) == 2  # v1's, not v2's
    assert len(store.lookup(ident, ns, tokens, sources=v1).hits) == 1
    assert len(store.lookup(ident, ns, tokens, sources=v2).hits) == 3
    assert store.invalidate(source=Source(doc, 1)) == 0
    assert store.invalidate(source=Source(doc, 2)) == 2
    assert len(store.lookup(ident, ns, tokens, sources=v2).hits) == 1
    with pytest.raises(InvalidArgument, match="names one version"):
        store.invalidate(source=Source(doc, 2), before_version=3)
    with pytest.raises(InvalidArgument, match="sources"):
        store.lookup(ident, ns, tokens, sources=["sys@0"])  # type: ignore[list-item]


def test_invalidate_every_weights_version_but_one(store: Store, ns: Namespace) -> None:
    tokens, kv = prompt_kv(22, 2 * N)
    model = f"m-{ns.name}"
    idents = [tiny_identity(model_id=model, weights_digest=f"w{v}") for v in range(3)]
    for ident in idents:
        assert store.put_prompt(ident, ns, tokens, kv).stored == 2
    assert store.invalidate(model=model, keep_weights_digest="w2") == 4
    assert [len(store.lookup(i, ns, tokens).hits) for i in idents] == [0, 0, 2]
    assert store.invalidate(model=model, weights_digest="w2") == 2
    with pytest.raises(InvalidArgument, match="needs a model"):
        store.invalidate(keep_weights_digest="w2")


def test_check_audits_the_tiers(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(19, 2 * N)
    store.put_prompt(ident, ns, tokens, kv)
    store.flush()
    report = store.check()
    assert report.clean and report.ok >= 2 and report.problems == []


def test_bad_arguments_are_typed_errors_from_either_store(store: Store, ns: Namespace) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(20, 2 * N)
    with pytest.raises(InvalidArgument, match="identity must be a ModelIdentity"):
        store.lookup("tiny", ns, tokens)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"Namespace\.parse"):
        store.put_prompt(ident, str(ns), tokens, kv)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="accept must be an Accept"):
        store.lookup(ident, ns, tokens, accept="lossy")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="token ids"):
        store.lookup(ident, ns, [-1] * N)
    with pytest.raises(InvalidArgument, match="start must be an int position >= 0"):
        store.lookup(ident, ns, tokens, start=-N)
    with pytest.raises(InvalidArgument, match="at least one criterion"):
        store.invalidate()
    with pytest.raises(InvalidArgument, match="no tier"):
        store.evict("nvme", 1)
    store.put_prompt(ident, ns, tokens, kv)
    lk = store.lookup(ident, ns, tokens)
    with pytest.raises(InvalidArgument, match="load depth"):
        store.load_async(lk, depth=0)
    with pytest.raises(InvalidArgument, match="output buffers"):
        store.load_async(lk, [np.zeros(TINY.chunk_shape, np.float16)])
    assert store.info().objects_by_state["tentative"] == 0


def test_the_suite_calls_every_method() -> None:
    """Every public member of StoreAPI is called by a test of this suite."""
    source = Path(__file__).read_text(encoding="utf-8")
    members = {n for n in vars(StoreAPI) if not n.startswith("_")} | {"__enter__", "__exit__"}
    called = {"__enter__", "__exit__"} if "with store as" in source else set()
    called |= {n for n in members if f"store.{n}" in source}
    assert members - called == set(), f"no contract test calls {sorted(members - called)}"


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
