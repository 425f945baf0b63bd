"""The state every part of the store shares: the tier chain, the index, the placement
engine, the ledger and the locks.

Locking rule: ``lock`` (the index lock) guards the index, the records and their replicas,
the placement engine and the counters; it is held only for bookkeeping, never across a
read, write or fsync. Physical work runs outside it, in the order of the sequencer's
tickets (:mod:`kvlife.store.lock`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlife.core.errors import KVLifeError, ReplicaNotFound, StoreClosedError
from kvlife.core.events import EventSink
from kvlife.core.identity import ROOT_PARENT, ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import ObjectRecord, Replica, ReplicaState, TierName
from kvlife.index.prefix import ObjectIndex
from kvlife.placement import Action, Copy, Drop, Evict, Place, Placement, Reject, TierSlot
from kvlife.policy.base import EvictionPolicy, make_policy
from kvlife.policy.shares import TenantShares
from kvlife.store import deletes
from kvlife.store.callbacks import Callbacks
from kvlife.store.config import StoreConfig
from kvlife.store.forms import DecodeRates, contract_of, encoded_nbytes, tier_transform
from kvlife.store.ledger import Ledger
from kvlife.store.lock import Sequencer
from kvlife.tenancy.quotas import UNSCOPED, by_tier, tenant_of_namespace
from kvlife.tiers.base import (
    Durability,
    KeepsEdges,
    ReportsLostReplicas,
    SealedInMemory,
    SupportsBatchDelete,
    Tier,
)
from kvlife.tiers.spec import TierSpec
from kvlife.transforms.base import Transform, UnknownTransform
from kvlife.transforms.contract import Accept

if TYPE_CHECKING:  # the invalidation module builds on this one
    from kvlife.store.invalidation import Scope

INDEXED = ObjectState.INDEXED


@dataclass(slots=True)
class Serving:
    """Which replica of an object a lookup's Accept lets it serve (or why none)."""

    tier: TierName | None
    replica: Replica | None
    refused: str = ""
    """Why readable replicas were refused (empty when one is served or none exists)."""
    unknown: list[Replica] | None = None
    """Replicas whose transform this reader does not know."""


@dataclass(slots=True)
class Bound:
    """One planned action with the record and replica it concerns."""

    action: Action
    rec: ObjectRecord
    replica: Replica | None
    """The replica the action creates (Place, Copy) or evicts (Evict)."""


