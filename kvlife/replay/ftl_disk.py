"""The disk tier of a replay through the page-level FTL, one block at a time.

The bandwidth model of a disk (:func:`kvlife.replay.engine.make_device` ``nvme``) times
a request's bytes; the FTL (:class:`kvlife.sim.ssd_tier.SSDTier`) needs which blocks:
reads of mapped units, trims of evicted blocks, writes of blocks that may overwrite
space GC must reclaim. :class:`FTLDisk` runs a request's disk operations
(:class:`kvlife.replay.ops.RequestOps`, cut from the cache replay's lifecycle events)
on the FTL when the request starts: its disk reads first, then its trims, demotions and
direct disk placements (the room for its KV is made when it is admitted, in arrival
order, so the FTL never holds more than the tier's capacity). ``kvlife replay
--disk-model ftl`` (:func:`kvlife.replay.engine.simulate`) and ``kvlife report``
(:mod:`kvlife.reporting.host`) both time their disk tier through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvlife.replay.ops import RequestOps
from kvlife.sim.ssd_tier import SSDTier

DISK_MODELS = ("bandwidth", "ftl")
"""How a replay times its disk tier: a bandwidth model, or the page-level FTL."""


@dataclass(frozen=True, slots=True)
class DiskIO:
    """What one request's start did on the FTL."""

    done: float
    """When its disk reads finished (its start time if it read nothing)."""
    read_bytes: int
    written_bytes: int
    """Demotions and direct placements written (in the background of the request)."""


class FTLDisk:
    """Per-request disk operations timed on an :class:`SSDTier`."""

    def __init__(
        self,
        tier: SSDTier,
        ops: Sequence[RequestOps],
        block_bytes: int,
        classes: Mapping[int, int] | None = None,
    ) -> None:
        self.tier = tier
        self.ops = ops
        self.block_bytes = block_bytes
        self.classes = classes or {}
        """Lifecycle class of each block (the write's FDP hint); class 0 when absent."""

    def start(self, t: float, r: int, reads: int) -> DiskIO:
        """Request ``r`` starts at ``t``: its first ``reads`` disk blocks are read, then
        its trims and writes are issued."""
        o = self.ops[r]
        bb = self.block_bytes
        tier = self.tier
        done = t
        for key in o.disk_reads[:reads]:
            done = max(done, tier.read(t, bb, key))
        for key in o.disk_trims:
            tier.trim(key)
        wrote = 0
        for key in (*o.demotions, *o.disk_new):
            tier.write(t, bb, key, self.classes.get(key, 0))
            wrote += bb
        return DiskIO(done, min(reads, len(o.disk_reads)) * bb, wrote)
