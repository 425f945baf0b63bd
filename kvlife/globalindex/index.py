"""GlobalIndex: leases, fencing, epochs and invalidation rules of one shared remote
tier, kept in Redis (one server or a Redis Cluster).

Key layout (``NS`` is the deployment's index namespace)::

    {kvl:NS:idx}:meta           the index's incarnation id and bucket count, written
                                by the first script that finds the index empty
    {kvl:NS:idx}:fence          fencing-token counter (INCR)
    {kvl:NS:idx}:ban:HOST       set by a revocation: no new lease for a while
    {kvl:NS:idx}:epoch          invalidation epoch counter
    {kvl:NS:idx}:rules          epoch -> rule
    {kvl:NS:bNNN}:fence         per bucket: per host the lowest token accepted, the
                                current lease's token and deadline (scripts.py)
    {kvl:NS:bNNN}:m:KEY         a chunk's publication record
    {kvl:NS:bNNN}:f:KEY         its frame (Redis tier), staged as ...:s:KEY:NONCE

A chunk's record, frame and its bucket's fence hash share one hash tag, so the scripts
that check the host's lease and publish or delete run atomically on the one node that
owns them, single server or cluster.

Every read of the index's state (one script per lookup) returns its incarnation: an
index that lost its state (a restart without persistence, ``FLUSHALL``) comes back with
a new one, and each host treats it as new (its rules and epochs dropped, the store told
to drop what was created under the old one), logs it and counts it (``index_resets``).
Rules are handed to the store until it says it applied them (at-least-once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError

from kvlife.core.errors import IndexUnreachable, InvalidArgument, LeaseError, RemoteTierError
from kvlife.core.identity import Namespace
from kvlife.core.logs import log_event
from kvlife.core.objects import UNSTAMPED, EpochStamp, ObjectInfo
from kvlife.globalindex import scripts
from kvlife.globalindex.health import REFUSALS, Health
from kvlife.globalindex.lease import Lease
from kvlife.globalindex.record import RemoteRecord
from kvlife.globalindex.rule_index import RuleIndex
from kvlife.globalindex.rules import InvalidationRule, RuleSync

log = logging.getLogger(__name__)

RULES_PER_READ = 1000
"""Rules fetched by one script call (Lua's stack bounds the arguments of one call)."""

RedisClient = Any
"""A ``redis.Redis`` or ``redis.cluster.RedisCluster`` (same command API)."""


def default_host_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Settings of a host's view of the global index."""

    namespace: str = "kvlife"
    """Index namespace: every key of this deployment starts with ``kvl:NAMESPACE``."""
    buckets: int = 16
    """Hash-tag buckets the chunks are spread over (slots of a cluster)."""
    host: str = ""
    """This host's id in leases (default: hostname-pid)."""
    lease_ttl_ms: int = 10_000
    """Lease lifetime; a host paused or cut off longer than this cannot publish."""
    renew_margin: float = 0.5
    """Renew when less than this fraction of the lease is left."""

    def __post_init__(self) -> None:
        if not self.namespace or ":" in self.namespace or "{" in self.namespace:
            raise InvalidArgument(f"index namespace {self.namespace!r} must be plain")
        if not 1 <= self.buckets <= 4096:
            raise InvalidArgument(f"buckets must be in 1..4096, got {self.buckets}")
        if self.lease_ttl_ms < 10:
            raise InvalidArgument(f"lease_ttl_ms must be >= 10, got {self.lease_ttl_ms}")

    @property
    def host_id(self) -> str:
        return self.host or default_host_id()


REFRESH_OVERTAKEN = 64
"""Reads one :meth:`GlobalIndex.refresh` sends again because a later read's reply was
taken in before its own (other threads refreshing meanwhile) before it gives up."""


@dataclass(slots=True)
class IndexCounters:
    leases_acquired: int = 0
    leases_renewed: int = 0
    publishes_refused: int = 0
    """Publications the fencing check rejected (stale token, expired lease, a lease of
    an index that lost its state since)."""
    stale_replies: int = 0
    """Replies about the index's identity not taken in: a reply to a later read was
    taken in first (:meth:`GlobalIndex._observe`)."""
    rules_seen: int = 0
    refused_by_rule: int = 0
    """Remote objects not served because an invalidation rule covers them."""
    refused_incarnation: int = 0
    """Remote records not adopted: created under another index incarnation (or one the
    record does not name)."""
    unreachable: int = 0
    """Lookups that could not read the index (nothing remote served)."""
    index_resets: int = 0
    """Times the index was found with another incarnation than the one read before (it
    lost its state): everything created under the old one is dropped."""
    rules_malformed: int = 0
    """Rules that could not be read, applied as covering everything older."""
    deletes_refused: int = 0
    """Deletes not done: the fence refused them (no lease: revoked, banned) or the
    record was not the one this host held any more (published since by another)."""


class IndexMismatch(InvalidArgument):
    """This host's index settings disagree with the index's own (its bucket count):
    every host of an index must spread keys over the same buckets."""


class GlobalIndex:
    """One host's handle on the global index (thread-safe)."""

    def __init__(self, client: RedisClient, config: IndexConfig, health: Health) -> None:
        self.client = client
        self.config = config
        self.host = config.host_id
        self.health = health
        self.counters = IndexCounters()
        ns = config.namespace
        self._idx = f"{{kvl:{ns}:idx}}"
        self._tags = [f"{{kvl:{ns}:b{b:03d}}}" for b in range(config.buckets)]
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._incarnation = ""
        """Incarnation last read (empty: never read)."""
        self._reads = 0
        """Reads of the index's identity sent so far (numbered as sent)."""
        self._seen = 0
        """The number of the newest read whose reply was taken in (:meth:`_observe`)."""
        self._epoch = 0
        """Every rule up to this epoch of ``_incarnation`` was recorded before it was read."""
        self._rules = RuleIndex()
        """Every rule read or recorded, filed for :meth:`admissible`."""
        self._complete = 0
        """Every rule up to this epoch is in ``_rules`` (a rule this host recorded may be
        there before the ones below it are read): a refresh reads only the rules after
        it, so its cost does not grow with the rules of the index's life."""
        self._applied_incarnation = ""
        self._applied = 0
        """The store applied every rule of ``_applied_incarnation`` up to this epoch."""
        self._sha: dict[str, str] = {}

    # ------------------------------------------------------------------ key names

    def tag(self, key: bytes) -> str:
        return self._tags[int.from_bytes(key[:2], "big") % len(self._tags)]

    def buckets_of(self, keys: Sequence[bytes]) -> list[list[int]]:
        """The indices of ``keys`` grouped by hash-tag bucket (one cluster slot each),
        buckets in the order their first key comes, indices in order."""
        by_tag: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_tag.setdefault(self.tag(key), []).append(i)
        return list(by_tag.values())

    def record_key(self, key: bytes) -> str:
        return f"{self.tag(key)}:m:{key.hex()}"

    def frame_key(self, key: bytes) -> str:
        return f"{self.tag(key)}:f:{key.hex()}"

    def staging_key(self, key: bytes, nonce: str) -> str:
        return f"{self.tag(key)}:s:{key.hex()}:{nonce}"

    def fence_key(self, key: bytes) -> str:
        return f"{self.tag(key)}:fence"

    def record_pattern(self) -> str:
        return f"{{kvl:{self.config.namespace}:b*}}:m:*"

    # ------------------------------------------------------------------ scripts

    def evalsha(
        self, target: RedisClient, name: str, keys: Sequence[str], args: Sequence[object]
    ) -> Any:
        """Queue (pipeline) or run (client) one of :mod:`scripts` by SHA, loading it
        first where needed."""
        sha = self._sha.get(name)
        if sha is None:
            sha = self._sha[name] = self.client.script_load(getattr(scripts, name))
        return target.execute_command("EVALSHA", sha, len(keys), *keys, *args)

    def run_script(self, name: str, keys: Sequence[str], args: Sequence[object]) -> Any:
        try:
            return self.evalsha(self.client, name, keys, args)
        except NoScriptError:  # the server restarted and lost its script cache
            self._sha.clear()
            return self.evalsha(self.client, name, keys, args)

    def per_bucket(self, name: str, args: Callable[[str], Sequence[object]]) -> list[Any]:
        """Run script ``name`` once on every bucket's fence hash, pipelined; replies in
        bucket order, an error as a value."""
        for attempt in (0, 1):
            pipe = self.client.pipeline(transaction=False)
            for fence in self._fences():
                self.evalsha(pipe, name, [fence], args(fence))
            res = list(pipe.execute(raise_on_error=False))
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in res):
                self._sha.clear()  # a node restarted and lost its scripts
                continue
            return res
        raise AssertionError("unreachable")

    @property
    def standalone(self) -> bool:
        """One server (its scripts may name every key at once), not a cluster."""
        return isinstance(self.client, redis.Redis)

    # ------------------------------------------------------------------ leases

    def lease(self) -> Lease:
        """A lease valid for at least ``renew_margin`` of its TTL: the current one,
        renewed, or a new one (new token, granted in every bucket)."""
        with self._lock:
            cur = self._lease
            ttl_s = self.config.lease_ttl_ms / 1000
            if cur is not None and cur.remaining_s() > ttl_s * self.config.renew_margin:
                return cur
            if cur is not None and cur.remaining_s() > 0:
                sent = time.monotonic()
                try:
                    deadline = self.health.call("renew lease", lambda: self._renew(cur))
                    self._lease = Lease(
                        self.host, cur.token, int(deadline), sent + ttl_s, cur.incarnation
                    )
                    self.counters.leases_renewed += 1
                    return self._lease
                except RedisError as exc:  # lost: fall through to a new lease
                    if not str(exc).startswith(REFUSALS):
                        raise
            self._lease = None
            return self._acquire()

    def check_current(self, lease: Lease) -> None:
        """LeaseError (counted as ``publishes_refused``) when this host saw the index
        lose its state since ``lease`` was granted (another incarnation; no I/O), asked
        by a write right before it publishes. The lease's token went with the old
        index, and the new one counts tokens from 1 again: once this host took a lease
        there, a token of the lost index could match it in every bucket, and a write
        prepared before the loss (its lease perhaps revoked, expired or fenced by a rule
        of the lost index) would publish. A lease revoked, superseded or expired within
        one incarnation is left to the publish script, on the index's own clock."""
        with self._lock:
            now = self._incarnation
        if lease.incarnation and now and lease.incarnation != now:
            raise self.refused(
                RedisError(
                    f"KVLRESET lease granted by index incarnation {lease.incarnation}, "
                    f"which lost its state (now {now})"
                )
            )

    def _renew(self, cur: Lease) -> int:
        args = [self.host, cur.token, self.config.lease_ttl_ms]
        if self.standalone:
            return int(self.run_script("RENEW", self._fences(), args))
        res = self.per_bucket("RENEW", lambda _: args)
        _raise_first(res)
        return int(res[-1])

    def _acquire(self) -> Lease:
        """A new token granted in every bucket (called with the lock held)."""
        sent = time.monotonic()
        ttl = self.config.lease_ttl_ms
        cfg = [_fresh_id(), self.config.buckets]
        self._reads += 1
        seq = self._reads
        try:
            if self.standalone:
                token, inc, buckets, deadline = self.health.call(
                    "acquire lease",
                    lambda: self.run_script(
                        "ACQUIRE_ALL",
                        [
                            self._meta(),
                            self._fence_counter(),
                            self._ban_key(self.host),
                            *self._fences(),
                        ],
                        [*cfg, self.host, ttl],
                    ),
                )
            else:
                token, inc, buckets = self.health.call(
                    "acquire lease",
                    lambda: self.run_script(
                        "ACQUIRE",
                        [self._meta(), self._fence_counter(), self._ban_key(self.host)],
                        cfg,
                    ),
                )
                granted = self.health.call(
                    "grant lease",
                    lambda: self.per_bucket(
                        "GRANT", lambda _: [self.host, int(token), ttl, _text(inc)]
                    ),
                )
                _raise_first(granted)
                deadline = granted[-1]
        except RedisError as exc:
            raise LeaseError(f"host {self.host} cannot get a lease: {exc}") from exc
        self._observe(_text(inc), buckets, seq)  # the lock was held since it was sent
        lease = Lease(self.host, int(token), int(deadline), sent + ttl / 1000, _text(inc))
        self._lease = lease
        self.counters.leases_acquired += 1
        return lease

    def revoke(self, host: str, ban_ms: int = 0) -> int:
        """Revoke ``host``'s lease: its token (and every older one) is refused in every
        bucket from now on, and for ``ban_ms`` it gets no new lease. On one server this
        is one script (no moment where the host is banned but still publishes); on a
        cluster, a script on the index's node then one per bucket, each atomic, all
        done when this returns. A ban only ever grows: a shorter one (or none) leaves a
        longer ban in force. Returns the token the buckets now refuse below."""
        if self.standalone:
            token = self.health.call(
                "revoke lease",
                lambda: self.run_script(
                    "REVOKE_ALL",
                    [self._fence_counter(), self._ban_key(host), *self._fences()],
                    [host, ban_ms],
                ),
            )
        else:
            token = self.health.call(
                "revoke lease",
                lambda: self.run_script(
                    "REVOKE", [self._fence_counter(), self._ban_key(host)], [ban_ms]
                ),
            )
            done = self.health.call(
                "revoke in buckets",
                lambda: self.per_bucket("REVOKE_BUCKET", lambda _: [host, int(token)]),
            )
            errors = [r for r in done if isinstance(r, Exception)]
            if errors:
                raise RemoteTierError(f"revoke of {host} failed in a bucket: {errors[0]}")
        if host == self.host:
            self.drop_lease()
        return int(token)

    def drop_lease(self) -> None:
        """Forget the local lease (the next publication asks for a new one)."""
        with self._lock:
            self._lease = None

    def refused(self, exc: RedisError) -> LeaseError:
        self.counters.publishes_refused += 1
        with self._lock:
            self._lease = None  # a refusal means this lease is no good any more
        # fenced: a structured line (kvlife.core.logs), counted as publishes_refused
        log_event(log, "fenced", logging.WARNING, host=self.host, reason=str(exc))
        return LeaseError(f"publication by {self.host} refused: {exc}")

    # ------------------------------------------------------------------ epochs and rules

    def refresh(self) -> None:
        """Read the index's incarnation and epoch and any rules not read yet;
        IndexUnreachable when the index cannot be read (the caller serves nothing
        remote), IndexMismatch when its bucket count is not this host's."""
        losses = overtaken = 0
        while losses < 3 and overtaken < REFRESH_OVERTAKEN:
            seq = self._begin_read()
            try:
                inc, buckets, epoch = self.health.call(
                    "read index",
                    lambda: self.run_script(
                        "STATE",
                        [self._meta(), self._idx + ":epoch"],
                        [_fresh_id(), self.config.buckets],
                    ),
                )
                inc = _text(inc)
                epoch = int(epoch)
                with self._lock:
                    if not self._observe(inc, buckets, seq):
                        overtaken += 1  # an older reply than one taken in: read again
                        continue
                    missing = [
                        e for e in range(self._complete + 1, epoch + 1) if e not in self._rules
                    ]
                got = self._read_rules(inc, missing)
            except _Reset:
                losses += 1
                continue  # the index lost its state between two reads: read it again
            except RemoteTierError as exc:
                self.counters.unreachable += 1
                raise IndexUnreachable(f"global index unreachable: {exc}") from exc
            with self._lock:
                if self._incarnation != inc:
                    losses += 1
                    continue
                for rule in got.values():
                    self._rules.add(rule)
                self._epoch = max(self._epoch, epoch)
                self._complete = max(self._complete, epoch)
                self.counters.rules_seen = len(self._rules)
            return
        self.counters.unreachable += 1
        why = "it keeps losing its state" if losses >= 3 else "other reads keep overtaking"
        raise IndexUnreachable(f"global index unreachable: {why}")

    def _read_rules(self, inc: str, epochs: list[int]) -> dict[int, InvalidationRule]:
        got: dict[int, InvalidationRule] = {}
        for at in range(0, len(epochs), RULES_PER_READ):
            part = epochs[at : at + RULES_PER_READ]
            try:
                blobs = self.health.call(
                    "read rules",
                    lambda part=part: self.run_script(  # type: ignore[misc]
                        "RULES", [self._meta(), self._idx + ":rules"], [inc, *part]
                    ),
                )
            except RedisError as exc:
                if str(exc).startswith("KVLRESET"):
                    raise _Reset() from exc
                raise
            for e, blob in zip(part, blobs, strict=True):
                rule = InvalidationRule.from_body(e, inc, blob)
                if rule.everything:
                    self.counters.rules_malformed += 1
                    log.warning(
                        "index %s: rule %d cannot be read (%s); it covers everything older",
                        self.config.namespace,
                        e,
                        rule.reason,
                    )
                got[e] = rule
        return got

    def _begin_read(self) -> int:
        """The number of a read of the index's identity about to be sent: replies are
        taken in only in the order their reads were sent (:meth:`_observe`)."""
        with self._lock:
            self._reads += 1
            return self._reads

    def _observe(self, incarnation: str, buckets: object, seq: int) -> bool:
        """Take in the index's identity from the reply to read ``seq`` (called with the
        lock held); False, nothing taken in, when a reply to a later read was taken in
        already. Without that a reply read before the index lost its state and taken in
        after a reply read since rolled the host back to the lost incarnation, its rules
        cleared (found by a red team, 2026-12-06)."""
        if int(_text(buckets)) != self.config.buckets:
            raise IndexMismatch(
                f"index {self.config.namespace!r} spreads keys over {_text(buckets)} buckets; "
                f"this host is configured with buckets={self.config.buckets}"
            )
        if seq < self._seen:
            self.counters.stale_replies += 1
            return False
        self._seen = seq
        if self._incarnation and incarnation != self._incarnation:
            self.counters.index_resets += 1
            log.warning(
                "index %s lost its state (incarnation %s, was %s): everything created "
                "under the old one is dropped",
                self.config.namespace,
                incarnation,
                self._incarnation,
            )
            self._rules.clear()
            self._epoch = 0
            self._complete = 0
            self._applied = 0
            self._lease = None  # its token came from a counter that is gone
        self._incarnation = incarnation
        return True

    @property
    def epoch(self) -> int:
        """Last epoch read (see :meth:`refresh`)."""
        return self._epoch

    @property
    def incarnation(self) -> str:
        """Incarnation last read (empty: never read)."""
        return self._incarnation

    def stamp(self) -> EpochStamp:
        """The creation stamp of KV created now (no I/O): the index state last read."""
        with self._lock:
            if not self._incarnation:
                return UNSTAMPED
            return EpochStamp(self._incarnation, self._epoch)

    def pending(self) -> RuleSync:
        """What the store has not applied yet of the state last read (call after
        :meth:`refresh`): handed out again until :meth:`applied`."""
        with self._lock:
            fresh = self._applied_incarnation != self._incarnation
            since = 0 if fresh else self._applied
            upto = self._complete
            rules = tuple(self._rules[e] for e in range(since + 1, upto + 1))
            return RuleSync(self._incarnation, upto, fresh, rules)

    def applied(self, sync: RuleSync) -> None:
        """The store applied ``sync`` to its local index."""
        with self._lock:
            if sync.incarnation != self._incarnation:
                return  # the index was reset meanwhile: the next sync is fresh
            if self._applied_incarnation != sync.incarnation:
                self._applied_incarnation = sync.incarnation
                self._applied = sync.epoch
            else:
                self._applied = max(self._applied, sync.epoch)

    def admissible(self, rec: RemoteRecord, info: ObjectInfo, lineage: tuple[bytes, ...]) -> bool:
        """The record was published under the current incarnation and no rule newer
        than its creation epoch covers it (call after ``refresh``)."""
        with self._lock:
            if not rec.incarnation or rec.incarnation != self._incarnation:
                self.counters.refused_incarnation += 1
                return False
            if self._rules.covering(rec.epoch, rec.header.key, info, lineage) is None:
                return True
            self.counters.refused_by_rule += 1
            return False

    def invalidate(
        self,
        *,
        namespace: Namespace | str | None = None,
        adapter_id: str | None = None,
        weights_digest: str | None = None,
        prefix: bytes | None = None,
        reason: str = "",
        source: str | None = None,
        versions: tuple[int, int] | None = None,
        model: str | None = None,
        keep_weights_digest: str | None = None,
    ) -> InvalidationRule:
        """Record a global invalidation under a fresh epoch (validated first: a rule no
        host could apply is refused here, InvalidArgument; so is one from a host whose
        bucket count is not the index's, IndexMismatch, recording nothing); every host
        stops serving what it covers at its next lookup."""
        ns = str(namespace) if isinstance(namespace, Namespace) else namespace
        probe = InvalidationRule(  # validates
            1,
            ns,
            adapter_id,
            weights_digest,
            prefix,
            reason,
            source=source,
            versions=versions,
            model=model,
            keep_weights_digest=keep_weights_digest,
        )
        seq = self._begin_read()
        try:
            inc, buckets, epoch = self.health.call(
                "record invalidation",
                lambda: self.run_script(
                    "INVALIDATE",
                    [self._meta(), self._idx + ":epoch", self._idx + ":rules"],
                    [_fresh_id(), self.config.buckets, probe.body()],
                ),
            )
        except RedisError as exc:  # the script refused: nothing recorded
            if str(exc).startswith("KVLMISMATCH"):
                raise IndexMismatch(
                    f"index {self.config.namespace!r}: {str(exc).split(' ', 1)[1]}; this host "
                    f"is configured with buckets={self.config.buckets}: rule not recorded"
                ) from exc
            raise
        inc = _text(inc)
        with self._lock:
            self._observe(inc, buckets, seq)
            rule = dataclasses.replace(probe, epoch=int(epoch), incarnation=inc)
            if inc == self._incarnation:  # else a rule of an index that lost its state since
                self._rules.add(rule)
                self._epoch = max(self._epoch, rule.epoch)
        return rule

    # ------------------------------------------------------------------ keys of the idx tag

    def _meta(self) -> str:
        return self._idx + ":meta"

    def _fence_counter(self) -> str:
        return self._idx + ":fence"

    def _ban_key(self, host: str) -> str:
        return f"{self._idx}:ban:{host}"

    def _fences(self) -> list[str]:
        return [f"{tag}:fence" for tag in self._tags]


class _Reset(Exception):
    """The index's incarnation changed between two reads of one refresh."""


def _fresh_id() -> str:
    """The incarnation id a script writes if it finds the index empty: new every time,
    so an index recreated by the same host is still a new one."""
    return uuid.uuid4().hex[:16]


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _raise_first(replies: list[Any]) -> None:
    for r in replies:
        if isinstance(r, Exception):
            raise r
