"""Group quantisers: ``int8``, and ``int4`` / ``int2`` KIVI-style, with sinks, window, Kitty.

A chunk is ``(layers, 2, kv_heads, tokens, head_dim)``; index 0 of axis 1 holds keys, 1
values. Keys have outlier channels, so they are quantised per channel in groups of
``key_group`` tokens (0: all quantised tokens of the chunk); values are quantised per
token in groups of ``value_group`` along head_dim (0: the whole head_dim), as in KIVI.
Asymmetric min/scale per group: ``x ~ q * scale + zero``, ``q`` in ``[0, 2**bits - 1]``,
with zero rounded down and scale up to the metadata dtype (float16 for float16 input,
float32 for float32) so the declared bound holds after that rounding.

Options: the sequence's first ``sink_tokens`` tokens (attention sinks) and each chunk's
last ``window_tokens`` tokens are stored in full precision; ``key_hi_fraction`` (Kitty)
keeps that fraction of each head's key channels (those with the largest range over the
chunk) at ``key_hi_bits``.

Sinks belong to the sequence, not to the chunk: :meth:`Transform.encode` is told the
chunk's absolute start, and only a chunk holding some of the sequence's first
``sink_tokens`` tokens keeps them (version 3). The payload records how many it kept, so
decoding needs nothing but the frame. Version 2 (still read) kept ``sink_tokens`` at the
start of every chunk, which at 64-token chunks cost about 0.75 bits per element.

Payload (version 3) sections, each padded to 8 bytes: the number of sink tokens this
chunk holds (u64), Kitty channel mask (bits, LSB first, (L, H, ceil(D / 8)) bytes, only
with the option), key codes (channel-major), key zero, key scale ((L, H, key groups,
D)), value codes (token-major), value zero, value scale ((L, H, tokens, value groups)),
sink tokens and window tokens as raw bytes. Version 2 had no count (every chunk held
``min(sink_tokens, tokens)`` sinks) and a mask of one byte per channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, cast

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import LayoutMismatch
from kvlife.transforms.base import (
    ErrorBound,
    Exactness,
    Param,
    Transform,
    TransformDescriptor,
    TransformError,
)
from kvlife.transforms.quant_kernels import F16_TO_F32, decode_kernel, encode_kernel
from kvlife.transforms.registry import register_transform

DTYPES = ("float16", "float32")
KEY_AXES = ("channel", "token")
"""Keys per channel in groups along tokens (KIVI), or per token (the wrong axis, a control)."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class _Plan:
    """Section sizes of one payload (derived from shape and parameters only)."""

    L: int
    H: int
    T: int
    D: int
    S: int
    """Sink tokens this chunk holds (at its start)."""
    R: int
    nq: int
    gk: int
    gv: int
    nhi: int
    kblock: int
    """Bytes of key codes per (layer, head)."""
    meta: np.dtype[np.generic]
    version: int
    """Payload layout: 3 (sink count, packed mask) or 2."""
    sections: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(_pad8(n) for _, n in self.sections)


INT4_TUNED: dict[str, Param] = {
    "key_group": 128,
    "value_group": 64,
    "value_sym": True,
    "sink_tokens": 4,
    "key_hi_fraction": 0.0625,
    "key_hi_bits": 8,
}
"""The near-lossless int4 setting tuned on SmolLM2 (docs/transforms.md): key groups of 128
tokens (capped at the chunk), 6.25% of key channels at 8 bits, symmetric values in groups
of 64, the sequence's first 4 tokens in full precision. Bits per element of SmolLM2's
chunks (metadata included) for a chunk not at the sequence start: 4.51 at 64 tokens,
4.38 at 256 and 512; the chunk at the start adds its sinks (5.24, 4.56, 4.47)."""

INT2_TUNED: dict[str, Param] = {"key_hi_fraction": 0.25, "sink_tokens": 4}
"""The 2-bit setting tuned on SmolLM2: 25% of key channels at 4 bits (Kitty), the
sequence's first 4 tokens in full precision."""


