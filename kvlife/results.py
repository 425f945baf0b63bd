"""Typed results of the store's public calls."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName
from kvlife.transforms.contract import Accept


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
    tier: TierName
    """Fastest tier holding a replica the lookup's Accept takes, when it was looked up."""
    transform: str = "exact"
    """Transform of the replica that will be served (``exact``: the engine's own bytes)."""
    exactness: str = "exact"
    """Its class: ``exact``, ``lossless`` or ``lossy``."""
    stored_nbytes: int = 0
    """Bytes the tier holds for it (what the load reads)."""
    decode_nbytes: int = 0
    """Bytes a decode produces (0: served without decoding)."""
    decode_seconds: float = 0.0
    """Estimated decode time, from this store's measured decode speed of the transform."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest indexed prefix of a prompt."""

    hits: list[ChunkHit]
    """Leading chunks that are indexed, in order."""
    chunks_total: int
    """Full chunks in the prompt."""
    tokens_per_chunk: int
    accept: Accept = Accept.EXACT
    """What the lookup accepted; the load serves the same class of replica."""
    refused: int = 0
    """1 when the run ended at a chunk whose only readable replicas the Accept refused
    (or whose transform this reader does not know), else 0."""
    refusal: str = ""
    """Why that chunk's replicas were refused."""

    @property
    def tokens(self) -> int:
        """Tokens covered by the hits."""
        return len(self.hits) * self.tokens_per_chunk

    def tiers(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.hits:
            out[h.tier] = out.get(h.tier, 0) + 1
        return out

    def sub(self, first: int, stop: int) -> LookupResult:
        """This answer with only the hits ``[first, stop)`` (to load part of a prompt);
        everything else, and the kind of answer, as it is."""
        return replace(self, hits=self.hits[first:stop])


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
    unknown_transform: int = 0
    """Chunks whose frame names a transform or version this reader does not know (a
    miss; the replica is kept)."""
    decoded: int = 0
    """Chunks decoded from a transform's frame."""
    representations: dict[str, int] = field(default_factory=dict)
    """Chunks served per transform (``exact`` for the engine's own bytes)."""

    @property
    def complete(self) -> bool:
        return self.loaded == self.requested


@dataclass(slots=True)
class TierCounters:
    """Event counters of one tier of the chain."""

    stored: int = 0
    """Replicas written into this tier (new puts, promotions, demotions, flushes)."""
    loaded: int = 0
    """Chunks served to loads from this tier."""
    bytes_loaded: int = 0
    evictions: int = 0
    """Replicas dropped from this tier to make room."""
    invalidated_bytes: int = 0
    """Bytes of replicas this tier gave back to invalidations (its room freed when the
    invalidation took them out of service; deleted before it returned)."""


_TIER_PREFIX = "tier."


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
    bytes_loaded: int = 0
    corrupt: int = 0
    read_errors: int = 0
    vanished: int = 0
    demotions: int = 0
    demote_failed: int = 0
    """Demotions whose write failed: the object was dropped (counted, with an event)."""
    promotions: int = 0
    promote_failed: int = 0
    invalidated: int = 0
    evicted: int = 0
    """Objects dropped because their last replica was evicted."""
    recovered: int = 0
    recovery_dropped: int = 0
    aborted: int = 0
    encoded: int = 0
    """Replicas encoded for a tier that transforms (puts placed there, demotions, flushes)."""
    decoded: int = 0
    """Framed replicas decoded (by loads, and by promotions into a plain tier)."""
    lookup_chunks_refused: int = 0
    """Lookups that ended at a chunk whose readable replicas the Accept refused."""
    unknown_transform: int = 0
    """Replicas not served because their transform or version is unknown to this reader."""
    corrupt_frames: int = 0
    """Transform frames that failed verification (counted in ``corrupt`` as well)."""
    direct_loads: int = 0
    """Chunks a client on the server's host read from their disk frames itself, the
    store confirming them live in those frames (:mod:`kvlife.store.direct`)."""
    frame_loads: int = 0
    """Chunks a load read from their disk frames in the extension's run without pins or
    the I/O pool (a server's loads with disk hits: :mod:`kvlife.store.frame_loads`);
    counted in the tier's ``loaded`` as well."""
    sealed_mismatch: int = 0
    """Replicas in memory (DRAM, the server's arena) whose bytes no longer matched the
    seal they were published with, found by a demotion, a flush, ``check`` or a verified
    load; each was dropped (counted in ``corrupt`` as well)."""
    segments_rebuilt: int = 0
    """Lost disk segment files rebuilt from parity at open (``segment_parity``)."""
    segments_unrecoverable: int = 0
    """Lost disk segment files parity could not rebuild (their rows are quarantined)."""
    events_dropped: int = 0
    """Lifecycle events the store's event sink failed to take (its ``emit`` raised): the
    moves themselves happened; the event log misses these."""
    write_through_failed: int = 0
    """New chunks of write-through puts taken out of service because the put could not
    make them (or the chunks it found indexed) durable; the put raised, and each has an
    ``invalidate`` event whose reason is ``write-through failed``."""
    deletes_failed: int = 0
    """Replicas taken out of service whose physical delete failed (an invalidation's,
    a write-through put's undo, a flush copy's, a background one): logged, retried at
    close (:mod:`kvlife.store.deletes`)."""
    per_tier: dict[str, TierCounters] = field(default_factory=dict)
    """Counters of each tier, by tier name."""

    def tier(self, name: str) -> TierCounters:
        got = self.per_tier.get(name)
        if got is None:
            got = self.per_tier[name] = TierCounters()
        return got

    def as_dict(self) -> dict[str, int]:
        """Flat name -> value; tier counters as ``tier.<name>.<counter>``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "per_tier"}
        for name, tc in self.per_tier.items():
            for f in fields(tc):
                out[f"{_TIER_PREFIX}{name}.{f.name}"] = getattr(tc, f.name)
        return out

    def add(self, other: dict[str, int]) -> StoreCounters:
        """These counters plus a flat dict of others (as :meth:`as_dict` writes them)."""
        out = StoreCounters()
        for src in (self.as_dict(), other):
            for key, value in src.items():
                if key.startswith(_TIER_PREFIX):
                    tier, _, counter = key[len(_TIER_PREFIX) :].rpartition(".")
                    tc = out.tier(tier)
                    if counter in _TIER_FIELDS:
                        setattr(tc, counter, getattr(tc, counter) + int(value))
                elif key in _STORE_FIELDS:
                    setattr(out, key, getattr(out, key) + int(value))
        return out


_TIER_FIELDS = frozenset(f.name for f in fields(TierCounters))
_STORE_FIELDS = frozenset(f.name for f in fields(StoreCounters)) - {"per_tier"}


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
