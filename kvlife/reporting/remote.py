"""A shared remote tier for report runs: write-through, LRU within a block capacity.

Engines with a remote KV store (Mooncake Store, LMCache's remote backends, an RDMA or
CXL pool) write every newly computed block through to it and, after the local tiers,
extend a request's usable prefix with the blocks the remote tier holds. This model
keeps that decision separate from the local cache (whose decisions are the store's own
placement engine's): per request, after the local prefix, the run of following blocks
present remotely is fetched; blocks it does not hold are written to it once computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvlife.core.errors import InvalidArgument


class RemoteTier:
    """Block ids held remotely, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise InvalidArgument(f"remote capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.writes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def extend(self, req: Sequence[int], local_prefix: int) -> int:
        """Blocks after ``local_prefix`` served remotely (a leading run), touched."""
        lru = self._lru
        q = 0
        for b in req[local_prefix:]:
            if b not in lru:
                break
            lru.move_to_end(b)
            q += 1
        self.hits += q
        return q

    def store(self, blocks: Sequence[int]) -> int:
        """Write through the blocks not held (most recent); returns how many were written."""
        if not self.capacity:
            return 0
        lru = self._lru
        wrote = 0
        for b in blocks:
            if b in lru:
                lru.move_to_end(b)
                continue
            lru[b] = None
            wrote += 1
            if len(lru) > self.capacity:
                lru.popitem(last=False)
                self.evictions += 1
        self.writes += wrote
        return wrote
