"""The cache model: tiers as policy-ordered key sets, decided by the store's own placement
engine (:mod:`kvlife.placement`) and executed here by counting.

Every decision is handed to :class:`~kvlife.placement.Placement`, exactly as
:class:`kvlife.store.KVStore` does, so the two cannot drift apart; there is no second
copy of the rules here (the engine's own fast paths make one tier without events run at
millions of block touches per second). Per request (arrival order; blocks in prompt
order), as ``lookup`` + ``load`` + ``put_prompt`` in the store:

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
request* (docs/replay.md). Victims are taken as by one ``evict(1, protected)`` call at a
time (:meth:`~kvlife.policy.base.EvictionPolicy.evict_up_to`), as the store does, so every
policy sees the same calls in both.

Block capacity is counted in blocks (all blocks of a trace have one size).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain, combinations, compress, filterfalse, islice, pairwise, repeat
from operator import not_

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
        """Replay every request of ``trace``; ``progress(k)`` is called every 1024 requests.

        Every decision is the placement engine's (the store executes the very same plans
        with real I/O); this loop only finds each request's hits and counts."""
        n = trace.n_requests
        tracked = _TrackedResidency(self, trace) if self.track else None
        res = tracked if tracked is not None else _SimResidency(self, n)
        slots = [
            TierSlot(TierName(name), self.caps[name], pol) for name, pol in self.policies.items()
        ]
        place = Placement(slots, res)
        touch_hits, plan_promote = place.touch_hits, place.plan_promote
        put_prompt = place.put_prompt
        first = slots[0].name
        first_is_dram = first == DRAM
        one = len(slots) == 1
        names = [s.name for s in slots]
        tcs = [res.tc[name] for name in names]
        emit = self._emit if self.sink is not None else None
        nb = self.block_bytes
        blocks = block_ids(trace)
        offs = trace.offsets.tolist()
        times = trace.timestamps.tolist()
        cats = trace.categories.tolist()
        tenants = trace.tenants.tolist()
        tnames = trace.tenant_names
        if one and tracked is None and place.exact_one and distinct_requests(trace):
            return self._run_exact_one(trace, place, res, progress)
        where = res.where
        where_get = where.get
        # one tier: held anywhere is held there, as its policy knows (no map beside it)
        held_at = slots[0].policy.members.__contains__
        serving = res.serving.__getitem__  # a block's tier set (None: absent) -> serving tier
        hinted = self.class_hints and any(
            isinstance(p, SupportsClassHints) for p in self.policies.values()
        )
        # class hints by position, one row per category (rows are as long as the longest
        # request; a put reads only its own positions)
        longest = max((b - a for a, b in pairwise(offs)), default=0)
        buckets = [pos_bucket(pos) for pos in range(longest)]
        rows: dict[int, list[int]] = {}
        pd: list[int] = []
        pk: list[int] = []
        pr: list[int] = []
        nw: list[int] = []
        dr: list[int] = []
        for r in range(n):
            req = blocks[offs[r] : offs[r + 1]]
            res.r = r
            if tracked is not None:
                tracked.t = times[r]
                tracked.ns = tnames[tenants[r]]
                tracked.rid = str(r) if emit is not None else ""
                tracked.cat = cats[r]
            # lookup: the usable prefix, touched from last to first where it is served
            if one:
                # one tier serves every present block: the absent ones are the new ones,
                # and the usable prefix ends at the first of them (counted at the end)
                new = list(filterfalse(held_at, req))
                p = req.index(new[0]) if new else len(req)
                held = req[:p]
                head = [first] * p
                if p:
                    touch_hits(held, head)
                    if emit is not None:
                        for b in held:
                            emit(times[r], "load", b, "indexed", first, nbytes=nb)
                n_first = p
            else:
                served = list(map(serving, map(where_get, req)))
                p = served.index(None) if None in served else len(req)
                head = served[:p]  # type: ignore[assignment]  # all present
                held = req[:p]
                if p:
                    touch_hits(held, head)
                n_first = head.count(first)
                for name, tc in zip(names, tcs, strict=True):
                    tc.block_hits += served.count(name)
                    k = n_first if name == first else head.count(name)
                    tc.prefix_hits += k
                    tc.reads += k
                if emit is not None:
                    for b, tier in zip(held, head, strict=True):
                        emit(times[r], "load", b, "indexed", tier, nbytes=nb)
                # load, then promotion of the hits served from a slower tier (it may evict
                # blocks of the request: its new blocks are found after it)
                if n_first < p:
                    plan_promote([b for b, tier in zip(held, head, strict=True) if tier != first])
                    new = [b for b in req if b not in where]
                else:
                    new = list(compress(req, map(not_, served)))
            pd.append(n_first if first_is_dram else 0)
            pk.append(p - pd[-1])
            pr.append(len(req) - len(new))
            # put (a request with no new block only tells the policies, in prompt order)
            classes = None
            if new:
                if tracked is not None:
                    if emit is not None:
                        t, ns, rid = tracked.t, tracked.ns, tracked.rid
                        for b in new:
                            emit(t, "put", b, "tentative", nbytes=nb, ns=ns, rid=rid)
                    tracked.positions = {b: pos for pos, b in enumerate(req)}
                if hinted:
                    classes = rows.get(cats[r])
                    if classes is None:
                        base = cats[r] * 4
                        classes = rows[cats[r]] = [base + b for b in buckets]
            placed = put_prompt(req, new, classes)[1]
            nw.append(len(placed))
            dr.append(len(new) - len(placed))
            if progress is not None and r & 1023 == 1023:
                progress(1024)
        if one:
            (tc,) = tcs
            tc.block_hits += sum(pr)
            tc.prefix_hits += sum(pd) + sum(pk)
            tc.reads += sum(pd) + sum(pk)

        def arr(values: list[int]) -> NDArray[np.int64]:
            return np.array(values, np.int64) if values else np.zeros(n, np.int64)

        return CacheRun(
            prefix_dram=arr(pd),
            prefix_disk=arr(pk),
            present=arr(pr),
            new=arr(nw),
            dropped=arr(dr),
            promoted=arr(res.pm),
            demoted=arr(res.dm),
            tiers=res.tc,
            lifespans=tracked.lifespans if tracked is not None else {},
            resident_at_end=len(slots[0].policy) if one else len(where),
        )

    def _run_exact_one(
        self,
        trace: Trace,
        place: Placement,
        res: _SimResidency,
        progress: Callable[[int], None] | None,
    ) -> CacheRun:
        """The policy-only replay of one tier (no lifespans, no events): each request is
        one engine call (:meth:`~kvlife.placement.Placement.request_exact_one`: its
        lookup, then its put), mapped over the requests in one C call; the counts are
        taken from what the calls return. The same calls, decisions and counts as the
        general loop of :meth:`run`."""
        n = trace.n_requests
        reqs = request_ids(trace)
        hinted = self.class_hints and any(
            isinstance(p, SupportsClassHints) for p in self.policies.values()
        )
        classes: list[list[int] | None] | repeat[None]
        if hinted:
            # class hints by position, one row per category (a put reads only its own
            # positions, so rows are as long as the longest request)
            longest = max(map(len, reqs), default=0)
            buckets = [pos_bucket(pos) for pos in range(longest)]
            cats = trace.categories.tolist()
            rows = {c: [c * 4 + b for b in buckets] for c in set(cats)}
            classes = list(map(rows.__getitem__, cats))
        else:
            classes = repeat(None)
        serve = place.request_exact_one
        if progress is None:
            out = list(map(serve, reqs, classes))
        else:
            out = []
            it = map(serve, reqs, classes)
            for _ in range(0, n - 1023, 1024):
                out += islice(it, 1024)
                progress(1024)
            out += it
        got = np.fromiter(chain.from_iterable(out), np.int64, 3 * n).reshape(n, 3)
        hits, absent, placed = got.T.copy()
        zeros = np.zeros(n, np.int64)
        present = np.diff(trace.offsets).astype(np.int64) - absent
        ((name, tc),) = res.tc.items()
        tc.block_hits += int(present.sum())
        tc.prefix_hits += int(hits.sum())
        tc.reads += int(hits.sum())
        return CacheRun(
            prefix_dram=hits if name == DRAM else zeros,
            prefix_disk=zeros if name == DRAM else hits,
            present=present,
            new=placed,
            dropped=absent - placed,
            promoted=zeros.copy(),
            demoted=zeros.copy(),
            tiers=res.tc,
            resident_at_end=len(self.policies[name]),
        )


