"""The placement engine: where a put lands, what to demote or evict and where to, what to
promote, and in what order each tier's policy is told. No I/O, no clock.

The live store (:mod:`kvlife.store`) and the replay simulator (:mod:`kvlife.replay.cache`)
both call this engine and execute the actions it takes, one with real I/O and one by
counting, so a replay takes exactly the store's decisions.

The engine keeps each tier's charged units (bytes in the store, blocks in the simulator)
and its eviction policy; it learns where objects live from a :class:`Residency` that the
caller implements over its own records. Every action is handed to the residency
(its ``on_*`` hook) as it is taken, in an order that is safe to execute, so later decisions of
the same plan see earlier ones; a run of actions of one kind (a put's placements, a batch
of evictions and the drops they cause) comes in one call, in the same order. The returned
:class:`~kvlife.placement.actions.Plan` says only how many there were and whether the
room asked for was made.

The simulator replays millions of block touches through this engine, so its hot paths
are written for that (policy calls bound once, victims taken n at a time, one hook call
per run of actions, one tier without a per-tier loop); they are the engine's only code,
shared by the store.

The rules (docs/replay.md states them for one tier):

- **lookup**: hits are touched from last to first in the tier that serves them, so the
  head of a chain is evicted last;
- **put**: the new objects go to the first tier, room made for all at once without
  evicting a chunk of the prompt; if that fails each goes to the first tier with room,
  and those that fit nowhere are rejected. Then every chunk of the prompt, in order, is
  inserted (new) or touched (present) in each tier holding it;
- **making room** in tier *i* takes victims as one ``evict(1, protected)`` at a time
  would (:meth:`~kvlife.policy.base.EvictionPolicy.evict_up_to`) until the shortfall is
  met. Victims with no replica elsewhere are first copied (demoted) to
  tier *i+1*, whose room is made the same way, protecting those victims and whatever the
  caller protects (a put's whole prompt); a victim that then has no replica left is
  dropped;
- **promotion** copies hits that were served from a slower tier into the first tier.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import filterfalse
from typing import Protocol

from kvlife.core.errors import InvalidArgument
from kvlife.core.objects import TierName
from kvlife.placement.actions import Plan
from kvlife.policy.base import EvictionPolicy, SupportsClassHints


class Residency(Protocol):
    """Where objects live, as the caller records it (replicas being written count)."""

    def tiers_of(self, key: Hashable) -> Collection[TierName]:
        """Tiers holding (or receiving) a replica of ``key``; empty if none."""
        ...

    def size_of(self, key: Hashable) -> int:
        """Payload size of ``key`` in the caller's units."""
        ...

    # The actions (no action object is built on the hot path: the store makes its own,
    # the simulator executes the hook at once). Each hook is called as its actions are
    # taken, before the next decision; the hooks that take several keys take them in the
    # order of their actions.

    def on_place(self, keys: Sequence[Hashable], tier: TierName) -> None:
        """New objects' first replicas go to ``tier`` (a :class:`Place` each)."""
        ...

    def on_copy(self, key: Hashable, src: TierName, dst: TierName, reason: str) -> None:
        """A replica is copied (:class:`Copy`)."""
        ...

    def on_evict(
        self, keys: Sequence[Hashable], tier: TierName, last: Collection[Hashable], reason: str
    ) -> None:
        """The replicas of ``keys`` in ``tier`` leave (an :class:`Evict` each); a key in
        ``last`` (a subset of ``keys``, or ``keys`` itself when every key is dropped) had no
        other replica: right after its eviction the object is dropped (:class:`Drop` with
        ``reason``)."""
        ...

    def on_reject(self, key: Hashable, reason: str) -> None:
        """A new object fits nowhere (:class:`Reject`)."""
        ...


class UniformResidency(Residency, Protocol):
    """A residency whose objects all have one size (the simulator's blocks): placement
    then skips the per-key size lookups."""

    uniform_size: int


