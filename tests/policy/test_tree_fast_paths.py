"""The prefix tree's fast paths leave exactly the state of its one-key-at-a-time paths.

The fast paths: a put's links, classes and admission computed once per put
(``record_tail``), a lookup's touches in C (``touch_all``), victims taken without the
children maps while the order is tidy (every parent later than its children) or as a
checked batch, and the reuse predictor's hits and evictions as sums. The reference is the
same class through its general paths only (``_record_plain``/``_record_classed`` per key,
every touch and every victim one by one through ``_drop``, the admission told per key).
Compared after every step: the LRU order with each key's parent, the children, orphans,
classes, turn depths and the predictor's ghost list, counts and estimates; and the
victims of every eviction. The tidy flag is checked against the order itself whenever it
claims one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlife.policy.base as base_module
from kvlife.policy.admission import PredictorAdmission
from kvlife.policy.prefixtree import PrefixTreeAdmitPolicy, PrefixTreePolicy
from kvlife.policy.reuse import FIRST_TURN, LAST, N_CLASSES, REUSED, UNKNOWN, ReusePredictor
from kvlife.replay.cache import CacheSim
from kvlife.trace.model import Trace, TraceBuilder
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace
from tests.policy.trees import prompt_paths


class _PlainOneByOne(PrefixTreePolicy[int]):
    """``prefixtree`` through its general paths only."""

    def record_in_order(self, keys: Sequence[int], new: Collection[int]) -> None:
        self._record_plain(keys, new)

    def record_tail(self, keys: Sequence[int], head: int) -> None:
        self._record_plain(keys, set(keys[head:]))

    def touch_all(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.touch(key)

    def _drop(self, key: int) -> None:  # a subclass's _drop: no batch, victims one by one
        super()._drop(key)


class _AdmitOneByOne(PrefixTreeAdmitPolicy[int]):
    """``prefixtree-admit`` through its general paths only."""

    def record_in_order(self, keys: Sequence[int], new: Collection[int]) -> None:
        self._record_classed(keys, new)

    def record_tail(self, keys: Sequence[int], head: int) -> None:
        self._record_classed(keys, set(keys[head:]))

    def touch_all(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.touch(key)

    def _drop(self, key: int) -> None:
        super()._drop(key)


class _OwnGhost(ReusePredictor):
    """The reuse predictor not shared with the policy (its own ghost list's classes,
    each victim's class popped and told: the path of any subclass)."""


def _state(p: PrefixTreePolicy[int]) -> tuple[object, ...]:
    kids = {k: p.children_of(k) for k in p._order}
    pred = p.predictor
    learned = (
        None
        if pred is None
        else (pred.ghost_items(), list(pred.reused), list(pred.unused), list(pred._p))
    )
    return (
        list(p._order.items()),
        {k: c for k, c in kids.items() if c},
        list(p._orphans),
        # the residents' classes (a shared ghost list keeps its own beside them; a bare
        # insert's UNKNOWN is no entry there, which the predictor takes alike)
        {k: c for k, c in p._cls.items() if k in p._order and c != UNKNOWN},
        dict(p._depth),
        learned,
    )


# a forest of prompts: each prompt is a root-to-node path of a random tree
TREE = st.lists(st.integers(0, 40), min_size=1, max_size=60)  # parent index of node i+1
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "touch", "touch1", "insert", "evict", "evict",
                         "remove"]),
        st.integers(0, 60),
        st.integers(0, 7),
    ),
    max_size=90,
)  # fmt: skip


def _make(variant: str) -> tuple[PrefixTreePolicy[int], PrefixTreePolicy[int]]:
    if variant == "plain":
        return PrefixTreePolicy(), _PlainOneByOne()
    if variant.startswith("shared"):  # the ghost list shared with the policy, or not
        threshold = float(variant.split("-")[1])
        unshared = PrefixTreePolicy[int](PredictorAdmission(_OwnGhost(threshold)))
        assert not unshared._shared
        return PrefixTreeAdmitPolicy(threshold), unshared
    # 0.6: a class of estimate 0.5 is cold, warm once hit
    threshold = float(variant.split("-")[1])
    return PrefixTreeAdmitPolicy(threshold), _AdmitOneByOne(threshold)


PRIOR = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=N_CLASSES,
                 max_size=N_CLASSES)  # fmt: skip
