"""KVStore: the one facade an engine talks to (public API only; the work is done by the
modules of :mod:`kvlife.store`).

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
from kvlife.core.identity import ROOT_PARENT, ChunkKey, ModelIdentity, Namespace
from kvlife.core.lifecycle import ObjectState
from kvlife.core.objects import PromptRef, TierName
from kvlife.results import LoadResult, LookupResult, PutResult, StoreCounters, StoreInfo
from kvlife.store import metrics
from kvlife.store.config import GiB, StoreConfig
from kvlife.store.invalidation import invalidate
from kvlife.store.lifecycle import close_store, open_store
from kvlife.store.reads import LoadHandle, Reader
from kvlife.store.recovery import audit
from kvlife.store.writes import PendingPut, Writer
from kvlife.tiers.base import AuditReport, Tier
from kvlife.tiers.disk.fileio import FileIO
from kvlife.transforms.contract import Accept

Tokens = Sequence[int] | np.ndarray


class KVStore:
    """Typed KV objects with full identity, an enforced lifecycle and crash-safe tiers."""

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

    # ------------------------------------------------------------------ puts

    def put_prompt(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        request_id: str = "",
    ) -> PutResult:
        """Store the full chunks of a prompt's KV (``prepare_put`` + ``commit_put``).

        ``kv`` is one array (or CPU tensor) shaped ``(layers, 2, kv_heads, T, head_dim)``
        with ``chunks * tokens_per_chunk <= T <= len(tokens)``, or a sequence of chunk
        arrays shaped like ``identity.layout.chunk_shape``. A trailing partial chunk is
        never stored. Everything is validated before anything is written.
        """
        ref = PromptRef(identity, namespace, tokens, start, parent, extra_keys)
        return self._writer.commit_put(self._writer.prepare_put(ref, kv, request_id))

    def prepare_put(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        request_id: str = "",
    ) -> PendingPut:
        """Validate and create TENTATIVE objects for the prompt's new chunks; nothing is
        visible until :meth:`commit_put`. The arrays in ``kv`` are referenced, not copied:
        keep them unchanged until the commit or abort."""
        ref = PromptRef(identity, namespace, tokens, start, parent, extra_keys)
        return self._writer.prepare_put(ref, kv, request_id)

    def commit_put(self, pending: PendingPut) -> PutResult:
        """Write, make durable as the tier promises, then index the pending chunks. On a
        write error the batch is aborted and the typed error raised; nothing of it is
        visible."""
        return self._writer.commit_put(pending)

    def put_async(self, pending: PendingPut) -> Future[PutResult]:
        """``commit_put`` in the background; ``.result()`` returns or raises as it would."""
        return self._writer.put_async(pending)

    def abort_put(self, pending: PendingPut, reason: str = "aborted by caller") -> None:
        """Roll back a pending put: its TENTATIVE objects become DELETED."""
        self._writer.abort_put(pending, reason)

    # ------------------------------------------------------------------ reads

    def lookup(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        accept: Accept = Accept.EXACT,
    ) -> LookupResult:
        """The longest run of INDEXED leading chunks that have a replica ``accept`` takes
        (default: exact replicas only), each with the fastest such tier, the replica's
        transform and its estimated decode cost. A chunk whose readable replicas are all
        refused (or of a transform this reader does not know) ends the run."""
        return self._reader.lookup(
            PromptRef(identity, namespace, tokens, start, parent, extra_keys), accept
        )

    def load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> LoadResult:
        """Load the hits of ``lookup`` in order, verified, into ``outs`` (one buffer per
        hit) or new read-only arrays; framed replicas (a transforming tier's) are
        verified and decoded into them. Each chunk is served from a replica the lookup's
        ``accept`` takes. The first chunk that is gone or fails verification ends the
        result; a corrupt replica is invalidated (reason ``corrupt``)."""
        return self._reader.load(lookup, outs, request_id)

    def load_async(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
        depth: int | None = None,
    ) -> LoadHandle:
        """Like :meth:`load`, returning at once; ``handle.chunk(i)`` waits for chunk i only.
        ``depth`` bounds the reads in flight (None: every chunk at once); reads start in
        chunk order, so with a small depth the first chunks complete first and a consumer
        works on chunk i while later ones are read."""
        return self._reader.load_async(lookup, outs, request_id, depth)

    def get(
        self, identity: ModelIdentity, namespace: Namespace, tokens: Tokens, **kwargs: object
    ) -> LoadResult:
        """lookup + load in one call."""
        return self.load(self.lookup(identity, namespace, tokens, **kwargs))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ management

    def invalidate(
        self,
        *,
        weights_digest: str | None = None,
        adapter_id: str | None = None,
        namespace: Namespace | None = None,
        prefix: ChunkKey | None = None,
    ) -> int:
        """Invalidate and delete every object matching all the given criteria; ``prefix``
        selects that chunk and every chunk chained after it, present or not in between.
        Puts in flight are covered too: a chunk of a put prepared before this returned
        is never stored. On a store whose chain has a shared tier (Redis, Mooncake) the
        invalidation is global: recorded in the shared index first, so every host stops
        serving what it covers at its next lookup (docs/remote.md), then applied here
        (IndexUnreachable if it could only be applied here). Returns the number of
        objects removed here; durable when it returns."""
        return invalidate(
            self._core,
            weights_digest=weights_digest,
            adapter_id=adapter_id,
            namespace=namespace,
            prefix=prefix,
        )

    def evict(self, tier: str, nbytes: int) -> int:
        """Evict ``nbytes``' worth of replicas from ``tier``, coldest first by its policy:
        victims until the room they held there adds up to at least ``nbytes`` (or no
        unpinned replica is left), however much of its budget was free already; each
        victim held only there is demoted to the next tier first where the chain allows.
        Returns the payload bytes of the replicas evicted from it (a tier that stores
        frames or rounds to pages charges a replica a different room)."""
        return self._writer.evict(TierName(tier), nbytes)

    def flush(self) -> int:
        """Make every object durable; returns how many replicas were copied."""
        done = self._writer.flush()
        metrics.save_lifetime(self._core, self._open.lifetime_base)
        return done

    def drain(self) -> None:
        """Wait for background work (promotions) planned so far."""
        self._reader.drain()

    def check(
        self, fix: bool = False, progress: Callable[[int], object] | None = None
    ) -> AuditReport:
        """Audit every tier that can be audited (payload checksums included); with
        ``fix`` bad replicas are dropped (their objects invalidated as corrupt)."""
        return audit(self._core, fix, progress)

    def info(self) -> StoreInfo:
        return metrics.info(self._core, self._open.lifetime_base)

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

    @property
    def tier_names(self) -> list[TierName]:
        """The chain, fastest first."""
        return [t.name for t in self._core.chain]

    def indexed_keys(self) -> list[ChunkKey]:
        """Keys of every indexed object."""
        with self._core.lock:
            return [r.key for r in self._core.index if r.state is ObjectState.INDEXED]

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless ``flush=False``), then release files, threads and the lock."""
        close_store(self._open, self._writer, self._reader, flush=flush)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