class ExactResidency(Residency, Protocol):
    """A residency changed only by this engine's hooks (the simulator's), so every key a
    tier's policy knows is held in that tier, and a tier holds exactly what its policy
    knows: placement then skips the check, victim by victim, that the tier still holds
    what its policy gives up (the store's policies may know a replica that failed or was
    lost), and asks a one-tier chain's policy (its ``members``, a C call) whether a key is
    held rather than the residency, which then needs no map of its own."""

    policies_exact: bool


@dataclass(slots=True)
class TierSlot:
    """One tier as placement sees it."""

    name: TierName
    capacity: int
    """Units (bytes or blocks) the tier may hold."""
    policy: EvictionPolicy[object]
    """The tier's eviction policy (fixed: the engine binds its calls once)."""
    footprint: Callable[[int], int] = int
    """Units a replica of a given payload size takes (framing included)."""
    used: int = 0
    """Units charged by replicas placed and not evicted."""
    unit: int | None = None
    """Units every replica takes when all objects have one size (set by Placement)."""
    size: Callable[[Hashable], int] | None = None
    """Payload size of a key's replica in this tier when it differs from the
    residency's (a tier that encodes what it stores); a pure function of the key."""

    def units(self, res: Residency, key: Hashable) -> int:
        unit = self.unit
        if unit is not None:
            return unit
        size = self.size
        return self.footprint(size(key) if size is not None else res.size_of(key))


_NO_KEYS: dict[Hashable, TierName] = {}
"""A put's placements when it has no new key (never changed)."""


