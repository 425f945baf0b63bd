"""Upstream sources (issue 26) through ``kvlife serve``: a source invalidation and a
"every weights version but the current one" invalidation sent by a client survive the
server being killed (SIGKILL of the real process) the moment they returned, and a
restarted server serves exactly what they left."""

from __future__ import annotations

from pathlib import Path

from kvlife.core.identity import PUBLIC
from kvlife.core.sources import Source, SourceSpan
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc

N = TINY.tokens_per_chunk


def _spans(doc: str, version: int) -> list[SourceSpan]:
    return [SourceSpan(Source("sys"), 0, N), SourceSpan(Source(doc, version), N, 3 * N)]


def test_a_source_invalidation_survives_a_killed_server(tmp_path: Path) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(1, 3 * N)
    prompts = {(doc, v): _spans(doc, v) for doc in ("doc:a", "doc:b") for v in (1, 2)}
    srv = ServerProc(tmp_path / "store").start()
    try:
        with srv.client() as c:
            for spans in prompts.values():
                c.put_prompt(ident, PUBLIC, tokens, kv, sources=spans)
            c.flush()  # on disk: the restart recovers them with their sources
        srv.kill()
        srv.start()
        with srv.client() as c:
            for spans in prompts.values():
                assert len(c.lookup(ident, PUBLIC, tokens, sources=spans).hits) == 3
            assert c.invalidate(source="doc:a", before_version=2) == 2
        srv.kill()  # no flush, no clean stop: durable when it returned
        srv.start()
        with srv.client() as c:
            got = {
                k: len(c.lookup(ident, PUBLIC, tokens, sources=s).hits) for k, s in prompts.items()
            }
            assert got == {("doc:a", 1): 1, ("doc:a", 2): 3, ("doc:b", 1): 3, ("doc:b", 2): 3}
            assert c.invalidate(source=Source("doc:b", 2)) == 2
            assert c.invalidate(source="doc:b") == 2
            assert c.invalidate(source="sys") == 3  # the shared chunk and doc:a@2's two
            assert c.info().objects_by_state.get("indexed", 0) == 0
    finally:
        srv.stop()


def test_other_weights_versions_go_on_every_tier_across_a_killed_server(tmp_path: Path) -> None:
    tokens, kv = prompt_kv(2, 2 * N)
    idents = [tiny_identity(model_id="m", weights_digest=f"w{v}") for v in range(3)]
    srv = ServerProc(tmp_path / "store").start()
    try:
        with srv.client() as c:
            for ident in idents:
                c.put_prompt(ident, PUBLIC, tokens, kv)
            c.flush()  # each chunk in DRAM and on disk
            assert c.invalidate(model="m", keep_weights_digest="w2") == 4
            counters = c.counters
            for tier in ("dram", "disk"):
                assert counters.tier(tier).invalidated_bytes == 4 * TINY.chunk_nbytes, tier
            assert [len(c.lookup(i, PUBLIC, tokens).hits) for i in idents] == [0, 0, 2]
        srv.kill()
        srv.start()
        with srv.client() as c:
            assert [len(c.lookup(i, PUBLIC, tokens).hits) for i in idents] == [0, 0, 2]
    finally:
        srv.stop()
