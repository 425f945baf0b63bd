"""The multi-host model's runner: a world of real servers (one redis-server, a Redis
Cluster, or a Mooncake master with its Redis index), hosts that join it on their first
step (in-process stores and ``kvlife serve`` processes, each reaching Redis through a
loopback fault proxy of its own where the backend allows), and the loop that runs a
schedule step by step, hands every served chunk to the oracle and collects findings.
The liveness checks that need more than one call live here too: a handoff of a fresh
prompt between two hosts, a get that must serve (retried through an index backoff),
what the disk host made durable, the records of a host revoked while a thread of its
own publishes (read from Redis directly), and a host configured with another bucket
count.

Also a command line for working on findings::

    python -m tests.remote.multihost_run run --seed 7 --steps 400 [--backend redis]
    python -m tests.remote.multihost_run shrink --seed 7 --steps 400 --label item1
    python -m tests.remote.multihost_run replay '[{"kind":"put",...}, ...]'
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from kvlife.core.errors import KVLifeError
from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.globalindex import RemoteRecord
from kvlife.globalindex.record import RecordError
from kvlife.tiers.redis.server import RedisClusterServers, RedisServer
from tests.remote.multihost_api import (
    Criteria,
    Host,
    InProcessHost,
    Looked,
    ServedHost,
    SharedSpec,
)
from tests.remote.multihost_oracle import Finding, Oracle, Served, Version
from tests.remote.multihost_schedule import (
    CHUNKS,
    FRESH,
    PROMPTS,
    Cast,
    Step,
    chunk_of,
    dumps,
    generate,
    key_infos,
    loads,
    prompt_keys,
    prompt_of,
    version_kv,
)

LEASE_TTL_MS = 1000
SOCKET_TIMEOUT_S = 0.25
DELAY_S = 0.005

TRANSFORMS = {"d": "int8", "s2": "int4"}
"""Hosts whose shared tier stores a lossy transform of the same keys."""

JOIN_TOKENS = np.random.default_rng(99).integers(0, 50_000, 64)
"""A prompt no step puts: the lookup a host joins with."""

DEFAULT_CAST = Cast(("a", "b", "c", "d", "e"), ("s1", "s2"), faults=True, disk=("e",))
"""Four in-process hosts with [memory dram, shared] (d's shared tier stores int8), one
with [memory dram, disk disk, shared] (e), two ``kvlife serve`` hosts (s2's shared tier
stores int4)."""
CLUSTER_CAST = Cast(("a", "b", "c", "d", "e"), ("s1",), faults=False, disk=("e",))
"""On a Redis Cluster: no fault proxy (clients follow MOVED to the nodes)."""
MOONCAKE_CAST = Cast(("a", "b", "c", "d", "e"), (), faults=True, disk=("e",))
"""On Mooncake: in-process hosts only (a Mooncake client per host)."""
CASTS = {"redis": DEFAULT_CAST, "cluster": CLUSTER_CAST, "mooncake": MOONCAKE_CAST}


# ---------------------------------------------------------------------- backends


class Backend:
    """The shared servers of a world and how a host reaches them."""

    name = ""
    faults = False
    timeout_s = SOCKET_TIMEOUT_S
    """Hosts' Redis socket timeout: short, so that a partitioned host fails fast; the
    minimal schedules, which have no partition, wait longer (a loaded machine)."""

    def start(self, tmp: Path) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def spec(self, host: str, ns: str) -> SharedSpec:
        raise NotImplementedError

    def set_fault(self, host: str, fault: Fault) -> None:
        """Set the fault between ``host`` and Redis (only where ``faults``)."""

    def restart(self, persist: bool) -> None:
        raise NotImplementedError

    def flushall(self) -> None:
        raise NotImplementedError

    def nodes(self) -> list[redis.Redis]:
        """A direct client of every node (no proxy): the oracle's own view of Redis."""
        raise NotImplementedError

    def records(self, ns: str) -> dict[bytes, bytes]:
        """Every publication record of index ``ns``: key name -> record bytes."""
        out: dict[bytes, bytes] = {}
        for node in self.nodes():
            names = list(node.scan_iter(match=f"{{kvl:{ns}:b*}}:m:*", count=1000))
            pipe = node.pipeline(transaction=False)
            for name in names:
                pipe.get(name)  # one by one: a cluster node answers no cross-slot MGET
            for name, blob in zip(names, pipe.execute(), strict=True):
                if blob is not None:
                    out[name] = blob
            node.close()
        return out

    def index_exists(self, ns: str) -> bool:
        """Whether index ``ns`` has its identity (incarnation, bucket count) in Redis."""
        found = False
        for node in self.nodes():
            with contextlib.suppress(redis.ResponseError):  # MOVED: another node's slot
                found = found or bool(node.exists(f"{{kvl:{ns}:idx}}:meta"))
            node.close()
        return found

    def rule_count(self, ns: str) -> int:
        """Rules recorded in index ``ns``."""
        n = 0
        for node in self.nodes():
            with contextlib.suppress(redis.ResponseError):  # MOVED: another node's slot
                n += int(node.hlen(f"{{kvl:{ns}:idx}}:rules"))
            node.close()
        return n


def _index_options(host: str, ns: str, timeout_s: float) -> tuple[tuple[str, object], ...]:
    return (
        ("index_namespace", ns),
        ("host", host),
        ("lease_ttl_ms", LEASE_TTL_MS),
        ("socket_timeout_s", timeout_s),
    )


def _restart_node(node: RedisServer, persist: bool) -> None:
    if persist:  # a snapshot, then the kill: every key comes back
        redis.Redis(port=node.port, socket_timeout=10).save()
        node.stop()
    else:  # a crash of a server without persistence: it comes back empty
        node.stop()
        (node.dir / "dump.rdb").unlink(missing_ok=True)
    node.start()


class SingleRedis(Backend):
    """One redis-server; each host reaches it through a fault proxy of its own."""

    name = "redis"
    faults = True

    def __init__(self) -> None:
        self.server: RedisServer | None = None
        self.proxies: dict[str, FaultProxy] = {}

    def start(self, tmp: Path) -> None:
        self.server = RedisServer(tmp / "redis").start()

    def stop(self) -> None:
        for p in self.proxies.values():
            p.set(Fault.drop())  # its connections end first: no pump is left pending
        time.sleep(0.05)
        for p in self.proxies.values():
            p.stop()
        self.proxies.clear()
        if self.server is not None:
            self.server.stop()

    def _proxy(self, host: str) -> FaultProxy:
        assert self.server is not None
        p = self.proxies.get(host)
        if p is None:
            p = self.proxies[host] = FaultProxy(("127.0.0.1", self.server.port)).start()
        return p

    def spec(self, host: str, ns: str) -> SharedSpec:
        url = f"redis://127.0.0.1:{self._proxy(host).port}/0"
        options = (("url", url), *_index_options(host, ns, self.timeout_s))
        return SharedSpec("redis", options, TRANSFORMS.get(host, ""))

    def set_fault(self, host: str, fault: Fault) -> None:
        self._proxy(host).set(fault)

    def restart(self, persist: bool) -> None:
        assert self.server is not None
        _restart_node(self.server, persist)

    def flushall(self) -> None:
        assert self.server is not None
        redis.Redis(port=self.server.port).flushall()

    def nodes(self) -> list[redis.Redis]:
        assert self.server is not None
        return [redis.Redis(port=self.server.port, socket_timeout=10)]


class ClusterRedis(Backend):
    """A three-master Redis Cluster (no proxy: clients follow MOVED to the nodes)."""

    name = "cluster"

    def __init__(self) -> None:
        self.cluster: RedisClusterServers | None = None

    def start(self, tmp: Path) -> None:
        self.cluster = RedisClusterServers(tmp / "cluster").start()

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()

    def spec(self, host: str, ns: str) -> SharedSpec:
        assert self.cluster is not None
        return SharedSpec(
            "redis",
            (("cluster", self.cluster.seeds), *_index_options(host, ns, self.timeout_s)),
            TRANSFORMS.get(host, ""),
        )

    def restart(self, persist: bool) -> None:
        assert self.cluster is not None
        for node in self.cluster.nodes:  # every master: the index's slot and the buckets'
            _restart_node(node, persist)
        _wait_cluster_ok(self.cluster)

    def flushall(self) -> None:
        assert self.cluster is not None
        for node in self.cluster.nodes:
            redis.Redis(port=node.port).flushall()

    def nodes(self) -> list[redis.Redis]:
        assert self.cluster is not None
        return [redis.Redis(port=n.port, socket_timeout=10) for n in self.cluster.nodes]


def _wait_cluster_ok(cluster: RedisClusterServers) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if all(
                redis.Redis(port=n.port).cluster("info").get("cluster_state") == "ok"
                for n in cluster.nodes
            ):
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise RuntimeError("Redis Cluster did not come back to cluster_state:ok")


class MooncakeBackend(SingleRedis):
    """A Mooncake master and metadata server for the payloads, one redis-server for the
    index (each host through its own fault proxy). Inside a private network namespace
    only (``tests/remote/test_mooncake.py``)."""

    name = "mooncake"

    def __init__(self) -> None:
        super().__init__()
        self.master: object = None

    def start(self, tmp: Path) -> None:
        from kvlife.tiers.mooncake.server import MooncakeMaster

        super().start(tmp)
        self.master = MooncakeMaster(tmp / "mooncake").start()

    def stop(self) -> None:
        super().stop()
        if self.master is not None:
            self.master.stop()  # type: ignore[attr-defined]

    def spec(self, host: str, ns: str) -> SharedSpec:
        m = self.master
        url = f"redis://127.0.0.1:{self._proxy(host).port}/0"
        return SharedSpec(
            "mooncake",
            (
                ("master", m.master),  # type: ignore[attr-defined]
                ("metadata", m.metadata),  # type: ignore[attr-defined]
                ("index", url),
                ("segment_bytes", 32 << 20),
                *_index_options(host, ns, self.timeout_s),
            ),
            TRANSFORMS.get(host, ""),
        )


BACKENDS: dict[str, Callable[[], Backend]] = {
    "redis": SingleRedis,
    "cluster": ClusterRedis,
    "mooncake": MooncakeBackend,
}


# ---------------------------------------------------------------------- the run


@dataclass(slots=True)
class Outcome:
    findings: list[Finding] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    steps_run: int = 0
    served_chunks: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Typed errors the steps met (allowed outcomes: a refused publish, an unreachable
    index), by step kind and error type."""
    checks: dict[str, int] = field(default_factory=dict)
    """Liveness checks made, by kind and result (``handoff:ok``, ``handoff:skipped``,
    ``durable:ok``, ``race:refused``, ...)."""

    def count(self, what: str, n: int = 1) -> None:
        self.checks[what] = self.checks.get(what, 0) + n

    def summary(self) -> str:
        checks = ", ".join(f"{k} {v}" for k, v in sorted(self.checks.items()))
        return (
            f"{self.steps_run} steps, {self.served_chunks} chunks served, "
            f"{len(self.findings)} findings; checks: {checks or 'none'}"
        )


HANDOFF_S = 5.0
"""How long a handoff may take before the target's failure to serve is a finding (a
host in an index backoff waits up to 2 s)."""
MUST_S = 3.0
"""How long a get that must serve is retried."""
RACE_S = 0.2
"""How long a revoked host keeps trying to publish after the revocation returned
(less than the shortest ban a race uses)."""
WRONG_BUCKETS = 8
"""The bucket count of a misconfigured host (the others use the default, 16)."""


class World:
    """Servers, hosts and the oracle of one run."""

    def __init__(self, tmp: Path, backend: Backend, cast: Cast) -> None:
        self.tmp = tmp
        self.backend = backend
        self.cast = cast
        self.ns = "m" + uuid.uuid4().hex[:10]
        self.shm_dir = Path(
            tempfile.mkdtemp(
                prefix="kvl-mh-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
            )
        )
        self.hosts: dict[str, Host] = {}
        self.looked: dict[str, tuple[Looked, Served]] = {}
        self.faulted: dict[str, tuple[int, str]] = {}
        """Hosts under a fault: the step at which it heals, and its kind."""
        self.pending: dict[str, Version] = {}
        """The version of each host's pending put."""
        self.oracle = Oracle(key_infos(), sorted(set(TRANSFORMS.values())))
        self.vids = itertools.count(1)
        self.fresh = itertools.count(FRESH)
        self.out = Outcome()
        self.n = 0

    def __enter__(self) -> World:
        self.backend.start(self.tmp)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hosts.values():
            with contextlib.suppress(Exception):
                h.close(clean=False)
        self.backend.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def host(self, name: str) -> Host:
        h = self.hosts.get(name)
        if h is None:
            spec = self.backend.spec(name, self.ns)
            if name in self.cast.served:
                h = ServedHost(name, self.tmp / name, spec, self.shm_dir)
            else:
                h = InProcessHost(name, self.tmp / name, spec, disk=name in self.cast.disk)
            self.hosts[name] = h
        if not h.is_open:
            h.open()
            self.looked.pop(name, None)
            # a host joins the index with a lookup (it reads the index's state)
            p = PROMPTS[0]
            try:
                joined = h.lookup(p.identity(), p.ns, JOIN_TOKENS, lossy=False)
                if joined.read_index:
                    self.oracle.read(name, h.incarnation, self.n)
            except KVLifeError as exc:
                self.out.findings.append(self.oracle.raised(self.n, name, 0, "join", exc))
        return h

    def in_process(self, name: str) -> InProcessHost:
        h = self.host(name)
        assert isinstance(h, InProcessHost)
        return h

    def partitioned(self, name: str) -> bool:
        return name in self.faulted and self.faulted[name][1] == "partition"

    def heal(self, name: str) -> None:
        if self.faulted.pop(name, None) is not None:
            self.backend.set_fault(name, Fault.none())

    # ------------------------------------------------------------------ steps

    def run(self, steps: Sequence[Step], stop_at_first: bool = False) -> Outcome:
        out = self.out = Outcome()
        for n, step in enumerate(steps):
            self.n = n
            for host, (until, _) in list(self.faulted.items()):
                if until <= n:  # a fault lasts its span of steps, then heals
                    self.heal(host)
            t0 = time.monotonic()
            try:
                note = self.step(n, step, out)
            except KVLifeError as exc:
                key = f"{step.kind}:{type(exc).__name__}"
                out.errors[key] = out.errors.get(key, 0) + 1
                note = f"{type(exc).__name__}: {str(exc)[:120]}"
                if step.kind in ("lookup", "get", "load", "request", "recall"):
                    out.findings.append(
                        self.oracle.raised(n, step.host, step.prompt, step.kind, exc)
                    )
                if step.kind in ("inv_global", "inv_index"):
                    self.oracle.unknown_rule(n)  # recorded or not, applied here or not
            except Exception as exc:  # a bug: reported, and the run goes on
                out.findings.append(
                    Finding(
                        "bug",
                        f"{step.kind}-crashed",
                        n,
                        step.host,
                        step.prompt,
                        -1,
                        f"{type(exc).__name__}: {exc}",
                    )
                )
                note = f"BUG {type(exc).__name__}: {exc}"
            out.log.append(f"{n:4d} {step} -> {note} ({(time.monotonic() - t0) * 1000:.0f} ms)")
            out.steps_run = n + 1
            if stop_at_first and out.findings:
                break
        return out

    def _version(self, h: Host, p: int, n: int) -> tuple[Version, np.ndarray]:
        """A new version of prompt ``p`` computed on ``h`` at step ``n``."""
        vid = next(self.vids)
        kv = version_kv(vid)
        keys = prompt_keys(p)
        chunks = {k: chunk_of(kv, i) for i, k in enumerate(keys)}
        return self.oracle.created(vid, h.name, h.incarnation, p, n, chunks, time.monotonic()), kv

    def _put(self, h: Host, p: int, n: int) -> Version:
        v, kv = self._version(h, p, n)
        pr = prompt_of(p)
        v.stored = h.put(pr.identity(), pr.ns, pr.tokens(), kv)
        v.committed = n
        return v

    def _lookup(self, h: Host, p: int, n: int, lossy: bool) -> tuple[Looked, Served]:
        pr = prompt_of(p)
        t = time.monotonic()
        looked = h.lookup(pr.identity(), pr.ns, pr.tokens(), lossy)
        if looked.read_index:
            self.oracle.read(h.name, h.incarnation, n)
        served = Served(
            h.name,
            h.incarnation,
            n,
            t,
            p,
            [x.key for x in looked.hits],
            [x.tier for x in looked.hits],
            [x.exactness for x in looked.hits],
            lossy,
        )
        return looked, served

    def step(self, n: int, s: Step, out: Outcome) -> str:
        o = self.oracle
        if s.kind == "put":
            v = self._put(self.host(s.host), s.prompt, n)
            return f"put {v.vid}: stored {v.stored}"
        if s.kind == "begin":
            h = self.host(s.host)
            if h.pending is not None:
                return "a put is pending already"
            v, kv = self._version(h, s.prompt, n)
            pr = PROMPTS[s.prompt]
            h.begin(pr.identity(), pr.ns, pr.tokens(), kv)
            self.pending[h.name] = v
            return f"begun {v.vid}"
        if s.kind in ("commit", "abort"):
            h = self.host(s.host)
            if h.pending is None:
                return "nothing pending"
            v = self.pending.pop(h.name)
            if s.kind == "abort":
                v.aborted = n
                h.abort()
                return f"aborted {v.vid}"
            try:
                v.stored = h.commit()
            except KVLifeError:
                v.aborted = n
                raise
            v.committed = n
            return f"committed {v.vid}: stored {v.stored}"
        if s.kind == "flush":
            h = self.host(s.host)
            done = h.flush()
            o.flushed(h.name, h.incarnation, n)
            return f"flushed {done}"
        if s.kind in ("lookup", "get"):
            h = self.host(s.host)
            looked, served = self._lookup(h, s.prompt, n, s.lossy)
            if s.kind == "lookup":
                self.looked[h.name] = (looked, served)
                out.findings += o.check(served, claims=True)  # nothing loaded yet
                return f"{len(looked.hits)} hits {_tiers(served.tiers)}"
            note = self._load(h, looked, served, out)
            return note + self._must_serve(h, s, n, served, out)
        if s.kind == "recall":
            h = self.host(s.host)
            mine = [v for v in o.versions if v.host == h.name and v.durable is not None]
            if not mine:
                return "nothing made durable yet"
            p = max(mine, key=lambda v: v.created).prompt
            looked, served = self._lookup(h, p, n, s.lossy)
            note = self._load(h, looked, served, out)
            return f"prompt {p}: {note}" + self._must_serve(
                h, Step("get", h.name, p, s.lossy), n, served, out
            )
        if s.kind == "request":
            h = self.host(s.host)
            looked, served = self._lookup(h, s.prompt, n, s.lossy)
            note = self._load(h, looked, served, out)
            if len(served.arrays) == CHUNKS:
                return note
            try:  # the engine computed the rest (a put may fail: an allowed outcome)
                v = self._put(h, s.prompt, n)
            except KVLifeError as exc:
                key = f"request-put:{type(exc).__name__}"
                out.errors[key] = out.errors.get(key, 0) + 1
                return f"{note}; put {type(exc).__name__}: {str(exc)[:100]}"
            return f"{note}; put {v.vid}: stored {v.stored}"
        if s.kind == "load":
            h = self.host(s.host)
            kept = self.looked.pop(h.name, None)
            if kept is None or kept[0].incarnation != h.incarnation:
                return "no lookup to load"
            looked, served = kept
            served.load_step = n
            return self._load(h, looked, served, out, claims=False)
        if s.kind == "inv_global":
            h = self.host(s.host)
            crit = s.criteria()
            o.bad_rules_tried += crit.raw_namespace is not None
            removed = h.invalidate(crit)
            o.rule(n, crit)
            o.read(h.name, h.incarnation, n)
            return f"removed {removed} here"
        if s.kind == "inv_index":
            h = self.in_process(s.host)
            crit = s.criteria()
            o.bad_rules_tried += crit.raw_namespace is not None
            epoch = h.record_rule(crit)
            o.rule(n, crit)
            o.read(h.name, h.incarnation, n)
            return f"epoch {epoch}"
        if s.kind == "revoke":
            token = self.in_process(s.host).revoke(s.target, s.ban_ms)
            o.revoked(n, s.target, time.monotonic(), s.ban_ms)
            return f"token {token}"
        if s.kind == "revoke_race":
            return self._race(n, s, out)
        if s.kind == "expire":
            self.host(s.host)
            time.sleep(LEASE_TTL_MS / 1000 + 0.05)
            return "lease lapsed"
        if s.kind == "restart":
            h = self.host(s.host)
            if h.name in self.pending:
                self.pending.pop(h.name).aborted = n  # closing aborts a pending put
            before = h.incarnation
            note = ""
            try:
                h.close(s.clean)
                if s.clean:
                    o.flushed(h.name, before, n)
            except KVLifeError as exc:  # closed all the same; what was flushed is unknown
                note = f" (close: {type(exc).__name__})"
            self.host(s.host)
            return f"incarnation {h.incarnation}{note}"
        if s.kind == "redis_restart":
            self.backend.restart(s.persist)
            if not s.persist:
                o.wiped(n)
            return "restarted" + (" with its data" if s.persist else " empty")
        if s.kind == "flushall":
            self.backend.flushall()
            o.wiped(n)
            return "flushed all"
        if s.kind == "fault":
            if not self.backend.faults:
                return "no faults on this backend"
            self.host(s.host)
            fault = {"partition": Fault.partition(), "delay": Fault.delay(DELAY_S)}[s.fault]
            self.backend.set_fault(s.host, fault)
            self.faulted[s.host] = (n + 1 + s.span, s.fault)
            return f"{s.fault} for {s.span} steps"
        if s.kind == "handoff":
            return self._handoff(n, s, out)
        if s.kind == "mismatch":
            return self._mismatch(n, s, out)
        if s.kind == "wait":
            time.sleep(s.ms / 1000)
            return f"waited {s.ms} ms"
        raise AssertionError(f"unknown step {s.kind}")

    def _load(
        self, h: Host, looked: Looked, served: Served, out: Outcome, claims: bool = True
    ) -> str:
        served.load_t = time.monotonic()
        served.arrays = h.load(looked)
        out.served_chunks += len(served.arrays)
        found = self.oracle.check(served, claims)
        out.findings += found
        return f"{len(looked.hits)} hits {_tiers(served.tiers)}, loaded {len(served.arrays)}" + (
            " !" if found else ""
        )

    # ------------------------------------------------------------------ liveness

    def _must_serve(self, h: Host, s: Step, n: int, served: Served, out: Outcome) -> str:
        """A get that must serve every chunk (``must``), or a version a host with a disk
        tier made durable (the oracle's :meth:`~Oracle.durable`): retried while it
        falls short (an index backoff is no loss), a finding if it still does."""
        keys = prompt_keys(s.prompt)
        durable = None
        if h.name in self.cast.disk and not self.partitioned(h.name):
            durable = self.oracle.durable(h.name, s.prompt, keys, n)
        if not s.must and durable is None:
            return ""
        deadline = time.monotonic() + MUST_S

        def short(sv: Served) -> str:
            if len(sv.arrays) < len(keys):
                return f"served {len(sv.arrays)} of {len(keys)} chunks"
            if durable is not None and not s.lossy:
                for k, a in zip(keys, sv.arrays, strict=True):
                    if not np.array_equal(a, durable.chunks[k]):
                        return f"served other bytes than put {durable.vid}"
            return ""

        why = short(served)
        tries = 1
        while why and time.monotonic() < deadline:
            time.sleep(0.1)
            looked, again = self._lookup(h, s.prompt, n, s.lossy)
            self._load(h, looked, again, out)
            why = short(again)
            tries += 1
        what = "durable" if durable is not None else "must"
        if not why:
            out.count(f"{what}:ok")
            return f"; {what} ok" + (f" after {tries} tries" if tries > 1 else "")
        if durable is not None:
            detail = (
                f"put {durable.vid} (created at step {durable.created}, durable at step "
                f"{durable.durable}, incarnation {durable.incarnation}; host now at "
                f"{h.incarnation}): {why} after {tries} tries"
            )
            out.findings.append(Finding("item6", "lost", n, h.name, s.prompt, -1, detail))
        else:
            out.findings.append(
                Finding(
                    "liveness", "not-served", n, h.name, s.prompt, -1, f"{why} after {tries} tries"
                )
            )
        out.count(f"{what}:failed")
        return f"; {what} FAILED ({why})"

    def _handoff(self, n: int, s: Step, out: Outcome) -> str:
        """``s.host`` publishes a fresh prompt (lookup, put, flush: no rule selects it),
        then ``s.target`` must serve it, lossy allowed (from the shared tier: it never
        had it). Faults on both end first; a publish that fails (a ban, an index
        backoff, Mooncake refusing a put) is retried with another fresh prompt. A
        finding when two publishes succeeded and the target served neither within
        :data:`HANDOFF_S`."""
        x, y = self.host(s.host), self.host(s.target)
        if x.name in self.cast.disk or x.name == y.name:
            return "no handoff from a host with a disk tier (it flushes to disk)"
        self.heal(x.name)
        self.heal(y.name)
        deadline = time.monotonic() + HANDOFF_S
        published = 0
        why = ""
        while time.monotonic() < deadline:
            p = next(self.fresh)
            self.oracle.know(key_infos([p]))
            try:
                self._lookup(x, p, n, lossy=False)
                v = self._put(x, p, n)
                x.flush()
                self.oracle.flushed(x.name, x.incarnation, n)
            except KVLifeError as exc:
                why = f"{x.name} could not publish: {type(exc).__name__}: {str(exc)[:100]}"
                time.sleep(0.1)
                continue
            published += 1
            until = min(deadline, time.monotonic() + HANDOFF_S / 3)
            while True:
                try:
                    looked, served = self._lookup(y, p, n, lossy=True)
                    self._load(y, looked, served, out)
                except KVLifeError as exc:
                    out.findings.append(self.oracle.raised(n, y.name, p, "handoff", exc))
                    return f"{y.name} raised {type(exc).__name__}"
                if len(served.arrays) == CHUNKS:
                    out.count("handoff:ok")
                    return f"put {v.vid} by {x.name} served by {y.name} ({_tiers(served.tiers)})"
                why = f"{y.name} served {len(served.arrays)} of {CHUNKS} chunks of put {v.vid}"
                if time.monotonic() >= until:
                    break
                time.sleep(0.1)
        if published >= 2:
            out.count("handoff:failed")
            out.findings.append(
                Finding(
                    "liveness",
                    "no-handoff",
                    n,
                    y.name,
                    -1,
                    -1,
                    f"{x.name} published {published} fresh prompts, {why}",
                )
            )
            return f"handoff FAILED: {why}"
        out.count("handoff:skipped")
        return f"handoff skipped: {why}"

    def _race(self, n: int, s: Step, out: Outcome) -> str:
        """``s.target`` publishes fresh prompts on a thread of its own while ``s.host``
        revokes it with a ban (issue 29 item 7): once ``revoke`` returned, no record of
        the target may appear or change in the index during the ban, whatever the
        target had in flight."""
        issuer = self.in_process(s.host)
        target = self.in_process(s.target)
        stop = threading.Event()
        tally = {"published": 0, "refused": 0}

        def racer() -> None:
            while not stop.is_set():
                p = next(self.fresh)
                self.oracle.know(key_infos([p]))
                try:
                    self._put(target, p, n)
                    target.flush()
                    tally["published"] += 1
                except KVLifeError:
                    tally["refused"] += 1

        th = threading.Thread(target=racer, name=f"racer-{target.name}", daemon=True)
        th.start()
        time.sleep(s.ms / 1000)  # let a few publishes through first
        try:
            issuer.revoke(target.name, s.ban_ms)
        except BaseException:
            stop.set()
            th.join(30)
            raise
        returned = time.monotonic()
        self.oracle.revoked(n, target.name, returned, s.ban_ms)
        before = self._records_of(target.name)
        time.sleep(RACE_S)
        stop.set()
        th.join(30)
        assert not th.is_alive(), "the racing publisher did not stop"
        after = self._records_of(target.name)
        late = sorted(k for k, blob in after.items() if before.get(k) != blob)
        if late and time.monotonic() < returned + s.ban_ms / 1000:
            out.findings.append(
                Finding(
                    "item7",
                    "published-after-revoke",
                    n,
                    target.name,
                    -1,
                    -1,
                    f"{len(late)} records of {target.name} appeared or changed after its "
                    f"revocation (ban {s.ban_ms} ms) returned, e.g. {late[0][:60]!r}",
                )
            )
        out.count("race:runs")
        out.count("race:published", tally["published"])
        out.count("race:refused", tally["refused"])
        return (
            f"revoked {target.name} while it published: {tally['published']} flushes "
            f"through, {tally['refused']} refused, {len(late)} records after"
        )

    def _records_of(self, host: str) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for name, blob in self.backend.records(self.ns).items():
            try:
                rec = RemoteRecord.decode(blob)
            except RecordError:
                continue
            if rec.host == host:
                out[name] = blob
        return out

    def _mismatch(self, n: int, s: Step, out: Outcome) -> str:
        """A host configured with another bucket count joins (after ``s.host`` made sure
        the index exists) and tries a lookup, a put, a flush and an invalidation: each is
        refused with a typed error or harmless; it serves nothing, publishes nothing
        another host serves (the oracle's ``mismatch-published``) and records no rule."""
        h = self.host(s.host)  # a well configured host reads (so creates) the index
        p0 = PROMPTS[0]
        h.lookup(p0.identity(), p0.ns, JOIN_TOKENS, lossy=False)
        if not self.backend.index_exists(self.ns):  # it could not: the misconfigured
            return "no index to join"  # host would create it with its count (docs)
        name = f"m{n}"
        spec = self.backend.spec(name, self.ns)
        wrong = SharedSpec(spec.kind, (*spec.options, ("buckets", WRONG_BUCKETS)))
        m = InProcessHost(name, self.tmp / name, wrong)
        self.oracle.misconfigured.add(name)
        rules = self.backend.rule_count(self.ns)
        refused: list[str] = []
        try:
            m.open()
        except KVLifeError as exc:
            return f"{name} could not open: {type(exc).__name__}"
        pr = PROMPTS[s.prompt]
        try:
            for what in ("lookup", "put", "flush", "invalidate"):
                try:
                    if what == "lookup":
                        looked, served = self._lookup(m, s.prompt, n, lossy=True)
                        self._load(m, looked, served, out)
                        if served.arrays:
                            out.findings.append(
                                Finding(
                                    "mismatch",
                                    "mismatch-served",
                                    n,
                                    name,
                                    s.prompt,
                                    -1,
                                    f"served {len(served.arrays)} chunks without reading the index",
                                )
                            )
                    elif what == "put":
                        self._put(m, s.prompt, n)
                    elif what == "flush":
                        m.flush()
                    else:
                        m.invalidate(Criteria(namespace=pr.ns))
                        self.oracle.rule(n, Criteria(namespace=pr.ns))
                except KVLifeError as exc:
                    refused.append(f"{what}: {type(exc).__name__}")
        finally:
            with contextlib.suppress(KVLifeError):
                m.close(clean=False)
        if self.backend.rule_count(self.ns) != rules and "invalidate" in " ".join(refused):
            self.oracle.unknown_rule(n)
            out.findings.append(
                Finding(
                    "mismatch",
                    "mismatch-recorded",
                    n,
                    name,
                    s.prompt,
                    -1,
                    "an invalidation refused with an error was recorded in the index all the same",
                )
            )
        out.count("mismatch:runs")
        return f"{name} (buckets={WRONG_BUCKETS}) refused: {', '.join(refused) or 'nothing'}"


