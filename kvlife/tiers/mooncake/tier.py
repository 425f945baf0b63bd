"""MooncakeTier: payloads in Mooncake Store (``mooncake-transfer-engine-non-cuda``, TCP),
each under a fresh object name; its publication record in the global index on Redis.

Mooncake has no conditional write, so fencing is done by the record: a payload is
``put`` first under a name no reader knows yet, then the index's publish script checks
the lease and writes the record that names it. A reader trusts nothing from Mooncake
alone: ``is_exist`` was seen to report a key present while ``get`` returned empty for
about 10 s after the holder of its segment died, so a payload is served only when its
length and xxh3-128 match the record; empty or short is a miss.

Mooncake's clients (and the master's built-in HTTP metadata server) bind every
interface; see ``docs/remote.md`` for running them on loopback only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from redis.exceptions import NoScriptError, RedisError

from kvlife.core.errors import ChecksumMismatch, InvalidArgument, LeaseError, RemoteTierError
from kvlife.core.identity import ChunkKey
from kvlife.globalindex import GlobalIndex, Health, IndexConfig, RemoteRecord
from kvlife.globalindex.health import REFUSALS
from kvlife.globalindex.record import RecordError
from kvlife.tiers.base import ChecksumsWrites, ReplicaMeta
from kvlife.tiers.disk.frame import payload_checksum
from kvlife.tiers.redis.connect import RedisEndpoint
from kvlife.tiers.redis.published import (
    NOT_FETCHED,
    Payload,
    PublishedTier,
    _NotFetched,
    _Pending,
)

T = TypeVar("T")

GROUP_MIN = 4 << 20
"""The smallest fetch group of a batch split into groups; a batch under twice this is
one group (:func:`_schedule`)."""
GROUP_BYTES = 8 << 20
"""The default size of a fetch group (:attr:`MooncakeConfig.read_group_bytes`): small
enough that a group and the copy of the next one fit in this machine's 32 MiB L3 (the
verification of a group just copied read it at about 45 GB/s, from memory at about
22 GB/s, and a copy beside a hash that streams from memory fell from 11.6 to 4.4 GB/s),
large enough that the calls (0.1-0.4 ms each) stay a small part of the copy."""


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Where the Mooncake client connects and what it contributes."""

    master: str
    """Master RPC address, ``127.0.0.1:50051``."""
    metadata: str
    """HTTP metadata server, ``http://127.0.0.1:8080/metadata``."""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 256 << 20
    """Memory this client contributes to the pool (0: none, a pure client)."""
    buffer_bytes: int = 64 << 20
    """The client's local transfer buffer."""
    protocol: str = "tcp"
    register_buffers: bool | None = None
    """Register payload and destination buffers with the transfer engine around each
    call (RDMA needs it; over TCP the engine copies from and to any memory, so None
    means: only when the protocol is not tcp)."""
    read_lease_s: float = 2.0
    """The master's ``--default_kv_lease_ttl``: a removal refused because a reader holds
    the object is retried after this."""
    read_group_bytes: int = GROUP_BYTES
    """A large read is fetched in groups of about this many bytes, each verified while
    the next is copied (:func:`_schedule`); 0: one ``batch_get_into`` for the whole
    batch, verified after (less CPU and memory traffic: better where no second CPU is
    free; ``kvlife bench remote`` measures both)."""

    def __post_init__(self) -> None:
        if not self.metadata.startswith("http://"):
            raise InvalidArgument(f"mooncake metadata {self.metadata!r} must be http://...")
        if self.segment_bytes < 0 or self.buffer_bytes <= 0:
            raise InvalidArgument("mooncake segment_bytes >= 0 and buffer_bytes > 0")
        if self.read_lease_s <= 0:
            raise InvalidArgument(f"mooncake read_lease_s must be > 0, got {self.read_lease_s}")
        if self.read_group_bytes < 0:
            raise InvalidArgument(
                f"mooncake read_group_bytes must be >= 0, got {self.read_group_bytes}"
            )
        if self.register_buffers is None:
            object.__setattr__(self, "register_buffers", self.protocol != "tcp")


