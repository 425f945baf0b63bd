"""Sparse transform: keep the top-k tokens of each (layer, KV head) by importance, drop the rest.

A chunk is ``(layers, 2, kv_heads, tokens, head_dim)``. Each (layer, head) keeps the same
number ``k`` of tokens (its keys and values together), chosen by an importance score of
shape ``(layers, kv_heads, tokens)``, higher kept first:

- from the engine where it has one (``encode(kv, importance=...)``): SnapKV/H2O-style, the
  attention the last window of prefix queries pays to each token, summed over the query
  heads that share the KV head (:func:`snapkv_importance` builds it from attention weights);
- otherwise the documented fallback proxy (``score="knorm"``): tokens with the *smallest*
  key L2 norm first (Devoto et al. 2024, "A simple and effective L2 norm-based strategy for
  KV cache compression": low-norm keys draw high attention, attention sinks among them).

The first ``sink_tokens`` and the last ``window_tokens`` tokens are always kept (they count
towards ``k``). Kept tokens are stored bit-exact, so the payload is the kept positions
(``(L, H, k)`` uint16, uint32 beyond 65535 tokens, ascending) and the kept keys and values
(``(L, 2, H, k, D)``).

Exactness is :attr:`~kvlife.transforms.base.Exactness.SPARSE`: a sparse replica never
satisfies an exact or lossless lookup. Decoding has two forms: :meth:`SparseTransform.decode`
fills a full-shape buffer with zeros at dropped positions (and :meth:`kept_mask` says which),
and :meth:`SparseTransform.decode_kept` fills a compact ``(L, 2, H, k, D)`` buffer and returns
the positions, which is what an engine injects (keys carry their rotary position already,
so a cache of only the kept tokens is attention with the dropped ones masked out).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Self

import numpy as np
import xxhash
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument, LayoutMismatch
from kvlife.transforms.base import (
    EncodedPayload,
    ErrorBound,
    Exactness,
    Param,
    Transform,
    TransformDescriptor,
    TransformError,
    UnknownTransform,
    _params_of,
)
from kvlife.transforms.registry import register_transform

SCORES = ("knorm", "given")
"""``knorm``: the fallback proxy; ``given``: the encoder was handed an importance array."""


def keep_count(tokens: int, keep_ratio: float, sink_tokens: int, window_tokens: int) -> int:
    """Tokens kept per (layer, head): ``ceil(keep_ratio * tokens)``, at least the sinks and
    the window, at most all tokens."""
    forced = min(tokens, sink_tokens + window_tokens)
    return min(tokens, max(forced, math.ceil(keep_ratio * tokens - 1e-9)))


def knorm_importance(kv: NDArray[np.generic]) -> NDArray[np.float32]:
    """Fallback importance ``(L, H, T)``: minus each key's L2 norm (low-norm keys first)."""
    keys = np.asarray(kv[:, 0], dtype=np.float32)
    norms: NDArray[np.float32] = np.sqrt(np.einsum("lhtd,lhtd->lht", keys, keys))
    return -norms


