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

from kvlife.core.errors import RemoteTierError
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import ObjectInfo, ObjectRecord, PromptRef, Replica, ReplicaState
from kvlife.results import ChunkHit
from kvlife.store.core import StoreCore
from kvlife.store.invalidation import invalidate
from kvlife.tiers.base import SharedTier, Tier


def shared_tier(core: StoreCore) -> SharedTier | None:
    for tier in core.chain:
        if isinstance(tier, SharedTier):
            return tier
    return None


def consult_shared(
    core: StoreCore, prompt: PromptRef, keys: list[ChunkKey], hits: list[ChunkHit]
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
        hits = hits + _probe(core, shared, prompt, keys, len(hits))
    gained = len(hits) - local
    if gained:
        with core.lock:
            core.counters.lookup_chunks_hit += gained
            core.counters.lookup_chunks_miss -= gained
    return hits


def _probe(
    core: StoreCore, shared: SharedTier, prompt: PromptRef, keys: list[ChunkKey], first: int
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
            if meta.shape != layout.chunk_shape or core.index.get(key) is not None:
                break
            rec = ObjectRecord(key, infos[j], meta.dtype, meta.shape, meta.nbytes)
            core.ledger.move(rec, Move.RECOVER, tier=tier, nbytes=meta.nbytes, reason="shared")
            core.ledger.move(rec, Move.INDEX, tier=tier)
            core.index.add(rec)
            rec.replicas[tier] = Replica(
                tier, meta.nbytes, meta.transform, meta.checksum, ReplicaState.READY
            )
            core.placement.charge(key, tier)
            out.append(ChunkHit(first + j, key, prompt.start + (first + j) * n, tier))
        core.placement.touch_hits([(h.key, h.tier) for h in out])
    return out
