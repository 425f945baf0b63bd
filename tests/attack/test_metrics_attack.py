"""Attacks on the Prometheus exporter (kvlife/server/prometheus.py, ``--metrics``): no
tenant's name, organisation, adapter id or request id appears in a scrape of a server
with principals, whatever namespaces and identities its clients use; and scrapes while
four client processes put and load neither deadlock the store nor stall the clients."""

from __future__ import annotations

import time
from pathlib import Path

from kvlife.client import RemoteStore
from kvlife.core.identity import Namespace, NamespaceKind
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.ops.servers import metrics_server, scrape, scrape_text, value
from tests.server.conftest import ClientProc
from tests.server.tenants import ORG, TOKENS, USER, write_config

N = TINY.tokens_per_chunk


def test_held_no_tenant_adapter_or_request_name_in_a_scrape(tmp_path: Path) -> None:
    config = write_config(tmp_path / "tenants.toml")
    srv, url = metrics_server(tmp_path / "store", "--tenants", str(config))
    secret_words = ["alice", "acme", "bob", "globex", "zork", TOKENS["alice"], TOKENS["bob"]]
    try:
        lora = tiny_identity(adapter_id="alice-zork-lora", adapter_digest="acme-digest")
        with (
            RemoteStore(srv.socket, timeout=30, token=TOKENS["alice"]) as alice,
            RemoteStore(srv.socket, timeout=30, token=TOKENS["bob"]) as bob,
        ):
            scopes = [
                (alice, ORG["alice"], lora),
                (alice, USER["alice"], tiny_identity(model_id="m")),
                (alice, Namespace(NamespaceKind.REQUEST, "alice-req-zork"), lora),
                (bob, USER["bob"], tiny_identity()),
                (bob, Namespace(NamespaceKind.ORGANISATION, "globex"), tiny_identity()),
            ]
            for i, (who, ns, ident) in enumerate(scopes):
                tokens, kv = prompt_kv(20 + i, 2 * N)
                assert who.put_prompt(ident, ns, tokens, kv, request_id=f"zork-{i}").stored == 2
                assert who.load(who.lookup(ident, ns, tokens)).loaded == 2
                who.invalidate(namespace=ns, adapter_id="alice-zork-lora")
            text = scrape_text(url)
        for word in secret_words:
            assert word not in text, word
        m = scrape(url)
        assert value(m, "kvlife_chunks_stored_total") == 10
    finally:
        assert srv.stop() == 0


CLIENT = """
import sys, time
import numpy as np
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC
from tests.conftest import prompt_kv, tiny_identity
seed = int(sys.stdin.readline())
ident = tiny_identity()
done = 0
with RemoteStore(sys.argv[1], timeout=60) as store:
    deadline = time.monotonic() + 6
    i = 0
    while time.monotonic() < deadline:
        tokens, kv = prompt_kv(seed * 1000 + i % 40, 64)
        store.put_prompt(ident, PUBLIC, tokens, kv)
        got = store.load(store.lookup(ident, PUBLIC, tokens))
        assert got.loaded == 4 or got.loaded == 0
        if got.loaded:
            assert np.array_equal(np.concatenate(got.arrays, axis=3), kv)
        i += 1
        done += 1
print(done, flush=True)
"""


def test_held_scrapes_under_four_clients_putting_and_loading_never_stall(tmp_path: Path) -> None:
    srv, url = metrics_server(tmp_path / "store")
    clients = [ClientProc(CLIENT, srv.socket) for _ in range(4)]
    try:
        for i, c in enumerate(clients):
            c.send(str(i + 1))
        scrapes = 0
        worst = 0.0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            m = scrape(url)
            worst = max(worst, time.monotonic() - t0)
            assert value(m, "kvlife_tier_used_bytes", tier="dram") >= 0
            scrapes += 1
        done = [int(c.line()) for c in clients]
        assert all(d > 0 for d in done), done
        assert all(c.close() == 0 for c in clients)
        assert scrapes > 3 and worst < 20, (scrapes, worst)
        final = scrape(url)
        assert value(final, "kvlife_puts_total") == sum(done)
    finally:
        for c in clients:
            c.close()
        assert srv.stop() == 0
