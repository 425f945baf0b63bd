"""A real ``kvlife serve`` whose frame loads (:mod:`kvlife.store.frame_loads`) can be
parked at one point, for tests/attack/test_frame_loads_attack.py.

The server is this checkout's ``kvlife serve``, started through :func:`serve` below:
the same CLI, with one hook installed first. A test arms the gate (a file in a
directory named by the environment) with a point, ``start`` (a load found its chunks
under the store's lock; its frame reads have not begun) or ``wait`` (the reads are
done, the publication has not begun); the next frame load that reaches that point
parks there until the test releases it. One load parks per arming: a second client's
loads meanwhile run through. Nothing else in the server is changed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from tests.server.conftest import ROOT, ServerProc, child_env

GATE_ENV = "KVLIFE_TEST_FRAME_GATE"
Point = Literal["start", "wait"]


def _park(point: str) -> None:
    """In the server: park here if the gate is armed for ``point`` (one load per arming)."""
    gate = Path(os.environ[GATE_ENV])
    arm = gate / f"arm-{point}"
    try:
        arm.unlink()  # exactly one load takes an arming
    except FileNotFoundError:
        return
    go = gate / "go"
    (gate / "parked").write_text(point)
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    (gate / "parked").unlink(missing_ok=True)
    go.unlink(missing_ok=True)  # last: the test's release() returns once it is gone


def serve() -> None:  # pragma: no cover - runs in the server process
    """``python -c 'from tests.attack.frame_loads_rig import serve; serve()' serve ...``"""
    from kvlife import cli
    from kvlife.native import frames as native
    from kvlife.results import LoadResult
    from kvlife.store.frame_loads import FrameLoad

    start_direct = native.start_direct

    def parked_start(frames: list[native.DirectFrame], depth: int) -> native.DirectRun:
        _park("start")
        return start_direct(frames, depth)

    wait = FrameLoad.wait

    def parked_wait(self: FrameLoad, timeout: float | None = None) -> LoadResult:
        if getattr(self, "_result", None) is None:
            _park("wait")
        return wait(self, timeout)

    native.start_direct = parked_start  # type: ignore[assignment]
    FrameLoad.wait = parked_wait  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))


class GatedServer(ServerProc):
    """A :class:`ServerProc` started through :func:`serve`, with its gate directory."""

    def __init__(self, path: Path, gate: Path, *, promote: bool, dram: int, disk: int) -> None:
        extra = ("--write-through",) if promote else ("--write-through", "--no-promote")
        super().__init__(path, dram=dram, disk=disk, staging=dram, extra=extra)
        self.gate = gate
        gate.mkdir(parents=True, exist_ok=True)

    def start(self) -> GatedServer:
        self.pid_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-c",
            "from tests.attack.frame_loads_rig import serve; serve()",
            "serve",
            str(self.path),
            "--socket",
            str(self.socket),
            "--pid-file",
            str(self.pid_file),
            *self.args,
        ]
        env = child_env()
        env[GATE_ENV] = str(self.gate)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=log)
        deadline = time.monotonic() + 60
        while not self.pid_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlife serve exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvlife serve did not start: {self.log.read_text()}")
            time.sleep(0.02)
        return self

    def arm(self, point: Point) -> None:
        """The next frame load to reach ``point`` parks there."""
        for stale in ("go", "parked"):  # left by a server killed at the gate
            (self.gate / stale).unlink(missing_ok=True)
        (self.gate / f"arm-{point}").write_text("")

    def parked(self, timeout: float = 30.0) -> None:
        """Wait until a load parks (AssertionError if none does in ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not (self.gate / "parked").exists():
            assert self.proc is not None and self.proc.poll() is None, "the server died"
            assert time.monotonic() < deadline, "no frame load parked at the gate"
            time.sleep(0.002)

    def release(self) -> None:
        """Let the parked load go on; returns once it has left the gate."""
        go = self.gate / "go"
        go.write_text("")
        deadline = time.monotonic() + 30
        while go.exists():
            assert self.proc is not None and self.proc.poll() is None, "the server died"
            assert time.monotonic() < deadline, "the parked load did not leave the gate"
            time.sleep(0.002)

    def disarm(self) -> None:
        for p in ("arm-start", "arm-wait"):
            (self.gate / p).unlink(missing_ok=True)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def tasks(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))


@contextlib.contextmanager
def gated_server(root: Path, *, dram: int, disk: int) -> Iterator[GatedServer]:
    """A started gated, write-through, non-promoting server in ``root`` (its store and
    gate there), disarmed and stopped after."""
    srv = GatedServer(root / "store", root / "gate", promote=False, dram=dram, disk=disk)
    srv.start()
    try:
        yield srv
    finally:
        srv.disarm()
        srv.stop()
