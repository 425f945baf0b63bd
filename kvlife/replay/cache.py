"""The cache model: tiers as policy-ordered key sets, decided by the store's own placement
engine (:mod:`kvlife.placement`) and executed here by counting.

The general path (any tiers, events, lifespans) hands every decision to
:class:`~kvlife.placement.Placement`, exactly as :class:`kvlife.store.KVStore` does, so the
two cannot drift apart. The one-tier path without events is a hand-inlined copy of the
same rules for speed (millions of block touches per second); a test keeps it equal to the
general path. Per request (arrival order; blocks in prompt order), as ``lookup`` +
``load`` + ``put_prompt`` in the store:

1. **lookup**: the usable prefix is the longest run of leading blocks present in any tier;
   its blocks are touched from last to first in the tier that serves them (DRAM if there).
2. **load**: prefix blocks found only on disk are promoted into DRAM (room is made in
   DRAM, protecting them; DRAM victims not on disk are demoted, i.e. written back).
3. **put**: blocks not present are new. Room is made in the first tier (DRAM, else disk)
   for all of them at once, never evicting a block of the current request; victims are
   demoted (DRAM with a disk tier) or dropped. If there is still no room, new blocks are
   placed one by one in DRAM then disk, and those that fit nowhere are dropped. Then every
   block of the request, in prompt order, is inserted (new) or touched (present) in each
   tier that holds it.

With one tier and LRU this is: *a present block becomes the most recent; a missing block
is inserted as the most recent, evicting the least recent block not used by the current
request* (docs/replay.md). Victims are taken one ``evict(1, protected)`` call at a time, as
the store does, so every policy sees the same calls in both.

Block capacity is counted in blocks (all blocks of a trace have one size).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.objects import TierName
from kvlife.placement import Placement, TierSlot
from kvlife.policy.base import EvictionPolicy, SupportsClassHints, make_policy
from kvlife.trace.model import Trace

DRAM = "dram"
DISK = "disk"
POS_BUCKETS = ("pos0", "pos1-3", "pos4-15", "pos16+")


def pos_bucket(pos: int) -> int:
    """Position bucket of a block (0: first block, 1: 1-3, 2: 4-15, 3: 16 and later)."""
    return 0 if pos == 0 else 1 if pos < 4 else 2 if pos < 16 else 3


@dataclass(slots=True)
class TierCounters:
    """Block counts of one tier over a run."""

    prefix_hits: int = 0
    """Blocks of usable prefixes served from this tier."""
    block_hits: int = 0
    """Blocks found present in this tier (prefix or not; DRAM first)."""
    inserts: int = 0
    """Blocks written into this tier (new puts, promotions, demotions)."""
    reads: int = 0
    """Blocks read from this tier (loads and demotion read-backs)."""
    evictions: int = 0
    """Blocks evicted from this tier."""


@dataclass(slots=True)
class CacheRun:
    """Per-request results of a cache replay (arrays of length n) and tier counters."""

    prefix_dram: NDArray[np.int64]
    prefix_disk: NDArray[np.int64]
    present: NDArray[np.int64]
    """Blocks of the request present when it arrived (prefix or not)."""
    new: NDArray[np.int64]
    """Blocks stored by the request."""
    dropped: NDArray[np.int64]
    """New blocks that fit in no tier."""
    promoted: NDArray[np.int64]
    demoted: NDArray[np.int64]
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    lifespans: dict[str, list[float]] = field(default_factory=dict)
    """Seconds from insert to leaving the cache, per object class (evicted objects only)."""
    resident_at_end: int = 0


class CacheSim:
    """Tiers with block capacities and one eviction policy each (by registered name)."""

    def __init__(
        self,
        policy: str,
        dram_blocks: int,
        disk_blocks: int = 0,
        *,
        sink: EventSink | None = None,
        block_bytes: int = 0,
        track_lifespans: bool = False,
        class_hints: bool = True,
    ) -> None:
        if dram_blocks < 0 or disk_blocks < 0 or dram_blocks + disk_blocks == 0:
            raise InvalidArgument(
                f"capacities must be >= 0 blocks with at least one tier "
                f"(dram={dram_blocks}, disk={disk_blocks})"
            )
        self.policy_name = policy
        self.caps: dict[str, int] = {}
        self.policies: dict[str, EvictionPolicy[object]] = {}
        for name, cap in ((DRAM, dram_blocks), (DISK, disk_blocks)):
            if cap > 0:
                self.caps[name] = cap
                self.policies[name] = make_policy(policy)
        self.sink = sink
        self.block_bytes = block_bytes
        self.track = track_lifespans or sink is not None
        self.class_hints = class_hints
        """Pass object classes to policies that take them (off: as the live store does)."""
        self._seq = 0

    # -- events (only when a sink is given) ------------------------------------------------

    def _emit(
        self,
        t: float,
        kind: str,
        key: Hashable,
        state: str,
        tier: str = "",
        dst: str = "",
        nbytes: int = 0,
        reason: str = "",
        ns: str = "",
        rid: str = "",
    ) -> None:
        assert self.sink is not None
        self._seq += 1
        self.sink.emit(
            LifecycleEvent(
                time=t,
                seq=self._seq,
                kind=kind,
                key=format(int(key) & ((1 << 256) - 1), "064x"),  # type: ignore[call-overload]
                state=state,
                tier=tier,
                dst_tier=dst,
                nbytes=nbytes,
                namespace=ns,
                reason=reason,
                request_id=rid,
            )
        )

    # -- the replay -----------------------------------------------------------------------

    def run(self, trace: Trace, progress: Callable[[int], None] | None = None) -> CacheRun:
        """Replay every request of ``trace``; ``progress(k)`` is called every 1024 requests."""
        if len(self.policies) == 1 and not self.track:
            return self._run_one_tier(trace, progress)
        return self._run_general(trace, progress)

    def _run_one_tier(self, trace: Trace, progress: Callable[[int], None] | None) -> CacheRun:
        """The fast path: one tier, no events, no lifespans (same decisions as the general)."""
        n = trace.n_requests
        (tier_name,) = self.policies
        pol = self.policies[tier_name]
        cap = self.caps[tier_name]
        contains = pol.__contains__
        touch, insert, evict = pol.touch, pol.insert, pol.evict
        classed = isinstance(pol, SupportsClassHints) and self.class_hints
        cats = trace.categories.tolist()
        blocks = trace.blocks.tolist()
        offs = trace.offsets.tolist()
        prefix = np.zeros(n, np.int64)
        present = np.zeros(n, np.int64)
        new_a = np.zeros(n, np.int64)
        dropped_a = np.zeros(n, np.int64)
        evictions = 0
        resident = len(pol)
        for r in range(n):
            req = blocks[offs[r] : offs[r + 1]]
            p = 0
            for b in req:
                if contains(b):
                    p += 1
                else:
                    break
            for j in range(p - 1, -1, -1):
                touch(req[j])
            new = [b for b in req[p:] if not contains(b)]
            k = resident + len(new) - cap
            store = new
            if k > 0:
                prot = set(req)
                got = 0
                while got < k:
                    v = evict(1, prot)
                    if v is None:
                        break
                    got += 1
                evictions += got
                resident -= got
                if got < k:
                    room = cap - resident
                    store = new[: max(room, 0)]
                    dropped_a[r] = len(new) - len(store)
            resident += len(store)
            stored = set(store) if len(store) != len(new) else None
            if classed:
                base = cats[r] * 4
                hinted = pol.insert_classed  # type: ignore[attr-defined]
                newset = set(new)
                for pos, b in enumerate(req):
                    if b in newset:
                        if stored is None or b in stored:
                            hinted(b, base + pos_bucket(pos))
                    else:
                        touch(b)
            elif new:
                newset = set(new) if stored is None else stored
                dropped = set(new) - newset if stored is not None else ()
                for b in req:
                    if b in newset:
                        insert(b)
                    elif b not in dropped:
                        touch(b)
            else:
                for b in req:
                    touch(b)
            prefix[r] = p
            present[r] = len(req) - len(new)
            new_a[r] = len(store)
            if progress is not None and r & 1023 == 1023:
                progress(1024)
        zeros = np.zeros(n, np.int64)
        tc = TierCounters(
            prefix_hits=int(prefix.sum()),
            block_hits=int(present.sum()),
            inserts=int(new_a.sum()),
            reads=int(prefix.sum()),
            evictions=evictions,
        )
        dram = tier_name == DRAM
        return CacheRun(
            prefix_dram=prefix if dram else zeros,
            prefix_disk=zeros if dram else prefix,
            present=present,
            new=new_a,
            dropped=dropped_a,
            promoted=zeros.copy(),
            demoted=zeros.copy(),
            tiers={tier_name: tc},
            resident_at_end=resident,
        )

    def _run_general(self, trace: Trace, progress: Callable[[int], None] | None) -> CacheRun:
        """Any tiers, with events and lifespans: the placement engine's plans, executed
        by counting (the store executes the very same plans with real I/O)."""
        n = trace.n_requests
        res = _SimResidency(self, trace, n)
        slots = [
            TierSlot(TierName(name), self.caps[name], pol) for name, pol in self.policies.items()
        ]
        place = Placement(slots, res)
        first = slots[0].name
        tc = res.tc
        out = res.out
        emit = self._emit if self.sink is not None else None
        nb = self.block_bytes
        blocks = trace.blocks.tolist()
        offs = trace.offsets.tolist()
        times = trace.timestamps.tolist()
        cats = trace.categories.tolist()
        tenants = trace.tenants.tolist()
        tnames = trace.tenant_names
        where = res.where
        fastest = place.fastest
        hinted = self.class_hints and any(
            isinstance(p, SupportsClassHints) for p in self.policies.values()
        )
        for r in range(n):
            res.r = r
            res.t = times[r]
            res.ns = tnames[tenants[r]]
            res.rid = str(r) if emit is not None else ""
            req = blocks[offs[r] : offs[r + 1]]
            # lookup: the usable prefix, touched from last to first where it is served
            served: list[TierName | None] = []  # the serving tier of every block, if any
            for b in req:
                w = where.get(b)
                served.append(fastest(w) if w else None)
            p = served.index(None) if None in served else len(req)
            hits = [(b, t) for b, t in zip(req[:p], served[:p], strict=True) if t is not None]
            place.touch_hits(hits)
            n_first = served[:p].count(first)
            out["pd"][r] = n_first if first == DRAM else 0
            out["pk"][r] = p - out["pd"][r]
            for tier in served:
                if tier is not None:
                    tc[tier].block_hits += 1
            # load, then promotion of the hits served from a slower tier
            for b, tier in hits:
                tc[tier].prefix_hits += 1
                tc[tier].reads += 1
                if emit is not None:
                    emit(res.t, "load", b, "indexed", tier, nbytes=nb)
            slower = [b for b, tier in hits if tier != first]
            if slower:
                place.plan_promote(slower)
            # put
            new = [b for b in req if not where.get(b)]
            out["pr"][r] = len(req) - len(new)
            if emit is not None:
                for b in new:
                    emit(res.t, "put", b, "tentative", nbytes=nb, ns=res.ns, rid=res.rid)
            res.cat = cats[r]
            if res.track and new:
                res.positions = {b: pos for pos, b in enumerate(req)}
            _, placed = place.plan_put(req, new)
            classes = None
            if hinted and placed:
                base = cats[r] * 4
                classes = [base + pos_bucket(pos) for pos in range(len(req))]
            place.touch_in_order(req, placed, classes)
            out["nw"][r] = len(placed)
            out["dr"][r] = len(new) - len(placed)
            if progress is not None and r & 1023 == 1023:
                progress(1024)
        return CacheRun(
            prefix_dram=out["pd"],
            prefix_disk=out["pk"],
            present=out["pr"],
            new=out["nw"],
            dropped=out["dr"],
            promoted=out["pm"],
            demoted=out["dm"],
            tiers=tc,
            lifespans=res.lifespans,
            resident_at_end=len(where),
        )


class _SimResidency:
    """Where blocks live in the simulation, and the counting executor of placement's
    actions (the simulator's side of "one placement engine, two executors")."""

    def __init__(self, sim: CacheSim, trace: Trace, n: int) -> None:
        self.sim = sim
        self.where: dict[Hashable, set[TierName]] = {}
        self.tc = {name: TierCounters() for name in sim.policies}
        self.out = {k: np.zeros(n, np.int64) for k in ("pd", "pk", "pr", "nw", "dr", "pm", "dm")}
        self.born: dict[Hashable, float] = {}
        self.klass: dict[Hashable, int] = {}
        self.lifespans: dict[str, list[float]] = {}
        self.names = trace.category_names
        self.emit = sim._emit if sim.sink is not None else None
        self.nb = sim.block_bytes
        self.r = 0
        self.t = 0.0
        self.ns = ""
        self.rid = ""
        self.cat = 0
        self.positions: dict[Hashable, int] = {}
        self.track = sim.track
        self.uniform_size = 1
        """Every block has one size: placement skips per-key size lookups."""

    def tiers_of(self, key: Hashable) -> Collection[TierName]:
        return self.where.get(key, ())

    def size_of(self, key: Hashable) -> int:
        return 1

    def on_place(self, key: Hashable, tier: TierName) -> None:
        self.where[key] = {tier}
        self.tc[tier].inserts += 1
        if self.track:
            self.born[key] = self.t
            self.klass[key] = self.cat * 4 + pos_bucket(self.positions[key])
        emit = self.emit
        if emit is not None:
            t, nb = self.t, self.nb
            emit(t, "write", key, "tentative", tier, nbytes=nb, rid=self.rid)
            emit(t, "seal", key, "tentative", tier, nbytes=nb)
            emit(t, "commit", key, "committed", tier)
            emit(t, "index", key, "indexed", tier)

    def on_copy(self, key: Hashable, src: TierName, dst: TierName, reason: str) -> None:
        self.where[key].add(dst)
        self.tc[dst].inserts += 1
        if reason == "demote":
            self.tc[src].reads += 1
            self.out["dm"][self.r] += 1
        elif reason == "promote":
            self.out["pm"][self.r] += 1
        if self.emit is not None:
            self.emit(self.t, "offload", key, "indexed", src, dst, self.nb, reason)

    def on_evict(self, key: Hashable, tier: TierName) -> None:
        self.where[key].discard(tier)
        self.tc[tier].evictions += 1
        if self.emit is not None:
            self.emit(self.t, "evict", key, "indexed", tier=tier, nbytes=self.nb, reason="capacity")

    def on_drop(self, key: Hashable, reason: str) -> None:
        t = self.t
        del self.where[key]
        emit = self.emit
        if emit is not None:
            emit(t, "invalidate", key, "invalidated", reason=reason, ns=self.ns, rid=self.rid)
            emit(t, "delete", key, "deleted", reason=reason, ns=self.ns, rid=self.rid)
        if self.track:
            c = self.klass.pop(key)
            name = f"{self.names[c // 4]}/{POS_BUCKETS[c % 4]}"
            self.lifespans.setdefault(name, []).append(t - self.born.pop(key))

    def on_reject(self, key: Hashable, reason: str) -> None:
        if self.emit is not None:
            self.emit(self.t, "abort", key, "deleted", reason=reason)
