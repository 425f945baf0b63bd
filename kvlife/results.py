"""Typed results of the store's public calls."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from kvlife.core.identity import ChunkKey


@dataclass(frozen=True, slots=True)
class PutResult:
    """What ``put_prompt`` did."""

    chunks: int
    """Full chunks in the prompt (the trailing partial chunk is never stored)."""
    stored: int
    """Chunks newly stored."""
    already_present: int
    """Chunks that were already indexed (touched, not rewritten)."""
    in_flight: int
    """Chunks left to another pending put that is writing the same key."""
    dropped: int
    """Chunks that did not fit in any tier (not stored, counted)."""
    tokens_stored_or_present: int
    """Tokens covered by stored or present chunks from the start of the prompt."""
    keys: list[ChunkKey]
    """Keys of every full chunk, in order."""


@dataclass(frozen=True, slots=True)
class ChunkHit:
    """One chunk of a lookup answer."""

    index: int
    """Chunk number in the prompt."""
    key: ChunkKey
    start: int
    """Absolute position of the chunk's first token."""
    tier: str
    """Fastest tier holding the chunk when it was looked up."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest indexed prefix of a prompt."""

    hits: list[ChunkHit]
    """Leading chunks that are indexed, in order."""
    chunks_total: int
    """Full chunks in the prompt."""
    tokens_per_chunk: int

    @property
    def tokens(self) -> int:
        """Tokens covered by the hits."""
        return len(self.hits) * self.tokens_per_chunk

    def tiers(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.hits:
            out[h.tier] = out.get(h.tier, 0) + 1
        return out


@dataclass(slots=True)
class LoadResult:
    """Arrays of the leading chunks that loaded and verified.

    ``arrays`` holds exactly ``loaded`` arrays, chunk 0 first. A chunk that failed
    verification, and every chunk after it, is a miss: it is not in ``arrays`` (and a
    caller-provided buffer for it must be treated as garbage).
    """

    arrays: list[np.ndarray]
    loaded: int
    requested: int
    tiers: dict[str, int] = field(default_factory=dict)
    """Chunks served per tier."""
    corrupt: list[ChunkKey] = field(default_factory=list)
    """Chunks whose replica failed verification (now invalidated)."""
    vanished: int = 0
    """Chunks invalidated or evicted between lookup and load."""
    read_errors: int = 0
    """Chunks whose read failed with an I/O error (a miss; the replica is kept)."""

    @property
    def complete(self) -> bool:
        return self.loaded == self.requested


@dataclass(slots=True)
class StoreCounters:
    """Event counters of a store (since open, and lifetime totals in ``info``)."""

    puts: int = 0
    chunks_stored: int = 0
    chunks_already_present: int = 0
    chunks_dropped: int = 0
    lookups: int = 0
    lookup_chunks_hit: int = 0
    lookup_chunks_miss: int = 0
    loads: int = 0
    chunks_loaded_dram: int = 0
    chunks_loaded_disk: int = 0
    bytes_loaded: int = 0
    corrupt: int = 0
    read_errors: int = 0
    vanished: int = 0
    demotions: int = 0
    promotions: int = 0
    evictions_dram: int = 0
    evictions_disk: int = 0
    invalidated: int = 0
    recovered: int = 0
    recovery_dropped: int = 0
    aborted: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: dict[str, int]) -> StoreCounters:
        out = StoreCounters(**self.as_dict())
        for f in fields(self):
            setattr(out, f.name, getattr(out, f.name) + int(other.get(f.name, 0)))
        return out


@dataclass(slots=True)
class TierInfo:
    name: str
    capacity_bytes: int
    used_bytes: int
    replicas: int
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StoreInfo:
    """What ``kvlife info`` prints."""

    path: str
    tiers: list[TierInfo]
    objects_by_state: dict[str, int]
    bytes_by_state: dict[str, int]
    counters: dict[str, int]
    """Counters since this open."""
    lifetime_counters: dict[str, int]
    """Counters summed over every session of this store."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
