"""Planned prefills on the transformers engine: the planner's plans executed, and the
engine's prefill profile measured for its cost model.

:class:`PlannedEngine` wraps an :class:`~kvlife.engines.hf.HFEngine` and a
:class:`~kvlife.planner.CostModel`. Per request it looks the prompt up, asks a policy
(the planner's :func:`~kvlife.planner.choose` unless told otherwise) for a
:class:`~kvlife.planner.Plan` and executes it: the loaded chunks ``[front, stop)`` start
loading at once in the store's I/O threads (``load_async`` into the engine's aligned
landing buffer) while the engine prefills the front ``[0, front)`` itself; then the
cache is the computed front followed by the loaded chunks, and the rest of the prompt is
prefilled on top. The KV of the front is what a full prefill computes for those
positions, and the loaded chunks are the KV a full prefill computed for theirs, so the
logits and tokens are those of a full prefill (tested).

A load still running at its deadline (the plan's predicted load time times
``deadline_factor``, plus ``deadline_slack_s``) is not waited for: the chunks that
arrived in order are used and the rest is recomputed with the remainder of the prompt
(vLLM's ``kv_load_failure_policy=recompute`` shape), counted in
:class:`PlanCounters`. The loads of a prefill whose forward raises (out of memory, an
interrupt) keep the buffer they read into too, and the engine takes a new one: a late
read of theirs never lands in the next request's chunks. A chunk that fails
verification ends the loaded run the same way.
Each load that completes teaches the cost model the tier's speed, each prefill the
engine's speed against its profile.

An engine whose chunks are stored as layer groups (``HFEngine(layer_groups=G)``,
:mod:`kvlife.engines.hf_layers`) loads each group with its own ``load_async``, group 0
first, and runs the rest's forward at once in a landing cache: layer ``l`` takes its
prefix when its group has landed and verified, so the forward overlaps the groups still
loading. A group that does not land whole by the deadline (missing, corrupt, late)
abandons that forward, whose earlier layers used the loaded prefix: the engine
recomputes on the chunks every group has whole, counted (``PlanCounters.abandoned``).
The cost model predicts the overlap (``CostModel.layer_groups``, set here).

:func:`measure_prefill` times a few prefills of the engine's own model (a few seconds)
and fits a :class:`~kvlife.planner.PrefillProfile`; :func:`prefill_profile` reads a
cached one for the same model and thread count instead.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import Namespace
from kvlife.core.payload import to_torch
from kvlife.engines.hf import HFEngine, Prefill
from kvlife.engines.hf_layers import (
    GroupUnavailable,
    combined_hits,
    group_views,
    landing_cache,
    layer_group_index,
    lookup_groups,
)
from kvlife.engines.identity import cache_dir
from kvlife.planner import CostModel, Plan, PrefillProfile, choose
from kvlife.planner.cost import PrefillSample
from kvlife.planner.plan import usable_hits
from kvlife.results import ChunkHit

Policy = Callable[[CostModel, Sequence[ChunkHit], int], Plan]
"""Chooses a plan from the model, the usable hits and the prompt's length."""

PROFILE_POINTS: tuple[tuple[int, int], ...] = (
    (0, 64),
    (0, 256),
    (0, 1024),
    (256, 16),
    (1024, 16),
    (2048, 16),
    (1024, 256),
    (2048, 128),
)
"""(start, length) of the prefills :func:`measure_prefill` times: lengths for the
per-token cost, long ones after a prefix for attention's growth with position, and short
ones after a prefix (the rest a plan prefills after its loaded chunks: there the cached
KV's copy per call, ``c3``, is most of the time)."""

PROFILE_VERSION = 2
"""Part of the cached profile's label: profiles of another version are measured again
(2: the per-cached-token term and the short prefills after a prefix)."""


@dataclass(slots=True)
class PlanCounters:
    """What a planned engine did, since it was made."""

    plans: dict[str, int] = field(default_factory=dict)
    """Requests by plan kind (``compute``, ``load``, ``split``)."""
    chunks_loaded: int = 0
    chunks_recomputed: int = 0
    """Hit chunks recomputed (the front and any after the loaded run)."""
    fallback_chunks: int = 0
    """Chunks the plan loaded but the engine recomputed: their load ran past its
    deadline or a chunk before them was a miss."""
    timeouts: int = 0
    """Loads that ran past their deadline."""
    misses: int = 0
    """Loads that ended at a chunk that was no longer there or failed verification."""
    abandoned: int = 0
    """Layered forwards abandoned at a layer whose group did not land whole (missing,
    corrupt, past the deadline): the layers before it had attended to the loaded
    prefix, so the forward was recomputed on the prefix every group had whole."""


