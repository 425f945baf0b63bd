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

import numpy as np
from numba import njit, prange, types
from numba.extending import overload
from numpy.typing import NDArray

F16_TO_F32 = (
    np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)
"""float32 value of every float16 bit pattern."""


@njit(cache=True)
def f16_bits_of_f32_bits(b: int) -> int:  # pragma: no cover
    """float16 bits of the float32 with bits ``b``, rounded to nearest even (inf on
    overflow, NaN kept)."""
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


@njit(cache=True)
def f32_to_f16_bits(
    f: float, scratch: NDArray[np.float32], bits: NDArray[np.uint32]
) -> int:  # pragma: no cover
    """float16 bits of ``f`` (through a one-element float32 scratch and its uint32 view)."""
    scratch[0] = f
    return f16_bits_of_f32_bits(bits[0])


def load(x, i, lut):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Element ``i`` of a flat array as float32 (float16 bits through the table)."""


@overload(load)
def _load_ov(x, i, lut):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(x.dtype, types.Integer):
        return lambda x, i, lut: lut[x[i]]
    return lambda x, i, lut: np.float32(x[i])


def store_row(x, base, row, rowbits, n):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Store float32 ``row[:n]`` at flat ``x[base:base+n]`` (as float16 bits for uint16)."""


@overload(store_row)
def _store_row_ov(x, base, row, rowbits, n):  # type: ignore[no-untyped-def]  # pragma: no cover
    if isinstance(x.dtype, types.Integer):

        def impl16(x, base, row, rowbits, n):  # type: ignore[no-untyped-def]
            for d in range(n):
                b = rowbits[d]
                a = b & 0x7FFFFFFF
                if 0x38800000 <= a < 0x47800000:
                    # float16-normal range: rebias the exponent and round to nearest even
                    # in one add (a carry into the exponent is the correct rounding)
                    x[base + d] = ((b >> 16) & 0x8000) | (
                        (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
                    )
                else:
                    x[base + d] = f16_bits_of_f32_bits(b)

        return impl16

    def impl32(x, base, row, rowbits, n):  # type: ignore[no-untyped-def]
        for d in range(n):
            x[base + d] = row[d]

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
def quant_rows(  # type: ignore[no-untyped-def]  # pragma: no cover
    x, base, S, nq, D, gv, nbits, codes, zero, scale, row0, lut, scratch, bits, vr, sym
):
    """Quantise rows [S, S+nq) of the (T, D) block at flat ``x[base:]`` per token, in
    groups of ``gv`` along D, into codes/zero/scale rows ``row0 + t``; returns the sum of
    ``v - v`` over the values (NaN unless all are finite). ``sym``: a grid symmetric
    about 0 (``zero = -scale * levels / 2``, not stored), scale ``2 max|x| / levels``."""
    ngv = (D + gv - 1) // gv
    levels = (1 << nbits) - 1
    fin = np.float32(0.0)
    for t in range(nq):
        row = base + (S + t) * D
        r = row0 + t
        for d in range(D):
            vr[d] = load(x, row + d, lut)
            fin += vr[d] - vr[d]
        acc = 0
        for g in range(ngv):
            d0 = g * gv
            d1 = min(D, d0 + gv)
            lo = vr[d0]
            hi = vr[d0]
            for d in range(d0, d1):
                lo = min(lo, vr[d])
                hi = max(hi, vr[d])
            if sym:
                m = max(-lo, hi)
                s = store_rounded(scale[r], g, 2 * m / levels, True, lut, scratch, bits)
                z = -s * np.float32(levels * 0.5)  # exact: s has 11 (float16) or 24 bits
            else:
                z = store_rounded(zero[r], g, lo, False, lut, scratch, bits)
                s = store_rounded(scale[r], g, (hi - z) / levels, True, lut, scratch, bits)
            iv = np.float32(1.0 / s) if s > 0 else np.float32(0.0)
            for d in range(d0, d1):
                q = min(int((vr[d] - z) * iv + np.float32(0.5)), levels)
                pos = d * nbits
                acc |= q << (pos & 7)
                if (pos & 7) + nbits == 8:
                    codes[r, pos >> 3] = acc
                    acc = 0
        if (D * nbits) & 7 != 0:
            codes[r, (D * nbits) >> 3] = acc
    return fin


@njit(cache=True)
def dequant_rows(  # type: ignore[no-untyped-def]  # pragma: no cover
    out, base, S, nq, D, gv, nbits, codes, zero, scale, row0, lut, lo_, hi_, vr, vbits_row, sym
):
    """Inverse of :func:`quant_rows`, writing rows [S, S+nq) at flat ``out[base:]``."""
    ngv = (D + gv - 1) // gv
    mask = (1 << nbits) - 1
    for t in range(nq):
        r = row0 + t
        for g in range(ngv):
            s = load(scale[r], g, lut)
            z = -s * np.float32(mask * 0.5) if sym else load(zero[r], g, lut)
            for d in range(g * gv, min(D, g * gv + gv)):
                pos = d * nbits
                q = (codes[r, pos >> 3] >> (pos & 7)) & mask
                vr[d] = min(max(q * s + z, lo_), hi_)
        store_row(out, base + (S + t) * D, vr, vbits_row, D)


@njit(cache=True, parallel=True)
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
    kaxis,
    vsym,
    hmask,
    kcodes,
    kzero,
    kscale,
    vcodes,
    vzero,
    vscale,
    lut,
    finite,
):
    """Quantise tokens [S, S+nq) of x (flat, shape (L, 2, H, T, D)) into the outputs.

    kcodes (L*H, kblock) must be zeroed (group edges share bytes and are OR-ed);
    kzero/kscale (L*H, ngk, D); vcodes (L*H*nq, vrow); vzero/vscale (L*H*nq, ngv);
    hmask (L*H, D) is written when nhi > 0; finite[lh] is NaN unless every quantised
    value of that (layer, head) is finite (v - v is NaN exactly for inf and NaN).
    With kaxis == 1 keys are quantised per token like values (groups of gk along D, the
    wrong axis for keys, kept as a control): kcodes (L*H, nq*krow), kzero/kscale
    (L*H, nq, groups).
    """
    ngk = (nq + gk - 1) // gk
    # one (layer, head) per iteration: outputs are disjoint, scratch is per iteration
    for lh in prange(L * H):
        li = lh // H
        h = lh % H
        scratch = np.empty(1, np.float32)
        bits = scratch.view(np.uint32)
        # one group of keys converted to float32 once, then scanned twice from L1/L2
        kb = np.empty((min(gk, nq), D), np.float32)
        vr = np.empty(D, np.float32)
        mn = np.empty(D, np.float32)
        mx = np.empty(D, np.float32)
        bw = np.empty(D, np.int64)
        off = np.empty(D, np.int64)
        fin = np.float32(0.0)
        kbase = ((li * 2 + 0) * H + h) * T * D
        vbase = ((li * 2 + 1) * H + h) * T * D
        fin += quant_rows(
            x,
            vbase,
            S,
            nq,
            D,
            gv,
            vbits,
            vcodes,
            vzero,
            vscale,
            lh * nq,
            lut,
            scratch,
            bits,
            vr,
            vsym,
        )
        if kaxis == 1:
            # (L*H, nq*krow) codes and (L*H, nq, groups) metadata, seen as rows per token
            fin += quant_rows(
                x,
                kbase,
                S,
                nq,
                D,
                gk,
                kbits_lo,
                kcodes.reshape(L * H * nq, kcodes.shape[1] // nq),
                kzero.reshape(L * H * nq, kzero.shape[2]),
                kscale.reshape(L * H * nq, kscale.shape[2]),
                lh * nq,
                lut,
                scratch,
                bits,
                vr,
                False,
            )
            finite[lh] = fin
            continue
        for d in range(D):
            bw[d] = kbits_lo
        if nhi > 0:
            # Kitty: the channels with the largest range over the chunk get kbits_hi
            mn[:] = np.inf
            mx[:] = -np.inf
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
            n = min(nq, t0 + gk) - t0
            mn[:] = np.inf
            mx[:] = -np.inf
            for tt in range(n):
                row = kbase + (S + t0 + tt) * D
                for d in range(D):
                    v = load(x, row + d, lut)
                    fin += v - v
                    kb[tt, d] = v
                    mn[d] = min(mn[d], v)
                    mx[d] = max(mx[d], v)
            for d in range(D):
                b = bw[d]
                levels = (1 << b) - 1
                z = store_rounded(kzero[lh, g], d, mn[d], False, lut, scratch, bits)
                s = store_rounded(kscale[lh, g], d, (mx[d] - z) / levels, True, lut, scratch, bits)
                inv = np.float32(1.0 / s) if s > 0 else np.float32(0.0)
                pos = off[d] + t0 * b
                acc = 0
                for tt in range(n):
                    # x - z >= 0 (zero rounded down), so int() truncation is floor
                    q = min(int((kb[tt, d] - z) * inv + np.float32(0.5)), levels)
                    if b == 8:
                        kcodes[lh, pos >> 3] = q
                        pos += 8
                        continue
                    sh = pos & 7
                    acc |= q << sh
                    if sh + b == 8:
                        kcodes[lh, pos >> 3] |= acc
                        acc = 0
                    pos += b
                if pos & 7:
                    kcodes[lh, pos >> 3] |= acc
        finite[lh] = fin


@njit(cache=True, parallel=True)
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
    kaxis,
    vsym,
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
    ngk = (nq + gk - 1) // gk
    hi_ = np.float32(ymax)
    lo_ = np.float32(-ymax)
    for lh in prange(L * H):
        li = lh // H
        h = lh % H
        # decoded float32 values are staged per group/row, then converted
        kb = np.empty((min(gk, nq), D), np.float32)
        kbits = kb.view(np.uint32)
        vr = np.empty(D, np.float32)
        vbits_row = vr.view(np.uint32)
        bw = np.empty(D, np.int64)
        off = np.empty(D, np.int64)
        kbase = ((li * 2 + 0) * H + h) * T * D
        vbase = ((li * 2 + 1) * H + h) * T * D
        dequant_rows(
            out,
            vbase,
            S,
            nq,
            D,
            gv,
            vbits,
            vcodes,
            vzero,
            vscale,
            lh * nq,
            lut,
            lo_,
            hi_,
            vr,
            vbits_row,
            vsym,
        )
        if kaxis == 1:
            dequant_rows(
                out,
                kbase,
                S,
                nq,
                D,
                gk,
                kbits_lo,
                kcodes.reshape(L * H * nq, kcodes.shape[1] // nq),
                kzero.reshape(L * H * nq, kzero.shape[2]),
                kscale.reshape(L * H * nq, kscale.shape[2]),
                lh * nq,
                lut,
                lo_,
                hi_,
                vr,
                vbits_row,
                False,
            )
            continue
        o = 0
        for d in range(D):
            bw[d] = kbits_hi if (nhi > 0 and hmask[lh, d] != 0) else kbits_lo
            off[d] = o * 8
            o += (nq * bw[d] + 7) // 8
        for g in range(ngk):
            t0 = g * gk
            n = min(nq, t0 + gk) - t0
            for d in range(D):
                z = load(kzero[lh, g], d, lut)
                s = load(kscale[lh, g], d, lut)
                b = bw[d]
                mask = (1 << b) - 1
                pos = off[d] + t0 * b
                for tt in range(n):
                    q = (kcodes[lh, pos >> 3] >> (pos & 7)) & mask
                    kb[tt, d] = min(max(q * s + z, lo_), hi_)
                    pos += b
            for tt in range(n):
                store_row(out, kbase + (S + t0 + tt) * D, kb[tt], kbits[tt], D)
