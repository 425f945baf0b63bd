"""The scheduler side of the kvlife connector: lookups, per-request state, step plans,
and the verdicts that make saves visible.

``matched`` answers vLLM's ``get_num_new_matched_tokens``: the longest run of stored
chunks of the prompt present for every rank (each tensor-parallel shard of each pipeline
stage), capped so that at least one prompt token is computed (vLLM needs the last
position's logits). ``allocated`` records the range to load once vLLM allocated blocks
for it; ``plan`` turns the scheduled step into loads (new hits) and saves (chunks whose
every token has KV after this step, prompt and generated tokens alike). Loads are
synchronous within the step (the worker writes them layer by layer before each layer's
attention); saves are copied out of the blocks during the step and staged (invisible)
by every worker at its end, so no block outlives its request.

A staged save becomes visible only on a verdict: ``reported`` takes the workers' merged
:class:`StepReport` of a step (vLLM's ``update_connector_output``) and decides, per
request, commit (every rank finished the step and none failed the request) or abort (a
rank failed its load or did not gather every layer; a rank never reported; the save
covers blocks a load failed to fill, heard of after it was planned). The verdicts
travel with the next step's plan; until they are sent,
``has_pending_verdicts`` keeps vLLM's engine stepping. An aborted save is planned again,
so the chunks are stored once vLLM has recomputed them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvlife.core.errors import KVLifeError, NotPermitted
from kvlife.core.identity import ModelIdentity, Namespace
from kvlife.engines.identity import AdapterSpec
from kvlife.engines.vllm.identity import NamespacePolicy, adapter_spec, with_adapter
from kvlife.engines.vllm.meta import LoadSpec, SaveSpec, SaveVerdict, StepPlan, StepReport
from kvlife.engines.vllm.stores import StoreAPI
from kvlife.planner import CostModel, tokens_to_load
from kvlife.results import ChunkHit

log = logging.getLogger("kvlife.vllm")


@dataclass(slots=True)
class _Request:
    request: Any
    namespace: Namespace
    adapter: AdapterSpec | None
    hit_tokens: int = 0
    """Chunk-aligned tokens kvlife holds for the prompt (at the last lookup)."""
    load: tuple[int, int] | None = None
    """Tokens to load at the request's next scheduling: [first, end)."""
    hits: list[ChunkHit] = field(default_factory=list)
    """The usable hits of the last lookup (rank 0's), for the load's deadline."""
    saved_chunks: int = 0
    """Leading chunks that are in the store or planned to be saved."""
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerCounters:
    lookups: int = 0
    hit_tokens: int = 0
    """Tokens offered to vLLM from kvlife (beyond its own prefix cache)."""
    store_errors: int = 0
    """Lookups the store could not answer (counted as misses)."""
    steps_committed: int = 0
    """Steps whose staged saves every rank reported (committed but for failed requests)."""
    steps_aborted: int = 0
    """Steps whose staged saves were all aborted (a rank never reported the step)."""
    saves_aborted: int = 0
    """Request saves aborted by a verdict (and planned again)."""
    planner_declined: int = 0
    """Hit tokens not offered because the planner predicted recomputing them faster."""
    planner_loads: int = 0
    """Lookups with hits where the planner chose to load all of them."""
    planner_partial: int = 0
    """Lookups where it chose to load some of them (a prefix) and recompute the rest."""
    planner_recomputes: int = 0
    """Lookups where it chose to load none of them."""
    load_samples: int = 0
    """Loads the workers timed and the cost model learnt from."""
    resets: int = 0
    """vLLM prefix-cache resets passed on to every tier of the store."""


