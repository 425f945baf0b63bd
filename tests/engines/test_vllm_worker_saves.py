"""The vLLM worker's save path against a real embedded store and vLLM 0.32-shaped CPU
caches: the gather's row buffers are reused from step to step only once the stager has
read them (a stager still laying a step out while the next step gathers stores the
first step's bytes, not the second's), and the gather refuses block ids outside the
cache instead of reading a wrong block."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.engines.errors import UnsupportedModel
from kvlife.engines.vllm.identity import identity_for
from kvlife.engines.vllm.meta import SaveSpec, SaveVerdict, StepPlan
from kvlife.engines.vllm.paged import PagedLayer
from kvlife.engines.vllm.worker import WorkerSide
from kvlife.store import KVStore
from tests.engines.vllm_fakes import facts

LAYERS, HEADS, DIM, BS, CHUNK, BLOCKS = 3, 2, 8, 4, 8, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _identity() -> ModelIdentity:
    engine = facts(1, layers=LAYERS, heads=HEADS, head_dim=DIM, block=BS)
    return identity_for(engine, tp_rank=0, tokens_per_chunk=CHUNK)


def _caches() -> list[torch.Tensor]:
    """vLLM 0.32's CPU cache: one allocation, layer-outermost."""
    per = BLOCKS * HEADS * BS * 2 * DIM
    raw = torch.zeros(LAYERS * per)
    return [raw[i * per : (i + 1) * per].view(BLOCKS, HEADS, BS, 2 * DIM) for i in range(LAYERS)]


def _fill(caches: list[torch.Tensor], blocks: list[int], kv: np.ndarray) -> None:
    """Write ``kv`` (``(layers, 2, heads, tokens, dim)``) into ``blocks`` as the CPU
    backend lays them out (per block and head: the keys' rows, then the values')."""
    for layer, cache in enumerate(caches):
        halves = cache.view(BLOCKS, HEADS, 2 * BS, DIM)
        for j, b in enumerate(blocks):
            span = kv[layer, :, :, j * BS : (j + 1) * BS]
            halves[b, :, :BS] = torch.from_numpy(span[0])
            halves[b, :, BS:] = torch.from_numpy(span[1])


def _stored(store: KVStore, ident: ModelIdentity, tokens: list[int]) -> np.ndarray:
    got = store.lookup(ident, PUBLIC, tokens)
    res = store.load(got, None)
    assert res.loaded == len(got.hits) == len(tokens) // CHUNK
    return np.concatenate(list(res.arrays), axis=3)


def _save(step: int, req: str, tokens: list[int], blocks: list[int], **kw: object) -> StepPlan:
    spec = SaveSpec(req, tokens, blocks, 0, len(tokens) // CHUNK, PUBLIC, None)
    return StepPlan(saves=[spec], step=step, **kw)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = KVStore.open(tmp_path / "store", dram_bytes=64 << 20, disk_bytes=0)
    yield s
    s.close()


def test_a_step_gathered_while_the_stager_lays_out_the_last_keeps_both(store: KVStore) -> None:
    """Step 1's rows are still being laid out (the stager held back) while step 2, on
    the same blocks now holding other KV, gathers: each request's stored chunks are its
    own KV. Once the stager is done, a later step gathers into a buffer an earlier step
    used (no fresh pages per step)."""
    ident = _identity()
    rng = np.random.default_rng(7)
    caches = _caches()
    w = WorkerSide(store, ident, block_size=BS)
    w.register(NAMES, caches, "halves")
    blocks = [3, 4, 5, 6, 9, 10]
    n = {"a": 2, "b": 3}  # chunks: the steps' buffers differ in size
    tokens = {r: [int(t) for t in rng.integers(10, 900, n[r] * CHUNK)] for r in "ab"}
    kv = {
        r: rng.standard_normal((LAYERS, 2, HEADS, n[r] * CHUNK, DIM)).astype(np.float32)
        for r in "ab"
    }

    gate = threading.Event()
    w._stager.submit(gate.wait, 10.0)  # the stager busy: step 1 waits to be laid out
    step1 = _save(1, "a", tokens["a"], blocks[:4])
    _fill(caches, blocks[:4], kv["a"])
    for name in NAMES:
        w.save_layer(name, step1)
    w.submit(step1)
    first = w._saving  # consumed by submit
    assert first is None
    # vLLM hands the blocks to another request: step 2 gathers them with b's KV
    _fill(caches, blocks, kv["b"])
    step2 = _save(2, "b", tokens["b"], blocks)
    for name in NAMES:
        w.save_layer(name, step2)
    w.submit(step2)
    gate.set()
    w.submit(StepPlan(step=3, verdicts=[SaveVerdict(1, True), SaveVerdict(2, True)]))
    w.drain()
    assert w.counters.saves_committed == 2
    for r in "ab":
        assert np.array_equal(_stored(store, ident, tokens[r]), kv[r]), r

    # both steps' buffers are back; the next gather takes the smaller, step 1's
    w._stager.submit(lambda: None).result()
    pooled = list(w._buffers._free)
    assert len(pooled) == 2
    step4 = _save(4, "c", [int(t) for t in rng.integers(10, 900, 2 * CHUNK)], blocks[:4])
    w.save_layer(NAMES[0], step4)
    saving = w._saving
    assert saving is not None
    small = min(pooled, key=lambda raw: raw.nbytes)
    assert np.shares_memory(saving.rows, small)
    w.close()


@pytest.mark.parametrize("bad", [-1, BLOCKS, BLOCKS + 5])
def test_the_gather_refuses_block_ids_outside_the_cache(bad: int) -> None:
    """numpy takes -1 as the last block (and a clipped take clamps the others): a
    block id outside the cache is a typed refusal, never another block's bytes."""
    cache = torch.arange(BLOCKS * HEADS * BS * 2 * DIM, dtype=torch.float32)
    layer = PagedLayer(cache.view(BLOCKS, HEADS, BS, 2 * DIM), "halves", HEADS, DIM)
    out = np.zeros((2, *layer.row_shape), np.float32)
    with pytest.raises(UnsupportedModel, match="outside"):
        layer.read_rows(np.array([2, bad], np.int64), out)
    layer.read_rows(np.array([2, BLOCKS - 1], np.int64), out)
    rows = cache.view(BLOCKS, HEADS, 2, BS, DIM).numpy()
    assert np.array_equal(out, rows[[2, BLOCKS - 1]])
