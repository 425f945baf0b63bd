"""Arenas of killed servers are found and removed (kvlife.server.stale_arenas): a real
``kvlife serve`` killed with SIGKILL leaves its arena, the next server of any store
removes it; a live server's arena, a young one, a file of a live pid or of no server
are never touched."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.server.server import arena_prefix
from kvlife.server.stale_arenas import sweep
from kvlife.tiers.shm import Arena, held
from tests.helpers.shm_files import age, dead_pid, write_file
from tests.server.conftest import ServerProc, wait_for

MiB = 1 << 20
PREFIX = "kvlife-0123456789abcdef"


def test_arena_is_held_for_its_life(tmp_path: Path) -> None:
    arena = Arena(tmp_path / f"{PREFIX}-{os.getpid()}", MiB)
    assert held(arena.path)
    arena.unlink()
    assert not arena.path.exists()
    assert not held(arena.path)  # gone
    sparse = Arena(tmp_path / "sparse", MiB, populate_pages=False)
    assert held(sparse.path)
    assert sparse.alloc(4096, "uint8", (4096,)) is not None  # its descriptor still allocates
    path = sparse.path
    del sparse
    gc.collect()  # collected without unlink: the descriptor and its lock go with it
    assert path.exists() and not held(path)


def test_sweep_removes_a_dead_servers_family_only(tmp_path: Path) -> None:
    dead = dead_pid()
    family = [
        write_file(tmp_path / f"{PREFIX}-{dead}"),
        write_file(tmp_path / f"{PREFIX}-{dead}-t-alice"),
        write_file(tmp_path / f"{PREFIX}-{dead}-buf-00112233aabbccdd"),
    ]
    others = [
        write_file(tmp_path / f"{PREFIX}-{os.getpid()}"),  # a live pid (a server without the lock)
        write_file(tmp_path / f"kvlife-floor-{dead}-123"),  # not a server's arena
        write_file(tmp_path / f"kvlife-{dead}"),
        write_file(tmp_path / "unrelated"),
    ]
    age(*family, *others)
    swept = sweep(tmp_path)
    assert swept.files == 3 and swept.servers == [dead]
    assert swept.nbytes >= 3 * 4096
    assert not any(p.exists() for p in family)
    assert all(p.exists() for p in others)
    assert sweep(tmp_path).files == 0


def test_sweep_spares_a_held_arena_and_young_files(tmp_path: Path) -> None:
    dead = dead_pid()
    locked = write_file(tmp_path / f"{PREFIX}-{dead}")
    buf = write_file(tmp_path / f"{PREFIX}-{dead}-buf-0011223344556677")
    young = write_file(tmp_path / f"kvlife-fedcba9876543210-{dead}")
    age(locked, buf)
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a server in another pid namespace holds it
        assert sweep(tmp_path).files == 0
        assert locked.exists() and buf.exists() and young.exists()
    finally:
        os.close(fd)
    swept = sweep(tmp_path)
    assert swept.files == 2 and not locked.exists() and not buf.exists()
    assert young.exists()  # within the grace: maybe an arena being made elsewhere
    assert sweep(tmp_path, grace_s=0).files == 1 and not young.exists()


def test_sweep_counts_a_zombie_as_dead(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] == "Z")
        f = write_file(tmp_path / f"{PREFIX}-{proc.pid}")
        age(f)
        assert sweep(tmp_path).servers == [proc.pid]
    finally:
        proc.wait()


def test_sweep_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert sweep(tmp_path / "nothing").files == 0


def _arenas(shm: Path, store: Path, pid: int) -> list[Path]:
    return sorted(shm.glob(f"{arena_prefix(store)}-{pid}*"))


def test_killed_server_arena_is_removed_by_the_next_server_of_any_store(
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ("--shm-dir", str(shm))
    victim = ServerProc(tmp_path / "victim", extra=flags).start()
    alive = ServerProc(tmp_path / "alive", extra=flags).start()
    try:
        with victim.client() as c:  # a shared buffer too: a file of the family
            c.alloc_buffer(MiB)
            files = _arenas(shm, victim.path, victim.pid)
            assert len(files) == 2
            victim.kill()
        assert all(p.exists() and not held(p) for p in files), "a killed server's arena stays"
        live_files = _arenas(shm, alive.path, alive.pid)
        assert live_files and held(live_files[0])
        age(*files, *live_files)
        third = ServerProc(tmp_path / "third", extra=flags).start()
        try:
            assert not any(p.exists() for p in files)
            assert all(p.exists() for p in live_files), "a live server's arena was removed"
            log = third.log.read_text()
            assert "stale_arenas_removed" in log and "files=2 " in log, log
            assert f"dead_servers={victim.pid} " in log, log
            with alive.client() as c:  # the live server serves on, its arena intact
                assert c.alloc_buffer(MiB).nbytes == MiB
        finally:
            assert third.stop() == 0
    finally:
        assert alive.stop() == 0
        if victim.alive():
            victim.kill()


@pytest.mark.parametrize("kill", [False, True])
def test_a_young_dead_servers_arena_waits_for_the_grace(tmp_path: Path, kill: bool) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ("--shm-dir", str(shm))
    first = ServerProc(tmp_path / "first", extra=flags).start()
    files = _arenas(shm, first.path, first.pid)
    if kill:
        first.kill()
    else:
        assert first.stop() == 0
    assert bool(files[0].exists()) is kill  # a clean stop removes its own
    second = ServerProc(tmp_path / "second", extra=flags).start()
    try:
        assert bool(files[0].exists()) is kill  # younger than the grace: kept
    finally:
        assert second.stop() == 0
