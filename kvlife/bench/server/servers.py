"""The ``kvlife serve`` processes of ``kvlife bench server`` (stopped by PID), the tmpfs
their arenas live in, and the CPUs they and this process are pinned to."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvlife.bench.server.config import MiB, ServerBenchConfig
from kvlife.client import RemoteStore
from kvlife.server.server import MAX_SOCKET_PATH
from kvlife.tiers.shm import SHM_DIR


class BenchServer:
    """A ``kvlife serve`` child process, stopped by PID. Its socket is ``PATH.sock``
    beside the store, or in a short directory of its own where that path would be
    longer than a Unix socket path may be (a deep work directory: pytest's under
    pytest-xdist, a user's ``--dir``)."""

    def __init__(
        self,
        path: Path,
        dram: int,
        disk: int,
        shm: Path,
        *flags: str,
        launcher: Sequence[str] = ("-m", "kvlife.cli"),
    ) -> None:
        """``launcher``: how the child runs ``kvlife serve`` (its arguments follow; the
        stages bench starts it under its probes)."""
        self.socket = path.parent / f"{path.name}.sock"
        self._sockdir: Path | None = None
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH:
            self._sockdir = Path(tempfile.mkdtemp(prefix="kvb-"))
            self.socket = self._sockdir / "serve.sock"
        pid_file = path.parent / f"{path.name}.pid"
        cmd = [
            sys.executable, *launcher, "serve", str(path), "--socket", str(self.socket),
            "--pid-file", str(pid_file), "--dram-bytes", str(dram), "--disk-bytes", str(disk),
            "--staging-bytes", str(max(128 * MiB, dram // 2)), "--shm-dir", str(shm), *flags,
        ]  # fmt: skip
        log = path.parent / f"{path.name}.log"
        with log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stderr=err, env=child_env())
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvlife serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def client(self, direct_reads: bool = False) -> RemoteStore:
        return RemoteStore(self.socket, timeout=300, direct_reads=direct_reads)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._sockdir is not None:
            shutil.rmtree(self._sockdir, ignore_errors=True)


def child_env() -> dict[str, str]:
    """This kvlife first on the children's path (a checkout run without installing)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # kvlife/bench/server.py -> checkout
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextlib.contextmanager
def arena_dir(cfg: ServerBenchConfig, work: Path) -> Iterator[Path]:
    """The tmpfs the servers put their arenas in: the configured one, or a private one
    mounted ``huge=always`` (root only; unmounted after the run), else /dev/shm."""
    if cfg.shm_dir is not None or not cfg.huge or os.geteuid() != 0:
        yield cfg.shm_dir if cfg.shm_dir is not None else SHM_DIR
        return
    mnt = work / "shm"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "huge=always,size=4g,mode=0700", "kvlife-bench"]
    done = subprocess.run([*cmd, str(mnt)], capture_output=True, check=False)
    if done.returncode != 0:
        yield SHM_DIR
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def direct_ok(directory: Path) -> bool:
    probe = directory / "direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@contextlib.contextmanager
def pinned(cfg: ServerBenchConfig) -> Iterator[tuple[str, str]]:
    """(server CPUs, client CPUs) as --cpus lists, this process pinned to the client
    ones for the run; ("", "") when not pinning."""
    have = sorted(os.sched_getaffinity(0))
    if not cfg.pin or len(have) < 2:
        yield "", ""
        return
    os.sched_setaffinity(0, have[:-1])
    try:
        yield str(have[-1]), ",".join(map(str, have[:-1]))
    finally:
        os.sched_setaffinity(0, have)
