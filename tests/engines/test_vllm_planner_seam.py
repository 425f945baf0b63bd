"""The vLLM connector's scheduler side with the planner: ``matched`` (vLLM's
``get_num_new_matched_tokens``) offers the whole hit when the tier is fast, nothing when
recomputing is faster, a shorter prefix in between, and never offers again what vLLM's
own prefix cache holds; declined tokens are counted. (The connector builds its cost model
from the ``[planner]`` table of its ``kvlife.config``: tests/vllm/test_planner_e2e.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvlife.core.identity import PUBLIC
from kvlife.engines.vllm.identity import NamespacePolicy
from kvlife.engines.vllm.scheduler import SchedulerSide
from kvlife.planner import CostModel, PrefillProfile
from kvlife.store import KVStore
from tests.engines.vllm_fakes import BLOCK, CHUNK, FakeRequest, identities, oracle_kv


def _side(store: KVStore, spb: float | None, prefill: PrefillProfile) -> SchedulerSide:
    model = None
    if spb is not None:
        model = CostModel(prefill, CHUNK)
        model.tier("dram").per_byte.seed(spb)
    return SchedulerSide(
        store, identities(1), NamespacePolicy(PUBLIC), block_size=BLOCK, planner=model
    )


def test_matched_offers_what_the_planner_says_to_load(tmp_path: Path) -> None:
    ids = identities(1)
    prompt = list(range(100, 100 + 6 * CHUNK + 3))
    chunk_bytes = 3 * 2 * ids[0].layout.num_kv_heads * CHUNK * 4 * 4
    with KVStore.open(tmp_path, dram_bytes=8 << 20, disk_bytes=64 << 20) as store:
        kv = oracle_kv(0, prompt, 0, 6 * CHUNK, ids[0].layout.num_kv_heads)
        chunks = [kv[:, :, :, i * CHUNK : (i + 1) * CHUNK] for i in range(6)]
        store.put_prompt(ids[0], PUBLIC, prompt[: 6 * CHUNK], chunks)
        flat = PrefillProfile(0.0, 1e-3, 0.0)  # 1 ms a token, wherever it is
        req = FakeRequest("r", prompt)
        assert _side(store, None, flat).matched(req, 0) == 6 * CHUNK  # no planner: the hit
        fast = _side(store, 1e-3 / chunk_bytes * CHUNK / 10, flat)  # a chunk in 1/10 its compute
        assert fast.matched(FakeRequest("a", prompt), 0) == 6 * CHUNK
        assert fast.matched(FakeRequest("b", prompt), 2 * CHUNK) == 4 * CHUNK  # vLLM has 2
        slow = _side(store, 1e-3 / chunk_bytes * CHUNK * 10, flat)  # 10x its compute
        assert slow.matched(FakeRequest("c", prompt), 0) == 0
        assert slow.counters.planner_declined == 6 * CHUNK