@dataclass(slots=True)
class _TraceKeys:
    """What a trace's replays share (made once per trace, kept while its ``blocks``
    array lives)."""

    ids: list[int]
    requests: list[list[int]] | None = None
    """Each request's block ids (slices of ``ids``)."""
    distinct: bool | None = None
    """Whether no request names a block twice."""


_TRACE_KEYS: dict[int, tuple[weakref.ref[NDArray[np.int64]], _TraceKeys]] = {}


def _trace_keys(trace: Trace) -> _TraceKeys:
    arr = trace.blocks
    key = id(arr)
    got = _TRACE_KEYS.get(key)
    if got is not None and got[0]() is arr:
        return got[1]
    values = arr.tolist()
    first: dict[int, int] = {}
    keys = _TraceKeys(list(map(first.setdefault, values, values)))

    def forget(_: object, key: int = key) -> None:
        _TRACE_KEYS.pop(key, None)

    _TRACE_KEYS[key] = (weakref.ref(arr, forget), keys)
    return keys


def block_ids(trace: Trace) -> list[int]:
    """The trace's block ids as a list with one int object per distinct id.

    Equal ids are the same object, so the policies' and the engine's dict lookups
    match a key by identity (no value comparison), and the list is made once per trace
    (kept while its ``blocks`` array lives) rather than once per replay. Do not change
    the list: every replay of the trace reads it."""
    return _trace_keys(trace).ids


