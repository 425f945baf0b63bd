"""The live executor of placement plans: real reads, writes and deletes, outside the
index lock, with each group's outcome published under it.

Consecutive actions of one kind between the same tiers run as one batch (one
``commit_store``, one ``delete_batch``). Every planned action runs even when an earlier
one failed, because placement already counted on it; failures are published as typed,
counted outcomes:

- a failed **placement** aborts its new objects (nothing of the batch is visible);
- a failed **demotion** drops the objects whose only other replica was being evicted,
  counted as ``demote_failed`` and emitted with the reason (never silently);
- a failed **promotion** or **flush/write-through copy** removes the copy; the source
  replica stays;
- a copy out of a tier that seals replicas in memory verifies each replica's seal
  before its bytes become durable anywhere (a replica sealed in this same plan
  excepted: a put's write-through): the destination checks it as it hashes what it
  writes anyway, or the source is verified as it is read; the checksum a copy's bytes
  are known by goes with them, so no tier hashes them twice. A replica that changed in
  memory is counted (``corrupt``, ``sealed_mismatch``) and dropped, its object
  invalidated as corrupt if it was the last readable copy; it is never made durable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlife.core.errors import (
    ChecksumMismatch,
    KVLifeError,
    ReplicaNotFound,
    ReplicaReadError,
    StorageFullError,
    StorePathError,
)
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import EXACT, ObjectRecord, Replica, ReplicaState, Representation, TierName
from kvlife.placement import Copy, Evict, Place
from kvlife.store import deletes
from kvlife.store.core import Bound, StoreCore
from kvlife.store.forms import Converted, convert, meta_for
from kvlife.tiers.base import (
    CapacityShortfall,
    ChecksumsWrites,
    KeepsEdges,
    ReadResult,
    SealedInMemory,
    SupportsAdopt,
    Tier,
)

INDEXED = ObjectState.INDEXED


@dataclass(slots=True)
class Outcome:
    """What the execution of one plan did."""

    placed: list[ChunkKey] = field(default_factory=list)
    """New objects now indexed."""
    failed_places: dict[ChunkKey, Exception] = field(default_factory=dict)
    failed_copies: list[tuple[Copy, Exception]] = field(default_factory=list)
    unsealed: dict[ChunkKey, ChecksumMismatch] = field(default_factory=dict)
    """Copies given up because their source replica failed its seal (counted corrupt and
    dropped, not failed writes), with what the check found."""
    errors: list[Exception] = field(default_factory=list)
    """Failed placements and deletes, in order (the first is what a caller raises).
    Failed copies are outcomes, counted and listed in ``failed_copies``."""

    def copy_errors(self, reason: str) -> list[Exception]:
        """Errors of the failed copies made for ``reason`` (e.g. ``flush``)."""
        return [err for copy, err in self.failed_copies if copy.reason == reason]


def execute(
    core: StoreCore,
    bound: Sequence[Bound],
    *,
    payloads: dict[ChunkKey, np.ndarray] | None = None,
    sources: dict[ChunkKey, tuple[np.ndarray, Representation, bytes]] | None = None,
    request_id: str = "",
    protect: set[ChunkKey] | None = None,
    seals: dict[ChunkKey, bytes] | None = None,
) -> Outcome:
    """Run a bound plan in order (the caller holds the plan's sequencer turn).

    ``protect``: keys no extra eviction may take while a tier refuses a batch placement
    made room for (a put's whole prompt; by default the batch itself). ``seals``: the
    xxh3-128 of some ``payloads``, hashed by the caller while they were written
    (:attr:`PendingPut.seals`): a tier holding replicas in memory takes it as its seal
    (a writer that changes the bytes after is caught where seals are verified, as one
    that writes after its put committed), any other tier checks it as it hashes."""
    out = Outcome()
    fresh = set(payloads or ())
    for group in _groups(bound):
        action = group[0].action
        if isinstance(action, Place):
            keys = protect if protect is not None else {b.rec.key for b in group}
            _place(core, action.tier, group, payloads or {}, request_id, keys, out, seals)
        elif isinstance(action, Copy):  # protects its batch (and ``protect``)
            # a seal the caller vouched for was not hashed from the replica's bytes by
            # this store: checked like an older replica's before it becomes durable
            hashed_here = fresh - set(seals or ())
            _copy(core, action.src, action.dst, group, sources or {}, hashed_here, out, protect)
        elif isinstance(action, Evict):
            _evict(core, action.tier, group, out)
        # Drop and Reject were fully applied when planned (nothing physical to do)
    return out


def _groups(bound: Sequence[Bound]) -> list[list[Bound]]:
    groups: list[list[Bound]] = []
    last: tuple[object, ...] | None = None
    for b in bound:
        a = b.action
        if isinstance(a, Place):
            sig: tuple[object, ...] = (Place, a.tier)
        elif isinstance(a, Copy):
            sig = (Copy, a.src, a.dst, a.reason)
        elif isinstance(a, Evict):
            sig = (Evict, a.tier)
        else:
            sig = (type(a),)
        if sig == last:
            groups[-1].append(b)
        else:
            groups.append([b])
            last = sig
    return groups


def _write(
    core: StoreCore,
    tier_name: TierName,
    recs: list[ObjectRecord],
    arrays: list[np.ndarray],
    protect: set[ChunkKey],
    *,
    adopt: bool = False,
    forms: list[Representation] | None = None,
    checksums: list[bytes] | None = None,
    verify: list[bool] | None = None,
) -> list[Converted]:
    """Convert (encode for a transforming tier, decode a frame for a plain one), then
    prepare + commit one batch in a tier; raises a typed error on failure. ``forms``:
    the representation of each array (default: exact); ``checksums``: the xxh3-128 each
    array is known by (verified or sealed in this plan; passed on unless the copy
    changed the bytes); ``verify``: the tier checks the bytes against that checksum
    (else it takes it as given). Returns what was written.

    Placement made room by its count of live bytes; a tier can still refuse (garbage a
    disk tier cannot compact yet, a frame larger than its bound). Then more victims are
    evicted, as placement chooses them, until the batch fits or nothing more can go.
    """
    tier = core.tiers[tier_name]
    enc = core.encoders.get(tier_name)
    src = forms if forms is not None else [EXACT] * len(recs)
    done = [convert(r, a, f, enc, tier_name) for r, a, f in zip(recs, arrays, src, strict=True)]
    arrays = [c.array for c in done]
    sums = checksums if checksums is not None else [b""] * len(recs)
    checks = verify if verify is not None else [False] * len(recs)
    links: list[tuple[tuple[bytes, bytes], ...]] = [()] * len(recs)
    if isinstance(tier, KeepsEdges):
        with core.lock:
            links = core.links_for(tier, recs)
    metas = [
        meta_for(r, c.array, c.form, b"" if c.changed else h, ln, v and not c.changed)
        for r, c, h, ln, v in zip(recs, done, sums, links, checks, strict=True)
    ]
    while True:
        res = tier.prepare_store(metas)
        if not isinstance(res, CapacityShortfall):
            break
        with core.lock:
            plan = core.placement.plan_evict(tier_name, res.need_bytes, core.protected(protect))
            bound = core.residency.take()
        if not plan:
            raise StorageFullError(
                f"tier {tier_name} is {res.need_bytes} bytes short for {len(recs)} replicas "
                "and has nothing left to evict"
            )
        extra = execute(core, bound)
        if extra.errors:
            raise extra.errors[0]
    if (adopt or any(c.changed for c in done)) and isinstance(tier, SupportsAdopt):
        if not adopt:  # adopt only what this call made: the caller's arrays are copied
            arrays = [c.array if c.changed else c.array.copy() for c in done]
        tier.commit_adopt(res, arrays)
    else:
        tier.commit_store(res, arrays)
    return done


def _place(
    core: StoreCore,
    tier_name: TierName,
    group: list[Bound],
    payloads: dict[ChunkKey, np.ndarray],
    request_id: str,
    protect: set[ChunkKey],
    out: Outcome,
    seals: dict[ChunkKey, bytes] | None = None,
) -> None:
    recs = [b.rec for b in group]
    sums: list[bytes] | None = None
    verify: list[bool] | None = None
    if seals:
        sums = [seals.get(r.key, b"") for r in recs]
        verify = [not isinstance(core.tiers[tier_name], SealedInMemory)] * len(recs)
    try:
        _write(
            core,
            tier_name,
            recs,
            [payloads[r.key] for r in recs],
            protect,
            checksums=sums,
            verify=verify,
        )
    except (KVLifeError, OSError) as exc:
        with core.lock:
            for b in group:
                _abort_new(core, b.rec, str(exc))
                out.failed_places[b.rec.key] = exc
        out.errors.append(exc)
        return
    gone: list[tuple[TierName, ChunkKey]] = []
    with core.lock:
        ledger = core.ledger
        tc = core.counters.tier(tier_name)
        for b in group:
            rec, rep = b.rec, b.replica
            assert rep is not None
            if rec.state is not ObjectState.TENTATIVE or rec.replicas.get(tier_name) is not rep:
                gone.append((tier_name, rec.key))  # given up meanwhile: its bytes go too
                continue
            _sealed(core, tier_name, rec.key, rep)
            core.residency.settle(rec, rep, ReplicaState.READY)
            name = rep.transform.name
            if rep.transform.framed:
                core.counters.encoded += 1
            ledger.move(
                rec,
                Move.WRITE,
                tier=tier_name,
                nbytes=rec.nbytes,
                request_id=request_id,
                transform=name,
            )
            ledger.move(rec, Move.SEAL, tier=tier_name, nbytes=rep.nbytes, transform=name)
            ledger.move(rec, Move.COMMIT, tier=tier_name)
            ledger.move(rec, Move.INDEX, tier=tier_name)
            tc.stored += 1
            out.placed.append(rec.key)
        orphaned = core.orphaned_links([b.rec for b in group if b.rec.state is INDEXED])
    for keeper, links in orphaned.items():
        tier = core.tiers[keeper]
        assert isinstance(tier, KeepsEdges)
        try:
            tier.keep_edges(links)
        except (KVLifeError, OSError) as exc:
            out.errors.append(exc)
    deletes.delete_or_keep(core, gone)  # out of service already: a failure is kept


def _sealed(core: StoreCore, tier_name: TierName, key: ChunkKey, rep: Replica) -> None:
    """Record what the tier sealed the replica with (its checksum, where it keeps one),
    its representation and the bytes it takes there."""
    with contextlib.suppress(ReplicaNotFound):
        meta = core.tiers[tier_name].meta(key)
        rep.checksum, rep.nbytes = meta.checksum, meta.nbytes
        rep.transform = Representation.decode(meta.form)[0] if meta.form else EXACT


def _abort_new(core: StoreCore, rec: ObjectRecord, why: str) -> None:
    """A new object whose write failed: it never becomes visible."""
    if rec.state is not ObjectState.TENTATIVE:
        return
    core.placement.forget(rec.key)
    for rep in list(rec.replicas.values()):
        core.residency.settle(rec, rep, None)
    core.ledger.move(rec, Move.ABORT, reason=f"write failed: {why}")
    core.counters.aborted += 1
    core.index.remove(rec.key)


def _planned(b: Bound, tier: TierName) -> bool:
    """The bound replica is still the object's, and the object still live."""
    rec = b.rec
    live = rec.state is INDEXED or rec.state is ObjectState.TENTATIVE
    return live and rec.replicas.get(tier) is b.replica


def _copy(
    core: StoreCore,
    src: TierName,
    dst: TierName,
    group: list[Bound],
    sources: dict[ChunkKey, tuple[np.ndarray, Representation, bytes]],
    fresh: set[ChunkKey],
    out: Outcome,
    protect: set[ChunkKey] | None = None,
) -> None:
    """Copy ``group`` from ``src`` into ``dst``; room made for it there never takes the
    batch or ``protect`` (a write-through put's whole prompt). ``fresh``: replicas this
    plan placed and sealed from their own bytes (no need to verify them again)."""
    with core.lock:  # objects invalidated since the plan was made need no copy
        todo = [b for b in group if _planned(b, dst)]
        held = {b.rec.key: _form_in(b.rec, src) for b in todo}
        seals = {b.rec.key: _checksum_in(b.rec, src) for b in todo}
    source, target = core.tiers[src], core.tiers[dst]
    # A replica sealed in memory before this plan is verified before it becomes durable
    # anywhere: by a destination that hashes what it writes anyway, as it writes (its
    # bytes unchanged by the copy), else here, as it is read. Hashed once either way.
    check = {k for k in held if isinstance(source, SealedInMemory) and k not in fresh}
    at_target = {k for k in check if _checked_by(core, target, dst, held[k])}
    changed: dict[ChunkKey, ChecksumMismatch] = {}
    error: Exception | None = None
    written: dict[ChunkKey, Converted] = {}
    retry_vanished = True
    while todo:
        recs = [b.rec for b in todo]
        try:
            got = {r.key: sources[r.key][:2] for r in recs if r.key in sources}
            missing = [r.key for r in recs if r.key not in got]
            for key, res in _read_sources(source, missing, check - at_target):
                if key in check and isinstance(res, ChecksumMismatch):
                    changed[key] = res  # changed in memory: this replica goes, not the batch
                elif isinstance(res, (ChecksumMismatch, ReplicaReadError)):
                    raise res
                else:
                    got[key] = (res, held[key])
            todo = [b for b in todo if b.rec.key not in changed]
            recs = [b.rec for b in todo]
            if not todo:
                break
            # arrays this copy read from a slower tier belong to nobody else and may be
            # adopted; arrays a load handed to its caller never become a replica (they
            # are copied), nor views of a first-tier replica
            handed = any(r.key in sources for r in recs)
            done = _write(
                core,
                dst,
                recs,
                [got[r.key][0] for r in recs],
                {r.key for r in recs}.union(protect or ()),
                adopt=src != core.chain[0].name and not handed,
                forms=[got[r.key][1] for r in recs],
                # the source's checksum names these bytes only in the source's form (a
                # load hands over a frame decoded: its bytes are not the frame's)
                checksums=[_seal_of_copy(r.key, got[r.key][1], held, seals, sources) for r in recs],
                verify=[r.key in at_target for r in recs],
            )
            written = {r.key: c for r, c in zip(recs, done, strict=True)}
            error = None
            break
        except ChecksumMismatch as exc:
            key = ChunkKey(bytes.fromhex(exc.key_hex))
            if key in at_target and key not in changed:
                changed[key] = exc  # the destination found it changed: the others again
                todo = [b for b in todo if b.rec.key != key]
                continue
            error = exc
            break
        except ReplicaNotFound as exc:
            error = exc
            if not retry_vanished:
                break
            retry_vanished = False  # invalidated while the read ran? then the others go
            with core.lock:
                todo = [b for b in todo if _planned(b, dst)]
        except (KVLifeError, OSError) as exc:
            error = exc
            break
    doomed: list[tuple[TierName, ChunkKey]] = []
    with core.lock:
        for b in group:
            mismatch = changed.get(b.rec.key)
            if mismatch is not None:
                doomed += _source_changed(core, b, src, mismatch, out)
        for b in todo:
            doomed += _publish_copy(core, b, error, out, written.get(b.rec.key))
    deletes.delete_or_keep(core, doomed)  # out of service already: a failure is kept


def _checked_by(core: StoreCore, target: Tier, dst: TierName, form: Representation) -> bool:
    """Whether ``target`` can check a replica's seal as it writes it: it hashes what it
    writes, and the copy does not change the bytes (no encode into it, no decode)."""
    if not isinstance(target, ChecksumsWrites):
        return False
    return not form.framed if dst not in core.encoders else not form.exact


def _read_sources(
    tier: Tier, keys: list[ChunkKey], verify: set[ChunkKey]
) -> list[tuple[ChunkKey, ReadResult]]:
    """Read the copy's sources from ``tier``, those in ``verify`` checked against their
    seals as they are read."""
    if not keys:
        return []
    check = [k for k in keys if k in verify]
    plain = [k for k in keys if k not in verify]
    got: dict[ChunkKey, ReadResult] = {}
    if check:
        assert isinstance(tier, SealedInMemory)
        got.update(zip(check, tier.read_verified(check), strict=True))
    if plain:
        got.update(zip(plain, tier.read_batch(plain), strict=True))
    return [(k, got[k]) for k in keys]


def _source_changed(
    core: StoreCore, b: Bound, src: TierName, exc: ChecksumMismatch, out: Outcome
) -> list[tuple[TierName, ChunkKey]]:
    """A copy's source replica failed its seal (under the lock): the copy is given up,
    the replica dropped and counted; its object goes too if that was its last readable
    replica. Returns the replicas to delete."""
    action = b.action
    assert isinstance(action, Copy)
    rec, rep = b.rec, b.replica
    assert rep is not None
    if _planned(b, action.dst):
        core.placement.release(rec.key, action.dst)
        core.residency.settle(rec, rep, None)
    # not a failed copy (nothing of it was written): a corrupt replica, its own outcome
    out.unsealed[rec.key] = exc
    core.counters.sealed_mismatch += 1
    return core.drop_corrupt(rec, src, f"corrupt: {exc} (found by {action.reason})")


def _form_in(rec: ObjectRecord, tier: TierName) -> Representation:
    rep = rec.replicas.get(tier)
    return rep.transform if rep is not None else EXACT


def _checksum_in(rec: ObjectRecord, tier: TierName) -> bytes:
    rep = rec.replicas.get(tier)
    return rep.checksum if rep is not None else b""


def _publish_copy(
    core: StoreCore,
    b: Bound,
    error: Exception | None,
    out: Outcome,
    written: Converted | None = None,
) -> list[tuple[TierName, ChunkKey]]:
    """Publish one copy's outcome (under the lock); returns replicas to delete."""
    action = b.action
    assert isinstance(action, Copy)
    rec, rep = b.rec, b.replica
    assert rep is not None
    planned = _planned(b, action.dst)
    if error is None and planned:
        _sealed(core, action.dst, rec.key, rep)
        core.residency.settle(rec, rep, ReplicaState.READY)
        form = rep.transform
        if written is not None and written.changed and rec.state is INDEXED:
            core.ledger.move(
                rec,
                Move.TRANSFORM,
                tier=action.dst,
                nbytes=rep.nbytes,
                transform=form.name,
                reason=f"{written.changed}d on {action.reason} ({form.name})",
            )
            if written.changed == "encode":
                core.counters.encoded += 1
            else:
                core.counters.decoded += 1
        core.ledger.move(
            rec,
            Move.OFFLOAD,
            tier=action.src,
            dst=action.dst,
            nbytes=rec.nbytes,
            reason=action.reason,
            transform=form.name,
        )
        core.counters.tier(action.dst).stored += 1
        if action.reason == "demote":
            core.counters.demotions += 1
        elif action.reason == "promote":
            core.counters.promotions += 1
        return []
    if not planned:  # the object went away meanwhile: whatever was written goes too
        return [(action.dst, rec.key)] if error is None else []
    core.placement.release(rec.key, action.dst)
    core.residency.settle(rec, rep, None)
    assert error is not None
    out.failed_copies.append((action, error))
    if action.reason == "demote":
        core.counters.demote_failed += 1
    elif action.reason == "promote":
        core.counters.promote_failed += 1
    if not any(r.lasting for r in rec.replicas.values()):
        # the replica being demoted was the last one: dropped, counted, explained
        return core.retire(rec, Move.INVALIDATE, f"{action.reason} to {action.dst} failed: {error}")
    return []


def _evict(core: StoreCore, tier_name: TierName, group: list[Bound], out: Outcome) -> None:
    """The eviction step: each replica, served until now (EVICTING: a copy that demotes
    it was published before this step), leaves service, then its bytes go."""
    with core.lock:
        for b in group:
            rep = b.replica
            if rep is not None and rep.state is ReplicaState.EVICTING:
                rep.state = ReplicaState.LEAVING
    keys = [b.rec.key for b in group]
    failed = deletes.delete_or_keep(core, [(tier_name, k) for k in keys])
    if failed is not None:  # their room is not free: the plan's error, typed
        out.errors.append(
            StorePathError(f"evicting {len(keys)} replicas from tier {tier_name}: {failed}")
        )
    with core.lock:
        for b in group:
            rep = b.replica
            if b.rec.replicas.get(tier_name) is rep:
                del b.rec.replicas[tier_name]


def _seal_of_copy(
    key: ChunkKey,
    form: Representation,
    held: dict[ChunkKey, Representation],
    seals: dict[ChunkKey, bytes],
    sources: dict[ChunkKey, tuple[np.ndarray, Representation, bytes]],
) -> bytes:
    """The checksum a copy's bytes are known by: the source replica's where the copy
    keeps its form; else the seal a load took of the array it decoded and handed over
    (empty: unknown, hashed as written)."""
    if form == held[key]:
        return seals[key]
    handed = sources.get(key)
    return handed[2] if handed is not None else b""
