"""The store's one hook into a shared tier (:class:`~kvlife.tiers.base.SharedTier`):
global invalidations and lookups that reach other hosts' KV.

Called by a lookup after its local pass, outside the index lock (it does network I/O):

1. the shared tier's index is read; rules issued by any host since the last lookup are
   applied to the local index (the store's own ``invalidate``), so KV this host holds
   locally stops being served at once too. If the index cannot be read, the lookup
   answers no hits at all: a host cut off from the index may have missed an
   invalidation, and serves nothing rather than something revoked.
2. where the local run ended before the prompt's end, the following keys are probed in
   the shared tier; what other hosts published there, verified (record, identity info
   byte for byte, rules), is adopted as INDEXED objects with a replica in that tier.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlife.core.errors import InvalidArgument, RemoteTierError
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import (
    EXACT,
    ObjectInfo,
    ObjectRecord,
    PromptRef,
    Replica,
    ReplicaState,
    Representation,
)
from kvlife.results import ChunkHit
from kvlife.store.core import Serving, StoreCore
from kvlife.store.forms import DecodeRates
from kvlife.store.invalidation import invalidate
from kvlife.tiers.base import SharedTier, Tier
from kvlife.transforms.contract import Accept

HitOf = Callable[[int, ChunkKey, int, Serving, ObjectRecord, DecodeRates], ChunkHit]
"""How the lookup turns a served replica into a :class:`ChunkHit` (reads' ``_hit``)."""


def shared_tier(core: StoreCore) -> SharedTier | None:
    for tier in core.chain:
        if isinstance(tier, SharedTier):
            return tier
    return None


def consult_shared(
    core: StoreCore,
    prompt: PromptRef,
    keys: list[ChunkKey],
    hits: list[ChunkHit],
    accept: Accept,
    hit_of: HitOf,
) -> list[ChunkHit]:
    """The lookup's hits after the shared tier had its say (see the module docstring)."""
    shared = shared_tier(core)
    if shared is None:
        return hits
    local = len(hits)
    try:
        rules = shared.sync_invalidations()
    except RemoteTierError:
        with core.lock:
            core.counters.lookup_chunks_hit -= local
            core.counters.lookup_chunks_miss += local
        return []
    for rule in rules:
        invalidate(core, **rule.criteria())  # type: ignore[arg-type]
    if rules:
        with core.lock:
            kept = 0
            for h in hits:
                rec = core.index.get(h.key)
                if rec is None or rec.state is not ObjectState.INDEXED:
                    break
                kept += 1
            hits = hits[:kept]
    if len(hits) < len(keys):
        hits = hits + _probe(core, shared, prompt, keys, len(hits), accept, hit_of)
    gained = len(hits) - local
    if gained:
        with core.lock:
            core.counters.lookup_chunks_hit += gained
            core.counters.lookup_chunks_miss -= gained
    return hits


def _probe(
    core: StoreCore,
    shared: SharedTier,
    prompt: PromptRef,
    keys: list[ChunkKey],
    first: int,
    accept: Accept,
    hit_of: HitOf,
) -> list[ChunkHit]:
    n = prompt.tokens_per_chunk
    parent = keys[first - 1] if first else prompt.parent
    infos: list[ObjectInfo] = []
    for i in range(first, len(keys)):
        infos.append(
            ObjectInfo.for_chunk(prompt.identity, prompt.namespace, parent, prompt.start + i * n)
        )
        parent = keys[i]
    with core.lock:  # keys another put is writing right now are its business
        todo = []
        for key in keys[first:]:
            if core.index.get(key) is not None:
                break
            todo.append(key)
    if not todo:
        return []
    try:
        found = shared.probe(todo, [inf.encode() for inf in infos[: len(todo)]])
    except RemoteTierError:
        return []
    assert isinstance(shared, Tier)
    tier = shared.name
    layout = prompt.identity.layout
    out: list[ChunkHit] = []
    with core.lock:
        for j, meta in enumerate(found):
            key = todo[j]
            if core.index.get(key) is not None:
                break
            try:  # the representation the publisher recorded (exact: the engine's bytes)
                form, dtype, shape = Representation.decode(meta.form)
            except (InvalidArgument, TypeError, ValueError):
                break
            dtype = dtype if dtype is not None else meta.dtype
            shape = shape if shape is not None else meta.shape
            if tuple(shape) != layout.chunk_shape or (form is EXACT) != (meta.transform == "exact"):
                break
            nbytes = ObjectRecord.size(dtype, shape)
            rec = ObjectRecord(key, infos[j], dtype, shape, nbytes)
            core.ledger.move(rec, Move.RECOVER, tier=tier, nbytes=meta.nbytes, reason="shared")
            core.ledger.move(rec, Move.INDEX, tier=tier)
            core.index.add(rec)
            rec.replicas[tier] = Replica(tier, meta.nbytes, form, meta.checksum, ReplicaState.READY)
            core.placement.charge(key, tier)
            got = core.serving(rec, accept)
            if got.tier is None:
                break  # adopted, but not a representation this lookup takes
            i = first + j
            out.append(hit_of(i, key, prompt.start + i * n, got, rec, core.decode_rates))
        core.placement.touch_hits([(h.key, h.tier) for h in out])
    return out
