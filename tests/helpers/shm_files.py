"""Files as dead servers leave them in a shared-memory directory (the stale-arena
sweep's tests): the pid of a process that ran and was reaped, files, and files aged
past the sweep's grace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvlife.server.stale_arenas import GRACE_S


def dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def age(*paths: Path, seconds: float = 2 * GRACE_S) -> None:
    """Set the paths' times ``seconds`` back (a link's own, not its target's)."""
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then), follow_symlinks=False)


def write_file(path: Path, data: bytes = b"\1" * 4096) -> Path:
    path.write_bytes(data)
    return path
