"""A small stand-in for vLLM around kvlife's connector sides, for the main suite (which
has no vLLM): fakes of vLLM's request and scheduler-output objects, and a mini engine
that drives :class:`SchedulerSide` and one :class:`WorkerSide` per tensor-parallel rank
through vLLM's step protocol (lookup, allocate, plan, start loads, per layer wait /
compute / save, ``wait_for_save`` in a ``finally``, load errors and merged worker reports
back to the scheduler, rollback of failed blocks, empty steps while verdicts are due).

The "model" is an oracle: the KV of position ``p`` at layer ``l`` on rank ``r`` is a
pure function of the tokens up to ``p``, unless the step attended to a wrong prefix on
*any* rank at an earlier layer (tensor parallelism all-reduces every layer's output),
in which case it is poisoned. A sampled token is a function of the tokens, or wrong
when the last position was poisoned. So every stored chunk and every output can be
checked against a run that never used kvlife.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvlife.core.identity import PUBLIC, ModelIdentity, prompt_chunk_keys
from kvlife.engines.vllm.identity import EngineFacts, NamespacePolicy, identity_for
from kvlife.engines.vllm.meta import StepReport
from kvlife.engines.vllm.scheduler import SchedulerSide
from kvlife.engines.vllm.stores import StoreAPI
from kvlife.engines.vllm.worker import WorkerSide

LAYERS = 3
HEAD_DIM = 4
BLOCK = 4
CHUNK = 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
POISON = 100.0


def facts(
    tp_size: int,
    *,
    layers: int = LAYERS,
    heads: int = 2,
    head_dim: int = HEAD_DIM,
    block: int = BLOCK,
) -> EngineFacts:
    """A fake float32 engine's facts (the mini engine's shape unless told otherwise)."""
    return EngineFacts(
        model="/models/fake",
        revision="",
        weights_digest="w",
        tokenizer_digest="t",
        position_digest="rope",
        num_layers=layers,
        total_kv_heads=heads,
        head_dim=head_dim,
        kv_dtype="float32",
        compute_dtype="float32",
        block_size=block,
        tp_size=tp_size,
        engine_version="fake",
    )


def identities(tp_size: int) -> list[ModelIdentity]:
    f = facts(tp_size)
    return [identity_for(f, tp_rank=r, tokens_per_chunk=CHUNK) for r in range(tp_size)]


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    out, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % (1 << 31)
        out.append(h)
    return out


def oracle_kv(rank: int, tokens: Sequence[int], lo: int, hi: int, heads: int) -> np.ndarray:
    """Correct KV ``(layers, 2, heads, hi - lo, head_dim)`` of positions ``[lo, hi)``."""
    h = np.array(_prefix_hashes(tokens)[lo:hi], dtype=np.int64)
    lay = np.arange(LAYERS).reshape(-1, 1, 1, 1, 1)
    kv = np.arange(2).reshape(1, -1, 1, 1, 1)
    head = np.arange(heads).reshape(1, 1, -1, 1, 1)
    dim = np.arange(HEAD_DIM).reshape(1, 1, 1, 1, -1)
    val = h.reshape(1, 1, 1, -1, 1) * 31 + lay * 7919 + rank * 104729 + kv * 13 + head * 5 + dim
    return (val % 1009).astype(np.float32) / 1009 + 1.0


def oracle_token(tokens: Sequence[int]) -> int:
    return 3 + _prefix_hashes(tokens)[-1] % 997


def reference_outputs(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What an engine without kvlife generates for ``prompt``."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(oracle_token(tokens))
        tokens.append(out[-1])
    return out


# --------------------------------------------------------------------- vLLM's objects


@dataclass
class FakeRequest:
    """What the connector reads of ``vllm.v1.request.Request``."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    lora_request: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class FakeNewRequest:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class FakeCachedRequests:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class FakeSchedulerOutput:
    scheduled_new_reqs: list[FakeNewRequest] = field(default_factory=list)
    scheduled_cached_reqs: FakeCachedRequests = field(default_factory=FakeCachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


class EngineDied(RuntimeError):
    """A fault raised in the forward: the step's output never reaches the scheduler."""


Fault = Callable[[int, int, int, str], None]
"""``fault(step, rank, layer, phase)`` may raise inside the forward; phase ``"load"``
is before the layer's ``wait_for_layer_load``, ``"save"`` before its ``save_kv_layer``,
``"skip"`` returns True to leave the layer's save out (vLLM not calling it)."""


class MiniEngine:
    """vLLM's step loop around a scheduler side and ``tp`` worker sides."""

    def __init__(
        self,
        scheduler_store: StoreAPI,
        worker_stores: Sequence[StoreAPI],
        *,
        blocks: int = 128,
        fault: Fault | None = None,
        before_start: Callable[[Any], None] | None = None,
        after_start: Callable[[], None] | None = None,
        skip_save: Callable[[int, int, int], bool] | None = None,
    ) -> None:
        self.tp = len(worker_stores)
        self.ids = identities(self.tp)
        self.heads = self.ids[0].layout.num_kv_heads
        self.scheduler = SchedulerSide(
            scheduler_store, self.ids, NamespacePolicy(PUBLIC), block_size=BLOCK
        )
        self.workers = [
            WorkerSide(s, self.ids[r], block_size=BLOCK, rank=r)
            for r, s in enumerate(worker_stores)
        ]
        self.caches = [
            [torch.full((blocks, self.heads, BLOCK, 2 * HEAD_DIM), math.nan) for _ in NAMES]
            for _ in range(self.tp)
        ]
        for w, cache in zip(self.workers, self.caches, strict=True):
            w.register(NAMES, cache, "halves")
        self.free = list(range(blocks))
        self.fault = fault
        self.before_start = before_start
        self.after_start = after_start
        self.skip_save = skip_save
        self.steps = 0
        self.requests = 0

    # ------------------------------------------------------------------ paged cache

    def _view(self, rank: int, layer: int) -> torch.Tensor:
        c = self.caches[rank][layer]
        return c.view(c.shape[0], self.heads, 2, BLOCK, HEAD_DIM)

    def _write(self, rank: int, layer: int, blocks: list[int], lo: int, kv: np.ndarray) -> None:
        view = self._view(rank, layer)
        for i in range(kv.shape[2]):
            p = lo + i
            view[blocks[p // BLOCK], :, :, p % BLOCK, :] = torch.from_numpy(
                np.ascontiguousarray(kv[:, :, i, :].transpose(1, 0, 2))
            )

    def _prefix_ok(self, tokens: list[int], blocks: list[int], upto: int, below: int) -> bool:
        """Whether every rank holds the correct KV of positions ``[0, upto)`` in layers
        ``[0, below)``."""
        if upto == 0 or below == 0:
            return True
        for rank in range(self.tp):
            want = oracle_kv(rank, tokens, 0, upto, self.heads)
            for layer in range(below):
                view = self._view(rank, layer)
                got = np.stack(
                    [
                        view[blocks[p // BLOCK], :, :, p % BLOCK, :].numpy().transpose(1, 0, 2)
                        for p in range(upto)
                    ],
                    axis=2,
                )
                if not np.array_equal(got, want[layer]):
                    return False
        return True

    # ------------------------------------------------------------------ steps

    def _forward(
        self, plan: Any, tokens: list[int], blocks: list[int], lo: int, hi: int
    ) -> tuple[set[int], bool]:
        """One step on every rank: loads, the layers, saves; the invalid blocks and
        whether the last position's hidden state was poisoned."""
        step = plan.step
        if self.before_start is not None:
            self.before_start(plan)
        for w in self.workers:
            w.start(plan)
        if self.after_start is not None:
            self.after_start()
        poisoned = False
        try:
            for layer in range(LAYERS):
                for rank, w in enumerate(self.workers):
                    if self.fault is not None:
                        self.fault(step, rank, layer, "load")
                    w.wait_layer(NAMES[layer])
                # new KV at this layer comes from the previous layers' outputs, which
                # all-reduced every rank's attention over the prefix
                poisoned = poisoned or not self._prefix_ok(tokens, blocks, lo, layer)
                for rank, w in enumerate(self.workers):
                    kv = oracle_kv(rank, tokens[:hi], lo, hi, self.heads)[layer]
                    self._write(rank, layer, blocks, lo, kv + POISON if poisoned else kv)
                    if self.fault is not None:
                        self.fault(step, rank, layer, "save")
                    if self.skip_save is None or not self.skip_save(step, rank, layer):
                        w.save_layer(NAMES[layer], plan)
            poisoned = poisoned or not self._prefix_ok(tokens, blocks, lo, LAYERS)
        finally:
            for w in self.workers:  # vLLM's wait_for_save runs in a finally
                w.submit(plan)
        return self._collect(), poisoned

    def _collect(self) -> set[int]:
        """The step's output reached the scheduler: invalid blocks and merged reports
        (vLLM's KVOutputAggregator), then ``update_connector_output``."""
        invalid: set[int] = set()
        merged = StepReport()
        for w in self.workers:
            invalid |= w.load_errors()
            report = w.take_report()
            if report is not None:
                merged = merged.merge(report)
        if invalid:
            self.scheduler.load_failed(invalid)
        self.scheduler.reported(merged if merged else None)
        return invalid

    def _plan(self, out: FakeSchedulerOutput) -> Any:
        self.steps += 1
        return self.scheduler.plan(out)

    def idle(self) -> None:
        """Empty steps while verdicts are due (vLLM's ``has_pending_push_work``)."""
        while self.scheduler.has_pending_verdicts:
            plan = self._plan(FakeSchedulerOutput())
            for w in self.workers:
                w.start(plan)
                w.submit(plan)
            self._collect()

    def serve(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Generate ``max_tokens`` greedy tokens for ``prompt``; raises
        :class:`EngineDied` if the forward failed (nothing after it runs)."""
        self.requests += 1
        req = FakeRequest(f"req-{self.requests}", list(prompt))
        n_prompt = len(req.prompt_token_ids)
        ext = self.scheduler.matched(req, 0)
        self.scheduler.allocated(req, ext)
        computed, first = ext, True
        blocks: list[int] = []
        while len(req.output_token_ids) < max_tokens:
            tokens = req.all_token_ids
            hi = n_prompt if computed < n_prompt else len(tokens)
            new = [self.free.pop(0) for _ in range(math.ceil(hi / BLOCK) - len(blocks))]
            blocks += new
            if first:
                out = FakeSchedulerOutput(
                    [FakeNewRequest(req.request_id, (list(blocks),), computed)],
                    num_scheduled_tokens={req.request_id: hi - computed},
                )
            else:
                out = FakeSchedulerOutput(
                    scheduled_cached_reqs=FakeCachedRequests(
                        [req.request_id], [(new,) if new else None], set(), [computed]
                    ),
                    num_scheduled_tokens={req.request_id: hi - computed},
                )
            first = False
            plan = self._plan(out)
            try:
                invalid, poisoned = self._forward(plan, tokens, blocks, computed, hi)
            except Exception as exc:
                raise EngineDied(f"step {plan.step} failed: {exc}") from exc
            bad = [i for i, b in enumerate(blocks) if b in invalid]
            if bad and bad[0] * BLOCK < hi:  # vLLM recomputes from the first bad block
                computed = bad[0] * BLOCK
                continue
            computed = hi
            tok = oracle_token(tokens)
            req.output_token_ids.append(tok + 1 if poisoned else tok)
        self.scheduler.finished(req)
        self.free += blocks
        self.idle()
        for w in self.workers:  # commits run in the background: let them land before the
            w.drain()  # next request's lookup, so a test's hits are deterministic
        return list(req.output_token_ids)

    def close(self) -> None:
        """vLLM's shutdown of every worker's connector."""
        for w in self.workers:
            w.close()


def served_chunks(
    stores: Sequence[StoreAPI], ids: Sequence[ModelIdentity], prompts: Sequence[Sequence[int]]
) -> tuple[int, list[str]]:
    """Every chunk of ``prompts`` the stores serve, each looked up on its own (so one
    reachable only past a gap is checked too), against the oracle: (chunks served,
    descriptions of the wrong ones)."""
    served, wrong = 0, []
    for rank, (store, ident) in enumerate(zip(stores, ids, strict=True)):
        heads = ident.layout.num_kv_heads
        for prompt in prompts:
            tokens = list(prompt)
            keys = prompt_chunk_keys(ident, PUBLIC, tokens)
            for c, _ in enumerate(keys):
                parent = keys[c - 1] if c else bytes(32)
                part = tokens[c * CHUNK : (c + 1) * CHUNK]
                hit = store.lookup(ident, PUBLIC, part, start=c * CHUNK, parent=parent)  # type: ignore[arg-type]
                if not hit.hits:
                    continue
                res = store.load(hit)
                if not res.loaded:
                    continue
                served += 1
                want = oracle_kv(rank, tokens, c * CHUNK, (c + 1) * CHUNK, heads)
                if not np.array_equal(res.arrays[0], want):
                    wrong.append(f"rank {rank} chunk {c} of prompt {tokens[:4]}...")
    return served, wrong
