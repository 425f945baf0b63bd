"""The worker side of the kvlife connector: loads into and saves from vLLM's paged KV.

Loads (``start``): for each planned load the worker looks the prefix up again under its
own identity (its tensor-parallel shard), starts an asynchronous verified load of the
chunks into host buffers, and a loader thread writes them into the paged cache layer by
layer, setting one event per layer, so attention of layer ``l`` (which waits in
``wait_layer``) starts while later layers are still being written. A chunk that is
missing or fails verification, and every chunk after it, is not written: its blocks are
reported by ``load_errors`` and vLLM recomputes them (never served).

Saves: during the step ``save_layer`` copies each layer of the planned chunks out of the
paged cache into a host staging array (``(layers, 2, heads, T, head_dim)``); at
``submit`` the chunks are prepared and committed in the background (``put_async``), so
the blocks are free as soon as the step ends. Put failures are counted, never raised
into the engine: a missing chunk is a future miss, not wrong KV.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import ROOT_PARENT, ModelIdentity, prompt_chunk_keys
from kvlife.core.payload import numpy_dtype, to_torch
from kvlife.engines.vllm.identity import with_adapter
from kvlife.engines.vllm.meta import LoadSpec, SaveSpec, StepPlan
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
    chunks_stored: int = 0
    chunks_present: int = 0
    put_errors: int = 0
    saves_skipped: int = 0
    """Saves dropped because the request's load failed in the same step (its KV after
    the failed blocks was computed on garbage); vLLM recomputes and they are saved then."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Chunks loaded per tier."""


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    handle: Any
    first_chunk: int
    chunks: int
    buffers: list[np.ndarray]


class WorkerSide:
    """Loads and saves of one worker (one tensor-parallel rank)."""

    def __init__(self, store: StoreAPI, identity: ModelIdentity, *, block_size: int) -> None:
        self.store = store
        self.identity = identity
        self.block_size = block_size
        lay = identity.layout
        self.tpc = lay.tokens_per_chunk
        self.layers: list[PagedLayer] = []
        self.layer_index: dict[str, int] = {}
        self.counters = WorkerCounters()
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        """Requests whose load failed this step: whatever this step computed after the
        failed blocks attended to garbage, so none of it is saved."""
        self._events: list[threading.Event] | None = None
        self._loader: Future[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlife-vllm-load")
        self._staged: list[tuple[SaveSpec, np.ndarray]] = []
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
        return _Load(spec, handle, c0, c1 - c0, bufs)

    def _fail(self, spec: LoadSpec, from_chunk: int) -> None:
        """Blocks of ``spec`` from chunk ``from_chunk`` on did not load."""
        self._failed.add(spec.req_id)
        first_block = max(spec.first_token, from_chunk * self.tpc) // self.block_size
        bad = spec.block_ids[first_block : spec.end_token // self.block_size]
        with self._lock:
            self._errors.update(bad)
        self.counters.blocks_failed += len(bad)

    def _write_layers(self, jobs: list[_Load], events: list[threading.Event]) -> None:
        import torch

        try:
            ready: list[tuple[Any, Any, int]] = []  # (block ids tensor, torch chunk, first tok)
            for job in jobs:
                spec = job.spec
                got = 0
                for i in range(len(job.buffers)):
                    if job.handle.chunk(i) is None:
                        break
                    got += 1
                res = job.handle.wait()
                for tier, n in res.tiers.items():
                    self.counters.tiers[tier] = self.counters.tiers.get(tier, 0) + n
                if got < job.chunks:
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
        events = self._events
        if events is None:
            return
        idx = self.layer_index.get(name)
        if idx is None:
            return
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
        lay = self.identity.layout
        if idx == 0:
            self._staged = []
            for spec in plan.saves:
                n = (spec.end_chunk - spec.first_chunk) * self.tpc
                shape = (lay.num_layers, 2, lay.num_kv_heads, n, lay.head_dim)
                self._staged.append((spec, np.empty(shape, numpy_dtype(lay.dtype))))
        for spec, buf in self._staged:
            lo = spec.first_chunk * self.tpc // self.block_size
            hi = spec.end_chunk * self.tpc // self.block_size
            blocks = torch.tensor(spec.block_ids[lo:hi], dtype=torch.long)
            self.layers[idx].gather(blocks, to_torch(buf[idx], lay.dtype))

    def submit(self) -> None:
        """Commit this step's staged chunks in the background (end of the step)."""
        self._events = None
        staged, self._staged = self._staged, []
        for spec, buf in staged:
            if spec.req_id in self._failed:
                self.counters.saves_skipped += 1
                continue
            identity = with_adapter(self.identity, spec.adapter)
            start = spec.first_chunk * self.tpc
            parent = ROOT_PARENT
            if spec.first_chunk:
                parent = prompt_chunk_keys(identity, spec.namespace, spec.tokens[:start])[-1]
            self.counters.saves += 1
            try:
                pending = self.store.prepare_put(
                    identity,
                    spec.namespace,
                    spec.tokens[start:],
                    buf,
                    start=start,
                    parent=parent,
                    request_id=spec.req_id,
                )
                self._puts.append(self.store.put_async(pending))
            except KVLifeError as exc:
                self.counters.put_errors += 1
                log.warning("kvlife put of %s failed (not stored): %s", spec.req_id, exc)
        self._reap(wait=False)

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
        """Wait for every background put (before the store closes)."""
        self._reap(wait=True)

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