"""Each class's reused and unused counts to start from (estimates 0.25-0.75)."""


@pytest.mark.parametrize("variant", ["plain", "admit-0.1", "admit-0.6", "shared-0.1", "shared-0.6"])
@settings(max_examples=120, deadline=None)
@given(parents=TREE, ops=OPS, prior=PRIOR)
def test_fast_paths_equal_the_calls_one_by_one(
    variant: str, parents: list[int], ops: list[tuple[str, int, int]], prior: list[tuple[int, int]]
) -> None:
    paths = prompt_paths(parents)
    fast, slow = _make(variant)
    for p in (fast, slow):
        if p.predictor is not None:  # some classes warm, some cold, from the start
            for cls, (reused, unused) in enumerate(prior):
                p.predictor.reused[cls], p.predictor.unused[cls] = float(reused), float(unused)
                p.predictor._update(cls)
    for op, i, m in ops:
        path = paths[i % len(paths)]
        if op == "put":
            # as placement makes it: the leading residents, then the new keys (the usual
            # put, by record_tail); with m = 7, the first key last (a resident after a
            # new key, or a new key before residents: record_in_order's general path)
            lead = 0
            while lead < len(path) and path[lead] in slow:
                lead += 1
            keys = path[:lead] + [k for k in path[lead:] if k not in slow]
            if m >= 6 and len(keys) > 2:
                # m = 6: the second key named again last (a request naming a block twice)
                keys = keys + keys[1:2] if m == 6 else keys[1:] + keys[:1]
                new = {k for k in keys if k not in slow}
                fast.record_in_order(keys, new)
                slow.record_in_order(keys, new)
            else:
                fast.record_tail(keys, lead)
                slow.record_tail(keys, lead)
        elif op == "touch":  # a lookup of the path's first m + 1 keys
            hits = [k for k in path[: m + 1] if k in slow]
            fast.touch_all(reversed(hits))
            slow.touch_all(reversed(hits))
        elif op in ("touch1", "insert", "remove"):
            call = "touch" if op == "touch1" else op
            getattr(fast, call)(path[-1])
            getattr(slow, call)(path[-1])
        else:
            protected = set(path[: m + 1]) if i % 3 else set()
            assert fast.evict_up_to(m, protected) == slow.evict_up_to(m, protected)
        if fast._tidy:
            assert fast._order_is_tidy()
        assert _state(fast) == _state(slow)
    assert fast.evict_up_to(len(fast) + 1) == slow.evict_up_to(len(slow) + 1)
    assert _state(fast) == _state(slow)


EVICTS = st.lists(
    st.tuples(st.lists(st.integers(0, N_CLASSES - 1), max_size=12), st.integers(0, 40),
              st.lists(st.integers(0, N_CLASSES - 1), max_size=6)),
    max_size=30,
)  # fmt: skip


@pytest.mark.parametrize("ghost_factor", [0.5, 2.0])
@settings(max_examples=150, deadline=None)
@given(steps=EVICTS)
def test_predictor_sums_equal_its_calls_one_by_one(
    ghost_factor: float, steps: list[tuple[list[int], int, list[int]]]
) -> None:
    """``on_evicts`` (a batch of victims, the residents after the last) and ``on_hits``
    leave the ghost list, the counts and the estimates of ``on_evict`` and ``on_hit``
    called in turn."""
    batch, single = ReusePredictor(0.1, ghost_factor), ReusePredictor(0.1, ghost_factor)
    serial = 0
    for classes, resident, hits in steps:
        keys = list(range(serial, serial + len(classes)))
        serial += len(classes)
        batch.on_evicts(keys, classes, resident)
        for j, (key, cls) in enumerate(zip(keys, classes, strict=True)):
            single.on_evict(key, cls, resident + len(keys) - 1 - j)
        batch.on_hits(hits)
        for cls in hits:
            single.on_hit(cls)
        assert batch.ghost_items() == single.ghost_items()
        assert (batch.reused, batch.unused, batch._p) == (single.reused, single.unused, single._p)


