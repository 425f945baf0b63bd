"""Payload helpers: KV arrays as numpy without pickling, torch tensors when torch is present.

kvlife stores plain arrays. Torch tensors are accepted on the CPU and viewed as numpy
without a copy (bfloat16 through a 16-bit integer view, since numpy has no bfloat16).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvlife.core.errors import LayoutMismatch
from kvlife.core.identity import KVLayout

_NUMPY_NAME = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
"""Storage dtype in numpy for KV dtypes numpy lacks (the bits are kept exactly)."""


_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {}


def numpy_dtype(kv_dtype: str) -> np.dtype[Any]:
    """The numpy dtype kvlife uses to hold ``kv_dtype`` (remembered by name: ``np.dtype``
    of a name takes about 1 us, several times in every put, issue 28)."""
    dtype = _NUMPY_DTYPES.get(kv_dtype)
    if dtype is None:
        dtype = np.dtype(_NUMPY_NAME.get(kv_dtype, kv_dtype))
        if len(_NUMPY_DTYPES) < 256:  # the dtypes of KV: a handful
            _NUMPY_DTYPES[kv_dtype] = dtype
    return dtype


def is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_numpy(obj: object, kv_dtype: str) -> np.ndarray:
    """View ``obj`` (numpy array or CPU torch tensor) as numpy, checking its dtype."""
    if is_torch_tensor(obj):
        tensor: Any = obj
        if tensor.device.type != "cpu":
            raise LayoutMismatch(f"KV tensor is on {tensor.device}; kvlife tiers take CPU tensors")
        tname = str(tensor.dtype).removeprefix("torch.")
        if tname != kv_dtype:
            raise LayoutMismatch(f"KV tensor has dtype {tname}, the layout says {kv_dtype}")
        if kv_dtype in _NUMPY_NAME:
            import torch

            bits = {"uint16": torch.int16, "uint8": torch.uint8}[_NUMPY_NAME[kv_dtype]]
            arr: np.ndarray = tensor.contiguous().view(bits).numpy()
            return arr.view(numpy_dtype(kv_dtype))
        out: np.ndarray = tensor.numpy()
        return out
    if not isinstance(obj, np.ndarray):
        raise LayoutMismatch(
            f"KV must be a numpy array or a torch tensor, got {type(obj).__name__}"
        )
    if obj.dtype != numpy_dtype(kv_dtype):
        raise LayoutMismatch(
            f"KV array has dtype {obj.dtype}, the layout says {kv_dtype}"
            + (f" (held as {numpy_dtype(kv_dtype)})" if kv_dtype in _NUMPY_NAME else "")
        )
    return obj


def check_chunk(arr: np.ndarray, layout: KVLayout, what: str) -> None:
    """Raise LayoutMismatch unless ``arr`` has the shape of one chunk of ``layout``."""
    if arr.shape != layout.chunk_shape:
        raise LayoutMismatch(
            f"{what} has shape {arr.shape}; layout needs {layout.chunk_shape} "
            "(layers, k/v, kv_heads, tokens_per_chunk, head_dim)"
        )


def to_torch(arr: np.ndarray, kv_dtype: str) -> Any:
    """A CPU torch tensor sharing ``arr``'s memory, in the KV dtype (bfloat16 restored).

    Read-only arrays (DRAM hits served without a copy) are copied first, since torch
    tensors are always writable.
    """
    import torch

    if not arr.flags.writeable:
        arr = arr.copy()
    tensor = torch.from_numpy(arr)
    if kv_dtype in _NUMPY_NAME:
        return tensor.view(getattr(torch, kv_dtype))
    return tensor


def cast_kv(arr: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Float KV converted by value to ``kv_dtype`` in kvlife's numpy form (bfloat16 via
    torch, since numpy has none). Arrays already in that form are returned as they are."""
    target = numpy_dtype(kv_dtype)
    if arr.dtype == target:
        return arr
    if kv_dtype in _NUMPY_NAME:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        bits = t.to(getattr(torch, kv_dtype))
        view = {"uint16": torch.int16, "uint8": torch.uint8}[target.name]
        out: np.ndarray = bits.view(view).numpy().view(target)
        return out
    return arr.astype(target)
