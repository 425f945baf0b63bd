"""Physical deletes of replicas already out of service that failed.

An invalidation retires its chunks and then deletes their replicas; when the delete
fails, the invalidation holds in this process and the caller gets a typed
``StorePathError`` saying that the replicas are still on disk until the close deletes
them (the next open would find them again).

A write-through put whose copy failed takes its new chunks out of service and deletes
the replicas a first copy batch made durable (``Writer._undo_write_through``). When
that delete fails too (the disk tier's catalog cannot be written), the put still
raises its own typed error, not the delete's; the chunks are already out of service,
so nothing serves them in this process. Their frames would be found again by the next
open (their bytes are the ones written and verify, but the put that wrote them said
nothing was stored). So the failure is logged, counted in ``deletes_failed``, and the
deletes are kept: the close retries each, once, unless a record names its key with a
replica in that tier (a key put again since and written there holds that put's
replica under the key; deletes go by key). A delete that
fails at close too leaves the frames for the next open, logged.

The deletes a load left to the store's background thread (``StoreCore.delete_later``:
replicas a reader found retired) go the same way: a failure there had no caller and
was lost with its job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import TierName

if TYPE_CHECKING:  # the core runs these for its background deletes
    from kvlife.store.core import StoreCore

log = logging.getLogger(__name__)


def delete_or_keep(
    core: StoreCore, doomed: Iterable[tuple[TierName, ChunkKey]]
) -> KVLifeError | OSError | None:
    """``core.delete_replicas(doomed)`` (in the caller's sequencer turn); a failure is
    logged and counted, the deletes are kept for :func:`retry_kept` at close, and the
    failure is returned (the caller says what it means for its own call)."""
    doomed = list(doomed)
    try:
        core.delete_replicas(doomed)
        return None
    except (KVLifeError, OSError) as exc:
        left = [(t, k) for t, k in doomed if core.tiers[t].contains(k)]
        with core.lock:
            core.counters.deletes_failed += len(left)
            core.undeleted += left
        log.warning(
            "deleting %d replicas taken out of service failed (retried at close): %s",
            len(left),
            exc,
        )
        return exc


def retry_kept(core: StoreCore) -> None:
    """At close, once no plan or read runs: delete each kept replica once, unless a
    record names its key with a replica in that tier (:func:`_holds`); a failure is
    logged (the next open finds those frames again)."""
    with core.lock:
        todo = [(t, k) for t, k in dict.fromkeys(core.undeleted) if not _holds(core, t, k)]
        core.undeleted = []
    if not todo:
        return
    try:
        core.delete_replicas(todo)
    except (KVLifeError, OSError) as exc:
        log.error(
            "deleting %d replicas taken out of service failed again at close: the next "
            "open of %s finds them again: %s",
            len(todo),
            core.path,
            exc,
        )


def _holds(core: StoreCore, tier: TierName, key: ChunkKey) -> bool:
    """Whether a record names ``key`` with a replica in ``tier`` (under the lock): that
    replica was written after the one kept, under the same key, and is the tier's now.
    A record without one there (a key put again and held in DRAM only) leaves the kept
    replica the tier's: it goes, or the next open would serve the bytes it held."""
    rec = core.index.get(key)
    return rec is not None and tier in rec.replicas