def _tiers(tiers: list[str]) -> str:
    return "".join(t[0] for t in tiers)


@contextlib.contextmanager
def world(
    backend: str = "redis",
    cast: Cast = DEFAULT_CAST,
    tmp: Path | None = None,
    timeout_s: float = SOCKET_TIMEOUT_S,
) -> Iterator[World]:
    with contextlib.ExitStack() as stack:
        if tmp is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvl-mh-")))
        servers = BACKENDS[backend]()
        servers.timeout_s = timeout_s
        with World(tmp, servers, cast) as w:
            yield w


def run_schedule(
    steps: Sequence[Step],
    backend: str = "redis",
    cast: Cast = DEFAULT_CAST,
    stop_at_first: bool = False,
) -> Outcome:
    with world(backend, cast) as w:
        return w.run(steps, stop_at_first)


def labels(out: Outcome) -> set[str]:
    return {f.label for f in out.findings}


# ---------------------------------------------------------------------- shrinking


def shrink(
    steps: list[Step],
    label: str,
    backend: str = "redis",
    cast: Cast = DEFAULT_CAST,
    log: Callable[[str], None] = print,
) -> list[Step]:
    """A smaller schedule that still yields a finding labelled ``label`` (delta
    debugging: drop chunks of steps, halving the chunk size down to single steps)."""

    def fails(cand: list[Step]) -> bool:
        out = run_schedule(cand, backend, cast, stop_at_first=False)
        return label in labels(out)

    out = run_schedule(steps, backend, cast)
    hits = [f.step for f in out.findings if f.label == label]
    if not hits:
        raise ValueError(f"the schedule yields no {label} finding")
    cur = list(steps[: hits[0] + 1])
    # first, whole classes of steps at once: the server processes (slow to start),
    # then the steps that only let time pass or slow things down
    drops: list[Callable[[Step], bool]] = [
        lambda st: st.host in cast.served or st.target in cast.served,
        lambda st: st.kind in ("expire", "fault", "wait"),
    ]
    for drop in drops:
        cand = [st for st in cur if not drop(st)]
        if len(cand) < len(cur) and cand and fails(cand):
            cur = cand
            log(f"  {len(cur)} steps")
    size = max(1, len(cur) // 2)
    while True:
        i = 0
        changed = False
        while i < len(cur):
            cand = cur[:i] + cur[i + size :]
            if cand and fails(cand):
                cur = cand
                changed = True
                log(f"  {len(cur)} steps")
            else:
                i += size
        if size == 1 and not changed:
            return cur
        size = max(1, size // 2)


# ---------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.remote.multihost_run")
    ap.add_argument("what", choices=["run", "shrink", "replay"])
    ap.add_argument("schedule", nargs="?", help="replay: the schedule's JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", default="redis", choices=sorted(BACKENDS))
    ap.add_argument("--label", default="")
    ap.add_argument("--log", action="store_true", help="print every step")
    ap.add_argument("--without", default="", help="step kinds to leave out, comma-separated")
    args = ap.parse_args(argv)
    cast = CASTS[args.backend]
    if args.what == "replay":
        steps = loads(args.schedule)
    else:
        steps = generate(args.seed, args.steps, cast, [k for k in args.without.split(",") if k])
    if args.what == "shrink":
        small = shrink(steps, args.label, args.backend, cast)
        print(dumps(small))
        steps = small
    t0 = time.monotonic()
    out = run_schedule(steps, args.backend, cast)
    if args.log or args.what != "run":
        print("\n".join(out.log))
    took = time.monotonic() - t0
    print(f"{out.summary()}; {took:.1f} s")
    print(f"typed errors met: {out.errors}")
    for f in out.findings:
        print(f)
    return 1 if out.findings else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # FaultProxy.stop leaves its connections' pump tasks pending: asyncio says so at exit
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.exit(main())
