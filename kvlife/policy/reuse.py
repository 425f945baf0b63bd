"""Structural classes of KV blocks and an online reuse predictor over them.

A policy that sees a put's chunks in prompt order (:meth:`EvictionPolicy.record_in_order`)
knows, for each new block: its position (the last block of a prompt is usually a partial
block that the next turn replaces), whether the put continued a conversation (a hit
prefix longer than the shared system block), how many blocks the turn added and how deep
the conversation is (turns so far along the chain). On the Mooncake conversation trace
these separate reuse from no reuse (share of new blocks touched again, docs/replay.md):
last block 1%, first turns 26-41% (shorter prompts more), continuations adding < 4
blocks 49-67%, adding >= 8 blocks 8-11%, deeper turns more.

:class:`ReusePredictor` learns each class's reuse probability online, with no clock and
no capacity: a block is labelled *reused* when it is touched after its insert (while
resident), or inserted again while remembered in a ghost list of recently evicted blocks
(as long as twice the resident count); *not reused* when it leaves the ghost list
untouched. ``predict`` says "will be reused" when the class's estimate is at least the
threshold; its precision and recall against the trace's future are reported by
:func:`kvlife.replay.predictor.predictor_accuracy`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import compress, count, repeat
from operator import gt

from kvlife.core.errors import InvalidArgument

LAST = 0
"""The last block of a put's prompt."""
FIRST_TURN = 1
"""Classes 1-3: a put whose hit prefix is at most one block, by prompt length (<8, <32, more)."""
CONTINUATION = 4
"""Classes 4-12: a put continuing a hit prefix, by blocks added (<4, <8, more) x turn (1, 2, 3+)."""
REUSED = 13
"""A block touched at least once after its insert (classes 0-12 move here on a hit)."""
UNKNOWN = 14
"""A block inserted without its prompt (a bare ``insert``: structure unknown)."""
N_CLASSES = 15
CLASS_NAMES = (
    "last",
    *(f"first/len{b}" for b in ("<8", "<32", ">=32")),
    *(f"cont/add{a}/turn{t}" for a in ("<4", "<8", ">=8") for t in ("1", "2", "3+")),
    "reused",
    "unknown",
)


def structural_classes(
    keys: Sequence[Hashable], new_flags: Sequence[bool], depth_of_hit: int
) -> tuple[list[int], int]:
    """The class of each new key of a put (``new_flags[i]``: keys[i] is new) and the turn
    depth its new keys get. ``depth_of_hit`` is the depth of the last key of the hit prefix
    (0 when the prefix is at most one block)."""
    n = len(keys)
    hit = 0
    while hit < n and not new_flags[hit]:
        hit += 1
    base, depth = put_class(n, hit, sum(new_flags), depth_of_hit)
    classes = [base] * n
    if n:  # a put of no keys (an empty request) has no last block
        classes[n - 1] = LAST
    return classes, depth


def put_class(n: int, hit: int, added: int, depth_of_hit: int) -> tuple[int, int]:
    """The class of every new key of a put but its last block (:data:`LAST`), and the
    turn depth they get: ``n`` keys, the first ``hit`` of them resident (the hit prefix),
    ``added`` of them new (:func:`structural_classes`, computed once per put)."""
    if hit <= 1:
        return FIRST_TURN + (0 if n < 8 else 1 if n < 32 else 2), 0
    depth = depth_of_hit + 1
    a = 0 if added < 4 else 1 if added < 8 else 2
    return CONTINUATION + 3 * a + min(depth, 3) - 1, depth


