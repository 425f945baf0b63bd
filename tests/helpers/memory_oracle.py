"""Brute force over every element's bytes: which arrays share memory, and which overlap
themselves (the oracle of kvlife.store.overlap's tests)."""

from __future__ import annotations

import numpy as np


def element_starts(arr: np.ndarray) -> np.ndarray:
    """The address of every element of ``arr``."""
    starts = np.array([arr.__array_interface__["data"][0]], dtype=np.int64)
    for n, stride in zip(arr.shape, arr.strides, strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).reshape(-1)
    return starts if arr.size else starts[:0]


def self_overlaps(arr: np.ndarray) -> bool:
    """Two elements of ``arr`` share a byte."""
    s = np.sort(element_starts(arr))
    return arr.itemsize > 0 and bool(np.any(np.diff(s) < arr.itemsize))


def share(a: np.ndarray, b: np.ndarray) -> bool:
    """An element of ``a`` and one of ``b`` share a byte."""
    if not a.size or not b.size or not a.itemsize or not b.itemsize:
        return False
    sa, sb = element_starts(a), np.sort(element_starts(b))
    first = np.searchsorted(sb, sa - b.itemsize + 1)  # the first b start reaching past sa
    hit = sb[np.minimum(first, len(sb) - 1)] < sa + a.itemsize
    return bool(np.any((first < len(sb)) & hit))
