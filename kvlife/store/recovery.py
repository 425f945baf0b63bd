"""Recovery at open and the audit (``check``).

At open every replica a durable tier kept becomes an INDEXED object again, and the
prefix links an edge-keeping tier kept (every durable chunk's own link and those of the
ancestors it was chained from) join the index, so that invalidating a prefix reaches
every durable chunk chained after it, across chunks that lived only in DRAM, were lost
or were dropped. A replica's own link missing from the tier (a store written before
links were kept with every replica) is added here. Nothing is deleted but links that
lead to nothing stored: a replica whose object metadata cannot be decoded is not served
and is counted (``recovery_dropped``); the tier keeps it for ``check``.

The audit runs beside serving: no sequencer turn and no index lock across its reads
(each tier's ``check`` holds its own locks only for metadata); what it dropped is taken
in as lost replicas, counted and invalidated, once it is done.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.core.identity import ROOT_PARENT, ChunkKey
from kvlife.core.lifecycle import Move
from kvlife.core.objects import (
    EXACT,
    EpochStamp,
    ObjectInfo,
    ObjectRecord,
    Replica,
    ReplicaState,
    Representation,
)
from kvlife.store.core import StoreCore
from kvlife.tiers.base import AuditReport, Durability, KeepsEdges, SupportsAudit


def recover(core: StoreCore) -> None:
    for tier in core.chain:
        if tier.durability is not Durability.DURABLE:
            continue
        missing: list[tuple[bytes, bytes]] = []
        for key in tier.replica_keys():
            meta = tier.meta(key)
            try:
                info = ObjectInfo.decode(meta.info)
                born = EpochStamp.decode(meta.born)
                form, dtype, shape = Representation.decode(meta.form)
                if dtype is None or shape is None:
                    dtype, shape = meta.dtype, meta.shape
                nbytes = ObjectRecord.size(dtype, shape)
                if form.name != meta.transform or (form is EXACT) != (meta.transform == "exact"):
                    raise InvalidArgument(f"representation {form.name!r} vs {meta.transform!r}")
            except (InvalidArgument, KVLifeError, TypeError, ValueError):
                core.counters.recovery_dropped += 1
                continue
            rec = core.index.get(key)
            if rec is not None and (rec.dtype, rec.shape) != (dtype, shape):
                core.counters.recovery_dropped += 1  # two tiers disagree: serve neither copy
                continue
            if rec is None:
                rec = ObjectRecord(key, info, dtype, shape, nbytes, born=born)
                core.ledger.move(rec, Move.RECOVER, tier=tier.name, nbytes=nbytes, reason="reopen")
                core.ledger.move(rec, Move.INDEX, tier=tier.name)
                core.index.add(rec)
                core.counters.recovered += 1
            rec.replicas[tier.name] = Replica(
                tier.name, meta.nbytes, form, meta.checksum, ReplicaState.READY
            )
            core.placement.charge(key, tier.name)
            parent = bytes(info.parent)
            if (
                isinstance(tier, KeepsEdges)
                and parent != ROOT_PARENT
                and tier.kept_parent(key) != parent
            ):
                missing.append((bytes(key), parent))  # written before links were kept
        if missing and isinstance(tier, KeepsEdges):
            tier.keep_edges(missing)
    keepers = [t for t in core.chain if isinstance(t, KeepsEdges)]
    for keeper in keepers:
        for child, parent in keeper.load_edges():
            core.index.add_edge(ChunkKey(child), parent)
    gone = core.index.prune_edges()  # links that lead to nothing stored any more
    for keeper in keepers:
        keeper.forget_edges(gone)
    core.reap_lost()


def audit(core: StoreCore, fix: bool, progress: Callable[[int], object] | None) -> AuditReport:
    """Audit every tier that can be audited, beside serving (see the module docstring);
    what the audit dropped (a DRAM replica that failed its seal, bad rows a fix
    deleted) is taken in as lost replicas."""
    report = AuditReport()
    progress = core.callbacks.wrap(progress)  # a close() from it closes on another thread
    with core.reading():  # close waits for it: the tiers stay open under the audit
        for tier in core.chain:
            if isinstance(tier, SupportsAudit):
                report.merge(tier.check(fix=fix, progress=progress))
    with core.lock:
        core.delete_later(core.reap_lost())
    return report