@dataclass(slots=True)
class PlannedPrefill:
    """One request's planned prefill."""

    prefill: Prefill
    plan: Plan
    loaded: int
    """Chunks served from the store."""
    fallback: int
    """Chunks the plan loaded but were recomputed (deadline, miss)."""
    ttft_s: float
    """Lookup to the last prompt position's logits."""
    lookup_s: float
    front_s: float
    """Time the front's prefill took."""
    load_s: float
    """Time the load took (to its last chunk; to the deadline when abandoned)."""
    rest_s: float
    """Time the prefill after the plan's stop took."""
    wait_s: float = 0.0
    """Time the engine waited for the load after its front was computed."""
    join_s: float = 0.0
    """Time to make the cache of the front and the loaded chunks."""
    main_cpu_s: float = 0.0
    """CPU seconds of the engine's thread (torch computes there with one thread)."""
    other_cpu_s: float = 0.0
    """CPU seconds of the process's other threads meanwhile: the store's I/O threads
    loading (reads, checks, copies), with torch's own pool where it has more threads."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds of the engine's thread per phase (``lookup_s``, ``front_s``,
    ``join_s``, ``rest_s``): with one torch thread, the phase's work without the time
    the thread waited for a core (a shared machine's noise)."""
    layered: bool = False
    """The rest's forward ran layer by layer behind the load (``wait_s`` and ``join_s``
    are then inside ``rest_s``)."""
    abandoned_layer: int = -1
    """Layer at which a layered forward was abandoned (its group did not land whole);
    -1: none."""
    abandoned_s: float = 0.0
    """Time the abandoned forward ran before it was given up."""


