"""The worker side of the kvlife connector: loads into and saves from vLLM's paged KV.

Loads (``start``): for each planned load the worker looks the prefix up again under its
own identity (its tensor-parallel shard), starts an asynchronous verified load of the
chunks into host buffers, and a loader thread writes them into the paged cache layer by
layer, setting one event per layer, so attention of layer ``l`` (which waits in
``wait_layer``) starts while later layers are still being written. A chunk that is
missing or fails verification, and every chunk after it, is not written: its blocks are
reported by ``load_errors`` and vLLM recomputes them (never served). A load that fails
part-way (the server dropped, a chunk corrupt) is the same: the chunks that arrived
whole are written, the rest recomputed.

Saves are all-or-nothing across layers and ranks. During the step ``save_layer`` copies
each layer of the planned chunks out of the paged cache into a host staging array
(``(layers, 2, heads, T, head_dim)``), recording which layers it gathered; at ``submit``
(vLLM's ``wait_for_save``, which runs even when the forward raised) the chunks of a
request are staged with ``prepare_put`` (TENTATIVE, invisible) only if every layer of
every chunk was gathered, no load of the request (nor of a block it shares with another
request through vLLM's prefix cache) failed on this rank and no exception is
propagating. The worker then reports the step (:class:`StepReport`) and holds the
staged puts until the scheduler's verdict arrives with a later step's plan: commit
(``put_async``) once every rank reported success for the request, abort otherwise. A
worker that shuts down aborts what it still holds. Put failures are counted, never
raised into the engine: a missing chunk is a future miss, not wrong KV.
"""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import ROOT_PARENT, ModelIdentity, prompt_chunk_keys
from kvlife.core.payload import numpy_dtype, to_torch
from kvlife.engines.vllm.faults import LayerFault
from kvlife.engines.vllm.identity import with_adapter
from kvlife.engines.vllm.meta import LoadSpec, SaveSpec, SaveVerdict, StepPlan, StepReport
from kvlife.engines.vllm.paged import PagedLayer
from kvlife.engines.vllm.stores import StoreAPI

log = logging.getLogger("kvlife.vllm")


@dataclass(slots=True)
class WorkerCounters:
    loads: int = 0
    tokens_loaded: int = 0
    """Tokens written into the paged cache from kvlife."""
    blocks_failed: int = 0
    """Blocks reported to vLLM as failed loads (recomputed by it)."""
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
    saves_committed: int = 0
    """Staged saves committed on the scheduler's verdict."""
    saves_aborted: int = 0
    """Staged saves rolled back: another rank failed the request in that step, or the
    step was never confirmed before shutdown."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Chunks loaded per tier."""


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    handle: Any
    first_chunk: int
    chunks: int
    buffers: list[np.ndarray]


@dataclass(slots=True)
class _Staging:
    """One planned save being gathered layer by layer in the current step."""

    spec: SaveSpec
    buf: np.ndarray
    gathered: set[int] = field(default_factory=set)
    """Layer indices copied into ``buf`` this step."""


