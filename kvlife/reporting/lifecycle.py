"""The lifecycle distribution of an event stream: lifespans, reuse, time in each state.

The same analysis reads a replay's events (:class:`~kvlife.replay.cache.CacheSim` with a
sink) and a live store's event log (:func:`kvlife.trace.events_io.read_events`), since
both emit :class:`~kvlife.core.events.LifecycleEvent` records. Per object *life* (a
``put`` or first ``write`` to its ``delete``; a key put again after its delete starts a
new life):

- *lifespan*: create to delete (lives still open at the end are counted as open, and
  their lifespans are left out: they are censored);
- *reuse count*: loads during the life; *reuse distance*: seconds from creation to the
  first load and between consecutive loads (of open lives too: a gap between two loads
  that happened is a whole observation);
- *time in each state*: tentative (put to commit), committed (commit to index), indexed
  (index to invalidate), invalidated (invalidate to delete); and in each tier (written or
  offloaded in, to evicted).

Lives still open at the end report their age then (a live store rarely deletes: its
lives are mostly open, so their ages are the figure to read), and their time in each
state up to the end is in ``state_share_with_open``. ``overall`` pools every class: the
row a report puts beside other sources' (a replay's, a live engine's).

Cache lifespans depend on the cache (its policy and capacity). :func:`trace_lifetimes`
gives the policy-free view of a trace: per block, its *useful lifetime* (first to last
touch), touches and gaps between touches, per class, with the same stability test.

Every life is put in a class by ``classify(key)`` (for a trace: the block's position
bucket; for a live log: the namespace). *Stable classes*: the lives are split in two
halves by creation time; a class is stable when its median lifespan in the two halves
differs by at most 2x, and the classes are *distinct* when their medians span more
than 2x (:func:`stability`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.replay.metrics import percentiles

STATES = ("tentative", "committed", "indexed", "invalidated")
MIN_LIVES = 30
"""Fewest lives of a class in each half for its stability to be judged."""


@dataclass(slots=True)
class _Life:
    cls: str
    born: float
    commit: float = -1.0
    index: float = -1.0
    invalidate: float = -1.0
    loads: list[float] = field(default_factory=list)
    tier_in: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _ClassAcc:
    lifespans: list[float] = field(default_factory=list)
    born: list[float] = field(default_factory=list)
    reuse_counts: list[int] = field(default_factory=list)
    reuse_gaps: list[float] = field(default_factory=list)
    state_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    tier_s: dict[str, list[float]] = field(default_factory=dict)

    def pooled(self, other: _ClassAcc) -> _ClassAcc:
        """This class's lives and ``other``'s together (neither is changed)."""
        return _ClassAcc(
            self.lifespans + other.lifespans,
            self.born + other.born,
            self.reuse_counts + other.reuse_counts,
            self.reuse_gaps + other.reuse_gaps,
            {s: self.state_s[s] + other.state_s[s] for s in STATES},
            {
                t: self.tier_s.get(t, []) + other.tier_s.get(t, [])
                for t in sorted(set(self.tier_s) | set(other.tier_s))
            },
        )


def _state_times(life: _Life, end: float) -> dict[str, float]:
    """Seconds ``life`` spent in each state, from its birth to ``end`` (its delete, or
    the end of the log for a life still open)."""
    out = dict.fromkeys(STATES, 0.0)
    marks = [life.born, life.commit, life.index, life.invalidate, end]
    last = life.born
    for state, (a, b) in zip(STATES, pairwise(marks), strict=True):
        if a >= 0 and b >= 0:
            out[state] += max(0.0, b - max(a, last))
            last = max(last, b)
    # a state entered and not left by the end (an open life): its time runs to the end
    entered = [(s, m) for s, m in zip(STATES, marks[:-1], strict=True) if m >= 0]
    if entered and end != life.born:
        state, since = entered[-1]
        if all(m < 0 for m in marks[STATES.index(state) + 1 : -1]):
            out[state] = max(out[state], end - max(since, life.born))
    return out


def _gaps(life: _Life) -> list[float]:
    gaps, prev = [], life.born
    for tl in life.loads:
        gaps.append(tl - prev)
        prev = tl
    return gaps


class LifecycleAnalysis(EventSink):
    """Accumulates lives from events (as a sink, or fed with :meth:`add_all`)."""

    def __init__(self, classify: Callable[[str, LifecycleEvent], str]) -> None:
        self.classify = classify
        self._open: dict[str, _Life] = {}
        self._acc: dict[str, _ClassAcc] = {}
        self.events = 0
        self.t_first = float("inf")
        self.t_last = 0.0

    def emit(self, event: LifecycleEvent) -> None:
        self.events += 1
        t = event.time
        if t < self.t_first:
            self.t_first = t
        if t > self.t_last:
            self.t_last = t
        kind, key = event.kind, event.key
        life = self._open.get(key)
        if life is None:
            if kind not in ("put", "write", "recover"):
                return  # a move of an object created before the log began
            life = self._open[key] = _Life(self.classify(key, event), t)
            if kind == "recover":  # found committed at a restart: its life goes on
                life.commit = t
        # a restart re-publishes what it recovers (recover, index) within the same life:
        # the life entered each state the first time
        if kind == "commit" and life.commit < 0:
            life.commit = t
        elif kind == "index" and life.index < 0:
            life.index = t
        elif kind in ("invalidate", "corrupt"):
            life.invalidate = t
        elif kind == "load":
            life.loads.append(t)
        elif kind == "write" and event.tier:
            life.tier_in.setdefault(event.tier, t)
        elif kind == "offload" and event.dst_tier:
            life.tier_in.setdefault(event.dst_tier, t)
        elif kind == "evict" and event.tier:
            t_in = life.tier_in.pop(event.tier, None)
            if t_in is not None:
                acc = self._class(life.cls)
                acc.tier_s.setdefault(event.tier, []).append(t - t_in)
        elif kind in ("delete", "abort"):
            self._close(key, life, t)

    def add_all(self, events: Iterable[LifecycleEvent]) -> LifecycleAnalysis:
        for e in events:
            self.emit(e)
        return self

    def _class(self, cls: str) -> _ClassAcc:
        acc = self._acc.get(cls)
        if acc is None:
            acc = self._acc[cls] = _ClassAcc()
        return acc

    def _close(self, key: str, life: _Life, t: float) -> None:
        del self._open[key]
        acc = self._class(life.cls)
        acc.lifespans.append(t - life.born)
        acc.born.append(life.born)
        acc.reuse_counts.append(len(life.loads))
        acc.reuse_gaps += _gaps(life)
        for state, v in _state_times(life, t).items():
            acc.state_s[state] += v

    def result(self) -> dict[str, Any]:
        """Per class distributions, all classes pooled (``overall``), open lives, and
        the stability verdict."""
        open_lives: dict[str, list[_Life]] = {}
        for life in self._open.values():
            open_lives.setdefault(life.cls, []).append(life)
        classes: dict[str, Any] = {}
        every = _ClassAcc()
        every_open: list[_Life] = []
        for cls in sorted(set(self._acc) | set(open_lives)):
            acc = self._acc.get(cls, _ClassAcc())
            lives = open_lives.get(cls, [])
            classes[cls] = self._figures(acc, lives)
            every = every.pooled(acc)
            every_open += lives
        return {
            "events": self.events,
            "span_s": max(0.0, self.t_last - self.t_first) if self.events else 0.0,
            "overall": self._figures(every, every_open),
            "classes": classes,
            "stability": stability(self._acc, self.t_first, self.t_last),
        }

    def _figures(self, acc: _ClassAcc, lives: list[_Life]) -> dict[str, Any]:
        """The figures of one class: ``acc`` its closed lives, ``lives`` its open ones."""
        counts = np.asarray(acc.reuse_counts, dtype=np.float64)
        open_loads = np.asarray([len(x.loads) for x in lives], dtype=np.float64)
        gaps = list(acc.reuse_gaps)
        with_open = dict(acc.state_s)
        for life in lives:
            gaps += _gaps(life)
            for state, v in _state_times(life, self.t_last).items():
                with_open[state] += v

        def shares(d: dict[str, float]) -> dict[str, float]:
            total = sum(d.values())
            return {s: (v / total if total else 0.0) for s, v in d.items()}

        n_all = counts.size + open_loads.size
        return {
            "lives_closed": len(acc.lifespans),
            "lives_open": len(lives),
            "lifespan_s": percentiles(acc.lifespans),
            "open_age_s": percentiles([self.t_last - x.born for x in lives]),
            "open_reuse_count": percentiles(open_loads),
            "reuse_count": percentiles(counts),
            "reused_share": float((counts > 0).mean()) if counts.size else 0.0,
            "reused_share_with_open": (
                float(((counts > 0).sum() + (open_loads > 0).sum()) / n_all) if n_all else 0.0
            ),
            "reuse_distance_s": percentiles(gaps),
            "state_share": shares(acc.state_s),
            "state_s_with_open": with_open,
            "state_share_with_open": shares(with_open),
            "tier_residency_s": {tier: percentiles(v) for tier, v in sorted(acc.tier_s.items())},
        }

    def samples(self) -> dict[str, list[float]]:
        """Closed lifespans per class (for plots)."""
        return {cls: acc.lifespans for cls, acc in sorted(self._acc.items())}


def stability(acc: dict[str, _ClassAcc], t0: float, t1: float) -> dict[str, Any]:
    """Median lifespan per class in each half of the run, and the verdict.

    Each half is read as a window of its own: a life counts in the first half if it was
    born and closed before the midpoint, in the second if it was born after it, so both
    halves are censored alike (a long life is missing from both, not from one)."""
    mid = (t0 + t1) / 2.0
    first: dict[str, np.ndarray] = {}
    second: dict[str, np.ndarray] = {}
    for cls, a in acc.items():
        life = np.asarray(a.lifespans, np.float64)
        born = np.asarray(a.born, np.float64)
        first[cls] = life[(born < mid) & (born + life < mid)]
        second[cls] = life[born >= mid]
    return _verdict(first, second, "lifespan")


def _verdict(
    first: dict[str, np.ndarray], second: dict[str, np.ndarray], what: str
) -> dict[str, Any]:
    halves: dict[str, Any] = {}
    stable: list[bool] = []
    medians: list[float] = []
    for cls in sorted(set(first) | set(second)):
        f = first.get(cls, np.zeros(0))
        g = second.get(cls, np.zeros(0))
        row: dict[str, Any] = {"first_n": int(f.size), "second_n": int(g.size)}
        if f.size >= MIN_LIVES and g.size >= MIN_LIVES:
            m1, m2 = float(np.median(f)), float(np.median(g))
            ratio = max(m1, m2) / min(m1, m2) if min(m1, m2) > 0 else float("inf")
            row.update(first_median_s=m1, second_median_s=m2, ratio=ratio, stable=ratio <= 2.0)
            stable.append(ratio <= 2.0)
            medians.append(float(np.median(np.concatenate([f, g]))))
        halves[cls] = row
    spread = max(medians) / min(medians) if medians and min(medians) > 0 else 0.0
    judged = len(stable)
    if judged < 2:
        verdict = f"not enough lives to judge ({judged} class(es) with {MIN_LIVES}+ per half)"
    elif all(stable) and spread > 2.0:
        verdict = (
            f"yes: all {judged} judged classes keep their median {what} within 2x across "
            f"halves, and the class medians span {spread:.1f}x"
        )
    elif all(stable):
        verdict = f"stable but not distinct: class medians span only {spread:.1f}x"
    else:
        verdict = f"no: {stable.count(False)} of {judged} classes change by more than 2x"
    return {"per_class": halves, "median_spread": spread, "verdict": verdict}


def _useful(
    blocks: np.ndarray, times: np.ndarray, classes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per block (of these touches): class, touches, useful lifetime; per repeat touch:
    the gap since the previous touch and the block's class."""
    order = np.lexsort((np.arange(blocks.size), blocks))
    b, t, c = blocks[order], times[order], classes[order]
    start = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    end = np.r_[start[1:], b.size] - 1
    touches = end - start + 1
    cls = c[start]  # a block's class is that of its first touch
    same = b[1:] == b[:-1]
    gap_cls = np.repeat(cls, touches)[1:]
    return cls, touches, t[end] - t[start], np.diff(t)[same], gap_cls[same]