class ReusePredictor:
    """Per-class reuse probability, learned online (see the module docstring)."""

    compact_at = 4096
    """The ghost list's FIFO drops its trimmed entries once they are more than this
    and more than half of it, and its stale ones once it holds more than this beyond
    twice the keys remembered."""

    def __init__(self, threshold: float = 0.1, ghost_factor: float = 2.0) -> None:
        self.threshold = threshold
        self.ghost_factor = ghost_factor
        self.reused = [1.0] * N_CLASSES  # a weak prior of 1 in 2
        self.unused = [1.0] * N_CLASSES
        self._ghost: dict[Hashable, int] = {}
        """The ghost list's classes: remembered key -> its class. A policy may share
        this dict, its residents' classes beside the remembered keys
        (:meth:`share_ghost`): a key not resident in it is remembered."""
        self._remembered = 0
        """How many keys the ghost list remembers."""
        self._keys: list[Hashable] = []
        """The keys remembered, oldest first, from :attr:`_head` on (the entries before
        it are trimmed), with *stale* entries of keys that left by an insert
        (:attr:`_stale`), skipped by the trim."""
        self._head = 0
        self._stale: dict[Hashable, int] = {}
        """Key -> how many of its entries in :attr:`_keys` are stale: they all come
        before its live one (a key is remembered again only after it left)."""
        self._p = [0.5] * N_CLASSES

    def admit_inserts(self, keys: Sequence[Hashable], cls: int, last_cls: int) -> list[bool] | None:
        """:meth:`predict` then :meth:`on_insert` for each of ``keys`` in turn (a put's
        new keys: each of class ``cls``, the last of ``last_cls``): whether each is
        predicted reused. None, and nothing changed, when the ghost list remembers none
        of them: then no insert changes an estimate, and the caller decides all but the
        last by ``predict(cls)``. Otherwise only a remembered key's insert changes an
        estimate, so the keys between two remembered ones share one decision."""
        ghost = self._ghost
        if not ghost or ghost.keys().isdisjoint(keys):
            return None
        if type(self) is not ReusePredictor:  # a subclass: its own methods, called
            return self._admit_inserts_calls(keys, cls, last_cls)
        # predict() and on_insert() written out (a few keys of one put each time)
        p, threshold, reused, unused = self._p, self.threshold, self.reused, self.unused
        stale = self._stale
        last = len(keys) - 1
        warm: list[bool] = []
        start = 0
        for j in compress(count(), map(ghost.__contains__, keys)):
            # keys start..j are decided now (j before its own insert)
            if j < last:
                warm += repeat(p[cls] >= threshold, j + 1 - start)
            else:
                warm += repeat(p[cls] >= threshold, last - start)
                warm.append(p[last_cls] >= threshold)
            key = keys[j]
            old = ghost.pop(key)  # its insert: its class was reused
            stale[key] = stale.get(key, 0) + 1
            self._remembered -= 1
            r = reused[old] + 1.0
            reused[old] = r
            p[old] = r / (r + unused[old])
            start = j + 1
        if start <= last:
            warm += repeat(p[cls] >= threshold, last - start)
            warm.append(p[last_cls] >= threshold)
        if len(self._keys) - self._head > 2 * self._remembered + self.compact_at:
            self._compact()
        return warm

    def _admit_inserts_calls(self, keys: Sequence[Hashable], cls: int, last_cls: int) -> list[bool]:
        """:meth:`admit_inserts` by calls of :meth:`predict` and :meth:`on_insert`."""
        ghost, predict, insert = self._ghost, self.predict, self.on_insert
        last = len(keys) - 1
        warm: list[bool] = []
        start = 0
        for j in compress(count(), map(ghost.__contains__, keys)):
            if j < last:
                warm += repeat(predict(cls), j + 1 - start)
            else:
                warm += repeat(predict(cls), last - start)
                warm.append(predict(last_cls))
            insert(keys[j])
            start = j + 1
        if start <= last:
            warm += repeat(predict(cls), last - start)
            warm.append(predict(last_cls))
        return warm

    def probability(self, cls: int) -> float:
        """The class's estimated reuse probability."""
        return self._p[cls]

    def predict(self, cls: int) -> bool:
        """Will a new block of this class be reused?"""
        return self._p[cls] >= self.threshold

    def _update(self, cls: int) -> None:
        r = self.reused[cls]
        self._p[cls] = r / (r + self.unused[cls])

    def on_hit(self, cls: int) -> None:
        """A resident block of class ``cls`` was touched for the first time since insert."""
        if cls < REUSED:
            self.reused[cls] += 1.0
            self._update(cls)

    def share_ghost(self, classes: dict[Hashable, int]) -> None:
        """Keep the ghost list's classes in ``classes``, a policy's own map of its
        residents' classes (before anything is remembered): an untouched victim's class
        then stays where it is (:meth:`on_evicts_kept`), so a victim costs no dict
        write; the policy must keep only classes below :data:`REUSED` there, and call
        :meth:`on_insert` for a key before it writes the key's new class."""
        if self._remembered or self._keys:
            raise InvalidArgument("the ghost list is shared only before it remembers")
        self._ghost = classes

    def on_insert(self, key: Hashable) -> None:
        """A block is inserted: if the ghost list remembers it, its class was reused."""
        cls = self._ghost.pop(key, None)
        if cls is not None:
            self._remembered -= 1
            stale = self._stale
            stale[key] = stale.get(key, 0) + 1  # its entry, skipped by the trim
            self.reused[cls] += 1.0
            self._update(cls)
            if len(self._keys) - self._head > 2 * self._remembered + self.compact_at:
                self._compact()  # stale entries pile up where the trim does not run

    def _compact(self) -> None:
        """Keep only the live entries of the FIFO (the trimmed and stale ones go)."""
        stale = self._stale
        live = []
        for key in self._keys[self._head :]:
            n = stale.get(key)
            if n is None:
                live.append(key)
            elif n == 1:
                del stale[key]
            else:
                stale[key] = n - 1
        self._keys, self._head = live, 0

    def on_evict(self, key: Hashable, cls: int, resident: int) -> None:
        """A block left untouched since insert (class ``cls``); ``resident`` keys remain."""
        if cls >= REUSED:
            return
        ghost = self._ghost
        if key not in ghost:  # (remembered already: its place stays, as a dict's would)
            self._keys.append(key)
            self._remembered += 1
        ghost[key] = cls
        limit = max(16, int(self.ghost_factor * resident))
        if self._remembered > limit:
            self._trim(limit)

    def on_evicts_kept(self, keys: Sequence[Hashable], after: int, resident: int) -> None:
        """:meth:`on_evicts` for a policy that shares the ghost list's classes
        (:meth:`share_ghost`): ``keys`` are its untouched victims in order, their
        classes left where they are, ``after`` the victims after the last of them,
        ``resident`` the keys that remain after the last victim."""
        self._keys += keys
        self._remembered += len(keys)
        limit = max(16, int(self.ghost_factor * (resident + after)))
        if self._remembered > limit:
            self._trim(limit)

    def _trim(self, limit: int) -> None:
        """Forget the oldest remembered keys down to ``limit``; each one forgotten counts
        its class not reused (sums: one update per class)."""
        need = self._remembered - limit
        if need <= 0:
            return
        self._remembered = limit
        keys, stale = self._keys, self._stale
        head = self._head
        oldest: list[Hashable] = []
        while need > 0:
            window = keys[head : head + need]
            if not window:  # (cannot happen: as many live entries as remembered keys)
                break
            head += len(window)
            if stale and not stale.keys().isdisjoint(window):
                # skip the stale entries (each key's come before its live one)
                live = [True] * len(window)
                for i in compress(count(), map(stale.__contains__, window)):
                    key = window[i]
                    n = stale.get(key)
                    if n is None:  # its stale entries were passed: this one is live
                        continue
                    live[i] = False
                    if n == 1:
                        del stale[key]
                    else:
                        stale[key] = n - 1
                window = list(compress(window, live))
            oldest += window
            need -= len(window)
        gone = list(map(self._ghost.pop, oldest))
        if head > self.compact_at and 2 * head > len(keys):  # the trimmed part goes
            del keys[:head]
            head = 0
        self._head = head
        unused, update = self.unused, self._update
        for cls in set(gone):  # a few distinct classes: a count each, no Counter
            unused[cls] += gone.count(cls)
            update(cls)

    def ghost_items(self) -> list[tuple[Hashable, int]]:
        """The ghost list, oldest first: (key, class) of each remembered key."""
        ghost, stale = self._ghost, dict(self._stale)
        items = []
        for key in self._keys[self._head :]:
            n = stale.get(key)
            if n:
                stale[key] = n - 1
            else:
                items.append((key, ghost[key]))
        return items

    def on_hits(self, classes: Iterable[int]) -> None:
        """:meth:`on_hit` for each of ``classes`` (a lookup's first touches): the counts
        are sums, so one update per class gives the same estimates."""
        got = classes if isinstance(classes, list) else list(classes)
        reused, update = self.reused, self._update
        for cls in set(got):  # a few distinct classes: a count each, no Counter
            if cls < REUSED:
                reused[cls] += got.count(cls)
                update(cls)

    def on_evicts(self, keys: Sequence[Hashable], classes: Sequence[int], resident: int) -> None:
        """:meth:`on_evict` for each of ``keys`` in turn (an eviction's victims, in
        order), ``classes`` theirs, ``resident`` the keys that remain after the last: the
        same ghost list and estimates as the calls one by one. The victims' entries go
        to the ghost list in order and are trimmed once, to the limit of the last call
        that trims (the last of class < :data:`REUSED`): a limit only falls from one
        victim to the next (one resident fewer each), so no earlier call's trim takes
        an entry that this one keeps; the unused counts are sums, updated once per
        class."""
        if len(keys) != len(classes):
            raise InvalidArgument(f"{len(keys)} victims with {len(classes)} classes")
        if not classes:
            return
        if max(classes) < REUSED:  # the usual batch: every victim untouched
            added, labels, after = list(keys), list(classes), 0
        else:
            mask = list(map(gt, repeat(REUSED), classes))
            if True not in mask:
                return
            added = list(compress(keys, mask))
            labels = list(compress(classes, mask))
            after = mask[::-1].index(True)  # victims after the last that trims
        ghost = self._ghost
        if ghost.keys().isdisjoint(added):  # the usual batch: each key new to the list
            size = len(ghost)
            for key, cls in zip(added, labels, strict=True):  # plain: faster than update()
                ghost[key] = cls
            n = len(ghost) - size
            # in order (a key named twice: its first place)
            self._keys += added if n == len(added) else dict.fromkeys(added)
            self._remembered += n
        else:
            order = self._keys
            for key, cls in zip(added, labels, strict=True):
                if key not in ghost:
                    order.append(key)
                    self._remembered += 1
                ghost[key] = cls
        limit = max(16, int(self.ghost_factor * (resident + after)))
        if self._remembered > limit:
            self._trim(limit)

    def estimates(self) -> dict[str, float]:
        """Each class's estimated reuse probability, by name."""
        return {name: round(self._p[c], 4) for c, name in enumerate(CLASS_NAMES)}
