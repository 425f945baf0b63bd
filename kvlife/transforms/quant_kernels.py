"""Numba kernels of the group quantisers in :mod:`kvlife.transforms.quant`.

numba has no float16 on the CPU, so float16 data travels as its uint16 bits: loads go
through a 65536-entry float32 table (fits in L2, one lookup per element) and stores through
a bit-exact round-to-nearest-even conversion (:func:`f32_to_f16_bits`, checked against
numpy in the tests). Type-dependent loads and stores are numba overloads, so one kernel
source serves float16 and float32 and is specialised at compile time.

Codes are packed least significant bits first; 2, 4 and 8 bits divide 8, so no code
straddles a byte. Keys are packed channel-major (each channel's tokens contiguous, each
channel with its own bit width, for the Kitty option), values token-major.
"""

# The overload stubs below have no body for mypy to type, and numba returns its own
# integer types: checked by the round-trip tests instead.
# mypy: disable-error-code="no-untyped-call, no-any-return"
from __future__ import annotations

import math

import numpy as np
from numba import njit, types
from numba.extending import overload
from numpy.typing import NDArray

F16_TO_F32 = (
    np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)
"""float32 value of every float16 bit pattern."""


@njit(cache=True)
def f32_to_f16_bits(
    f: float, scratch: NDArray[np.float32], bits: NDArray[np.uint32]
) -> int:  # pragma: no cover
    """float16 bits of ``f`` rounded to nearest even (inf on overflow, NaN kept)."""
    scratch[0] = f
    b = bits[0]
    sign = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    if e == 0xFF:
        return sign | 0x7C00 | (0x200 if m != 0 else 0)
    e16 = int(e) - 112
    if e16 >= 31:
        return sign | 0x7C00
    if e16 <= 0:
        if e16 < -10:
            return sign
        m = m | 0x800000
        shift = 14 - e16
        half = 1 << (shift - 1)
        r = m >> shift
        rem = m & ((1 << shift) - 1)
        if rem > half or (rem == half and (r & 1) != 0):
            r += 1
        return sign | r
    r = (e16 << 10) | (m >> 13)
    rem = m & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (r & 1) != 0):
        r += 1
    return sign | r


def load(x, i, lut):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Element ``i`` of a flat array as float32 (float16 bits through the table)."""


@overload(load)
def _load_ov(x, i, lut):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(x.dtype, types.Integer):
        return lambda x, i, lut: lut[x[i]]
    return lambda x, i, lut: np.float32(x[i])


def store(x, i, f, scratch, bits):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Store float32 ``f`` at flat index ``i`` (as float16 bits for a uint16 array)."""


@overload(store)
def _store_ov(x, i, f, scratch, bits):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(x.dtype, types.Integer):

        def impl16(x, i, f, scratch, bits):  # type: ignore[no-untyped-def]
            x[i] = f32_to_f16_bits(f, scratch, bits)

        return impl16

    def impl32(x, i, f, scratch, bits):  # type: ignore[no-untyped-def]
        x[i] = f

    return impl32


def store_rounded(x, i, f, up, lut, scratch, bits):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Store ``f`` rounded up (or down) to the array's dtype; returns the stored value."""


@overload(store_rounded)
def _store_rounded_ov(x, i, f, up, lut, scratch, bits):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(x.dtype, types.Integer):

        def impl16(x, i, f, up, lut, scratch, bits):  # type: ignore[no-untyped-def]
            h = f32_to_f16_bits(f, scratch, bits)
            r = lut[h]
            neg = (h & 0x8000) != 0
            if up and r < f:
                h = (h - 1 if h != 0x8000 else 1) if neg else h + 1
            elif (not up) and r > f:
                h = h + 1 if neg else (h - 1 if h != 0 else 0x8001)
            x[i] = h
            return lut[h]

        return impl16

    def impl32(x, i, f, up, lut, scratch, bits):  # type: ignore[no-untyped-def]
        x[i] = f
        return np.float32(f)

    return impl32


