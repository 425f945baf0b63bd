"""Real Redis servers for tests and benchmarks: ``redis-server`` processes bound to
127.0.0.1 on free ports, with no persistence, stopped by PID (never by name)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvlife.core.errors import KVLifeError


class ServerError(KVLifeError):
    """A test server could not be started (missing binary, port, timeout)."""


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port (``cluster_bus``: also port + 10000, as a cluster node needs)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus:
            return port
        if port > 55535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise ServerError("no free loopback port found")


def wait_port(
    port: int, timeout_s: float = 10.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise ServerError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise ServerError("redis-server not found: apt-get install redis-server")
    return path


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 (``cluster=True``: a cluster-enabled node)."""

    def __init__(self, workdir: Path, port: int = 0, *, cluster: bool = False) -> None:
        self.port = port or free_port(cluster_bus=cluster)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        args = [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.dir / "log"),
            "--proto-max-bulk-len",
            "1gb",
            "--client-output-buffer-limit",
            "normal 0 0 0",
        ]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.dir / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped server cannot exit
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


class RedisClusterServers:
    """Three (or ``masters``) cluster-enabled nodes joined into one Redis Cluster with
    ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(masters)]

    @property
    def seeds(self) -> str:
        return "cluster://" + ",".join(n.address for n in self.nodes)

    def start(self) -> RedisClusterServers:
        for n in self.nodes:
            n.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise ServerError("redis-cli not found: apt-get install redis-tools")
        out = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[n.address for n in self.nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise ServerError(
                f"redis-cli --cluster create failed: {out.stdout[-500:]}{out.stderr[-500:]}"
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            infos = [
                subprocess.run(
                    [cli, "-p", str(n.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                for n in self.nodes
            ]
            if all("cluster_state:ok" in i for i in infos):
                return self
            time.sleep(0.1)
        raise ServerError("Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
