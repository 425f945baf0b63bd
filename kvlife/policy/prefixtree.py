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
from the last to the first, so a parent is normally more recent than its children and the
least recent key is a leaf.

**Speed** (the replay runs millions of keys through this): each resident's parent is its
value in the LRU order, so one table holds both and a victim's removal gives its parent.
While the order is *tidy* (every resident's parent later in it than the resident: what
puts and lookups of whole prefixes keep) and no key is an orphan, ``n`` calls of
``evict(1)`` take the first ``n`` keys that are neither protected nor an ancestor of a
protected resident, so victims are found and dropped in C loops with no children maps at
all. A move that may break tidiness (a single touch of a non-root, a put of any other
shape, a cold key before its warm child) makes it unknown until an O(n) check in C
loops finds it again (backing off while it does not); meanwhile, and for removals,
orphans and subclasses, the children maps are made from the parents and kept (one dict
entry per chain link, a set only at a branch), and victims go as a checked batch or one
by one. The admission's per-put work is done once per put (every new key but the last
has one class) and the predictor learns from sums; its ghost list keeps its classes in
this policy's class map (:meth:`~kvlife.policy.reuse.ReusePredictor.share_ghost`: an
untouched victim's class stays where it is). Every fast path leaves the state of the
one-key-at-a-time paths (``tests/policy/test_tree_fast_paths.py``).

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
from collections.abc import Callable, Collection, Container, Hashable, Iterable, Sequence
from functools import partial
from itertools import compress, count, filterfalse, islice, pairwise, repeat
from operator import gt, is_not, le, not_
from typing import TypeVar, cast

from kvlife.core.errors import InvalidArgument
from kvlife.policy.admission import Admission, Doorkeeper, PredictorAdmission
from kvlife.policy.base import EvictionPolicy, LearnsFromPrompts, register_policy
from kvlife.policy.reuse import (
    FIRST_TURN,
    LAST,
    UNKNOWN,
    ReusePredictor,
    put_class,
    structural_classes,
)

K = TypeVar("K", bound=Hashable)

_is_class = partial(is_not, None)
"""A popped class, not a miss (class 0 is falsy)."""
_after = cast("Callable[[int, int], bool]", gt)
"""A place after another (``operator.gt``, typed for the C loops)."""