class PlannedEngine:
    """An HF engine whose prefills follow the planner's plans."""

    def __init__(
        self,
        engine: HFEngine,
        model: CostModel,
        *,
        deadline_factor: float = 2.0,
        deadline_slack_s: float = 0.05,
        learn: bool = True,
        layered: bool = True,
    ) -> None:
        if engine.store is None:
            raise ValueError("a planned engine needs a store")
        self.layered = layered and engine.layer_groups > 1
        """Run the rest's forward behind the load, layer by layer (an engine whose
        chunks are stored in more than one layer group); else wait for the whole load."""
        # the plans predict the overlap this engine runs
        model.layer_groups = engine.layer_groups if self.layered else 1
        self.engine = engine
        self.model = model
        self.deadline_factor = deadline_factor
        self.deadline_slack_s = deadline_slack_s
        self.learn = learn
        """Feed each completed load's and each prefill's time to the cost model."""
        self.counters = PlanCounters()
        self._abandoned: list[_Loading] = []

    def prefill(
        self,
        ids: Sequence[int],
        namespace: Namespace,
        *,
        policy: Policy = choose,
        start: int = 0,
        request_id: str = "",
    ) -> PlannedPrefill:
        eng, store = self.engine, self.engine.store
        assert store is not None
        eng._check_length(ids, start, 0)
        lay = eng.identity.layout
        tpc, n = lay.tokens_per_chunk, len(ids)
        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        found = lookup_groups(store, eng.group_identities, namespace, ids, start)
        every = combined_hits(found)
        hits = every[: usable_hits(every, n, tpc)]
        plan = policy(self.model, hits, n)
        t1, m1 = time.perf_counter(), time.thread_time()
        front, stop = plan.front, plan.stop
        count = stop - front
        loads: list[_Loading] = []
        buf = np.empty(0)
        if count:
            shape = (lay.num_layers, 2, lay.num_kv_heads, count * tpc, lay.head_dim)
            buf = eng._kv_buffer(shape)
            # one load per layer group, issued in group order: group 0's reads go first
            views = group_views(buf, eng.group_spans(), count, tpc)
            for group, outs in zip(found, views, strict=True):
                handle = store.load_async(group.sub(front, stop), outs, request_id=request_id)
                loads.append(_Loading(handle))
        try:
            # the front, computed while the back loads
            front_cache = eng._new_cache()
            tf, mf = time.perf_counter(), time.thread_time()
            if front:
                front_cache = eng._prefill_suffix(ids[: front * tpc], front_cache, start).cache
            t2, m2 = time.perf_counter(), time.thread_time()
            deadline = (
                math.inf
                if math.isinf(self.deadline_factor)
                else t1 + plan.load_s * self.deadline_factor + self.deadline_slack_s
            )
            layered = bool(count) and self.layered
            got, timed_out, abandoned_layer, abandoned_s = 0, False, -1, 0.0
            landing = _Landing(eng, loads, front_cache, front * tpc, buf, count, deadline)
            if layered:
                # the rest's forward starts now; layer l waits for its group inside the cache
                t2w, m2w = t2, m2
                cache = landing.cache()
                t3, m3 = time.perf_counter(), time.thread_time()
                try:
                    pre = eng._prefill_suffix(ids, cache, start)
                    got = count
                except GroupUnavailable as exc:
                    # layers before exc.layer attended to the loaded prefix: nothing of this
                    # forward can be kept; recompute on the prefix every group has whole
                    abandoned_layer, timed_out = exc.layer, exc.timed_out
                    got = min(x.take(count, time.perf_counter())[0] for x in loads)
                    t3a = time.perf_counter()
                    abandoned_s = t3a - t3
                    cache = _joined(eng, front_cache, front * tpc, buf, got * tpc)
                    t3, m3 = time.perf_counter(), time.thread_time()
                    pre = eng._prefill_suffix(ids, cache, start)
            else:
                if loads:
                    got, timed_out = _take_all(loads, count, deadline)
                t2w, m2w = time.perf_counter(), time.thread_time()
                cache = (
                    _joined(eng, front_cache, front * tpc, buf, got * tpc) if loads else front_cache
                )
                t3, m3 = time.perf_counter(), time.thread_time()
                pre = eng._prefill_suffix(ids, cache, start)
        except BaseException:
            if loads:
                # the forward failed (out of memory, an interrupt) with reads of this
                # request still landing in the engine's buffer: the next request needs
                # another, or a late read overwrites chunks it verified with this
                # prompt's KV
                eng._buffer = None
                self._abandoned += loads
            raise
        t4, m4 = time.perf_counter(), time.thread_time()
        load_s = 0.0
        if loads:
            if got < count:
                if timed_out:
                    self.counters.timeouts += 1
                else:
                    self.counters.misses += 1
                if abandoned_layer >= 0:
                    self.counters.abandoned += 1
                # reads after the last chunk used may still be writing into this buffer:
                # the next request needs another
                eng._buffer = None
                self._abandoned += loads
                load_s = time.perf_counter() - t1
            else:
                for x in loads:
                    x.join(1.0)  # its watcher notes when the last read ended
                ends = [x.finished_at or time.perf_counter() for x in loads]
                load_s = max(ends) - t1
                if self.learn:
                    self.model.observe_load(hits[front:stop], load_s)
        main_cpu = m4 - m0
        other_cpu = max(0.0, time.process_time() - c0 - main_cpu)
        rest_s = t4 - t3
        wait_s = landing.wait_s if layered else t2w - t2
        join_s = landing.join_s if layered else t3 - t2w
        if self.learn:
            if front and got:
                self.model.observe_join((front + got) * tpc, join_s)
            if front:
                self.model.observe_prefill(0, front * tpc, t2 - tf)
            # a layered forward's own work: its waits for groups and joins taken off
            compute = rest_s - (wait_s + join_s if layered and got == count else 0.0)
            self.model.observe_prefill(pre.cached_tokens, n - pre.cached_tokens, compute)
        pre.lookup_s, pre.load_s = t1 - t0, load_s
        c = self.counters
        c.plans[plan.kind.value] = c.plans.get(plan.kind.value, 0) + 1
        c.chunks_loaded += got
        c.fallback_chunks += count - got
        c.chunks_recomputed += len(hits) - got
        return PlannedPrefill(
            prefill=pre,
            plan=plan,
            loaded=got,
            fallback=count - got,
            ttft_s=t4 - t0,
            lookup_s=t1 - t0,
            front_s=t2 - tf,
            load_s=load_s,
            rest_s=rest_s,
            wait_s=wait_s,
            join_s=join_s,
            main_cpu_s=main_cpu,
            other_cpu_s=other_cpu,
            cpu_s={
                "lookup_s": m1 - m0,
                "front_s": m2 - mf,
                "join_s": m3 - m2w,
                "rest_s": m4 - m3,
            },
            layered=layered,
            abandoned_layer=abandoned_layer,
            abandoned_s=abandoned_s,
        )

    def settle(self, timeout: float | None = None) -> bool:
        """Wait for the loads abandoned at their deadline or a miss to end (they still
        hold the store's I/O threads and the tier); True when none is left."""
        end = None if timeout is None else time.perf_counter() + timeout
        while self._abandoned:
            left = None if end is None else max(0.0, end - time.perf_counter())
            if not self._abandoned[0].join(left):
                return False
            self._abandoned.pop(0)
        return True

    def generate(
        self,
        ids: Sequence[int],
        namespace: Namespace,
        *,
        max_new_tokens: int = 16,
        policy: Policy = choose,
    ) -> tuple[list[int], PlannedPrefill]:
        """Greedy tokens after a planned prefill (nothing is stored)."""
        done = self.prefill(ids, namespace, policy=policy)
        out, _, _ = self.engine.decode(done.prefill, len(ids), max_new_tokens, stop_at_eos=False)
        return out, done