def test_a_key_named_twice_keeps_both_links() -> None:
    """A put naming a new key twice, after two different keys, links it to both (the
    parent is the last; the first keeps it as a child for good): the fast paths keep
    that, as the general paths do, even once the order is tidy again."""
    fast, slow = PrefixTreePolicy[int](), _PlainOneByOne()
    for p in (fast, slow):
        p.record_tail([1, 2], 0)
        p.record_tail([5], 0)
        p.record_in_order([1, 9, 5, 9], {9})
        p.record_tail([7, 8], 0)
    assert fast.children_of(1) == slow.children_of(1) == {2, 9}
    assert [fast.evict_up_to(1) for _ in range(7)] == [slow.evict_up_to(1) for _ in range(7)]
    assert _state(fast) == _state(slow)


def test_a_put_of_remembered_keys_is_decided_key_by_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A usual put whose new keys the ghost list remembers: each one's insert counts its
    old class reused before the next key is decided, so a class turns warm within the
    put. The fast path (no call of the general path) decides the keys between two
    remembered ones at once, as the general path decides them one by one."""
    fast, slow = PrefixTreeAdmitPolicy[int](0.5), _AdmitOneByOne(0.5)
    for p in (fast, slow):
        pred = p.predictor
        assert pred is not None
        # short first turns: 2 of 5 reused (0.4, cold) until a remembered one comes back
        pred.reused[FIRST_TURN], pred.unused[FIRST_TURN] = 2.0, 3.0
        pred._update(FIRST_TURN)
        pred.on_evicts([11, 13, 99], [FIRST_TURN, FIRST_TURN, LAST], 100)  # remembered

    def general(*args: object, **kwargs: object) -> None:
        raise AssertionError("the usual put took the general path")

    monkeypatch.setattr(fast, "_record_classed", general)
    for p in (fast, slow):
        p.record_tail([10, 11, 12, 13, 14], 0)
    # 10 and 11 decided at 2/5, 12 and 13 at 3/6, the last block at its prior 1/2
    assert list(fast._order)[:2] == [11, 10]
    assert fast.predictor is not None and fast.predictor.probability(FIRST_TURN) == 4 / 7
    assert fast._tidy is False and not fast._order_is_tidy()  # 12 after its cold parent
    assert _state(fast) == _state(slow)
    assert fast.evict_up_to(5) == slow.evict_up_to(5)
    assert _state(fast) == _state(slow)


def _scrambled(seed: int) -> Trace:
    """A synthetic trace whose requests break the chain (a block after another
    predecessor, a rotated request, a block named twice: the general loop)."""
    base = synthetic_trace(SyntheticConfig(seed=seed, sessions=40))
    rng = np.random.default_rng(seed)
    out = TraceBuilder("scrambled", base.block_tokens)
    offs, blocks = base.offsets.tolist(), base.blocks.tolist()
    for i in range(base.n_requests):
        req = blocks[offs[i] : offs[i + 1]]
        r = rng.random()
        if r < 0.15 and len(req) > 2:
            k = int(rng.integers(1, len(req)))
            req = req[k:] + req[:k]
        elif r < 0.25 and len(req) > 1:
            del req[int(rng.integers(0, len(req)))]
        elif r < 0.3 and len(req) > 1:
            req = [*req, req[0]]
        out.add(float(i), len(req) * base.block_tokens, 1, req)
    return out.build()


@pytest.mark.parametrize("variant", ["plain", "admit-0.1", "admit-0.6", "shared-0.1"])
def test_replays_equal_the_calls_one_by_one(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator (its one-call-per-request path, its general loop, two tiers) gives
    the same per-request results, counters and lifespans with the fast paths as with the
    same policy through its one-key-at-a-time paths."""
    monkeypatch.setitem(base_module._REGISTRY, "fast", lambda: _make(variant)[0])
    monkeypatch.setitem(base_module._REGISTRY, "one-by-one", lambda: _make(variant)[1])
    for trace in (synthetic_trace(SyntheticConfig(seed=5, sessions=60)), _scrambled(7)):
        unique = trace.n_unique_blocks()
        for dram, disk, lifespans in (
            (unique // 10, 0, False),
            (unique // 40, 0, False),
            (unique // 50, unique // 10, True),
        ):
            runs = [
                CacheSim(p, dram, disk, track_lifespans=lifespans).run(trace)
                for p in ("fast", "one-by-one")
            ]
            for f in ("prefix_dram", "prefix_disk", "present", "new", "dropped", "promoted"):
                assert np.array_equal(getattr(runs[0], f), getattr(runs[1], f)), (dram, f)
            assert runs[0].tiers == runs[1].tiers and runs[0].lifespans == runs[1].lifespans
            assert int(runs[0].present.sum()) > 0


class _OrderedGhost:
    """The reuse predictor's ghost list as an ordered dict, trimmed one key at a time
    (and a batch of victims trimmed once, to its last trimming victim's limit): the
    reference for its FIFO of places."""

    def __init__(self, ghost_factor: float) -> None:
        self.ghost_factor = ghost_factor
        self.ghost: OrderedDict[int, int] = OrderedDict()
        self.reused = [1.0] * N_CLASSES
        self.unused = [1.0] * N_CLASSES

    def on_insert(self, key: int) -> None:
        cls = self.ghost.pop(key, None)
        if cls is not None:
            self.reused[cls] += 1.0

    def on_evict(self, key: int, cls: int, resident: int) -> None:
        if cls >= REUSED:
            return
        self.ghost[key] = cls
        self.trim(resident)

    def on_evicts(self, keys: list[int], classes: list[int], resident: int) -> None:
        kept = [j for j, cls in enumerate(classes) if cls < REUSED]
        for j in kept:
            self.ghost[keys[j]] = classes[j]
        if kept:
            self.trim(resident + len(keys) - 1 - kept[-1])

    def trim(self, resident: int) -> None:
        while len(self.ghost) > max(16, int(self.ghost_factor * resident)):
            self.unused[self.ghost.popitem(last=False)[1]] += 1.0


GHOST_OPS = st.lists(
    st.tuples(st.sampled_from(["evict", "evicts", "insert"]),
              st.lists(st.tuples(st.integers(0, 30), st.integers(0, N_CLASSES - 1)),
                       min_size=1, max_size=12),
              st.integers(0, 25)),
    max_size=80,
)  # fmt: skip


@pytest.mark.parametrize("ghost_factor", [0.5, 2.0])
@settings(max_examples=200, deadline=None)
@given(ops=GHOST_OPS)
def test_the_ghost_list_is_an_ordered_dict(
    ghost_factor: float, ops: list[tuple[str, list[tuple[int, int]], int]]
) -> None:
    """Keys remembered, inserted (they leave) and remembered again, a batch naming a key
    twice or one remembered already: the ghost list keeps the order, classes and counts
    of an ordered dict trimmed from its oldest end one key at a time (the trims run far
    past keys that left, and the FIFO is compacted)."""
    pred, ref = ReusePredictor(0.1, ghost_factor), _OrderedGhost(ghost_factor)
    pred.compact_at = 8
    for op, pairs, resident in ops:
        keys, classes = [k for k, _ in pairs], [c for _, c in pairs]
        if op == "evicts":
            pred.on_evicts(keys, classes, resident)
            ref.on_evicts(keys, classes, resident)
        else:
            for key, cls in pairs:
                if op == "evict":
                    pred.on_evict(key, cls, resident)
                    ref.on_evict(key, cls, resident)
                else:
                    pred.on_insert(key)
                    ref.on_insert(key)
        assert pred.ghost_items() == list(ref.ghost.items())
        assert (pred.reused, pred.unused) == (ref.reused, ref.unused)
        assert pred._p == [r / (r + u) for r, u in zip(ref.reused, ref.unused, strict=True)]


def test_the_ghost_list_stays_bounded_when_keys_keep_coming_back() -> None:
    """Most remembered keys come back before the list is full, so the trim never runs:
    the entries they leave behind are dropped all the same (the FIFO stays within
    twice the keys remembered plus its compaction margin), and the list keeps the
    order of an ordered dict."""
    pred, ref = ReusePredictor(0.1), _OrderedGhost(2.0)
    pred.compact_at = 8
    for step in range(500):
        keys, classes = [step, step + 1000], [FIRST_TURN, LAST]
        pred.on_evicts(keys, classes, 100)
        ref.on_evicts(keys, classes, 100)
        for key in keys if step % 10 else keys[:1]:  # one in ten stays remembered
            pred.on_insert(key)
            ref.on_insert(key)
        assert len(pred._keys) - pred._head <= 2 * pred._remembered + pred.compact_at + 1
    assert len(pred._keys) < 200  # of the 1000 remembered in all
    assert pred.ghost_items() == list(ref.ghost.items())
    assert (pred.reused, pred.unused) == (ref.reused, ref.unused)
