"""PagedLayer against the paged-cache layouts of vLLM's attention backends, on CPU
tensors laid out as each backend lays them out (so the copies a GPU run makes are the
ones tested here). Each layout's keys and values are written through the backend's own
split, copied from the vLLM source the test names; the connector's copies are then
checked against it: a chunk gathered from blocks holds exactly those keys and values,
and a chunk scattered into other blocks reads back through the backend's split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvlife.engines.errors import UnsupportedModel
from kvlife.engines.vllm.paged import (
    PagedLayer,
    chunk_to_rows,
    rows_to_chunk,
    split_for_platform,
    stack_layers,
    write_chunk,
)

BLOCKS, BS, HEADS, DIM = 12, 4, 2, 8


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # v1/attention/backends/cpu_attn.py: view(blocks, heads, 2 * block_size, -1).chunk(2, 2)
    b, h, n, _ = t.shape
    k, v = t.view(b, h, 2 * n, -1).chunk(2, dim=2)
    return k, v  # [blocks, heads, block_size, head_dim]


def _concat(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # v1/attention/backends/flash_attn.py: kv_cache.transpose(1, 2).split(head_size, -1)
    k, v = t.transpose(1, 2).split(DIM, dim=-1)  # [blocks, block_size, heads, head_dim]
    return k.transpose(1, 2), v.transpose(1, 2)


def _kv_first(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # vLLM <= 0.11 flash_attn.py: key_cache, value_cache = kv_cache.unbind(0)
    k, v = t.unbind(0)  # [blocks, block_size, heads, head_dim]
    return k.transpose(1, 2), v.transpose(1, 2)


def _block_kv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # vLLM <= 0.11 flashinfer.py: kv_cache[:, 0], kv_cache[:, 1]
    return t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)


def _latent(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # MLA: one latent per token; kvlife's "key" is its first half, "value" the second
    lat = t.squeeze(1) if t.dim() == 4 else t  # [blocks, block_size, 2 * head_dim]
    return lat[..., :DIM].unsqueeze(1), lat[..., DIM:].unsqueeze(1)


def _alloc(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of logical ``shape`` whose memory is in axis order ``order`` (vLLM's
    ``KVCacheLayout`` stride orders, FlashInfer's HND), filled with distinct values."""
    phys = torch.empty(tuple(shape[i] for i in order), dtype=torch.float32)
    inv = [order.index(i) for i in range(len(order))]
    t = phys.permute(*inv)
    t.copy_(torch.randn(shape))
    return t.to(dtype) if dtype != torch.float32 else t


# (split, logical shape, memory orders, heads, the backend's split into keys and values)
LAYOUTS: list[tuple[str, tuple[int, ...], list[tuple[int, ...]], int, Callable[..., Any]]] = [
    ("halves", (BLOCKS, HEADS, BS, 2 * DIM), [(0, 1, 2, 3)], HEADS, _halves),
    # vLLM 0.32: logical [B, H, N, C], physical order from v1/kv_cache_layout.py
    ("concat", (BLOCKS, HEADS, BS, 2 * DIM), [(0, 1, 2, 3), (0, 2, 1, 3)], HEADS, _concat),
    ("kv_first", (2, BLOCKS, BS, HEADS, DIM), [(0, 1, 2, 3, 4)], HEADS, _kv_first),
    # FlashInfer NHD, and HND (heads before tokens in memory)
    ("block_kv", (BLOCKS, 2, BS, HEADS, DIM), [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4)], HEADS, _block_kv),
    ("latent", (BLOCKS, BS, 2 * DIM), [(0, 1, 2)], 1, _latent),
    ("latent", (BLOCKS, 1, BS, 2 * DIM), [(0, 1, 2, 3)], 1, _latent),
]
CASES = [
    pytest.param(
        split, shape, order, heads, ref, id=f"{split}-{len(shape)}d-{''.join(map(str, order))}"
    )
    for split, shape, orders, heads, ref in LAYOUTS
    for order in orders
]


