"""Prometheus metrics scraped over HTTP from a real ``kvlife serve --metrics`` process
(and from the embedded store's registry): the figures are what the test did, a tenant's
name never appears, and a corrupt replica caught shows in its counter."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import InvalidArgument, NotPermitted
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind
from kvlife.results import StoreCounters, TierCounters
from kvlife.server.address import parse_address
from kvlife.server.prometheus import (
    STORE_COUNTERS,
    TIER_COUNTERS,
    registry_for,
    serve,
)
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.ops.corrupt import store_with_a_flipped_payload
from tests.ops.servers import metrics_server, scrape, scrape_text, value
from tests.server.conftest import ServerProc
from tests.server.tenants import ORG, TOKENS, USER, write_config

CHUNK = TINY.num_layers * 2 * TINY.num_kv_heads * TINY.tokens_per_chunk * TINY.head_dim * 2
"""Bytes of one TINY chunk (float16)."""
N = TINY.tokens_per_chunk
ACME = Namespace(NamespaceKind.ORGANISATION, "acme")
REQ = Namespace(NamespaceKind.REQUEST, "r-17")


def test_every_store_counter_is_exported() -> None:
    assert set(STORE_COUNTERS) == {f.name for f in fields(StoreCounters)} - {"per_tier"}
    assert set(TIER_COUNTERS) == {f.name for f in fields(TierCounters)}


def test_a_served_store_exports_what_was_done(tmp_path: Path) -> None:
    srv, url = metrics_server(tmp_path / "store")
    try:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0/metrics")
        ident = tiny_identity()
        store = srv.client()
        try:
            a_tokens, a_kv = prompt_kv(1, 3 * N)
            b_tokens, b_kv = prompt_kv(2, 2 * N)
            c_tokens, _ = prompt_kv(3, 4 * N)
            assert store.put_prompt(ident, ACME, a_tokens, a_kv).stored == 3
            assert store.put_prompt(ident, REQ, b_tokens, b_kv).stored == 2
            hit = store.lookup(ident, ACME, a_tokens)
            assert len(hit.hits) == 3
            got = store.load(hit)
            assert got.loaded == 3
            for i, arr in enumerate(got.arrays):  # what is counted was served right
                assert np.array_equal(arr, a_kv[:, :, :, i * N : (i + 1) * N])
            assert store.lookup(ident, ACME, c_tokens).hits == []  # 4 chunks missed
            m = scrape(url)
            info = {t.name: t for t in store.info().tiers}
        finally:
            store.close()
        assert value(m, "kvlife_puts_total") == 2
        assert value(m, "kvlife_chunks_stored_total") == 5
        assert value(m, "kvlife_lookups_total") == 2
        assert value(m, "kvlife_lookup_hit_chunks_total") == 3
        assert value(m, "kvlife_lookup_miss_chunks_total") == 4
        assert value(m, "kvlife_loads_total") == 1
        assert value(m, "kvlife_loaded_bytes_total") == 3 * CHUNK
        # hits and misses by tier: DRAM served the 3, neither tier had the 4
        assert value(m, "kvlife_tier_hits_total", tier="dram") == 3
        assert value(m, "kvlife_tier_hits_total", tier="disk") == 0
        assert value(m, "kvlife_tier_misses_total", tier="dram") == 4
        assert value(m, "kvlife_tier_misses_total", tier="disk") == 4
        assert value(m, "kvlife_tier_loaded_bytes_total", tier="dram") == 3 * CHUNK
        # the arena's footprint (whole pages), as `kvlife info` says
        assert value(m, "kvlife_tier_used_bytes", tier="dram") == info["dram"].used_bytes > 0
        assert value(m, "kvlife_tier_replicas", tier="dram") == 5
        assert value(m, "kvlife_tier_capacity_bytes", tier="disk") == 64 << 20
        # per namespace: the organisation by name, request namespaces as one
        for ns, n in (("organisation:acme", 3), ("request", 2)):
            assert value(m, "kvlife_objects", state="indexed", namespace=ns) == n
            assert value(m, "kvlife_object_bytes", state="indexed", namespace=ns) == n * CHUNK
            assert value(m, "kvlife_namespace_bytes", tier="dram", namespace=ns) == n * CHUNK
            assert value(m, "kvlife_objects", state="invalidated", namespace=ns) == 0
        assert value(m, "kvlife_tentative_objects") == 0
        assert value(m, "kvlife_corrupt_replicas_total") == 0
        # the server's own: connections, leases, latency histograms per request
        assert value(m, "kvlife_client_connections") == 1  # the scrape ran with it open
        assert value(m, "kvlife_leases", kind="put") == 0
        assert value(m, "kvlife_lookup_seconds_count") == 2
        assert value(m, "kvlife_load_seconds_count") == 1
        assert value(m, "kvlife_load_seconds_bucket", le="+Inf") == 1
        assert value(m, "kvlife_store_seconds_count", phase="commit") == 2
        assert 0 < value(m, "kvlife_load_seconds_sum") < 30
        text = scrape_text(url)
        assert "r-17" not in text  # a request's namespace is never a label of its own
    finally:
        assert srv.stop() == 0


def test_a_tenant_name_never_appears(tmp_path: Path) -> None:
    config = write_config(tmp_path / "tenants.toml")
    srv, url = metrics_server(tmp_path / "store", "--tenants", str(config), bare=True)
    assert url.startswith("http://127.0.0.1:")
    try:
        ident = tiny_identity()
        alice = RemoteStore(srv.socket, timeout=30, token=TOKENS["alice"])
        try:
            tokens, kv = prompt_kv(4, 2 * N)
            assert alice.put_prompt(ident, ORG["alice"], tokens, kv).stored == 2
            other, okv = prompt_kv(5, 1 * N)
            assert alice.put_prompt(ident, USER["alice"], other, okv).stored == 1
            assert alice.load(alice.lookup(ident, ORG["alice"], tokens)).loaded == 2
            with pytest.raises(NotPermitted, match="admin"):  # kvlife top's view: an admin's
                alice.server_stats()
            text = scrape_text(url)
        finally:
            alice.close()
        m = scrape(url)
        for name in ("alice", "acme", "bob", "globex", TOKENS["alice"]):
            assert name not in text
        assert value(m, "kvlife_objects", state="indexed", namespace="tenants") == 3
        assert value(m, "kvlife_chunks_stored_total") == 3
    finally:
        assert srv.stop() == 0


def test_a_corrupt_replica_caught_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "store"
    ident, tokens, keys = store_with_a_flipped_payload(path)
    srv, url = metrics_server(path)
    try:
        before = scrape(url)
        assert value(before, "kvlife_corrupt_replicas_total") == 0
        assert value(before, "kvlife_recovered_objects_total") == 3
        store = srv.client()
        try:
            got = store.load(store.lookup(ident, PUBLIC, tokens))
        finally:
            store.close()
        assert got.loaded == 1 and got.corrupt == [keys[1]]
        m = scrape(url)
        assert value(m, "kvlife_corrupt_replicas_total") == 1
        assert value(m, "kvlife_read_errors_total") == 0
        assert value(m, "kvlife_tier_hits_total", tier="disk") == 1
        # chunk 1 was retired; chunk 2 after it stays indexed (it is whole)
        assert value(m, "kvlife_objects", state="indexed", namespace="public") == 2
    finally:
        assert srv.stop() == 0


def test_the_embedded_store_exports_the_same_registry(tmp_path: Path) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(7, 2 * N)
    with KVStore.open(tmp_path / "store", dram_bytes=1 << 20, disk_bytes=8 << 20) as store:
        store.put_prompt(ident, ACME, tokens, kv)
        assert store.load(store.lookup(ident, ACME, tokens)).loaded == 2
        http = serve(registry_for(store))
        try:
            m = scrape(http.url)
        finally:
            http.close()
    assert value(m, "kvlife_chunks_stored_total") == 2
    assert value(m, "kvlife_tier_hits_total", tier="dram") == 2
    assert value(m, "kvlife_objects", state="indexed", namespace="organisation:acme") == 2
    assert not any(name.startswith("kvlife_client") for name, _ in m)  # a server's only


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        (":9400", ("127.0.0.1", 9400)),
        ("9400", ("127.0.0.1", 9400)),
        ("[::1]:80", ("::1", 80)),
    ],
)
def test_metrics_addresses(text: str, want: tuple[str, int]) -> None:
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["host:port", "127.0.0.1:70000", "127.0.0.1:-1"])
def test_a_bad_metrics_address_is_named(text: str) -> None:
    with pytest.raises(InvalidArgument, match="--metrics"):
        parse_address(text)


def test_a_metrics_port_in_use_is_refused_by_name(tmp_path: Path) -> None:
    """The server does not start half-way: the store is closed again, its lock released
    (a second server of the same directory then starts)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        srv = ServerProc(tmp_path / "store", extra=("--metrics", f"127.0.0.1:{port}"))
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            srv.start()
        assert srv.proc is not None and srv.proc.wait(timeout=60) == 1
    finally:
        taken.close()
    again, _ = metrics_server(tmp_path / "store")
    assert again.stop() == 0
