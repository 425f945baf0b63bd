"""Whether a load's output buffers share memory, exactly (each chunk needs memory of its
own: two chunks read into one place both report success with only the last one's bytes
there, and one chunk read into a buffer whose elements overlap reads back wrong).

:func:`shared_pair` finds a pair of buffers that share a byte, or a buffer two of whose
elements share one, or says there is none, with no false answer either way:

- Buffers whose spans (lowest to one past highest byte) are disjoint share nothing: the
  common case (separate arrays, contiguous slices of one) costs a sort.
- Buffers whose spans overlap are grouped (a run of spans, sorted by their low end,
  each starting before the furthest end so far). Up to :data:`PAIRWISE` pairs (32
  buffers): ``np.shares_memory`` on each pair whose spans overlap, exact (chunk slices
  ``buf[:, :, :, t0:t1, :]`` of one per-layer KV buffer all span most of it: 16 of them
  0.1 ms). More: every buffer cut into its contiguous runs of bytes, all the group's
  runs sorted by start, and a run that starts before an earlier one ended is a shared
  byte (numpy, a run per layer and head: about 3 ms for 128 chunk slices, where a
  pair-by-pair check would take 7). A group of more than :data:`MAX_RUNS` runs is
  checked pair by pair.
- A buffer overlaps itself only if it is not C-contiguous and its strides fail the
  usual sufficient test (sorted by size, each stride reaches past everything the
  smaller ones span); such a buffer is cut into its runs and checked the same way
  (more than :data:`MAX_RUNS` runs: reported as overlapping, refused rather than
  guessed).

Found by the red team of issue 28 (``tests/attack/test_spans_attack.py``): the check
before this compared each buffer with its predecessor and with the one reaching
furthest, and missed a third buffer sharing a byte with an earlier one that was
neither; and it never looked inside one buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np

from kvlife.native.spans import Span
from kvlife.tiers.buffers import contiguous_tail

MAX_RUNS = 1 << 20
"""Contiguous runs the exact check cuts one group into at most."""

PAIRWISE = 496
"""Pairs of a group checked one by one with ``np.shares_memory`` at most (32 buffers;
about 1 µs a pair of chunk slices): a larger group is cut into runs."""


def shared_pair(arrays: Sequence[np.ndarray], where: Sequence[Span]) -> tuple[int, int] | None:
    """Indices ``(i, j)``, ``i < j``, of two arrays that share a byte, or ``(i, i)`` for
    an array two of whose elements share one; None when every byte of every array is
    its own. ``where``: each array's span (:func:`kvlife.native.spans.spans`)."""
    layouts = _Layouts()
    for i, (arr, span) in enumerate(zip(arrays, where, strict=True)):
        if span.high > span.low and not span.c_contiguous and layouts.may_self_overlap(arr):
            runs = layouts.runs(arr)
            if runs is None or _clash(*_gathered([i], [runs])) is not None:
                return (i, i)
    order = sorted((s.low, s.high, i) for i, s in enumerate(where) if s.high > s.low)
    group: list[int] = []
    reach = 0
    for low, high, i in order:
        if group and low < reach:
            group.append(i)
            reach = max(reach, high)
            continue
        found = _group_pair(arrays, where, group, layouts)
        if found is not None:
            return found
        group, reach = [i], high
    return _group_pair(arrays, where, group, layouts)


def _group_pair(
    arrays: Sequence[np.ndarray], where: Sequence[Span], group: list[int], layouts: _Layouts
) -> tuple[int, int] | None:
    if len(group) < 2:
        return None
    if len(group) * (len(group) - 1) // 2 <= PAIRWISE:
        return _pairwise(arrays, where, group)
    runs = [layouts.runs(arrays[i]) for i in group]
    if any(r is None for r in runs) or sum(len(r[0]) for r in runs if r is not None) > MAX_RUNS:
        return _pairwise(arrays, where, group)
    return _clash(*_gathered(group, [r for r in runs if r is not None]))


