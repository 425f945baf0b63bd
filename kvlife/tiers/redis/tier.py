"""RedisTier: frames in Redis beside their publication records.

A put pipelines, per replica, a ``SET`` of the payload under a staging name (expiring,
so a writer that dies leaves nothing visible; sent from the payload's own buffer, see
:func:`send_sets`, on one of the tier's sender threads while the writer's thread hashes
the payloads and builds the publish calls), then one ``PUBLISH_STAGED`` script per
hash-tag bucket, which checks that the host holds its lease there (token and deadline,
on the bucket node's clock) and then renames the bucket's staged payloads into place
and writes their records, atomically on the node that owns the bucket. A read is one
``MGET record frame`` per replica (pipelined), verified against the record. A delete is
one ``UNPUBLISH`` script per bucket, under the lease, removing a record and its frame
only if the record is still the one the deleter held. A publish (or the take-back of a
batch part of which published) whose replies are lost is settled at the next write
(:mod:`kvlife.tiers.redis.unsettled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import redis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from kvlife.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    LeaseError,
    RemoteTierError,
    ReplicaReadError,
)
from kvlife.core.identity import ChunkKey
from kvlife.globalindex import GlobalIndex, Health, IndexConfig, RemoteRecord
from kvlife.globalindex.health import REFUSALS
from kvlife.globalindex.record import RecordError
from kvlife.tiers.base import ReadResult, ReplicaMeta
from kvlife.tiers.redis.connect import RedisEndpoint
from kvlife.tiers.redis.published import PublishedTier, _Pending

STAGING_TTL_MS = 120_000
"""A staged payload not published within this expires (its writer died or was cut)."""

SENDERS = 4
"""Threads sending the payloads of writes (one per write in flight, up to this many)."""


class RedisTier(PublishedTier):
    """Replicas in Redis (one server or a cluster), shared by every host of the index."""

    def __init__(
        self,
        endpoint: RedisEndpoint,
        capacity_bytes: int,
        name: str = "redis",
        index: IndexConfig | None = None,
        *,
        backoff_s: float = 0.05,
    ) -> None:
        health = Health(f"redis tier {name}", base_s=backoff_s)
        self.endpoint = endpoint
        self.client = endpoint.connect()
        super().__init__(
            name, capacity_bytes, GlobalIndex(self.client, index or IndexConfig(), health), health
        )
        self._senders = ThreadPoolExecutor(SENDERS, thread_name_prefix=f"kvlife-{name}-send")

    def close(self) -> None:
        self._senders.shutdown(wait=True)
        self._settle_at_close()
        self.client.close()

    def _write(
        self, pending: _Pending, metas: Sequence[ReplicaMeta], payloads: list[np.ndarray]
    ) -> list[RemoteRecord]:
        idx = self.index
        lease = pending.lease
        staged = [idx.staging_key(m.key, pending.nonce) for m in metas]

        def stage() -> list[Any]:
            if isinstance(self.client, redis.Redis):
                return send_sets(self.client, staged, payloads, STAGING_TTL_MS)
            pipe = self.client.pipeline(transaction=False)  # a cluster: redis-py routes
            for name, arr in zip(staged, payloads, strict=True):
                pipe.set(name, arr.data.cast("B"), px=STAGING_TTL_MS)
            return list(pipe.execute(raise_on_error=False))

        # The payloads go out on a worker while this thread hashes them (both release
        # the GIL) and builds the publish calls; a hash that raises still waits for the
        # send, which reads them.
        try:
            sending = self._senders.submit(self.health.call, "stage", stage)
        except RuntimeError as exc:  # the pool was shut down
            raise RemoteTierError(f"{self.name} is closed: nothing written") from exc
        try:
            records = self._records_for(pending, metas, payloads)
            groups = idx.buckets_of([m.key for m in metas])
            calls: list[tuple[list[str], list[object]]] = []
            for at in groups:  # one script per bucket: fence and lease checked once
                keys: list[str] = [idx.fence_key(metas[at[0]].key)]
                for i in at:
                    k = metas[i].key
                    keys += [idx.record_key(k), staged[i], idx.frame_key(k)]
                calls.append((keys, [lease.host, lease.token] + [records[i].encode() for i in at]))
        finally:
            wait([sending])
        staged_res = sending.result()
        failed = [r for r in staged_res if isinstance(r, Exception)]
        if failed:
            self.health.failed(f"stage: {failed[0]}")
            raise RemoteTierError(f"{self.name}: staging payloads failed: {failed[0]}")

        sent = [False]

        def run() -> list[Any]:
            for attempt in (0, 1):
                sent[0] = True
                pipe = self.client.pipeline(transaction=False)
                for keys, args in calls:
                    idx.evalsha(pipe, "PUBLISH_STAGED", keys, args)
                res = list(pipe.execute(raise_on_error=False))
                if attempt == 0 and any(isinstance(r, NoScriptError) for r in res):
                    idx._sha.clear()  # a restarted server lost its scripts: load, redo
                    continue
                return res
            raise AssertionError("unreachable")

        self._current(pending)  # the staged payloads expire unpublished
        try:
            results = self.health.call("publish", run)
        except BaseException:
            if sent[0]:  # the scripts may have run, only their replies lost: settle later
                self.unknown.add(records, [])
            raise
        errors = [r for r in results if isinstance(r, Exception)]
        if not errors:
            return records
        done = [
            i
            for at, r in zip(groups, results, strict=True)
            if not isinstance(r, Exception)
            for i in at
        ]
        if done:  # the batch is all or nothing: take back what did publish (fenced)
            try:
                self._unpublish([ChunkKey(metas[i].key) for i in done], [records[i] for i in done])
            except RemoteTierError:  # the take-back's own outcome is unknown: settle later
                self.unknown.add([records[i] for i in done], [])
        first = errors[0]
        if isinstance(first, RedisError) and str(first).startswith(REFUSALS):
            raise idx.refused(first)
        self.health.failed(f"publish: {first}")
        raise RemoteTierError(f"{self.name}: publish failed: {first}")

    def _fetch(
        self, records: list[RemoteRecord], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[memoryview | bytes | Exception | None]:
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for rec in records:
                pipe.get(self.index.frame_key(rec.header.key))
            return list(pipe.execute(raise_on_error=False))

        return self.health.call("read frames", run)

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        # one round trip: MGET of record and frame per key (same slot)
        self.counters.reads += len(keys)
        idx = self.index

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.execute_command("MGET", idx.record_key(k), idx.frame_key(k))
            return list(pipe.execute(raise_on_error=False))

        try:
            raw = self.health.call("read", run)
        except RemoteTierError as exc:
            self.counters.read_misses += len(keys)
            return [ReplicaReadError(k.hex(), self.name, str(exc)) for k in keys]
        parsed: list[tuple[RemoteRecord | Exception, Any]] = []
        for k, pair in zip(keys, raw, strict=True):
            if isinstance(pair, Exception) or not isinstance(pair, list) or len(pair) != 2:
                parsed.append((RemoteTierError(f"bad reply {type(pair).__name__}"), None))
                continue
            blob, frame = pair
            if blob is None:
                raise self._missing(k, "deleted")
            try:
                found = RemoteRecord.decode(blob)
            except RecordError as exc:
                parsed.append((exc, None))
                continue
            if not self._holds(k, found):
                raise self._missing(k, "replaced by another host")
            parsed.append((found, frame))
        results: list[ReadResult] = []
        for i, (k, (rec, frame)) in enumerate(zip(keys, parsed, strict=True)):
            out = outs[i] if outs is not None else None
            if isinstance(rec, RemoteTierError):
                self.counters.read_misses += 1
                results.append(ReplicaReadError(k.hex(), self.name, str(rec)))
                continue
            if isinstance(rec, Exception):
                self.counters.corrupt += 1
                results.append(ChecksumMismatch(k.hex(), self.name, f"record: {rec}"))
                continue
            h = rec.header
            if out is not None and (out.shape != h.shape or out.dtype != np.dtype(h.dtype)):
                raise InvalidArgument(
                    f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
                    f"{h.dtype}{list(h.shape)}"
                )
            results.append(self._settle(k, rec, frame, out))
        return results

    def _settle_one(self, records: list[RemoteRecord], payloads: list[str]) -> int:
        """Take back the records of a write of unknown outcome that are still its own,
        with their frames (a fenced delete compares each record's bytes); the staged
        frames of records never published expire (``STAGING_TTL_MS``). A record this
        host holds now is spared: a later write of the same bytes under the same token
        (another thread's) published a record equal to this one, and holds it (no
        write is in flight meanwhile: :class:`~kvlife.tiers.redis.unsettled.SettleGate`)."""
        with self._lock:
            held = [self._held.get(ChunkKey(r.header.key)) for r in records]
        mine = [r for r, h in zip(records, held, strict=True) if h is None or h.blob() != r.blob()]
        keys = [ChunkKey(r.header.key) for r in mine]
        return len(self._delete_records(keys, mine, frames=True)) if mine else 0

    def _unpublish(self, keys: Sequence[ChunkKey], records: Sequence[RemoteRecord]) -> None:
        self._delete_records(keys, records, frames=True)  # record and frame: one slot


def send_sets(
    client: redis.Redis, names: list[str], payloads: list[np.ndarray], px: int | None = None
) -> list[Any]:
    """Pipelined ``SET name payload [PX px]`` on one connection, each payload sent from
    its own buffer: redis-py's packer (hiredis ``pack_command``) copies every value into
    the packed command first, a third of the time of a large SET here. Replies (or
    their errors) in order; a transport failure drops the connection and raises."""
    tail = b"\r\n" if px is None else b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
    argc = b"*3" if px is None else b"*5"
    chunks: list[bytes | memoryview] = []
    glue = b""
    for name, arr in zip(names, payloads, strict=True):
        nb = name.encode()
        chunks.append(
            glue + argc + b"\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(nb), nb, arr.nbytes)
        )
        chunks.append(arr.data.cast("B"))
        glue = tail
    chunks.append(glue)
    conn: Any = client.connection_pool.get_connection()  # redis-py leaves it untyped
    try:
        conn.send_packed_command(chunks)
        out: list[Any] = []
        for _ in names:
            try:
                out.append(conn.read_response())
            except ResponseError as exc:  # a reply, not a broken connection
                out.append(exc)
        return out
    except BaseException:
        conn.disconnect()
        raise
    finally:
        client.connection_pool.release(conn)


__all__ = ["LeaseError", "RedisTier"]