def _expected(ref: Callable[..., Any], t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The chunk ``(2, heads, len(ids) * BS, DIM)`` of blocks ``ids`` as the backend
    reads them."""
    k, v = ref(t)
    kk = torch.cat([k[b] for b in ids], dim=1)  # [heads, tokens, dim]
    vv = torch.cat([v[b] for b in ids], dim=1)
    return torch.stack([kk, vv])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("split", "shape", "order", "heads", "ref"), CASES)
def test_gather_then_scatter_round_trips_through_the_backends_own_split(
    split: str, shape: tuple[int, ...], order: tuple[int, ...], heads: int, ref: Any, dtype: Any
) -> None:
    t = _alloc(shape, order, dtype)
    layer = PagedLayer(t, split, heads, DIM)
    src, dst = [7, 2, 9], [0, 11, 4]
    out = torch.empty((2, heads, len(src) * BS, DIM), dtype=dtype)
    layer.gather(torch.tensor(src), out)
    assert torch.equal(out, _expected(ref, t, src))  # what the backend reads, bit for bit
    before = t.clone()
    layer.scatter(torch.tensor(dst), out)
    assert torch.equal(_expected(ref, t, dst), _expected(ref, before, src))
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert torch.equal(_expected(ref, t, untouched), _expected(ref, before, untouched))


@pytest.mark.parametrize(("split", "shape", "order", "heads", "ref"), CASES)
def test_a_steps_chunks_are_written_with_one_copy_per_layer_skipping_cached_blocks(
    split: str, shape: tuple[int, ...], order: tuple[int, ...], heads: int, ref: Any
) -> None:
    """The worker's load path: two chunks of 3 blocks of two layers, the first chunk's
    leading block already in the cache (vLLM's prefix cache) and not written."""
    layers = 2
    caches = [_alloc(shape, order, torch.float32) for _ in range(layers)]
    paged = [PagedLayer(c, split, heads, DIM) for c in caches]
    rng = np.random.default_rng(0)
    chunks = [
        rng.standard_normal((layers, 2, heads, 3 * BS, DIM)).astype(np.float32) for _ in range(2)
    ]
    before = [c.clone() for c in caches]
    targets = [[5, 1, 8], [3, 10, 6]]
    rows = np.empty((layers, 5, *paged[0].row_shape), np.float32)
    chunk_to_rows(chunks[0], BS, 1, rows[:, :2])
    chunk_to_rows(chunks[1], BS, 0, rows[:, 2:])
    ids = np.array(targets[0][1:] + targets[1], np.int64)
    for layer, p in enumerate(paged):
        p.write_rows(ids, rows[layer])
    for layer in range(layers):
        got0 = _expected(ref, caches[layer], targets[0][1:]).numpy()
        assert np.array_equal(got0, chunks[0][layer, :, :, BS:])
        assert np.array_equal(_expected(ref, caches[layer], targets[1]).numpy(), chunks[1][layer])
        assert torch.equal(  # the cached leading block is left as it was
            _expected(ref, caches[layer], [5]), _expected(ref, before[layer], [5])
        )
    # and read back: one indexed copy per layer, laid out as chunks again
    back = np.empty((layers, 3, *paged[0].row_shape), np.float32)
    for layer, p in enumerate(paged):
        p.read_rows(np.array(targets[1], np.int64), back[layer])
    chunk = np.empty_like(chunks[1])
    rows_to_chunk(back, chunk)
    assert np.array_equal(chunk, chunks[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_in_one_allocation_take_a_chunk_in_one_copy(dtype: Any) -> None:
    """vLLM 0.32 puts a group's layers in one allocation a constant stride apart (the
    CPU layout here): a chunk goes straight into its blocks of every layer."""
    layers = 3
    raw = torch.randn(layers * BLOCKS * HEADS * BS * 2 * DIM + 5).to(dtype)
    per = BLOCKS * HEADS * BS * 2 * DIM
    caches = [
        raw[5 + i * per : 5 + (i + 1) * per].view(BLOCKS, HEADS, BS, 2 * DIM) for i in range(layers)
    ]
    paged = [PagedLayer(c, "halves", HEADS, DIM) for c in caches]
    stack = stack_layers(paged)
    assert stack is not None
    before = [c.clone() for c in caches]
    chunk = torch.randn(layers, 2, HEADS, 3 * BS, DIM).to(dtype)
    write_chunk(stack, np.array([9, 0], np.int64), _host_bits(chunk), 1)  # block 0 cached
    for layer in range(layers):
        got = _expected(_halves, caches[layer], [9, 0])
        assert torch.equal(got, chunk[layer, :, :, BS:])
        rest = [b for b in range(BLOCKS) if b not in (9, 0)]
        assert torch.equal(
            _expected(_halves, caches[layer], rest), _expected(_halves, before[layer], rest)
        )
    # separate allocations (or a gap between layers) are not stacked: one copy per layer
    assert (
        stack_layers(
            [
                PagedLayer(torch.zeros(BLOCKS, HEADS, BS, 2 * DIM), "halves", HEADS, DIM)
                for _ in range(2)
            ]
        )
        is None
    )


@pytest.mark.parametrize(
    "targets",
    [
        pytest.param([[11, 3, 7], [2, 10, 1, 6]], id="scattered"),
        pytest.param([[0, 1, 2], [3, 4, 5, 6]], id="ascending"),
        pytest.param([[9, 8, 7], [6, 5, 4, 3]], id="descending"),
        pytest.param([[0, 5, 6], [11, 10, 2, 3]], id="mixed-runs"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_group_of_layers_takes_its_slice_of_each_chunk_in_any_block_order(
    targets: list[list[int]], dtype: Any
) -> None:
    """The loader writes a step's chunks a group of layers at a time (``stack[lo:hi]``,
    ``chunk[lo:hi]``), in whatever order vLLM hands out blocks (fresh ones ascending,
    freed ones descending): exactly the chunk's blocks after ``skip`` land in the given
    blocks of those layers, and nothing else changes."""
    layers = 5
    raw = torch.randn(layers * BLOCKS * HEADS * BS * 2 * DIM).to(dtype)
    per = BLOCKS * HEADS * BS * 2 * DIM
    caches = [raw[i * per : (i + 1) * per].view(BLOCKS, HEADS, BS, 2 * DIM) for i in range(layers)]
    stack = stack_layers([PagedLayer(c, "halves", HEADS, DIM) for c in caches])
    assert stack is not None
    before = [c.clone() for c in caches]
    chunks = [torch.randn(layers, 2, HEADS, 4 * BS, DIM).to(dtype) for _ in range(2)]
    # the first chunk's leading block is cached (vLLM's prefix cache): not written
    for lo, hi in [(0, 2), (2, 5)]:
        write_chunk(stack[lo:hi], np.array(targets[0]), _host_bits(chunks[0])[lo:hi], 1)
        write_chunk(stack[lo:hi], np.array(targets[1]), _host_bits(chunks[1])[lo:hi], 0)
    for layer in range(layers):
        got = _expected(_halves, caches[layer], targets[0])
        assert torch.equal(got, chunks[0][layer, :, :, BS:])
        assert torch.equal(_expected(_halves, caches[layer], targets[1]), chunks[1][layer])
        rest = [b for b in range(BLOCKS) if b not in targets[0] + targets[1]]
        assert torch.equal(
            _expected(_halves, caches[layer], rest), _expected(_halves, before[layer], rest)
        )


@pytest.mark.parametrize("ids", [[3, BLOCKS], [-1, 2], [4]])
def test_block_ids_that_do_not_fit_are_refused_before_anything_is_written(ids: list[int]) -> None:
    """An id outside the cache (numpy would take -1 as the last block), or a count that
    does not match the chunk's blocks, is refused, and the cache is left as it was."""
    raw = torch.randn(2 * BLOCKS * HEADS * BS * 2 * DIM)
    caches = [c.view(BLOCKS, HEADS, BS, 2 * DIM) for c in raw.chunk(2)]
    stack = stack_layers([PagedLayer(c, "halves", HEADS, DIM) for c in caches])
    assert stack is not None
    before = raw.clone()
    chunk = torch.randn(2, 2, HEADS, 2 * BS, DIM)
    with pytest.raises((UnsupportedModel, IndexError)):
        write_chunk(stack, np.array(ids, np.int64), _host_bits(chunk), 0)
    assert torch.equal(raw, before)


def _host_bits(t: torch.Tensor) -> np.ndarray:
    width = {2: torch.int16, 4: torch.int32}[t.element_size()]
    bits: np.ndarray = t.view(width).numpy()
    return bits


def test_layouts_that_do_not_fit_are_refused() -> None:
    with pytest.raises(UnsupportedModel, match="split"):
        PagedLayer(torch.zeros(BLOCKS, HEADS, BS, 2 * DIM), "guess", HEADS, DIM)
    with pytest.raises(UnsupportedModel, match="kv_first"):  # heads disagree
        PagedLayer(torch.zeros(2, BLOCKS, BS, HEADS + 1, DIM), "kv_first", HEADS, DIM)
    with pytest.raises(UnsupportedModel, match="block_kv"):  # a kv_first tensor
        PagedLayer(torch.zeros(2, BLOCKS, BS, HEADS, DIM), "block_kv", HEADS, DIM)
    with pytest.raises(UnsupportedModel, match="1 head"):  # MLA with the wrong identity
        PagedLayer(torch.zeros(BLOCKS, BS, 2 * DIM), "latent", HEADS, DIM)
    with pytest.raises(UnsupportedModel, match="concat"):
        PagedLayer(torch.zeros(BLOCKS, HEADS, BS, DIM), "concat", HEADS, DIM)
    layer = PagedLayer(torch.zeros(BLOCKS, HEADS, BS, 2 * DIM), "halves", HEADS, DIM)
    with pytest.raises(UnsupportedModel, match="block rows"):  # a wider dtype
        layer.write_rows(np.array([0]), np.zeros((1, *layer.row_shape), np.float64))


def test_the_backend_names_map_to_their_splits() -> None:
    assert split_for_platform(True, "") == "halves"
    assert split_for_platform(False, "FLASH_ATTN") == "concat"
    assert split_for_platform(False, "FLASHINFER") == "concat"
    assert split_for_platform(False, "FLASH_ATTN", ndim=5) == "kv_first"
    assert split_for_platform(False, "TRITON_ATTN", ndim=5) == "kv_first"
    assert split_for_platform(False, "FLASHINFER", ndim=5) == "block_kv"
    assert split_for_platform(False, "AttentionBackendEnum.FLASHMLA") == "latent"
    with pytest.raises(UnsupportedModel, match="ROCM_ATTN"):
        split_for_platform(False, "ROCM_ATTN")
