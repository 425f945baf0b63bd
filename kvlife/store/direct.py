"""Direct disk reads (issue 28): a client on the store's host reads a disk hit's frame
itself and verifies it, while the store confirms that the chunk is still live in that
frame.

A served disk load spent about half a millisecond of the server's Python before its
first device read (the request, the pins, the I/O thread) and more after the last: a
4-chunk load of 2 MiB chunks ran at 0.55-0.65 of raw reads through ``kvlife serve``,
against 0.9 for the same reads in one process. Here the lookup names each disk hit's
frame (:func:`frame_hints`: its catalog row and segment file), the client reads and
verifies the frames with the disk tier's own reader (the header byte for byte, the
payload's xxh3-128 against the row's checksum), and one request, handled while it
reads, asks the store whether each chunk is still live in that frame
(:func:`confirm`).

Why this serves no wrong KV:

- A frame that verifies holds the bytes its key was put with: the header names the key,
  the dtype, the shape and the payload's checksum, and the payload hashes to it. A frame
  moved, compacted away, torn or overwritten since the lookup does not verify, and the
  client loads that chunk through the server instead.
- The confirmation orders the load against invalidations: each chunk confirmed was
  INDEXED, with that very frame as a readable replica of its disk tier, while the store
  held its lock, as a served load's pin would have found it. A chunk invalidated (or
  evicted from the disk tier, or rewritten elsewhere) before that is not confirmed, and
  neither is any chunk after it.
- The client keeps the leading chunks both verified and confirmed; the rest are loaded
  through the server, which reads, verifies and counts what it finds (a corrupt frame is
  counted and retired there, as on any load).

Only exact replicas are hinted (a replica in a transform's frame needs the store's
decoder), and only to clients the server lets map its arena (a server with principals
hints nothing: the segment files hold every tenant's frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import EXACT, ObjectRecord, TierName
from kvlife.results import ChunkHit
from kvlife.store.core import StoreCore
from kvlife.tiers.disk.catalog import CatalogRow
from kvlife.tiers.disk.tier import DiskTier

INDEXED = ObjectState.INDEXED


@dataclass(frozen=True, slots=True)
class FrameHint:
    """Where a disk hit's frame is and what it must verify to."""

    row: CatalogRow
    path: str
    """The segment file holding it (absolute)."""


def _disk_tiers(core: StoreCore) -> dict[TierName, DiskTier]:
    return {name: t for name, t in core.tiers.items() if isinstance(t, DiskTier)}


def frame_hints(core: StoreCore, hits: Sequence[ChunkHit]) -> list[FrameHint | None]:
    """Each hit's frame, where the hit is served exact from a disk tier (else None)."""
    disks = _disk_tiers(core)
    out: list[FrameHint | None] = [None] * len(hits)
    for name, tier in disks.items():
        mine = [i for i, h in enumerate(hits) if h.tier == name and h.transform == EXACT.name]
        if not mine:
            continue
        rows = tier.frame_rows([hits[i].key for i in mine])
        for i, row in zip(mine, rows, strict=True):
            if row is not None and row.transform == EXACT.name:
                out[i] = FrameHint(row, tier.segment_file(row.seg))
    return out


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The chunks of a direct load the store found live in the frames the client read."""

    found: tuple[tuple[ObjectRecord, TierName], ...]
    """Each one's record and the disk tier whose frame it is, from the first."""
    request_id: str


def confirm(
    core: StoreCore, keys: Sequence[ChunkKey], frames: Sequence[tuple[int, int]], request_id: str
) -> Confirmed:
    """The leading ``keys`` that are INDEXED now with a readable exact replica in a disk
    tier whose frame is at ``frames[i]`` (segment, offset); stops at the first that is
    not. Nothing is counted yet: the client says how many it kept (:func:`record`)."""
    disks = _disk_tiers(core)
    found: list[tuple[ObjectRecord, TierName]] = []
    with core.lock:
        core.check_open()
        rows = {name: tier.frame_rows(keys) for name, tier in disks.items()}  # one lock each
        for i, (key, (seg, off)) in enumerate(zip(keys, frames, strict=True)):
            rec = core.index.get(key)
            if rec is None or rec.state is not INDEXED:
                break
            where = None
            for name in disks:
                rep = rec.replicas.get(name)
                if rep is None or not rep.readable or rep.transform != EXACT:
                    continue
                row = rows[name][i]
                if row is not None and row.seg == seg and row.off == off:
                    where = name
                    break
            if where is None:
                break
            found.append((rec, where))
    return Confirmed(tuple(found), request_id)


def record(core: StoreCore, confirmed: Confirmed, kept: int) -> int:
    """Count the load: the first ``kept`` chunks confirmed (the client verified them
    and kept them) as loaded from their disk tier, each with its LOAD in the ledger
    (one invalidated since it was confirmed was loaded before that: counted, its move
    not recorded on a record that left the index). How many were counted."""
    took = confirmed.found[: max(0, kept)]
    with core.lock:
        core.counters.loads += 1
        for rec, tier in took:
            count_exact_load(core, rec, tier, confirmed.request_id)
            core.counters.direct_loads += 1
    return len(took)


def count_exact_load(core: StoreCore, rec: ObjectRecord, tier: TierName, request_id: str) -> None:
    """Under the store's lock: one chunk loaded exact from ``tier``'s frame, read outside
    the store (a direct read, a frame load): its LOAD in the ledger while it is INDEXED
    (a record that left the index takes no move), the tier's and the store's counts."""
    if rec.state is INDEXED:
        core.ledger.move(
            rec,
            Move.LOAD,
            tier=tier,
            nbytes=rec.nbytes,
            request_id=request_id,
            transform=EXACT.name,
        )
    tc = core.counters.tier(tier)
    tc.loaded += 1
    tc.bytes_loaded += rec.nbytes
    core.counters.bytes_loaded += rec.nbytes