def trace_lifetimes(
    blocks: np.ndarray, times: np.ndarray, classes: np.ndarray, names: tuple[str, ...]
) -> dict[str, Any]:
    """Policy-free lifetimes of a trace's blocks: ``blocks`` and ``times`` per touch (in
    time order), ``classes`` the class index of each touch (a block's class is the one
    of its first touch). Per class: useful lifetime (first to last touch, blocks touched
    more than once), touches per block, gaps between touches; and the stability test on
    the useful lifetimes."""
    if blocks.size == 0:
        return {"classes": {}, "stability": _verdict({}, {}, "useful lifetime")}
    cls, touches, life, gaps, gap_cls = _useful(blocks, times, classes)
    out: dict[str, Any] = {}
    for k in np.unique(cls).tolist():
        m = cls == k
        reused = m & (touches > 1)
        out[names[k]] = {
            "blocks": int(m.sum()),
            "reused_share": float(reused.sum() / m.sum()),
            "touches": percentiles(touches[m].astype(np.float64)),
            "useful_lifetime_s": percentiles(life[reused]),
            "reuse_gap_s": percentiles(gaps[gap_cls == k]),
        }
    # each half of the trace read as a trace of its own (censored alike)
    mid = (float(times.min()) + float(times.max())) / 2.0
    halves = []
    for m in (times < mid, times >= mid):
        hc, ht, hl, _, _ = _useful(blocks[m], times[m], classes[m])
        halves.append({names[k]: hl[(hc == k) & (ht > 1)] for k in np.unique(hc).tolist()})
    return {"classes": out, "stability": _verdict(halves[0], halves[1], "useful lifetime")}
