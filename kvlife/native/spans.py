"""Where arrays lie in memory, several at once (issue 28).

A load checks its output buffers before anything is read (writable, no two sharing
memory: :func:`kvlife.store.args.check_outs`), a served load finds which of the
session's shared buffers each lies in, and the disk tier checks that each is aligned
for O_DIRECT. Each asked numpy per array (``np.byte_bounds``, ``ndarray.ctypes.data``:
about 2.5 µs apiece, each building a dict or a ctypes object) and a served load paid it
three times over for its four buffers, on a cache the load's bytes had just cooled (70-90
µs of the client's 0.2 ms before its request left, measured with ``kvlife bench
stages``). :func:`spans` reads them through the buffer protocol in one call of the disk
tier's C extension (:mod:`kvlife.native._frames`), and through numpy, array by array,
where the extension is not available or an array exports no strided buffer: the same
answers either way (``tests/test_native_spans.py`` holds them to numpy's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.lib.array_utils import byte_bounds

from kvlife.native import frames


class Span(NamedTuple):
    """An array's memory: ``low`` its lowest byte's address, ``high`` one past its
    highest (``low == high``: it holds no element), and two of its flags."""

    low: int
    high: int
    writable: bool
    c_contiguous: bool


def spans(arrays: Sequence[np.ndarray]) -> list[Span]:
    """The :class:`Span` of each array, as ``np.byte_bounds`` and ``ndarray.flags`` give
    them (an array with no element: ``low == high``). The flags are numpy's own, read
    from each array (numpy's buffer export calls a broadcast array read-only that numpy
    only warns on writing, and any buffer of no bytes contiguous): only the bounds come
    from the extension."""
    module = frames.native_module()
    found = module.spans(arrays) if module is not None else [None] * len(arrays)
    out: list[Span] = []
    for arr, got in zip(arrays, found, strict=True):
        low, high = _numpy_bounds(arr) if got is None else got[:2]
        flags = arr.flags
        out.append(Span(low, high, bool(flags.writeable), bool(flags.c_contiguous)))
    return out


def disjoint(arrays: Sequence[np.ndarray]) -> bool:
    """True when every array is writable (numpy's flag and its buffer export agree),
    C-contiguous, and no two share a byte, found in one call of the extension; False
    decides nothing (the extension is not available, or some array is not so): the
    caller checks them exactly (:func:`kvlife.store.overlap.shared_pair`)."""
    module = frames.native_module()
    return module is not None and bool(module.disjoint(arrays))


def _numpy_bounds(arr: np.ndarray) -> tuple[int, int]:
    if arr.size == 0:
        low: int = arr.__array_interface__["data"][0]
        return low, low
    low, high = byte_bounds(arr)
    return low, high


def c_address(arr: np.ndarray) -> int | None:
    """The address of a C-contiguous array's first byte (None: not C-contiguous), what
    ``ndarray.ctypes.data`` gives, in a fifth of its time where the extension is
    available (0.29 against 1.45 µs; the shared-memory tier asks it of every extent a
    put adopts and a load hands out)."""
    if not arr.flags.c_contiguous:
        return None
    module = frames.native_module()
    got = module.spans((arr,))[0] if module is not None else None
    # C-contiguous: no stride is negative, so the lowest byte is the first one
    return int(got[0]) if got is not None else int(arr.ctypes.data)