@dataclass(slots=True)
class _Held:
    """A staged put (TENTATIVE in the store) awaiting the scheduler's verdict."""

    req_id: str
    pending: Any


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
        self.block_size = block_size
        self.rank = rank
        """Global rank (stage-major: ``pp_rank * tp_size + tp_rank``) in step reports."""
        self.fault = fault
        lay = identity.layout
        self.tpc = lay.tokens_per_chunk
        self.layers: list[PagedLayer] = []
        self.layer_index: dict[str, int] = {}
        self.counters = WorkerCounters()
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
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlife-vllm-load")
        self._staging: list[_Staging] = []
        self._staging_step = -1
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
        self.layer_index = {n: i for i, n in enumerate(names)}
        if self.layers and self.layers[0].block_size != self.block_size:
            raise KVLifeError(
                f"paged KV blocks hold {self.layers[0].block_size} tokens, vLLM's block size "
                f"is {self.block_size}"
            )

    # ------------------------------------------------------------------ loads

    def start(self, plan: StepPlan) -> None:
        """Start this step's loads (before the forward)."""
        self._events = None
        self._failed = set()
        self._failed_blocks = set()
        if not plan.loads:
            return
        jobs = [job for job in (self._begin(spec) for spec in plan.loads) if job is not None]
        events = [threading.Event() for _ in self.layers]
        self._events = events
        self._loader = self._pool.submit(self._write_layers, jobs, events)

    def _begin(self, spec: LoadSpec) -> _Load | None:
        import torch  # noqa: F401  (the paged cache is torch)

        identity = with_adapter(self.identity, spec.adapter)
        c0, c1 = spec.first_token // self.tpc, spec.end_token // self.tpc
        self.counters.loads += 1
        try:
            hit = self.store.lookup(identity, spec.namespace, spec.tokens)
            sub = hit.sub(c0, c1)  # a served store's answer keeps its layout and hints
            usable = sub.hits
            dtype = numpy_dtype(identity.layout.dtype)
            bufs = [np.empty(identity.layout.chunk_shape, dtype) for _ in usable]
            handle = self.store.load_async(sub, bufs, request_id=spec.req_id)
        except KVLifeError as exc:
            log.warning("kvlife load of %s failed, recomputed: %s", spec.req_id, exc)
            self._fail(spec, c0)
            return None
        if len(usable) < c1 - c0:
            self._fail(spec, c0 + len(usable))
        return _Load(spec, handle, c0, len(usable), bufs)

    def _fail(self, spec: LoadSpec, from_chunk: int) -> None:
        """Blocks of ``spec`` from chunk ``from_chunk`` on did not load."""
        first_block = max(spec.first_token, from_chunk * self.tpc) // self.block_size
        bad = set(spec.block_ids[first_block : spec.end_token // self.block_size])
        with self._lock:
            self._failed.add(spec.req_id)
            self._failed_blocks |= bad
            new = bad - self._errors
            self._errors |= new
            self.counters.blocks_failed += len(new)

    def _arrived(self, job: _Load) -> int:
        """Leading chunks of ``job`` that arrived whole (a failure of the handle, e.g.
        the server dropped mid-load, ends the run there: recomputed, not raised)."""
        got = 0
        try:
            for i in range(len(job.buffers)):
                if job.handle.chunk(i) is None:
                    break
                got += 1
            res = job.handle.wait()
            for tier, n in res.tiers.items():
                self.counters.tiers[tier] = self.counters.tiers.get(tier, 0) + n
        except KVLifeError as exc:
            log.warning("kvlife load of %s failed part-way, recomputed: %s", job.spec.req_id, exc)
        return got

    def _write_layers(self, jobs: list[_Load], events: list[threading.Event]) -> None:
        import torch

        try:
            ready: list[tuple[Any, Any, int]] = []  # (block ids tensor, torch chunk, first tok)
            for job in jobs:
                spec = job.spec
                got = self._arrived(job)
                if got < len(job.buffers):
                    self._fail(spec, job.first_chunk + got)
                for i in range(got):
                    c = job.first_chunk + i
                    lo = max(spec.first_token, c * self.tpc)
                    hi = (c + 1) * self.tpc
                    blocks = torch.tensor(
                        spec.block_ids[lo // self.block_size : hi // self.block_size],
                        dtype=torch.long,
                    )
                    chunk = to_torch(job.buffers[i], self.identity.layout.dtype)
                    ready.append((blocks, chunk, lo - c * self.tpc))
                    self.counters.tokens_loaded += hi - lo
            for layer, paged in enumerate(self.layers):
                for blocks, chunk, off in ready:
                    paged.scatter(blocks, chunk[layer, :, :, off:])
                events[layer].set()
        finally:
            for e in events:  # a failure must not hang the forward; wait_layer raises it
                e.set()

    def wait_layer(self, name: str) -> None:
        idx = self.layer_index.get(name)
        events = self._events
        if events is None or idx is None:
            return
        if self.fault is not None:
            self.fault.check("load", idx)
        events[idx].wait()
        if idx == len(events) - 1 and self._loader is not None:
            self._loader.result()  # raise a loader bug here, in the engine's step

    def load_errors(self) -> set[int]:
        with self._lock:
            bad, self._errors = self._errors, set()
        return bad

    # ------------------------------------------------------------------ saves

    def save_layer(self, name: str, plan: StepPlan) -> None:
        import torch

        if not plan.saves:
            return
        idx = self.layer_index.get(name)
        if idx is None:
            return
        if self.fault is not None:
            self.fault.check("save", idx)
        lay = self.identity.layout
        if self._staging_step != plan.step:
            self._staging_step = plan.step
            self._staging = []
            for spec in plan.saves:
                n = (spec.end_chunk - spec.first_chunk) * self.tpc
                shape = (lay.num_layers, 2, lay.num_kv_heads, n, lay.head_dim)
                self._staging.append(_Staging(spec, np.empty(shape, numpy_dtype(lay.dtype))))
        for st in self._staging:
            lo = st.spec.first_chunk * self.tpc // self.block_size
            hi = st.spec.end_chunk * self.tpc // self.block_size
            blocks = torch.tensor(st.spec.block_ids[lo:hi], dtype=torch.long)
            self.layers[idx].gather(blocks, to_torch(st.buf[idx], lay.dtype))
            st.gathered.add(idx)

    def submit(self, plan: StepPlan) -> None:
        """End of the step (vLLM's ``wait_for_save``, also after a forward that raised):
        carry out the verdicts on earlier steps, stage this step's complete saves and
        report the step."""
        self._events = None
        for verdict in plan.verdicts:
            self._settle(verdict)
        staging = self._staging if self._staging_step == plan.step else []
        self._staging, self._staging_step = [], -1
        if plan.saves:
            # an exception propagating through vLLM's finally: the forward did not complete
            raising = sys.exc_info()[0] is not None
            failed = self._stage(plan, staging, raising)
            self._report.add(plan.step, self.rank, failed)
        self._reap(wait=False)

    def _stage(self, plan: StepPlan, staging: list[_Staging], raising: bool) -> set[str]:
        """Stage the step's complete saves; the requests this rank failed."""
        failed: set[str] = set()
        by_spec = {id(st.spec): st for st in staging}
        complete = set(range(self.identity.layout.num_layers))
        with self._lock:
            bad_blocks = set(self._failed_blocks)
        for spec in plan.saves:
            st = by_spec.get(id(spec))
            # a request whose own load failed, or one that shares a block that did not
            # load (vLLM's prefix cache): both attended to garbage in this step
            if spec.req_id in self._failed or not bad_blocks.isdisjoint(spec.block_ids):
                self.counters.saves_skipped += 1
                failed.add(spec.req_id)
                continue
            if raising or st is None or st.gathered != complete:
                self.counters.saves_incomplete += 1
                failed.add(spec.req_id)
                continue
            pending = self._prepare(spec, st.buf)
            if pending is not None:
                self._held.setdefault(plan.step, []).append(_Held(spec.req_id, pending))
        return failed

    def _prepare(self, spec: SaveSpec, buf: np.ndarray) -> Any | None:
        identity = with_adapter(self.identity, spec.adapter)
        start = spec.first_chunk * self.tpc
        parent = ROOT_PARENT
        try:
            if spec.first_chunk:
                parent = prompt_chunk_keys(identity, spec.namespace, spec.tokens[:start])[-1]
            pending = self.store.prepare_put(
                identity,
                spec.namespace,
                spec.tokens[start:],
                buf,
                start=start,
                parent=parent,
                request_id=spec.req_id,
            )
        except KVLifeError as exc:
            self.counters.put_errors += 1
            log.warning("kvlife put of %s failed (not stored): %s", spec.req_id, exc)
            return None
        self.counters.saves += 1
        return pending

    def _settle(self, verdict: SaveVerdict) -> None:
        """Commit or abort the puts staged in ``verdict.step``."""
        for held in self._held.pop(verdict.step, []):
            if verdict.keeps(held.req_id):
                try:
                    self._puts.append(self.store.put_async(held.pending))
                    self.counters.saves_committed += 1
                except KVLifeError as exc:
                    self.counters.put_errors += 1
                    log.warning("kvlife put of %s failed (not stored): %s", held.req_id, exc)
            else:
                self._abort(held, f"step {verdict.step} failed on another rank or layer")

    def _abort(self, held: _Held, reason: str) -> None:
        self.counters.saves_aborted += 1
        try:
            self.store.abort_put(held.pending, reason)
        except KVLifeError as exc:  # the server dropped: it aborts the session's puts
            log.warning("kvlife abort of %s's put failed: %s", held.req_id, exc)

    def take_report(self) -> StepReport | None:
        """The steps this worker finished since the last call (vLLM's
        ``build_connector_worker_meta``)."""
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
                self.counters.put_errors += 1
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