class MooncakeTier(PublishedTier, ChecksumsWrites):
    """Replicas in Mooncake Store, published in the global index on Redis.

    A write takes the checksum a payload is known by (:attr:`ReplicaMeta.checksum`, a
    copy of a replica the store verified or sealed in this plan) instead of hashing it
    again: such a put costs the transfer and the publish only. With
    ``verify_checksum`` it hashes the payload while Mooncake copies it, and a mismatch
    fails the batch (ChecksumMismatch naming the replica; the payloads put are
    removed, no record published). Readers verify every byte against the record's
    checksum either way: a checksum given wrongly is a counted corrupt replica, never
    served."""

    def __init__(
        self,
        config: MooncakeConfig,
        index_endpoint: RedisEndpoint,
        capacity_bytes: int,
        name: str = "mooncake",
        index: IndexConfig | None = None,
        *,
        backoff_s: float = 0.05,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the wheel, or libibverbs1 under it, is missing
            raise RemoteTierError(
                f"mooncake tier {name}: cannot import mooncake.store ({exc}); "
                "pip install 'kvlife[remote]' and apt-get install libibverbs1"
            ) from exc
        health = Health(f"mooncake tier {name}", base_s=backoff_s)
        self.config = config
        self.mc: Any = MooncakeDistributedStore()
        rc = self.mc.setup(
            config.local_hostname,
            config.metadata,
            config.segment_bytes,
            config.buffer_bytes,
            config.protocol,
            "",
            config.master,
        )
        if rc != 0:
            raise RemoteTierError(
                f"mooncake tier {name}: setup against {config.master} returned {rc}"
            )
        self.client = index_endpoint.connect()
        super().__init__(
            name, capacity_bytes, GlobalIndex(self.client, index or IndexConfig(), health), health
        )
        self.mc_health = Health(f"mooncake store {name}", base_s=backoff_s)
        self.doomed = _Doomed(config.read_lease_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvlife-{name}-put")
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix=f"kvlife-{name}-get")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._settle_at_close()
        with contextlib.suppress(RemoteTierError):
            self._reap(everything=True)
        self.mc.close()
        self.client.close()

    def _mc(self, what: str, fn: Callable[[], T]) -> T:
        """A Mooncake call: any failure is a RemoteTierError and starts a backoff."""

        def run() -> T:
            try:
                return fn()
            except Exception as exc:  # pybind11 surfaces C++ failures as RuntimeError
                raise OSError(f"{type(exc).__name__}: {exc}") from exc

        return self.mc_health.call(what, run)

    def _location(self, key: ChunkKey, pending: _Pending) -> str:
        return f"kvl/{self.index.config.namespace}/{key.hex()}/{pending.nonce}"

    # ------------------------------------------------------------------ payloads

    def _registered(self, arrays: Sequence[np.ndarray]) -> contextlib.ExitStack[bool | None]:
        """Buffers registered with the transfer engine for the length of one call
        (``register_buffers``; over TCP none is needed)."""
        stack = contextlib.ExitStack()
        if self.config.register_buffers:
            spans = {a.ctypes.data: a.nbytes for a in arrays if a.nbytes}  # a payload passed twice
            for ptr, nbytes in spans.items():
                rc = int(self.mc.register_buffer(ptr, nbytes))
                if rc != 0:
                    stack.close()
                    raise RemoteTierError(f"{self.name}: mooncake register_buffer returned {rc}")
                stack.callback(self.mc.unregister_buffer, ptr)
        return stack

    def _put_payloads(
        self,
        locations: list[str],
        payloads: list[np.ndarray],
        copying: threading.Event | None = None,
    ) -> None:
        """One ``batch_put_from`` straight from the payload arrays (no copy); all or
        nothing: a failed batch removes what it did write. ``copying`` is set as the
        call is about to release the GIL."""

        def put() -> list[int]:
            with self._registered(payloads):
                ptrs = [a.ctypes.data for a in payloads]
                sizes = _sizes(payloads)
                if copying is not None:
                    copying.set()
                return [int(rc) for rc in self.mc.batch_put_from(locations, ptrs, sizes)]

        rcs = self._mc("put", put)
        bad = [rc for rc in rcs if rc != 0]
        if bad or len(rcs) != len(locations):
            self._remove([loc for loc, rc in zip(locations, rcs, strict=False) if rc == 0])
            raise RemoteTierError(f"{self.name}: mooncake batch_put_from returned {bad[:4]}")

    def _write(
        self, pending: _Pending, metas: Sequence[ReplicaMeta], payloads: list[np.ndarray]
    ) -> list[RemoteRecord]:
        """Payloads go to Mooncake (under names no reader knows yet) on a worker thread
        while this one computes their checksums (xxh3 and Mooncake's copy both release
        the GIL); then the index's publish script checks the lease and writes the records
        that name them. (``commit_store`` retried the due removals just before:
        :meth:`_settle_failures`.)"""
        locations = [self._location(m.key, pending) for m in metas]
        if not sum(a.nbytes for a in payloads):  # nothing to move: no thread
            self._put_payloads(locations, payloads)
            records = self._records_for(pending, metas, payloads)
        else:
            copying = threading.Event()
            try:
                put = self._pool.submit(self._copy, locations, payloads, copying)
            except RuntimeError as exc:  # the pool was shut down
                raise RemoteTierError(f"{self.name} is closed: nothing written") from exc
            if all(m.checksum_given for m in metas):
                # Records with every checksum known are pure Python, which would keep
                # the GIL from the worker until the switch interval (5 ms) forced it
                # out: its copy began 2 ms late (median, 256 records). Let it reach
                # the copy first. A hash releases the GIL at once: no wait needed.
                copying.wait()
            try:
                records = self._records_for(pending, metas, payloads)
                plan = self._publish_plan(pending, records)  # still beside the copy
            except BaseException:
                if put.exception() is None:
                    self._remove(locations)
                raise
            put.result()  # RemoteTierError: nothing of it left behind
            self._publish(pending, records, locations, plan)
            return records
        self._publish(pending, records, locations)
        return records

    def _copy(
        self, locations: list[str], payloads: list[np.ndarray], copying: threading.Event
    ) -> None:
        try:
            self._put_payloads(locations, payloads, copying)
        finally:
            copying.set()  # refused or failed before the copy: nothing to wait for

    def _records_for(
        self, pending: _Pending, metas: Sequence[ReplicaMeta], payloads: list[np.ndarray]
    ) -> list[RemoteRecord]:
        """The records of new payloads: each payload's xxh3-128 taken as its meta gives
        it (:class:`ChecksumsWrites`), else computed here (beside Mooncake's copy)."""
        lease = pending.lease
        records: list[RemoteRecord] = []
        for m, a in zip(metas, payloads, strict=True):
            known = m.checksum
            if not m.checksum_given:
                hashed = payload_checksum(a)
                if known and hashed != known:
                    raise ChecksumMismatch(
                        m.key.hex(),
                        f"{self.name} write",
                        "the payload no longer matches the checksum it was sealed with",
                    )
                known = hashed
            loc = self._location(m.key, pending)
            records.append(
                RemoteRecord.for_payload(m, a, lease.host, lease.token, loc, checksum=known)
            )
        return records

    def _publish_plan(self, pending: _Pending, records: list[RemoteRecord]) -> _PublishPlan:
        """The publish calls of ``records``: on one server one ``PUBLISH_RECORDS_ALL``
        (every bucket's lease check, then every record: the batch or nothing), on a
        cluster one ``PUBLISH_RECORDS`` per bucket; each call's record indices, keys
        and arguments (host, token, encoded records). Built while the payloads are
        copied (about 4 µs a record), so that only the round trip follows the copy."""
        idx = self.index
        lease = pending.lease
        groups = idx.buckets_of([rec.header.key for rec in records])
        if idx.standalone and groups:
            keys = [idx.fence_key(records[at[0]].header.key) for at in groups]
            keys += [idx.record_key(rec.header.key) for rec in records]
            args: list[object] = [lease.host, lease.token, len(groups)]
            args += [rec.encode() for rec in records]
            return _PublishPlan([list(range(len(records)))], [(keys, args)], "PUBLISH_RECORDS_ALL")
        calls: list[tuple[list[str], list[object]]] = []
        for at in groups:
            keys = [idx.fence_key(records[at[0]].header.key)]
            keys += [idx.record_key(records[i].header.key) for i in at]
            args = [lease.host, lease.token]
            args += [records[i].encode() for i in at]
            calls.append((keys, args))
        return _PublishPlan(groups, calls, "PUBLISH_RECORDS")

    def _publish(
        self,
        pending: _Pending,
        records: list[RemoteRecord],
        put: list[str],
        plan: _PublishPlan | None = None,
    ) -> None:
        """The publish calls of :meth:`_publish_plan` (fence and lease checked once per
        bucket), pipelined; the records they replaced name payloads that are removed
        after."""
        idx = self.index
        if plan is None:
            plan = self._publish_plan(pending, records)
        groups = plan.groups
        try:
            self._current(pending)
        except LeaseError:
            self._remove(put)
            raise

        sent = [False]

        def run() -> list[Any]:
            for attempt in (0, 1):
                sent[0] = True
                pipe = self.client.pipeline(transaction=False)
                for keys, args in plan.calls:
                    idx.evalsha(pipe, plan.script, keys, args)
                res = list(pipe.execute(raise_on_error=False))
                if attempt == 0 and any(isinstance(r, NoScriptError) for r in res):
                    idx._sha.clear()  # a restarted server lost its scripts: load, redo
                    continue
                return res
            raise AssertionError("unreachable")

        try:
            results = self.health.call("publish", run)
        except BaseException:
            if sent[0]:  # the scripts may have run, only their replies lost: settle later
                self.unknown.add(records, put)
            else:  # refused before anything was sent (the index's backoff)
                self._remove(put)
            raise
        replaced: list[str] = []
        for reply in results:
            if isinstance(reply, list):
                for blob in reply:
                    if blob:
                        with contextlib.suppress(RecordError):
                            if loc := RemoteRecord.decode(blob).location:
                                replaced.append(loc)
        errors = [r for r in results if not isinstance(r, list)]
        if errors:  # all or nothing: take back the buckets that did publish (fenced)
            done = [
                i for at, r in zip(groups, results, strict=True) if isinstance(r, list) for i in at
            ]
            try:
                taken = self._delete_records(
                    [ChunkKey(records[i].header.key) for i in done],
                    [records[i] for i in done],
                    frames=False,
                )
                kept = set(done) - {done[j] for j in taken}  # still named: they stay
            except RemoteTierError:  # the take-back's own outcome is unknown: settle later
                self.unknown.add([records[i] for i in done], [put[i] for i in done])
                kept = set(done)
            self._remove([loc for i, loc in enumerate(put) if i not in kept])
            self._remove(replaced)  # their records are gone too
            first = errors[0]
            if isinstance(first, RedisError) and str(first).startswith(REFUSALS):
                raise idx.refused(first)
            raise RemoteTierError(f"{self.name}: publish failed: {first}")
        ours = set(put)
        self._remove([loc for loc in replaced if loc not in ours])

    def _remove(self, locations: Sequence[str]) -> None:
        """Remove payloads no record names any more. Never forced: an object a reader
        is fetching holds Mooncake's read lease and is kept (a forced remove let the
        allocator hand its memory to the next put under the reader, who then got
        another object's bytes); such removals are retried after the lease
        (:class:`_Doomed`). What still fails is left to Mooncake's eviction."""
        if not locations:
            return
        locs = list(locations)
        try:
            rcs = self._mc("remove", lambda: [int(r) for r in self.mc.batch_remove(locs, False)])
        except RemoteTierError:
            rcs = [-1] * len(locs)
        self.doomed.add([loc for loc, rc in zip(locs, rcs, strict=True) if rc not in GONE_OK])

    def _settle_failures(self) -> None:
        super()._settle_failures()
        self._reap()

    def _unsettled(self) -> int:
        return self.doomed.pending() + self.unknown.pending()

    def _settle_one(self, records: list[RemoteRecord], put: list[str]) -> int:
        """Read a write's records back; take back (a fenced delete) those that are
        still this write's, and remove the payloads no record names. A record the
        delete could not take back (this host's lease refused) stays with its payload:
        complete and verified, never wrong."""
        keys = [ChunkKey(r.header.key) for r in records]
        now = self._records(keys)
        ours = [
            i
            for i, rec in enumerate(now)
            if isinstance(rec, RemoteRecord) and rec.location == put[i]
        ]
        taken = (
            self._delete_records([keys[i] for i in ours], [records[i] for i in ours], frames=False)
            if ours
            else []
        )
        gone = {ours[j] for j in taken}
        named = set(ours) - gone  # the delete was refused: the record keeps its payload
        self._remove([loc for i, loc in enumerate(put) if i not in named])
        return len(gone)

    def _reap(self, everything: bool = False) -> None:
        """Retry removals whose read lease should have lapsed by now."""
        due = self.doomed.due(everything)
        if not due:
            return
        locs = list(due)
        try:
            rcs = self._mc("remove", lambda: [int(r) for r in self.mc.batch_remove(locs, False)])
        except RemoteTierError:
            rcs = [-1] * len(locs)
        failed = [loc for loc, rc in zip(locs, rcs, strict=True) if rc not in GONE_OK]
        self.doomed.retry(due, failed)

    def _fetch(
        self, records: list[RemoteRecord], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[memoryview | bytes | Exception | None]:
        """One ``batch_get_into``: straight into each ``out`` that is C-contiguous and
        of the payload's size, the rest into one new buffer. Not found is None; any
        other failure an exception (the caller re-reads the record before judging).

        A location asked twice in one batch is fetched once (Mooncake fills only one of
        two destinations of a repeated key and reports both complete)."""
        first: dict[str, int] = {}
        for i, r in enumerate(records):
            first.setdefault(r.location, i)
        uniq = list(first.values())
        sizes = [records[i].header.payload_len for i in uniq]
        dests, regions = _destinations(sizes, [outs[i] for i in uniq] if outs else None)
        locs = list(first)

        def get() -> list[int]:
            with self._registered(regions):
                ptrs = [d.ctypes.data for d in dests]
                return [int(rc) for rc in self.mc.batch_get_into(locs, ptrs, sizes)]

        rcs = self._mc("get", get)
        got: list[memoryview | bytes | Exception | None] = []
        for dest, size, rc in zip(dests, sizes, rcs, strict=True):
            if rc == size:
                got.append(dest.data)
            elif rc == NOT_FOUND:
                got.append(None)
            elif 0 <= rc < size:
                got.append(dest[:rc].data)
            else:
                got.append(RemoteTierError(f"{self.name}: mooncake get returned {rc}"))
        if any(rc != s for rc, s in zip(rcs, sizes, strict=True)) and self.mc.health_check() != 0:
            self.mc_health.failed("mooncake master unreachable")
            err = RemoteTierError(f"{self.name}: mooncake master unreachable")
            got = [g if rc == s else err for g, rc, s in zip(got, rcs, sizes, strict=True)]
        at = {loc: j for j, loc in enumerate(locs)}
        return [got[at[r.location]] for r in records]

    def _fetch_values(
        self, records: list[RemoteRecord], outs: list[np.ndarray | None]
    ) -> list[memoryview | bytes | Exception | None]:
        try:
            return self._fetch(records, outs)
        except RemoteTierError as exc:
            return [exc] * len(records)

    def _fetch_stream(
        self, records: list[RemoteRecord], outs: list[np.ndarray | None]
    ) -> Generator[memoryview | bytes | Exception | None, None, None]:
        """The payloads in order, fetched in groups (:class:`_Groups`) while the caller
        verifies the group before; closing the stream waits for the groups in flight
        (they write into the caller's buffers)."""
        groups = _Groups(self, records, outs, inline=True)
        try:
            for i, rec in enumerate(records):
                got = groups.take(i, rec.location)
                assert not isinstance(got, _NotFetched)
                yield got
        finally:
            groups.close()

    def _fetch_ahead(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None
    ) -> _Groups | None:
        """When this host holds a record for every key (it published or adopted each
        replica: every read the store makes) and the batch is large enough to be
        fetched in groups on the reader threads, their objects are fetched from the
        moment the read starts, beside the record reads; a payload is served only if
        the record read names the same object, and it is verified against that record
        (else it is fetched again from the object the record names). A smaller batch
        is fetched on the caller's thread once its records are read, as before (so N
        threads reading small batches keep N fetches in flight)."""
        if not keys:
            return None
        with self._lock:
            held = [self._held.get(k) for k in keys]
        records: list[RemoteRecord] = []
        for i, rec in enumerate(held):
            if rec is None or not rec.location:
                return None
            out = outs[i] if outs is not None else None
            h = rec.header
            if out is not None and (out.shape != h.shape or out.dtype != np.dtype(h.dtype)):
                return None  # read_batch refuses it before any byte is written
            records.append(rec)
        sizes = [r.header.payload_len for r in records]
        if len(_schedule(sizes, self.config.read_group_bytes)) < 2:
            return None  # one group: fetched on the caller's thread, after the records
        return _Groups(self, records, list(outs) if outs is not None else [None] * len(keys))

    def _unpublish(self, keys: Sequence[ChunkKey], records: Sequence[RemoteRecord]) -> None:
        self._reap()
        deleted = self._delete_records(keys, records, frames=False)
        self._remove([records[i].location for i in deleted if records[i].location])

    def details(self) -> dict[str, Any]:
        return {**super().details(), **self.doomed.counters()}


@dataclass(frozen=True, slots=True)
class _PublishPlan:
    """The publish calls of one batch (:meth:`MooncakeTier._publish_plan`)."""

    groups: list[list[int]]
    """Record indices per call (a bucket, or the whole batch on one server)."""
    calls: list[tuple[list[str], list[object]]]
    """Keys and arguments of each call."""
    script: str
    """``PUBLISH_RECORDS`` (one call per bucket) or ``PUBLISH_RECORDS_ALL`` (one)."""


class _Doomed:
    """Payloads whose removal Mooncake refused (a reader's lease) or that failed on
    the transport: retried once their lease should have lapsed, a few times, then left
    to Mooncake's eviction (counted). Thread-safe."""

    MAX_TRIES = 8
    MAX_HELD = 1 << 16

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._queue: deque[tuple[float, int, str]] = deque()
        self.deferred = 0
        self.reaped = 0
        self.abandoned = 0

    def add(self, locations: Sequence[str], tries: int = 0) -> None:
        if not locations:
            return
        at = time.monotonic() + self.lease_s
        with self._lock:
            for loc in locations:
                if tries >= self.MAX_TRIES or len(self._queue) >= self.MAX_HELD:
                    self.abandoned += 1
                else:
                    self._queue.append((at, tries + 1, loc))
                    self.deferred += tries == 0

    def due(self, everything: bool = False) -> dict[str, int]:
        """Locations due for another try, with the tries they had."""
        now = time.monotonic()
        out: dict[str, int] = {}
        with self._lock:
            while self._queue and (everything or self._queue[0][0] <= now):
                _, tries, loc = self._queue.popleft()
                out[loc] = tries
        return out

    def retry(self, due: dict[str, int], failed: Sequence[str]) -> None:
        with self._lock:
            self.reaped += len(due) - len(failed)
        for loc in failed:
            self.add([loc], due[loc])

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def counters(self) -> dict[str, int]:
        held = self.pending()
        return {  # read without the lock: counters only ever grow
            "removals_deferred": self.deferred,
            "removals_reaped": self.reaped,
            "removals_abandoned": self.abandoned,
            "removals_pending": held,
        }


class _Groups:
    """The payloads of ``records``, fetched in groups (:func:`_schedule`), one
    ``batch_get_into`` per group, one after the other on one of the tier's reader
    threads, so the caller verifies a group while the next one is copied (a group of a
    few MiB verified right after its copy is still in the cache: about twice as fast as
    from memory here). One group at a time: two ``batch_get_into`` calls of one client
    run interleaved, each finishing only when both are done (measured with 0.3.13), which
    would keep the caller waiting for two groups. A batch too small to split is one
    group: with ``inline`` fetched on the caller's thread when first taken, else on a
    reader thread from the start. Payloads are taken in order
    (:class:`~kvlife.tiers.redis.published.FetchAhead`)."""

    def __init__(
        self,
        tier: MooncakeTier,
        records: list[RemoteRecord],
        outs: Sequence[np.ndarray | None],
        inline: bool = False,
    ) -> None:
        self.tier = tier
        self.records = records
        self.outs = outs
        sizes = [r.header.payload_len for r in records]
        self.groups = _schedule(sizes, tier.config.read_group_bytes)
        self.inline = inline and len(self.groups) == 1
        self.results: list[Future[list[Payload]]] = [Future() for _ in self.groups]
        self.next_group = 0
        self.done: list[Payload] = []
        self.base = 0  # index of done[0]
        self.closed = threading.Event()
        self.chain: Future[None] | None = None
        if not self.inline:
            self.chain = tier._readers.submit(self._fetch_all)

    def _fetch_all(self) -> None:
        """Fetch the groups in order until all are done or the reader closed."""
        for g, result in zip(self.groups, self.results, strict=True):
            if self.closed.is_set():
                result.cancel()
                continue
            recs, dests = [self.records[i] for i in g], [self.outs[i] for i in g]
            try:
                result.set_result(self.tier._fetch_values(recs, dests))
            except BaseException as exc:
                result.set_exception(exc)

    def take(self, at: int, location: str) -> Payload | _NotFetched:
        if at < self.base:
            raise IndexError(f"payload {at} taken after payload {self.base}")
        while at >= self.base + len(self.done):
            self.base += len(self.done)
            if self.next_group >= len(self.groups):
                raise IndexError(f"payload {at} of a batch of {len(self.records)}")
            if self.inline:
                self.inline = False
                self.done = self.tier._fetch_values(self.records, list(self.outs))
            else:
                self.done = self.results[self.next_group].result()
            self.next_group += 1
        got = self.done[at - self.base]
        return got if self.records[at].location == location else NOT_FETCHED

    def close(self) -> None:
        """Stop after the group being fetched and wait for it (it writes into the
        caller's buffers)."""
        self.closed.set()
        if self.chain is not None:
            with contextlib.suppress(Exception):
                self.chain.result()


READERS = 4
"""Worker threads fetching groups of large reads (shared by the tier's readers)."""

NOT_FOUND = -704
"""Mooncake's OBJECT_NOT_FOUND."""
HAS_LEASE = -706
"""Mooncake's OBJECT_HAS_LEASE: a reader holds the object; removed later."""
GONE_OK = (0, NOT_FOUND)


def _sizes(arrays: Sequence[np.ndarray]) -> list[int]:
    return [a.nbytes for a in arrays]


def _destinations(
    sizes: list[int], outs: Sequence[np.ndarray | None] | None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Byte views to read each payload into: the caller's ``out`` where it can take the
    bytes as they are, else a slice of one new buffer for the rest of the batch; and the
    distinct buffers behind them (what a registration covers)."""
    dests: list[np.ndarray | None] = []
    regions: list[np.ndarray] = []
    for i, size in enumerate(sizes):
        out = outs[i] if outs is not None else None
        if out is not None and _takes(out, size):
            view = out.reshape(-1).view(np.uint8)
            dests.append(view)
            regions.append(view)
        else:
            dests.append(None)
    rest = sum(s for s, d in zip(sizes, dests, strict=True) if d is None)
    buf = np.empty(rest, np.uint8)
    if rest:
        regions.append(buf)
    at = 0
    done: list[np.ndarray] = []
    for size, d in zip(sizes, dests, strict=True):
        if d is None:
            d, at = buf[at : at + size], at + size
        done.append(d)
    return done, regions


def _takes(out: np.ndarray, size: int) -> bool:
    """Whether a payload of ``size`` bytes can be read straight into ``out``."""
    return bool(out.flags.c_contiguous and out.flags.writeable and out.nbytes == size)


def _schedule(sizes: list[int], group_bytes: int = GROUP_BYTES) -> list[list[int]]:
    """The fetch groups of a read batch: consecutive indices, about ``group_bytes``
    each (:attr:`MooncakeConfig.read_group_bytes`; a payload larger than that is a
    group alone), so that the caller verifies each group while it is still in the
    cache: a hash that reads the bytes from memory again competes with the copy for
    memory bandwidth. A batch under ``2 * GROUP_MIN`` bytes or of one payload, or any
    batch with ``group_bytes`` 0, is one group."""
    total = sum(sizes)
    if len(sizes) < 2 or total < 2 * GROUP_MIN or group_bytes <= 0:
        return [list(range(len(sizes)))]
    target = max(GROUP_MIN, min(group_bytes, total // 2))
    groups: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        if groups[-1] and held + size > target:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return groups
