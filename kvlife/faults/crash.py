"""SIGKILL harness: run a writer in a child process, kill it at a chosen moment, read its log.

A process kill is the crash every store must survive: whatever the kernel accepted
(page cache included) stays, whatever the process held in memory is gone. The harness
has two sides.

Child side: ``python -m kvlife.faults.crash_child MODULE:FUNCTION STORE LOG [ARGS...]``
(see :mod:`kvlife.faults.crash_child`) logs ``start`` and calls the workload function
with the store path, an :class:`AckLog` and the remaining arguments. The workload opens
the store, logs ``ready``, and then works forever, writing one line per acknowledged
operation with :meth:`AckLog.ack` (fsynced before the operation counts as acknowledged,
so a kill never loses an acknowledgement) and other facts with :meth:`AckLog.line`.
:class:`DropLogSink` is an event sink that logs every key a tier drops, as it happens.

Parent side: :func:`start_child` starts the child, :meth:`CrashChild.wait_until` polls
its log until a condition holds (it has started, is ready, has done enough work),
:meth:`CrashChild.kill` SIGKILLs it and checks it died by the kill, and :func:`read_log`
parses the log (a torn last line is ignored). What the log says was acknowledged is what
the parent then demands from the reopened store.

Lines are ``kind arg arg ...`` separated by single spaces; kinds and their arguments are
the workload's own vocabulary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvlife.core.events import EventSink, LifecycleEvent
from kvlife.core.lifecycle import Move

CHILD_MODULE = "kvlife.faults.crash_child"


class CrashHarnessError(Exception):
    """The child did not behave as a crash test needs (it exited by itself, never got
    going, or died of something other than the kill). The message holds its stderr."""


class AckLog:
    """Append-only log written straight to the kernel (no user-space buffer), so a SIGKILL
    loses no line that :meth:`line` returned from."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def line(self, text: str) -> None:
        """Append one line (not fsynced: it survives a kill, not a power cut)."""
        if "\n" in text:
            raise ValueError(f"a log line holds no newline: {text!r}")
        os.write(self._fd, (text + "\n").encode())

    def ack(self, text: str) -> None:
        """Append one line and fsync the log: only then is the operation acknowledged."""
        self.line(text)
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class DropLogSink(EventSink):
    """Logs ``gone <key hex>`` for every object deleted and every replica evicted from
    ``tier``, as the event is emitted."""

    def __init__(self, log: AckLog, tier: str = "disk") -> None:
        self._log = log
        self._tier = tier

    def emit(self, event: LifecycleEvent) -> None:
        if event.kind == Move.DELETE.value or (
            event.kind == Move.EVICT.value and event.tier == self._tier
        ):
            self._log.line(f"gone {event.key}")


@dataclass(frozen=True, slots=True)
class LogLine:
    """One complete line of a child's log."""

    kind: str
    args: tuple[str, ...]

    @property
    def rest(self) -> str:
        """The arguments as they were written (after the kind)."""
        return " ".join(self.args)


def read_log(path: Path) -> list[LogLine]:
    """The complete lines of a child's log, in order ([] if there is no log yet).

    The text after the last newline is a line the kill tore (at most one), ignored.
    """
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[LogLine] = []
    for line in lines[:-1]:
        kind, _, rest = line.partition(" ")
        out.append(LogLine(kind, tuple(rest.split())))
    return out


@dataclass(slots=True)
class CrashChild:
    """A running crash child (see :func:`start_child`)."""

    proc: subprocess.Popen[bytes]
    log: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_until(
        self, done: Callable[[list[LogLine]], bool], timeout_s: float = 60.0, poll_s: float = 0.005
    ) -> list[LogLine]:
        """Poll the log until ``done(lines)``; raise :class:`CrashHarnessError` if the child
        exits first or the condition does not hold within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CrashHarnessError(
                    f"crash child exited by itself (rc {self.proc.returncode}):\n{self.stderr()}"
                )
            lines = read_log(self.log)
            if done(lines):
                return lines
            time.sleep(poll_s)
        raise CrashHarnessError(f"crash child did not get going within {timeout_s} s")

    def kill(self) -> int:
        """SIGKILL the child and reap it; returns its exit status (``-SIGKILL`` when the kill
        did it). A child that had already exited keeps its own status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def killed_by_signal(self) -> bool:
        return self.proc.returncode == -signal.SIGKILL


def start_child(
    workload: str,
    store: Path,
    log: Path,
    args: Sequence[str] = (),
    *,
    pythonpath: Sequence[Path] = (),
) -> CrashChild:
    """Start ``python -m kvlife.faults.crash_child workload store log *args``.

    ``workload`` names the function the child runs, ``"module:function"``; its module
    must be importable in the child (add its root to ``pythonpath``). The child's stderr
    goes to ``log`` + ``.stderr``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*(str(p) for p in pythonpath), *filter(None, [env.get("PYTHONPATH")])]
    )
    cmd = [sys.executable, "-m", CHILD_MODULE, workload, str(store), str(log), *args]
    stderr_path = log.parent / (log.name + ".stderr")
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    return CrashChild(proc, log, stderr_path)