@dataclass(frozen=True)
class MeasuredKL:
    """One measured parameter set: mean KL of next-token distributions against exact KV,
    by chunk size."""

    name: str
    params: dict[str, Param]
    """Parameters apart from the defaults."""
    kl: dict[int, float] = field(default_factory=dict)
    """Chunk tokens -> mean KL with the prefix stored in chunks of that size."""
    sinks_per_chunk: bool = False
    """Measured with sinks at the start of every chunk: what a version-2 payload with
    sinks decodes to (sequence sinks otherwise, version 3)."""


MEASURED_KL: tuple[MeasuredKL, ...] = (
    MeasuredKL("int8", {}, {64: 2.16e-05, 256: 3.61e-05, 512: 4.11e-05}),
    MeasuredKL("int4", {}, {64: 0.00395, 256: 0.00395, 512: 0.00395}),
    MeasuredKL("int4", INT4_TUNED, {64: 0.00231, 256: 0.0027, 512: 0.00264}),
    MeasuredKL(
        "int4",
        {"key_group": 64, "value_group": 64, "value_sym": True, "sink_tokens": 4},
        {64: 0.00306, 256: 0.00318, 512: 0.00326},
    ),
    MeasuredKL("int4", {"value_bits": 2}, {64: 0.03, 256: 0.03, 512: 0.03}),
    MeasuredKL("int2", {}, {64: 0.167, 256: 0.167, 512: 0.167}),
    MeasuredKL("int2", {"sink_tokens": 4}, {64: 0.0875, 256: 0.0864, 512: 0.0892}),
    MeasuredKL("int2", {"key_hi_fraction": 0.25}, {64: 0.0561, 256: 0.0584, 512: 0.0578}),
    MeasuredKL("int2", {"key_axis": "token"}, {64: 0.528, 256: 0.528, 512: 0.528}),
    MeasuredKL("int2", INT2_TUNED, {64: 0.0232, 256: 0.0229, 512: 0.0236}),
    MeasuredKL("int2", {**INT2_TUNED, "value_group": 16}, {64: 0.018, 256: 0.0178, 512: 0.0182}),
    # version-2 frames: sinks at the start of every chunk (at 512 tokens the experiment's
    # prefix is one chunk, so the figure is the same as with sequence sinks)
    MeasuredKL("int4", INT4_TUNED, {64: 0.0023, 256: 0.00263, 512: 0.00264}, True),
    MeasuredKL("int2", INT2_TUNED, {64: 0.0205, 256: 0.0233, 512: 0.0236}, True),
)
"""Mean KL of next-token distributions against exact KV, measured by ``kvlife experiment
transforms`` (SmolLM2-135M-Instruct, float16 KV, 512-token prefixes stored in chunks of
64, 256 and 512 tokens, each chunk told its start; 6 licence-text windows, 1,536 scored
positions; docs/transforms.md)."""


def kl_at_chunk(figures: dict[int, float], chunk_tokens: int | None) -> float | None:
    """The figure for ``chunk_tokens``: the one measured there; for an unmeasured size
    the worst measured at larger sizes (key groups, Kitty channels and the recent window
    are chosen per chunk, so a smaller chunk quantises no coarser); None above every
    measured size; the worst of all when the size is not known (None)."""
    if not figures:
        return None
    if chunk_tokens is None:
        return max(figures.values())
    if chunk_tokens in figures:
        return figures[chunk_tokens]
    larger = [kl for tokens, kl in figures.items() if tokens > chunk_tokens]
    return max(larger) if larger else None


