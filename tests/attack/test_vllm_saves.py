"""Attacks on the vLLM connector's save protocol (docs/vllm.md, "Saves"), driven
without vLLM through the pieces of the mini engine (:mod:`tests.engines.vllm_fakes`):
a step with several requests, built by hand the way vLLM's scheduler builds it.

The model is the fakes' oracle: KV of a position is a pure function of the tokens up to
it unless the step attended to a wrong prefix on any rank, so every chunk the store
serves afterwards is checked against what an engine without kvlife computes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC, prompt_chunk_keys
from kvlife.engines.vllm.meta import StepReport
from kvlife.store import KVStore
from tests.engines.vllm_fakes import (
    BLOCK,
    CHUNK,
    LAYERS,
    NAMES,
    POISON,
    FakeCachedRequests,
    FakeNewRequest,
    FakeRequest,
    FakeSchedulerOutput,
    MiniEngine,
    identities,
    oracle_kv,
    served_chunks,
)

IDS = identities(2)
SHARED = [(7 * i + 3) % 991 for i in range(2 * CHUNK)]
"""Two chunks every prompt below starts with."""
R1 = SHARED + [(11 * i + 5) % 983 for i in range(2 * CHUNK + 3)]
R2 = SHARED + [(13 * i + 1) % 977 for i in range(2 * CHUNK + 3)]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    with KVStore.open(tmp_path / "store", dram_bytes=8 << 20, disk_bytes=64 << 20) as s:
        yield s


def _blocks(n_tokens: int, first: int) -> list[int]:
    return list(range(first, first + math.ceil(n_tokens / BLOCK)))


def test_a_request_sharing_the_blocks_of_a_failed_load_in_the_same_step_saves_nothing(
    store: KVStore,
) -> None:
    """vLLM's prefix cache hands a second request R2 the blocks R1 is loading from
    kvlife in the same step (sync loads cache blocks at allocation; vLLM's
    ``_update_requests_with_invalid_blocks`` names exactly this case: "a block is
    invalid and shared by multiple requests in the batch"). Rank 0's load of R1's
    second chunk fails, so R2's new KV attended to garbage on rank 0 and, all-reduced,
    on every rank. vLLM rolls R2 back too; the connector must not keep R2's saves of
    that step either. Before the fix only R1 was named failed (the request whose load
    failed), R2's poisoned chunks were committed on both ranks and served."""
    MiniEngine(store, [store, store]).serve([*SHARED, 1, 2, 3], 1)  # chunks 0-1 stored
    engine = MiniEngine(store, [store, store])
    sched, workers = engine.scheduler, engine.workers
    r1, r2 = FakeRequest("r1", list(R1)), FakeRequest("r2", list(R2))
    assert sched.matched(r1, 0) == 2 * CHUNK
    sched.allocated(r1, 2 * CHUNK)
    # R2 finds R1's blocks in vLLM's own prefix cache: nothing external to load
    assert sched.matched(r2, 2 * CHUNK) == 0
    sched.allocated(r2, 0)
    b1 = _blocks(len(R1), 0)
    b2 = b1[: 2 * CHUNK // BLOCK] + _blocks(len(R2) - 2 * CHUNK, len(b1))
    plan = sched.plan(
        FakeSchedulerOutput(
            [FakeNewRequest("r1", (b1,), 2 * CHUNK), FakeNewRequest("r2", (b2,), 2 * CHUNK)],
            num_scheduled_tokens={"r1": len(R1) - 2 * CHUNK, "r2": len(R2) - 2 * CHUNK},
        )
    )
    assert [s.req_id for s in plan.loads] == ["r1"]
    assert sorted(s.req_id for s in plan.saves) == ["r1", "r2"]
    # rank 0 cannot load R1's chunk 1 (gone between the scheduler's lookup and its own)
    assert store.invalidate(prefix=prompt_chunk_keys(IDS[0], PUBLIC, R1)[1]) == 1
    for w in workers:
        w.start(plan)
    try:
        for layer in range(LAYERS):
            for w in workers:
                w.wait_layer(NAMES[layer])
            for tokens, blocks in ((R1, b1), (R2, b2)):
                bad = not engine._prefix_ok(tokens, blocks, 2 * CHUNK, layer)
                for rank in range(len(workers)):
                    kv = oracle_kv(rank, tokens, 2 * CHUNK, len(tokens), engine.heads)[layer]
                    engine._write(rank, layer, blocks, 2 * CHUNK, kv + POISON if bad else kv)
            for w in workers:
                w.save_layer(NAMES[layer], plan)
    finally:
        for w in workers:
            w.submit(plan)
    invalid = engine._collect()
    assert set(b1[CHUNK // BLOCK : 2 * CHUNK // BLOCK]) <= invalid
    engine.idle()  # the verdict goes out with the next (empty) step
    for w in workers:
        w.drain()
    _, wrong = served_chunks([store, store], IDS, [R1, R2])
    assert wrong == [], f"KV computed on a failed load's garbage was served: {wrong}"
    assert all(not w.held_steps for w in workers)


def test_oracle_sanity_r2_alone_is_stored_right(store: KVStore) -> None:
    """Control: without the failed load the same hand-built step stores R2 right."""
    MiniEngine(store, [store, store]).serve([*SHARED, 1, 2, 3], 1)
    engine = MiniEngine(store, [store, store])
    r2 = FakeRequest("r2", list(R2))
    sched, workers = engine.scheduler, engine.workers
    assert sched.matched(r2, 0) == 2 * CHUNK
    sched.allocated(r2, 2 * CHUNK)
    b2 = _blocks(len(R2), 0)
    plan = sched.plan(
        FakeSchedulerOutput(
            [FakeNewRequest("r2", (b2,), 2 * CHUNK)],
            num_scheduled_tokens={"r2": len(R2) - 2 * CHUNK},
        )
    )
    for w in workers:
        w.start(plan)
    try:
        for layer in range(LAYERS):
            for w in workers:
                w.wait_layer(NAMES[layer])
            assert engine._prefix_ok(R2, b2, 2 * CHUNK, layer)
            for rank in range(len(workers)):
                kv = oracle_kv(rank, R2, 2 * CHUNK, len(R2), engine.heads)[layer]
                engine._write(rank, layer, b2, 2 * CHUNK, kv)
            for w in workers:
                w.save_layer(NAMES[layer], plan)
    finally:
        for w in workers:
            w.submit(plan)
    engine._collect()
    engine.idle()
    for w in workers:
        w.drain()
    served, wrong = served_chunks([store, store], IDS, [R2])
    assert wrong == [] and served == 2 * 4
    assert np.isfinite(store.get(IDS[0], PUBLIC, R2).arrays[3]).all()


def test_a_step_planned_before_a_failed_load_was_heard_of_saves_nothing(store: KVStore) -> None:
    """vLLM 0.32 schedules step N+1 before it processed step N's output (async
    scheduling, on by default). R's first step P1 loads its prefix (rank 0 cannot load
    chunk 1) and computes only a few tokens (chunked prefill under a token budget: no
    chunk completes, so P1 stages nothing and reports nothing). P2, planned before P1's
    invalid blocks reached the scheduler, computes the rest of R's prompt attending to
    P1's garbage and stages two chunks; every rank reports P2 clean. Before the fix P2's
    verdict committed them (``load_failed`` lowered the request's saved chunks but
    left the saves already planned alone) and the store served them."""
    MiniEngine(store, [store, store]).serve([*SHARED, 1, 2, 3], 1)  # chunks 0-1 stored
    engine = MiniEngine(store, [store, store])
    sched, workers = engine.scheduler, engine.workers
    prompt = R1[: 4 * CHUNK + 3]
    req = FakeRequest("r", list(prompt))
    assert sched.matched(req, 0) == 2 * CHUNK
    sched.allocated(req, 2 * CHUNK)
    blocks = _blocks(len(prompt), 0)
    first = 2 * CHUNK + BLOCK  # P1 computes one block: no chunk completes
    p1 = sched.plan(
        FakeSchedulerOutput(
            [FakeNewRequest("r", (blocks,), 2 * CHUNK)],
            num_scheduled_tokens={"r": first - 2 * CHUNK},
        )
    )
    assert [s.req_id for s in p1.loads] == ["r"] and p1.saves == []
    assert store.invalidate(prefix=prompt_chunk_keys(IDS[0], PUBLIC, prompt)[1]) == 1
    _step(engine, p1, prompt, blocks, 2 * CHUNK, first)
    p1_invalid = set().union(*(w.load_errors() for w in workers))  # P1's output, not heard yet
    assert p1_invalid
    # async scheduling: P2 is planned before P1's output is processed
    p2 = sched.plan(
        FakeSchedulerOutput(
            scheduled_cached_reqs=FakeCachedRequests(["r"], [None], set(), [first]),
            num_scheduled_tokens={"r": len(prompt) - first},
        )
    )
    assert [(s.first_chunk, s.end_chunk) for s in p2.saves] == [(2, 4)]
    _step(engine, p2, prompt, blocks, first, len(prompt))
    sched.load_failed(p1_invalid)  # P1's output: vLLM rolls R back
    sched.reported(None)
    merged = StepReport()
    for w in workers:  # P2's output: every rank staged R's chunks and reports it clean
        report = w.take_report()
        if report is not None:
            merged = merged.merge(report)
    sched.reported(merged)
    engine.idle()
    for w in workers:
        w.drain()
    _, wrong = served_chunks([store, store], IDS, [prompt])
    assert wrong == [], f"KV computed on a failed load's garbage was served: {wrong}"


def _step(
    engine: MiniEngine, plan: Any, tokens: list[int], blocks: list[int], lo: int, hi: int
) -> None:
    """One forward of one request over positions ``[lo, hi)`` on every rank (the fakes'
    oracle: poisoned from the first layer after one whose prefix was wrong anywhere)."""
    workers = engine.workers
    for w in workers:
        w.start(plan)
    try:
        bad = False
        for layer in range(LAYERS):
            for w in workers:
                w.wait_layer(NAMES[layer])
            bad = bad or not engine._prefix_ok(tokens, blocks, lo, layer)
            for rank in range(len(workers)):
                kv = oracle_kv(rank, tokens[:hi], lo, hi, engine.heads)[layer]
                engine._write(rank, layer, blocks, lo, kv + POISON if bad else kv)
            for w in workers:
                w.save_layer(NAMES[layer], plan)
    finally:
        for w in workers:
            w.submit(plan)
