"""Copies between vLLM's paged KV cache and kvlife chunks.

A kvlife chunk is ``(layers, 2, kv_heads, tokens_per_chunk, head_dim)`` and covers a
whole number of vLLM blocks (``tokens_per_chunk = k * block_size``). vLLM hands a
connector one paged tensor per attention layer, logically ``[blocks, kv_heads,
block_size, 2 * head_dim]``; where keys and values sit inside a block depends on the
attention backend:

- ``halves`` (vLLM's CPU backend): per (block, head), ``block_size`` key rows then
  ``block_size`` value rows, i.e. ``[blocks, heads, 2, block_size, head_dim]``;
- ``concat`` (FlashAttention-style CUDA backends): per token, the key then the value
  along the last axis, i.e. ``[..., 2, head_dim]``.

:class:`PagedLayer` turns either into one 5-d view ``[blocks, heads, 2, block_size,
head_dim]`` so gather and scatter are the same code. An unknown backend is refused, not
guessed: a wrong split would serve wrong KV.
"""

from __future__ import annotations

from typing import Any

from kvlife.engines.errors import UnsupportedModel

SPLITS = ("halves", "concat")


def split_for_platform(is_cpu: bool, backend: str) -> str:
    """How keys and values sit in a block for this platform and attention backend."""
    if is_cpu:
        return "halves"
    if backend.upper() in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"):
        return "concat"
    raise UnsupportedModel(
        f"attention backend {backend!r}: kvlife does not know where it keeps keys and "
        "values in a block (supported: CPU_ATTN, FLASH_ATTN, TRITON_ATTN, FLASHINFER)"
    )


class PagedLayer:
    """One layer's paged KV as ``[blocks, heads, 2, block_size, head_dim]``."""

    def __init__(self, kv_layer: Any, split: str, num_kv_heads: int, head_dim: int) -> None:
        if split not in SPLITS:
            raise UnsupportedModel(f"unknown paged KV split {split!r}; one of {SPLITS}")
        shape = tuple(kv_layer.shape)
        if len(shape) != 4 or shape[1] != num_kv_heads or shape[3] != 2 * head_dim:
            raise UnsupportedModel(
                f"paged KV layer of shape {shape}; kvlife expects [blocks, {num_kv_heads} "
                f"heads, block_size, {2 * head_dim}] (keys and values of head_dim {head_dim})"
            )
        blocks, heads, block_size, _ = shape
        self.block_size = block_size
        if split == "halves":
            self.view = kv_layer.view(blocks, heads, 2, block_size, head_dim)
        else:
            self.view = kv_layer.unflatten(-1, (2, head_dim)).permute(0, 1, 3, 2, 4)

    def gather(self, block_ids: Any, out: Any) -> None:
        """Copy blocks ``block_ids`` (1-d long tensor) into ``out``, a ``(2, heads,
        len(block_ids) * block_size, head_dim)`` tensor of this layer's chunk."""
        got = self.view.index_select(0, block_ids)  # (nb, H, 2, N, D)
        nb = got.shape[0]
        src = got.permute(2, 1, 0, 3, 4).reshape(2, got.shape[1], nb * self.block_size, -1)
        out.copy_(src)

    def scatter(self, block_ids: Any, src: Any) -> None:
        """Write ``src`` (as :meth:`gather` produces it) into blocks ``block_ids``."""
        nb = int(block_ids.shape[0])
        two, heads, _, dim = src.shape
        blocks = src.reshape(two, heads, nb, self.block_size, dim).permute(2, 1, 0, 3, 4)
        self.view.index_copy_(0, block_ids, blocks.to(self.view.dtype))
