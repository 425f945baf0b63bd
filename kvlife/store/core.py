"""The state every part of the store shares: the tier chain, the index, the placement
engine, the ledger and the locks.

Locking rule: ``lock`` (the index lock) guards the index, the records and their replicas,
the placement engine and the counters; it is held only for bookkeeping, never across a
read, write or fsync. Physical work runs outside it, in the order of the sequencer's
tickets (:mod:`kvlife.store.lock`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlife.core.errors import KVLifeError, ReplicaNotFound, StoreClosedError
from kvlife.core.events import EventSink
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import ObjectRecord, Replica, ReplicaState, TierName
from kvlife.index.prefix import ObjectIndex
from kvlife.placement import Action, Copy, Drop, Evict, Place, Placement, TierSlot
from kvlife.policy.base import make_policy
from kvlife.store.config import StoreConfig
from kvlife.store.ledger import Ledger
from kvlife.store.lock import Sequencer
from kvlife.tiers.base import Durability, ReportsLostReplicas, SupportsBatchDelete, Tier

if TYPE_CHECKING:
    from kvlife.tiers.disk.fileio import FileIO

INDEXED = ObjectState.INDEXED


@dataclass(slots=True)
class Bound:
    """One planned action with the record and replica it concerns."""

    action: Action
    rec: ObjectRecord
    replica: Replica | None
    """The replica the action creates (Place, Copy) or evicts (Evict)."""


class StoreResidency:
    """The placement engine's view of the store's records (replicas being written count,
    replicas chosen for eviction do not)."""

    def __init__(self, index: ObjectIndex, ledger: Ledger) -> None:
        self._index = index
        self._ledger = ledger
        self.bound: list[Bound] = []

    def tiers_of(self, key: Hashable) -> Collection[TierName]:
        rec = self._index.get(key)  # type: ignore[arg-type]
        if rec is None:
            return ()
        return [t for t, r in rec.replicas.items() if r.state is not ReplicaState.LEAVING]

    def size_of(self, key: Hashable) -> int:
        rec = self._index.get(key)  # type: ignore[arg-type]
        if rec is None:
            raise KVLifeError(f"placement asked the size of unknown object {key!r}")
        return rec.nbytes

    def apply(self, action: Action) -> None:
        rec = self._index.get(action.key)  # type: ignore[arg-type]
        if rec is None:
            raise KVLifeError(f"placement planned {action} for an object not in the index")
        rep: Replica | None = None
        if isinstance(action, Place):
            rep = rec.replicas[action.tier] = Replica(action.tier, rec.nbytes)
        elif isinstance(action, Copy):
            rep = rec.replicas[action.dst] = Replica(action.dst, rec.nbytes)
        elif isinstance(action, Evict):
            rep = rec.replicas[action.tier]
            rep.state = ReplicaState.LEAVING
            self._ledger.move(
                rec, Move.EVICT, tier=action.tier, nbytes=rec.nbytes, reason="capacity"
            )
            self._ledger.counters.tier(action.tier).evictions += 1
        elif isinstance(action, Drop):
            self._ledger.counters.evicted += 1
            _retire(self._index, self._ledger, rec, Move.INVALIDATE, action.reason)
        self.bound.append(Bound(action, rec, rep))

    def take(self) -> list[Bound]:
        bound, self.bound = self.bound, []
        return bound


def _retire(index: ObjectIndex, ledger: Ledger, rec: ObjectRecord, move: Move, why: str) -> None:
    """Invalidate (or mark corrupt) and delete a record logically: it is never served
    again; its replicas are deleted physically by whoever retired it."""
    if rec.state is INDEXED or rec.state is ObjectState.COMMITTED:
        ledger.move(rec, move, reason=why)
    ledger.move(rec, Move.DELETE, reason=why)
    for rep in rec.replicas.values():
        rep.state = ReplicaState.LEAVING
    index.remove(rec.key)


class StoreCore:
    """Shared state of one open store (see the module docstring for the locking rule)."""

    def __init__(
        self,
        path: Path,
        config: StoreConfig,
        chain: list[Tier],
        sink: EventSink | None,
    ) -> None:
        self.path = path
        self.config = config
        self.lock = threading.RLock()
        self.seq = Sequencer()
        self.index = ObjectIndex()
        self.ledger = Ledger(sink)
        self.counters = self.ledger.counters
        self.chain = chain
        self.tiers: dict[TierName, Tier] = {t.name: t for t in chain}
        self.residency = StoreResidency(self.index, self.ledger)
        self.placement = Placement(
            [
                TierSlot(t.name, t.capacity_bytes, make_policy(spec.policy), t.footprint)
                for t, spec in zip(chain, config.chain, strict=True)
            ],
            self.residency,
        )
        self.pinned: dict[ChunkKey, int] = {}
        self.placement.pinned = self.pinned
        self.durable = [t.name for t in chain if t.durability is Durability.DURABLE]
        self.closed = False
        self.fileio: FileIO | None = None

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def fastest(self, rec: ObjectRecord) -> TierName | None:
        """The first tier of the chain with a READY replica of ``rec`` (one chosen for
        eviction is never read: its bytes may go at any moment)."""
        reps = rec.replicas
        for tier in self.chain:
            rep = reps.get(tier.name)
            if rep is not None and rep.state is ReplicaState.READY:
                return tier.name
        return None

    def protected(self, keys: Iterable[ChunkKey]) -> set[ChunkKey]:
        """``keys`` plus every pinned key: no eviction may take them."""
        out = set(keys)
        out.update(self.pinned)
        return out

    # ------------------------------------------------------------------ pins

    def pin(self, rec: ObjectRecord, tier: TierName) -> Replica:
        rep = rec.replicas[tier]
        rep.pins += 1
        self.pinned[rec.key] = self.pinned.get(rec.key, 0) + 1
        return rep

    def unpin(self, rec: ObjectRecord, rep: Replica) -> None:
        rep.pins -= 1
        left = self.pinned[rec.key] - 1
        if left:
            self.pinned[rec.key] = left
        else:
            del self.pinned[rec.key]
        if rep.pins < 0:
            raise AssertionError(f"replica {rec.key.hex()[:16]} unpinned more than pinned")

    # ------------------------------------------------------------------ retiring objects

    def retire(self, rec: ObjectRecord, move: Move, why: str) -> list[tuple[TierName, ChunkKey]]:
        """Take an object out of service now (under the lock); returns the replicas to
        delete physically."""
        doomed = [(t, rec.key) for t in rec.replicas]
        self.placement.forget(rec.key)
        _retire(self.index, self.ledger, rec, move, why)
        return doomed

    def delete_replicas(self, doomed: Iterable[tuple[TierName, ChunkKey]]) -> None:
        """Physical deletes (outside the lock), batched per tier; absent replicas are
        skipped (a write that failed, a replica the tier already dropped)."""
        by_tier: dict[TierName, list[ChunkKey]] = {}
        for tier_name, key in doomed:
            by_tier.setdefault(tier_name, []).append(key)
        for tier_name, keys in by_tier.items():
            tier = self.tiers[tier_name]
            present = [k for k in keys if tier.contains(k)]
            if not present:
                continue
            if isinstance(tier, SupportsBatchDelete):
                tier.delete_batch(present)
            else:
                for key in present:
                    with contextlib.suppress(ReplicaNotFound):
                        tier.delete(key)

    def reap_lost(self) -> list[tuple[TierName, ChunkKey]]:
        """Take in replicas tiers dropped by themselves (under the lock); returns the
        replicas of objects that lost their last copy, to delete physically."""
        doomed: list[tuple[TierName, ChunkKey]] = []
        for tier in self.chain:
            if not isinstance(tier, ReportsLostReplicas):
                continue
            for key, why in tier.take_lost():
                rec = self.index.get(key)
                rep = rec.replicas.get(tier.name) if rec is not None else None
                if rec is None or rep is None:
                    self.counters.recovery_dropped += 1
                    continue
                self.counters.corrupt += 1
                if rep.state is not ReplicaState.LEAVING:
                    self.placement.release(key, tier.name)
                del rec.replicas[tier.name]
                if not any(r.readable for r in rec.replicas.values()):
                    doomed += self.retire(rec, Move.CORRUPT, f"corrupt: {why}")
        return doomed