class SchedulerSide:
    """Per-request bookkeeping of the scheduler-side connector."""

    def __init__(
        self,
        store: StoreAPI,
        identities: list[ModelIdentity],
        namespaces: NamespacePolicy,
        *,
        block_size: int,
        save_decode: bool = True,
        planner: CostModel | None = None,
        load_timeout_s: float | None = None,
        deadline_factor: float = 2.0,
        deadline_slack_s: float = 0.05,
    ) -> None:
        self.store = store
        self.planner = planner
        """With a cost model, ``matched`` offers the tokens the planner says to load
        (:func:`kvlife.planner.tokens_to_load`: fewer than the hit, or none, when the
        tier is slower than the prefill it saves); without, the longest hit. It learns
        the tiers' speed from the loads the workers time (``reported``)."""
        self.load_timeout_s = load_timeout_s
        """A load's deadline at most (None: none without a planner)."""
        self.deadline_factor = deadline_factor
        self.deadline_slack_s = deadline_slack_s
        """With a planner, a load's deadline is its predicted time times
        ``deadline_factor`` plus ``deadline_slack_s`` (as the HF engine's planned
        prefill), capped by ``load_timeout_s``."""
        self.identities = identities
        """One identity per rank (every tensor-parallel shard of every pipeline stage),
        in global rank order."""
        self.namespaces = namespaces
        self.block_size = block_size
        self.tpc = identities[0].layout.tokens_per_chunk
        self.save_decode = save_decode
        self.requests: dict[str, _Request] = {}
        self.counters = SchedulerCounters()
        self.step = 0
        """Sequence number of the last planned step."""
        self._awaiting: dict[int, list[SaveSpec]] = {}
        """Steps with saves whose report has not arrived, with their saves."""
        self._verdicts: list[SaveVerdict] = []
        """Verdicts to send with the next plan."""
        self._taint: dict[int, set[str]] = {}
        """Requests to abort in an awaiting step because an earlier step of theirs was
        aborted after it was planned."""

    def _state(self, request: Any) -> _Request:
        st = self.requests.get(request.request_id)
        if st is None:
            lora = getattr(request, "lora_request", None)
            adapter = (
                adapter_spec(lora.lora_name, int(lora.lora_int_id), str(lora.lora_path))
                if lora is not None
                else None
            )
            st = _Request(request, self.namespaces.namespace(request.cache_salt), adapter)
            self.requests[request.request_id] = st
        return st

    def matched(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that kvlife can load."""
        st = self._state(request)
        prompt = list(request.prompt_token_ids or [])
        limit = (len(prompt) - 1) // self.tpc * self.tpc
        st.hit_tokens = 0
        if limit <= 0:
            return 0
        self.counters.lookups += 1
        hit = limit
        hits: list[ChunkHit] = []
        try:
            for identity in self.identities:
                got = self.store.lookup(
                    with_adapter(identity, st.adapter), st.namespace, prompt[:limit]
                )
                hit = min(hit, got.tokens)
                hits = hits or got.hits  # rank 0's hits: every rank loads its own shard
                if hit == 0:
                    break
        except KVLifeError as exc:
            self.counters.store_errors += 1
            log.warning("kvlife lookup failed, served as a miss: %s", exc)
            return 0
        st.saved_chunks = max(st.saved_chunks, hit // self.tpc)
        st.hits = hits[: hit // self.tpc]
        if self.planner is not None and hit > num_computed_tokens:
            chosen = tokens_to_load(st.hits, self.planner, len(prompt), num_computed_tokens)
            c = self.counters
            if chosen >= hit:
                c.planner_loads += 1
            elif chosen > num_computed_tokens:
                c.planner_partial += 1
            else:
                c.planner_recomputes += 1
            if chosen < hit:
                c.planner_declined += hit - max(chosen, num_computed_tokens)
                hit = chosen
        st.hit_tokens = hit
        return max(0, hit - num_computed_tokens)

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens > 0:
            st.load = (st.hit_tokens - num_external_tokens, st.hit_tokens)
            self.counters.hit_tokens += num_external_tokens

    def plan(self, scheduler_output: Any) -> StepPlan:
        self.step += 1
        out = StepPlan(step=self.step, verdicts=self._verdicts)
        self._verdicts = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_load(st, new.req_id, out)
            self._plan_save(st, new.req_id, new.num_computed_tokens + scheduled[new.req_id], out)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids += list(new_ids[0])
            self._plan_load(st, req_id, out)
            after = cached.num_computed_tokens[i] + scheduled[req_id]
            self._plan_save(st, req_id, after, out)
        if out.saves:
            self._awaiting[out.step] = list(out.saves)
        return out

    def _plan_load(self, st: _Request, req_id: str, out: StepPlan) -> None:
        if st.load is None:
            return
        first, end = st.load
        st.load = None
        tokens = list(st.request.prompt_token_ids[:end])
        out.loads.append(
            LoadSpec(
                req_id,
                tokens,
                st.block_ids[: end // self.block_size],
                first,
                end,
                st.namespace,
                st.adapter,
                self._deadline(st.hits[first // self.tpc : end // self.tpc]),
            )
        )

    def _deadline(self, hits: list[ChunkHit]) -> float | None:
        """Seconds the workers wait for a load of ``hits`` before recomputing the rest."""
        limit = self.load_timeout_s
        if self.planner is not None and hits:
            predicted = self.planner.load_seconds(hits)
            if predicted < float("inf"):
                own = predicted * self.deadline_factor + self.deadline_slack_s
                limit = own if limit is None else min(limit, own)
        return limit

    def _plan_save(self, st: _Request, req_id: str, computed: int, out: StepPlan) -> None:
        tokens_known = st.request.all_token_ids
        end = min(computed, len(tokens_known))
        if not self.save_decode:
            end = min(end, len(st.request.prompt_token_ids))
        end_chunk = end // self.tpc
        if end_chunk <= st.saved_chunks:
            return
        n = end_chunk * self.tpc
        out.saves.append(
            SaveSpec(
                req_id,
                list(tokens_known[:n]),
                st.block_ids[: n // self.block_size],
                st.saved_chunks,
                end_chunk,
                st.namespace,
                st.adapter,
            )
        )
        st.saved_chunks = end_chunk

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks the workers could not load (vLLM recomputes them): their chunks are
        saved again once recomputed, so a corrupt chunk heals instead of staying a miss.

        Saves already planned over those blocks are aborted whatever their step's
        report says: a step planned before this was heard of (vLLM's async scheduling
        plans step N+1 before it processed step N's output) attended to the blocks'
        garbage on the rank that failed and, all-reduced, on every rank, though no rank
        failed a load in it."""
        for step, specs in self._awaiting.items():
            over = {s.req_id for s in specs if not block_ids.isdisjoint(s.block_ids)}
            if over:
                self._taint.setdefault(step, set()).update(over)
        for st in self.requests.values():
            for i, block in enumerate(
                st.block_ids[: st.saved_chunks * self.tpc // self.block_size]
            ):
                if block in block_ids:
                    st.saved_chunks = i * self.block_size // self.tpc
                    break

    def reported(self, report: StepReport | None) -> None:
        """The workers' merged reports of finished steps: verdicts on their saves. A
        step with saves that is older than a reported one and was never reported itself
        (its output was lost) is aborted whole."""
        if report is None:
            return
        if self.planner is not None:
            for sample in report.loads:
                self.planner.tier(sample.tier).observe(sample.nbytes, sample.seconds)
                self.counters.load_samples += 1
        everyone = set(range(len(self.identities)))
        for step in sorted(report.ranks):
            if step not in self._awaiting:
                continue  # already decided
            for lost in [s for s in self._awaiting if s < step]:
                self._decide(lost, commit=False, failed=set())
            complete = report.ranks[step] >= everyone
            self._decide(step, commit=complete, failed=report.failed.get(step, set()))

    def _decide(self, step: int, *, commit: bool, failed: set[str]) -> None:
        saves = self._awaiting.pop(step)
        if commit:
            self.counters.steps_committed += 1
            aborted = set(failed) | self._taint.pop(step, set())
        else:
            self.counters.steps_aborted += 1
            self._taint.pop(step, None)
            aborted = {s.req_id for s in saves}
        for spec in saves:
            if spec.req_id not in aborted:
                continue
            self.counters.saves_aborted += 1
            st = self.requests.get(spec.req_id)
            if st is not None:  # plan the chunks again once vLLM has recomputed them
                st.saved_chunks = min(st.saved_chunks, spec.first_chunk)
        # a later step planned before this verdict may have computed on the same garbage
        # (vLLM rolls a request back only once it hears of the failure): abort those too
        for later, specs in self._awaiting.items():
            hit = aborted & {s.req_id for s in specs}
            if later > step and hit:
                self._taint.setdefault(later, set()).update(hit)
        self._verdicts.append(SaveVerdict(step, commit, tuple(sorted(aborted))))

    @property
    def has_pending_verdicts(self) -> bool:
        """Verdicts not yet sent to the workers (vLLM keeps stepping while so)."""
        return bool(self._verdicts)

    def reset(self) -> int:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: every tier of the store
        stops serving, and frees, the KV this engine could hit: every chunk of its model
        version (``model`` and ``weights_digest`` of its ranks' identities, adapters
        included), in every namespace its requests reach; on a server with principals
        (a tenant names one namespace) in its default namespace. Durable and, with a
        shared tier, global when it returns. Returns the chunks removed (vLLM #57727:
        a CPU tier that kept serving after a reset)."""
        removed = 0
        for model, weights in sorted({(i.model_id, i.weights_digest) for i in self.identities}):
            try:
                removed += self.store.invalidate(model=model, weights_digest=weights)
            except NotPermitted:
                removed += self.store.invalidate(
                    namespace=self.namespaces.default, model=model, weights_digest=weights
                )
        self.counters.resets += 1
        return removed

    def finished(self, request: Any) -> None:
        self.requests.pop(request.request_id, None)
