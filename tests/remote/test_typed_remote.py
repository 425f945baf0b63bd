"""A remote tier that transforms on demotion: the representation travels with the
publication record, so another host serves it as what it is (never as exact KV)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.store import Accept, KVStore, TierSpec
from kvlife.tiers.redis.server import RedisServer
from tests.conftest import prompt_kv, tiny_identity

NS = Namespace(NamespaceKind.ORGANISATION, "acme")


def _store(path: Path, redis: RedisServer, index_ns: str) -> KVStore:
    opts = {"url": redis.url, "index_namespace": index_ns}
    chain = (
        TierSpec("memory", "dram", 8 << 20),
        TierSpec("redis", "shared", 64 << 20, options=tuple(opts.items()), transform="int8"),
    )
    return KVStore.open(path, tiers=chain)


def test_a_lossy_remote_replica_is_served_as_lossy_on_another_host(
    tmp_path: Path, redis_server: RedisServer, index_ns: str
) -> None:
    tokens, kv = prompt_kv(5, 64)
    ident = tiny_identity()
    with _store(tmp_path / "a", redis_server, index_ns) as a:
        assert a.put_prompt(ident, NS, tokens, kv).stored == 4
        a.flush()  # published through the tier's int8 transform
    with _store(tmp_path / "b", redis_server, index_ns) as b:
        exact = b.lookup(ident, NS, tokens)
        assert exact.hits == []  # an int8 replica is not exact KV
        lossy = b.lookup(ident, NS, tokens, accept=Accept.lossy())
        assert [h.transform for h in lossy.hits] == ["int8"] * 4
        assert {h.exactness for h in lossy.hits} == {"lossy"}
        got = b.load(lossy)
        assert got.loaded == 4
        n = ident.layout.tokens_per_chunk
        for i, chunk in enumerate(got.arrays):
            want = kv[:, :, :, i * n : (i + 1) * n].astype(np.float32)
            err = np.abs(np.asarray(chunk, dtype=np.float32) - want).max()
            assert 0 < err < 0.1  # within int8's bound on unit-normal data, not bit-exact
