"""Issue 26 on the shared remote tier: an invalidation by upstream source and one of
every weights version of a model but the current one are global rules (recorded in
the index, applied by every host at its next lookup, refused by every host's probe of
the shared tier), with in-process hosts on one real redis-server. The rules' stored
form is read back exactly; a host of format v1 reads one as an ``everything`` rule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ModelIdentity
from kvlife.core.sources import Source, SourceSpan
from kvlife.globalindex.rules import InvalidationRule
from kvlife.store import KVStore
from kvlife.tiers.redis.server import RedisServer
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.remote.fleet import ACME, Fleet

N = TINY.tokens_per_chunk
SEED = 5


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServer, index_ns: str) -> Iterator[Fleet]:
    f = Fleet(tmp_path, "redis", redis_server.url, index_ns)
    yield f
    f.close()


def _spans(doc: str, version: int) -> list[SourceSpan]:
    return [SourceSpan(Source("sys"), 0, N), SourceSpan(Source(doc, version), N, 4 * N)]


def _put(store: KVStore, spans: list[SourceSpan], ident: ModelIdentity | None = None) -> int:
    tokens, kv = prompt_kv(SEED, 4 * N)
    return store.put_prompt(ident or tiny_identity(), ACME, tokens, kv, sources=spans).stored


def _hits(store: KVStore, spans: list[SourceSpan], ident: ModelIdentity | None = None) -> int:
    tokens, _ = prompt_kv(SEED, 4 * N)
    res = store.lookup(ident or tiny_identity(), ACME, tokens, sources=spans)
    got = store.load(res)
    assert got.loaded == len(res.hits)
    return got.loaded


def test_a_source_rule_stops_every_host_serving_what_depends_on_it(fleet: Fleet) -> None:
    a, b, c, e = fleet.host("a"), fleet.host("b"), fleet.host("c"), fleet.host("e")
    old, new, other = _spans("doc", 1), _spans("doc", 2), _spans("doc:b", 1)
    for spans in (old, new, other):
        _put(b, spans)
    b.flush()  # published: C adopts them from the shared tier
    assert _hits(c, old) == 4 and _hits(c, other) == 4
    _put(e, old)  # E computes doc@1's KV before the rule, in its DRAM only
    assert a.invalidate(source="doc", before_version=2) == 0  # A holds none itself
    e.flush()  # published after the rule, before E read it: C must refuse it
    for host in (c, b, e, a):  # no host serves doc@1's chunks after its next lookup
        assert _hits(host, old) == 1  # the sys chunk depends on sys only
        assert _hits(host, new) == 4
        assert _hits(host, other) == 4
    assert c.invalidate(source=Source("doc", 2)) == 3  # what C adopted of doc@2
    assert _hits(b, new) == 1 and _hits(a, new) == 1
    assert _hits(b, other) == 4


def test_a_rule_keeping_one_weights_version_reaches_every_host(fleet: Fleet) -> None:
    a, b, c = fleet.host("a"), fleet.host("b"), fleet.host("c")
    d = fleet.host("d", disk=True)  # its own copies on its disk (flushed there)
    idents = [tiny_identity(weights_digest=f"w{v}") for v in range(3)]
    for host in (b, d):
        for ident in idents:
            assert _put(host, [], ident) == 4
        host.flush()
    assert [_hits(c, [], i) for i in idents] == [4, 4, 4]  # adopted from B's
    assert a.invalidate(model="tiny", keep_weights_digest="w2") == 0
    for host in (b, c, d, a):
        assert [_hits(host, [], i) for i in idents] == [0, 0, 4]
    for tier in ("dram", "disk"):  # D's tiers gave back both old versions
        assert d.counters.tier(tier).invalidated_bytes == 8 * TINY.chunk_nbytes, tier


def test_rules_with_sources_and_models_keep_their_criteria_in_the_stored_form() -> None:
    rules = [
        InvalidationRule(3, source="doc:1", versions=(0, 7), reason="re-ranked"),
        InvalidationRule(4, "organisation:acme", source="t", versions=(2, 3)),
        InvalidationRule(5, model="m", keep_weights_digest="w9"),
        InvalidationRule(6, weights_digest="w1"),
    ]
    for rule in rules:
        got = InvalidationRule.from_body(rule.epoch, "inc", rule.body())
        assert got == InvalidationRule(
            rule.epoch,
            rule.namespace,
            rule.adapter_id,
            rule.weights_digest,
            rule.prefix,
            rule.reason,
            "inc",
            source=rule.source,
            versions=rule.versions,
            model=rule.model,
            keep_weights_digest=rule.keep_weights_digest,
        )
    assert len(msgpack.unpackb(rules[3].body())) == 5  # the v1 form, unchanged
    # a sixth field this host cannot read: the rule covers everything older than it
    blob = msgpack.packb([None, None, None, None, "", {"tomorrow": 1}])
    assert InvalidationRule.from_body(7, "inc", blob).everything
    with pytest.raises(InvalidArgument, match="needs a model"):
        InvalidationRule(8, weights_digest="w0", keep_weights_digest="w1")
    with pytest.raises(InvalidArgument, match="versions"):
        InvalidationRule(9, model="m", versions=(0, 1))