class _Loading:
    """An asynchronous load and the time its last chunk completed (a watcher thread
    waits for it, so the time is the load's own, not when the engine looked)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.finished_at: float | None = None
        self._watch = threading.Thread(target=self._wait, daemon=True, name="kvlife-plan-load")
        self._watch.start()

    def _wait(self) -> None:
        # a failed load only ends sooner here: the engine sees its miss through chunk()
        with contextlib.suppress(Exception):
            self.handle.wait()
        self.finished_at = time.perf_counter()

    def join(self, timeout: float | None) -> bool:
        self._watch.join(timeout)
        return not self._watch.is_alive()

    def take(self, count: int, deadline: float) -> tuple[int, bool]:
        """Chunks that arrived in order by ``deadline`` (infinite: wait), and whether it
        passed first."""
        for i in range(count):
            left = None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
            try:
                arr = self.handle.chunk(i, timeout=left)
            except TimeoutError:
                return i, True
            except KVLifeError:  # a failed load (store closed...): a miss, recomputed
                return i, False
            if arr is None:
                return i, False
        return count, False


def _take_all(loads: Sequence[_Loading], count: int, deadline: float) -> tuple[int, bool]:
    """Chunks whose every layer group arrived in order by ``deadline``, and whether it
    passed first (a group that came short ends the wait: later groups cannot add)."""
    got, timed_out = count, False
    for x in loads:
        n, late = x.take(got, deadline)
        got, timed_out = min(got, n), timed_out or late
        if not got:
            break
    return got, timed_out


class _Landing:
    """The loaded prefix handed to a layered forward: layer ``l``'s first update waits
    for its group's ``count`` chunks (by the deadline), then takes the computed front's
    layer joined to the group's loaded positions."""

    def __init__(
        self,
        eng: HFEngine,
        loads: Sequence[_Loading],
        front: Any,
        front_tokens: int,
        buf: np.ndarray,
        count: int,
        deadline: float,
    ) -> None:
        self.eng, self.loads, self.front, self.front_tokens = eng, loads, front, front_tokens
        self.buf, self.count, self.deadline = buf, count, deadline
        lay = eng.identity.layout
        self.group_of = layer_group_index(lay.num_layers, eng.layer_groups)
        self.landed = [False] * len(loads)
        self.wait_s = 0.0
        """Time layers waited for their groups."""
        self.join_s = 0.0
        """Time spent making each layer's prefix (views, or the front joined to them)."""

    def cache(self) -> Any:
        lay = self.eng.identity.layout
        tokens = self.front_tokens + self.count * lay.tokens_per_chunk
        return landing_cache(self.eng.config, lay.num_layers, tokens, self.land)

    def land(self, layer: int) -> tuple[Any, Any]:
        g = self.group_of[layer]
        t0 = time.perf_counter()
        if not self.landed[g]:
            got, timed_out = self.loads[g].take(self.count, self.deadline)
            if got < self.count:
                raise GroupUnavailable(g, layer, got, timed_out)
            self.landed[g] = True
        t1 = time.perf_counter()
        lay = self.eng.identity.layout
        tokens = self.count * lay.tokens_per_chunk
        k = to_torch(self.buf[layer, 0, :, :tokens], lay.dtype)[None]
        v = to_torch(self.buf[layer, 1, :, :tokens], lay.dtype)[None]
        if self.front_tokens:
            torch = self.eng.torch
            fk = self.front.layers[layer].keys[:, :, : self.front_tokens]
            fv = self.front.layers[layer].values[:, :, : self.front_tokens]
            k, v = torch.cat([fk, k], dim=2), torch.cat([fv, v], dim=2)
        self.wait_s += t1 - t0
        self.join_s += time.perf_counter() - t1
        return k, v


