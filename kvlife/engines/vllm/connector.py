"""``KVLifeConnector``: kvlife as a vLLM V1 KV connector (``KVConnectorBase_V1``).

Load it with::

    KVTransferConfig(
        kv_connector="KVLifeConnector",
        kv_connector_module_path="kvlife.engines.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",   # a bad chunk is recomputed, not failed
        kv_connector_extra_config={"kvlife.path": DIR} or {"kvlife.socket": SOCK}
                                  or {"kvlife.config": "kvlife.toml"},
    )

(:func:`kvlife.engines.vllm.transfer_config` builds it.) The scheduler-side instance
answers lookups and plans each step (:mod:`.scheduler`); each worker instance moves KV
between the paged cache and kvlife (:mod:`.worker`). Both talk to one store
(:mod:`.stores`). Chunks are a whole number of vLLM blocks (``kvlife.chunk_tokens``,
default 64, must be a multiple of the block size).

Saves commit only once every rank finished the step (:mod:`.meta`): each worker returns
its step report as vLLM worker metadata (``build_connector_worker_meta``), vLLM merges
the ranks' reports (``KVLifeWorkerMetadata.aggregate``) and hands them to the scheduler
side (``update_connector_output``), whose verdicts reach the workers with the next
step's plan; ``has_pending_push_work`` keeps the engine stepping until they are sent.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.core.lifecycle import Move
from kvlife.engines.vllm.faults import LayerFault
from kvlife.engines.vllm.identity import NamespacePolicy, facts_from_vllm_config, identity_for
from kvlife.engines.vllm.meta import StepPlan, StepReport
from kvlife.engines.vllm.paged import split_for_platform
from kvlife.engines.vllm.scheduler import SchedulerSide
from kvlife.engines.vllm.stores import (
    StoreAddress,
    StoreLease,
    open_store,
    resolve_extra_config,
)
from kvlife.engines.vllm.worker import WorkerSide

log = logging.getLogger("kvlife.vllm")

DEFAULT_CHUNK_TOKENS = 64
_LIVE: weakref.WeakSet[KVLifeConnector] = weakref.WeakSet()


def live_connectors() -> list[KVLifeConnector]:
    """The connector instances alive in this process (for tests and the demo runner)."""
    return list(_LIVE)


class KVLifeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, sent from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVLifeWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """One worker's report of the steps it finished; vLLM merges those of all ranks."""

    def __init__(self, report: StepReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVLifeWorkerMetadata:
        assert isinstance(other, KVLifeWorkerMetadata)
        return KVLifeWorkerMetadata(self.report.merge(other.report))


def _int_option(extra: dict[str, Any], name: str, default: int) -> int:
    value = extra.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
    return value


class KVLifeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvlife behind vLLM's KV connector seam (scheduler or worker role)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # a kvlife.config file gives the store and the defaults of the other keys
        extra, file = resolve_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        tpc = _int_option(extra, "kvlife.chunk_tokens", DEFAULT_CHUNK_TOKENS)
        # a load still running this long is abandoned and recomputed (worker.py)
        timeout_s = None
        if extra.get("kvlife.load_timeout_ms") is not None:
            timeout_s = _int_option(extra, "kvlife.load_timeout_ms", 1) / 1000
        self.facts = facts_from_vllm_config(vllm_config)
        salt_kind = str(extra.get("kvlife.salt_kind", "organisation"))
        try:
            kind = NamespaceKind(salt_kind)
        except ValueError as exc:
            raise InvalidArgument(
                f"kvlife.salt_kind {salt_kind!r} is not a namespace kind"
            ) from exc
        self.namespaces = NamespacePolicy(
            Namespace.parse(str(extra.get("kvlife.namespace", "public"))), kind
        )
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kvlife: kv_load_failure_policy is %r: a chunk that fails verification "
                "fails its request instead of being recomputed",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        address = StoreAddress.from_extra_config(extra, file)
        if role == KVConnectorRole.SCHEDULER:  # it counts hits and loads nothing
            address = address.without_direct_reads()
        self.lease: StoreLease = open_store(address)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        try:
            if role == KVConnectorRole.SCHEDULER:
                identities = [
                    identity_for(self.facts, tp_rank=tp, pp_rank=pp, tokens_per_chunk=tpc)
                    for pp, tp in self.facts.ranks
                ]
                self.scheduler = SchedulerSide(
                    self.lease.store,
                    identities,
                    self.namespaces,
                    block_size=self.block_size,
                    save_decode=bool(extra.get("kvlife.save_decode", True)),
                    # the [planner] table of kvlife.config: the engine's measured prefill
                    # profile and the tiers' seeded speeds (learnt from every load after)
                    planner=file.planner.cost_model(tpc) if file and file.planner else None,
                    load_timeout_s=timeout_s,
                )
            else:
                from vllm.distributed.parallel_state import (
                    get_pp_group,
                    get_tensor_model_parallel_rank,
                )

                tp = int(get_tensor_model_parallel_rank()) if self.facts.tp_size > 1 else 0
                pp = int(get_pp_group().rank_in_group) if self.facts.pp_size > 1 else 0
                identity = identity_for(self.facts, tp_rank=tp, pp_rank=pp, tokens_per_chunk=tpc)
                fault = extra.get("kvlife.fail_layer")
                self.worker = WorkerSide(
                    self.lease.store,
                    identity,
                    block_size=self.block_size,
                    rank=pp * self.facts.tp_size + tp,
                    fault=LayerFault.parse(str(fault)) if fault else None,
                )
        except BaseException:
            self.lease.release()
            raise
        _LIVE.add(self)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        assert self.worker is not None
        names = sorted(kv_caches, key=_layer_number)
        backend = ""
        if not current_platform.is_cpu():  # vLLM's CUDA default for these models
            attn = getattr(self._vllm_config, "attention_config", None)
            backend = str(getattr(attn, "backend", "") or "FLASH_ATTN")
            backend = backend.rsplit(".", 1)[-1]
        ndim = kv_caches[names[0]].dim() if names else 4
        split = split_for_platform(current_platform.is_cpu(), backend, ndim)
        self.worker.register(names, [kv_caches[n] for n in names], split)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVLifeMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self.worker is not None
        self.worker.save_layer(layer_name, self._plan())

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.submit(self._plan())

    def build_connector_worker_meta(self) -> KVLifeWorkerMetadata | None:
        assert self.worker is not None
        report = self.worker.take_report()
        return KVLifeWorkerMetadata(report) if report is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.lease.release()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVLifeMetadata:
        assert self.scheduler is not None
        return KVLifeMetadata(self.scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        bad = connector_output.invalid_block_ids
        if bad:
            self.scheduler.load_failed(set(bad))
        meta = connector_output.kv_connector_worker_meta
        if meta is not None:
            assert isinstance(meta, KVLifeWorkerMetadata)
            self.scheduler.reported(meta.report)

    def has_pending_push_work(self) -> bool:
        # verdicts on staged saves go out with the next step's plan: keep stepping
        return self.scheduler is not None and self.scheduler.has_pending_verdicts

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.finished(request)
        return False, None

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (the scheduler asks the
        scheduler-side connector): every tier of kvlife drops this engine's model
        version (:meth:`SchedulerSide.reset`). False (vLLM reports the reset failed)
        when the store could not do it."""
        if self.scheduler is None:
            return None
        try:
            removed = self.scheduler.reset()
        except KVLifeError as exc:
            log.warning("kvlife: reset of the connector's cache failed: %s", exc)
            return False
        log.info("kvlife: prefix cache reset: %d chunks invalidated on every tier", removed)
        return True

    def take_events(self) -> Iterable[Any]:
        """kvlife lifecycle events of the store as vLLM KV events: a chunk indexed is a
        ``BlockStored``, a chunk invalidated or deleted a ``BlockRemoved`` (block hash:
        the first 8 bytes of the kvlife key; medium ``kvlife:<tier>``). Only an embedded
        store reports events here; a served store keeps its own event stream."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        out: list[Any] = []
        tpc = self.scheduler.tpc if self.scheduler is not None else 0
        for ev in self.lease.take_events():
            block_hash = int.from_bytes(bytes.fromhex(ev.key)[:8], "little")
            if ev.kind == Move.INDEX.value:
                out.append(
                    BlockStored(
                        block_hashes=[block_hash],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=tpc,
                        lora_id=None,
                        medium=f"kvlife:{ev.tier}",
                        lora_name=None,
                    )
                )
            elif ev.kind in (Move.INVALIDATE.value, Move.CORRUPT.value, Move.DELETE.value):
                out.append(BlockRemoved(block_hashes=[block_hash], medium=f"kvlife:{ev.tier}"))
        return out


def _layer_number(name: str) -> tuple[int, str]:
    found = re.findall(r"\d+", name)
    return (int(found[0]) if found else -1, name)