class QuantTransform(Transform):
    """Shared implementation of the group quantisers (subclasses fix ``bits``)."""

    exactness = Exactness.LOSSY
    version = 3
    """3: sinks at the sequence start only, their count in the payload, a packed Kitty
    mask. 2 (read, no longer written): sinks at every chunk's start."""
    bits: ClassVar[int]
    default_key_group: ClassVar[int]
    default_value_group: ClassVar[int]

    def __init__(
        self,
        key_group: int,
        value_group: int,
        sink_tokens: int = 0,
        window_tokens: int = 0,
        key_hi_fraction: float = 0.0,
        key_hi_bits: int = 4,
        value_bits: int = 0,
        key_axis: str = "channel",
        value_sym: bool = False,
    ) -> None:
        value_bits = value_bits or self.bits
        if value_bits not in (2, 4, 8):
            raise TransformError(f"{self.name}: value_bits must be 2, 4 or 8")
        if key_axis not in KEY_AXES:
            raise TransformError(f"{self.name}: key_axis must be one of {KEY_AXES}")
        if key_axis == "token" and key_hi_fraction > 0:
            raise TransformError(f"{self.name}: Kitty key channels need key_axis='channel'")
        if key_group < 0 or value_group < 0 or sink_tokens < 0 or window_tokens < 0:
            raise TransformError(f"{self.name}: group sizes and token counts must be >= 0")
        if not 0.0 <= key_hi_fraction <= 1.0:
            raise TransformError(f"{self.name}: key_hi_fraction must be in [0, 1]")
        if key_hi_bits not in (2, 4, 8) or (key_hi_fraction > 0 and key_hi_bits < self.bits):
            raise TransformError(f"{self.name}: key_hi_bits must be 2, 4 or 8 and >= bits")
        self.key_group = key_group
        self.value_group = value_group
        self.sink_tokens = sink_tokens
        self.window_tokens = window_tokens
        self.key_hi_fraction = float(key_hi_fraction)
        self.key_hi_bits = key_hi_bits
        self.value_bits = value_bits
        self.key_axis = key_axis
        self.value_sym = bool(value_sym)

    def params(self) -> Mapping[str, Param]:
        return {
            "key_group": self.key_group,
            "value_group": self.value_group,
            "sink_tokens": self.sink_tokens,
            "window_tokens": self.window_tokens,
            "key_hi_fraction": self.key_hi_fraction,
            "key_hi_bits": self.key_hi_bits,
            "value_bits": self.value_bits,
            "key_axis": self.key_axis,
            "value_sym": self.value_sym,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Param]) -> Self:
        ints = (
            "key_group",
            "value_group",
            "sink_tokens",
            "window_tokens",
            "key_hi_bits",
            "value_bits",
        )
        unknown = set(params) - {*ints, "key_hi_fraction", "key_axis", "value_sym"}
        if unknown:
            raise TransformError(f"{cls.name} does not know parameters {sorted(unknown)}")
        for k in ints:
            if k in params and type(params[k]) is not int:
                raise TransformError(f"{cls.name}: {k} must be an integer, got {params[k]!r}")
        frac = params.get("key_hi_fraction", 0.0)
        if isinstance(frac, bool) or not isinstance(frac, int | float):
            raise TransformError(f"{cls.name}: key_hi_fraction must be a number")
        axis = params.get("key_axis", "channel")
        if not isinstance(axis, str):
            raise TransformError(f"{cls.name}: key_axis must be a string")
        sym = params.get("value_sym", False)
        if not isinstance(sym, bool):
            raise TransformError(f"{cls.name}: value_sym must be a boolean")

        def get(k: str, default: int) -> int:
            v = params.get(k, default)
            assert isinstance(v, int)
            return v

        return cls(
            get("key_group", cls.default_key_group),
            get("value_group", cls.default_value_group),
            get("sink_tokens", 0),
            get("window_tokens", 0),
            float(frac),
            get("key_hi_bits", 4),
            get("value_bits", 0),
            axis,
            sym,
        )

    @classmethod
    def reads(cls, version: int) -> bool:
        return version in (2, 3)

    def measured_kl_at(
        self, chunk_tokens: int | None = None, version: int | None = None
    ) -> float | None:
        """The experiment's mean KL for exactly these parameters at this chunk size
        (:func:`kl_at_chunk`); None if not measured. A version-2 payload with sinks kept
        them at every chunk: only a figure measured that way is its own."""
        per_chunk = (version or self.version) < 3 and self.sink_tokens > 0
        mine = dict(self.params())
        for entry in MEASURED_KL:
            if entry.name != self.name or entry.sinks_per_chunk != per_chunk:
                continue
            if dict(type(self).from_params(entry.params).params()) == mine:
                return kl_at_chunk(entry.kl, chunk_tokens)
        return None

    def chunk_sinks(self, tokens: int, start: int) -> int:
        """Sink tokens a chunk of ``tokens`` tokens starting at absolute position
        ``start`` holds: those of the sequence's first ``sink_tokens`` inside it."""
        return max(0, min(self.sink_tokens - start, tokens))

    @property
    def error_bound(self) -> ErrorBound:
        levels = (1 << min(self.bits, self.value_bits)) - 1
        # half a step, padded for rounding the scale up to float16 (relative 2**-10);
        # a symmetric value grid's step is 2 max|x| / levels: a magnitude term
        sym = (1 + 2.0**-8) / ((1 << self.value_bits) - 1) if self.value_sym else 0.0
        return ErrorBound(0.5 / levels * (1 + 2.0**-8), 2.0**-8 + sym, 2.0**-22)

    def check_input(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> None:
        if dtype.name not in DTYPES:
            raise LayoutMismatch(f"{self.name} quantises {DTYPES}, not {dtype}")
        if len(shape) != 5 or shape[1] != 2:
            raise LayoutMismatch(
                f"{self.name} wants a chunk (layers, 2, kv_heads, tokens, head_dim), got {shape}"
            )

    def _plan(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], S: int, version: int = 3
    ) -> _Plan:
        """Section sizes of a payload holding ``S`` sink tokens, in layout ``version``."""
        L, _, H, T, D = shape
        R = min(self.window_tokens, T - S)
        nq = T - S - R
        if self.key_axis == "token":  # groups along head_dim, per token (a control)
            gk = self.key_group if self.key_group > 0 else max(D, 1)
        else:
            gk = self.key_group if self.key_group > 0 else max(nq, 1)
        gv = self.value_group if self.value_group > 0 else max(D, 1)
        nhi = round(self.key_hi_fraction * D) if self.key_hi_fraction > 0 else 0
        meta = np.dtype(np.float16) if dtype == np.float16 else np.dtype(np.float32)
        m = meta.itemsize
        ngv = -(-D // gv)
        if self.key_axis == "token":
            kblock = nq * -(-D * self.bits // 8)
            kmeta = nq * -(-D // gk)
        else:
            kblock = nhi * -(-nq * self.key_hi_bits // 8) + (D - nhi) * -(-nq * self.bits // 8)
            kmeta = -(-nq // gk) * D
        e = dtype.itemsize
        sections = (
            ("header", 8 if version >= 3 else 0),
            ("hmask", L * H * (-(-D // 8) if version >= 3 else D) if nhi else 0),
            ("kcodes", L * H * kblock),
            ("kzero", L * H * kmeta * m),
            ("kscale", L * H * kmeta * m),
            ("vcodes", L * H * nq * -(-D * self.value_bits // 8)),
            ("vzero", 0 if self.value_sym else L * H * nq * ngv * m),
            ("vscale", L * H * nq * ngv * m),
            ("sinks", L * 2 * H * S * D * e),
            ("window", L * 2 * H * R * D * e),
        )
        return _Plan(L, H, T, D, S, R, nq, gk, gv, nhi, kblock, meta, version, sections)

    def payload_nbytes(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int:
        """The largest payload over chunk positions (whatever number of sinks it holds)."""
        most = self.chunk_sinks(shape[3], 0)
        return max(self._plan(shape, dtype, S).total for S in range(most + 1))

    def payload_nbytes_at(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], start: int
    ) -> int:
        return self._plan(shape, dtype, self.chunk_sinks(shape[3], start)).total

    def _views(self, buf: NDArray[np.uint8], p: _Plan) -> dict[str, NDArray[np.generic]]:
        views: dict[str, NDArray[np.generic]] = {}
        o = 0
        mt = np.uint16 if p.meta == np.float16 else np.float32
        ngv = -(-p.D // p.gv)
        if self.key_axis == "token":
            krow = -(-p.D * self.bits // 8)
            kcodes_shape: tuple[int, ...] = (p.L * p.H, p.nq * krow)
            kmeta_shape: tuple[int, ...] = (p.L * p.H, p.nq, -(-p.D // p.gk))
        else:
            kcodes_shape = (p.L * p.H, p.kblock)
            kmeta_shape = (p.L * p.H, -(-p.nq // p.gk), p.D)
        mask_row = (-(-p.D // 8) if p.version >= 3 else p.D) if p.nhi else 0
        shapes: dict[str, tuple[tuple[int, ...], type[np.generic]]] = {
            "header": ((1 if p.version >= 3 else 0,), np.uint64),
            "hmask": ((p.L * p.H, mask_row), np.uint8),
            "kcodes": (kcodes_shape, np.uint8),
            "kzero": (kmeta_shape, mt),
            "kscale": (kmeta_shape, mt),
            "vcodes": ((p.L * p.H * p.nq, -(-p.D * self.value_bits // 8)), np.uint8),
            "vzero": ((p.L * p.H * p.nq, 0 if self.value_sym else ngv), mt),
            "vscale": ((p.L * p.H * p.nq, ngv), mt),
            "sinks": ((dict(p.sections)["sinks"],), np.uint8),
            "window": ((dict(p.sections)["window"],), np.uint8),
        }
        for name, n in p.sections:
            shape, dt = shapes[name]
            views[name] = buf[o : o + n].view(dt).reshape(shape)
            o += _pad8(n)
        return views

    def _kernel_args(self, p: _Plan) -> tuple[int, ...]:
        return (
            p.L,
            p.H,
            p.T,
            p.D,
            p.S,
            p.nq,
            p.gk,
            p.gv,
            self.bits,
            self.key_hi_bits,
            p.nhi,
            self.value_bits,
            1 if self.key_axis == "token" else 0,
            self.value_sym,
        )

    def _encode(self, array: NDArray[np.generic]) -> NDArray[np.uint8]:
        return self._encode_at(array, 0)

    def _encode_at(self, array: NDArray[np.generic], start: int) -> NDArray[np.uint8]:
        p = self._plan(array.shape, array.dtype, self.chunk_sinks(array.shape[3], start))
        buf = np.zeros(p.total, np.uint8)  # zeroed: key codes are OR-ed in
        v = self._views(buf, p)
        v["header"][:] = p.S
        if array.size and p.nq:
            flat = array.reshape(-1)
            finite = np.zeros(p.L * p.H, np.float32)
            x = flat.view(np.uint16) if array.dtype == np.float16 else flat
            # the kernel writes one byte per channel; the payload keeps one bit
            mask = np.zeros((p.L * p.H, p.D if p.nhi else 0), np.uint8)
            cast(Any, encode_kernel)(
                x,
                *self._kernel_args(p),
                *_sections({**v, "hmask": mask}),
                F16_TO_F32,
                finite,
            )
            # checked in the kernel's pass rather than by np.isfinite, a pass of its own
            if not np.isfinite(finite).all():
                raise LayoutMismatch(f"{self.name} cannot quantise non-finite values")
            if p.nhi:
                v["hmask"][:] = np.packbits(mask, axis=1, bitorder="little")
        v["sinks"][:] = np.ascontiguousarray(array[:, :, :, : p.S]).reshape(-1).view(np.uint8)
        v["window"][:] = (
            np.ascontiguousarray(array[:, :, :, p.T - p.R :]).reshape(-1).view(np.uint8)
        )
        return buf

    def _decode(
        self, payload: NDArray[np.uint8], desc: TransformDescriptor, out: NDArray[np.generic]
    ) -> None:
        shape = tuple(out.shape)
        most = self.chunk_sinks(shape[3], 0)
        if payload.ctypes.data % 8:
            payload = payload.copy()  # a view into a frame may be unaligned for the metadata
        if desc.version >= 3:
            if payload.size < 8:
                raise TransformError(f"{self.name} payload is shorter than its sink count")
            held = int(payload[:8].view(np.uint64)[0])
            if held > most:
                raise TransformError(
                    f"{self.name} payload holds {held} sink tokens; "
                    f"sink_tokens={self.sink_tokens} allows at most {most} in {shape[3]} tokens"
                )
        else:
            held = most  # version 2: sinks at the start of every chunk
        p = self._plan(shape, out.dtype, held, desc.version)
        if payload.size != p.total:
            raise TransformError(
                f"{self.name} payload has {payload.size} bytes, expected {p.total}"
            )
        v = self._views(payload, p)
        if out.size and p.nq:
            mask = v["hmask"]
            if p.nhi:
                if p.version >= 3:
                    packed = cast(NDArray[np.uint8], mask)
                    mask = np.unpackbits(packed, axis=1, count=p.D, bitorder="little")
                # the kernel sizes each channel's codes by the mask: a forged one
                # (checksum recomputed) must not make it read past the key codes
                if not (np.count_nonzero(mask, axis=1) == p.nhi).all():
                    raise TransformError(
                        f"{self.name} Kitty mask does not mark {p.nhi} channels per head"
                    )
            flat = out.reshape(-1)
            y = flat.view(np.uint16) if out.dtype == np.float16 else flat
            ymax = float(np.finfo(cast(Any, out.dtype)).max)
            cast(Any, decode_kernel)(
                y,
                *self._kernel_args(p),
                *_sections({**v, "hmask": mask}),
                F16_TO_F32,
                ymax,
            )
        e = out.dtype
        out[:, :, :, : p.S] = v["sinks"].view(e).reshape(p.L, 2, p.H, p.S, p.D)
        out[:, :, :, p.T - p.R :] = v["window"].view(e).reshape(p.L, 2, p.H, p.R, p.D)

    def element_bounds(self, array: NDArray[np.generic], *, start: int = 0) -> NDArray[np.float64]:
        """Reference (slow, numpy) per-element bound of the declared :class:`ErrorBound`,
        for the chunk starting at absolute position ``start``."""
        p = self._plan(array.shape, array.dtype, self.chunk_sinks(array.shape[3], start))
        b = self.error_bound
        x = array.astype(np.float64)
        out = np.zeros_like(x)

        def fill(sl: NDArray[np.float64], dst: NDArray[np.float64], axis: int) -> None:
            lo = sl.min(axis=axis, keepdims=True)
            hi = sl.max(axis=axis, keepdims=True)
            mag = np.maximum(np.abs(lo), np.abs(hi))
            dst[...] = b.range_factor * (hi - lo) + b.magnitude_factor * mag + b.absolute

        if self.key_axis == "token":
            t = slice(p.S, p.S + p.nq)
            for d0 in range(0, p.D, p.gk):
                d = slice(d0, min(p.D, d0 + p.gk))
                fill(x[:, 0, :, t, d], out[:, 0, :, t, d], 3)
        for g0 in range(0, p.nq if self.key_axis == "channel" else 0, p.gk):
            t = slice(p.S + g0, p.S + min(p.nq, g0 + p.gk))
            fill(x[:, 0, :, t], out[:, 0, :, t], 2)
        for d0 in range(0, p.D, p.gv):
            d = slice(d0, min(p.D, d0 + p.gv))
            t = slice(p.S, p.S + p.nq)
            fill(x[:, 1, :, t, d], out[:, 1, :, t, d], 3)
        return out


@register_transform
class Int8(QuantTransform):
    """8 bits: keys per channel over the chunk's tokens, values per token."""

    name = "int8"
    bits = 8
    default_key_group = 0
    default_value_group = 0


@register_transform
class Int4(QuantTransform):
    """4 bits KIVI-style, keys in groups of 32 tokens, values in groups of 32 channels."""

    name = "int4"
    bits = 4
    default_key_group = 32
    default_value_group = 32


@register_transform
class Int2(QuantTransform):
    """2 bits KIVI-style (pair with sinks, a window or Kitty channels for quality)."""

    name = "int2"
    bits = 2
    default_key_group = 32
    default_value_group = 32


_SECTIONS = ("hmask", "kcodes", "kzero", "kscale", "vcodes", "vzero", "vscale")
"""The payload sections the encode and decode kernels take, in their argument order."""


def _sections(views: dict[str, NDArray[Any]]) -> tuple[NDArray[Any], ...]:
    return tuple(views[name] for name in _SECTIONS)