def distinct_requests(trace: Trace) -> bool:
    """Whether no request of ``trace`` names a block twice (chained block ids never
    do; a hand-made trace may), found once per trace. The one-call-per-request replay
    (:meth:`~kvlife.placement.Placement.request_exact_one`) takes only such traces."""
    keys = _trace_keys(trace)
    if keys.distinct is None:
        keys.distinct = all(len(set(req)) == len(req) for req in request_ids(trace))
    return keys.distinct


def request_ids(trace: Trace) -> list[list[int]]:
    """Each request's block ids (as :func:`block_ids`), made once per trace. Do not
    change the lists: every replay of the trace reads them."""
    keys = _trace_keys(trace)
    if keys.requests is None:
        offs = trace.offsets.tolist()
        keys.requests = list(map(keys.ids.__getitem__, map(slice, offs, offs[1:])))
    return keys.requests


class _Where(dict[Hashable, frozenset[TierName]]):
    """Block -> the tiers holding it; a block held nowhere maps to the empty set (so
    that ``__getitem__``, a C call, is the placement engine's ``tiers_of``)."""

    def __missing__(self, key: Hashable) -> frozenset[TierName]:
        return NOWHERE


NOWHERE: frozenset[TierName] = frozenset()


class _SimResidency:
    """Where blocks live in the simulation, and the counting executor of placement's
    actions (the simulator's side of "one placement engine, two executors").

    With several tiers a map from block to tier set is kept; tier sets are interned (one
    frozenset object per combination of tiers), so moving a replica is two dictionary
    lookups and the serving tier of a set is precomputed. With one tier its policy is the
    residency (it knows exactly what the tier holds, :class:`~kvlife.placement.engine.
    ExactResidency`) and no map is kept. This class counts only;
    :class:`_TrackedResidency` adds lifespans and events."""

    tiers_of: Callable[[Hashable], Collection[TierName]]

    def __init__(self, sim: CacheSim, n: int) -> None:
        names = [TierName(t) for t in sim.policies]
        sets = [frozenset(c) for k in range(len(names) + 1) for c in combinations(names, k)]
        interned = {s: s for s in sets}
        self.one = {t: interned[frozenset((t,))] for t in names}
        self.plus = {t: {s: interned[s | {t}] for s in sets} for t in names}
        self.minus = {t: {s: interned[s - {t}] for s in sets} for t in names}
        order = {t: i for i, t in enumerate(names)}
        self.serving: dict[frozenset[TierName] | None, TierName | None] = {
            s: min(s, key=order.__getitem__) for s in sets if s
        }
        """The fastest tier of each non-empty set (as Placement.fastest); None: absent."""
        self.serving[None] = None
        self.where = _Where()
        """Block -> its tiers (several tiers only; it stays empty with one)."""
        self.tiers_of = self.where.__getitem__
        self.multi = len(names) > 1
        if not self.multi:
            members = sim.policies[names[0]].members
            held = self.one[names[0]]
            self.tiers_of = lambda key: held if key in members else NOWHERE
        self.tc: dict[str, TierCounters] = {t: TierCounters() for t in names}
        self.pm = [0] * n
        self.dm = [0] * n
        self.r = 0
        self.uniform_size = 1
        """Every block has one size: placement skips per-key size lookups."""
        self.policies_exact = True
        """Only placement's hooks change where blocks live, so the policies know exactly
        what their tiers hold: placement skips its check of each victim."""

    def size_of(self, key: Hashable) -> int:
        return 1

    def on_place(self, keys: Sequence[Hashable], tier: TierName) -> None:
        if self.multi:
            self.where.update(zip(keys, repeat(self.one[tier])))
        self.tc[tier].inserts += len(keys)

    def on_copy(self, key: Hashable, src: TierName, dst: TierName, reason: str) -> None:
        where = self.where
        where[key] = self.plus[dst][where[key]]
        self.tc[dst].inserts += 1
        if reason == "demote":
            self.tc[src].reads += 1
            self.dm[self.r] += 1
        elif reason == "promote":
            self.pm[self.r] += 1

    def on_evict(
        self, keys: Sequence[Hashable], tier: TierName, last: Collection[Hashable], reason: str
    ) -> None:
        where = self.where
        if not self.multi:  # one tier: every key leaves, and nothing is mapped
            pass
        elif len(last) == len(keys):  # last is a subset of keys: every key leaves (C loop)
            deque(map(where.pop, keys), maxlen=0)
        else:
            minus = self.minus[tier]
            for key in keys:
                if key in last:
                    del where[key]
                else:
                    where[key] = minus[where[key]]
        self.tc[tier].evictions += len(keys)

    def on_reject(self, key: Hashable, reason: str) -> None:
        pass


