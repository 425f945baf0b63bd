"""The multi-host model's runner: a world of real servers (one redis-server, a Redis
Cluster, or a Mooncake master with its Redis index), hosts that join it on their first
step (in-process stores and ``kvlife serve`` processes, each reaching Redis through a
loopback fault proxy of its own where the backend allows), and the loop that runs a
schedule step by step, hands every served chunk to the oracle and collects findings.

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
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from kvlife.core.errors import KVLifeError
from kvlife.faults.proxy import Fault, FaultProxy
from kvlife.tiers.redis.server import RedisClusterServers, RedisServer
from tests.remote.multihost_api import Host, InProcessHost, Looked, ServedHost, SharedSpec
from tests.remote.multihost_oracle import Finding, Oracle, Served, Version
from tests.remote.multihost_schedule import (
    PROMPTS,
    Cast,
    Step,
    chunk_of,
    dumps,
    generate,
    key_infos,
    loads,
    prompt_keys,
    version_kv,
)

LEASE_TTL_MS = 1000
SOCKET_TIMEOUT_S = 0.25
DELAY_S = 0.005

TRANSFORMS = {"d": "int8", "s2": "int4"}
"""Hosts whose shared tier stores a lossy transform of the same keys."""

JOIN_TOKENS = np.random.default_rng(99).integers(0, 50_000, 64)
"""A prompt no step puts: the lookup a host joins with."""

DEFAULT_CAST = Cast(in_process=("a", "b", "c", "d"), served=("s1", "s2"), faults=True)


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
        self.faulted: dict[str, int] = {}
        """Hosts under a fault, and the step at which it heals."""
        self.pending: dict[str, Version] = {}
        """The version of each host's pending put."""
        self.oracle = Oracle(key_infos(), sorted(set(TRANSFORMS.values())))
        self.vids = itertools.count(1)
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
                h = InProcessHost(name, self.tmp / name, spec)
            self.hosts[name] = h
        if not h.is_open:
            h.open()
            self.looked.pop(name, None)
            # a host joins the index with a lookup (it reads the index's state)
            p = PROMPTS[0]
            try:
                h.lookup(p.identity(), p.ns, JOIN_TOKENS, lossy=False)
            except KVLifeError as exc:
                self.out.findings.append(self.oracle.raised(self.n, name, 0, "join", exc))
        return h

    def in_process(self, name: str) -> InProcessHost:
        h = self.host(name)
        assert isinstance(h, InProcessHost)
        return h

    # ------------------------------------------------------------------ steps

    def run(self, steps: Sequence[Step], stop_at_first: bool = False) -> Outcome:
        out = self.out = Outcome()
        for n, step in enumerate(steps):
            self.n = n
            for host, until in list(self.faulted.items()):
                if until <= n:  # a fault lasts its span of steps, then heals
                    del self.faulted[host]
                    self.backend.set_fault(host, Fault.none())
            t0 = time.monotonic()
            try:
                note = self.step(n, step, out)
            except KVLifeError as exc:
                key = f"{step.kind}:{type(exc).__name__}"
                out.errors[key] = out.errors.get(key, 0) + 1
                note = f"{type(exc).__name__}: {str(exc)[:120]}"
                if step.kind in ("lookup", "get", "load"):
                    out.findings.append(
                        self.oracle.raised(n, step.host, step.prompt, step.kind, exc)
                    )
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

    def step(self, n: int, s: Step, out: Outcome) -> str:
        o = self.oracle
        if s.kind in ("put", "begin"):
            h = self.host(s.host)
            if s.kind == "begin" and h.pending is not None:
                return "a put is pending already"
            pr = PROMPTS[s.prompt]
            vid = next(self.vids)
            kv = version_kv(vid)
            keys = prompt_keys(s.prompt)
            v = o.created(
                vid,
                h.name,
                h.incarnation,
                s.prompt,
                n,
                {k: chunk_of(kv, i) for i, k in enumerate(keys)},
                time.monotonic(),
            )
            if s.kind == "put":
                stored = h.put(pr.identity(), pr.ns, pr.tokens(), kv)
                v.committed = n
                return f"put {vid}: stored {stored}"
            h.begin(pr.identity(), pr.ns, pr.tokens(), kv)
            self.pending[h.name] = v
            return f"begun {vid}"
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
                stored = h.commit()
            except KVLifeError:
                v.aborted = n
                raise
            v.committed = n
            return f"committed {v.vid}: stored {stored}"
        if s.kind == "flush":
            done = self.host(s.host).flush()
            o.flushed(s.host, n)
            return f"flushed {done}"
        if s.kind in ("lookup", "get"):
            h = self.host(s.host)
            pr = PROMPTS[s.prompt]
            t = time.monotonic()
            looked = h.lookup(pr.identity(), pr.ns, pr.tokens(), s.lossy)
            served = Served(
                h.name,
                h.incarnation,
                n,
                t,
                s.prompt,
                [x.key for x in looked.hits],
                [x.tier for x in looked.hits],
                [x.exactness for x in looked.hits],
                s.lossy,
            )
            if s.kind == "lookup":
                self.looked[h.name] = (looked, served)
                out.findings += o.check(served, claims=True)  # nothing loaded yet
                return f"{len(looked.hits)} hits {_tiers(served.tiers)}"
            return self._load(h, looked, served, out)
        if s.kind == "load":
            h = self.host(s.host)
            kept = self.looked.pop(h.name, None)
            if kept is None or kept[0].incarnation != h.incarnation:
                return "no lookup to load"
            looked, served = kept
            served.load_step = n
            return self._load(h, looked, served, out, claims=False)
        if s.kind == "inv_local":
            h = self.host(s.host)
            crit = s.criteria()
            removed = h.invalidate_local(crit)
            o.rule(n, crit, h.name, h.incarnation)
            return f"removed {removed}"
        if s.kind == "inv_global":
            crit = s.criteria()
            epoch = self.in_process(s.host).invalidate_global(crit)
            o.rule(n, crit, None)
            return f"epoch {epoch}"
        if s.kind == "revoke":
            token = self.in_process(s.host).revoke(s.target, s.ban_ms)
            o.revoked(n, s.target, time.monotonic(), s.ban_ms)
            return f"token {token}"
        if s.kind == "expire":
            self.host(s.host)
            time.sleep(LEASE_TTL_MS / 1000 + 0.05)
            return "lease lapsed"
        if s.kind == "restart":
            h = self.host(s.host)
            if h.name in self.pending:
                self.pending.pop(h.name).aborted = n  # closing aborts a pending put
            h.close(s.clean)
            if s.clean:
                o.flushed(h.name, n)
            self.host(s.host)
            return f"incarnation {h.incarnation}"
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
            self.faulted[s.host] = n + 1 + s.span
            return f"{s.fault} for {s.span} steps"
        if s.kind == "wait":
            time.sleep(s.ms / 1000)
            return f"waited {s.ms} ms"
        raise AssertionError(f"unknown step {s.kind}")

    def _load(
        self, h: Host, looked: Looked, served: Served, out: Outcome, claims: bool = True
    ) -> str:
        served.arrays = h.load(looked)
        out.served_chunks += len(served.arrays)
        found = self.oracle.check(served, claims)
        out.findings += found
        return f"{len(looked.hits)} hits {_tiers(served.tiers)}, loaded {len(served.arrays)}" + (
            " !" if found else ""
        )


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
    cast = (
        DEFAULT_CAST
        if args.backend != "cluster"
        else Cast(DEFAULT_CAST.in_process, DEFAULT_CAST.served, False)
    )
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
    print(f"{out.steps_run} steps, {out.served_chunks} chunks served, {took:.1f} s")
    print(f"typed errors met: {out.errors}")
    for f in out.findings:
        print(f)
    return 1 if out.findings else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # FaultProxy.stop leaves its connections' pump tasks pending: asyncio says so at exit
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.exit(main())
