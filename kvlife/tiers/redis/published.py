"""What the Redis and Mooncake tiers share: replicas published under the global index.

Every replica has a publication record in Redis (:class:`RemoteRecord`); the tier's
payload store is Redis itself (:class:`~kvlife.tiers.redis.tier.RedisTier`) or Mooncake
Store (:class:`~kvlife.tiers.mooncake.tier.MooncakeTier`). This base does the parts
that do not depend on where the payload lies: capacity accounting of this host's share,
reservations with the lease they will publish under, verified reads (record checksum,
key, length, xxh3-128 of the payload; anything short of exact bytes re-reads the record
before judging the payload: deleted, overwritten or, unchanged across a second fetch, a
miss or a corrupt replica), probes for other hosts' objects, fenced deletes and the
health of the connection.

This host remembers the record of every replica it published or adopted (``_held``). A
read serves a record's payload only if the record still describes that replica (same
object info, representation, dtype, shape and payload checksum): a record another host
published since for the same key with other bytes (an ``int8`` frame where an exact
replica was adopted) is not this host's replica any more, the read is a miss, and the
store is told (:meth:`take_gone`). A delete removes a record only if it is still the
one held, and only under this host's lease (a revoked host deletes nothing).

Capacity is this host's budget in the shared tier: replicas it published or adopted
count against it; other hosts' objects do not. ``replica_keys`` lists those replicas.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
from redis.exceptions import NoScriptError, RedisError

from kvlife.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    KVLifeError,
    LeaseError,
    RemoteTierError,
    ReplicaNotFound,
    ReplicaReadError,
)
from kvlife.core.identity import ChunkKey
from kvlife.core.objects import UNSTAMPED, EpochStamp, ObjectInfo, TierName
from kvlife.globalindex import (
    GlobalIndex,
    Health,
    InvalidationRule,
    Lease,
    RemoteRecord,
    RuleSync,
)
from kvlife.globalindex.health import REFUSALS
from kvlife.globalindex.record import RecordError
from kvlife.native.copies import stream_copy
from kvlife.tiers.base import (
    CapacityShortfall,
    Durability,
    ReadResult,
    ReplicaMeta,
    Reservation,
    SharedTier,
    SupportsBatchDelete,
    Tier,
    check_payloads,
)
from kvlife.tiers.disk.frame import MAX_NDIM
from kvlife.tiers.redis.unsettled import SettleGate, UnknownOutcomes


@dataclass(slots=True)
class RemoteCounters:
    """What a remote tier did (``details()``)."""

    published: int = 0
    publish_failed: int = 0
    reads: int = 0
    read_misses: int = 0
    """Reads that failed on the transport or found no payload (a miss, replica kept)."""
    reread_ok: int = 0
    """Payloads that failed verification once and verified on the second read."""
    corrupt: int = 0
    """Replicas that failed verification twice (reported as corrupt)."""
    short_payloads: int = 0
    """Payloads shorter than the record (or empty) behind a present record: a miss."""
    record_changed: int = 0
    """Reads whose record changed under them (overwritten): the new object was read."""
    probes: int = 0
    probe_hits: int = 0
    probe_refused_identity: int = 0
    """Records found whose object info differs from the lookup's (never served)."""
    replicas_gone: int = 0
    """Replicas this host held whose records another host deleted or replaced (with
    other bytes): reads of them are misses, and the store drops them."""


FETCHES = 4
"""Fetches of one payload in one read, the first included (:meth:`PublishedTier._settle`)."""

log = logging.getLogger(__name__)

Payload = memoryview | bytes | Exception | None
"""A fetched payload: its bytes (not verified yet), None (gone), an exception (I/O)."""


class _NotFetched:
    """The payload of a key was fetched from another object than its record names."""


NOT_FETCHED = _NotFetched()