def snapkv_importance(
    attention: NDArray[np.floating], kv_heads: int, pool: int = 7
) -> NDArray[np.float32]:
    """SnapKV importance from attention weights ``(L, query_heads, queries, T)`` of an
    observation window: summed over its queries and over the query heads sharing a KV head
    (grouped-query attention: query head ``i`` reads KV head ``i // (query_heads //
    kv_heads)``), then max-pooled over ``pool`` neighbouring tokens so that the kept tokens
    come in small runs (SnapKV's clustering)."""
    a = np.asarray(attention, dtype=np.float32)
    if a.ndim != 4 or a.shape[1] % kv_heads:
        raise InvalidArgument(f"attention {a.shape} is not (L, query_heads, queries, T)")
    L, qh, _, T = a.shape
    score = a.sum(axis=2).reshape(L, kv_heads, qh // kv_heads, T).sum(axis=2)
    if pool > 1 and T:
        half = pool // 2
        padded = np.pad(score, ((0, 0), (0, 0), (half, half)), constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, pool, axis=2)
        score = windows.max(axis=3)
    return np.ascontiguousarray(score, dtype=np.float32)


@register_transform
class SparseTransform(Transform):
    """Top-k tokens per (layer, KV head) by importance; the rest dropped."""

    name = "sparse"
    version = 1
    exactness = Exactness.SPARSE

    def __init__(
        self,
        keep_ratio: float = 0.5,
        sink_tokens: int = 4,
        window_tokens: int = 32,
        score: str = "knorm",
    ) -> None:
        if not 0.0 < keep_ratio <= 1.0:
            raise TransformError(f"sparse: keep_ratio must be in (0, 1], got {keep_ratio}")
        if sink_tokens < 0 or window_tokens < 0:
            raise TransformError("sparse: sink_tokens and window_tokens must be >= 0")
        if score not in SCORES:
            raise TransformError(f"sparse: score must be one of {SCORES}, got {score!r}")
        self.keep_ratio = float(keep_ratio)
        self.sink_tokens = sink_tokens
        self.window_tokens = window_tokens
        self.score = score

    def params(self) -> Mapping[str, Param]:
        return {
            "keep_ratio": self.keep_ratio,
            "sink_tokens": self.sink_tokens,
            "window_tokens": self.window_tokens,
            "score": self.score,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Param]) -> Self:
        unknown = set(params) - {"keep_ratio", "sink_tokens", "window_tokens", "score"}
        if unknown:
            raise TransformError(f"sparse does not know parameters {sorted(unknown)}")
        ratio = params.get("keep_ratio", 0.5)
        sinks = params.get("sink_tokens", 4)
        window = params.get("window_tokens", 32)
        score = params.get("score", "knorm")
        if isinstance(ratio, bool) or not isinstance(ratio, int | float):
            raise TransformError("sparse: keep_ratio must be a number")
        if type(sinks) is not int or type(window) is not int or not isinstance(score, str):
            raise TransformError(f"sparse parameters have wrong types: {dict(params)}")
        return cls(float(ratio), sinks, window, score)

    @property
    def error_bound(self) -> ErrorBound:
        # kept elements decode bit-exact, dropped ones as 0: |x - y| <= |x| element-wise
        # (the whole of a dropped token is lost; recall is what the experiment measures)
        return ErrorBound(0.0, 1.0, 0.0)

    def check_input(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> None:
        if dtype.kind != "f" and dtype != np.uint16:
            raise LayoutMismatch(f"sparse stores float KV (or bfloat16 as uint16), not {dtype}")
        if len(shape) != 5 or shape[1] != 2:
            raise LayoutMismatch(
                f"sparse wants a chunk (layers, 2, kv_heads, tokens, head_dim), got {shape}"
            )

    def kept(self, shape: tuple[int, ...]) -> int:
        """Tokens kept per (layer, head) for a chunk of this shape."""
        return keep_count(shape[3], self.keep_ratio, self.sink_tokens, self.window_tokens)

    @staticmethod
    def _index_dtype(tokens: int) -> np.dtype[np.unsignedinteger]:
        return np.dtype(np.uint16) if tokens <= 0xFFFF else np.dtype(np.uint32)

    def payload_nbytes(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int:
        L, _, H, T, D = shape
        k = self.kept(shape)
        idx = L * H * k * self._index_dtype(T).itemsize
        return ((idx + 7) & ~7) + L * 2 * H * k * D * dtype.itemsize

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        array: NDArray[np.generic],
        importance: NDArray[np.floating] | None = None,
        *,
        start: int = 0,
    ) -> EncodedPayload:
        """Encode ``array``; ``importance`` ``(L, H, T)`` (higher kept first) comes from
        the engine, else the ``knorm`` proxy is used. The descriptor's ``score`` says which
        (an instance built with ``score="given"`` refuses to encode without one). The
        chunk's ``start`` does not change what is kept (its sinks are per chunk)."""
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InvalidArgument(f"sparse: start must be an int >= 0, got {start!r}")
        arr = np.ascontiguousarray(array)
        self.check_input(arr.shape, arr.dtype)
        if importance is None and self.score == "given":
            raise InvalidArgument("sparse(score='given') needs an importance array")
        used = self if (importance is None) == (self.score == "knorm") else self._flip_score()
        payload = used._payload(arr, importance)
        desc = TransformDescriptor(
            used.name,
            used.version,
            arr.dtype.name,
            arr.shape,
            _params_of(used.params()),
            payload.size,
            xxhash.xxh3_64_intdigest(payload.data),
        )
        return EncodedPayload(desc, payload)

    def _flip_score(self) -> SparseTransform:
        other = "given" if self.score == "knorm" else "knorm"
        return SparseTransform(self.keep_ratio, self.sink_tokens, self.window_tokens, other)

    def _encode(self, array: NDArray[np.generic]) -> NDArray[np.uint8]:
        return self._payload(array, None)

    def _payload(
        self, arr: NDArray[np.generic], importance: NDArray[np.floating] | None
    ) -> NDArray[np.uint8]:
        L, _, H, T, D = arr.shape
        k = self.kept(arr.shape)
        if importance is None:
            if arr.dtype.kind != "f":
                raise InvalidArgument("sparse: uint16 (bfloat16) KV needs an importance array")
            score = knorm_importance(arr)
        else:
            score = np.array(importance, dtype=np.float32)
            if score.shape != (L, H, T):
                raise LayoutMismatch(f"sparse importance {score.shape} is not {(L, H, T)}")
            if np.isnan(score).any():
                raise LayoutMismatch("sparse importance has NaN scores")
        S = min(self.sink_tokens, T)
        R = min(self.window_tokens, T - S)
        score[:, :, :S] = np.inf
        score[:, :, T - R :] = np.inf
        if k < T:
            top = np.argpartition(-score, k - 1, axis=2)[:, :, :k]
        else:
            top = np.broadcast_to(np.arange(T), (L, H, T))
        pos = np.sort(top, axis=2).astype(self._index_dtype(T))
        buf = np.empty(self.payload_nbytes(arr.shape, arr.dtype), np.uint8)
        nidx = pos.nbytes
        buf[:nidx] = pos.reshape(-1).view(np.uint8)
        buf[nidx : (nidx + 7) & ~7] = 0
        kept = buf[(nidx + 7) & ~7 :].view(arr.dtype).reshape(L, 2, H, k, D)
        gather = np.broadcast_to(pos.astype(np.intp)[:, None, :, :, None], (L, 2, H, k, D))
        kept[...] = np.take_along_axis(arr, gather, axis=3)
        return buf

    # ------------------------------------------------------------------ decode

    def _split(
        self, payload: NDArray[np.uint8], shape: tuple[int, ...], dtype: np.dtype[np.generic]
    ) -> tuple[NDArray[np.intp], NDArray[np.generic]]:
        """Verified positions ``(L, H, k)`` and kept KV ``(L, 2, H, k, D)`` of a payload."""
        L, _, H, T, D = shape
        k = self.kept(shape)
        if payload.size != self.payload_nbytes(shape, dtype):
            raise TransformError(
                f"sparse payload has {payload.size} bytes, "
                f"expected {self.payload_nbytes(shape, dtype)}"
            )
        it = self._index_dtype(T)
        nidx = L * H * k * it.itemsize
        if payload.ctypes.data % 8:
            payload = payload.copy()  # a view into a frame may be unaligned
        pos = payload[:nidx].view(it).reshape(L, H, k).astype(np.intp)
        # strictly ascending positions inside the chunk: a damaged table is never a gather
        if k and (pos[:, :, 0].min() < 0 or pos[:, :, -1].max() >= T):
            raise TransformError("sparse positions fall outside the chunk")
        if k > 1 and (np.diff(pos, axis=2) <= 0).any():
            raise TransformError("sparse positions are not strictly ascending")
        kept = payload[(nidx + 7) & ~7 :].view(dtype).reshape(L, 2, H, k, D)
        return pos, kept

    def _decode(
        self, payload: NDArray[np.uint8], desc: TransformDescriptor, out: NDArray[np.generic]
    ) -> None:
        pos, kept = self._split(payload, tuple(out.shape), out.dtype)
        out[...] = 0
        L, _, H, k, D = kept.shape
        scatter = np.broadcast_to(pos[:, None, :, :, None], (L, 2, H, k, D))
        np.put_along_axis(out, scatter, kept, axis=3)

    def _check(self, encoded: EncodedPayload) -> TransformDescriptor:
        d = encoded.descriptor
        if d.name != self.name or d.version != self.version:
            raise UnknownTransform(
                f"payload of {d.name!r} v{d.version} given to {self.name!r} v{self.version}"
            )
        if d.params != _params_of(self.params()):
            raise TransformError(f"sparse payload params {d.params} differ from this instance")
        encoded.verify()
        return d

    def decode_kept(self, encoded: EncodedPayload, out: NDArray[np.generic]) -> NDArray[np.intp]:
        """Verify ``encoded``, fill ``out`` ``(L, 2, H, k, D)`` with the kept tokens and
        return their positions ``(L, H, k)`` (ascending within each head)."""
        d = self._check(encoded)
        L, _, H, _, D = d.shape
        k = self.kept(d.shape)
        if tuple(out.shape) != (L, 2, H, k, D) or out.dtype.name != d.dtype:
            raise LayoutMismatch(
                f"sparse keeps {d.dtype}{[L, 2, H, k, D]}, the buffer is "
                f"{out.dtype.name}{list(out.shape)}"
            )
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise InvalidArgument("sparse decodes into a C-contiguous writable buffer only")
        pos, kept = self._split(encoded.payload_view(), d.shape, np.dtype(d.dtype))
        np.copyto(out, kept)
        return pos

    def kept_mask(self, encoded: EncodedPayload) -> NDArray[np.bool_]:
        """``(L, H, T)``: True where a token was kept (verified payload)."""
        d = self._check(encoded)
        pos, _ = self._split(encoded.payload_view(), d.shape, np.dtype(d.dtype))
        L, _, H, T, _ = d.shape
        mask = np.zeros((L, H, T), np.bool_)
        np.put_along_axis(mask, pos, True, axis=2)
        return mask

    def element_bounds(self, array: NDArray[np.generic]) -> NDArray[np.float64]:
        """|x| everywhere (dropped tokens decode as 0; kept ones are exact)."""
        return np.abs(array.astype(np.float64))
