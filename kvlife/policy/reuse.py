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
    and more than half of it."""

    def __init__(self, threshold: float = 0.1, ghost_factor: float = 2.0) -> None:
        self.threshold = threshold
        self.ghost_factor = ghost_factor
        self.reused = [1.0] * N_CLASSES  # a weak prior of 1 in 2
        self.unused = [1.0] * N_CLASSES
        self._ghost: dict[Hashable, int] = {}
        """The ghost list: each remembered key -> its place in :attr:`_keys` (counted
        from the first key ever remembered); :meth:`ghost_items`."""
        self._keys: list[Hashable] = []
        """The keys remembered, in the order they came, from :attr:`_head` on (the
        entries before it are trimmed); :attr:`_classes` holds each one's class."""
        self._classes: list[int] = []
        """The class of each entry of :attr:`_keys`: :data:`UNKNOWN` for a key that
        left the list by an insert (the trim skips it)."""
        self._head = 0
        self._base = 0
        """The place of ``_keys[0]`` (the entries before it were compacted away)."""
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
        predict, insert = self.predict, self.on_insert
        last = len(keys) - 1
        warm: list[bool] = []
        start = 0
        for j in compress(count(), map(ghost.__contains__, keys)):
            # keys start..j are decided now (j before its own insert)
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

    def on_insert(self, key: Hashable) -> None:
        """A block is inserted: if the ghost list remembers it, its class was reused."""
        at = self._ghost.pop(key, None)
        if at is not None:
            at -= self._base
            classes = self._classes
            cls = classes[at]
            classes[at] = UNKNOWN  # left: skipped by the trim
            self.reused[cls] += 1.0
            self._update(cls)

    def on_evict(self, key: Hashable, cls: int, resident: int) -> None:
        """A block left untouched since insert (class ``cls``); ``resident`` keys remain."""
        if cls >= REUSED:
            return
        self._remember([key], [cls])
        limit = max(16, int(self.ghost_factor * resident))
        if len(self._ghost) > limit:
            self._trim(limit)

    def _remember(self, keys: list[Hashable], classes: list[int]) -> None:
        """Add ``keys`` (of ``classes``, each < :data:`REUSED`) to the ghost list in
        turn, one by one: a key remembered already keeps its place and takes the new
        class, as an ordered dict's would."""
        ghost, order, labels = self._ghost, self._keys, self._classes
        for key, cls in zip(keys, classes, strict=True):
            at = ghost.get(key)
            if at is None:
                ghost[key] = self._base + len(order)
                order.append(key)
                labels.append(cls)
            else:
                labels[at - self._base] = cls

    def _trim(self, limit: int) -> None:
        """Forget the oldest remembered keys down to ``limit`` (below the list's
        length); each one forgotten counts its class not reused (sums: one update per
        class)."""
        over = len(self._ghost) - limit
        head = self._head
        end = head + over
        gone = self._classes[head:end]
        left = gone.count(UNKNOWN)
        while left:  # keys that left by an insert: look as much further
            more = self._classes[end : end + left]
            end += left
            gone += more
            left = more.count(UNKNOWN)
        keys = self._keys[head:end]
        if len(gone) > over:
            live = list(map(gt, repeat(REUSED), gone))
            keys = list(compress(keys, live))
            gone = list(compress(gone, live))
        ghost = self._ghost
        for key in keys:  # a plain loop: faster than map() here
            del ghost[key]
        if end > self.compact_at and 2 * end > len(self._keys):  # the trimmed part goes
            del self._keys[:end]
            del self._classes[:end]
            self._base += end
            end = 0
        self._head = end
        unused, update = self.unused, self._update
        for cls in set(gone):  # a few distinct classes: a count each, no Counter
            unused[cls] += gone.count(cls)
            update(cls)

    def ghost_items(self) -> list[tuple[Hashable, int]]:
        """The ghost list, oldest first: (key, class) of each remembered key."""
        pairs = zip(self._keys[self._head :], self._classes[self._head :], strict=True)
        return [(key, cls) for key, cls in pairs if cls != UNKNOWN]

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
            for key, at in zip(added, count(self._base + len(self._keys))):
                ghost[key] = at  # a plain loop: faster than update() here
            if len(ghost) - size == len(added):
                self._keys += added
                self._classes += labels
            else:  # a key named twice: undone, then key by key
                for key in added:
                    ghost.pop(key, None)
                self._remember(added, labels)
        else:
            self._remember(added, labels)
        limit = max(16, int(self.ghost_factor * (resident + after)))
        if len(ghost) > limit:
            self._trim(limit)

    def estimates(self) -> dict[str, float]:
        """Each class's estimated reuse probability, by name."""
        return {name: round(self._p[c], 4) for c, name in enumerate(CLASS_NAMES)}
