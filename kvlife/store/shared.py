"""The store's one hook into a shared tier (:class:`~kvlife.tiers.base.SharedTier`):
global invalidations, creation stamps and lookups that reach other hosts' KV.

Called by a lookup after its local pass, outside the index lock (it does network I/O):

1. the shared tier's index is read; the rules issued by any host that this host has not
   applied yet (and, if the index is new to this host, the reset that drops everything
   created under another incarnation) are applied to the local index through the same
   function as a local invalidation (:mod:`kvlife.store.invalidation`), all of them at
   once under the index lock, puts in flight included; only then does the tier hear
   that they were applied, so a rule is applied at least once, whatever fails after
   (the replicas' deletes run in the background; a failed delete loses no rule). The
   lookup's hits are then checked again: a chunk taken out of service meanwhile, by
   this lookup or a racing one, ends the run. If the index cannot be read, the lookup
   answers no hits at all: a host cut off from the index may have missed an
   invalidation, and serves nothing rather than something revoked.
2. replicas other hosts deleted or replaced in the shared tier (found by reads) are
   dropped from the local index.
3. where the local run ended before the prompt's end, the following keys are probed in
   the shared tier; what other hosts published there, verified (record, identity info
   byte for byte, incarnation, rules), is adopted as INDEXED objects with a replica in
   that tier, carrying the creation stamp of the record. The tier forgets (2) and
   adopts (3) in a sequencer turn of the lookup's own, after every delete planned
   before: deletes go by key, and one meant for an older replica of a key must never
   meet the replica adopted since.

Every put stamps its objects with :func:`creation_stamp` when it is prepared.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from kvlife.core.errors import InvalidArgument, RemoteTierError
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import (
    EXACT,
    UNSTAMPED,
    EpochStamp,
    ObjectInfo,
    ObjectRecord,
    PromptRef,
    Replica,
    ReplicaState,
    Representation,
    TierName,
)
from kvlife.results import ChunkHit
from kvlife.store.core import Serving, StoreCore
from kvlife.store.forms import DecodeRates
from kvlife.store.invalidation import Scope, apply_scopes, record_sources
from kvlife.tiers.base import SharedTier, Tier
from kvlife.transforms.contract import Accept

log = logging.getLogger(__name__)

HitOf = Callable[[int, ChunkKey, int, Serving, ObjectRecord, DecodeRates], ChunkHit]
"""How the lookup turns a served replica into a :class:`ChunkHit` (reads' ``_hit``)."""


def shared_tier(core: StoreCore) -> SharedTier | None:
    for tier in core.chain:
        if isinstance(tier, SharedTier):
            return tier
    return None


def creation_stamp(core: StoreCore) -> EpochStamp:
    """The stamp of KV put now (call outside the index lock: the first one may read the
    index): unknown on a store without a shared tier."""
    shared = shared_tier(core)
    return shared.creation_stamp() if shared is not None else UNSTAMPED


def stamp_moved(core: StoreCore, born: EpochStamp) -> bool:
    """Whether the shared index was read since ``born`` was taken (no I/O): a lookup may
    have applied a rule meanwhile that covers KV of that stamp, and objects made after
    that application would escape it here."""
    shared = shared_tier(core)
    return shared is not None and shared.stamp_now() != born


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
        sync = shared.sync_invalidations()
    except RemoteTierError:
        with core.lock:
            core.counters.lookup_chunks_hit -= local
            core.counters.lookup_chunks_miss += local
        return []
    scopes = [Scope.of_rule(r) for r in sync.rules]
    if sync.fresh:  # the index is new to this host: its rules never reached the others
        scopes.insert(0, Scope(everything=True, outside=sync.incarnation, reason="index new"))
    gone = shared.take_gone()
    with core.lock:
        count, doomed = apply_scopes(core, scopes) if scopes else (0, [])
        doomed += _drop_gone(core, shared, gone)
        kept = 0
        for h in hits:  # this lookup's or a racing one's rules took them out of service
            rec = core.index.get(h.key)
            if rec is None or rec.state is not ObjectState.INDEXED or h.tier not in rec.replicas:
                break
            kept += 1
        hits = hits[:kept]
        core.delete_later(doomed)  # a failure is kept, counted and retried at close
        # What this host holds in the shared tier changes in plan order: the lookup
        # forgets and adopts in a turn of its own, after every delete planned before it
        # (by this lookup's rules or anything else). Deletes go by key: one that ran
        # after a key was adopted again would delete the new record and leave the new
        # replica unheld, its reads unchecked (an int8 frame served as exact KV).
        probing = len(hits) < len(keys)
        ticket = core.seq.take() if gone or probing else None
    turn = core.seq.turn(ticket) if ticket is not None else contextlib.nullcontext()
    with turn:
        shared.invalidations_applied(sync)
        if gone:
            shared.forget(gone)
        if probing:
            hits = hits + _probe(core, shared, prompt, keys, len(hits), accept, hit_of)
    if sync.fresh and count:
        log.warning("global index new to this host: %d objects created before dropped", count)
    gained = len(hits) - local
    if gained:
        with core.lock:
            core.counters.lookup_chunks_hit += gained
            core.counters.lookup_chunks_miss -= gained
    return hits


def _drop_gone(
    core: StoreCore, shared: SharedTier, gone: list[ChunkKey]
) -> list[tuple[TierName, ChunkKey]]:
    """Drop replicas other hosts deleted or replaced in the shared tier (under the
    lock); an object left with no readable replica is retired. Returns the replicas to
    delete physically (the object's other tiers)."""
    assert isinstance(shared, Tier)
    tier = shared.name
    doomed: list[tuple[TierName, ChunkKey]] = []
    for key in gone:
        rec = core.index.get(key)
        rep = rec.replicas.get(tier) if rec is not None else None
        if rec is None or rep is None or rep.state is ReplicaState.WRITING:
            continue
        if rep.counted:
            core.placement.release(key, tier)
        del rec.replicas[tier]
        if rec.state is ObjectState.INDEXED and not any(r.lasting for r in rec.replicas.values()):
            doomed += core.retire(rec, Move.INVALIDATE, "shared replica gone")
    return doomed


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
    with core.lock:  # the sources the putter's record keeps (its parent's too)
        deps = record_sources(core, prompt, len(keys))
    for i in range(first, len(keys)):
        infos.append(
            ObjectInfo.for_chunk(
                prompt.identity, prompt.namespace, parent, prompt.start + i * n, deps[i]
            )
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
    adopted = 0
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
            try:
                born = EpochStamp.decode(meta.born)
            except InvalidArgument:
                break
            rec = ObjectRecord(key, infos[j], dtype, shape, nbytes, born=born)
            core.ledger.move(rec, Move.RECOVER, tier=tier, nbytes=meta.nbytes, reason="shared")
            core.ledger.move(rec, Move.INDEX, tier=tier)
            core.index.add(rec)
            rec.replicas[tier] = Replica(tier, meta.nbytes, form, meta.checksum, ReplicaState.READY)
            core.placement.charge(key, tier)
            adopted += 1
            got = core.serving(rec, accept)
            if got.tier is None:
                break  # adopted, but not a representation this lookup takes
            i = first + j
            out.append(hit_of(i, key, prompt.start + i * n, got, rec, core.decode_rates))
        core.placement.touch_hits([h.key for h in out], [h.tier for h in out])
    if adopted < len(found):  # charged by the probe, but not adopted here
        shared.forget([m.key for m in found[adopted:]])
    return out