class StoreResidency:
    """The placement engine's view of the store's records (replicas being written count,
    replicas chosen for eviction do not).

    A replica chosen for eviction becomes EVICTING: uncounted at once (placement frees
    its room in the plan that chose it), still served until the plan's eviction step
    runs, after the copy that demotes it is published, so that a chunk being demoted
    is never a miss (copy, then drop). The executor's eviction step takes it out of
    service (LEAVING) before its bytes go."""

    def __init__(self, index: ObjectIndex, ledger: Ledger) -> None:
        self._index = index
        self._ledger = ledger
        self.bound: list[Bound] = []
        self.unsettled: dict[ChunkKey, int] = {}
        """Keys with replicas still WRITING (planned, not yet published), and how many."""

    def tiers_of(self, key: Hashable) -> Collection[TierName]:
        rec = self._index.get(key)  # type: ignore[arg-type]
        if rec is None:
            return ()
        return [t for t, r in rec.replicas.items() if r.counted]

    def size_of(self, key: Hashable) -> int:
        rec = self._index.get(key)  # type: ignore[arg-type]
        if rec is None:
            raise KVLifeError(f"placement asked the size of unknown object {key!r}")
        return rec.nbytes

    def on_place(self, keys: Sequence[Hashable], tier: TierName) -> None:
        for key in keys:
            self._apply(Place(key, tier))

    def on_copy(self, key: Hashable, src: TierName, dst: TierName, reason: str) -> None:
        self._apply(Copy(key, src, dst, reason))

    def on_evict(
        self, keys: Sequence[Hashable], tier: TierName, last: Collection[Hashable], reason: str
    ) -> None:
        for key in keys:
            self._apply(Evict(key, tier))
            if key in last:
                self._apply(Drop(key, reason))

    def on_reject(self, key: Hashable, reason: str) -> None:
        self._apply(Reject(key, reason))

    def _apply(self, action: Action) -> None:
        rec = self._index.get(action.key)  # type: ignore[arg-type]
        if rec is None:
            raise KVLifeError(f"placement planned {action} for an object not in the index")
        rep: Replica | None = None
        if isinstance(action, Place):
            rep = rec.replicas[action.tier] = Replica(action.tier, rec.nbytes)
            self.unsettled[rec.key] = self.unsettled.get(rec.key, 0) + 1
        elif isinstance(action, Copy):
            rep = rec.replicas[action.dst] = Replica(action.dst, rec.nbytes)
            self.unsettled[rec.key] = self.unsettled.get(rec.key, 0) + 1
        elif isinstance(action, Evict):
            rep = rec.replicas[action.tier]
            rep.state = ReplicaState.EVICTING  # served until its eviction step runs
            self._ledger.move(
                rec, Move.EVICT, tier=action.tier, nbytes=rec.nbytes, reason="capacity"
            )
            self._ledger.counters.tier(action.tier).evictions += 1
        elif isinstance(action, Drop):
            self._ledger.counters.evicted += 1
            self.retire(rec, Move.INVALIDATE, action.reason)
        self.bound.append(Bound(action, rec, rep))

    def take(self) -> list[Bound]:
        bound, self.bound = self.bound, []
        return bound

    def settle(self, rec: ObjectRecord, rep: Replica, state: ReplicaState | None) -> None:
        """A WRITING replica is published (``state`` READY) or given up (None: removed)."""
        if rep.state is ReplicaState.WRITING:
            left = self.unsettled[rec.key] - 1
            if left:
                self.unsettled[rec.key] = left
            else:
                del self.unsettled[rec.key]
        if state is None:
            if rec.replicas.get(rep.tier) is rep:
                del rec.replicas[rep.tier]
        else:
            rep.state = state

    def retire(self, rec: ObjectRecord, move: Move, why: str) -> None:
        """Take a record out of service (never served again; TENTATIVE ones are aborted).
        Its replicas become LEAVING; whoever retired it deletes them physically."""
        if rec.state is ObjectState.TENTATIVE:
            self._ledger.move(rec, Move.ABORT, reason=why)
        else:
            if rec.state is INDEXED or rec.state is ObjectState.COMMITTED:
                self._ledger.move(rec, move, reason=why)
            self._ledger.move(rec, Move.DELETE, reason=why)
        for rep in list(rec.replicas.values()):
            self.settle(rec, rep, ReplicaState.LEAVING)
        self._index.remove(rec.key)


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
        self.callbacks = Callbacks()
        """Whether a thread is inside a callback of this store's (:mod:`kvlife.store.callbacks`)."""
        self.undeleted: list[tuple[TierName, ChunkKey]] = []
        """Replicas out of service whose physical delete failed, retried at close
        (:mod:`kvlife.store.deletes`; under the lock)."""
        self.ledger = Ledger(sink, self.callbacks)
        self.counters = self.ledger.counters
        self.chain = chain
        self.tiers: dict[TierName, Tier] = {t.name: t for t in chain}
        self.residency = StoreResidency(self.index, self.ledger)
        shares = by_tier(config.tenant_shares)
        self.placement = Placement(
            [
                TierSlot(t.name, t.capacity_bytes, self._policy(spec, shares), t.footprint)
                for t, spec in zip(chain, config.chain, strict=True)
            ],
            self.residency,
        )
        self.pinned: dict[ChunkKey, int] = {}
        self.invalidating: list[Scope] = []
        """Scopes of the invalidations under way (``invalidate`` between applying its
        rule and returning): a put prepared meanwhile is covered too (its new chunks are
        taken out of service as they are made), so an invalidation covers every put
        prepared before it returned (:mod:`kvlife.store.invalidation`)."""
        self.encoders: dict[TierName, Transform] = {
            TierName(spec.name): tier_transform(spec.name, spec.transform, spec.transform_params)
            for spec in config.chain
            if spec.transform
        }
        """Tiers that encode the exact replicas written into them, and with what."""
        self._frame_nbytes = functools.lru_cache(maxsize=4096)(self._frame_nbytes_uncached)
        """Frame bytes by (tier, shape, dtype, chunk start): exact per start (a quantiser's
        chunk at the sequence start holds its sinks, a later one none), bounded (the
        starts in use are the model's context over its chunk size, per layout)."""
        for slot in self.placement.slots:
            if slot.name in self.encoders:
                slot.size = self._sizer(slot.name)
        self.decode_rates = DecodeRates()
        self.placement.shielded = (self.pinned, self.residency.unsettled)
        self.durable = [t.name for t in chain if t.durability is Durability.DURABLE]
        self.deleted_at: dict[TierName, float] = {}
        """``time.monotonic()`` when each tier last finished a batch of physical deletes
        (``kvlife bench invalidate``: from an invalidation's call to its last stale
        byte freed, per tier)."""
        self.closed = False
        self.closing = False
        """``close`` has begun: no put is prepared or committed any more."""
        self.close_done = threading.Event()
        """Set when ``close`` has released everything (a second ``close`` waits for it)."""
        self.closer: threading.Thread | None = None
        """The thread of a close asked from inside a callback (:mod:`kvlife.store.lifecycle`)."""
        self._readers: dict[int, int] = {}
        """Reads under way (:meth:`reading`), by thread."""
        self._no_readers = threading.Condition(self.lock)
        self._bg: ThreadPoolExecutor | None = None
        self._bg_lock = threading.Lock()

    def _policy(self, spec: TierSpec, shares: dict[str, dict[str, int]]) -> EvictionPolicy[object]:
        """The tier's policy: ``spec.policy``, within each tenant's share if the tier has
        shares (quotas: :mod:`kvlife.tenancy.quotas`)."""
        if spec.name not in shares:
            return make_policy(spec.policy)
        name = TierName(spec.name)
        index = self.index

        def tenant_of(key: object) -> str:
            rec = index.get(key)  # type: ignore[arg-type]
            return UNSCOPED if rec is None else tenant_of_namespace(rec.info.namespace)

        def size(key: object) -> int:
            # the units the placement engine charges this tier for the key
            return self.placement.slot(name).units(self.residency, key)

        policy: TenantShares[object, str] = TenantShares(
            tenant_of, shares[spec.name], inner=lambda: make_policy(spec.policy), size=size
        )
        return policy

    def share_figures(self) -> dict[str, dict[str, dict[str, int]]]:
        """Quotas: each tier with shares -> tenant -> share, used bytes, resident
        objects, objects evicted (an admin's view: it names every tenant)."""
        with self.lock:
            return {
                slot.name: {str(t): f for t, f in slot.policy.figures().items()}
                for slot in self.placement.slots
                if isinstance(slot.policy, TenantShares)
            }

    def _sizer(self, tier: TierName) -> Callable[[Hashable], int]:
        """Placement's size of a key's replica in a transforming tier: the frame its
        transform writes for that chunk, at the chunk's absolute start (the one the
        write passes to ``encode``), so a chunk is charged its sinks only where it holds
        them. A pure function of the key (its shape, dtype and start never change)."""
        frame = self._frame_nbytes

        def size(key: Hashable) -> int:
            rec = self.index.get(key)  # type: ignore[arg-type]
            if rec is None:
                raise KVLifeError(f"placement asked the size of unknown object {key!r}")
            return frame(tier, rec.shape, rec.dtype, rec.info.start)

        return size

    def _frame_nbytes_uncached(
        self, tier: TierName, shape: tuple[int, ...], dtype: str, start: int
    ) -> int:
        return encoded_nbytes(self.encoders[tier], shape, dtype, start=start)

    def serving(self, rec: ObjectRecord, accept: Accept) -> Serving:
        """The first tier of the chain with a READY replica that ``accept`` takes, else
        the first with an EVICTING one (a chunk being demoted stays servable until its
        copy is published; a replica that stays is preferred, so that a load races the
        eviction only when nothing else can serve). A LEAVING replica is never read."""
        refused = ""
        unknown: list[Replica] | None = None
        going: Serving | None = None
        for tier in self.chain:
            rep = rec.replicas.get(tier.name)
            if rep is None or not rep.readable:
                continue
            form = rep.transform
            if not form.exact:
                try:
                    why = accept.refusal(contract_of(form))
                except UnknownTransform as exc:
                    unknown = (unknown or []) + [rep]
                    refused = refused or f"{tier.name}: {exc}"
                    continue
                if why:
                    refused = refused or f"{tier.name}: {why}"
                    continue
            if rep.lasting:
                return Serving(tier.name, rep)
            going = going or Serving(tier.name, rep)
        return going or Serving(None, None, refused, unknown)

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def check_accepting_puts(self) -> None:
        """StoreClosedError once ``close`` has begun (call under the lock): a put made
        while close flushes would be acknowledged in DRAM only, then lost."""
        if self.closing or self.closed:
            raise StoreClosedError(f"store {self.path} is closed (or closing)")

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A read of the tiers in the caller's thread (a load's reads, an audit): refused
        once the store is closed; ``close`` waits for those under way before it closes
        the tiers (a read resumed on a closed segment file could read whatever file
        took its descriptor)."""
        me = threading.get_ident()
        with self.lock:
            self.check_open()
            self._readers[me] = self._readers.get(me, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                left = self._readers[me] - 1
                if left:
                    self._readers[me] = left
                else:
                    del self._readers[me]
                    self._no_readers.notify_all()

    def wait_readers(self) -> None:
        """Wait until no :meth:`reading` of another thread is under way (after the store
        was marked closed, none starts; a close from inside a read, a progress callback,
        does not wait for itself)."""
        me = threading.get_ident()
        with self.lock:
            while any(t != me for t in self._readers):
                self._no_readers.wait()

    def protected(self, keys: Iterable[ChunkKey]) -> set[ChunkKey]:
        """``keys`` plus every pinned or unsettled key: no eviction may take them."""
        out = set(keys)
        out.update(self.pinned)
        out.update(self.residency.unsettled)
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
        self.residency.retire(rec, move, why)
        return doomed

    # ------------------------------------------------------------------ background work

    def later(self, ticket: int, job: Callable[[], object]) -> None:
        """Run ``job`` in the background thread in ``ticket``'s sequencer turn. Call under
        the lock right after taking the ticket: the one background thread runs jobs in
        the order they were submitted, which must be ticket order."""

        def run() -> None:
            with self.seq.turn(ticket):
                job()

        with self._bg_lock:  # submitted under it: stop_background cannot shut it between
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix="kvlife-bg")
            self._bg.submit(run)

    def delete_later(self, doomed: list[tuple[TierName, ChunkKey]]) -> None:
        """Physical deletes for a reader, who must not wait for pending plans. Call under
        the lock, where the objects were retired: deletes go by key, so they must run
        before any later plan could write the key again."""
        if doomed and not self.closed:  # closed: found again at the next open
            self.later(self.seq.take(), lambda: deletes.delete_or_keep(self, doomed))

    def stop_background(self) -> None:
        self.seq.wait_idle()
        with self._bg_lock:
            bg, self._bg = self._bg, None
        if bg is not None:  # a job it runs may submit another: to a new one
            bg.shutdown(wait=True)

    def delete_replicas(self, doomed: Iterable[tuple[TierName, ChunkKey]]) -> None:
        """Physical deletes (outside the lock, in a sequencer turn), batched per tier;
        absent replicas are skipped (a write that failed, a replica the tier already
        dropped). A tier that keeps edges drops, in the same step, the links of the
        doomed keys (and of their ancestors) that lead to nothing the index knows any
        more; a link that still leads to a chunk stays."""
        doomed = list(doomed)
        if not doomed:  # nothing to delete, no link to forget (every put's commit: no lock)
            return
        by_tier: dict[TierName, list[ChunkKey]] = {t.name: [] for t in self.chain}
        for tier_name, key in doomed:
            by_tier[tier_name].append(key)
        gone = list(dict.fromkeys(key for _, key in doomed))
        for tier_name, keys in by_tier.items():
            tier = self.tiers[tier_name]
            present = [k for k in keys if tier.contains(k)]
            if isinstance(tier, KeepsEdges):
                with self.lock:
                    forget = self._unneeded_links(tier, gone)
                if present:
                    tier.delete_forgetting(present, forget)
                elif forget:
                    tier.forget_edges(forget)
            elif not present:
                continue
            elif isinstance(tier, SupportsBatchDelete):
                tier.delete_batch(present)
            else:
                for key in present:
                    with contextlib.suppress(ReplicaNotFound):
                        tier.delete(key)
            if present:
                self.deleted_at[tier_name] = time.monotonic()

    # ------------------------------------------------------------------ prefix links

    def _known(self, key: bytes) -> bool:
        """The index still knows ``key``: a record, or a key chunks are chained after."""
        return ChunkKey(key) in self.index or bool(self.index.children(key))

    def _unneeded_links(self, tier: KeepsEdges, keys: Iterable[ChunkKey]) -> list[bytes]:
        """Links ``tier`` keeps for ``keys`` and their ancestors that lead to nothing the
        index knows any more (under the lock). A link leads to a durable chunk only
        through keys the index knows, so these can go."""
        out: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            child: bytes | None = key
            while child is not None and child not in seen and not self._known(child):
                seen.add(child)
                parent = tier.kept_parent(child)
                if parent is None:
                    break
                out.append(child)
                child = parent
        return out

    def links_for(
        self, tier: KeepsEdges, recs: Sequence[ObjectRecord]
    ) -> list[tuple[tuple[bytes, bytes], ...]]:
        """The prefix links each of ``recs`` must carry into ``tier`` (under the lock):
        its own and those of its ancestors the tier does not keep yet, as far as the
        index knows the chain. A kept link's ancestors are kept too (links are written
        top-down complete), so the walk stops at the first kept one; keys of the batch
        count as kept, since their own links go in the same step."""
        batch = {rec.key for rec in recs}
        seen: set[bytes] = set()
        out: list[tuple[tuple[bytes, bytes], ...]] = []
        for rec in recs:
            links: list[tuple[bytes, bytes]] = []
            parent = bytes(rec.info.parent)
            if parent != ROOT_PARENT and tier.kept_parent(rec.key) != parent:
                links.append((bytes(rec.key), parent))
            child = parent
            while child != ROOT_PARENT and child not in batch and child not in seen:
                seen.add(child)
                if tier.kept_parent(child) is not None:
                    break
                up = self.index.kept_edge(ChunkKey(child))
                if up is None or up == ROOT_PARENT:
                    break  # a first chunk, or the chain before it was never known here
                links.append((child, bytes(up)))
                child = bytes(up)
            out.append(tuple(links))
        return out

    def orphaned_links(
        self, recs: Iterable[ObjectRecord]
    ) -> dict[TierName, list[tuple[bytes, bytes]]]:
        """For new records (under the lock): the links edge-keeping tiers must add
        because a chunk chained after one of them is durable there already (it was
        stored, through an explicit parent, before this chunk was known here)."""
        out: dict[TierName, list[tuple[bytes, bytes]]] = {}
        for tier in self.chain:
            if not isinstance(tier, KeepsEdges):
                continue
            need = [
                rec
                for rec in recs
                if bytes(rec.info.parent) != ROOT_PARENT
                and any(tier.kept_parent(c) == rec.key for c in self.index.children(rec.key))
            ]
            links = [link for links in self.links_for(tier, need) for link in links]
            if links:
                out[tier.name] = links
        return out

    def drop_corrupt(
        self, rec: ObjectRecord, tier: TierName, why: str
    ) -> list[tuple[TierName, ChunkKey]]:
        """A replica found corrupt (under the lock): counted, taken out of service; its
        object is retired as corrupt when no readable replica is left. Returns the
        replicas to delete physically."""
        self.counters.corrupt += 1
        rep = rec.replicas.get(tier)
        if rep is None or self.index.get(rec.key) is not rec:
            return []  # already gone: whoever retired it deletes it
        if rep.counted:
            self.placement.release(rec.key, tier)
        del rec.replicas[tier]
        doomed = [(tier, rec.key)]
        if not any(r.lasting for r in rec.replicas.values()):
            doomed += self.retire(rec, Move.CORRUPT, why)
        else:
            self._left_tier(rec, tier, rep.nbytes, why)
        return doomed

    def _left_tier(self, rec: ObjectRecord, tier: TierName, nbytes: int, why: str) -> None:
        """A replica dropped as corrupt or lost while its object lives on in other tiers:
        an ``evict`` event of that tier (its reason says why), so what follows the events
        (the KV-events publisher, a router) learns the tier no longer holds it."""
        self.ledger.move(rec, Move.EVICT, tier=tier, nbytes=nbytes, reason=why)

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
                if isinstance(tier, SealedInMemory):
                    self.counters.sealed_mismatch += 1
                if rep.counted:
                    self.placement.release(key, tier.name)
                del rec.replicas[tier.name]
                if not any(r.lasting for r in rec.replicas.values()):
                    doomed += self.retire(rec, Move.CORRUPT, f"corrupt: {why}")
                else:
                    self._left_tier(rec, tier.name, rep.nbytes, f"corrupt: {why}")
        return doomed
