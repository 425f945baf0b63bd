"""KVStore: the one facade an engine talks to (public API only; the work is done by the
modules of :mod:`kvlife.store`; the API itself, its argument checks and docstrings are
:class:`~kvlife.store.api.StoreAPI`'s, which ``RemoteStore`` has too).

``KVStore.open(path, dram_bytes=..., disk_bytes=...)`` is the embedded default: a host
DRAM tier in front of a disk tier (segment files + SQLite catalog) under ``path``;
``tiers=(TierSpec(...), ...)`` names any chain. Every lifecycle move is checked against
the transition table and emitted to the event sink; only INDEXED objects are served.

Threads of one process may share a store: lookups and loads never wait for another
thread's write, fsync or disk read (the index lock is held only for bookkeeping). A
store directory is held by one process at a time: a second ``open`` raises
:class:`~kvlife.core.errors.StoreLockedError`; many processes share one through
``kvlife serve`` and :func:`kvlife.connect`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import EventSink
from kvlife.core.identity import ChunkKey
from kvlife.core.lifecycle import ObjectState
from kvlife.core.objects import PromptRef, TierName
from kvlife.results import ChunkHit, LoadResult, LookupResult, PutResult, StoreCounters, StoreInfo
from kvlife.store import args, direct, frame_loads, metrics
from kvlife.store.api import Criteria, Outs, StoreAPI
from kvlife.store.config import GiB, StoreConfig
from kvlife.store.direct import Confirmed, FrameHint
from kvlife.store.frame_loads import FrameLoad
from kvlife.store.invalidation import invalidate, orphaned
from kvlife.store.lifecycle import close_store, open_store
from kvlife.store.reads import LoadHandle, Reader
from kvlife.store.recovery import audit
from kvlife.store.writes import PendingPut, Writer
from kvlife.tiers.base import AuditReport, Tier
from kvlife.tiers.disk.fileio import FileIO
from kvlife.transforms.contract import Accept


class KVStore(StoreAPI[PendingPut]):
    """Typed KV objects with full identity, an enforced lifecycle and crash-safe tiers.
    The public API is :class:`~kvlife.store.api.StoreAPI`'s (argument checks there);
    this class supplies its steps from the writer and the reader of the store."""

    def __init__(
        self,
        path: str | Path,
        config: StoreConfig,
        *,
        sink: EventSink | None = None,
        fileio: FileIO | None = None,
    ) -> None:
        if not isinstance(config, StoreConfig):
            raise InvalidArgument(f"config must be a StoreConfig, got {type(config).__name__}")
        self.path = Path(path)
        self.config = config
        self._open = open_store(self.path, config, sink, fileio)
        self._core = self._open.core
        self.parity_repair = self._open.parity_repair
        """What parity rebuilt (or could not) at this open."""
        self._writer = Writer(self._core)
        self._reader = Reader(self._core)

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        dram_bytes: int = 1 * GiB,
        disk_bytes: int = 8 * GiB,
        sink: EventSink | None = None,
        fileio: FileIO | None = None,
        **settings: object,
    ) -> KVStore:
        """Open (or create) the store at ``path``; see :class:`StoreConfig` for settings
        (an unknown one is an InvalidArgument naming it)."""
        config = StoreConfig.from_settings(
            {"dram_bytes": dram_bytes, "disk_bytes": disk_bytes, **settings}
        )
        return cls(path, config, sink=sink, fileio=fileio)

    # ------------------------------------------------------------------ the steps of StoreAPI

    # a parent named by its prefix tokens is derived here (PromptRef.chained), so the
    # writer and the reader only ever see parent keys

    def _put_prompt(self, prompt: PromptRef, kv: object, request_id: str) -> PutResult:
        pending = self._writer.prepare_put(prompt.chained(), kv, request_id)
        return self._writer.commit_put(pending)

    def _prepare_put(self, prompt: PromptRef, kv: object, request_id: str) -> PendingPut:
        # the arrays of kv are referenced, not copied
        return self._writer.prepare_put(prompt.chained(), kv, request_id)

    def _lookup(self, prompt: PromptRef, accept: Accept) -> LookupResult:
        return self._reader.lookup(prompt.chained(), accept)

    def _load(self, lookup: LookupResult, outs: Outs, request_id: str) -> LoadResult:
        # leading disk hits into buffers O_DIRECT can fill: read from their frames in
        # this thread's run of the extension, without pins (kvlife.store.frame_loads)
        if outs is not None:
            core, depth = self._core, frame_loads.DEPTH
            frames = frame_loads.start(core, lookup, outs, request_id, depth, self._reader)
            if frames is not None:
                try:
                    return frames.wait()
                finally:
                    frames.close()
        return self._reader.load(lookup, outs, request_id)

    def _load_async(
        self, lookup: LookupResult, outs: Outs, request_id: str, depth: int | None
    ) -> LoadHandle:
        return self._reader.load_async(lookup, outs, request_id, depth)

    def _invalidate(self, criteria: Criteria) -> int:
        return invalidate(self._core, criteria)

    # ------------------------------------------------------------------ its own calls

    def commit_put(self, pending: PendingPut) -> PutResult:
        return self._writer.commit_put(pending)

    def continue_put(self, pending: PendingPut, parent: ChunkKey) -> int:
        """``pending`` continues a put of the same KV stored before it, whose last chunk
        is ``parent`` (``kvlife serve``: a ``put_prompt`` sent in pieces): if that chunk
        is no longer live (an invalidation took it since), ``pending`` stores nothing
        (its chunks counted as dropped at the commit). Returns how many chunks it lost."""
        with self._core.lock:
            return orphaned(self._core, parent, [rec for rec, _ in pending.items])

    def put_async(self, pending: PendingPut) -> Future[PutResult]:
        return self._writer.put_async(pending)

    def abort_put(self, pending: PendingPut, reason: str = "aborted by caller") -> None:
        self._writer.abort_put(pending, reason)

    def evict(self, tier: str, nbytes: int) -> int:
        return self._writer.evict(TierName(tier), nbytes)

    def flush(self) -> int:
        done = self._writer.flush()
        metrics.save_lifetime(self._core, self._open.lifetime_base)
        return done

    def drain(self) -> None:
        self._reader.drain()

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> AuditReport:
        """Audit every tier that can be audited (payload checksums included); with
        ``fix`` bad replicas are dropped (their objects invalidated as corrupt)."""
        return audit(self._core, fix, progress)

    def info(self) -> StoreInfo:
        return metrics.info(self._core, self._open.lifetime_base)

    def namespace_figures(
        self, label: Callable[[str], str] = str
    ) -> tuple[dict[str, tuple[dict[str, int], dict[str, int], dict[str, int]]], int]:
        """Per namespace (``label`` of its text, for exporters that aggregate): objects
        by state, their bytes by state, their replicas' bytes per tier; and the
        TENTATIVE objects (:func:`kvlife.store.metrics.by_namespace`)."""
        return metrics.by_namespace(self._core, label)

    def share_figures(self) -> dict[str, dict[str, dict[str, int]]]:
        """Quotas (:attr:`StoreConfig.tenant_shares`): each tier with shares -> tenant ->
        its ``share`` and ``used`` bytes, resident ``keys`` and ``evicted`` objects
        since this open; empty without shares."""
        return self._core.share_figures()

    @property
    def counters(self) -> StoreCounters:
        """Counters since this open."""
        return self._core.counters

    def tier(self, name: str) -> Tier:
        """The tier of the chain called ``name``."""
        got = self._core.tiers.get(TierName(name))
        if got is None:
            raise InvalidArgument(f"store has no tier {name!r}; tiers: {list(self._core.tiers)}")
        return got

    def frame_hints(self, hits: Sequence[ChunkHit]) -> list[FrameHint | None]:
        """Each hit's disk frame, for a reader on this host (:mod:`kvlife.store.direct`)."""
        return direct.frame_hints(self._core, hits)

    def confirm_direct(
        self, keys: Sequence[ChunkKey], frames: Sequence[tuple[int, int]], request_id: str = ""
    ) -> Confirmed:
        """The leading ``keys`` live in those disk frames now
        (:func:`kvlife.store.direct.confirm`); :meth:`record_direct` counts the load."""
        return direct.confirm(self._core, keys, frames, request_id)

    def load_frames(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray | None],
        *,
        request_id: str = "",
        depth: int = 1,
    ) -> FrameLoad | None:
        """Like :meth:`load_async` into ``outs``, with the leading hits served exact from
        disk read from their frames by the extension in this thread's run (up to
        ``depth`` reads in flight), without pins or the I/O pool; None where it cannot
        (:func:`kvlife.store.frame_loads.start`): load through :meth:`load_async`. A hit
        whose buffer is None is read into new memory, as is every hit after it. The
        handle is for the calling thread alone."""
        args.outs(lookup, outs)
        args.depth(depth)
        return frame_loads.start(self._core, lookup, outs, request_id, depth, self._reader)

    def record_direct(self, confirmed: Confirmed, kept: int) -> int:
        """Count a direct load whose first ``kept`` confirmed chunks the client kept."""
        return direct.record(self._core, confirmed, kept)

    @property
    def tier_names(self) -> list[TierName]:
        return [t.name for t in self._core.chain]

    def namespaces_of(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """The namespace (its text) each key's object was stored under; None for a key
        the store does not know (a server with principals checks a load's keys)."""
        with self._core.lock:
            recs = [self._core.index.get(k) for k in keys]
        return [None if r is None else r.info.namespace for r in recs]

    def indexed_keys(self) -> list[ChunkKey]:
        """Keys of every indexed object."""
        with self._core.lock:
            return [r.key for r in self._core.index if r.state is ObjectState.INDEXED]

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless ``flush=False``), then release files, threads and the lock."""
        close_store(self._open, self._writer, self._reader, flush=flush)
