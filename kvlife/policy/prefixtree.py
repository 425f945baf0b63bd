"""Prefix-tree-aware LRU: leaves go first, and no block outlives its parent.

A KV block is usable only behind its whole prefix, so a resident block whose parent is
gone is worthless. This policy learns the prefix tree from the puts themselves
(:meth:`record_in_order` gets a put's chunks in prompt order: each new chunk's parent is
the chunk before it) and keeps two rules:

- **leaves first**: only a block with no resident child may be evicted, so eviction
  never leaves a resident child without its parent (the invariant the tests check);
- **orphans first**: a block whose parent left by :meth:`remove` (deleted, invalidated)
  is the next victim.

Among leaves the order is LRU. A put's chunks (and a lookup's hits) are made most recent
from the last to the first, so a parent is always more recent than its children and the
least recent key is a leaf: eviction stays a scan of one or two keys.

Variants (registered names): ``prefixtree`` (the above), ``prefixtree-admit`` (new
blocks whose structural class the online reuse predictor does not expect to be reused
are admitted cold, :mod:`kvlife.policy.admission`), ``prefixtree-door`` (TinyLFU's
doorkeeper: first sightings go cold).

Only :meth:`record_in_order` sees the structure: a bare ``insert`` (a multi-tier chain's
per-tier calls, recovery at open) makes a root of unknown class; ``touch`` keeps the
tree. This policy's ``record_in_order`` is therefore *not* the calls one by one (it is
a :class:`~kvlife.policy.base.LearnsFromPrompts` policy).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Container, Hashable, Sequence
from itertools import islice, pairwise, repeat
from typing import TypeVar

from kvlife.core.errors import InvalidArgument
from kvlife.policy.admission import Admission, Doorkeeper, PredictorAdmission
from kvlife.policy.base import EvictionPolicy, LearnsFromPrompts, register_policy
from kvlife.policy.reuse import UNKNOWN, ReusePredictor, structural_classes

K = TypeVar("K", bound=Hashable)


class PrefixTreePolicy(EvictionPolicy[K], LearnsFromPrompts):
    """LRU among the leaves of the learned prefix tree (see the module docstring)."""

    name = "prefixtree"

    def __init__(self, admission: Admission | None = None) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()
        self._parent: dict[K, K] = {}
        """Resident key -> its resident parent (roots and orphans have none)."""
        self._kids: dict[K, set[K]] = {}
        """Resident key -> its resident children (keys with none are absent)."""
        self._orphans: OrderedDict[K, None] = OrderedDict()
        """Residents whose parent was removed: the next victims."""
        self.admission = admission
        self._cls: dict[K, int] = {}
        """Class of each resident not touched since insert (for the admission's labels)."""
        self._depth: dict[K, int] = {}
        """Conversation turn of each resident inserted by a put (structure only)."""
        self.predictor: ReusePredictor | None = (
            admission.predictor if isinstance(admission, PredictorAdmission) else None
        )
        self.log: dict[K, float] | None = None
        """When set (and a predictor decides), each new key's reuse probability at its
        first insert (for :func:`kvlife.replay.predictor.predictor_accuracy`)."""

    # ------------------------------------------------------------------ structure

    def _link(self, key: K, parent: K) -> None:
        self._parent[key] = parent
        kids = self._kids.get(parent)
        if kids is None:
            self._kids[parent] = {key}
        else:
            kids.add(key)

    def _unlink(self, key: K) -> None:
        """``key`` leaves: detach it from its parent, orphan its children (kept as sets,
        so removing an inner block costs its children, not a scan of the cache)."""
        kids = self._kids
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = kids[parent]
            siblings.discard(key)
            if not siblings:
                del kids[parent]
        children = kids.pop(key, None)
        if children:
            for child in children:
                del self._parent[child]
                self._orphans[child] = None
        if self._orphans:
            self._orphans.pop(key, None)
        if self._depth:
            self._depth.pop(key, None)

    def parent_of(self, key: K) -> K | None:
        """The resident parent of a resident key (None: a root or an orphan)."""
        return self._parent.get(key)

    # ------------------------------------------------------------------ EvictionPolicy

    def insert(self, key: K) -> None:
        if key in self._order:
            self.touch(key)
            return
        self._order[key] = None
        if self.admission is not None:
            self._cls[key] = UNKNOWN
            self.admission.on_insert(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)
            if self._cls:
                cls = self._cls.pop(key, None)
                if cls is not None and self.admission is not None:
                    self.admission.on_hit(cls)

    def remove(self, key: K) -> None:
        if key in self._order:
            del self._order[key]
            self._cls.pop(key, None)
            self._unlink(key)

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        order = self._order
        if self.admission is None and self.log is None:
            # the plain tree: link each new key to the chunk before it, then make the
            # prompt most recent from its last chunk to its first
            head = len(keys) - len(new)
            if (
                head >= 0
                and not any(map(new.__contains__, islice(keys, head)))
                and not any(map(order.__contains__, islice(keys, head, None)))
            ):
                # the usual put: residents first, then its new keys (the last len(new)
                # keys, each a non-resident once): link each to the key before it, add
                # them from the last to the first, then move the residents likewise
                parent_of, kids = self._parent, self._kids
                for prev, key in pairwise(islice(keys, head - 1 if head else 0, None)):
                    parent_of[key] = prev  # _link, written out
                    siblings = kids.get(prev)
                    if siblings is None:
                        kids[prev] = {key}
                    else:
                        siblings.add(key)
                order.update(zip(reversed(keys[head:]), repeat(None)))
                deque(map(order.move_to_end, reversed(keys[:head])), maxlen=0)
                return
            self._record_plain(keys, new)
            return
        self._record_classed(keys, new)

    def record_tail(self, keys: Sequence[K], head: int) -> None:
        # the usual put (residents keys[:head], then new keys), known from the lookup
        if self.admission is not None or self.log is not None:
            self._record_classed(keys, set(islice(keys, head, None)))
            return
        # record_in_order's usual put without its checks, and its links made in C
        # loops: each new key's parent is the key before it; each new key but the last
        # gets the next one as its only child; the first new key is a child of the last
        # resident, which may have others
        kids = self._kids
        tail = keys[head:]
        if tail and head:
            last = keys[head - 1]
            self._parent.update(zip(tail, keys[head - 1 : -1], strict=True))
            siblings = kids.get(last)
            if siblings is None:
                kids[last] = {tail[0]}
            else:
                siblings.add(tail[0])
        else:
            self._parent.update(zip(tail[1:], tail, strict=False))
        kids.update(zip(tail, map(set, zip(tail[1:])), strict=False))
        order = self._order
        order.update(zip(reversed(tail), repeat(None)))
        if head:
            deque(map(order.move_to_end, keys[head - 1 :: -1]), maxlen=0)

    def _record_plain(self, keys: Sequence[K], new: Container[K]) -> None:
        """The plain tree's put, any keys: link each new key to the chunk before it,
        then make the prompt most recent from its last chunk to its first."""
        order = self._order
        link = self._link
        prev: K | None = None
        for key in keys:
            if prev is not None and key not in order and key in new:
                link(key, prev)
            prev = key
        order.update(zip(keys, repeat(None)))
        deque(map(order.move_to_end, reversed(keys)), maxlen=0)

    def _record_classed(self, keys: Sequence[K], new: Container[K]) -> None:
        order = self._order
        flags = [key in new for key in keys]
        adm = self.admission
        cold: list[K] = []
        depth_of = self._depth.get
        hit = 0
        while hit < len(keys) and not flags[hit]:
            hit += 1
        d_hit = depth_of(keys[hit - 1], 0) if hit > 1 else 0
        classes, depth = structural_classes(keys, flags, d_hit)
        prev: K | None = None
        for i, key in enumerate(keys):
            if flags[i]:
                if key in order:  # a resident named new: a touch, as insert says
                    self.touch(key)
                else:
                    order[key] = None
                    if prev is not None:
                        self._link(key, prev)
                    self._depth[key] = depth
                    cls = classes[i]
                    warm = adm.admit(key, cls) if adm is not None else True
                    if self.log is not None and key not in self.log and self.predictor:
                        self.log[key] = self.predictor.probability(cls)
                    if adm is not None:
                        self._cls[key] = cls
                        adm.on_insert(key)
                        if not warm:
                            cold.append(key)
            elif self._cls:  # a hit: label its class (the move comes below)
                hit_cls = self._cls.pop(key, None)
                if hit_cls is not None and adm is not None:
                    adm.on_hit(hit_cls)
            prev = key
        # most recent from the last chunk to the first: parents stay ahead of children
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)
        for key in cold:  # in prompt order to the front: the deepest is evicted first
            move(key, last=False)

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        if self._evictable(protected) < n:
            return None
        return self.evict_up_to(n, protected)

    def _evictable(self, protected: Collection[K]) -> int:
        """Keys that some sequence of evictions could take: neither protected nor an
        ancestor of a protected resident."""
        blocked: set[K] = set()
        parent = self._parent.get
        for key in protected:
            k: K | None = key if key in self._order else None
            while k is not None and k not in blocked:
                blocked.add(k)
                k = parent(k)
        return len(self._order) - len(blocked)

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        # The least recent keys, taken from a copy of the front of the LRU order, are
        # what n calls of evict(1) would take: a victim only turns its parent into a
        # leaf, and a parent is normally more recent (further on); if one already passed
        # over becomes a leaf, or the copy runs out, the scan starts again from the
        # front, as the next evict(1) would. Orphans take the one-at-a-time path.
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        kids, parent_of, drop = self._kids, self._parent.get, self._drop
        order, parents, depths = self._order, self._parent, self._depth
        plain = not self._cls and type(self)._drop is PrefixTreePolicy._drop
        size = 0
        while len(victims) < n:
            if self._orphans:
                key = self._victim(protected)
                if key is None:
                    break
                victims.append(key)
                drop(key)
                continue
            size = max(size, n - len(victims) + 16)
            batch = list(islice(self._order, size))
            passed: set[K] = set()
            took = len(victims)
            for key in batch:
                if key in protected or key in kids:
                    passed.add(key)
                    continue
                parent = parent_of(key)
                if plain:
                    # _drop(key) for a leaf of the plain tree, written out: no class,
                    # no admission, no children to orphan
                    del order[key]
                    if parent is not None:
                        del parents[key]
                        siblings = kids[parent]
                        siblings.discard(key)
                        if not siblings:
                            del kids[parent]
                    if depths:
                        depths.pop(key, None)
                else:
                    drop(key)
                victims.append(key)
                if len(victims) == n:
                    break
                if parent in passed and parent not in kids and parent not in protected:
                    break  # a key passed over is a leaf now: start again from the front
            else:
                if len(batch) < size:
                    break  # the whole order was scanned: nothing more can go
                if len(victims) == took:
                    size *= 2  # the copy held no victim: look further next time
        return victims

    def _evict_one_by_one(self, n: int, protected: Collection[K] = ()) -> list[K]:
        """``evict_up_to`` by repeated :meth:`_victim` (subclasses with another order)."""
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        while len(victims) < n:
            key = self._victim(protected)
            if key is None:
                break
            victims.append(key)
            self._drop(key)
        return victims

    def _victim(self, protected: Collection[K]) -> K | None:
        for key in self._orphans:
            if key not in protected and key not in self._kids:
                return key
        kids = self._kids
        for key in self._order:
            if key not in protected and key not in kids:
                return key
        return None

    def _drop(self, key: K) -> None:
        del self._order[key]
        cls = self._cls.pop(key, None)
        self._unlink(key)
        if cls is not None and self.admission is not None:
            self.admission.on_evict(key, cls, len(self._order))

    @property
    def members(self) -> Collection[object]:
        return self._order

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class PrefixTreeAdmitPolicy(PrefixTreePolicy[K]):
    """``prefixtree`` with the reuse predictor's admission."""

    name = "prefixtree-admit"

    def __init__(self, threshold: float = 0.1) -> None:
        super().__init__(PredictorAdmission(ReusePredictor(threshold)))


class PrefixTreeDoorPolicy(PrefixTreePolicy[K]):
    """``prefixtree`` with TinyLFU's doorkeeper admission."""

    name = "prefixtree-door"

    def __init__(self) -> None:
        super().__init__(Doorkeeper())


register_policy("prefixtree", PrefixTreePolicy)
register_policy("prefixtree-admit", PrefixTreeAdmitPolicy)
register_policy("prefixtree-door", PrefixTreeDoorPolicy)
