"""RemoteStore: the public API of :class:`~kvlife.store.KVStore`, served by ``kvlife
serve`` over its Unix socket, with bulk bytes through the server's shared-memory arena.

A small composition: the :class:`~kvlife.client.wire.Wire` (the connection, one
request at a time, reconnecting), the load protocol (:mod:`kvlife.client.loads`:
lookups, hinted, shared-buffer and granted loads) and the put protocol
(:mod:`kvlife.client.puts`: the staged one-round-trip put and the two-phase put). Made
by :func:`kvlife.connect`.

When the server cannot be reached every call raises
:class:`~kvlife.core.errors.StoreUnavailable` (an engine treats it as a miss); the next
call tries to reconnect, so a restarted server is picked up by itself. Pending puts and
loads of a lost connection are gone (the server aborted them); finishing one raises
StoreUnavailable. A RemoteStore may be shared by the threads of a process: calls are
serialised on its one connection, and the copies that overlap a round trip (hinted
loads, staged puts) run inside that serialisation; grant copies run outside it. Threads
that load in parallel each want a RemoteStore of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.client.handles import RemoteLoadHandle, RemotePendingPut
from kvlife.client.loads import Loads
from kvlife.client.puts import Puts
from kvlife.client.wire import Wire
from kvlife.core.errors import InvalidArgument, StoreUnavailable
from kvlife.core.identity import ROOT_PARENT, ChunkKey, ModelIdentity, Namespace
from kvlife.core.objects import PromptRef, TierName
from kvlife.results import LoadResult, LookupResult, PutResult, StoreCounters, StoreInfo, TierInfo
from kvlife.tiers.base import AuditReport
from kvlife.transforms.contract import Accept

Tokens = Sequence[int] | np.ndarray


class RemoteStore:
    """A store served by ``kvlife serve`` (the public API of ``KVStore``)."""

    def __init__(
        self, socket_path: str | Path, *, timeout: float | None = 60.0, lazy: bool = False
    ) -> None:
        """Connect to the server on ``socket_path`` (StoreUnavailable if it is not there;
        with ``lazy`` the first call connects instead, so a client may start first)."""
        self._wire = Wire(str(socket_path), timeout)
        self._loads = Loads(self._wire)
        self._puts = Puts(self._wire)
        if not lazy:
            self._wire.call("info", {})  # connect now: a wrong path fails here, typed

    @property
    def socket_path(self) -> str:
        return self._wire.socket_path

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
        """Store a prompt's chunks (:mod:`kvlife.client.puts`)."""
        ref = _prompt(identity, namespace, tokens, start, parent, extra_keys)
        return self._puts.put_prompt(ref, kv, request_id)

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
    ) -> RemotePendingPut:
        ref = _prompt(identity, namespace, tokens, start, parent, extra_keys)
        return self._puts.prepare_put(ref, kv, request_id)

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
        if not isinstance(accept, Accept):
            raise InvalidArgument(f"accept must be an Accept, got {type(accept).__name__}")
        ref = _prompt(identity, namespace, tokens, start, parent, extra_keys)
        return self._loads.lookup(ref, accept)

    def load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> LoadResult:
        _outs(lookup, outs)
        return self._loads.load(lookup, outs, request_id)

    def load_async(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> RemoteLoadHandle:
        _outs(lookup, outs)
        return self._loads.load_async(lookup, outs, request_id)

    def get(
        self, identity: ModelIdentity, namespace: Namespace, tokens: Tokens, **kwargs: object
    ) -> LoadResult:
        return self.load(self.lookup(identity, namespace, tokens, **kwargs))  # type: ignore[arg-type]

    def invalidate(
        self,
        *,
        weights_digest: str | None = None,
        adapter_id: str | None = None,
        namespace: Namespace | None = None,
        prefix: ChunkKey | None = None,
    ) -> int:
        args: dict[str, Any] = {}
        if weights_digest is not None:
            args["weights_digest"] = weights_digest
        if adapter_id is not None:
            args["adapter_id"] = adapter_id
        if namespace is not None:
            args["namespace"] = str(namespace)
        if prefix is not None:
            args["prefix"] = bytes(prefix)
        n: int = self._wire.call("invalidate", args)
        return n

    # ------------------------------------------------------------------ its own calls

    def commit_put(self, pending: RemotePendingPut) -> PutResult:
        return self._puts.commit_put(pending)

    def put_async(self, pending: RemotePendingPut) -> Future[PutResult]:
        return self._puts.put_async(pending)

    def abort_put(self, pending: RemotePendingPut, reason: str = "aborted by caller") -> None:
        self._puts.abort_put(pending, reason)

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of shared memory (uint8, page-aligned) that the server writes into:
        a load whose output buffers all lie in such memory lands there directly (disk
        reads by O_DIRECT, DRAM hits copied by the server), with no copy in this process.
        Slice it into chunk-shaped views. It lasts as long as the connection; after a
        reconnect loads into it take the ordinary path (still correct, one copy more)."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"buffer size must be a positive int, got {nbytes!r}")
        return self._loads.alloc_buffer(nbytes)

    def evict(self, tier: str, nbytes: int) -> int:
        n: int = self._wire.call("evict", {"tier": tier, "nbytes": nbytes})
        return n

    def flush(self) -> int:
        n: int = self._wire.call("flush", {})
        return n

    def drain(self) -> None:
        self._wire.call("drain", {})

    def check(self) -> AuditReport:
        """The server's audit of its store (read-only: no fix through the socket)."""
        r = dict(self._wire.call("check", {}))
        r.pop("clean", None)
        return AuditReport(**r)

    def info(self) -> StoreInfo:
        r = self._wire.call("info", {})
        return StoreInfo(
            path=r["path"],
            tiers=[TierInfo(**t) for t in r["tiers"]],
            objects_by_state=r["objects_by_state"],
            bytes_by_state=r["bytes_by_state"],
            counters=r["counters"],
            lifetime_counters=r["lifetime_counters"],
        )

    def server_info(self) -> dict[str, Any]:
        """``info`` as the server sends it, with its ``server`` section (sessions, leases,
        arena)."""
        out: dict[str, Any] = self._wire.call("info", {})
        return out

    def server_state(self) -> dict[str, Any]:
        """Live sessions, leases held, TENTATIVE objects and arena figures."""
        out: dict[str, Any] = self._wire.call("state", {})
        return out

    @property
    def counters(self) -> StoreCounters:
        """The server's counters since it opened the store (all clients together)."""
        return StoreCounters().add(self._wire.call("counters", {}))

    @property
    def tier_names(self) -> list[TierName]:
        if self._wire.conn is None:
            self._wire.call("info", {})
        return [TierName(n) for n in self._wire.names]

    def close(self, *, flush: bool = False) -> None:
        """Close the connection (the server keeps the store open for other clients);
        ``flush=True`` asks the server to flush first."""
        if self._wire.closed:
            return
        with contextlib.suppress(StoreUnavailable):
            if flush:
                self.flush()
            elif self._wire.conn is not None and self._wire.conn.releases:
                self._wire.call("state", {})  # hands the waiting grants back
        self._wire.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prompt(
    identity: ModelIdentity,
    namespace: Namespace,
    tokens: Tokens,
    start: int,
    parent: ChunkKey,
    extra_keys: Sequence[bytes],
) -> PromptRef:
    if not isinstance(identity, ModelIdentity):
        raise InvalidArgument(f"identity must be a ModelIdentity, got {type(identity).__name__}")
    if not isinstance(namespace, Namespace):
        raise InvalidArgument(f"namespace must be a Namespace, got {type(namespace).__name__}")
    return PromptRef(identity, namespace, tokens, start, parent, extra_keys)


def _outs(lookup: LookupResult, outs: Sequence[np.ndarray] | None) -> None:
    if outs is not None and len(outs) != len(lookup.hits):
        raise InvalidArgument(f"{len(outs)} output buffers for {len(lookup.hits)} hits")