class FetchAhead(Protocol):
    """Payloads a tier started fetching before their records were read again
    (:meth:`PublishedTier._fetch_ahead`)."""

    def take(self, at: int, location: str) -> Payload | _NotFetched:
        """The payload of ``keys[at]`` (waiting for it), or :data:`NOT_FETCHED` if it
        was not fetched from ``location``. Called with ``at`` increasing."""
        ...

    def close(self) -> None:
        """Wait for every fetch in flight (they write into the caller's buffers)."""
        ...


@dataclass(frozen=True, slots=True)
class _Fault:
    kind: str
    """error (transport), short (empty or short payload), mismatch (checksum, length)."""
    why: str


@dataclass(slots=True)
class _Pending:
    lease: Lease
    nonce: str


def _last_of_each(
    metas: Sequence[ReplicaMeta], payloads: list[np.ndarray]
) -> tuple[Sequence[ReplicaMeta], list[np.ndarray]]:
    """A batch with one key at most once: where a key comes twice the last one wins (a
    Redis tier's publish script renamed the first staged frame and then failed on the
    second, leaving the records before it visible: found by a red team, 2026-12-06)."""
    last = {m.key: i for i, m in enumerate(metas)}
    if len(last) == len(metas):
        return metas, payloads
    keep = sorted(last.values())
    return [metas[i] for i in keep], [payloads[i] for i in keep]


