"""Keys computed by clients under ``kvlife serve --tenants`` (issue 24, "every engine
path carries the tenant"): the vLLM connector's save of a prompt's later chunks chains
them after a parent key it computes itself (``kvlife.engines.vllm.worker``,
``prompt_chunk_keys`` of the unkeyed namespace). With principals only the server can
compute keys, so that chain is one no lookup follows: misses, never wrong KV; the
connector's ``cache_salt`` as a ``request`` scope is the principal's own, keyed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvlife.core.identity import Namespace, NamespaceKind, prompt_chunk_keys
from tests.conftest import prompt_kv, tiny_identity
from tests.server.tenants import USER, as_, tenant_server, write_config

IDENT = tiny_identity()


def test_a_parent_key_the_client_computes_is_a_chain_no_lookup_finds(tmp_path: Path) -> None:
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml")).start()
    tokens, kv = prompt_kv(21, 64)
    n = IDENT.layout.tokens_per_chunk
    try:
        with as_(srv, "alice") as alice:
            ns = USER["alice"]
            first = alice.put_prompt(IDENT, ns, tokens[: 2 * n], kv[:, :, :, : 2 * n])
            assert first.stored == 2
            # the connector's own parent key: the unkeyed namespace's, not the server's
            mine = prompt_chunk_keys(IDENT, ns, tokens[: 2 * n])[-1]
            assert mine != first.keys[-1]
            later = alice.put_prompt(
                IDENT, ns, tokens[2 * n :], kv[:, :, :, 2 * n :], start=2 * n, parent=mine
            )
            assert later.stored == 2  # stored, under a chain nobody's lookup reaches
            hit = alice.lookup(IDENT, ns, tokens)
            assert len(hit.hits) == 2  # the first two chunks only: the rest a miss
            got = alice.load(hit)
            assert all(
                np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
                for i, a in enumerate(got.arrays)
            )
            # the parent key the server computed chains them: what the connector would
            # need to ask the server for
            keyed = alice.put_prompt(
                IDENT, ns, tokens[2 * n :], kv[:, :, :, 2 * n :], start=2 * n,
                parent=first.keys[-1],
            )  # fmt: skip
            assert keyed.stored == 2 and len(alice.lookup(IDENT, ns, tokens).hits) == 4
            # a cache_salt as a request scope: the principal's own, keyed by the server
            salted = Namespace(NamespaceKind.REQUEST, "salt-1")
            assert alice.put_prompt(IDENT, salted, tokens, kv).stored == 4
            assert len(alice.lookup(IDENT, salted, tokens).hits) == 4
    finally:
        srv.stop()
