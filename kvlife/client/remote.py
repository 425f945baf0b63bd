"""RemoteStore: :class:`~kvlife.store.api.StoreAPI`, served by ``kvlife serve`` over its
Unix socket, with bulk bytes through the server's shared-memory arena.

A small composition: the :class:`~kvlife.client.wire.Wire` (the connection, one
request at a time, reconnecting), the load protocol (:mod:`kvlife.client.loads`:
lookups, hinted, shared-buffer and granted loads) and the put protocol
(:mod:`kvlife.client.puts`: the staged one-round-trip put and the two-phase put); the
signatures and argument checks are StoreAPI's, the same as the embedded ``KVStore``'s.
Made by :func:`kvlife.connect`.

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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.client.handles import RemoteLoadHandle, RemoteLookup, RemotePendingPut
from kvlife.client.loads import Loads
from kvlife.client.puts import Puts
from kvlife.client.wire import Wire
from kvlife.core.errors import StoreUnavailable
from kvlife.core.objects import PromptRef, TierName
from kvlife.core.sources import MAX_VERSION
from kvlife.results import LoadResult, LookupResult, PutResult, StoreCounters, StoreInfo, TierInfo
from kvlife.store import args
from kvlife.store.api import Criteria, Outs, StoreAPI
from kvlife.tiers.base import AuditReport
from kvlife.transforms.contract import Accept


class RemoteStore(StoreAPI[RemotePendingPut]):
    """A store served by ``kvlife serve`` (the public API of ``KVStore``)."""

    def __init__(
        self,
        socket_path: str | Path,
        *,
        timeout: float | None = 60.0,
        lazy: bool = False,
        token: str | None = None,
        direct_reads: bool = False,
    ) -> None:
        """Connect to the server on ``socket_path`` (StoreUnavailable if it is not there;
        with ``lazy`` the first call connects instead, so a client may start first).
        ``token``: the principal this client is, on a server with principals where its
        Unix credentials do not say (NotAuthenticated if the server refuses it).
        ``direct_reads``: loads of disk hits read their frames from the server's
        segment files here, verified, while the server confirms them
        (:mod:`kvlife.client.direct`; a server with principals names no frames, and
        its loads go through it as before)."""
        self._wire = Wire(str(socket_path), timeout, token)
        self._loads = Loads(self._wire, direct_reads)
        self._puts = Puts(self._wire)
        if not lazy:
            # connect now: a wrong path fails here, typed. Its hello only: an ``info``
            # here had the server collect its whole heap at every client's connect
            self._wire.connect()

    def direct_fallbacks(self) -> int:
        """Chunks of this client's direct loads it did not keep (not verified here, or
        not confirmed by the server), each loaded through the server instead."""
        return self._loads.direct_fallbacks

    def direct_reads_off(self) -> str | None:
        """Why this client, made with ``direct_reads``, stopped reading disk frames
        itself: a load found the server's segment files out of this process's reach
        (another mount namespace, another user's files), and its loads go through the
        server since. None while it reads them (or was not asked to)."""
        return self._loads.direct_off

    @property
    def socket_path(self) -> str:
        return self._wire.socket_path

    # ------------------------------------------------------------------ the steps of StoreAPI

    def _put_prompt(self, prompt: PromptRef, kv: object, request_id: str) -> PutResult:
        return self._puts.put_prompt(prompt, kv, request_id)

    def _prepare_put(self, prompt: PromptRef, kv: object, request_id: str) -> RemotePendingPut:
        return self._puts.prepare_put(prompt, kv, request_id)

    def _lookup(self, prompt: PromptRef, accept: Accept) -> RemoteLookup:
        return self._loads.lookup(prompt, accept)

    def _load(self, lookup: LookupResult, outs: Outs, request_id: str) -> LoadResult:
        return self._loads.load(lookup, outs, request_id)

    def _load_async(
        self, lookup: LookupResult, outs: Outs, request_id: str, depth: int | None
    ) -> RemoteLoadHandle:
        return self._loads.load_async(lookup, outs, request_id)

    def _invalidate(self, criteria: Criteria) -> int:
        wire: dict[str, object] = {
            "weights_digest": criteria.weights_digest,
            "adapter_id": criteria.adapter_id,
            "namespace": None if criteria.namespace is None else str(criteria.namespace),
            "prefix": None if criteria.prefix is None else bytes(criteria.prefix),
            "source": criteria.source,
            "model": criteria.model,
            "keep_weights_digest": criteria.keep_weights_digest,
        }
        if criteria.source is not None and criteria.versions is not None:
            lo, hi = criteria.versions
            wire["source_lo"] = lo or None  # 0: the default
            wire["source_hi"] = hi if hi < MAX_VERSION else None
        n: int = self._wire.call("invalidate", {k: v for k, v in wire.items() if v is not None})
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
        args.size(nbytes)
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

    def server_stats(self, since: int = 0, events: int = 32) -> dict[str, Any]:
        """What ``kvlife top`` draws: tiers, counters, sessions, leases, latency
        histograms and the lifecycle events after sequence number ``since``
        (:meth:`kvlife.server.session.Session.stats`)."""
        out: dict[str, Any] = self._wire.call("stats", {"since": since, "events": events})
        return out

    @property
    def counters(self) -> StoreCounters:
        """The server's counters since it opened the store (all clients together)."""
        return StoreCounters().add(self._wire.call("counters", {}))

    @property
    def tier_names(self) -> list[TierName]:
        if self._wire.conn is None:
            self._wire.connect()
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
