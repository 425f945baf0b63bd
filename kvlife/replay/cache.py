"""The cache model: tiers as policy-ordered key sets, updated exactly as the store does.

Per request (arrival order; blocks in prompt order), mirroring :class:`kvlife.store.KVStore`
``lookup`` + ``load`` + ``put_prompt``:

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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import EventSink, LifecycleEvent
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
        key: int,
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
                key=format(key & ((1 << 256) - 1), "064x"),
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
        """Any tiers, with events and lifespans; the reference the fast path must equal."""
        n = trace.n_requests
        pols = self.policies
        caps = self.caps
        pd = pols.get(DRAM)
        pk = pols.get(DISK)
        first = DRAM if pd is not None else DISK
        bit = {DRAM: 1, DISK: 2}
        used = {name: len(p) for name, p in pols.items()}
        tc = {name: TierCounters() for name in pols}
        where: dict[int, int] = {}
        born: dict[int, float] = {}
        klass: dict[int, int] = {}
        lifespans: dict[str, list[float]] = {}
        names = trace.category_names
        emit = self._emit if self.sink is not None else None
        nb = self.block_bytes
        classed = {
            name: isinstance(p, SupportsClassHints) and self.class_hints for name, p in pols.items()
        }
        out = {k: np.zeros(n, np.int64) for k in ("pd", "pk", "pr", "nw", "dr", "pm", "dm")}
        t = 0.0
        ns = ""
        rid = ""

        def drop(b: int) -> None:
            del where[b]
            for p in pols.values():
                p.remove(b)
            if emit is not None:
                emit(t, "invalidate", b, "invalidated", reason="evicted", ns=ns, rid=rid)
                emit(t, "delete", b, "deleted", reason="evicted", ns=ns, rid=rid)
            if self.track:
                c = klass.pop(b)
                name = f"{names[c // 4]}/{POS_BUCKETS[c % 4]}"
                lifespans.setdefault(name, []).append(t - born.pop(b))

        def evict_blocks(tier: str, victims: list[int], r: int) -> None:
            if tier == DRAM and pk is not None:
                write_back([v for v in victims if not where[v] & 2], r)
            m = bit[tier]
            for v in victims:
                where[v] &= ~m
                used[tier] -= 1
                tc[tier].evictions += 1
                if emit is not None:
                    emit(t, "evict", v, "indexed", tier=tier, nbytes=nb, reason="capacity")
                if not where[v]:
                    drop(v)

        def make_room(tier: str, k: int, prot: set[int], r: int) -> bool:
            need = used[tier] + k - caps[tier]
            if need <= 0:
                return True
            pol = pols[tier]
            victims: list[int] = []
            while len(victims) < need:
                got = pol.evict(1, prot)
                if got is None:
                    break
                victims.append(got[0])  # type: ignore[arg-type]
            if victims:
                evict_blocks(tier, victims, r)
            return len(victims) >= need

        def write_back(recs: list[int], r: int) -> None:
            if not recs:
                return
            assert pk is not None
            if not make_room(DISK, len(recs), set(recs), r):
                return
            tc[DRAM].reads += len(recs)
            tc[DISK].inserts += len(recs)
            used[DISK] += len(recs)
            out["dm"][r] += len(recs)
            for v in recs:
                where[v] |= 2
                pk.insert(v)
                if emit is not None:
                    emit(t, "offload", v, "indexed", DRAM, DISK, nb, "demote")

        blocks = trace.blocks.tolist()
        offs = trace.offsets.tolist()
        times = trace.timestamps.tolist()
        cats = trace.categories.tolist()
        tenants = trace.tenants.tolist()
        tnames = trace.tenant_names
        for r in range(n):
            t = times[r]
            ns = tnames[tenants[r]]
            rid = str(r) if emit is not None else ""
            req = blocks[offs[r] : offs[r + 1]]
            # lookup
            p = 0
            for b in req:
                if where.get(b):
                    p += 1
                else:
                    break
            n_dram = 0
            for j in range(p - 1, -1, -1):
                b = req[j]
                if where[b] & 1:
                    n_dram += 1
                    pols[DRAM].touch(b)
                else:
                    pols[DISK].touch(b)
            out["pd"][r] = n_dram
            out["pk"][r] = p - n_dram
            for b in req:
                w = where.get(b, 0)
                if w:
                    tc[DRAM if w & 1 else DISK].block_hits += 1
            # load (and promotion of disk hits)
            if DRAM in tc:
                tc[DRAM].prefix_hits += n_dram
                tc[DRAM].reads += n_dram
            if DISK in tc:
                tc[DISK].prefix_hits += p - n_dram
                tc[DISK].reads += p - n_dram
            if emit is not None:
                for b in req[:p]:
                    emit(t, "load", b, "indexed", DRAM if where[b] & 1 else DISK, nbytes=nb)
            if pd is not None and p > n_dram:
                prom = [b for b in req[:p] if not where[b] & 1]
                if make_room(DRAM, len(prom), set(prom), r):
                    used[DRAM] += len(prom)
                    tc[DRAM].inserts += len(prom)
                    out["pm"][r] = len(prom)
                    for b in prom:
                        where[b] |= 1
                        pd.insert(b)
                        if emit is not None:
                            emit(t, "offload", b, "indexed", DISK, DRAM, nb, "promote")
            # put
            new = [b for b in req if not where.get(b)]
            out["pr"][r] = len(req) - len(new)
            placed: dict[int, str] = {}
            if new:
                prot = set(req)
                if emit is not None:
                    for b in new:
                        emit(t, "put", b, "tentative", nbytes=nb, ns=ns, rid=rid)
                if make_room(first, len(new), prot, r):
                    placed = dict.fromkeys(new, first)
                else:
                    for b in new:
                        for tier in pols:
                            if make_room(tier, 1, prot, r):
                                placed[b] = tier
                                used[tier] += 1
                                break
                    for tier in placed.values():
                        used[tier] -= 1
                for pos, b in enumerate(req):
                    dst = placed.get(b)
                    if dst is None:
                        continue
                    where[b] = bit[dst]
                    used[dst] += 1
                    tc[dst].inserts += 1
                    if self.track:
                        born[b] = t
                        klass[b] = cats[r] * 4 + pos_bucket(pos)
                    if emit is not None:
                        emit(t, "write", b, "tentative", dst, nbytes=nb, rid=rid)
                        emit(t, "seal", b, "tentative", dst, nbytes=nb)
                        emit(t, "commit", b, "committed", dst)
                        emit(t, "index", b, "indexed", dst)
                out["nw"][r] = len(placed)
                out["dr"][r] = len(new) - len(placed)
                if emit is not None:
                    for b in new:
                        if b not in placed:
                            emit(t, "abort", b, "deleted", reason="no room in any tier")
            for pos, b in enumerate(req):
                w = where.get(b, 0)
                home = placed.get(b)
                for name in (DRAM, DISK):
                    if w & bit[name] and name in pols:
                        pol = pols[name]
                        if home == name:
                            if classed[name]:
                                cls = cats[r] * 4 + pos_bucket(pos)
                                pol.insert_classed(b, cls)  # type: ignore[attr-defined]
                            else:
                                pol.insert(b)
                        else:
                            pol.touch(b)
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
            lifespans=lifespans,
            resident_at_end=len(where),
        )
