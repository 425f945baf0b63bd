"""Operations of ``kvlife serve``: owner-only socket, pid file, log lines, SIGTERM flush
and clean exit, ``kvlife info --socket``, ``kvlife check`` on a live store, the store
lock, recovery after a restart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvlife import connect
from kvlife.core.identity import PUBLIC
from kvlife.server.server import arena_prefix
from kvlife.store import KVStore
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env


def kvlife(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvlife.cli", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_lifecycle(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "store").start()
    assert srv.socket.stat().st_mode & 0o777 == 0o600
    assert int(srv.pid_file.read_text()) == srv.pid
    arena = next(Path("/dev/shm").glob(f"kvlife-*-{srv.pid}"))
    assert arena.stat().st_mode & 0o777 == 0o600
    tokens, kv = prompt_kv(1, 64)
    with srv.client() as c:
        assert c.put_prompt(tiny_identity(), PUBLIC, tokens, kv).stored == 4
    # a second opener of the directory is refused: the server holds the lock
    second = kvlife("serve", str(srv.path), "--socket", str(tmp_path / "other.sock"))
    assert second.returncode == 1 and "open in another process" in second.stderr
    info = kvlife("info", "--socket", str(srv.socket), "--json")
    assert info.returncode == 0, info.stderr
    got = json.loads(info.stdout)
    assert got["objects_by_state"]["indexed"] == 4 and got["server"]["sessions"] == 1
    live = kvlife("check", "--socket", str(srv.socket))
    assert live.returncode == 0 and "checked" in live.stdout, live.stdout + live.stderr
    refused = kvlife("check", "--fix", "--socket", str(srv.socket))
    assert refused.returncode == 1 and "stop it" in refused.stderr
    assert srv.stop() == 0  # SIGTERM: flush (DRAM-only chunks to disk) and exit cleanly
    assert not srv.socket.exists() and not srv.pid_file.exists() and not arena.exists()
    log = srv.log.read_text()
    assert "start pid=" in log and "stop pid=" in log and "flushed=4" in log
    # the flushed chunks are on disk: the embedded store (and a restarted server) has them
    with KVStore.open(srv.path) as store:
        assert store.get(tiny_identity(), PUBLIC, tokens).loaded == 4
    srv.start()
    with srv.client() as c:
        assert c.get(tiny_identity(), PUBLIC, tokens).loaded == 4
    assert srv.stop() == 0
    assert "recovered=4" in srv.log.read_text()


def test_a_dead_servers_socket_and_arena_are_cleaned_up(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "store", default_socket=True).start()
    live = kvlife("info", str(srv.path), "--json")  # PATH/serve.sock answers: asked there
    assert live.returncode == 0 and json.loads(live.stdout)["server"]["sessions"] == 1
    old = srv.pid
    srv.kill()
    assert srv.socket.exists() and list(Path("/dev/shm").glob(f"kvlife-*-{old}"))
    # the leftover socket is not taken for a live server: info opens the directory
    info = kvlife("info", str(srv.path), "--json")
    assert info.returncode == 0 and "server" not in json.loads(info.stdout), info.stderr
    srv.start()
    assert not list(Path("/dev/shm").glob(f"kvlife-*-{old}"))
    with srv.client() as c:
        assert c.info().objects_by_state["tentative"] == 0
    assert srv.stop() == 0


def test_no_server_is_store_unavailable_and_a_lazy_client_connects_later(tmp_path: Path) -> None:
    import pytest

    from kvlife.core.errors import StoreUnavailable

    srv = ServerProc(tmp_path / "store")
    with pytest.raises(StoreUnavailable, match="unavailable"):
        connect(srv.socket)
    client = connect(srv.socket, lazy=True)
    with pytest.raises(StoreUnavailable):
        client.lookup(tiny_identity(), PUBLIC, [1] * 16)
    srv.start()
    try:
        assert client.lookup(tiny_identity(), PUBLIC, [1] * 16).hits == []
        client.close()
    finally:
        assert srv.stop() == 0


def test_check_of_a_live_directory_with_a_custom_socket_points_to_it(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "store").start()  # its socket is not PATH/serve.sock
    try:
        got = kvlife("check", str(srv.path))
        assert got.returncode == 1 and "kvlife check --socket" in got.stderr
    finally:
        assert srv.stop() == 0


def test_long_socket_paths_serve_or_fail_by_name(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * max(1, 99 - len(str(tmp_path))))
    deep.mkdir()
    ok = ServerProc(deep / "s")  # a socket path of 107 bytes, the most there is: served
    assert len(str(ok.socket)) == 107 or len(str(tmp_path)) > 97
    ok.start()
    with ok.client() as c:
        assert c.info().objects_by_state["tentative"] == 0
    assert ok.stop() == 0
    store = tmp_path / "store"
    got = kvlife("serve", str(store), "--socket", str(deep / ("x" * 20)), "--dram-bytes", "4096")
    assert got.returncode == 1 and "at most 107" in got.stderr
    # a server that could not start leaves no arena behind
    assert not list(Path("/dev/shm").glob(arena_prefix(store) + "-*"))


def test_shm_dir_holds_the_arena_and_buffers_and_a_missing_one_is_named(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    srv = ServerProc(tmp_path / "store", extra=("--shm-dir", str(shm))).start()
    try:
        (arena,) = shm.glob(f"kvlife-*-{srv.pid}")
        assert not list(Path("/dev/shm").glob(f"kvlife-*-{srv.pid}"))
        assert "huge_pages=no" in srv.log.read_text()  # a plain directory has none
        tokens, kv = prompt_kv(3, 32)
        with srv.client() as c:
            c.alloc_buffer(4096)
            assert len(list(shm.glob(arena.name + "-buf-*"))) == 1
            c.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
            got = c.get(tiny_identity(), PUBLIC, tokens)
            assert got.loaded == 2
            assert np.array_equal(got.arrays[1], kv[:, :, :, 16:32])
    finally:
        assert srv.stop() == 0
    assert not arena.exists()
    missing = kvlife("serve", str(tmp_path / "s2"), "--shm-dir", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_cpus_pin_the_server_and_bad_lists_are_named(tmp_path: Path) -> None:
    import os

    import pytest

    from kvlife.core.errors import InvalidArgument
    from kvlife.server.server import parse_cpus

    assert parse_cpus("1") == (1,)
    assert parse_cpus("0,2-4, 3") == (0, 2, 3, 4)
    for bad in ("", "x", "3-1", "-2", "1,,2"):
        with pytest.raises(InvalidArgument, match="--cpus"):
            parse_cpus(bad)
    cpu = max(os.sched_getaffinity(0))
    srv = ServerProc(tmp_path / "store", extra=("--cpus", str(cpu))).start()
    try:
        assert os.sched_getaffinity(srv.pid) == {cpu}
        assert f"cpus={cpu} " in srv.log.read_text()
    finally:
        assert srv.stop() == 0
    out = kvlife("serve", str(tmp_path / "s2"), "--cpus", "100000")
    assert out.returncode == 1 and "cannot run on cpus" in out.stderr
