"""Copies between vLLM's paged KV cache and kvlife chunks.

A kvlife chunk is ``(layers, 2, kv_heads, tokens_per_chunk, head_dim)`` and covers a
whole number of vLLM blocks (``tokens_per_chunk = k * block_size``). Where keys and
values sit in vLLM's per-layer paged tensor depends on the attention backend and the
vLLM version (the ``split``):

- ``halves`` (vLLM's CPU backend, ``v1/attention/backends/cpu_attn.py``:
  ``kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)``): logically
  ``[blocks, heads, block_size, 2 * head_dim]``, per (block, head) ``block_size`` key
  rows then ``block_size`` value rows;
- ``concat`` (vLLM 0.32's CUDA backends, ``flash_attn.py`` and ``flashinfer.py``:
  ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` on a logical ``[blocks, heads,
  block_size, 2 * head_size]``, whatever the physical stride order of
  ``v1/kv_cache_layout.py``): per token, the key then the value along the last axis;
- ``kv_first`` (FlashAttention's and Triton's ``get_kv_cache_shape`` of vLLM <= 0.11):
  ``(2, blocks, block_size, heads, head_dim)``;
- ``block_kv`` (FlashInfer's of vLLM <= 0.11, NHD or HND stride order):
  ``(blocks, 2, block_size, heads, head_dim)``;
- ``latent`` (MLA: ``model_executor/layers/attention/mla_attention.py`` squeezes the
  head axis of ``[blocks, 1, block_size, kv_lora_rank + rope_dim]``): one latent vector
  per token, ``(blocks, block_size, D)`` or ``(blocks, 1, block_size, D)``. kvlife
  stores it as a chunk of one head with ``head_dim = D / 2``: the first half of the
  latent in the "key" slot, the second in the "value" slot (bytes kept as they are).

:class:`PagedLayer` turns each into one 5-d view ``[blocks, heads, 2, block_size,
head_dim]`` (no copy) so the copies are the same code. An unknown split, or a tensor
whose shape does not fit it, is refused, not guessed: a wrong split would serve wrong KV.

The copies work on *block rows*: ``(n_blocks, heads, 2, block_size, head_dim)``, the
paged cache's own order. Where every layer lives in one allocation a constant stride
apart (vLLM 0.32's CPU cache), :func:`write_chunk` copies a chunk straight into its blocks
of every layer with one indexed copy; otherwise :func:`chunk_to_rows` lays a chunk's
blocks out as rows (all layers in one copy) and :meth:`PagedLayer.write_rows` writes
one layer's rows of every chunk of a step into their blocks with one indexed copy;
:meth:`PagedLayer.read_rows` reads them back (saves), :func:`rows_to_chunk` turns rows
into a chunk again. On a CPU tensor the copies run in numpy on same-width integer views
(bit-exact for every dtype, bfloat16 included): torch's CPU copies fork an OpenMP team
per call, which on a busy host stalls against the forward's own (docs/vllm.md). On a
device tensor they are torch's ``index_copy_``/``index_select`` with one host-device
transfer per layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlife.engines.errors import UnsupportedModel

SPLITS = ("halves", "concat", "kv_first", "block_kv", "latent")

_CONCAT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "TRITON_FLASHINFER")
_MLA_BACKENDS = (
    "FLASHMLA",
    "FLASH_ATTN_MLA",
    "FLASHINFER_MLA",
    "TRITON_MLA",
    "CUTLASS_MLA",
    "CPU_MLA",
)

_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def split_for_platform(is_cpu: bool, backend: str, ndim: int = 4) -> str:
    """How keys and values sit in a block for this platform, attention backend and the
    rank of its per-layer KV tensor (4 in vLLM 0.32; 5 for the older CUDA layouts)."""
    name = backend.upper().rsplit(".", 1)[-1]
    if name in _MLA_BACKENDS:
        return "latent"
    if is_cpu:
        return "halves"
    if name in _CONCAT_BACKENDS:
        if ndim == 4:
            return "concat"
        if ndim == 5:
            return "block_kv" if "FLASHINFER" in name else "kv_first"
    raise UnsupportedModel(
        f"attention backend {backend!r} with {ndim}-d KV tensors: kvlife does not know "
        f"where it keeps keys and values in a block (supported: CPU_ATTN, "
        f"{', '.join(_CONCAT_BACKENDS)}, and the MLA backends {', '.join(_MLA_BACKENDS)})"
    )


def _refuse(shape: tuple[int, ...], split: str, want: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"paged KV layer of shape {shape} for split {split!r}; kvlife expects {want}"
    )


def _five_d(kv: Any, split: str, heads: int, dim: int) -> Any:
    """``kv`` as ``[blocks, heads, 2, block_size, head_dim]`` (a view, never a copy)."""
    shape = tuple(kv.shape)
    if split == "halves":
        if len(shape) != 4 or shape[1] != heads or shape[3] != 2 * dim:
            raise _refuse(shape, split, f"[blocks, {heads} heads, block_size, {2 * dim}]")
        return kv.view(shape[0], heads, 2, shape[2], dim)
    if split == "concat":
        if len(shape) != 4 or shape[1] != heads or shape[3] != 2 * dim:
            raise _refuse(shape, split, f"[blocks, {heads} heads, block_size, {2 * dim}]")
        return kv.unflatten(-1, (2, dim)).permute(0, 1, 3, 2, 4)
    if split == "kv_first":
        if len(shape) != 5 or shape[0] != 2 or shape[3] != heads or shape[4] != dim:
            raise _refuse(shape, split, f"(2, blocks, block_size, {heads} heads, {dim})")
        return kv.permute(1, 3, 0, 2, 4)
    if split == "block_kv":
        if len(shape) != 5 or shape[1] != 2 or shape[3] != heads or shape[4] != dim:
            raise _refuse(shape, split, f"(blocks, 2, block_size, {heads} heads, {dim})")
        return kv.permute(0, 3, 1, 2, 4)
    if split == "latent":
        if len(shape) == 4 and shape[1] == 1:
            kv = kv.squeeze(1)
            shape = tuple(kv.shape)
        if heads != 1 or len(shape) != 3 or shape[2] != 2 * dim:
            raise _refuse(
                shape,
                split,
                f"(blocks, block_size, {2 * dim}) with the identity's 1 head of head_dim "
                f"{dim} (half the latent); the identity says {heads} heads",
            )
        return kv.unflatten(-1, (2, dim)).permute(0, 2, 1, 3).unsqueeze(1)
    raise UnsupportedModel(f"unknown paged KV split {split!r}; one of {SPLITS}")


def _int_view(tensor: Any) -> Any:
    """``tensor`` reinterpreted as integers of its width (torch)."""
    import torch

    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(width[tensor.element_size()])


def as_bits(arr: np.ndarray) -> np.ndarray:
    """``arr`` reinterpreted as integers of its width (numpy, no copy)."""
    return arr.view(_INT_OF_SIZE[arr.dtype.itemsize])


class PagedLayer:
    """One layer's paged KV as ``[blocks, heads, 2, block_size, head_dim]``."""

    def __init__(self, kv_layer: Any, split: str, num_kv_heads: int, head_dim: int) -> None:
        if split not in SPLITS:
            raise UnsupportedModel(f"unknown paged KV split {split!r}; one of {SPLITS}")
        self.view = _five_d(kv_layer, split, num_kv_heads, head_dim)
        self.split = split
        self.block_size = int(self.view.shape[3])
        self.itemsize = int(self.view.element_size())
        self.on_cpu = self.view.device.type == "cpu"
        # numpy's view of the same memory (strided as the tensor is): the CPU copies
        self._bits: np.ndarray | None = _int_view(self.view).numpy() if self.on_cpu else None

    @property
    def row_shape(self) -> tuple[int, int, int, int]:
        """One block row: ``(heads, 2, block_size, head_dim)``."""
        _, heads, two, bs, dim = self.view.shape
        return (int(heads), int(two), int(bs), int(dim))

    def _check_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        if rows.shape != (len(ids), *self.row_shape) or rows.dtype.itemsize != self.itemsize:
            raise UnsupportedModel(
                f"block rows of shape {rows.shape} ({rows.dtype}) for {len(ids)} blocks of "
                f"{self.row_shape} with {self.itemsize}-byte elements"
            )

    def write_rows(self, block_ids: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows`` (``(n, heads, 2, block_size, head_dim)``, any dtype of the
        cache's width) into blocks ``block_ids`` (int64), one indexed copy."""
        self._check_rows(block_ids, rows)
        if self._bits is not None:
            self._bits[block_ids] = as_bits(rows)
            return
        import torch

        dev = self.view.device
        src = torch.from_numpy(as_bits(np.ascontiguousarray(rows)))
        src = src.to(dev, non_blocking=True).view(_int_view(self.view).dtype)
        ids = torch.from_numpy(block_ids).to(dev, non_blocking=True)
        _int_view(self.view).index_copy_(0, ids, src)

    def read_rows(self, block_ids: np.ndarray, out: np.ndarray) -> None:
        """Copy blocks ``block_ids`` into ``out`` (contiguous ``(n, heads, 2,
        block_size, head_dim)``), one indexed copy."""
        self._check_rows(block_ids, out)
        if self._bits is not None:
            blocks = self._bits.shape[0]
            # numpy would take -1 as the last block, and mode="clip" clamps: refuse, never
            # guess. Checked here, the take need not: with its default mode="raise" numpy
            # buffers ``out`` (a second copy of the rows, 1.8x the gather's time here)
            if len(block_ids) and (int(block_ids.min()) < 0 or int(block_ids.max()) >= blocks):
                raise UnsupportedModel(
                    f"block ids {block_ids.tolist()} outside {blocks} paged blocks"
                )
            np.take(self._bits, block_ids, axis=0, out=as_bits(out), mode="clip")
            return
        import torch

        dev = self.view.device
        ids = torch.from_numpy(block_ids).to(dev, non_blocking=True)
        got = _int_view(self.view).index_select(0, ids).cpu()
        as_bits(out)[...] = got.numpy()

    # chunk-at-a-time forms (one layer of one chunk), kept for tests and simple callers

    def gather(self, block_ids: Any, out: Any) -> None:
        """Copy blocks ``block_ids`` into ``out``, a ``(2, heads, len(block_ids) *
        block_size, head_dim)`` array or CPU tensor of this layer's chunk."""
        ids = _ids(block_ids)
        arr = _host(out)
        rows = np.empty((len(ids), *self.row_shape), arr.dtype)
        self.read_rows(ids, rows)
        rows_to_chunk(rows[None], arr[None])

    def scatter(self, block_ids: Any, src: Any) -> None:
        """Write ``src`` (as :meth:`gather` produces it) into blocks ``block_ids``."""
        ids = _ids(block_ids)
        arr = _host(src)
        rows = np.empty((len(ids), *self.row_shape), arr.dtype)
        chunk_to_rows(arr[None], self.block_size, 0, rows[None])
        self.write_rows(ids, rows)


def stack_layers(layers: list[PagedLayer]) -> np.ndarray | None:
    """Every layer's blocks as one numpy view ``[layers, blocks, heads, 2, block_size,
    head_dim]`` (integer bits), when the layers are CPU tensors in one allocation a
    constant stride apart (vLLM 0.32 allocates a group's same-shaped layers so:
    ``KVCacheTensor`` in ``v1/kv_cache_interface.py``, ``layer_stride``); else None.
    A chunk is then written into the cache with one copy for all its layers."""
    bits = [p._bits for p in layers]
    if not layers or any(b is None for b in bits):
        return None
    first = layers[0].view
    storage = first.untyped_storage().data_ptr()
    ptrs = [p.view.data_ptr() for p in layers]
    stride = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    for i, p in enumerate(layers):
        same = p.view.shape == first.shape and p.view.stride() == first.stride()
        if not same or p.view.untyped_storage().data_ptr() != storage:
            return None
        if ptrs[i] != ptrs[0] + i * stride:
            return None
    b0 = bits[0]
    assert b0 is not None
    return np.lib.stride_tricks.as_strided(
        b0, shape=(len(layers), *b0.shape), strides=(stride, *b0.strides), writeable=True
    )


def write_chunk(stack: np.ndarray, block_ids: np.ndarray, chunk: np.ndarray, skip: int) -> None:
    """Write ``chunk`` (``(layers, 2, heads, T, head_dim)``) from its block ``skip`` on
    into blocks ``block_ids`` of every layer of ``stack`` (:func:`stack_layers`): one
    indexed copy, straight from the chunk into the blocks. (A numba kernel over the
    runs, releasing the GIL, and a slice copy per run of consecutive blocks were measured
    against it and were no faster: docs/vllm.md, "The load and save path".)"""
    layers, two, heads, tokens, dim = chunk.shape
    bs = stack.shape[4]
    if stack.shape[0] != layers or stack.shape[2:] != (heads, two, bs, dim):
        raise UnsupportedModel(f"chunk of shape {chunk.shape} for paged blocks {stack.shape}")
    if chunk.dtype.itemsize != stack.itemsize:
        raise UnsupportedModel(
            f"chunk of {chunk.dtype.itemsize}-byte elements for paged blocks of {stack.itemsize}"
        )
    k = tokens // bs
    ids = np.asarray(block_ids, dtype=np.int64)
    if not 0 <= skip <= k or ids.shape != (k - skip,):
        raise UnsupportedModel(
            f"{len(ids)} blocks for a chunk of {k} blocks from its block {skip} on"
        )
    # numpy would take -1 as the last block: refuse, never guess
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= stack.shape[1]):
        raise UnsupportedModel(f"block ids {ids.tolist()} outside {stack.shape[1]} blocks")
    blocks = as_bits(chunk).reshape(layers, two, heads, k, bs, dim)[:, :, :, skip:]
    stack[:, ids] = blocks.transpose(0, 3, 2, 1, 4, 5)


def _ids(block_ids: Any) -> np.ndarray:
    if hasattr(block_ids, "numpy"):
        block_ids = block_ids.cpu().numpy()
    return np.asarray(block_ids, dtype=np.int64)


def _host(t: Any) -> np.ndarray:
    """A host tensor or array as numpy (bit view for dtypes numpy lacks), sharing memory."""
    if isinstance(t, np.ndarray):
        return t
    return _int_view(t).numpy()  # type: ignore[no-any-return]


def chunk_to_rows(chunk: np.ndarray, block_size: int, skip: int, rows: np.ndarray) -> None:
    """Lay ``chunk`` (``(layers, 2, heads, T, head_dim)``) out as block rows of every
    layer: ``rows`` is ``(layers, T // block_size - skip, heads, 2, block_size,
    head_dim)`` and receives the chunk's blocks from block ``skip`` on (one copy)."""
    layers, two, heads, tokens, dim = chunk.shape
    k = tokens // block_size
    blocks = chunk.reshape(layers, two, heads, k, block_size, dim)[:, :, :, skip:]
    as_bits(rows)[...] = as_bits(blocks).transpose(0, 3, 2, 1, 4, 5)


def rows_to_chunk(rows: np.ndarray, chunk: np.ndarray) -> None:
    """The inverse of :func:`chunk_to_rows` with no skip: ``rows`` ``(layers, k, heads,
    2, block_size, head_dim)`` into ``chunk`` ``(layers, 2, heads, k * block_size,
    head_dim)`` (contiguous)."""
    layers, k, heads, two, bs, dim = rows.shape
    out = as_bits(chunk).reshape(layers, two, heads, k, bs, dim)
    out[...] = as_bits(rows).transpose(0, 3, 2, 1, 4, 5)
