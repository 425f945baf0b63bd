"""The device operations of a cache replay, per request, read from its lifecycle events.

:class:`~kvlife.replay.cache.CacheSim` decides placement with the store's own placement
engine and emits one lifecycle event per move; it does not say which request each
eviction or offload belongs to. :class:`OpsRecorder` is the event sink that keeps the
moves a device model needs and :func:`split_requests` cuts them into requests: request
``r`` emits, in order, one ``load`` per block of its usable prefix, the moves of its
promotions, one ``put`` per block it did not find, then the moves of placing them. The
prefix and put counts of every request are in the :class:`~kvlife.replay.cache.CacheRun`,
so the cut is exact; a stream that does not match raises (a broken invariant).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlife.core.errors import KVLifeError
from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.replay.cache import DISK, DRAM, CacheRun

LOAD, PUT, WRITE, OFFLOAD, EVICT, OTHER = range(6)
_KIND = {"load": LOAD, "put": PUT, "write": WRITE, "offload": OFFLOAD, "evict": EVICT}
_TIER = {"": 0, DRAM: 1, DISK: 2}


class OpsStreamError(KVLifeError):
    """The replay's event stream does not match its per-request counts."""


class OpsRecorder(EventSink):
    """Keeps ``(kind, key, tier, dst_tier)`` of the moves that touch a device, and passes
    every event to ``tee`` (the lifecycle analysis) when given."""

    def __init__(self, tee: EventSink | None = None) -> None:
        self.rows: list[tuple[int, int, int, int]] = []
        self.tee = tee

    def emit(self, event: LifecycleEvent) -> None:
        if self.tee is not None:
            self.tee.emit(event)
        kind = _KIND.get(event.kind)
        if kind is not None:
            self.rows.append((kind, int(event.key, 16), _TIER[event.tier], _TIER[event.dst_tier]))


@dataclass(slots=True)
class RequestOps:
    """What one request does to the local devices (block keys)."""

    disk_reads: list[int] = field(default_factory=list)
    """Prefix blocks served from the SSD."""
    promotions: int = 0
    """Blocks copied from SSD into DRAM (written to DRAM; read once, with the load)."""
    demotions: list[int] = field(default_factory=list)
    """Blocks read from DRAM and written to the SSD."""
    disk_new: list[int] = field(default_factory=list)
    """New blocks placed directly on the SSD."""
    dram_new: int = 0
    """New blocks placed in DRAM."""
    disk_trims: list[int] = field(default_factory=list)
    """Blocks evicted from the SSD."""


def split_requests(rows: list[tuple[int, int, int, int]], run: CacheRun) -> list[RequestOps]:
    """Cut the recorded moves into per-request operations (see the module docstring)."""
    loads = (run.prefix_dram + run.prefix_disk).tolist()
    puts = (run.new + run.dropped).tolist()
    out: list[RequestOps] = []
    i, n = 0, len(rows)

    def moves(ops: RequestOps) -> None:
        nonlocal i
        while i < n and rows[i][0] not in (LOAD, PUT):
            kind, key, tier, dst = rows[i]
            if kind == WRITE:
                if tier == 2:
                    ops.disk_new.append(key)
                else:
                    ops.dram_new += 1
            elif kind == OFFLOAD:
                if dst == 2:
                    ops.demotions.append(key)
                else:
                    ops.promotions += 1
            elif kind == EVICT and tier == 2:
                ops.disk_trims.append(key)
            i += 1

    for r, (nl, npt) in enumerate(zip(loads, puts, strict=True)):
        ops = RequestOps()
        for _ in range(nl):
            if i >= n or rows[i][0] != LOAD:
                raise OpsStreamError(f"request {r}: expected {nl} loads at event {i}")
            if rows[i][2] == 2:
                ops.disk_reads.append(rows[i][1])
            i += 1
        moves(ops)
        for _ in range(npt):
            if i >= n or rows[i][0] != PUT:
                raise OpsStreamError(f"request {r}: expected {npt} puts at event {i}")
            i += 1
        moves(ops)
        out.append(ops)
    if i != n:
        raise OpsStreamError(f"{n - i} events left after the last request")
    return out