def _joined(eng: HFEngine, front: Any, front_tokens: int, buf: np.ndarray, tokens: int) -> Any:
    """A cache of the computed front's ``front_tokens`` positions followed by the first
    ``tokens`` loaded positions of ``buf`` (layers, 2, heads, T, dim)."""
    if not front_tokens:
        return eng._inject(buf, tokens)
    if not tokens:
        return front
    torch = eng.torch
    lay = eng.identity.layout
    cache = eng._new_cache()
    for layer in range(lay.num_layers):
        fk = front.layers[layer].keys[:, :, :front_tokens]
        fv = front.layers[layer].values[:, :, :front_tokens]
        lk = to_torch(buf[layer, 0, :, :tokens], lay.dtype)[None]
        lv = to_torch(buf[layer, 1, :, :tokens], lay.dtype)[None]
        cache.update(torch.cat([fk, lk], dim=2), torch.cat([fv, lv], dim=2), layer)
    return cache


# ---------------------------------------------------------------------- the prefill profile


def _engine_label(engine: HFEngine) -> str:
    torch = engine.torch
    return f"{engine.identity.model_id} weights={engine.identity.weights_digest[:16]} " + (
        f"threads={torch.get_num_threads()} profile=v{PROFILE_VERSION}"
    )


def measure_prefill(
    engine: HFEngine,
    points: Sequence[tuple[int, int]] = PROFILE_POINTS,
    *,
    repeats: int = 2,
    seed: int = 0,
) -> PrefillProfile:
    """Time prefills of ``length`` tokens after ``start`` cached ones (the median of
    ``repeats``: the best of a few is biased low on a shared machine) and fit the
    profile, the per-cached-token term included. Each start's prefix is prefilled once and
    copied for every repeat (untimed). Positions past the model's are skipped."""
    rng = np.random.default_rng(seed)
    vocab = int(getattr(engine.config, "vocab_size", 1000))
    samples = []
    prefixes: dict[int, tuple[list[int], Any]] = {}
    for start, length in points:
        if start + length > engine.max_positions:
            continue
        if start and start not in prefixes:
            head = rng.integers(0, vocab, start).tolist()
            prefixes[start] = (head, engine._prefill_suffix(head, engine._new_cache(), 0).cache)
        head, prefix_cache = prefixes.get(start, ([], None))
        ids = head + rng.integers(0, vocab, length).tolist()
        times = []
        for _ in range(repeats):
            cache = copy.deepcopy(prefix_cache) if start else engine._new_cache()
            t0 = time.perf_counter()
            engine._prefill_suffix(ids, cache, 0)
            times.append(time.perf_counter() - t0)
        samples.append(PrefillSample(start, length, statistics.median(times)))
    return PrefillProfile.fit(samples, _engine_label(engine), cached_term=True)


def prefill_profile(engine: HFEngine, *, cache: Path | None = None) -> PrefillProfile:
    """The engine's profile from ``cache`` (default: kvlife's cache directory) when one
    was measured for the same model and thread count, else measured now and saved."""
    label = _engine_label(engine)
    path = cache or cache_dir() / "prefill-profiles" / (
        "".join(ch if ch.isalnum() else "_" for ch in label)[:120] + ".json"
    )
    if path.exists():
        try:
            got = PrefillProfile.load(path)
            if got.engine == label:
                return got
        except ValueError:
            pass  # a damaged profile: measure again
    prof = measure_prefill(engine)
    prof.save(path)
    return prof