def _pairwise(
    arrays: Sequence[np.ndarray], where: Sequence[Span], group: list[int]
) -> tuple[int, int] | None:
    """``np.shares_memory`` on each pair of the group whose spans overlap."""
    for a, b in combinations(sorted(group), 2):
        overlapping = where[a].low < where[b].high and where[b].low < where[a].high
        if overlapping and np.shares_memory(arrays[a], arrays[b]):
            return (a, b)
    return None


class _Layouts:
    """What one call learns of each layout (shape, strides, item size): chunk slices of
    one buffer share theirs, so their runs differ by where each begins."""

    def __init__(self) -> None:
        self._may_overlap: dict[tuple[object, ...], bool] = {}
        self._runs: dict[tuple[object, ...], tuple[np.ndarray, int] | None] = {}

    def may_self_overlap(self, arr: np.ndarray) -> bool:
        key = (arr.shape, arr.strides, arr.itemsize)
        got = self._may_overlap.get(key)
        if got is None:
            got = self._may_overlap[key] = _may_self_overlap(arr)
        return got

    def runs(self, arr: np.ndarray) -> tuple[np.ndarray, int] | None:
        """The start addresses of ``arr``'s runs and their length (None: too many)."""
        key = (arr.shape, arr.strides, arr.itemsize)
        if key not in self._runs:
            self._runs[key] = _relative_runs(arr)
        rel = self._runs[key]
        if rel is None:
            return None
        return rel[0] + arr.__array_interface__["data"][0], rel[1]


def _may_self_overlap(arr: np.ndarray) -> bool:
    """False when the strides prove no two elements share a byte: sorted by size, each
    stride is at least what the axes of smaller strides span, one item included."""
    axes = sorted((abs(st), n) for st, n in zip(arr.strides, arr.shape, strict=True) if n > 1)
    extent = arr.itemsize
    for stride, n in axes:
        if stride < extent:
            return True
        extent = stride * (n - 1) + extent
    return False


def _relative_runs(arr: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Where ``arr``'s contiguous runs of bytes start, from its first element (its
    trailing axes that are contiguous make one run), and their length; None beyond
    :data:`MAX_RUNS`."""
    outer, length = contiguous_tail(arr)
    count = 1
    for n in arr.shape[:outer]:
        count *= n
    if count > MAX_RUNS:
        return None
    starts = np.zeros(1, dtype=np.int64)
    for n, stride in zip(arr.shape[:outer], arr.strides[:outer], strict=True):
        if n > 1:
            steps = np.arange(n, dtype=np.int64) * stride
            starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts, length


def _gathered(
    owners: Sequence[int], runs: Sequence[tuple[np.ndarray, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts = np.concatenate([r[0] for r in runs])
    ends = starts + np.repeat(
        np.array([r[1] for r in runs], dtype=np.int64), [len(r[0]) for r in runs]
    )
    who = np.repeat(np.array(owners, dtype=np.int64), [len(r[0]) for r in runs])
    return starts, ends, who


def _clash(starts: np.ndarray, ends: np.ndarray, who: np.ndarray) -> tuple[int, int] | None:
    """Owners of two runs that share a byte (a run of no bytes shares none), or None."""
    keep = ends > starts
    starts, ends, who = starts[keep], ends[keep], who[keep]
    if len(starts) < 2:
        return None
    order = np.argsort(starts, kind="stable")
    starts, ends, who = starts[order], ends[order], who[order]
    furthest = np.maximum.accumulate(ends)
    hits = np.nonzero(starts[1:] < furthest[:-1])[0]
    if not len(hits):
        return None
    j = int(hits[0]) + 1
    k = int(np.argmax(ends[:j]))  # an earlier run reaching past run j's start
    a, b = sorted((int(who[k]), int(who[j])))
    return (a, b)
