"""Keys computed by clients under ``kvlife serve --tenants`` (issue 24, "every engine
path carries the tenant"). With principals only the server can compute keys, so a
later chunk chained after a parent key the client computed itself (``prompt_chunk_keys``
of the unkeyed namespace) is one no lookup follows: misses, never wrong KV. What a
client does instead: chain after a key the server returned (a put's ``keys``), or name
the parent by every token before it (``prefix_tokens``), which the server keys in the
scope the request writes or, on a lookup, in each scope it searches. The vLLM
connector does the latter (tests/vllm/test_connector_tenants.py, a real vLLM); the
connector's ``cache_salt`` as a ``request`` scope is the principal's own, keyed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import Namespace, NamespaceKind, prompt_chunk_keys
from kvlife.store import KVStore
from tests.conftest import prompt_kv, tiny_identity
from tests.server.tenants import ORG, USER, as_, tenant_server, write_config

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


def test_a_parent_named_by_its_prefix_tokens_chains_in_the_keyed_scope(tmp_path: Path) -> None:
    """A prompt saved in three puts, each later one naming its parent by the tokens
    before it (as the vLLM connector saves a prompt prefilled over several steps): the
    owner's lookup hits every chunk, loads the bytes put; another principal's identical
    prompt and puts under the identical namespace text hit nothing of it."""
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml")).start()
    tokens, kv = prompt_kv(22, 96)
    n = IDENT.layout.tokens_per_chunk
    salted = Namespace(NamespaceKind.REQUEST, "conversation")
    try:
        with as_(srv, "alice") as alice, as_(srv, "bob") as bob:
            for lo, hi in ((0, 2), (2, 4), (4, 6)):
                res = alice.put_prompt(
                    IDENT, salted, tokens[lo * n : hi * n], kv[:, :, :, lo * n : hi * n],
                    start=lo * n, prefix_tokens=tokens[: lo * n],
                )  # fmt: skip
                assert res.stored == 2
            hit = alice.lookup(IDENT, salted, tokens)
            assert len(hit.hits) == 6
            got = alice.load(hit)
            assert all(
                np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
                for i, a in enumerate(got.arrays)
            )
            # a lookup of the later chunks alone, named by their prefix, finds them too
            later = alice.lookup(IDENT, salted, tokens[4 * n :], start=4 * n,
                                 prefix_tokens=tokens[: 4 * n])  # fmt: skip
            assert [h.key for h in later.hits] == [h.key for h in hit.hits[4:]]
            # bob: the identical prompt under the identical namespace text is his own scope
            assert bob.lookup(IDENT, salted, tokens).hits == []
            assert bob.lookup(IDENT, salted, tokens[2 * n :], start=2 * n,
                              prefix_tokens=tokens[: 2 * n]).hits == []  # fmt: skip
            mine = bob.put_prompt(IDENT, salted, tokens[2 * n : 4 * n], kv[:, :, :, 2 * n : 4 * n],
                                  start=2 * n, prefix_tokens=tokens[: 2 * n])  # fmt: skip
            assert mine.stored == 2 and not set(mine.keys) & {h.key for h in hit.hits}
            assert bob.lookup(IDENT, salted, tokens).hits == []  # his chain lacks chunks 0-1
    finally:
        srv.stop()


def test_a_lookup_by_prefix_tokens_derives_the_parent_in_every_scope_it_searches(
    tmp_path: Path,
) -> None:
    """A parent key belongs to one scope's chain; a prefix names the parent in each: a
    lookup that names its user scope (where nothing is) finds the later chunks in its
    organisation's scope, which a parent derived in the user scope would not reach."""
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml")).start()
    tokens, kv = prompt_kv(23, 64)
    n = IDENT.layout.tokens_per_chunk
    try:
        with as_(srv, "alice") as alice:
            org = alice.put_prompt(IDENT, ORG["alice"], tokens, kv)
            assert org.stored == 4
            by_prefix = alice.lookup(IDENT, USER["alice"], tokens[2 * n :], start=2 * n,
                                     prefix_tokens=tokens[: 2 * n])  # fmt: skip
            assert len(by_prefix.hits) == 2
            assert [h.key for h in by_prefix.hits] == list(org.keys[2:])
    finally:
        srv.stop()


@pytest.mark.parametrize("served", [False, True])
def test_a_prefix_that_is_not_every_token_before_start_is_refused(
    tmp_path: Path, served: bool
) -> None:
    tokens, kv = prompt_kv(24, 64)
    n = IDENT.layout.tokens_per_chunk
    ns = USER["alice"]
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml")) if served else None
    if srv is not None:
        srv.start()
    store = as_(srv, "alice") if srv is not None else KVStore.open(tmp_path / "embedded")
    later, later_kv = tokens[2 * n :], kv[:, :, :, 2 * n :]
    try:
        with store:
            bad = [
                {"start": 2 * n, "prefix_tokens": tokens[:n]},  # too short
                {"start": n // 2, "prefix_tokens": tokens[: n // 2]},  # not a chunk boundary
                {"start": 2 * n, "prefix_tokens": tokens[: 2 * n], "parent": b"\1" * 32},
                {"start": 2 * n, "prefix_tokens": 2 * n},  # not token ids
            ]
            for kw in bad:
                with pytest.raises(InvalidArgument):
                    store.put_prompt(IDENT, ns, later, later_kv, **kw)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgument):
                    store.lookup(IDENT, ns, later, **kw)  # type: ignore[arg-type]
            assert store.lookup(IDENT, ns, tokens).hits == []  # nothing stored
            # an empty prefix is the start of the sequence
            assert store.put_prompt(IDENT, ns, tokens, kv, prefix_tokens=[]).stored == 4
            assert len(store.lookup(IDENT, ns, tokens).hits) == 4
    finally:
        if srv is not None:
            srv.stop()


def test_a_session_that_maps_no_arena_prepares_by_holding_the_put(tmp_path: Path) -> None:
    """A token-only principal maps no arena, so ``prepare_put`` has no extents to copy
    into: the client holds the put (a copy of its chunks) and the commit sends it whole;
    nothing is visible before the commit, and an abort sends nothing (the vLLM
    connector stages every save with ``prepare_put``)."""
    srv = tenant_server(tmp_path / "store", write_config(tmp_path / "t.toml")).start()
    tokens, kv = prompt_kv(25, 64)
    n = IDENT.layout.tokens_per_chunk
    ns = USER["alice"]
    try:
        with as_(srv, "alice") as alice:
            chunks = [np.array(kv[:, :, :, i * n : (i + 1) * n]) for i in range(4)]
            dropped = alice.prepare_put(IDENT, ns, tokens[: 2 * n], chunks[:2])
            alice.abort_put(dropped, "the step failed")
            first = alice.prepare_put(IDENT, ns, tokens[: 2 * n], chunks[:2])
            later = alice.prepare_put(
                IDENT, ns, tokens[2 * n :], chunks[2:], start=2 * n, prefix_tokens=tokens[: 2 * n]
            )
            for c in chunks:
                c.fill(0)  # the held put copied them
            assert alice.lookup(IDENT, ns, tokens).hits == []  # nothing before the commit
            assert alice.commit_put(first).stored == 2
            assert alice.put_async(later).result().stored == 2
            hit = alice.lookup(IDENT, ns, tokens)
            got = alice.load(hit)
            assert len(got.arrays) == 4 and all(
                np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
                for i, a in enumerate(got.arrays)
            )
            with pytest.raises(InvalidArgument):
                alice.commit_put(first)  # finished once
    finally:
        srv.stop()
