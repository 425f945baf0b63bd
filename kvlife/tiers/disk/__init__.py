"""Disk tier: framed replicas packed into segment files, with a crash-safe SQLite catalog."""

from kvlife.tiers.disk.tier import DiskTier, DiskTierConfig

__all__ = ["DiskTier", "DiskTierConfig"]
