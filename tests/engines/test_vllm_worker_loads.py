"""The vLLM worker's load path on a paged cache laid out as vLLM 0.32's CPU backend lays
it out (every layer in one allocation a constant stride apart, ``halves`` split), against
a real embedded store: a step's chunks, from DRAM (read in the worker's own thread) or
from disk (the store's I/O pool), land bit for bit in their blocks of every layer, the
blocks vLLM's own prefix cache holds and every other block untouched, whatever number of
layer groups the copy is split into."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.engines.vllm import worker as worker_mod
from kvlife.engines.vllm.identity import identity_for
from kvlife.engines.vllm.meta import LoadSpec, StepPlan
from kvlife.engines.vllm.worker import WorkerSide, layer_groups, memory_tiers
from kvlife.store import KVStore
from tests.engines.vllm_fakes import facts

LAYERS, HEADS, DIM, BS, CHUNK, BLOCKS = 7, 2, 8, 4, 8, 40
SENTINEL = -7.0


def _identity() -> ModelIdentity:
    engine = facts(1, layers=LAYERS, heads=HEADS, head_dim=DIM, block=BS)
    return identity_for(engine, tp_rank=0, tokens_per_chunk=CHUNK)


def _cpu_cache() -> list[torch.Tensor]:
    """vLLM 0.32's CPU cache: one allocation, layer-outermost, ``[blocks, heads,
    block_size, 2 * head_dim]`` per layer."""
    per = BLOCKS * HEADS * BS * 2 * DIM
    raw = torch.full((LAYERS * per,), SENTINEL)
    return [raw[i * per : (i + 1) * per].view(BLOCKS, HEADS, BS, 2 * DIM) for i in range(LAYERS)]


def _block(cache: torch.Tensor, b: int) -> np.ndarray:
    """Block ``b`` as ``(2, heads, block_size, head_dim)`` through the CPU backend's own
    split (``view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)``)."""
    k, v = cache.view(BLOCKS, HEADS, 2 * BS, -1).chunk(2, dim=2)
    return np.stack([k[b].numpy(), v[b].numpy()])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = KVStore.open(tmp_path / "store", dram_bytes=64 << 20, disk_bytes=64 << 20)
    yield s
    s.close()


@pytest.mark.parametrize("groups", [1, 3, LAYERS])
@pytest.mark.parametrize("from_disk", [False, True])
def test_a_steps_chunks_land_in_their_blocks_of_every_layer(
    store: KVStore, groups: int, from_disk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_mod, "LOAD_GROUPS", groups)
    ident = _identity()
    rng = np.random.default_rng(groups)
    tokens = [int(t) for t in rng.integers(10, 900, 3 * CHUNK + 1)]
    kv = rng.standard_normal((LAYERS, 2, HEADS, 3 * CHUNK, DIM)).astype(np.float32)
    store.put_prompt(ident, PUBLIC, tokens, kv)
    store.drain()
    if from_disk:
        store.flush()
        store.evict("dram", 1 << 30)
    caches = _cpu_cache()
    w = WorkerSide(store, ident, block_size=BS)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    w.register(names, caches, "halves")
    # six blocks for the three chunks, scattered; the first block is vLLM's own
    blocks = [31, 2, 17, 9, 38, 0]
    spec = LoadSpec("r1", tokens, blocks, BS, 3 * CHUNK, PUBLIC, None)
    w.start(StepPlan(loads=[spec], step=1))
    for name in names:
        w.wait_layer(name)
    assert w.load_errors() == set()
    assert w.counters.tiers == ({"disk": 3} if from_disk else {"dram": 3})
    assert w.counters.tokens_loaded == 3 * CHUNK - BS
    for layer in range(LAYERS):
        for j, b in enumerate(blocks):
            got = _block(caches[layer], b)
            if j == 0:  # held by vLLM's prefix cache: never written
                assert (got == SENTINEL).all()
                continue
            want = kv[layer, :, :, j * BS : (j + 1) * BS]
            assert np.array_equal(got, want), (layer, j)
        rest = [b for b in range(BLOCKS) if b not in blocks[1:]]
        assert all((_block(caches[layer], b) == SENTINEL).all() for b in rest)
    w.close()


def test_layers_split_into_near_equal_groups() -> None:
    assert layer_groups(30, 6) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30)]
    assert layer_groups(2, 6) == [(0, 1), (1, 2)]


def test_only_an_embedded_stores_memory_tiers_are_read_in_place(store: KVStore) -> None:
    assert memory_tiers(store) == frozenset({"dram"})