@njit(cache=True)
def encode_kernel(  # type: ignore[no-untyped-def]  # pragma: no cover
    x,
    L,
    H,
    T,
    D,
    S,
    nq,
    gk,
    gv,
    kbits_lo,
    kbits_hi,
    nhi,
    vbits,
    hmask,
    kcodes,
    kzero,
    kscale,
    vcodes,
    vzero,
    vscale,
    lut,
):
    """Quantise tokens [S, S+nq) of x (flat, shape (L, 2, H, T, D)) into the outputs.

    kcodes (L*H, kblock) must be zeroed; kzero/kscale (L*H, ngk, D); vcodes (L*H*nq, vrow)
    zeroed; vzero/vscale (L*H*nq, ngv); hmask (L*H, D) is written when nhi > 0.
    """
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    ngk = (nq + gk - 1) // gk
    ngv = (D + gv - 1) // gv
    mn = np.empty(D, np.float32)
    mx = np.empty(D, np.float32)
    zr = np.empty(D, np.float32)
    inv = np.empty(D, np.float32)
    bw = np.empty(D, np.int64)
    off = np.empty(D, np.int64)
    for li in range(L):
        for h in range(H):
            lh = li * H + h
            kbase = ((li * 2 + 0) * H + h) * T * D
            vbase = ((li * 2 + 1) * H + h) * T * D
            # Kitty: the channels with the largest range over the chunk get kbits_hi
            for d in range(D):
                bw[d] = kbits_lo
            if nhi > 0:
                for d in range(D):
                    mn[d] = np.inf
                    mx[d] = -np.inf
                for t in range(S, S + nq):
                    row = kbase + t * D
                    for d in range(D):
                        v = load(x, row + d, lut)
                        mn[d] = min(mn[d], v)
                        mx[d] = max(mx[d], v)
                order = np.argsort(mn - mx)  # descending range
                for j in range(D):
                    hmask[lh, j] = 0
                for j in range(nhi):
                    bw[order[j]] = kbits_hi
                    hmask[lh, order[j]] = 1
            o = 0
            for d in range(D):
                off[d] = o * 8
                o += (nq * bw[d] + 7) // 8
            for g in range(ngk):
                t0 = g * gk
                t1 = min(nq, t0 + gk)
                for d in range(D):
                    mn[d] = np.inf
                    mx[d] = -np.inf
                for t in range(t0, t1):
                    row = kbase + (S + t) * D
                    for d in range(D):
                        v = load(x, row + d, lut)
                        mn[d] = min(mn[d], v)
                        mx[d] = max(mx[d], v)
                for d in range(D):
                    levels = (1 << bw[d]) - 1
                    z = store_rounded(kzero[lh, g], d, mn[d], False, lut, scratch, bits)
                    s = store_rounded(
                        kscale[lh, g], d, (mx[d] - z) / levels, True, lut, scratch, bits
                    )
                    zr[d] = z
                    inv[d] = 1.0 / s if s > 0 else 0.0
                for t in range(t0, t1):
                    row = kbase + (S + t) * D
                    for d in range(D):
                        levels = (1 << bw[d]) - 1
                        q = math.floor((load(x, row + d, lut) - zr[d]) * inv[d] + 0.5)
                        q = min(max(q, 0), levels)
                        pos = off[d] + t * bw[d]
                        kcodes[lh, pos >> 3] |= np.uint8(q << (pos & 7))
            # values: per token, groups of gv along head_dim
            for t in range(nq):
                row = vbase + (S + t) * D
                r = lh * nq + t
                levels = (1 << vbits) - 1
                acc = 0
                for g in range(ngv):
                    d0 = g * gv
                    d1 = min(D, d0 + gv)
                    lo = np.float32(np.inf)
                    hi = np.float32(-np.inf)
                    for d in range(d0, d1):
                        v = load(x, row + d, lut)
                        lo = min(lo, v)
                        hi = max(hi, v)
                    z = store_rounded(vzero[r], g, lo, False, lut, scratch, bits)
                    s = store_rounded(vscale[r], g, (hi - z) / levels, True, lut, scratch, bits)
                    iv = 1.0 / s if s > 0 else 0.0
                    for d in range(d0, d1):
                        q = math.floor((load(x, row + d, lut) - z) * iv + 0.5)
                        q = min(max(q, 0), levels)
                        pos = d * vbits
                        acc |= q << (pos & 7)
                        if (pos & 7) + vbits == 8:
                            vcodes[r, pos >> 3] = acc
                            acc = 0
                if (D * vbits) & 7 != 0:
                    vcodes[r, (D * vbits) >> 3] = acc


@njit(cache=True)
def decode_kernel(  # type: ignore[no-untyped-def]  # pragma: no cover
    out,
    L,
    H,
    T,
    D,
    S,
    nq,
    gk,
    gv,
    kbits_lo,
    kbits_hi,
    nhi,
    vbits,
    hmask,
    kcodes,
    kzero,
    kscale,
    vcodes,
    vzero,
    vscale,
    lut,
    ymax,
):
    """Inverse of :func:`encode_kernel`, writing tokens [S, S+nq) of ``out`` (flat)."""
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    ngk = (nq + gk - 1) // gk
    ngv = (D + gv - 1) // gv
    zr = np.empty(D, np.float32)
    sc = np.empty(D, np.float32)
    bw = np.empty(D, np.int64)
    off = np.empty(D, np.int64)
    for li in range(L):
        for h in range(H):
            lh = li * H + h
            kbase = ((li * 2 + 0) * H + h) * T * D
            vbase = ((li * 2 + 1) * H + h) * T * D
            o = 0
            for d in range(D):
                bw[d] = kbits_hi if (nhi > 0 and hmask[lh, d] != 0) else kbits_lo
                off[d] = o * 8
                o += (nq * bw[d] + 7) // 8
            for g in range(ngk):
                t0 = g * gk
                t1 = min(nq, t0 + gk)
                for d in range(D):
                    zr[d] = load(kzero[lh, g], d, lut)
                    sc[d] = load(kscale[lh, g], d, lut)
                for t in range(t0, t1):
                    row = kbase + (S + t) * D
                    for d in range(D):
                        pos = off[d] + t * bw[d]
                        q = (kcodes[lh, pos >> 3] >> (pos & 7)) & ((1 << bw[d]) - 1)
                        y = min(max(q * sc[d] + zr[d], -ymax), ymax)
                        store(out, row + d, y, scratch, bits)
            for t in range(nq):
                row = vbase + (S + t) * D
                r = lh * nq + t
                mask = (1 << vbits) - 1
                for g in range(ngv):
                    z = load(vzero[r], g, lut)
                    s = load(vscale[r], g, lut)
                    for d in range(g * gv, min(D, g * gv + gv)):
                        pos = d * vbits
                        q = (vcodes[r, pos >> 3] >> (pos & 7)) & mask
                        y = min(max(q * s + z, -ymax), ymax)
                        store(out, row + d, y, scratch, bits)