class Placement:
    """The decisions of a tier chain (fastest first)."""

    def __init__(self, slots: Sequence[TierSlot], residency: Residency) -> None:
        if not slots:
            raise InvalidArgument("a tier chain needs at least one tier")
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must be unique, got {names}")
        self.slots = list(slots)
        self._by_name = {s.name: s for s in slots}
        self._order = {s.name: i for i, s in enumerate(slots)}
        self.res = residency
        uniform = getattr(residency, "uniform_size", None)
        if isinstance(uniform, int):
            for slot in self.slots:
                if slot.size is None:
                    slot.unit = slot.footprint(uniform)
        self._exact = getattr(residency, "policies_exact", False) is True
        """Every key a policy knows is held in its tier (:class:`ExactResidency`)."""
        self.shielded: tuple[Collection[Hashable], ...] = ()
        """Keys no eviction may take whatever the call protects (the store's pinned
        objects and those with a replica still being written by a pending plan)."""
        # Each tier's policy calls, bound once: the hot loops below make one call per
        # chunk (a slot's policy is fixed for the engine's life).
        self._only = slots[0].policy if len(slots) == 1 else None
        """The policy of a one-tier chain (its batch calls serve the hot paths)."""
        self._held: Callable[[Hashable], object] = residency.tiers_of
        """Whether a key has a replica (truthy), for a one-tier chain's puts."""
        self._exact_one = False
        """One tier of one-size objects whose policy is exactly what it holds: a put
        is :meth:`_put_exact_one`."""
        if self._only is not None and self._exact:
            self._held = self._only.members.__contains__
            self._exact_one = bool(self.slots[0].unit)
        # the calls of a one-tier request (request_exact_one), bound once
        only = slots[0].policy
        self._touch_all = only.touch_all
        self._evict_up_to = only.evict_up_to
        self._record_tail = only.record_tail
        self._on_place = residency.on_place
        self._on_evict = residency.on_evict
        self._touch = {s.name: s.policy.touch for s in slots}
        self._insert = {s.name: s.policy.insert for s in slots}
        self._insert_classed = {
            s.name: s.policy.insert_classed
            for s in slots
            if isinstance(s.policy, SupportsClassHints)
        }

    # ------------------------------------------------------------------ queries

    @property
    def exact_one(self) -> bool:
        """One tier of one-size objects whose policy is exactly what it holds: a whole
        request can be :meth:`request_exact_one`."""
        return self._exact_one

    def slot(self, name: TierName) -> TierSlot:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidArgument(f"no tier {name!r} in the chain {list(self._by_name)}") from None

    def fastest(self, tiers: Collection[TierName]) -> TierName:
        """The first tier of the chain among ``tiers`` (which must not be empty)."""
        if len(tiers) == 1:
            for only in tiers:
                return only
        return min(tiers, key=self._order.__getitem__)

    def next_tier(self, name: TierName) -> TierName | None:
        i = self._order[name] + 1
        return self.slots[i].name if i < len(self.slots) else None

    # ------------------------------------------------------------------ bookkeeping

    def insert(self, key: Hashable, tier: TierName, cls: int | None = None) -> None:
        """Tell ``tier``'s policy about a new resident (with a class hint if it takes one)."""
        pol = self._by_name[tier].policy
        if cls is not None and isinstance(pol, SupportsClassHints):
            pol.insert_classed(key, cls)
        else:
            pol.insert(key)

    def touch_hits(self, keys: Sequence[Hashable], tiers: Sequence[TierName]) -> None:
        """A lookup's hits (their keys, and the tier serving each), touched from last to
        first."""
        if self._only is not None:  # one tier serves every hit
            self._only.touch_all(reversed(keys))
            return
        touch = self._touch
        for key, tier in zip(reversed(keys), reversed(tiers), strict=True):
            touch[tier](key)

    def touch_in_order(
        self,
        keys: Sequence[Hashable],
        new: dict[Hashable, TierName],
        classes: Sequence[int] | None = None,
    ) -> None:
        """Every chunk of a put in prompt order: inserted where it was just placed,
        touched in every other tier that holds it."""
        self._record(keys, new, classes, all_held=False)

    def put_prompt(
        self,
        keys: Sequence[Hashable],
        new: Sequence[Hashable],
        classes: Sequence[int] | None = None,
    ) -> tuple[Plan, dict[Hashable, TierName]]:
        """:meth:`plan_put` then :meth:`touch_in_order`, in one call, for a caller that
        adds nothing between the two (the simulator; the store adds write-through
        copies). When every new object was placed, every chunk of the prompt is held
        (the present ones were protected), so the policies are told without asking
        where each chunk lives."""
        if self._exact_one:
            plan = Plan()
            placed = self._put_exact_one(plan, keys, new, classes, None)
            return plan, placed if placed is not None else dict.fromkeys(new, self.slots[0].name)
        plan, placed = self.plan_put(keys, new)
        self._record(keys, placed, classes, all_held=len(placed) == len(new))
        return plan, placed

    def request_exact_one(
        self, keys: Sequence[Hashable], classes: Sequence[int] | None = None
    ) -> tuple[int, int, int]:
        """A whole request of distinct keys against one tier of one-size objects whose
        policy knows exactly what the tier holds (:class:`ExactResidency`; the
        simulator's policy-only replay), in one call: its lookup (the usable prefix,
        the leading keys held, touched from last to first as :meth:`touch_hits` does)
        and then its put of the keys not held (:meth:`put_prompt`), with the same
        decisions, actions and policy calls as those two. Returns the usable prefix's
        length, the number of keys not held and the number of them placed.

        The simulator maps this over a trace's requests in one C call, so a request
        costs one Python frame here plus the policy's batch calls; the put's policy
        calls take the policy's :meth:`~kvlife.policy.base.EvictionPolicy.record_tail`
        when the keys not held are exactly the request's tail (the usual request)."""
        new = list(filterfalse(self._held, keys))
        if not new:  # every key held: all hits, the put only tells the policy
            if keys:
                self._touch_all(keys[::-1])
            self._record(keys, _NO_KEYS, classes, all_held=True)
            return len(keys), 0, 0
        hits = keys.index(new[0])
        if hits:
            self._touch_all(keys[hits - 1 :: -1])
        placed = self._put_exact_one(None, keys, new, classes, hits)
        return hits, len(new), len(new) if placed is None else len(placed)

    def _put_exact_one(
        self,
        plan: Plan | None,
        keys: Sequence[Hashable],
        new: Sequence[Hashable],
        classes: Sequence[int] | None,
        hits: int | None,
    ) -> dict[Hashable, TierName] | None:
        """:meth:`put_prompt` for one tier of one-size objects whose policy knows exactly
        what the tier holds (the simulator's policy-only replay): the same decisions,
        actions and policy calls as :meth:`plan_put`, :meth:`_free`, :meth:`_evict` and
        :meth:`_record` take there, in one call (a victim the policy gives up is held;
        every victim is dropped, ``last`` is the victims' list itself). Counts the
        actions into ``plan`` when one is given. ``hits``, when given, is the number of
        leading keys held (:meth:`request_exact_one`): if the keys after them are
        exactly ``new`` (distinct keys), the policy is told by ``record_tail``.

        Returns where each key was placed, or None when every key of ``new`` went to
        the tier (the caller knows where) and no map was needed."""
        if not new:
            self._record(keys, _NO_KEYS, classes, all_held=True)
            return {}
        slot = self.slots[0]
        unit: int = slot.unit  # type: ignore[assignment]  # set: _exact_one
        need = len(new) * unit
        short = slot.used + need - slot.capacity
        if short > 0:
            protected: Collection[Hashable] = set(keys)
            if self.shielded and any(self.shielded):
                protected = set(protected).union(*self.shielded)
            want = -(-short // unit)
            victims = self._evict_up_to(want, protected)
            if victims:
                slot.used -= unit * len(victims)
                self._on_evict(victims, slot.name, victims, "evicted")
                if plan is not None:
                    plan.size += 2 * len(victims)
            if len(victims) < want:  # no room for all at once: one by one, as plan_put
                placed = self._place_each(plan if plan is not None else Plan(), new, protected)
                self._record(keys, placed, classes, all_held=len(placed) == len(new))
                return placed
        slot.used += need
        if plan is not None:
            plan.size += len(new)
        self._on_place(new, slot.name)
        if (
            hits is not None
            and hits + len(new) == len(keys)
            and (classes is None or not self._insert_classed)
        ):
            self._record_tail(keys, hits)
            return None
        self._record(keys, dict.fromkeys(new, slot.name), classes, all_held=True)
        return None

    def _record(
        self,
        keys: Sequence[Hashable],
        new: dict[Hashable, TierName],
        classes: Sequence[int] | None,
        all_held: bool,
    ) -> None:
        touch, insert = self._touch, self._insert
        classed = self._insert_classed if classes is not None else None
        only = self._only
        if only is not None:
            # one tier: it holds every held key, and every placed key went there
            held = self._held
            (name,) = self._touch
            touch1 = touch[name]
            put1 = classed.get(name) if classed else None
            # (a key just placed is held, though an exact policy learns of it only here)
            if put1 is None:
                if not all_held:
                    keys = [key for key in keys if key in new or held(key)]
                only.record_in_order(keys, new)
                return
            for pos, key in enumerate(keys):
                if not all_held and key not in new and not held(key):
                    continue
                if key in new:
                    put1(key, classes[pos])  # type: ignore[index]
                else:
                    touch1(key)
            return
        tiers_of = self.res.tiers_of
        home_of = new.get
        for pos, key in enumerate(keys):
            holders = tiers_of(key)
            if not holders:
                continue
            home = home_of(key)
            for tier in holders:  # each policy sees only its own tier's calls: order-free
                if tier != home:
                    touch[tier](key)
                elif classed and tier in classed:
                    classed[tier](key, classes[pos])  # type: ignore[index]
                else:
                    insert[tier](key)

    def charge(self, key: Hashable, tier: TierName) -> None:
        """Count a replica the caller placed by itself (recovery at open)."""
        slot = self._by_name[tier]
        slot.used += slot.units(self.res, key)
        slot.policy.insert(key)

    def release(self, key: Hashable, tier: TierName) -> None:
        """A replica left ``tier`` outside a plan (failed write, found lost, invalidated)."""
        slot = self._by_name[tier]
        slot.used -= slot.units(self.res, key)
        slot.policy.remove(key)
        if slot.used < 0:
            raise AssertionError(f"tier {tier} charged {slot.used} units: accounting broken")

    def forget(self, key: Hashable) -> None:
        """An object is being deleted: release all its replicas."""
        for tier in list(self.res.tiers_of(key)):
            self.release(key, tier)
        for slot in self.slots:
            slot.policy.remove(key)

    # ------------------------------------------------------------------ plans

    def plan_put(
        self,
        keys: Sequence[Hashable],
        new: Sequence[Hashable],
        classes: Sequence[int] | None = None,
    ) -> tuple[Plan, dict[Hashable, TierName]]:
        """Place the ``new`` objects of a prompt whose chunks are ``keys`` (in order).

        Returns the plan and where each placed object goes; policies are told about every
        chunk of the prompt afterwards by :meth:`touch_in_order` (the caller may first add
        write-through copies, as the store does).
        """
        plan = Plan()
        placed: dict[Hashable, TierName] = {}
        if new:
            protected = set(keys)
            slot = self.slots[0]
            first = slot.name
            unit = slot.unit
            need = len(new) * unit if unit is not None else self._units(slot, new)
            short = slot.used + need - slot.capacity  # _make_room, inlined for the hot path
            if short <= 0 or self._free(plan, first, short, protected):
                # the common case, all to the first tier: one charge, one hook
                slot.used += need
                plan.size += len(new)
                self.res.on_place(new, first)
                placed = dict.fromkeys(new, first)
            else:
                placed = self._place_each(plan, new, protected)
        return plan, placed

    def _place_each(
        self, plan: Plan, new: Sequence[Hashable], protected: Collection[Hashable]
    ) -> dict[Hashable, TierName]:
        """Each new object to the first tier with room for it; those that fit nowhere
        are rejected."""
        placed: dict[Hashable, TierName] = {}
        for key in new:
            for slot in self.slots:
                if self._make_room(plan, slot.name, [key], protected):
                    self._place(plan, key, slot.name)
                    placed[key] = slot.name
                    break
            else:
                plan.size += 1
                self.res.on_reject(key, "no room in any tier")
                plan.complete = False
        return placed

    def plan_copies(
        self,
        keys: Sequence[Hashable],
        dst: TierName,
        reason: str,
        *,
        protected: Collection[Hashable] = (),
        batch: int = 64,
    ) -> Plan:
        """Copy ``keys`` (from their fastest replica) into ``dst``, making room there
        batch by batch, protecting each batch and ``protected`` (a write-through put's
        whole prompt). ``complete`` is False if a batch found no room (it and the rest
        are then not copied)."""
        plan = Plan()
        todo = [k for k in keys if dst not in self.res.tiers_of(k)]
        for i in range(0, len(todo), batch):
            part = todo[i : i + batch]
            if not self._copy_into(plan, part, dst, reason, set(part).union(protected)):
                plan.complete = False
                break
        return plan

    def plan_promote(self, keys: Sequence[Hashable]) -> Plan:
        """Copy hits served from a slower tier into the first tier (all or none)."""
        plan = Plan()
        first = self.slots[0].name
        todo = [k for k in keys if first not in self.res.tiers_of(k)]
        if todo:
            self._copy_into(plan, todo, first, "promote", set(todo))
        return plan

    def plan_evict(self, tier: TierName, units: int, protected: Collection[Hashable]) -> Plan:
        """Free at least ``units`` of ``tier`` (as far as its policy allows)."""
        plan = Plan()
        plan.complete = self._free(plan, tier, units, protected)
        return plan

    # ------------------------------------------------------------------ internals

    def _place(self, plan: Plan, key: Hashable, tier: TierName) -> None:
        slot = self._by_name[tier]
        slot.used += slot.units(self.res, key)
        plan.size += 1
        self.res.on_place((key,), tier)

    def _copy_into(
        self,
        plan: Plan,
        keys: Sequence[Hashable],
        dst: TierName,
        reason: str,
        protected: Collection[Hashable],
    ) -> bool:
        if not self._make_room(plan, dst, keys, protected):
            return False
        slot = self._by_name[dst]
        res = self.res
        tiers_of, on_copy, insert = res.tiers_of, res.on_copy, slot.policy.insert
        unit = slot.unit
        for key in keys:
            held = tiers_of(key)
            if not held:  # evicted while making room (never when protected)
                continue
            slot.used += unit if unit is not None else slot.units(res, key)
            plan.size += 1
            on_copy(key, self.fastest(held), dst, reason)
            insert(key)
        return True

    def _make_room(
        self,
        plan: Plan,
        tier: TierName,
        keys: Sequence[Hashable],
        protected: Collection[Hashable],
    ) -> bool:
        slot = self._by_name[tier]
        need = len(keys) * slot.unit if slot.unit is not None else self._units(slot, keys)
        return self._free(plan, tier, slot.used + need - slot.capacity, protected)

    def _units(self, slot: TierSlot, keys: Iterable[Hashable]) -> int:
        """Units the replicas of ``keys`` take in ``slot`` (objects of several sizes)."""
        res = self.res
        return sum(slot.units(res, key) for key in keys)

    def _free(
        self, plan: Plan, tier: TierName, short: int, protected: Collection[Hashable]
    ) -> bool:
        if short <= 0:
            return True
        slot = self._by_name[tier]
        if any(self.shielded):
            protected = set(protected).union(*self.shielded)
        victims: list[Hashable] = []
        freed = 0
        res = self.res
        tiers_of = res.tiers_of
        evict_up_to = slot.policy.evict_up_to
        unit = slot.unit
        if unit:  # one (non-zero) size: the number of victims is known
            want = -(-short // unit)
            if self._exact:  # the policy knows only what the tier holds: no check
                victims = evict_up_to(want, protected)
            one_tier = self._only is not None
            while len(victims) < want:
                ask = want - len(victims)
                got = evict_up_to(ask, protected)
                # a key the tier no longer holds was only known to the policy: ask again
                # (with one tier, a key held anywhere is held here: one C pass checks all)
                if one_tier and all(map(tiers_of, got)):
                    victims += got
                else:
                    victims += [key for key in got if tier in tiers_of(key)]
                if len(got) < ask:
                    break
            freed = len(victims) * unit
        else:
            while freed < short:
                got = evict_up_to(1, protected)
                if not got:
                    break
                key = got[0]
                if tier not in tiers_of(key):
                    continue  # the policy knew a key the tier no longer holds
                victims.append(key)
                freed += slot.units(res, key)
        if victims:
            self._evict(plan, tier, victims, protected)
        return freed >= short

    def _evict(
        self, plan: Plan, tier: TierName, victims: list[Hashable], protected: Collection[Hashable]
    ) -> None:
        if self._only is not None:  # one tier: nowhere to demote to, every victim is dropped
            slot = self.slots[0]
            unit = slot.unit
            if unit is not None:
                slot.used -= unit * len(victims)
            else:
                slot.used -= sum(slot.units(self.res, key) for key in victims)
            self.res.on_evict(victims, tier, set(victims), "evicted")
            plan.size += 2 * len(victims)
            return
        nxt = self.next_tier(tier)
        demoted = True
        res = self.res
        tiers_of = res.tiers_of
        if nxt is not None:
            only_here = [v for v in victims if len(tiers_of(v)) == 1]
            if only_here:
                # room in the next tier never takes what the caller protects either (a
                # put's own prompt), nor the victims being demoted
                keep = set(only_here).union(protected)
                demoted = self._copy_into(plan, only_here, nxt, "demote", keep)
        slot = self._by_name[tier]
        why = "evicted" if demoted or nxt is None else f"evicted: no room in {nxt}"
        unit = slot.unit
        if unit is not None:
            slot.used -= unit * len(victims)
        else:
            slot.used -= sum(slot.units(res, key) for key in victims)
        last = {key for key in victims if len(tiers_of(key)) == 1}
        res.on_evict(victims, tier, last, why)
        plan.size += len(victims) + len(last)
        # a dropped object leaves every policy; this tier's forgot it in eviction already
        for s in self.slots:
            if s.name != tier:
                remove = s.policy.remove
                for key in last:
                    remove(key)
