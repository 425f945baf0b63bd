"""Shared-memory files that dead servers left behind, found and removed.

A ``kvlife serve`` keeps its replicas in an arena file in shared memory
(``kvlife-<store>-<pid>``; a tenant's arena and a client's shared buffer add a suffix to
that name). A server that stops cleanly removes them; one that is killed (SIGKILL, the
OOM killer, a crash) cannot, and a tmpfs file holds its memory until someone removes it:
a test run that killed servers once left 15 GB of 24 in ``/dev/shm`` of dead servers'
arenas, and every later benchmark ran with that memory gone. A restart of the same store
removes its own (the store's lock proves no server of it lives); this module removes
every dead server's, whatever its store: a server sweeps its shared-memory directory
when it starts.

A family of files (one server's) is stale when all of these hold:

- nobody holds its arena's lock (:func:`~kvlife.tiers.shm.held`): a live server holds it
  from the arena's creation to its removal, and the kernel drops it when the server
  dies, however it dies;
- its pid is no live process here (a server of a kvlife from before the lock holds
  none; its pid tells it is alive);
- none of its files is younger than ``grace_s`` (a server in another pid namespace that
  shares the directory holds no lock for the instant between creating its arena and
  locking it).

A file that cannot be told (not ours to open) counts as held: the sweep never removes
what may be served.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.tiers.shm import held

NAME = re.compile(r"^(kvlife-[0-9a-f]{16})-([0-9]+)(?:-.+)?$")
"""A server's shared-memory file: its arena, a tenant's arena or a shared buffer."""

GRACE_S = 60.0
"""How old a dead server's files must be before a sweep removes them."""


@dataclass(slots=True)
class Swept:
    """What a sweep removed."""

    files: int = 0
    nbytes: int = 0
    """Memory the removed files held (allocated blocks)."""
    servers: list[int] = field(default_factory=list)
    """The dead servers' pids."""


def sweep(shm_dir: Path, grace_s: float = GRACE_S) -> Swept:
    """Remove the files of dead servers in ``shm_dir`` (nothing if it cannot be read)."""
    families: dict[tuple[str, int], list[Path]] = {}
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return Swept()
    for name in names:
        m = NAME.match(name)
        if m is not None:
            families.setdefault((m.group(1), int(m.group(2))), []).append(shm_dir / name)
    out = Swept()
    now = time.time()
    for (prefix, pid), files in sorted(families.items()):
        if _alive(pid) or held(shm_dir / f"{prefix}-{pid}"):
            continue
        sizes = [_size_if_old(f, now - grace_s) for f in files]
        if any(s is None for s in sizes):
            continue
        removed = False
        for f, size in zip(files, sizes, strict=True):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
                out.files += 1
                out.nbytes += size or 0
                removed = True
        if removed:
            out.servers.append(pid)
    return out


def _size_if_old(path: Path, before: float) -> int | None:
    """The file's allocated bytes if it was last modified before ``before`` (0 if gone),
    else None. (The modification time: set when the file is made and sized; a write
    through a mapping of a tmpfs file leaves it.)"""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if st.st_mtime < before else None


def _alive(pid: int) -> bool:
    """``pid`` is a process here that has not exited (a zombie has: its locks are gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]
