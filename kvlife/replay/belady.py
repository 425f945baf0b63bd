"""Belady's offline optimum for a trace's block touches: the headroom every sweep shows.

Belady (MIN with bypass) knows each touch's next use. On a miss it admits the block only
if it is used again, evicting the resident block whose next use is farthest, and only if
that is farther than the new block's own next use (otherwise it bypasses the new block).
This maximises block hits on the flat sequence of touches (requests in arrival order,
blocks in prompt order), so it bounds every online policy the replay runs: a replay hit
(present when its request arrives, never evicted for a block of the same request) is a
hit of that sequence under the same capacity.

Used by ``kvlife sweep`` beside the online policies and the infinite cache; never by the
store.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from kvlife.core.errors import InvalidArgument


def next_use(blocks: ArrayLike) -> NDArray[np.int64]:
    """For each touch, the index of the next touch of the same block (``len`` if none)."""
    b = np.asarray(blocks, dtype=np.int64)
    n = b.size
    out = np.full(n, n, dtype=np.int64)
    if n > 1:
        order = np.lexsort((np.arange(n), b))  # by block, then by position
        same = b[order[1:]] == b[order[:-1]]
        out[order[:-1][same]] = order[1:][same]
    return out


def belady_hits(blocks: ArrayLike, capacity: int) -> int:
    """Hits of the offline optimum with ``capacity`` blocks on the touches ``blocks``."""
    if capacity < 0:
        raise InvalidArgument(f"capacity must be >= 0 blocks, got {capacity}")
    seq: Sequence[int] = np.asarray(blocks, dtype=np.int64).tolist()
    nxt: list[int] = next_use(seq).tolist()
    never = len(seq)
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped lazily
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for i, b in enumerate(seq):
        nu = nxt[i]
        if b in resident:
            hits += 1
            if nu == never:
                del resident[b]  # never used again: its slot is free from now on
            else:
                resident[b] = nu
                push(heap, (-nu, b))
            continue
        if nu == never or capacity == 0:
            continue  # bypass: a block not used again is never worth a slot
        if len(resident) < capacity:
            resident[b] = nu
            push(heap, (-nu, b))
            continue
        while resident.get(heap[0][1]) != -heap[0][0]:
            pop(heap)  # stale: the block was touched (or left) since this entry
        far = -heap[0][0]
        if far > nu:
            del resident[pop(heap)[1]]
            resident[b] = nu
            push(heap, (-nu, b))
    return hits


def brute_force_hits(blocks: Sequence[int], capacity: int) -> int:
    """The optimum by exhaustive search over every admission and eviction choice (tiny
    sequences only: the test oracle for :func:`belady_hits`)."""
    from functools import cache

    seq = tuple(blocks)

    @cache
    def best(i: int, state: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        b = seq[i]
        if b in state:
            return 1 + best(i + 1, state)
        options = [best(i + 1, state)]  # bypass
        if len(state) < capacity:
            options.append(best(i + 1, state | {b}))
        elif capacity:
            options += [best(i + 1, (state - {v}) | {b}) for v in state]
        return max(options)

    return best(0, frozenset())
