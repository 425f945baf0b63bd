"""What a kvlife configuration file holds, as typed settings: the store's own
:class:`~kvlife.store.config.StoreConfig` (its chain of :class:`~kvlife.tiers.spec.TierSpec`
and the quotas), the server's settings, the planner's seeds and the vLLM connector's
defaults. :mod:`kvlife.ops.config.parse` makes one from a file; ``kvlife serve`` and the
vLLM connector use these and nothing else, so a file, the flags and
``kv_connector_extra_config`` all end up in the same classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvlife.core.errors import InvalidArgument
from kvlife.ops.kv_events import KVEventsConfig
from kvlife.server.limits import Limits
from kvlife.store.config import StoreConfig
from kvlife.tenancy.principals import TenancyConfig
from kvlife.tiers.shm import SHM_DIR

if TYPE_CHECKING:
    from kvlife.planner import CostModel

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The ``[server]`` table: how ``kvlife serve`` serves the store (its first tier
    becomes the shared-memory arena)."""

    socket: Path | None = None
    """Unix socket (default ``STORE/serve.sock``)."""
    staging_bytes: int = 256 * MiB
    """Arena room beyond the first tier's budget: puts being written, disk reads handed
    out."""
    shm_dir: Path = SHM_DIR
    """tmpfs of the arena and the shared buffers."""
    cpus: tuple[int, ...] = ()
    """CPUs the server runs on (empty: any)."""
    pid_file: Path | None = None
    """Written once the server accepts connections."""
    limits: Limits = field(default_factory=Limits)
    """Every budget a client can make the server hold (``[server.limits]``)."""
    principals: TenancyConfig | None = None
    """Tenants enforced by the store (``[server.principals.NAME]``); None: every client
    of the server's Unix user is trusted alike."""
    kv_events: KVEventsConfig | None = None
    """Publish KV events for routers (``[server.kv_events]``); None: none."""
    metrics: str | None = None
    """Serve Prometheus metrics at this ``HOST:PORT`` (``--metrics``); None: none."""
    log_json: bool = False
    """Log one JSON object per line (``--log-json``)."""
    gc_whole_every_s: float = 600.0
    """Seconds between whole collections of the server's garbage (``--gc-whole-every``;
    0: the collector as Python leaves it)."""
    events: Path | None = None
    """The store's lifecycle event log (``--events``); None: none."""


@dataclass(frozen=True, slots=True)
class TierSeed:
    """The planner's first estimate of one tier's load speed (``[planner.tiers.NAME]``),
    learnt from every load after that."""

    tier: str
    latency_s: float
    """Seconds of a load before its first byte."""
    bytes_per_s: float
    """Bytes per second once it flows."""


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """The ``[planner]`` table: load or recompute, decided by the cost model
    (docs/planner.md)."""

    prefill_profile: Path
    """The engine's prefill profile (JSON written by
    :meth:`~kvlife.planner.PrefillProfile.save`)."""
    tiers: tuple[TierSeed, ...] = ()
    """Seeds of the tiers' load speeds (a tier without one is never loaded from until
    calibrated)."""

    def cost_model(self, tokens_per_chunk: int) -> CostModel:
        """A cost model with the profile read from its file and the tiers seeded."""
        from kvlife.planner import CostModel, PrefillProfile

        model = CostModel(PrefillProfile.load(self.prefill_profile), tokens_per_chunk)
        for seed in self.tiers:
            cost = model.tier(seed.tier)
            cost.latency_s = seed.latency_s
            cost.per_byte.seed(1.0 / seed.bytes_per_s)
        return model


CONNECTOR_KEYS: dict[str, type] = {
    "chunk_tokens": int,
    "events": str,
    "load_timeout_ms": int,
    "namespace": str,
    "salt_kind": str,
    "save_decode": bool,
    "store": str,
}
"""Keys of the ``[vllm]`` table (each the ``kvlife.<key>`` of
``kv_connector_extra_config``) and their types."""


@dataclass(frozen=True, slots=True)
class KVLifeConfig:
    """One configuration file, checked whole."""

    source: Path
    """The file it was read from (relative paths in it are relative to its directory)."""
    store: StoreConfig
    """The chain, the store-wide options and the quotas."""
    path: Path | None = None
    """The store directory (``[store] path``)."""
    server: ServerSettings | None = None
    """``[server]``, if the file has one."""
    planner: PlannerSettings | None = None
    """``[planner]``, if the file has one."""
    connector: tuple[tuple[str, object], ...] = ()
    """``[vllm]``: the connector's defaults, as ``(kvlife.<key>, value)`` pairs."""

    def connector_extra(self) -> dict[str, object]:
        """The ``[vllm]`` table as ``kv_connector_extra_config`` entries."""
        return dict(self.connector)

    def store_path(self) -> Path:
        if self.path is None:
            raise InvalidArgument(f"{self.source}: [store] path is not set")
        return self.path