class PublishedTier(Tier, SharedTier, SupportsBatchDelete):
    """Base of tiers whose replicas are published under a :class:`GlobalIndex`."""

    durability = Durability.DURABLE
    """Committed replicas outlive this process (the server's own persistence decides
    what survives the server's restart)."""

    def __init__(self, name: str, capacity_bytes: int, index: GlobalIndex, health: Health) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"remote tier capacity must be > 0, got {capacity_bytes}")
        self.name = TierName(name)
        self.capacity_bytes = capacity_bytes
        self.index = index
        self.health = health
        self.counters = RemoteCounters()
        self._held: dict[ChunkKey, RemoteRecord] = {}
        """The record of every replica this host published or adopted."""
        self._gone: set[ChunkKey] = set()
        """Held replicas found deleted or replaced by another host, not yet reported."""
        self._reserved = 0
        self._lock = threading.Lock()
        self.unknown = UnknownOutcomes()
        """Writes whose publish had an unknown outcome, until settled
        (:meth:`_settle_one`)."""
        self._gate = SettleGate()

    # ------------------------------------------------------------------ payload store

    @abstractmethod
    def _write(
        self, pending: _Pending, metas: Sequence[ReplicaMeta], payloads: list[np.ndarray]
    ) -> list[RemoteRecord]:
        """Write payloads and their records (:meth:`_records_for`; :meth:`_current`
        right before publishing); a record is visible only with its payload. Returns
        the records published. Raise LeaseError (refused) or RemoteTierError; on
        failure unpublish what can be."""

    @abstractmethod
    def _fetch(
        self, records: list[RemoteRecord], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[memoryview | bytes | Exception | None]:
        """The payload bytes behind each record (None: gone; an exception: I/O error).
        A tier may read straight into a record's ``out`` (C-contiguous, of its size) and
        return a view of it; the bytes are verified after, either way."""

    def settle_removals(self, timeout_s: float) -> int:
        """Settle what failures left to settle (writes of unknown outcome; on Mooncake,
        removals deferred too) until none is left or ``timeout_s`` passed (the index's
        backoff, readers' leases); returns how many are still pending."""
        end = time.monotonic() + timeout_s
        while True:
            self._settle_failures()
            left = self._unsettled()
            if not left or time.monotonic() >= end:
                return left
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def _settle_failures(self) -> None:
        """Settle the writes of unknown outcome (at each write, and by the above), when
        no write of this tier is in flight (:class:`SettleGate`)."""
        if not self.unknown:
            return
        with self._gate.settling() as now:
            if now:
                self.unknown.settle(self._settle_one)

    def _unsettled(self) -> int:
        return self.unknown.pending()

    def _settle_at_close(self) -> None:
        """One try at settling; what is left is logged (its records, if published,
        stay visible: complete and verified, held by no host)."""
        with contextlib.suppress(RemoteTierError):
            self._settle_failures()
        left = self.unknown.pending()
        if left:
            log.warning(
                "%s closed with %d writes of unknown outcome unsettled: their records, if "
                "published, stay visible (complete, verified, held by no host)",
                self.name,
                left,
            )

    @abstractmethod
    def _settle_one(self, records: list[RemoteRecord], payloads: list[str]) -> int:
        """Settle one write of unknown outcome (:mod:`kvlife.tiers.redis.unsettled`): take
        back the records still the write's (a fenced delete), remove the payloads no
        record names; how many records it took back. RemoteTierError: try later."""

    @abstractmethod
    def _unpublish(self, keys: Sequence[ChunkKey], records: Sequence[RemoteRecord]) -> None:
        """Remove records (first, so nothing is visible; each only if it is still
        ``records[i]``, under this host's lease: :meth:`_delete_records`) and then the
        payloads of those removed."""

    def _current(self, pending: _Pending) -> None:
        """What a write does right before its publish script: LeaseError (counted) if
        this host saw the index lose its state since the write's lease was granted
        (:meth:`GlobalIndex.check_current`; no I/O). The script alone could not tell:
        the new index counts tokens from 1 again, and once this host took a lease there
        (another of its threads) a token of the lost index could match it."""
        self.index.check_current(pending.lease)

    def _location(self, key: ChunkKey, pending: _Pending) -> str:
        """Where a new payload goes, recorded in its record ("" when beside it)."""
        return ""

    def _records_for(
        self, pending: _Pending, metas: Sequence[ReplicaMeta], payloads: list[np.ndarray]
    ) -> list[RemoteRecord]:
        """The records of new payloads (computes each payload's xxh3-128)."""
        lease = pending.lease
        return [
            RemoteRecord.for_payload(m, a, lease.host, lease.token, self._location(m.key, pending))
            for m, a in zip(metas, payloads, strict=True)
        ]

    def _delete_records(
        self, keys: Sequence[ChunkKey], records: Sequence[RemoteRecord], frames: bool
    ) -> list[int]:
        """Delete records (and, with ``frames``, the frames beside them) that are still
        the ones given, under this host's lease, one ``UNPUBLISH`` script per bucket;
        returns the indices deleted. A host without a lease (revoked, banned) deletes
        nothing; a record published since by another host is kept; both are counted
        (``deletes_refused``), neither is an error."""
        idx = self.index
        todo = idx.buckets_of(keys)
        deleted: list[int] = []
        for _ in (0, 1):
            try:
                lease = idx.lease()
            except LeaseError:
                break
            groups = todo

            def run(groups: list[list[int]] = groups, lease: Lease = lease) -> list[Any]:
                for retry in (0, 1):
                    pipe = idx.client.pipeline(transaction=False)
                    for at in groups:
                        names = [idx.fence_key(keys[at[0]])]
                        for i in at:
                            names.append(idx.record_key(keys[i]))
                            if frames:
                                names.append(idx.frame_key(keys[i]))
                        idx.evalsha(
                            pipe,
                            "UNPUBLISH",
                            names,
                            [lease.host, lease.token, 2 if frames else 1]
                            + [records[i].blob() for i in at],
                        )
                    res = list(pipe.execute(raise_on_error=False))
                    if retry == 0 and any(isinstance(r, NoScriptError) for r in res):
                        idx._sha.clear()  # a restarted server lost its scripts
                        continue
                    return res
                raise AssertionError("unreachable")

            replies = self.health.call("delete", run)
            todo = []
            for at, reply in zip(groups, replies, strict=True):
                if isinstance(reply, list):
                    for i, done in zip(at, reply, strict=True):
                        if done:
                            deleted.append(i)
                        else:
                            idx.counters.deletes_refused += 1  # published since: not ours
                elif isinstance(reply, RedisError) and str(reply).startswith(REFUSALS):
                    todo.append(at)  # our lease lapsed or was revoked: once more, anew
                else:
                    self.health.failed(f"delete: {reply}")
                    raise RemoteTierError(f"{self.name}: delete failed: {reply}")
            if not todo:
                return deleted
            idx.drop_lease()
        idx.counters.deletes_refused += sum(len(at) for at in todo)
        return deleted

    # ------------------------------------------------------------------ records

    def _records(self, keys: Sequence[ChunkKey]) -> list[RemoteRecord | Exception | None]:
        """The records of ``keys``: one ``MGET`` per hash-tag bucket (one cluster slot
        each), pipelined."""
        idx = self.index
        groups = idx.buckets_of(keys)

        def run() -> list[Any]:
            pipe = idx.client.pipeline(transaction=False)
            for at in groups:
                pipe.execute_command("MGET", *(idx.record_key(keys[i]) for i in at))
            replies = pipe.execute()
            blobs: list[Any] = [None] * len(keys)
            for at, reply in zip(groups, replies, strict=True):
                if not isinstance(reply, list) or len(reply) != len(at):
                    raise ValueError(f"MGET of {len(at)} records answered {type(reply).__name__}")
                for i, blob in zip(at, reply, strict=True):
                    blobs[i] = blob
            return blobs

        raw = self.health.call("read records", run)
        out: list[RemoteRecord | Exception | None] = []
        for blob in raw:
            if blob is None:
                out.append(None)
                continue
            try:
                out.append(RemoteRecord.decode(blob))
            except RecordError as exc:
                out.append(exc)
        return out

    # ------------------------------------------------------------------ Tier

    # ------------------------------------------------------------------ held replicas

    def _holds(self, key: ChunkKey, rec: RemoteRecord) -> bool:
        """Whether ``rec`` (read now) still describes the replica held for ``key``
        (a key this host does not hold, e.g. a tier used on its own, is not checked). A
        record republished with the same bytes (another host, token, Mooncake object)
        is the same replica to read; the record held stays the one this host published
        or adopted, so letting go of the replica never deletes that republication (a
        delete removes only the record held)."""
        with self._lock:
            held = self._held.get(key)
            if held is None or held == rec:
                return True
            return rec.same_replica(held.replica_meta())

    def _missing(self, key: ChunkKey, why: str) -> ReplicaNotFound:
        """The error of a held replica whose record is gone or replaced; the store is
        told at its next lookup (:meth:`take_gone`)."""
        with self._lock:
            if key in self._held and key not in self._gone:
                self._gone.add(key)
                self.counters.replicas_gone += 1
        return ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}… ({why})")

    @property
    def used_bytes(self) -> int:
        return sum(r.header.payload_len for r in self._held.values()) + self._reserved

    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        need = sum(m.nbytes for m in metas if m.key not in self._held)
        with self._lock:
            over = self.used_bytes + need - self.capacity_bytes
            if over > 0:
                return CapacityShortfall(over)
            self._reserved += need
        try:
            self.index.refresh()  # an index that lost its state: its leases went with it
            lease = self.index.lease()
        except BaseException:
            with self._lock:
                self._reserved -= need
            raise
        return Reservation(self.name, list(metas), need, _Pending(lease, uuid.uuid4().hex))

    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        if reservation.done:
            raise InvalidArgument("reservation already completed")
        try:
            check_payloads(reservation.metas, payloads)
            for m in reservation.metas:
                if len(m.shape) > MAX_NDIM:
                    raise InvalidArgument(
                        f"replica {m.key.hex()[:16]}… has {len(m.shape)} dimensions; a "
                        f"record's header holds at most {MAX_NDIM}"
                    )
            pending = reservation.state
            assert isinstance(pending, _Pending)
            if pending.lease.remaining_s() <= 0:
                self.index.drop_lease()
                raise LeaseError(
                    f"lease of {pending.lease.host} (token {pending.lease.token}) expired "
                    "before the write: not published"
                )
            metas, arrays = _last_of_each(
                reservation.metas, [np.ascontiguousarray(a) for a in payloads]
            )
            self._settle_failures()
            with self._gate.writing():  # no settlement until the records are held
                written = self._write(pending, metas, arrays)
                with self._lock:
                    self._reserved -= reservation.nbytes
                    for rec in written:
                        key = ChunkKey(rec.header.key)
                        self._held[key] = rec
                        self._gone.discard(key)
                    reservation.done = True
        except BaseException:
            self.counters.publish_failed += len({m.key for m in reservation.metas})
            self.cancel_store(reservation)
            raise
        self.counters.published += len(written)

    def cancel_store(self, reservation: Reservation) -> None:
        with self._lock:
            if not reservation.done:
                self._reserved -= reservation.nbytes
                reservation.done = True

    def contains(self, key: ChunkKey) -> bool:
        """Whether the tier holds the replica: a record is there and, for a replica this
        host published or adopted, it is still that one (else it is forgotten: another
        host deleted or replaced it)."""
        rec = self._records([key])[0]
        if rec is None or (isinstance(rec, RemoteRecord) and not self._holds(key, rec)):
            with self._lock:
                self._held.pop(key, None)
                self._gone.discard(key)
            return False
        return True

    def meta(self, key: ChunkKey) -> ReplicaMeta:
        rec = self._records([key])[0]
        if rec is None:
            raise ReplicaNotFound(f"{self.name} holds no replica {key.hex()[:16]}…")
        if isinstance(rec, Exception):
            raise ChecksumMismatch(key.hex(), self.name, f"record: {rec}")
        return rec.replica_meta()

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        self.counters.reads += len(keys)
        ahead = self._fetch_ahead(keys, outs)
        try:
            return self._read_batch(keys, outs, ahead)
        finally:
            if ahead is not None:
                ahead.close()  # its fetches in flight write into ``outs``: wait for them

    def _fetch_ahead(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None
    ) -> FetchAhead | None:
        """A tier may start fetching the payloads of the records it holds for ``keys``
        while :meth:`read_batch` reads the records again; each payload is then served
        only if the record read names the object it came from, and verified against that
        record like any other (None: fetch after the records are read)."""
        return None

    def _read_batch(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[np.ndarray | None] | None,
        ahead: FetchAhead | None,
    ) -> list[ReadResult]:
        try:
            records = self._records(keys)
        except RemoteTierError as exc:
            self.counters.read_misses += len(keys)
            return [ReplicaReadError(k.hex(), self.name, str(exc)) for k in keys]
        for k, rec in zip(keys, records, strict=True):
            if rec is None:
                raise self._missing(k, "deleted")
            if isinstance(rec, RemoteRecord) and not self._holds(k, rec):
                raise self._missing(k, "replaced by another host")
        for i, rec in enumerate(records):
            out = outs[i] if outs is not None else None
            if out is not None and isinstance(rec, RemoteRecord):
                h = rec.header
                if out.shape != h.shape or out.dtype != np.dtype(h.dtype):
                    raise InvalidArgument(
                        f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
                        f"{h.dtype}{list(h.shape)}"
                    )
        good = [r for r in records if isinstance(r, RemoteRecord) and ahead is None]
        good_outs = [
            outs[i] if outs is not None else None
            for i, r in enumerate(records)
            if isinstance(r, RemoteRecord) and ahead is None
        ]
        stream = self._fetch_stream(good, good_outs)
        results: list[ReadResult] = []
        try:
            for i, (key, rec) in enumerate(zip(keys, records, strict=True)):
                if not isinstance(rec, RemoteRecord):
                    self.counters.corrupt += 1
                    results.append(ChecksumMismatch(key.hex(), self.name, f"record: {rec}"))
                    continue
                out = outs[i] if outs else None
                if ahead is None:
                    got = next(stream)
                else:
                    taken = ahead.take(i, rec.location)
                    # the record names another object now: fetch that one
                    got = self._fetch_one(rec, out) if isinstance(taken, _NotFetched) else taken
                results.append(self._settle(key, rec, got, out))
        finally:
            stream.close()  # a tier fetching ahead waits for what it started
        return results

    def _fetch_stream(
        self, records: list[RemoteRecord], outs: list[np.ndarray | None]
    ) -> Generator[memoryview | bytes | Exception | None, None, None]:
        """The payloads behind ``records``, in order, a transport failure as a value; a
        tier may fetch ahead while its caller verifies what came."""
        if not records:
            return
        try:
            got = self._fetch(records, outs)
        except RemoteTierError as exc:
            got = [exc] * len(records)
        yield from got

    def _fetch_one(
        self, rec: RemoteRecord, out: np.ndarray | None
    ) -> memoryview | bytes | Exception | None:
        try:
            return self._fetch([rec], [out])[0]
        except RemoteTierError as exc:
            return exc

    def _settle(
        self,
        key: ChunkKey,
        rec: RemoteRecord,
        got: memoryview | bytes | Exception | None,
        out: np.ndarray | None,
    ) -> ReadResult:
        """The verified payload of ``key``, or why not.

        Anything short of exact bytes (an error, an empty or short payload, a checksum
        mismatch) re-reads the record before judging the payload: a record deleted
        meanwhile is ReplicaNotFound; a record that changed (overwritten: a new payload,
        at a new Mooncake object) is read at its new place; only a record that stayed
        the same across a second fetch of its payload is a miss (ReplicaReadError) or,
        mismatching twice, corrupt (ChecksumMismatch). At most :data:`FETCHES` fetches."""
        unchanged_retry = False
        fault: _Fault = _Fault("error", "")
        for _ in range(FETCHES):
            res = self._checked(key, rec, got, out)
            if not isinstance(res, _Fault):
                if fault.why:
                    self.counters.reread_ok += 1
                return res
            fault = res
            try:
                again = self._records([key])[0]
            except RemoteTierError:
                break
            if again is None:
                raise self._missing(key, "deleted")
            if isinstance(again, RemoteRecord) and not self._holds(key, again):
                raise self._missing(key, "replaced by another host")
            if not isinstance(again, RemoteRecord):
                self.counters.corrupt += 1
                return ChecksumMismatch(key.hex(), self.name, f"record: {again}")
            if again == rec:
                if unchanged_retry:
                    break
                unchanged_retry = True  # bytes damaged in transit, a lapsed read lease
            else:
                rec, unchanged_retry = again, False  # overwritten: read the new object
                self.counters.record_changed += 1
            got = self._fetch_one(rec, out)
        if fault.kind == "mismatch" and unchanged_retry:
            self.counters.corrupt += 1
            return ChecksumMismatch(key.hex(), self.name, fault.why)
        if fault.kind == "short":
            self.counters.short_payloads += 1
        self.counters.read_misses += 1
        return ReplicaReadError(key.hex(), self.name, fault.why)

    def _checked(
        self,
        key: ChunkKey,
        rec: RemoteRecord,
        got: memoryview | bytes | Exception | None,
        out: np.ndarray | None,
    ) -> np.ndarray | _Fault:
        if isinstance(got, Exception):
            return _Fault("error", f"payload: {got}")
        n = rec.header.payload_len
        if got is None or len(got) < n:
            return _Fault(
                "short",
                f"payload {'gone' if got is None else f'{len(got)} bytes'} behind a record of {n}",
            )
        try:
            arr = rec.verify(bytes(key), got)
        except RecordError as exc:
            return _Fault("mismatch", str(exc))
        if out is None:
            return arr
        if not (out.flags.c_contiguous and arr.ctypes.data == out.ctypes.data):
            stream_copy(out, arr)  # else the tier read straight into ``out``
        return out

    def delete(self, key: ChunkKey) -> int:
        return self.delete_batch([key])[0]

    def delete_batch(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Let go of replicas: each record is deleted (fenced, :meth:`_delete_records`)
        only if it is still the one this host held (a key it does not hold: the record
        there now). A record that does not decode is left alone (no reader trusts it)."""
        records = self._records(keys)
        with self._lock:
            held = [self._held.get(k) for k in keys]
        sizes: list[int] = []
        todo: list[ChunkKey] = []
        expect: list[RemoteRecord] = []
        for k, rec, h in zip(keys, records, held, strict=True):
            if rec is None and h is None:
                raise ReplicaNotFound(f"{self.name} holds no replica {k.hex()[:16]}…")
            mine = h if h is not None else rec
            if not isinstance(mine, RemoteRecord):
                sizes.append(0)
                continue
            sizes.append(mine.header.payload_len)
            if rec is not None:  # something is there: deleted if it is still ours
                todo.append(k)
                expect.append(mine)
        if todo:
            self._unpublish(todo, expect)
        with self._lock:
            for k in keys:
                self._held.pop(k, None)
                self._gone.discard(k)
        return sizes

    def replica_keys(self) -> list[ChunkKey]:
        return list(self._held)

    def details(self) -> dict[str, Any]:
        return {
            "host": self.index.host,
            "healthy": self.health.healthy,
            "last_error": self.health.last_error,
            **asdict(self.counters),
            **asdict(self.health.counters),
            **asdict(self.index.counters),
            **self.unknown.counts(),
        }

    # ------------------------------------------------------------------ SharedTier

    def sync_invalidations(self) -> RuleSync:
        self.index.refresh()
        return self.index.pending()

    def invalidations_applied(self, sync: RuleSync) -> None:
        self.index.applied(sync)

    def creation_stamp(self) -> EpochStamp:
        if not self.index.incarnation:
            try:
                self.index.refresh()
            except RemoteTierError:  # unknown: every rule covers what is created now
                return UNSTAMPED
        return self.index.stamp()

    def stamp_now(self) -> EpochStamp:
        return self.index.stamp()

    def record_invalidation(
        self,
        *,
        namespace: str | None,
        adapter_id: str | None,
        weights_digest: str | None,
        prefix: bytes | None,
        source: str | None = None,
        versions: tuple[int, int] | None = None,
        model: str | None = None,
        keep_weights_digest: str | None = None,
    ) -> InvalidationRule:
        return self.index.invalidate(
            namespace=namespace,
            adapter_id=adapter_id,
            weights_digest=weights_digest,
            prefix=prefix,
            source=source,
            versions=versions,
            model=model,
            keep_weights_digest=keep_weights_digest,
        )

    def take_gone(self) -> list[ChunkKey]:
        with self._lock:
            gone, self._gone = list(self._gone), set()
        return gone

    def probe(self, keys: Sequence[ChunkKey], infos: Sequence[bytes]) -> list[ReplicaMeta]:
        if len(keys) != len(infos):
            raise InvalidArgument(f"{len(keys)} keys but {len(infos)} infos")
        self.counters.probes += 1
        if not keys:
            return []
        if not self.index.incarnation:
            self.index.refresh()
        records = self._records(keys)
        found: list[ReplicaMeta] = []
        adopted: list[RemoteRecord] = []
        lineage: list[bytes] = []
        for key, info, rec in zip(keys, infos, records, strict=True):
            if not isinstance(rec, RemoteRecord) or rec.header.key != key:
                break
            if rec.info != info:
                self.counters.probe_refused_identity += 1
                break
            try:
                decoded = ObjectInfo.decode(rec.info)
            except KVLifeError:
                break
            lineage.append(bytes(decoded.parent))
            if not self.index.admissible(rec, decoded, tuple(lineage)):
                break
            found.append(rec.replica_meta())
            adopted.append(rec)
            lineage.append(bytes(key))
        with self._lock:
            for rec in adopted:
                key = ChunkKey(rec.header.key)
                self._held[key] = rec
                self._gone.discard(key)
        self.counters.probe_hits += len(found)
        return found

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Stop charging replicas this host adopted but will not use, or that another
        host deleted or replaced (never deletes)."""
        with self._lock:
            for k in keys:
                self._held.pop(k, None)
                self._gone.discard(k)
