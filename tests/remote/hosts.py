"""Driving host processes (tests.remote.host) from a test: start, ask, stop by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class Host:
    """One host process with its own store directory."""

    def __init__(
        self, store_dir: Path, kind: str, options: dict[str, object], *, wait: bool = True
    ) -> None:
        """Start the host; with ``wait``, return once it said it is ready (else call
        :meth:`ready`: :func:`start_hosts` starts several at once that way)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.remote.host", str(store_dir), kind, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.id = ""
        if wait:
            self.ready()

    def ready(self) -> Host:
        """Wait for the host's hello (its store open)."""
        hello = self._line()
        assert hello.get("ready"), hello
        self.id = str(hello["host"])
        return self

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"host exited with {self.proc.wait(timeout=10)}")
        return dict(json.loads(line))

    def ask(self, op: str, **args: object) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def send(self, op: str, **args: object) -> None:
        """Send without waiting for the answer (``answer()`` takes it later)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        return self._line()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)


def start_hosts(
    store_dirs: dict[str, Path], kind: str, options: dict[str, object]
) -> dict[str, Host]:
    """One host per name, started side by side (each process imports and opens its store
    while the others do), returned once all are ready."""
    made = {name: Host(d, kind, options, wait=False) for name, d in store_dirs.items()}
    try:
        for h in made.values():
            h.ready()
    except BaseException:
        for h in made.values():
            h.stop()
        raise
    return made
