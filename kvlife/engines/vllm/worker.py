"""The worker side of the kvlife connector: loads into and saves from vLLM's paged KV.

Loads (``start``): for each planned load the worker looks the prefix up again under its
own identity (its tensor-parallel shard), starts an asynchronous verified load of the
chunks into host buffers, and a loader thread writes them into the paged cache layer by
layer, setting one event per layer, so attention of layer ``l`` (which waits in
``wait_layer``) starts while later layers are still being written. A chunk that is
missing or fails verification, and every chunk after it, is not written: its blocks are
reported by ``load_errors`` and vLLM recomputes them (never served). A load that fails
part-way (the server dropped, a chunk corrupt) is the same: the chunks that arrived
whole are written, the rest recomputed. So is a load still running at its deadline
(``LoadSpec.deadline_s``, from the scheduler's planner or ``kvlife.load_timeout_ms``):
the chunks that arrived by then are written, the rest are abandoned (never written, late
or not) and recomputed, counted (``loads_timed_out``). Each load's time is reported to
the scheduler (``StepReport.loads``), whose cost model learns the tiers' speed from it.

A load never fails the engine's step. Whatever raises on its way (a spec that does not
fit its tokens, refused where it is received: ``LoadSpec.check``; the store's lookup or
read, a kvlife error or not; the copy into the paged cache; the re-check after it), the
chunks not written whole into every layer, the one whose copy began and failed included,
are load errors: reported, recomputed by vLLM (which overwrites those blocks), counted
by reason (``load_failures``) and logged once; the step goes on. ``submit`` (vLLM's
``wait_for_save``) waits for the step's copy before it returns, so no write of a step
lands in blocks vLLM has taken back; after a forward that raised, the copy writes no
further chunk.

A DRAM hit is read as the replica itself (no copy before the one into the paged cache),
in ``start``'s own thread: handing each chunk to the store's I/O pool would cost a
thread hand-off per chunk, each waiting for a core on a busy host. Its copy into the
paged cache runs later, so where the store verifies memory replicas
(``verify_dram_on_load``) they are verified again once copied: one changed in between is
a load error from there on. Where every layer lives in one allocation a constant stride
apart (vLLM 0.32's CPU cache) each chunk is copied straight into its blocks of a group
of layers with one indexed copy (``paged.write_chunk``; ``LOAD_GROUPS`` groups, each
group's events set as it is written, so the forward's first layers run while later ones
are written); otherwise every chunk of the step is laid out as the paged cache's block
rows (one copy per chunk, all layers), then each layer's rows are written with one
indexed copy. No Python loop over chunks x layers.

Saves are all-or-nothing across layers and ranks. During the step ``save_layer`` copies
each layer's blocks of every planned save out of the paged cache into one host array of
block rows (one indexed copy per layer), recording which layers it gathered; at
``submit`` (vLLM's ``wait_for_save``, which runs even when the forward raised) the
chunks of a request are staged with ``prepare_put`` (TENTATIVE, invisible), laid out as
chunks by a stager thread off the step's path, only if every layer of every chunk was
gathered, no load of the request (nor of a block it shares with another
request through vLLM's prefix cache) failed on this rank and no exception is
propagating. The worker then reports the step (:class:`StepReport`) and holds the
staged puts until the scheduler's verdict arrives with a later step's plan: commit
(``put_async``) once every rank reported success for the request, abort otherwise. A
worker that shuts down aborts what it still holds. Put failures are counted, never
raised into the engine: a missing chunk is a future miss, not wrong KV.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.core.identity import ModelIdentity
from kvlife.core.payload import numpy_dtype
from kvlife.engines.vllm.faults import LayerFault
from kvlife.engines.vllm.identity import with_adapter
from kvlife.engines.vllm.meta import (
    LoadSample,
    LoadSpec,
    SaveSpec,
    SaveVerdict,
    StepPlan,
    StepReport,
)
from kvlife.engines.vllm.paged import (
    PagedLayer,
    chunk_to_rows,
    rows_to_chunk,
    stack_layers,
    write_chunk,
)
from kvlife.engines.vllm.stores import StoreAPI
from kvlife.results import LoadResult

log = logging.getLogger("kvlife.vllm")

LOAD_FAILURES = {
    "spec": "a LoadSpec that does not fit its tokens (LoadSpec.check): refused whole",
    "lookup": "the worker's lookup of the load, or the start of its read, raised",
    "read": "the read raised part-way (the server dropped, an I/O error, a bug)",
    "copy": "the copy into the paged cache raised",
    "verify": "the re-check of a memory replica after its copy raised",
    "loader": "the loader raised outside its reads and copies (a bug): none of it is kept",
    "step_failed": "the forward raised before the copy ended: the rest was not written",
}
"""Reasons of ``WorkerCounters.load_failures``."""

LOAD_GROUPS = 6
"""A step's loads are written into the paged cache in this many groups of layers (where
the layers share one allocation), each group's event set as soon as it is written: the
forward's attention of layer 0 then waits for a sixth of the copy, not all of it, at a
cost of one more numpy call per chunk per group (about 10 us each)."""


def memory_tiers(store: StoreAPI) -> frozenset[str]:
    """Tiers of an embedded store that hold replicas in memory (a load of them is a
    pointer, not a read); none for a served store (its loads cross the socket)."""
    from kvlife.store.facade import KVStore
    from kvlife.tiers.base import SealedInMemory

    if not isinstance(store, KVStore):
        return frozenset()
    return frozenset(n for n in store.tier_names if isinstance(store.tier(n), SealedInMemory))


def verifies_memory(store: StoreAPI) -> bool:
    """Whether an embedded store verifies replicas held in memory against their seals on
    every load (``verify_dram_on_load``)."""
    from kvlife.store.facade import KVStore

    return isinstance(store, KVStore) and bool(store._core.config.verify_dram_on_load)


def layer_groups(layers: int, groups: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges splitting ``layers`` into at most ``groups`` near-equal runs."""
    n = max(1, min(groups, layers))
    cuts = [layers * i // n for i in range(n + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(cuts) if hi > lo]


@dataclass(slots=True)
class WorkerCounters:
    loads: int = 0
    tokens_loaded: int = 0
    """Tokens written into the paged cache from kvlife."""
    blocks_failed: int = 0
    """Blocks reported to vLLM as failed loads (recomputed by it)."""
    loads_timed_out: int = 0
    """Loads still running at their deadline: the chunks not arrived were abandoned and
    their blocks reported as failed loads (recomputed by vLLM)."""
    chunks_timed_out: int = 0
    """Chunks abandoned at a load's deadline."""
    chunks_changed: int = 0
    """Chunks read as a replica held in memory whose bytes no longer matched its seal
    once copied into the paged cache (changed after the verified read): load errors from
    there on, recomputed (only with ``verify_dram_on_load``)."""
    saves: int = 0
    """Saves staged (``prepare_put``), awaiting the scheduler's verdict."""
    chunks_stored: int = 0
    chunks_present: int = 0
    put_errors: int = 0
    saves_skipped: int = 0
    """Saves not staged because the request's load failed in the same step on this rank
    (its KV after the failed blocks was computed on garbage); vLLM recomputes and they
    are saved then."""
    saves_incomplete: int = 0
    """Saves not staged because the forward did not complete: a layer of a chunk was
    not gathered, or an exception was propagating."""
    saves_refused: int = 0
    """Saves not staged because their spec did not fit its tokens (``SaveSpec.check``:
    too few block ids, say); logged, and failed on every rank through the report."""
    saves_committed: int = 0
    """Staged saves committed on the scheduler's verdict."""
    saves_aborted: int = 0
    """Staged saves rolled back: another rank failed the request in that step, or the
    step was never confirmed before shutdown."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Chunks loaded per tier."""
    load_failures: dict[str, int] = field(default_factory=dict)
    """Loads that failed by an error rather than a miss, per reason (:data:`LOAD_FAILURES`),
    each logged once: the chunks they left not written whole into every layer are load
    errors (``blocks_failed``), recomputed by vLLM; the step goes on."""


@dataclass(slots=True)
class WorkerTimings:
    """Where the connector's time goes (seconds, summed over steps): the breakdown in
    docs/vllm.md and the ``connector_load_vs_memcpy`` figure of ``kvlife bench vllm``."""

    load_steps: int = 0
    load_bytes: int = 0
    """Bytes written into the paged cache from kvlife."""
    lookup_s: float = 0.0
    """The worker's own lookup of each planned load (its rank's keys) and the start of
    the asynchronous read (for hits held in memory, the whole read: a pointer each)."""
    read_s: float = 0.0
    """Waiting for the store's copy of the chunks into host buffers (verified)."""
    prep_s: float = 0.0
    """Turning the host chunks into what the paged cache's copy takes (index tensors,
    the chunks laid out as blocks)."""
    scatter_s: float = 0.0
    """The indexed copies into the paged cache, all layers."""
    load_s: float = 0.0
    """A step's load from ``start`` until the last layer's event is set."""
    wait_s: float = 0.0
    """The forward blocked in ``wait_layer`` (the load's cost on the step's path)."""
    save_steps: int = 0
    save_bytes: int = 0
    gather_s: float = 0.0
    """Copies out of the paged cache into the staging buffers (in the forward)."""
    stage_s: float = 0.0
    """``submit``: staging the step's saves (``prepare_put``) and the verdicts."""
    stager_s: float = 0.0
    """The stager thread laying gathered saves out as chunks and staging them (wall
    time, off the step's path)."""
    stager_cpu_s: float = 0.0
    """The same, the stager thread's CPU time (``time.thread_time``): what it takes from
    the engine's cores."""


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    handle: Any
    first_chunk: int
    chunks: int
    sizes: list[tuple[str, int]] = field(default_factory=list)
    """Tier and stored bytes of each chunk (what the scheduler's cost model learns from)."""
    lookup: Any = None
    """The lookup the chunks were loaded by (verified again after the copy)."""


@dataclass(slots=True)
class _Piece:
    """A chunk of a load that arrived whole, to be written into its blocks."""

    job: _Load
    chunk: int
    """The chunk's index in its request."""
    arr: np.ndarray
    skip: int
    """Leading blocks of the chunk not written (vLLM's prefix cache holds them)."""
    tokens: int
    """Tokens it writes."""


class _Loaded:
    """A load already read (hits held in memory), behind the load handle's interface."""

    def __init__(self, result: LoadResult) -> None:
        self.result = result

    def chunk(self, i: int, timeout: float | None = None) -> np.ndarray | None:
        got = self.result.arrays
        return got[i] if i < len(got) else None

    def wait(self) -> LoadResult:
        return self.result


class _RowBuffers:
    """Host buffers the saves' gather copies block rows into, reused from step to step.
    A fresh buffer of a step's rows (12 MB a request here) costs a page fault per page
    on its first write, in the gather, on the step's path (about a third of the
    gather's time, docs/vllm.md); a buffer comes back once the stager has laid every
    save of its step out as chunks (those are new arrays the store keeps, never these),
    so no gather writes rows still being read."""

    KEEP = 2
    """Free buffers kept (the largest): the step being gathered and the one the stager
    is laying out."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
        """A buffer of at least the bytes of ``shape`` and the array of ``shape`` over it."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw: np.ndarray | None = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:  # the smallest that fits (by index: == on arrays compares elements)
                raw = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if raw is None:
            raw = np.empty(nbytes, np.uint8)
        return raw, raw[:nbytes].view(dtype).reshape(shape)

    def give(self, raw: np.ndarray) -> None:
        with self._lock:
            self._free.append(raw)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            del self._free[self.KEEP :]


@dataclass(slots=True)
class _SaveStep:
    """The step's planned saves, gathered layer by layer into one array of block rows
    ``(layers, blocks, heads, 2, block_size, head_dim)``: spec ``i``'s blocks are rows
    ``[starts[i], starts[i + 1])``, read with one indexed copy per layer."""

    step: int
    specs: list[SaveSpec]
    starts: list[int]
    block_ids: np.ndarray
    rows: np.ndarray
    refused: set[int] = field(default_factory=set)
    """Indices of specs that do not fit their tokens (``SaveSpec.check``): no rows."""
    gathered: set[int] = field(default_factory=set)
    """Layer indices copied into ``rows`` this step."""
    raw: np.ndarray | None = None
    """The pooled buffer under ``rows`` (:class:`_RowBuffers`)."""
    readers: int = 0
    """Saves of the step the stager has still to lay out; the buffer goes back at 0."""


@dataclass(slots=True)
class _Held:
    """A staged put (TENTATIVE in the store) awaiting the scheduler's verdict; staged in
    the background (``pending`` resolves to the store's pending put, or None when
    ``prepare_put`` failed, counted)."""

    req_id: str
    pending: Future[Any]


class WorkerSide:
    """Loads and saves of one worker (one tensor-parallel rank of one pipeline stage)."""

    def __init__(
        self,
        store: StoreAPI,
        identity: ModelIdentity,
        *,
        block_size: int,
        rank: int = 0,
        fault: LayerFault | None = None,
    ) -> None:
        self.store = store
        self.identity = identity
        self._memory_tiers = memory_tiers(store)
        self._verify = verifies_memory(store)
        self.block_size = block_size
        self.rank = rank
        """Global rank (stage-major: ``pp_rank * tp_size + tp_rank``) in step reports."""
        self.fault = fault
        lay = identity.layout
        self.tpc = lay.tokens_per_chunk
        self.layers: list[PagedLayer] = []
        self._stack: np.ndarray | None = None
        self.layer_index: dict[str, int] = {}
        self.counters = WorkerCounters()
        self.timings = WorkerTimings()
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        """Requests whose load failed this step: whatever this step computed after the
        failed blocks attended to garbage, so none of it is saved."""
        self._failed_blocks: set[int] = set()
        """Blocks this step's loads did not fill. vLLM's prefix cache may hand them to
        other requests of the same step (a sync load caches its blocks at allocation):
        what those computed attended to the same garbage, so their saves are failed
        too."""
        self._events: list[threading.Event] | None = None
        self._loader: Future[None] | None = None
        self._stop = threading.Event()
        """Set when the step's forward failed: the loader writes no more chunks."""
        self._traced: set[str] = set()
        """Load failure reasons whose traceback was logged (once each)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlife-vllm-load")
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="kvlife-vllm-stage")
        """Lays gathered saves out as chunks and stages them (``prepare_put``), off the
        step's path."""
        self._saving: _SaveStep | None = None
        self._buffers = _RowBuffers()
        self._held: dict[int, list[_Held]] = {}
        """Staged puts per step, until the verdict on that step arrives."""
        self._report = StepReport()
        self._puts: list[Future[Any]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup

    def register(self, names: list[str], tensors: list[Any], split: str) -> None:
        lay = self.identity.layout
        if len(names) != lay.num_layers:
            raise KVLifeError(
                f"vLLM registered {len(names)} KV layers; the identity says {lay.num_layers}"
            )
        self.layers = [PagedLayer(t, split, lay.num_kv_heads, lay.head_dim) for t in tensors]
        self._stack = stack_layers(self.layers)
        """All layers as one view when they share an allocation (CPU): a chunk is then
        copied straight into its blocks of a group of layers with one copy."""
        self._groups = layer_groups(len(self.layers), LOAD_GROUPS)
        rows = self.layers[0].row_shape if self.layers else (0,)
        self._block_nbytes = (
            len(self.layers) * int(np.prod(rows)) * (self.layers[0].itemsize if self.layers else 0)
        )
        self.layer_index = {n: i for i, n in enumerate(names)}
        if self.layers and self.layers[0].block_size != self.block_size:
            raise KVLifeError(
                f"paged KV blocks hold {self.layers[0].block_size} tokens, vLLM's block size "
                f"is {self.block_size}"
            )

    # ------------------------------------------------------------------ loads

    def start(self, plan: StepPlan) -> None:
        """Start this step's loads (before the forward)."""
        self._join_loads(failed=False)  # vLLM ended the last step with wait_for_save
        self._events = None
        self._failed = set()
        self._failed_blocks = set()
        if not plan.loads:
            return
        t0 = time.perf_counter()
        specs = self._checked(plan.loads)
        jobs = [job for job in (self._begin(spec) for spec in specs) if job is not None]
        self.timings.lookup_s += time.perf_counter() - t0
        self.timings.load_steps += 1
        events = [threading.Event() for _ in self.layers]
        self._events = events
        self._stop = threading.Event()
        self._loader = self._pool.submit(self._write_layers, jobs, events, t0, self._stop)

    def _checked(self, specs: list[LoadSpec]) -> list[LoadSpec]:
        """The specs that fit their tokens (:meth:`LoadSpec.check`); each other one is
        refused, counted (``spec``) and its blocks from its first token on reported as
        load errors. One that names no block vLLM could be told to recompute raises its
        error before any load starts: reporting nothing would let vLLM use the unwritten
        blocks as computed (the step fails instead)."""
        good: list[LoadSpec] = []
        for spec in specs:
            try:
                spec.check(self.block_size, self.tpc)
            except InvalidArgument as exc:
                first = min(spec.first_token, spec.end_token) // self.block_size
                # the blocks it names from its first token on, else its last one (a block
                # vLLM's prefix cache holds: recomputed from there, more than needed)
                bad = spec.block_ids[first : spec.end_token // self.block_size]
                bad = bad or spec.block_ids[-1:]
                if not bad:
                    raise
                self.counters.loads += 1
                self._load_failed("spec", spec.req_id, exc)
                self._fail_blocks(spec.req_id, set(bad))
                continue
            good.append(spec)
        return good

    def _begin(self, spec: LoadSpec) -> _Load | None:
        identity = with_adapter(self.identity, spec.adapter)
        c0, c1 = spec.first_token // self.tpc, spec.end_token // self.tpc
        self.counters.loads += 1
        try:
            hit = self.store.lookup(identity, spec.namespace, spec.tokens)
            sub = hit.sub(c0, c1)  # a served store's answer keeps its layout and hints
            usable = len(sub.hits)
            # no output buffers: a DRAM hit is handed over as the replica itself
            # (read-only, kept alive while referenced), so the only copy of its bytes is
            # the one into the paged cache's layout. Hits held in memory are read here,
            # in this thread (a pointer each, verified as the store verifies them): the
            # I/O pool would cost a thread hand-off per chunk, which on a busy 2-core
            # host waits for a core each time
            if usable and all(h.tier in self._memory_tiers for h in sub.hits):
                handle: Any = _Loaded(self.store.load(sub, None, request_id=spec.req_id))
            else:
                handle = self.store.load_async(sub, None, request_id=spec.req_id)
        except Exception as exc:  # whatever the store raised: recomputed, not fatal
            self._load_failed("lookup", spec.req_id, exc)
            self._fail(spec, c0)
            return None
        if usable < c1 - c0:
            self._fail(spec, c0 + usable)
        sizes: list[tuple[str, int]] = [(h.tier, h.stored_nbytes) for h in sub.hits]
        return _Load(spec, handle, c0, usable, sizes, sub)

    def _load_failed(self, reason: str, what: str, exc: BaseException | str) -> None:
        """Count (``load_failures[reason]``) and log, once, a load that failed by an
        error rather than a miss; its unwritten chunks are reported by the caller."""
        # a kvlife error is a failure the store expects (the server dropped, an I/O
        # error); anything else is a bug somewhere, whose traceback is worth logging,
        # once per reason (a bug that fails every step would repeat it every step)
        bug = isinstance(exc, BaseException) and not isinstance(exc, KVLifeError)
        with self._lock:  # counted from the loader thread too
            n = self.counters.load_failures
            n[reason] = n.get(reason, 0) + 1
            trace = bug and reason not in self._traced
            if trace:
                self._traced.add(reason)
        log.warning(
            "kvlife load of %s failed (%s), recomputed: %s", what, reason, exc, exc_info=trace
        )

    def _fail(self, spec: LoadSpec, from_chunk: int) -> None:
        """Blocks of ``spec`` from chunk ``from_chunk`` on did not load."""
        first_block = max(spec.first_token, from_chunk * self.tpc) // self.block_size
        self._fail_blocks(
            spec.req_id, set(spec.block_ids[first_block : spec.end_token // self.block_size])
        )

    def _fail_blocks(self, req_id: str, bad: set[int]) -> None:
        with self._lock:
            self._failed.add(req_id)
            self._failed_blocks |= bad
            new = bad - self._errors
            self._errors |= new
            self.counters.blocks_failed += len(new)

    def _arrived(self, job: _Load, t0: float) -> list[np.ndarray]:
        """Leading chunks of ``job`` that arrived whole by its deadline (``deadline_s``
        after ``t0``, the step's start of loads). A failure of the handle (the server
        dropped mid-load, or anything else it raises) ends the run there, as does the
        deadline: recomputed, never raised; chunks arriving after the deadline are never
        written."""
        got: list[np.ndarray] = []
        limit = job.spec.deadline_s
        try:
            for i in range(job.chunks):
                left = None if limit is None else max(0.0, t0 + limit - time.perf_counter())
                try:
                    arr = job.handle.chunk(i, timeout=left)
                except TimeoutError:
                    self.counters.loads_timed_out += 1
                    self.counters.chunks_timed_out += job.chunks - i
                    log.warning(
                        "kvlife load of %s ran past its deadline (%.3f s) at chunk %d of "
                        "%d: the rest is recomputed",
                        job.spec.req_id,
                        limit,
                        i,
                        job.chunks,
                    )
                    # what it waited for bounds the tier's speed from above
                    self._observe(job, i + 1, time.perf_counter() - t0)
                    return got
                if arr is None:
                    break
                got.append(arr)
            if len(got) == job.chunks:
                self._observe(job, len(got), time.perf_counter() - t0)
            res = job.handle.wait()
            for tier, n in res.tiers.items():
                self.counters.tiers[tier] = self.counters.tiers.get(tier, 0) + n
        except Exception as exc:  # the chunks before it arrived whole: kept
            self._load_failed("read", job.spec.req_id, exc)
        return got

    def _observe(self, job: _Load, chunks: int, seconds: float) -> None:
        """Report ``job``'s first ``chunks`` as loaded in ``seconds`` (one tier only: a
        load across tiers does not say which was slow)."""
        sizes = job.sizes[:chunks]
        tiers = {t for t, _ in sizes}
        if len(tiers) == 1 and seconds > 0:
            sample = LoadSample(tiers.pop(), sum(n for _, n in sizes), seconds)
            with self._lock:
                self._report.loads.append(sample)

    def _write_layers(
        self,
        jobs: list[_Load],
        events: list[threading.Event],
        t0: float,
        stop: threading.Event,
    ) -> None:
        """(Loader thread.) Wait for the step's chunks and write them into their blocks
        (:meth:`_copy`); each layer's event is set once it is written, every one of them
        whatever happens. Never raises: a chunk not written whole into every layer, for
        any reason, is a load error (its blocks reported, vLLM recomputes them), so a
        failed load never fails the engine's step."""
        tm = self.timings
        bs = self.block_size
        pieces: list[_Piece] = []  # chunks that arrived whole, in the step's order
        block_ids: list[int] = []
        try:
            for job in jobs:
                spec = job.spec
                t1 = time.perf_counter()
                got = self._arrived(job, t0)
                tm.read_s += time.perf_counter() - t1
                if len(got) < job.chunks:
                    self._fail(spec, job.first_chunk + len(got))
                for i, arr in enumerate(got):
                    c = job.first_chunk + i
                    lo = max(spec.first_token, c * self.tpc)
                    hi = (c + 1) * self.tpc
                    pieces.append(_Piece(job, c, arr, (lo - c * self.tpc) // bs, hi - lo))
                    block_ids += spec.block_ids[lo // bs : hi // bs]
            done = self._copy(pieces, block_ids, events, stop)
            # the chunks not written whole into every layer (the one whose copy began and
            # failed included) are load errors: recomputed by vLLM, which overwrites them
            written: dict[int, int] = {}
            for p in pieces[:done]:
                written[id(p.job)] = written.get(id(p.job), 0) + 1
                self.counters.tokens_loaded += p.tokens
                tm.load_bytes += (self.tpc // bs - p.skip) * self._block_nbytes
            for p in pieces[done:]:
                if p.chunk == p.job.first_chunk + written.get(id(p.job), 0):
                    self._fail(p.job.spec, p.chunk)
            if self._verify:
                self._verify_copied([(job, written.get(id(job), 0)) for job in jobs])
            tm.load_s += time.perf_counter() - t0
        except Exception as exc:  # a bug outside the copy: nothing of the step is trusted
            self._load_failed("loader", ", ".join(j.spec.req_id for j in jobs), exc)
            for job in jobs:
                self._fail(job.spec, job.first_chunk)
        finally:
            for e in events:  # a failure must not hang the forward
                e.set()

    def _copy(
        self,
        pieces: list[_Piece],
        block_ids: list[int],
        events: list[threading.Event],
        stop: threading.Event,
    ) -> int:
        """Write ``pieces`` into their blocks (``block_ids``, in order): straight from
        each chunk into a group of layers at a time where the layers are one stacked
        view, else laid out as block rows (one copy per chunk, all layers) then one
        indexed copy per layer; each layer's event is set once it is written. The
        number of leading pieces written whole into every layer: a copy that raises
        ends it there (counted, ``copy``), as does the step's forward failing before
        the copy finished (``stop``; counted, ``step_failed``)."""
        if not pieces:
            return 0
        tm = self.timings
        bs = self.block_size
        k = self.tpc // bs
        done = 0
        try:
            if self._stack is not None:
                t2 = time.perf_counter()
                ids = np.asarray(block_ids, dtype=np.int64)
                spans = []  # each chunk's blocks in ``ids``
                at = 0
                for p in pieces:
                    spans.append((p.arr, p.skip, ids[at : at + k - p.skip]))
                    at += k - p.skip
                # straight from the replicas into the blocks, a group of layers at a time
                # (one copy per chunk per group), so attention of the first layers runs
                # while later ones are written; a chunk is whole once the last group has it
                last = len(self._groups) - 1
                for g, (lo, hi) in enumerate(self._groups):
                    self._copy_fault(lo, hi)
                    stack = self._stack[lo:hi]
                    for j, (arr, skip, span) in enumerate(spans):
                        if stop.is_set():
                            return self._stopped(pieces, done)
                        write_chunk(stack, span, arr[lo:hi], skip)
                        if g == last:
                            done = j + 1
                    for e in events[lo:hi]:
                        e.set()
                tm.scatter_s += time.perf_counter() - t2
            elif self.layers:
                t2 = time.perf_counter()
                lay = self.identity.layout
                shape = (lay.num_layers, len(block_ids), *self.layers[0].row_shape)
                rows = np.empty(shape, pieces[0].arr.dtype)
                at = 0
                for p in pieces:
                    n = k - p.skip
                    chunk_to_rows(p.arr, bs, p.skip, rows[:, at : at + n])
                    at += n
                ids = np.asarray(block_ids, dtype=np.int64)
                t3 = time.perf_counter()
                tm.prep_s += t3 - t2
                for layer, paged in enumerate(self.layers):
                    self._copy_fault(layer, layer + 1)
                    if stop.is_set():
                        return self._stopped(pieces, done)
                    paged.write_rows(ids, rows[layer])
                    events[layer].set()
                done = len(pieces)
                tm.scatter_s += time.perf_counter() - t3
        except Exception as exc:
            reqs = dict.fromkeys(p.job.spec.req_id for p in pieces[done:])
            self._load_failed("copy", ", ".join(reqs), exc)
        return done

    def _copy_fault(self, lo: int, hi: int) -> None:
        """The test hook's copy fault (``kvlife.fail_layer = "copy:L"``), raised in the
        copy into layers ``[lo, hi)`` as a bug in the scatter would."""
        if self.fault is not None:
            for layer in range(lo, hi):
                self.fault.check("copy", layer)

    def _stopped(self, pieces: list[_Piece], done: int) -> int:
        reqs = ", ".join(dict.fromkeys(p.job.spec.req_id for p in pieces[done:]))
        self._load_failed("step_failed", reqs, "the step's forward raised before its copy ended")
        return done

    def _verify_copied(self, written: list[tuple[_Load, int]]) -> None:
        """(Loader thread, after the copies.) A replica held in memory was verified when
        it was read, then copied later: one whose bytes changed in between (a stray
        write, a client writing a shared extent) would be in the paged cache. Verify
        them again now: a chunk that no longer matches its seal (or is gone, so cannot
        be checked) and every later one are load errors, recomputed, counted. Runs
        before the last layer's wait returns, so vLLM sees the errors; the forward may
        have used the layers already released, and vLLM discards what it computed."""
        for job, n in written:
            if not n or not any(t in self._memory_tiers for t, _ in job.sizes[:n]):
                continue
            try:
                res = self.store.load(job.lookup.sub(0, n), None, request_id=job.spec.req_id)
                ok = res.loaded
            except Exception as exc:  # cannot say the copy is whole: recomputed
                self._load_failed("verify", job.spec.req_id, exc)
                ok = 0
            if ok < n:
                log.warning(
                    "kvlife load of %s: chunk %d changed after it was read; recomputed",
                    job.spec.req_id,
                    job.first_chunk + ok,
                )
                with self._lock:
                    self.counters.chunks_changed += n - ok
                self._fail(job.spec, job.first_chunk + ok)

    def wait_layer(self, name: str) -> None:
        idx = self.layer_index.get(name)
        events = self._events
        if events is None or idx is None:
            return
        if self.fault is not None:
            self.fault.check("load", idx)
        t0 = time.perf_counter()
        events[idx].wait()
        self.timings.wait_s += time.perf_counter() - t0
        if idx == len(events) - 1 and self._loader is not None:
            # the load's errors are all known before the last layer's attention (the
            # loader never raises: it reports what it did not write)
            self._loader.result()

    def _join_loads(self, *, failed: bool) -> None:
        """Wait for the step's loader: once vLLM's ``wait_for_save`` returns, the step's
        blocks are vLLM's again (reused, or recomputed after a failure), and a copy still
        writing into them would corrupt them; its load errors are then complete for
        ``get_block_ids_with_load_errors``. After a forward that raised (``failed``) the
        loader writes no further chunk (their blocks are load errors): the wait is for
        the copy in progress, or the read the loader is waiting on."""
        loader, self._loader = self._loader, None
        if loader is None:
            return
        if failed:
            self._stop.set()
        loader.result()

    def load_errors(self) -> set[int]:
        with self._lock:
            bad, self._errors = self._errors, set()
        return bad

    # ------------------------------------------------------------------ saves

    def save_layer(self, name: str, plan: StepPlan) -> None:
        """Copy layer ``name``'s blocks of every planned save of the step out of the
        paged cache (one indexed copy); they are laid out as chunks off the step's path
        (:meth:`submit`)."""
        if not plan.saves:
            return
        idx = self.layer_index.get(name)
        if idx is None:
            return
        if self.fault is not None:
            self.fault.check("save", idx)
        t0 = time.perf_counter()
        saving = self._saving
        if saving is None or saving.step != plan.step:
            saving = self._saving = self._save_step(plan)
        self.layers[idx].read_rows(saving.block_ids, saving.rows[idx])
        saving.gathered.add(idx)
        self.timings.save_bytes += saving.rows[idx].nbytes
        self.timings.gather_s += time.perf_counter() - t0

    def _save_step(self, plan: StepPlan) -> _SaveStep:
        lay = self.identity.layout
        starts = [0]
        ids: list[int] = []
        refused: set[int] = set()
        for i, spec in enumerate(plan.saves):
            try:
                spec.check(self.block_size, self.tpc)
            except InvalidArgument as exc:  # gathers nothing; failed at submit
                log.warning("kvlife save refused (not stored): %s", exc)
                refused.add(i)
                starts.append(len(ids))
                continue
            lo = spec.first_chunk * self.tpc // self.block_size
            hi = spec.end_chunk * self.tpc // self.block_size
            ids += spec.block_ids[lo:hi]
            starts.append(len(ids))
        row = self.layers[0].row_shape if self.layers else (0, 2, self.block_size, 0)
        raw, rows = self._buffers.take((lay.num_layers, len(ids), *row), numpy_dtype(lay.dtype))
        return _SaveStep(
            plan.step, list(plan.saves), starts, np.asarray(ids, np.int64), rows, refused, raw=raw
        )

    def submit(self, plan: StepPlan) -> None:
        """End of the step (vLLM's ``wait_for_save``, also after a forward that raised):
        carry out the verdicts on earlier steps, stage this step's complete saves and
        report the step. First waits for the step's copy into the paged cache (once this
        returns vLLM reuses the step's blocks); after a forward that raised, the copy
        writes no further chunk."""
        # an exception propagating through vLLM's finally: the forward did not complete
        raising = sys.exc_info()[0] is not None
        self._join_loads(failed=raising)
        self._events = None
        t0 = time.perf_counter()
        for verdict in plan.verdicts:
            self._settle(verdict)
        saving = self._saving if self._saving and self._saving.step == plan.step else None
        self._saving = None
        if plan.saves:
            failed = self._stage(plan, saving, raising)
            self._report.add(plan.step, self.rank, failed)
            self.timings.save_steps += 1
        self._reap(wait=False)
        self.timings.stage_s += time.perf_counter() - t0

    def _stage(self, plan: StepPlan, saving: _SaveStep | None, raising: bool) -> set[str]:
        """Decide the step's saves: the complete ones go to the stager (laid out as
        chunks and staged with ``prepare_put`` in the background); the requests this rank
        failed are returned."""
        failed: set[str] = set()
        staged: list[tuple[SaveSpec, np.ndarray]] = []
        complete = set(range(self.identity.layout.num_layers))
        with self._lock:
            bad_blocks = set(self._failed_blocks)
        for i, spec in enumerate(plan.saves):
            # a request whose own load failed, or one that shares a block that did not
            # load (vLLM's prefix cache): both attended to garbage in this step
            if spec.req_id in self._failed or not bad_blocks.isdisjoint(spec.block_ids):
                self.counters.saves_skipped += 1
                failed.add(spec.req_id)
                continue
            if saving is not None and i in saving.refused:
                self.counters.saves_refused += 1
                failed.add(spec.req_id)
                continue
            if raising or saving is None or saving.gathered != complete:
                self.counters.saves_incomplete += 1
                failed.add(spec.req_id)
                continue
            staged.append((spec, saving.rows[:, saving.starts[i] : saving.starts[i + 1]]))
        if saving is not None:
            # counted before the first is handed over: the stager may finish it at once
            saving.readers = len(staged)
            if not staged:
                self._release_rows(saving)
        for spec, rows in staged:
            assert saving is not None
            pending = self._stager.submit(self._prepare, spec, rows, saving)
            self._held.setdefault(plan.step, []).append(_Held(spec.req_id, pending))
        return failed

    def _release_rows(self, saving: _SaveStep) -> None:
        """The stager is done with one save of ``saving`` (or none was staged): the last
        gives the step's buffer back for a later gather."""
        with self._lock:
            saving.readers = max(0, saving.readers - 1)
            raw, last = saving.raw, saving.readers == 0
            if last:
                saving.raw = None
        if last and raw is not None:
            self._buffers.give(raw)

    def _prepare(self, spec: SaveSpec, rows: np.ndarray, saving: _SaveStep) -> Any | None:
        """(Stager thread.) ``rows`` (of ``saving``'s buffer) laid out as the spec's
        chunks, staged TENTATIVE."""
        lay = self.identity.layout
        k = self.tpc // self.block_size
        n = spec.end_chunk - spec.first_chunk
        identity = with_adapter(self.identity, spec.adapter)
        start = spec.first_chunk * self.tpc
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            try:
                chunks = np.empty((n, *lay.chunk_shape), numpy_dtype(lay.dtype))
                for c in range(n):
                    rows_to_chunk(rows[:, c * k : (c + 1) * k], chunks[c])
            finally:  # the rows are read: their buffer may take a later step's gather
                self._release_rows(saving)
            # the chunk before is named by its tokens, not by a key computed here: the
            # store derives the key in the namespace it writes (under kvlife serve
            # --tenants a keyed one, which only the server can compute)
            pending = self.store.prepare_put(
                identity,
                spec.namespace,
                spec.tokens[start:],
                list(chunks),
                start=start,
                prefix_tokens=spec.tokens[:start],
                request_id=spec.req_id,
            )
        except Exception as exc:  # any error: counted, a future miss, never the engine's
            self._put_error()
            log.warning(
                "kvlife put of %s failed (not stored): %s",
                spec.req_id,
                exc,
                exc_info=not isinstance(exc, KVLifeError),
            )
            return None
        finally:
            with self._lock:
                self.timings.stager_s += time.perf_counter() - t0
                self.timings.stager_cpu_s += time.thread_time() - c0
        with self._lock:
            self.counters.saves += 1
        return pending

    def _settle(self, verdict: SaveVerdict) -> None:
        """Commit or abort the puts staged in ``verdict.step``."""
        for held in self._held.pop(verdict.step, []):
            pending = held.pending.result()  # staged a step ago: done, or nearly
            if pending is None:  # prepare_put failed (counted): nothing to commit or abort
                continue
            if verdict.keeps(held.req_id):
                try:
                    self._puts.append(self.store.put_async(pending))
                    self.counters.saves_committed += 1
                except KVLifeError as exc:
                    self._put_error()
                    log.warning("kvlife put of %s failed (not stored): %s", held.req_id, exc)
            else:
                self._abort(held, f"step {verdict.step} failed on another rank or layer")

    def _put_error(self) -> None:
        with self._lock:  # counted from the stager thread too
            self.counters.put_errors += 1

    def _abort(self, held: _Held, reason: str) -> None:
        pending = held.pending.result()
        if pending is None:
            return
        self.counters.saves_aborted += 1
        try:
            self.store.abort_put(pending, reason)
        except KVLifeError as exc:  # the server dropped: it aborts the session's puts
            log.warning("kvlife abort of %s's put failed: %s", held.req_id, exc)

    def take_report(self) -> StepReport | None:
        """The steps this worker finished since the last call (vLLM's
        ``build_connector_worker_meta``)."""
        with self._lock:
            report, self._report = self._report, StepReport()
        return report if report else None

    @property
    def held_steps(self) -> list[int]:
        """Steps whose staged puts await a verdict."""
        return sorted(self._held)

    def _reap(self, *, wait: bool) -> None:
        left = []
        for fut in self._puts:
            if not wait and not fut.done():
                left.append(fut)
                continue
            try:
                res = fut.result()
                self.counters.chunks_stored += res.stored
                self.counters.chunks_present += res.already_present
            except KVLifeError as exc:
                self._put_error()
                log.warning("kvlife put failed (not stored): %s", exc)
        self._puts = left

    def drain(self) -> None:
        """Wait for every committed background put (before the store closes)."""
        self._reap(wait=True)

    def close(self) -> None:
        """Abort what still awaits a verdict (never confirmed by every rank), then wait
        for the committed puts."""
        held, self._held = self._held, {}
        for step in sorted(held):
            for h in held[step]:
                self._abort(h, f"step {step} not confirmed by every rank before shutdown")
        self.drain()
        self._pool.shutdown(wait=True)
        self._stager.shutdown(wait=True)