class PrefixTreePolicy(EvictionPolicy[K], LearnsFromPrompts):
    """LRU among the leaves of the learned prefix tree (see the module docstring)."""

    name = "prefixtree"

    def __init__(self, admission: Admission | None = None) -> None:
        self._order: OrderedDict[K, K | None] = OrderedDict()
        """Resident keys, least recent first -> each one's resident parent (None: a root
        or an orphan): one table, so a victim's removal gives its parent."""
        self._kids: dict[K, K] = {}
        """Resident key -> one of its resident children (keys with none are absent): a
        put's chain is one entry per key, made in a C loop, not a set per key. Kept
        only while :attr:`_tree` is set (see :meth:`_ensure_tree`)."""
        self._more: dict[K, set[K]] = {}
        """Resident key -> all its resident children, for a key that has had two at once
        (a branch), kept until it has none (while :attr:`_tree` is set)."""
        self._orphans: OrderedDict[K, None] = OrderedDict()
        """Residents whose parent was removed: the next victims."""
        self.admission = admission
        self._cls: dict[K, int] = {}
        """Class of each resident not touched since insert (for the admission's labels)."""
        self._depth: dict[K, int] = {}
        """Conversation turn of each resident inserted by a put (structure only), kept
        only where it is not 0 (a first turn's keys, most of them: 0 by default)."""
        self.predictor: ReusePredictor | None = (
            admission.predictor if isinstance(admission, PredictorAdmission) else None
        )
        self._batched = type(admission) is PredictorAdmission or admission is None
        """The admission's calls can be made per batch (the predictor's sums, or none)."""
        pred = self.predictor
        self._admits_by_sums = pred is not None and self._batched
        """The reuse predictor's admission, told per batch: :meth:`_admit_tail` decides a
        usual put's new keys as :meth:`_record_classed` would (unless logging)."""
        self._shared = (
            self._batched
            and type(pred) is ReusePredictor
            and not pred._remembered
            and not pred._keys
        )
        """The predictor's ghost list keeps its classes in :attr:`_cls` (an untouched
        victim's class stays there: :meth:`ReusePredictor.share_ghost`), so only
        classes below ``REUSED`` are kept there (a bare insert's ``UNKNOWN`` is no
        entry, which tells the predictor the same) and a resident's entry is the class
        of a key not touched since insert, any other key's a remembered key's."""
        if self._shared:
            assert pred is not None
            pred.share_ghost(cast("dict[Hashable, int]", self._cls))
        self._batch_evict = self._batched and type(self)._drop is PrefixTreePolicy._drop
        """Victims may be taken and dropped as a batch (:meth:`_evict_batch`)."""
        self._tree = not self._batch_evict
        """The children maps are kept. Without them (the usual replay) the order is
        tidy and a victim is found without them (:meth:`_evict_tidy`); they are made
        from the parents when a path needs them (:meth:`_ensure_tree`)."""
        self._tidy = self._batch_evict
        """Known: every resident's parent is later in the order than it (so the least
        recent keys are leaves); unknown after a move that may break it, until
        :meth:`_order_is_tidy` finds it again. Never known where no batch is taken
        (nothing would use it)."""
        self._sticky = False
        """The children maps hold a link the parents do not (a put naming a key twice
        linked it to two parents): they are kept for good."""
        self._recheck = 0
        self._backoff = 1
        self.log: dict[K, float] | None = None
        """When set (and a predictor decides), each new key's reuse probability at its
        first insert (for :func:`kvlife.replay.predictor.predictor_accuracy`)."""

    # ------------------------------------------------------------------ structure

    def _ensure_tree(self) -> None:
        """Make the children maps from the parents (in LRU order), to keep from now on."""
        if self._tree:
            return
        adopt = self._adopt
        for key, parent in self._order.items():
            if parent is not None:
                adopt(parent, key)
        self._tree = True

    def _order_is_tidy(self) -> bool:
        """Whether every resident's parent is later in the order than it (C loops)."""
        order = self._order
        at: dict[object, int] = dict(zip(order, count()))  # a root's parent: after all
        return all(map(_after, map(at.get, order.values(), repeat(len(order))), count()))

    def _chain_moved(self, moved: Sequence[K]) -> None:
        """``moved`` were made most recent in turn: the order stays tidy if each one's
        parent is the next (the last a root), as a prompt's keys from last to first."""
        if self._tidy and moved:
            parents = list(map(self._order.get, moved))
            if parents[-1] is not None or parents[:-1] != moved[1:]:
                self._tidy = False

    def _adopt(self, parent: K, key: K) -> None:
        """``key`` is a resident child of ``parent`` (its children's side)."""
        kids = self._kids
        if parent not in kids:
            kids[parent] = key
            return
        more = self._more.get(parent)
        if more is None:  # a second child: the branch's set, as {first} then add
            more = {kids[parent]}
            self._more[parent] = more
        more.add(key)

    def _unkid(self, parent: K, key: K) -> None:
        """``key`` is no longer a resident child of ``parent``."""
        more = self._more.get(parent)
        if more is None:  # its only child
            del self._kids[parent]
            return
        more.discard(key)
        if not more:
            del self._more[parent]
            del self._kids[parent]
        elif self._kids[parent] == key:
            self._kids[parent] = next(iter(more))

    def _unlink(self, key: K, parent: K | None) -> None:
        """``key`` left the order (its parent was ``parent``): detach it from its parent,
        orphan its children (kept per parent, so removing an inner block costs its
        children, not a scan of the cache)."""
        kids = self._kids
        if parent is not None:
            self._unkid(parent, key)
        if key in kids:
            children: Collection[K] | None = self._more.pop(key, None)
            only = kids.pop(key)
            order = self._order
            for child in (only,) if children is None else children:
                order[child] = None  # no parent now (its place in the order stays)
                self._orphans[child] = None
        if self._orphans:
            self._orphans.pop(key, None)
        if self._depth:
            self._depth.pop(key, None)

    def parent_of(self, key: K) -> K | None:
        """The resident parent of a resident key (None: a root or an orphan)."""
        return self._order.get(key)

    def children_of(self, key: K) -> set[K]:
        """The resident children of a resident key."""
        self._ensure_tree()
        more = self._more.get(key)
        if more is not None:
            return set(more)
        return {self._kids[key]} if key in self._kids else set()

    # ------------------------------------------------------------------ EvictionPolicy

    def insert(self, key: K) -> None:
        if key in self._order:
            self.touch(key)
            return
        self._order[key] = None
        if self.admission is not None:
            self.admission.on_insert(key)  # first: a shared ghost list holds classes
            if not self._shared:
                self._cls[key] = UNKNOWN

    def touch(self, key: K) -> None:
        if key in self._order:
            if self._order[key] is not None:
                self._tidy = False  # now after its parent
            self._order.move_to_end(key)
            if self._cls:
                cls = self._cls.pop(key, None)
                if cls is not None and self.admission is not None:
                    self.admission.on_hit(cls)

    def touch_all(self, keys: Iterable[K]) -> None:
        # touch one by one, its moves in a C loop, then the first touches' labels (the
        # admission's hits are sums, independent of the moves)
        order = self._order
        held = list(filter(order.__contains__, keys))
        deque(map(order.move_to_end, held), maxlen=0)
        self._chain_moved(held)
        if self._cls and not self._cls.keys().isdisjoint(held):
            self._label_hits(held)

    def _label_hits(self, keys: Iterable[K]) -> None:
        """The first touches since insert among ``keys`` (residents), to the admission."""
        got = cast("list[int]", list(filter(_is_class, map(self._cls.pop, keys, repeat(None)))))
        if not got or self.admission is None:
            return
        if self.predictor is not None and self._batched:
            self.predictor.on_hits(got)
        else:
            deque(map(self.admission.on_hit, got), maxlen=0)

    def remove(self, key: K) -> None:
        if key in self._order:
            self._ensure_tree()  # its children become orphans
            parent = self._order.pop(key)
            self._cls.pop(key, None)
            self._unlink(key, parent)

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        head = len(keys) - len(new)
        held = self._order.__contains__
        if (
            head >= 0
            and not any(map(new.__contains__, islice(keys, head)))
            and all(map(held, islice(keys, head)))
            and not any(map(held, islice(keys, head, None)))
        ):
            # the usual put: residents first, then its new keys (the last len(new) keys,
            # each a non-resident once)
            self._put_tail(keys, head)
        elif self.admission is None and self.log is None:
            self._record_plain(keys, new)
        else:
            self._record_classed(keys, new)

    def record_tail(self, keys: Sequence[K], head: int) -> None:
        # the usual put (residents keys[:head], then new keys), known from the lookup
        self._put_tail(keys, head)

    def _put_tail(self, keys: Sequence[K], head: int) -> None:
        """``record_in_order``'s usual put, its links and moves made in C loops: each new
        key's parent is the key before it; each new key but the last gets the next one
        as its only child; the first new key is a child of the last resident, which may
        have others. With an admission, the classes and decisions of
        :meth:`_record_classed`, computed once per put (:meth:`_admit_tail`)."""
        tail = keys[head:]
        moved = keys[head - 1 :: -1] if head else []
        self._chain_moved(moved)  # the residents' moves below (new keys keep it tidy)
        classed = self.admission is not None or self.log is not None
        if classed and not (tail and self.log is None and self._admits_by_sums):
            # not the reuse predictor's admission, or logging: key by key
            self._record_classed(keys, set(tail), usual=True)
            return
        cls_of = self._cls
        if head and cls_of and not cls_of.keys().isdisjoint(moved):
            self._label_hits(islice(keys, head))  # first touches (usually the lookup's)
        order = self._order
        if tail:
            # from the last new key to the first, each with the key before it as parent
            # a plain loop: an OrderedDict's update() is slower than item assignment
            parents = keys[head - 1 : -1] if head else [None, *tail[:-1]]
            for key, parent in zip(reversed(tail), reversed(parents), strict=True):
                order[key] = parent
            if self._tree:
                if head:
                    self._adopt(keys[head - 1], tail[0])
                self._kids.update(pairwise(tail))
        if moved:
            deque(map(order.move_to_end, moved), maxlen=0)
        if classed:
            self._admit_tail(keys, head, tail)

    def _admit_tail(self, keys: Sequence[K], head: int, tail: Sequence[K]) -> None:
        """The classes, turn depth and admission of a usual put's new keys ``tail``, as
        :meth:`_record_classed` gives them: every new key but the last has one class, so
        one decision, unless the ghost list remembers some of them (each one's insert
        changes its old class's estimate before the next key is decided:
        :meth:`~kvlife.policy.reuse.ReusePredictor.admit_inserts`)."""
        pred = self.predictor
        assert pred is not None  # _admits_by_sums
        n, added = len(keys), len(tail)
        if head <= 1:  # put_class, written out: a first turn, by prompt length
            base = FIRST_TURN + (0 if n < 8 else 1 if n < 32 else 2)
            depth = 0
        else:
            base, depth = put_class(n, head, added, self._depth.get(keys[head - 1], 0))
        ghost = pred._ghost
        if type(pred) is ReusePredictor and (not ghost or ghost.keys().isdisjoint(tail)):
            warm = None  # no key remembered (admit_inserts' None, written out)
        else:  # before the classes below: a shared ghost list holds them
            warm = pred.admit_inserts(tail, base, LAST)
            if warm is None:  # (a subclass's predictor: its own predictions)
                warm = [pred.predict(base)] * (added - 1) + [pred.predict(LAST)]
        cls_of = self._cls
        if depth:
            depths = self._depth
            for key in tail:  # a plain loop: faster than update(zip(...)) here
                depths[key] = depth
                cls_of[key] = base
        else:
            for key in tail:
                cls_of[key] = base
        last = tail[-1]
        cls_of[last] = LAST
        if warm is None:
            # one decision for all but the last (predict() written out); cold keys to
            # the front in prompt order (the deepest is evicted first)
            warm_last = pred._p[LAST] >= pred.threshold
            if pred._p[base] >= pred.threshold:
                if not warm_last:
                    self._order.move_to_end(last, False)
            else:
                cold = tail[:-1] if warm_last else tail
                if warm_last and cold:  # the last new key's parent goes to the front
                    self._tidy = False
                deque(map(self._order.move_to_end, cold, repeat(False)), maxlen=0)
            return
        if any(map(gt, warm[1:], warm)):  # a warm key after its cold parent
            self._tidy = False
        cold = list(compress(tail, map(not_, warm)))
        if cold:
            deque(map(self._order.move_to_end, cold, repeat(False)), maxlen=0)

    def _record_plain(self, keys: Sequence[K], new: Container[K]) -> None:
        """The plain tree's put, any keys: link each new key to the chunk before it,
        then make the prompt most recent from its last chunk to its first."""
        order = self._order
        self._tidy = False  # any keys in any order: found again by _order_is_tidy
        links: list[tuple[K, K]] = []
        prev: K | None = None
        for key in keys:
            if prev is not None and key not in order and key in new:
                links.append((key, prev))
            prev = key
        if len(dict(links)) < len(links):
            # a key named twice, linked to the keys before both its places (its
            # children's side keeps both, the parent the last): keep the maps for good
            self._ensure_tree()
            self._sticky = True
        if self._tree:
            for key, prev in links:
                self._adopt(prev, key)
        # the new keys in prompt order, then their parents (a key named twice is linked
        # to the key before its last place)
        order.update(zip(filterfalse(order.__contains__, keys), repeat(None)))
        order.update(links)
        deque(map(order.move_to_end, reversed(keys)), maxlen=0)

    def _record_classed(self, keys: Sequence[K], new: Container[K], usual: bool = False) -> None:
        """The put one key at a time, with classes and admission. ``usual``: the usual
        put (residents first, their moves checked by the caller)."""
        order = self._order
        if not usual:
            self._tidy = False  # found again by _order_is_tidy
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
                    order[key] = prev
                    if prev is not None and self._tree:
                        self._adopt(prev, key)
                    if depth:
                        self._depth[key] = depth
                    cls = classes[i]
                    warm = adm.admit(key, cls) if adm is not None else True
                    if self.log is not None and key not in self.log and self.predictor:
                        self.log[key] = self.predictor.probability(cls)
                    if adm is not None:
                        adm.on_insert(key)  # first: a shared ghost list holds classes
                        self._cls[key] = cls
                        if not warm:
                            cold.append(key)
            elif self._cls and key in order:  # a hit: label its class (moved below)
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
        if cold and usual and self._tidy:
            # a cold key before a warm child (the next new key) is before its child
            gone = set(cold)
            if any(order.get(key) in gone and key not in gone for key in keys):
                self._tidy = False

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
        parent = self._order.get
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
        if not n:
            return []
        if self._batch_evict and not self._orphans and not self._sticky:
            if not self._tidy:
                self._recover()
            if self._tidy:
                if self._tree:  # tidy again: the children maps are not needed
                    self._kids.clear()
                    self._more.clear()
                    self._tree = False
                return self._evict_tidy(n, protected)
        self._ensure_tree()
        if self._batch_evict and not self._orphans:
            taken = self._evict_batch(n, protected)
            if taken is not None:
                return taken
        victims: list[K] = []
        kids, drop = self._kids, self._drop
        order, depths = self._order, self._depth
        plain = not self._cls and type(self)._drop is PrefixTreePolicy._drop
        unkid = self._unkid
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
                if plain:
                    # _drop(key) for a leaf of the plain tree, written out: no class,
                    # no admission, no children to orphan
                    parent = order.pop(key)
                    if parent is not None:
                        unkid(parent, key)
                    if depths:
                        depths.pop(key, None)
                else:
                    parent = order[key]
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

    def _recover(self) -> None:
        """Look for a tidy order again, less often while it is not (an O(n) check)."""
        if self._recheck:
            self._recheck -= 1
        elif self._order_is_tidy():
            self._tidy, self._backoff = True, 1
        else:
            self._backoff = min(2 * self._backoff, 1024)
            self._recheck = self._backoff

    def _evict_tidy(self, n: int, protected: Collection[K]) -> list[K]:
        """``evict_up_to`` in a tidy order without orphans (every resident's parent is
        later than it, and resident): the first ``n`` keys that are neither protected
        nor an ancestor of a protected resident, as ``n`` calls of evict(1) take them.

        Each such key is a leaf in its turn: its children are earlier in the order, so
        each was taken before it (one that is protected or an ancestor of a protected
        key would make this key an ancestor too); every key it passes over is
        protected, or an ancestor of one, a parent for the whole call."""
        order = self._order
        victims = list(islice(order, n))
        if any(map(protected.__contains__, victims)):
            blocked: set[K] = set()
            parent = order.get
            for key in protected:
                k: K | None = key if key in order else None
                while k is not None and k not in blocked:
                    blocked.add(k)
                    k = parent(k)
            victims = list(islice(filterfalse(blocked.__contains__, order), n))
        for key in victims:  # faster than map() over the OrderedDict's method wrapper
            del order[key]
        if self._depth:
            deque(map(self._depth.pop, victims, repeat(None)), maxlen=0)
        if self._cls:
            self._evicted(victims)
        return victims

    def _evict_batch(self, n: int, protected: Collection[K]) -> list[K] | None:
        """``evict_up_to`` in C loops, when the first ``n`` unprotected keys of the LRU
        order are what ``n`` calls of evict(1) take, else None (nothing changed).

        They are when each one's resident children are victims before it: then each
        is, in its turn, a leaf with only protected keys or earlier victims before it,
        the least recent leaf not protected (no orphans: the caller checks). That is
        the usual order (a parent is more recent than its children: a put's chain
        goes from the last to the first); checked per victim by a child's place among
        the victims, and every child of a branch's set."""
        order = self._order
        victims = list(islice(filterfalse(protected.__contains__, order), n))
        m = len(victims)
        if not m:
            return victims
        kids, more = self._kids, self._more
        at = dict(zip(victims, range(m), strict=True))
        # a victim without children names itself (its own place); one with a child
        # needs the child's place before its own
        if not all(map(le, map(at.get, map(kids.get, victims, victims), repeat(m)), count())):
            return None
        branched = at.keys() & more.keys() if more else ()
        for key in branched:
            j = at[key]
            if any(at.get(kid, m) >= j for kid in more[key]):
                return None
        # drop them: each one's children went before it, so only the parents that stay
        # lose a child
        parents = list(map(order.pop, victims))
        deque(map(kids.pop, victims, repeat(None)), maxlen=0)
        for key in branched:
            del more[key]
        unkid = self._unkid
        stay = map(not_, map(at.__contains__, parents))
        for key, parent in compress(zip(victims, parents, strict=True), stay):
            if parent is not None:
                unkid(parent, key)
        if self._depth:
            deque(map(self._depth.pop, victims, repeat(None)), maxlen=0)
        if self._cls:
            self._evicted(victims)
        return victims

    def _evicted(self, victims: list[K]) -> None:
        """Tell the predictor (``_batch_evict``: the predictor's sums, or none) of a
        batch of victims, dropped from the order."""
        pred = self.predictor
        assert pred is not None
        cls_of = self._cls
        if not self._shared:
            classes = list(map(cls_of.pop, victims, repeat(UNKNOWN)))
            pred.on_evicts(victims, classes, len(self._order))
            return
        # the untouched victims' classes stay, as the ghost list's (a C loop finds them)
        kept = list(filter(cls_of.__contains__, victims))
        if kept:
            last = kept[-1]
            after = 0 if last == victims[-1] else len(victims) - 1 - victims.index(last)
            pred.on_evicts_kept(kept, after, len(self._order))

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
        parent = self._order.pop(key)
        cls = self._cls.pop(key, None)
        self._unlink(key, parent)
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