class _TrackedResidency(_SimResidency):
    """The counting executor plus lifespans per object class and lifecycle events."""

    def __init__(self, sim: CacheSim, trace: Trace) -> None:
        super().__init__(sim, trace.n_requests)
        self.born: dict[Hashable, float] = {}
        self.klass: dict[Hashable, int] = {}
        self.lifespans: dict[str, list[float]] = {}
        self.names = trace.category_names
        self.emit = sim._emit if sim.sink is not None else None
        self.nb = sim.block_bytes
        self.t = 0.0
        self.ns = ""
        self.rid = ""
        self.cat = 0
        self.positions: dict[Hashable, int] = {}

    def on_place(self, keys: Sequence[Hashable], tier: TierName) -> None:
        super().on_place(keys, tier)
        t, emit, nb, positions = self.t, self.emit, self.nb, self.positions
        base = self.cat * 4
        for key in keys:
            self.born[key] = t
            self.klass[key] = base + pos_bucket(positions[key])
            if emit is not None:
                emit(t, "write", key, "tentative", tier, nbytes=nb, rid=self.rid)
                emit(t, "seal", key, "tentative", tier, nbytes=nb)
                emit(t, "commit", key, "committed", tier)
                emit(t, "index", key, "indexed", tier)

    def on_copy(self, key: Hashable, src: TierName, dst: TierName, reason: str) -> None:
        super().on_copy(key, src, dst, reason)
        if self.emit is not None:
            self.emit(self.t, "offload", key, "indexed", src, dst, self.nb, reason)

    def on_evict(
        self, keys: Sequence[Hashable], tier: TierName, last: Collection[Hashable], reason: str
    ) -> None:
        super().on_evict(keys, tier, last, reason)
        t, emit, nb = self.t, self.emit, self.nb
        every = len(last) == len(keys)  # last is keys or a subset of them
        for key in keys:
            if emit is not None:
                emit(t, "evict", key, "indexed", tier=tier, nbytes=nb, reason="capacity")
            if every or key in last:
                if emit is not None:
                    ns, rid = self.ns, self.rid
                    emit(t, "invalidate", key, "invalidated", reason=reason, ns=ns, rid=rid)
                    emit(t, "delete", key, "deleted", reason=reason, ns=ns, rid=rid)
                c = self.klass.pop(key)
                name = f"{self.names[c // 4]}/{POS_BUCKETS[c % 4]}"
                self.lifespans.setdefault(name, []).append(t - self.born.pop(key))

    def on_reject(self, key: Hashable, reason: str) -> None:
        if self.emit is not None:
            self.emit(self.t, "abort", key, "deleted", reason=reason)
