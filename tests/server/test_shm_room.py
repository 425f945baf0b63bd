"""An arena needs its pages on the shared-memory filesystem: one that fits the
filesystem's size but not its free room used to start, and the first write to a page
the filesystem had no room for killed the writer with SIGBUS (a client process writing
a put, exit status 135: the engine, not the server). The server's preflight counts the
free room (and this store's arenas a dead server left, removed before the new one is
made), and an arena's pages are allocated when it is made (StorageFullError, nothing
left) for a filesystem filled between the preflight and the arena.

These tests mount a small tmpfs of their own (skipped where mounting is not allowed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlife.core.errors import StorageFullError
from kvlife.tiers.shm import Arena
from tests.server.conftest import ROOT, child_env

MiB = 1 << 20


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 12 MiB of it taken by a file: 4 MiB free."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        with (mnt / "filler").open("wb") as f:
            f.write(bytes(12 * MiB))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_server_whose_arena_fits_the_size_but_not_the_room_is_refused_leaving_nothing(
    tmp_path: Path, small_shm: Path
) -> None:
    """An 8 MiB arena (4 MiB DRAM and 4 MiB staging) on a 16 MiB tmpfs with 4 MiB free:
    refused before anything is made. On the code of 69c924e the server started, and
    the first client put died of SIGBUS (checked by hand: exit status 135)."""
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "kvlife.cli", "serve", str(store)]
    cmd += ["--socket", str(tmp_path / "s.sock"), "--pid-file", str(tmp_path / "s.pid")]
    cmd += ["--dram-bytes", str(4 * MiB), "--staging-bytes", str(4 * MiB)]
    cmd += ["--disk-bytes", str(16 * MiB), "--shm-dir", str(small_shm)]
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stderr=err)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not (tmp_path / "s.pid").exists():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    if proc.poll() is None:  # it started: the bug
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode == 1, text
    assert "Traceback" not in text and "free" in text, text
    assert not store.exists() and not (tmp_path / "s.sock").exists()
    assert sorted(p.name for p in small_shm.iterdir()) == ["filler"]


def test_an_arena_the_filesystem_has_no_room_for_is_refused_typed_and_removed(
    small_shm: Path,
) -> None:
    """Made on a filesystem filled after the preflight: StorageFullError, no file left
    (before: a sparse file, whose pages failed only when written, with SIGBUS)."""
    with pytest.raises(StorageFullError, match="arena"):
        Arena(small_shm / "arena", 8 * MiB, owner=None)
    assert sorted(p.name for p in small_shm.iterdir()) == ["filler"]
    arena = Arena(small_shm / "fits", 2 * MiB)  # what fits is made as before
    try:
        assert os.stat(arena.path).st_blocks * 512 >= 2 * MiB  # its pages allocated
    finally:
        arena.unlink()
