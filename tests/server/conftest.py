"""A real ``kvlife serve`` process per fixture, started with this checkout's kvlife and
stopped by its PID."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import StoreUnavailable

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class ServerProc:
    """``kvlife serve PATH`` in a child process (start, SIGTERM, SIGKILL, restart)."""

    def __init__(
        self,
        path: Path,
        *,
        dram: int = 8 * MiB,
        disk: int = 64 * MiB,
        staging: int = 4 * MiB,
        extra: tuple[str, ...] = (),
        default_socket: bool = False,
        nofile: int | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.nofile = nofile
        self.prefix = prefix
        """Words before the server's command (it must exec the rest: the PID is the
        server's), e.g. a private mount namespace's (:mod:`tests.server.direct_rig`)."""
        """RLIMIT_NOFILE of the server (soft and hard: it cannot raise it)."""
        self.default_socket = default_socket
        """Serve on ``PATH/serve.sock`` (no ``--socket``)."""
        self.socket = path / "serve.sock" if default_socket else path.parent / f"{path.name}.sock"
        self.pid_file = path.parent / f"{path.name}.pid"
        self.log = path.parent / f"{path.name}.log"
        self.args = [
            "--dram-bytes",
            str(dram),
            "--disk-bytes",
            str(disk),
            "--staging-bytes",
            str(staging),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProc:
        self.pid_file.unlink(missing_ok=True)
        cmd = [
            *self.prefix,
            sys.executable,
            "-m",
            "kvlife.cli",
            "serve",
            str(self.path),
            *(() if self.default_socket else ("--socket", str(self.socket))),
            "--pid-file",
            str(self.pid_file),
            *self.args,
        ]
        nofile = self.nofile

        def limit() -> None:  # in the child, before exec
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=child_env(), stderr=log, preexec_fn=limit
            )
        deadline = time.monotonic() + 60
        while not self.pid_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlife serve exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvlife serve did not start: {self.log.read_text()}")
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> int:
        """SIGTERM and wait; the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def client(self) -> RemoteStore:
        return RemoteStore(self.socket, timeout=30)

    def rss(self) -> tuple[int, int]:
        """(resident, peak resident) bytes of the server process."""
        fields = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]

    def alive(self) -> bool:
        assert self.proc is not None
        return self.proc.poll() is None


class ClientProc:
    """Another client process: runs ``code`` (Python; the socket path is
    ``sys.argv[1]``), which talks through its stdout lines and waits for stdin lines.
    The server charges its per-client budgets to each process, so a client that must not
    share this test process's budgets runs here."""

    def __init__(self, code: str, socket: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(socket)],
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self) -> str:
        """The next line it prints (AssertionError if it ends first)."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        assert out, f"the client process ended (status {self.proc.wait(timeout=60)})"
        return out.strip()

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        """Close its stdin (it ends) and wait; its exit status."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ClientProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(pred: object, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    assert callable(pred)
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def quiet(store: RemoteStore, sessions: int = 1) -> dict[str, Any]:
    """The server's state once only ``sessions`` connections remain and nothing is in
    flight (a killed client's cleanup runs when the server reads its end of stream)."""
    box: dict[str, Any] = {}

    def settled() -> bool:
        store.drain()
        box.update(store.server_state())
        return bool(box["sessions"] == sessions)

    wait_for(settled, what=f"{sessions} session(s) left")
    return box


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path / "store").start()
    yield srv
    srv.stop()


@pytest.fixture
def remote(server: ServerProc) -> Iterator[RemoteStore]:
    store = server.client()
    yield store
    with contextlib.suppress(StoreUnavailable):
        store.close()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for a module's tests, with a 16 KiB DRAM tier (a few chunks: evictions
    and disk hits come quickly)."""
    srv = ServerProc(tmp_path_factory.mktemp("module-server") / "srv", dram=16 << 10).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def module_client(module_server: ServerProc) -> Iterator[RemoteStore]:
    """A client of :func:`module_server`, shared by the module's tests."""
    remote = module_server.client()
    try:
        yield remote
    finally:
        remote.close()
