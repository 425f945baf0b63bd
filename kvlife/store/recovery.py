"""Recovery at open and the audit (``check``).

At open every replica a durable tier kept becomes an INDEXED object again, and the
prefix links the tier kept for deleted chunks join the index (so that invalidating a
prefix still reaches the chunks chained behind a gap). Nothing is deleted there but
links that lead to nothing stored: a replica whose object metadata cannot be decoded is
not served and is counted (``recovery_dropped``); the tier keeps it for ``check``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.core.identity import ChunkKey
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
    keepers = [t for t in core.chain if isinstance(t, KeepsEdges)]
    for keeper in keepers:
        for child, parent in keeper.load_edges():
            core.index.add_edge(ChunkKey(child), parent)
    gone = core.index.prune_edges()  # links that lead to nothing stored any more
    for keeper in keepers:
        keeper.forget_edges(gone)
    core.reap_lost()


def audit(core: StoreCore, fix: bool, progress: Callable[[int], object] | None) -> AuditReport:
    """Audit every tier that can be audited, each in a sequencer turn (after every plan
    made before it); what a fix dropped is taken in as lost replicas."""
    core.check_open()
    report = AuditReport()
    for tier in core.chain:
        if isinstance(tier, SupportsAudit):
            with core.seq.turn(core.seq.take()):
                report.merge(tier.check(fix=fix, progress=progress))
    with core.lock:
        core.delete_later(core.reap_lost())
    return report
