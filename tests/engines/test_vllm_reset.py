"""vLLM's ``reset_prefix_cache(reset_connector=True)`` reaches every tier of kvlife
(issue 26; vLLM #57727 reported a CPU tier still serving after ``/reset_prefix_cache``):
the scheduler-side connector's reset (``KVLifeConnector.reset_cache`` calls
``SchedulerSide.reset``) drives a real ``kvlife serve`` process; after it no tier holds
or serves the engine's chunks, and the next run recomputes (outputs unchanged) and
stores them again. No vLLM needed: the engine is :mod:`tests.engines.vllm_fakes`'s step
loop (a real vLLM run of the same mapping is in tests/vllm/test_reset_e2e.py)."""

from __future__ import annotations

from pathlib import Path

from kvlife.core.identity import PUBLIC, prompt_chunk_keys
from tests.engines.vllm_fakes import CHUNK, MiniEngine, identities, reference_outputs
from tests.server.conftest import ServerProc

P = [(5 * i + 1) % 977 for i in range(3 * CHUNK + 5)]
IDS = identities(2)


def test_a_vllm_prefix_cache_reset_empties_every_tier_of_the_served_store(
    tmp_path: Path,
) -> None:
    srv = ServerProc(tmp_path / "store").start()
    clients = [srv.client() for _ in range(3)]
    try:
        sched, w0, w1 = clients
        engine = MiniEngine(sched, [w0, w1])
        assert engine.serve(P, 4) == reference_outputs(P, 4)
        sched.flush()  # every chunk in DRAM and on disk
        keys = [prompt_chunk_keys(i, PUBLIC, P) for i in IDS]
        assert all(len(sched.lookup(i, PUBLIC, P).hits) == 3 for i in IDS)
        before = sched.counters
        stored = sched.info().objects_by_state["indexed"]  # both ranks' (decode saves too)
        assert stored >= 6
        removed = engine.scheduler.reset()
        assert removed == stored
        assert engine.scheduler.counters.resets == 1
        after = sched.counters
        for tier in ("dram", "disk"):
            freed = after.tier(tier).invalidated_bytes - before.tier(tier).invalidated_bytes
            assert freed == stored * IDS[0].layout.chunk_nbytes, tier
        info = sched.info()
        assert info.objects_by_state.get("indexed", 0) == 0
        assert all(t.replicas == 0 for t in info.tiers), info.tiers
        for ident, ks in zip(IDS, keys, strict=True):
            assert sched.lookup(ident, PUBLIC, P).hits == [], ks
        hits = engine.scheduler.counters.hit_tokens
        assert engine.serve(P, 4) == reference_outputs(P, 4)
        assert engine.scheduler.counters.hit_tokens == hits  # recomputed, not loaded
        assert all(len(sched.lookup(i, PUBLIC, P).hits) == 3 for i in IDS)  # stored again
    finally:
        for c in clients:
            c.close()
        srv.stop()
