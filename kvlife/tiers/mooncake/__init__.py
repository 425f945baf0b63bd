"""Mooncake Store tier: payloads in Mooncake's distributed memory pool, publication
records, leases and invalidation rules in the global index on Redis."""

from kvlife.tiers.mooncake.tier import MooncakeConfig, MooncakeTier

__all__ = ["MooncakeConfig", "MooncakeTier"]
