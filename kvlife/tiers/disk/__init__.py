"""Disk tier: framed replicas packed into segment files, with a crash-safe SQLite catalog.

:class:`DiskTier` composes one room per job (segments, writer, reader, compaction,
recovery, audit, repair, links, counters); :mod:`kvlife.tiers.disk.tier` says which
does what and when the tier lock is held.
"""

from kvlife.tiers.disk.tier import DiskTier, DiskTierConfig

__all__ = ["DiskTier", "DiskTierConfig"]
