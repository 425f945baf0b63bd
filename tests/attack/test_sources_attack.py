"""Attacks on upstream sources in chunk identity and invalidation by source
(kvlife/core/sources.py, core/identity.py, store/invalidation.py, globalindex/rules.py,
the server's ``invalidate``): bad sources are typed errors that leave nothing, an
invalidation by source reaches every chunk chained after a dependent one on every host
(a continuation put with ``parent=`` and no spans included), and a tenant's invalidation
by source never reaches another tenant's chunks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import InvalidArgument, KVLifeError, NotPermitted
from kvlife.core.identity import PUBLIC, prompt_chunk_keys
from kvlife.core.sources import MAX_SPANS, Source, SourceSpan
from kvlife.globalindex.rules import InvalidationRule
from kvlife.store import KVStore
from kvlife.tiers.redis.server import RedisServer
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.remote.fleet import ACME, Fleet
from tests.server.conftest import ServerProc
from tests.server.tenants import ORG, USER, as_, tenant_server, write_config

N = TINY.tokens_per_chunk


def _open(path: Path) -> KVStore:
    return KVStore.open(path, dram_bytes=1 << 22, disk_bytes=0)


# ---------------------------------------------------------------------- bad sources


def test_a_source_name_with_a_lone_surrogate_is_a_typed_error_leaving_nothing(
    tmp_path: Path,
) -> None:
    """The name check encodes with ``surrogatepass`` (a lone surrogate passes), the key
    encodes strictly: the put failed with a UnicodeEncodeError, not InvalidArgument."""
    store = _open(tmp_path / "s")
    tokens, kv = prompt_kv(1, 4 * N)
    try:
        with pytest.raises(InvalidArgument):
            src = Source("doc\ud800")
            store.put_prompt(tiny_identity(), PUBLIC, tokens, kv, sources=[SourceSpan(src, 0, N)])
        assert store.lookup(tiny_identity(), PUBLIC, tokens).tokens == 0
        assert sum(store.info().objects_by_state.values()) == 0
    finally:
        store.close()


def test_held_too_many_spans_and_bad_spans_are_typed_and_leave_nothing(tmp_path: Path) -> None:
    store = _open(tmp_path / "s")
    tokens, kv = prompt_kv(2, 4 * N)
    bad: list[object] = [
        [SourceSpan(Source(f"d{i}"), i, i + 1) for i in range(MAX_SPANS + 1)],
        "doc@1",
        [("doc", 1, 0, 4)],
        [SourceSpan(Source("d"), 0, 4), None],
    ]
    try:
        for spans in bad:
            with pytest.raises(InvalidArgument):
                store.put_prompt(tiny_identity(), PUBLIC, tokens, kv, sources=spans)  # type: ignore[arg-type]
        for make in (
            lambda: SourceSpan(Source("d"), 5, 5),
            lambda: SourceSpan(Source("d"), -1, 5),
            lambda: Source("d@1"),
            lambda: Source("d", 1 << 64),
        ):
            with pytest.raises(InvalidArgument):
                make()
        with pytest.raises(InvalidArgument, match="needs a model"):
            store.invalidate(keep_weights_digest="w0", weights_digest="w0")
        assert sum(store.info().objects_by_state.values()) == 0
    finally:
        store.close()


def test_held_spans_beyond_the_prompt_or_out_of_order_change_no_chunk_they_do_not_reach(
    tmp_path: Path,
) -> None:
    """Spans in any order give the same keys; a span past the prompt's end and one that
    starts before ``start`` change exactly the chunks the dependency rule says."""
    ident = tiny_identity()
    tokens, _ = prompt_kv(3, 4 * N)
    a, b = SourceSpan(Source("a", 1), 0, N), SourceSpan(Source("b", 1), 2 * N, 3 * N)
    assert prompt_chunk_keys(ident, PUBLIC, tokens, sources=[a, b]) == prompt_chunk_keys(
        ident, PUBLIC, tokens, sources=[b, a]
    )
    past = SourceSpan(Source("z", 1), 10 * N, 11 * N)
    assert prompt_chunk_keys(ident, PUBLIC, tokens, sources=[a]) == prompt_chunk_keys(
        ident, PUBLIC, tokens, sources=[a, past]
    )
    # a span before start counts for every chunk (attention reads it)
    keys = prompt_chunk_keys(ident, PUBLIC, tokens, start=8 * N, sources=[a])
    plain = prompt_chunk_keys(ident, PUBLIC, tokens, start=8 * N)
    assert not set(keys) & set(plain)


# ---------------------------------------------------------------------- shared tier


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServer, index_ns: str) -> Iterator[Fleet]:
    f = Fleet(tmp_path, "redis", redis_server.url, index_ns)
    yield f
    f.close()


def test_a_continuation_without_spans_is_invalidated_on_every_host(fleet: Fleet) -> None:
    """B puts a prompt built from ``doc@1`` and continues it with ``parent=`` and no
    spans, and publishes both; A invalidates ``doc``. C never held either: its probe of
    the shared tier judged each record by its own sources only, so it adopted the
    continuation (KV chained after ``doc@1``) after the invalidation returned."""
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    ident = tiny_identity()
    spans = [SourceSpan(Source("sys"), 0, N), SourceSpan(Source("doc", 1), N, 4 * N)]
    tokens, kv = prompt_kv(7, 4 * N)
    more, more_kv = prompt_kv(8, 2 * N)
    keys = b.put_prompt(ident, ACME, tokens, kv, sources=spans).keys
    assert len(keys) == 4
    b.put_prompt(ident, ACME, more, more_kv, start=4 * N, parent=keys[-1])
    b.flush()
    # before the rule, a host holding the chain before the continuation adopts it whole
    d = fleet.host("d")
    assert d.load(d.lookup(ident, ACME, tokens, sources=spans)).loaded == 4
    res = d.lookup(ident, ACME, more, start=4 * N, parent=keys[-1])
    assert d.load(res).loaded == 2
    assert a.invalidate(source="doc", before_version=2) == 0  # A holds none itself
    for host in (c, d, b, a):
        res = host.lookup(ident, ACME, more, start=4 * N, parent=keys[-1])
        got = host.load(res)
        assert got.loaded == 0, f"host served {got.loaded} chunks chained after doc@1"


@pytest.mark.parametrize(
    "how",
    [
        {"source": "doc"},  # every version: [0, 2**64)
        {"source": Source("doc", (1 << 64) - 1)},  # the last version: [v, 2**64)
        {"source": "doc", "before_version": 1 << 64},
    ],
    ids=["every-version", "last-version", "before-2**64"],
)
def test_an_invalidation_reaching_the_last_version_works_with_a_shared_tier(
    fleet: Fleet, how: dict[str, object]
) -> None:
    """A source's versions run to 2**64 (exclusive): the rule's stored form packed that
    bound as a msgpack int, which holds at most 2**64 - 1, so ``invalidate(source=name)``
    on any host with a shared tier raised OverflowError and invalidated nothing."""
    rule = InvalidationRule(1, source="doc", versions=(0, 1 << 64))
    assert InvalidationRule.from_body(1, "i", rule.body()).versions == (0, 1 << 64)
    a, b = fleet.host("a"), fleet.host("b")
    ident = tiny_identity()
    top = (1 << 64) - 1
    spans = [SourceSpan(Source("sys"), 0, N), SourceSpan(Source("doc", top), N, 4 * N)]
    tokens, kv = prompt_kv(9, 4 * N)
    assert b.put_prompt(ident, ACME, tokens, kv, sources=spans).stored == 4
    b.flush()
    assert a.invalidate(**how) == 0  # type: ignore[arg-type]
    for host in (b, a):
        res = host.lookup(ident, ACME, tokens, sources=spans)
        assert host.load(res).loaded == 1  # the sys chunk only


# ---------------------------------------------------------------------- cleanup of bad puts


def test_held_a_put_with_bad_spans_through_the_store_is_not_partial(tmp_path: Path) -> None:
    """A span list that fails half-way through its items is refused before any chunk."""
    store = _open(tmp_path / "s")
    tokens, kv = prompt_kv(4, 4 * N)
    spans: list[object] = [SourceSpan(Source("d", 1), 0, N)] * 3 + [b"x"]
    try:
        with pytest.raises(KVLifeError):
            store.put_prompt(tiny_identity(), PUBLIC, tokens, kv, sources=spans)  # type: ignore[arg-type]
        assert store.lookup(tiny_identity(), PUBLIC, tokens).tokens == 0
        assert np.all(store.lookup(tiny_identity(), PUBLIC, tokens[:N]).tokens == 0)
    finally:
        store.close()


# ---------------------------------------------------------------------- tenants, served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServerProc]:
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "tenants.toml")).start()
    yield srv
    srv.stop()


def test_held_a_tenants_invalidation_by_source_or_weights_stays_in_its_namespaces(
    served: ServerProc,
) -> None:
    """alice and bob put the same prompt built from ``doc@1``; bob invalidates ``doc``
    (and every weights version but one) in his namespace only: alice's chunks stay;
    without a namespace, or naming alice's, he is refused; keep_weights_digest without
    model is a typed error through the wire."""
    ident = tiny_identity()
    spans = [SourceSpan(Source("sys"), 0, N), SourceSpan(Source("doc", 1), N, 4 * N)]
    tokens, kv = prompt_kv(11, 4 * N)
    with as_(served, "alice") as alice, as_(served, "bob") as bob:
        assert alice.put_prompt(ident, ORG["alice"], tokens, kv, sources=spans).stored == 4
        assert bob.put_prompt(ident, USER["bob"], tokens, kv, sources=spans).stored == 4
        for how in ({"source": "doc"}, {"model": "tiny", "keep_weights_digest": "w9"}):
            with pytest.raises(NotPermitted):
                bob.invalidate(**how)  # type: ignore[arg-type]
            with pytest.raises(NotPermitted):
                bob.invalidate(namespace=ORG["alice"], **how)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            bob.invalidate(namespace=USER["bob"], keep_weights_digest="w0")
        with pytest.raises(InvalidArgument):
            bob.invalidate(namespace=USER["bob"], source="doc@1")
        assert bob.invalidate(namespace=USER["bob"], source="doc", before_version=2) == 3
        got = alice.lookup(ident, ORG["alice"], tokens, sources=spans)
        assert alice.load(got).loaded == 4
        assert bob.load(bob.lookup(ident, USER["bob"], tokens, sources=spans)).loaded == 1
        assert bob.invalidate(namespace=USER["bob"], model="tiny", keep_weights_digest="w9") == 1
        assert alice.load(alice.lookup(ident, ORG["alice"], tokens, sources=spans)).loaded == 4


# ---------------------------------------------------------------------- puts racing, served


def test_held_a_served_put_racing_invalidate_by_source_is_all_or_nothing(tmp_path: Path) -> None:
    """Through a real ``kvlife serve`` whose client put share is a few pages (so each
    8-chunk put goes in pieces): one client puts new prompts built from ``doc@1`` while another
    invalidates ``doc`` again and again. Afterwards every prompt whose put returned
    before the last invalidation began is gone, each prompt is stored whole or not at
    all, and no chunk is stored that no prompt reaches. A prepared put committed after
    an invalidation returned stores nothing."""
    # a client's put share of a few pages: each 8-chunk put goes in pieces
    arena = (8 << 20) + (4 << 20)
    share = f"{6 * 4096 / arena:.8f}"
    srv = ServerProc(tmp_path / "s", dram=8 << 20, extra=("--session-put-share", share)).start()
    ident = tiny_identity()
    spans = [SourceSpan(Source("doc", 1), 0, 8 * N)]
    times: dict[int, tuple[float, float]] = {}
    starts: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def putter() -> None:
        try:
            with srv.client() as c:
                for i in range(40):
                    tokens, kv = prompt_kv(100 + i, 8 * N)
                    t0 = time.monotonic()
                    c.put_prompt(ident, PUBLIC, tokens, kv, sources=spans)
                    times[i] = (t0, time.monotonic())
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    def invalidator() -> None:
        try:
            with srv.client() as c:
                while not stop.is_set():
                    starts.append(time.monotonic())
                    c.invalidate(source="doc")
                    time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=putter), threading.Thread(target=invalidator)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        with srv.client() as c:
            assert c._puts.piece_chunks(ident.layout) < 8  # the puts went in pieces
        last = starts[-1]
        found = 0
        with srv.client() as c:
            for i, (_, end) in times.items():
                tokens, _ = prompt_kv(100 + i, 8 * N)
                hits = len(c.lookup(ident, PUBLIC, tokens, sources=spans).hits)
                assert hits in (0, 8), (i, hits)
                if end < last:
                    assert hits == 0, f"prompt {i} put before the last invalidation survived"
                found += hits
            indexed = c.info().objects_by_state.get("indexed", 0)
            assert indexed == found, (indexed, found)
            tokens, kv = prompt_kv(999, 2 * N)
            with srv.client() as other:
                pending = c.prepare_put(ident, PUBLIC, tokens, kv, sources=spans)
                other.invalidate(source="doc")
                c.commit_put(pending)
            assert c.lookup(ident, PUBLIC, tokens, sources=spans).hits == []
    finally:
        srv.stop()
