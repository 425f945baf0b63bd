"""The configuration of a report run: one host's hierarchy, its faults and tenants.

Capacities are bytes; the replay counts blocks of ``kv_bytes_per_token x block tokens``
(64 MiB for a Mooncake block of an 8B model), so every tier holds a whole number of
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlife.core.errors import InvalidArgument
from kvlife.replay.engine import ComputeModel
from kvlife.reporting.faults import FaultConfig

GiB = 1 << 30
TiB = 1 << 40

REMOTE_LINKS = ("rdma", "tcp")
TENANT_RULES = ("", "user", "organisation")


@dataclass(frozen=True, slots=True)
class HostConfig:
    """DRAM, SSD (through the FTL model) and an optional remote tier of one engine host."""

    kv_bytes_per_token: int = 131072
    """KV bytes per token (131,072: Llama-3-8B fp16; 327,680: Llama-3-70B)."""
    policy: str = "lru"
    """Eviction policy of the local tiers (registered name)."""
    dram_bytes: int = 256 * GiB
    """Host DRAM given to KV."""
    ssd_bytes: int = 2 * TiB
    """SSD capacity given to KV (logical; 0: no SSD tier)."""
    ssd_drives: int = 4
    """NVMe drives the SSD tier is striped over (a block lives on one drive)."""
    ssd_op: float = 0.07
    """SSD over-provisioning (physical / logical - 1)."""
    fdp: bool = False
    """Place SSD writes in FDP reclaim units by lifecycle class (position bucket)."""
    remote_bytes: int = 0
    """Remote tier capacity (0: none)."""
    remote_link: str = "rdma"
    """Network model of the remote tier: rdma (100 Gb/s RoCE) or tcp (25 Gb/s)."""
    compute: ComputeModel = field(default_factory=ComputeModel)
    """Prefill and decode speed."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Simulated faults (rate 0: none)."""
    tenants: str = ""
    """Derive tenants from the trace's prefixes: '', user or organisation."""
    tenant_groups: int = 4
    """Derived tenants are folded into this many (id modulo groups)."""
    tenant_shares: str = ""
    """Quotas per tier between tenants ('equal' or name=fraction,...); '': shared."""

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise InvalidArgument("kv_bytes_per_token must be >= 1")
        for name in ("dram_bytes", "ssd_bytes", "remote_bytes"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0")
        if self.ssd_drives < 1:
            raise InvalidArgument("ssd_drives must be >= 1")
        if self.remote_link not in REMOTE_LINKS:
            raise InvalidArgument(
                f"remote link {self.remote_link!r}: one of {', '.join(REMOTE_LINKS)}"
            )
        if self.tenants not in TENANT_RULES:
            raise InvalidArgument(f"tenants {self.tenants!r}: '', user or organisation")
        if self.tenant_groups < 1:
            raise InvalidArgument("tenant_groups must be >= 1")
        if self.tenant_shares and not self.tenants:
            raise InvalidArgument("tenant shares need tenants (--tenants user|organisation)")
