"""GlobalIndex: leases, fencing, epochs and invalidation rules of one shared remote
tier, kept in Redis (one server or a Redis Cluster).

Key layout (``NS`` is the deployment's index namespace)::

    {kvl:NS:idx}:fence          fencing-token counter (INCR)
    {kvl:NS:idx}:lease:HOST     the host's current token, expiring with the lease
    {kvl:NS:idx}:ban:HOST       set by a revocation: no new lease for a while
    {kvl:NS:idx}:epoch          invalidation epoch counter
    {kvl:NS:idx}:rules          epoch -> rule
    {kvl:NS:bNNN}:fence         per bucket: host -> lowest token still accepted
    {kvl:NS:bNNN}:m:KEY         a chunk's publication record
    {kvl:NS:bNNN}:f:KEY         its frame (Redis tier), staged as ...:s:KEY:NONCE

A chunk's record, frame and its bucket's fence floors share one hash tag, so the
publish script that checks the token and makes the frame visible runs atomically on
the one node that owns them, single server or cluster.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from redis.exceptions import NoScriptError, RedisError

from kvlife.core.errors import IndexUnreachable, InvalidArgument, LeaseError, RemoteTierError
from kvlife.core.identity import Namespace
from kvlife.core.objects import ObjectInfo
from kvlife.globalindex import scripts
from kvlife.globalindex.health import REFUSALS, Health
from kvlife.globalindex.lease import Lease
from kvlife.globalindex.record import RemoteRecord
from kvlife.globalindex.rules import InvalidationRule

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


@dataclass(slots=True)
class IndexCounters:
    leases_acquired: int = 0
    leases_renewed: int = 0
    publishes_refused: int = 0
    """Publications the fencing check rejected (stale token, expired lease)."""
    rules_seen: int = 0
    refused_by_rule: int = 0
    """Remote objects not served because an invalidation rule covers them."""
    unreachable: int = 0
    """Lookups that could not read the index (nothing remote served)."""


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
        self._epoch = 0
        self._rules: dict[int, InvalidationRule] = {}
        self._handed_out = 0
        """Highest epoch whose rules :meth:`take_new_rules` already returned."""
        self._sha: dict[str, str] = {}

    # ------------------------------------------------------------------ key names

    def tag(self, key: bytes) -> str:
        return self._tags[int.from_bytes(key[:2], "big") % len(self._tags)]

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

    # ------------------------------------------------------------------ leases

    def lease(self) -> Lease:
        """A lease valid for at least ``renew_margin`` of its TTL: the current one,
        renewed, or a new one (new token, floors raised in every bucket)."""
        with self._lock:
            cur = self._lease
            ttl_s = self.config.lease_ttl_ms / 1000
            if cur is not None and cur.remaining_s() > ttl_s * self.config.renew_margin:
                return cur
            if cur is not None and cur.remaining_s() > 0:
                sent = time.monotonic()
                try:
                    deadline = self.health.call(
                        "renew lease",
                        lambda: self.run_script(
                            "RENEW",
                            [self._lease_key(self.host)],
                            [cur.token, self.config.lease_ttl_ms],
                        ),
                    )
                    self._lease = Lease(self.host, cur.token, int(deadline), sent + ttl_s)
                    self.counters.leases_renewed += 1
                    return self._lease
                except RedisError as exc:  # lost: fall through to a new lease
                    if not str(exc).startswith(REFUSALS):
                        raise
            self._lease = None
            return self._acquire()

    def _acquire(self) -> Lease:
        sent = time.monotonic()
        ttl = self.config.lease_ttl_ms
        try:
            token, deadline = self.health.call(
                "acquire lease",
                lambda: self.run_script(
                    "ACQUIRE",
                    [self._fence_counter(), self._lease_key(self.host), self._ban_key(self.host)],
                    [ttl],
                ),
            )
        except RedisError as exc:
            raise LeaseError(f"host {self.host} cannot get a lease: {exc}") from exc
        self._raise_floors(self.host, int(token))
        lease = Lease(self.host, int(token), int(deadline), sent + ttl / 1000)
        self._lease = lease
        self.counters.leases_acquired += 1
        return lease

    def _raise_floors(self, host: str, token: int) -> None:
        """Every bucket refuses tokens of ``host`` below ``token`` from now on."""

        def run() -> None:
            for attempt in (0, 1):
                pipe = self.client.pipeline(transaction=False)
                for tag in self._tags:
                    self.evalsha(pipe, "RAISE_FLOOR", [f"{tag}:fence"], [host, token])
                try:
                    pipe.execute()
                    return
                except NoScriptError:
                    if attempt:
                        raise
                    self._sha.clear()  # a node restarted and lost its scripts

        self.health.call("raise fence floors", run)

    def revoke(self, host: str, ban_ms: int = 0) -> int:
        """Revoke ``host``'s lease: its token (and every older one) is refused in every
        bucket, atomically per bucket, and for ``ban_ms`` it gets no new lease."""
        token = int(
            self.health.call(
                "revoke lease",
                lambda: self.run_script(
                    "REVOKE",
                    [self._fence_counter(), self._lease_key(host), self._ban_key(host)],
                    [ban_ms],
                ),
            )
        )
        self._raise_floors(host, token)
        return token

    def drop_lease(self) -> None:
        """Forget the local lease (the next publication asks for a new one)."""
        with self._lock:
            self._lease = None

    def refused(self, exc: RedisError) -> LeaseError:
        self.counters.publishes_refused += 1
        with self._lock:
            self._lease = None  # a refusal means this lease is no good any more
        return LeaseError(f"publication by {self.host} refused: {exc}")

    # ------------------------------------------------------------------ epochs and rules

    def refresh(self) -> int:
        """Read the current epoch and any rules not seen yet; IndexUnreachable when the
        index cannot be read (the caller serves nothing remote)."""
        try:
            epoch = self.health.call(
                "read epoch", lambda: int(self.client.get(self._idx + ":epoch") or 0)
            )
            with self._lock:
                missing = [e for e in range(1, epoch + 1) if e not in self._rules]
            if missing:
                raw = self.health.call(
                    "read rules",
                    lambda: self.client.hmget(self._idx + ":rules", [str(e) for e in missing]),
                )
                got = {}
                for e, blob in zip(missing, raw, strict=True):
                    if blob is None:
                        raise RemoteTierError(f"index epoch {e} has no rule")
                    got[e] = _decode_rule(e, blob)
                with self._lock:
                    self._rules.update(got)
                    self.counters.rules_seen = len(self._rules)
        except RemoteTierError as exc:
            self.counters.unreachable += 1
            raise IndexUnreachable(f"global index unreachable: {exc}") from exc
        with self._lock:
            self._epoch = max(self._epoch, epoch)
            return self._epoch

    @property
    def epoch(self) -> int:
        """Last epoch read (see :meth:`refresh`)."""
        return self._epoch

    def admissible(self, rec: RemoteRecord, info: ObjectInfo, lineage: tuple[bytes, ...]) -> bool:
        """No rule newer than the record's epoch covers it (call after ``refresh``)."""
        with self._lock:
            rules = [r for e, r in self._rules.items() if e > rec.epoch]
        for rule in rules:
            if rule.matches(rec.header.key, info, lineage):
                self.counters.refused_by_rule += 1
                return False
        return True

    def take_new_rules(self) -> list[InvalidationRule]:
        """Rules read since the last call, oldest first (each handed out once): a store
        applies them to its local index."""
        with self._lock:
            new = [self._rules[e] for e in sorted(self._rules) if e > self._handed_out]
            if new:
                self._handed_out = max(r.epoch for r in new)
            return new

    def invalidate(
        self,
        *,
        namespace: Namespace | str | None = None,
        adapter_id: str | None = None,
        weights_digest: str | None = None,
        prefix: bytes | None = None,
        reason: str = "",
    ) -> InvalidationRule:
        """Record a global invalidation under a fresh epoch; every host stops serving
        what it covers at its next lookup."""
        ns = str(namespace) if namespace is not None else None
        probe = InvalidationRule(1, ns, adapter_id, weights_digest, prefix, reason)  # validates
        body = msgpack.packb([ns, adapter_id, weights_digest, probe.prefix, reason])
        epoch = int(
            self.health.call(
                "record invalidation",
                lambda: self.run_script(
                    "INVALIDATE", [self._idx + ":epoch", self._idx + ":rules"], [body]
                ),
            )
        )
        rule = InvalidationRule(epoch, ns, adapter_id, weights_digest, probe.prefix, reason)
        with self._lock:
            self._rules[epoch] = rule
        return rule

    # ------------------------------------------------------------------ keys of the idx tag

    def _fence_counter(self) -> str:
        return self._idx + ":fence"

    def _lease_key(self, host: str) -> str:
        return f"{self._idx}:lease:{host}"

    def _ban_key(self, host: str) -> str:
        return f"{self._idx}:ban:{host}"


def _decode_rule(epoch: int, blob: bytes) -> InvalidationRule:
    try:
        ns, adapter, weights, prefix, reason = msgpack.unpackb(blob)
        return InvalidationRule(epoch, ns, adapter, weights, prefix, reason)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise RemoteTierError(f"index rule {epoch} undecodable: {exc}") from exc
