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
what may be served. Only regular files are removed (never a directory, never through a
link), and a file the sweep may not remove is left: whatever lies in the directory, a
sweep does not raise (a server's start runs one).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvlife.tiers.shm import held

NAME = re.compile(r"^(kvlife-[0-9a-f]{16})-([1-9][0-9]{0,6})(?:-.+)?$")
"""A server's shared-memory file: its arena, a tenant's arena or a shared buffer (a pid
as the kernel writes it: no leading zero, at most 7 digits; any other name is not a
server's)."""

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
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                m = NAME.match(entry.name)
                # only regular files are a server's: a directory, a link or a device
                # with such a name (anyone may make one in /dev/shm) is left as it is
                if m is not None and entry.is_file(follow_symlinks=False):
                    key = (m.group(1), int(m.group(2)))
                    families.setdefault(key, []).append(shm_dir / entry.name)
    except OSError:
        return Swept()
    out = Swept()
    now = time.time()
    for (prefix, pid), files in sorted(families.items()):
        if _alive(pid) or held(shm_dir / f"{prefix}-{pid}"):
            continue
        sizes = [_size_if_old(f, now - grace_s) for f in files]
        if any(s is None for s in sizes):
            continue
        for f, size in zip(files, sizes, strict=True):
            try:
                f.unlink()
            except OSError:  # gone meanwhile, or not ours to remove: left
                continue
            out.files += 1
            out.nbytes += size or 0
            if pid not in out.servers:
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
    except OSError:
        return None
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
