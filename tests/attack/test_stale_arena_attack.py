"""Attacks on the sweep of dead servers' arenas (kvlife.server.stale_arenas, the arena
lock of kvlife.tiers.shm): a sweep must never remove a file a live server (or a client of
it) uses, must not follow a link to remove something else, and must not stop a server
from starting because of what else lies in its shared-memory directory.

Every server here runs in a private ``--shm-dir`` under tmp_path. A sweeper in another
pid namespace (``unshare --pid``, the tests run as root) sees no live pid: there the
arena lock is the only thing that spares a live server."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import PUBLIC
from kvlife.server.server import arena_prefix
from kvlife.server.stale_arenas import GRACE_S, sweep
from kvlife.tiers.shm import Arena, held
from tests.conftest import prompt_kv, tiny_identity
from tests.helpers.shm_files import age, dead_pid, write_file
from tests.server.conftest import ROOT, ServerProc, child_env, wait_for
from tests.server.tenants import USER, as_, write_config

MiB = 1 << 20
PREFIX = "kvlife-0123456789abcdef"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare, setuid)")


def _shm(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    shm = tmp_path / "shm"
    shm.mkdir()
    return shm, ("--shm-dir", str(shm))


def _family(shm: Path, server: ServerProc) -> list[Path]:
    return sorted(shm.glob(f"{arena_prefix(server.path)}-{server.pid}*"))


_SWEEP = (
    "import json, sys; from pathlib import Path; from kvlife.server.stale_arenas import sweep; "
)


def _sweep_elsewhere(shm: Path, grace_s: float = 0.0) -> dict[str, object]:
    """A sweep by a process in a new pid namespace: no pid of this one is alive there."""
    code = (
        _SWEEP + f"s = sweep(Path(sys.argv[1]), grace_s={grace_s}); "
        "print(json.dumps({'files': s.files, 'servers': s.servers}))"
    )
    return _json_of(["unshare", "--pid", "--fork", sys.executable, "-c", code, str(shm)])


def _json_of(argv: list[str]) -> dict[str, object]:
    """What a child Python prints as its one JSON line (it must exit 0)."""
    out = subprocess.run(
        argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


# -- what else lies in the directory must not stop a server from starting ----------------


def test_a_directory_named_like_a_dead_arena_does_not_break_the_sweep(tmp_path: Path) -> None:
    """/dev/shm is world-writable: anyone can make a directory with an arena's name. The
    sweep may leave it, but must neither raise nor spare the real dead family beside it."""
    dead = dead_pid()
    d1 = tmp_path / f"{PREFIX}-{dead}"
    d1.mkdir()
    d2 = tmp_path / f"kvlife-fedcba9876543210-{dead}-buf-0011223344556677"
    d2.mkdir()
    inside = write_file(d2 / "inside")
    write_file(tmp_path / f"kvlife-fedcba9876543210-{dead}")
    real = write_file(tmp_path / f"kvlife-00000000000000ff-{dead}")
    age(d1, d2, real, tmp_path / f"kvlife-fedcba9876543210-{dead}")
    swept = sweep(tmp_path)  # IsADirectoryError here stops every server's start
    assert inside.exists()  # never a tree removed
    assert not real.exists() and swept.files >= 1


def test_a_server_starts_beside_a_directory_named_like_a_dead_arena(tmp_path: Path) -> None:
    """The sweep runs first in Server.__init__, unguarded: one directory with a matching
    name in the shared-memory directory and no kvlife serve of any store starts."""
    shm, flags = _shm(tmp_path)
    trap = shm / f"{PREFIX}-{dead_pid()}"
    trap.mkdir()
    age(trap)
    server = ServerProc(tmp_path / "store", extra=flags)
    try:
        server.start()  # RuntimeError: kvlife serve exited (IsADirectoryError)
        with server.client() as c:
            assert c.alloc_buffer(MiB).nbytes == MiB
    finally:
        if server.proc is not None and server.alive():
            assert server.stop() == 0


def test_a_pid_beyond_pid_t_does_not_break_the_sweep(tmp_path: Path) -> None:
    """The name's pid is any run of digits: os.kill raises OverflowError for one that is
    no pid_t, and the sweep (so the server's start) with it."""
    big = write_file(tmp_path / f"{PREFIX}-99999999999999999999")
    dead = dead_pid()
    real = write_file(tmp_path / f"kvlife-00000000000000ff-{dead}")
    age(big, real)
    sweep(tmp_path)
    assert not real.exists()  # the real dead family is still removed


def test_a_file_the_sweeper_may_not_remove_does_not_break_the_sweep(tmp_path: Path) -> None:
    """A server of one Unix user sweeping a sticky /dev/shm that holds another user's
    file with a dead server's name (readable, so the lock test passes): unlink raises
    PermissionError, which must not end the sweep (nor the start of the server)."""
    shm = tmp_path / "sticky"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    dead = dead_pid()
    theirs = write_file(shm / f"{PREFIX}-{dead}")  # root's, 0644: nobody may open, not unlink
    os.chmod(theirs, 0o644)
    code = textwrap.dedent(
        """
        import json, os, sys
        from pathlib import Path
        from kvlife.server.stale_arenas import sweep
        os.chdir(sys.argv[1])
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        mine = Path(sys.argv[2])
        mine.write_bytes(b"x" * 4096)
        os.utime(mine, (1e9, 1e9))
        try:
            s = sweep(Path("."))
        except Exception as exc:
            print(json.dumps({"error": repr(exc)}))
        else:
            print(json.dumps({"files": s.files}))
        """
    )
    own = f"kvlife-00000000000000ff-{dead}"
    age(theirs)
    result = _json_of([sys.executable, "-c", code, str(shm), own])
    assert "error" not in result, result
    assert theirs.exists()
    assert not (shm / own).exists() and result["files"] == 1  # its own dead family went


# -- links are never followed --------------------------------------------------------------


def test_links_named_like_a_dead_family_are_never_followed(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    victims = tmp_path / "victims"
    victims.mkdir()
    victim = write_file(victims / "precious", b"keep me" * 100)
    vdir = victims / "dir"
    vdir.mkdir()
    write_file(vdir / "inside")
    dead = dead_pid()
    links = {
        shm / f"{PREFIX}-{dead}": victim,  # the base arena a link
        shm / f"kvlife-fedcba9876543210-{dead}": victim,
        shm / f"kvlife-fedcba9876543210-{dead}-buf-0011223344556677": vdir,
        shm / f"kvlife-fedcba9876543210-{dead}-t-alice": victims / "missing",
    }
    for link, target in links.items():
        link.symlink_to(target)
    age(victim, vdir, *links)
    for _ in range(2):
        sweep(shm, grace_s=0)
    assert victim.read_bytes() == b"keep me" * 100
    assert (vdir / "inside").exists() and vdir.is_dir()
    # a link as the base arena cannot be locked: its family counts as held
    assert (shm / f"{PREFIX}-{dead}").is_symlink()


# -- a live server's files, seen from where its pid is not alive ----------------------------


def test_a_live_servers_files_are_spared_by_a_sweeper_in_another_pid_namespace(
    tmp_path: Path,
) -> None:
    shm, flags = _shm(tmp_path)
    server = ServerProc(tmp_path / "live", extra=flags).start()
    try:
        with server.client() as c:
            buf = c.alloc_buffer(MiB)
            buf[:7] = np.frombuffer(b"payload", np.uint8)
            files = _family(shm, server)
            assert len(files) == 2, [p.name for p in files]
            age(*files, seconds=10 * GRACE_S)
            for _ in range(3):
                got = _sweep_elsewhere(shm, grace_s=0)
                assert got["files"] == 0, got
            assert all(p.exists() for p in files), "a live server's file was removed"
            assert c.alloc_buffer(MiB).nbytes == MiB  # serves on
            assert bytes(buf[:7]) == b"payload"
            files = _family(shm, server)  # the second buffer too
            assert len(files) == 3
            server.kill()  # while its client is connected: no buffer removed by it
        assert _sweep_elsewhere(shm, grace_s=0)["files"] == 3
        assert not any(p.exists() for p in files)
    finally:
        if server.alive():
            server.kill()


def test_a_live_tenant_servers_principal_arena_is_spared(tmp_path: Path) -> None:
    """A principal's arena is sparse (populate_pages=False) and given to its Unix user:
    the base arena's lock spares it; once the server is killed all of it goes."""
    shm, flags = _shm(tmp_path)
    config = write_config(tmp_path / "tenants.toml", bob_uid=os.geteuid())
    server = ServerProc(
        tmp_path / "tenant", dram=16 * MiB, extra=(*flags, "--tenants", str(config))
    ).start()
    try:
        with as_(server, "bob") as bob:
            ident = tiny_identity()
            tokens, kv = prompt_kv(7, 64)
            bob.put_prompt(ident, USER["bob"], tokens, kv)
            files = _family(shm, server)
            names = [p.name for p in files]
            assert any("-t-bob" in n for n in names), names
            age(*files, seconds=10 * GRACE_S)
            assert _sweep_elsewhere(shm, grace_s=0)["files"] == 0
            assert sweep(shm, grace_s=0).files == 0
            assert all(p.exists() for p in files)
            hit = bob.lookup(ident, USER["bob"], tokens)
            got = bob.load(hit)
            n = ident.layout.tokens_per_chunk
            assert got.loaded == len(got.arrays) > 0
            for i, a in enumerate(got.arrays):
                assert np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
        server.kill()
        assert sweep(shm, grace_s=0).files == len(files)
        assert not any(p.exists() for p in files)
    finally:
        if server.alive():
            server.kill()


def test_servers_starting_while_another_namespace_sweeps_keep_their_arenas(
    tmp_path: Path,
) -> None:
    """The window between O_EXCL and flock: a sweeper elsewhere, sweeping in a loop with
    the default grace, removes nothing of servers as they start."""
    shm, flags = _shm(tmp_path)
    code = (
        _SWEEP + "import time; end = time.time() + float(sys.argv[2]); n = 0\n"
        "while time.time() < end:\n"
        "    n += sweep(Path(sys.argv[1])).files\n"
        "print(n)"
    )
    sweeper = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", code, str(shm), "6"],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    servers = []
    try:
        for i in range(3):
            servers.append(ServerProc(tmp_path / f"s{i}", extra=flags).start())
        out, _ = sweeper.communicate(timeout=60)
        assert out.strip() == "0"
        for s in servers:
            files = _family(shm, s)
            assert files and held(files[0])
            with s.client() as c:
                assert c.alloc_buffer(MiB).nbytes == MiB
    finally:
        if sweeper.poll() is None:
            sweeper.kill()
            sweeper.wait()
        for s in servers:
            assert s.stop() == 0


# -- zombies, finalizers, descriptors ------------------------------------------------------


_ZOMBIE_LEADER = textwrap.dedent(
    """
    import ctypes, os, sys, threading, time
    from pathlib import Path
    from kvlife.tiers.shm import Arena
    arena = Arena(Path(sys.argv[1]) / f"kvlife-0123456789abcdef-{os.getpid()}", 1 << 20)
    def serve():
        while True:  # still using the arena
            arena.mmap[0] = (arena.mmap[0] + 1) % 256
            time.sleep(0.05)
    threading.Thread(target=serve).start()
    print("ready", flush=True)
    ctypes.CDLL(None).pthread_exit(None)  # the main thread ends, the process serves on
    """
)


def test_a_process_whose_main_thread_exited_keeps_its_arena(tmp_path: Path) -> None:
    """/proc/PID/stat says Z for a thread-group leader that exited while other threads
    run: the pid test calls it dead; the lock must still spare its arena."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _ZOMBIE_LEADER, str(tmp_path)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        base = tmp_path / f"{PREFIX}-{proc.pid}"
        assert held(base)
        wait_for(
            lambda: Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z",
            what="the leader to be a zombie",
        )
        assert proc.poll() is None  # the process lives on
        age(base, seconds=10 * GRACE_S)
        assert sweep(tmp_path, grace_s=0).files == 0 and base.exists()
    finally:
        proc.kill()
        proc.wait()
    assert sweep(tmp_path, grace_s=0).files == 1


def test_the_lock_lives_while_a_collected_arenas_views_do(tmp_path: Path) -> None:
    """An Arena collected without unlink while views of it still serve: the finalizer
    closes its descriptor, but the file must still read as held (the mapping's duplicate
    keeps the lock) until the last view dies."""
    arena = Arena(tmp_path / f"{PREFIX}-1", MiB, populate_pages=False)
    path = arena.path
    view = arena.alloc(4096, "uint8", (4096,))
    assert view is not None
    view[:] = 5
    del arena
    gc.collect()
    assert held(path)
    assert int(view.sum()) == 5 * 4096
    del view
    gc.collect()
    assert not held(path)


def test_unlink_twice_and_collection_never_close_a_reused_descriptor(tmp_path: Path) -> None:
    for populate in (True, False):
        arena = Arena(tmp_path / f"a-{populate}", MiB, populate_pages=populate)
        before = set(os.listdir("/proc/self/fd"))
        arena.unlink()
        freed = before - set(os.listdir("/proc/self/fd"))
        assert len(freed) == 1  # its own descriptor (the mapping keeps its duplicate)
        reused = os.open(tmp_path / f"other-{populate}", os.O_CREAT | os.O_RDWR)
        try:
            arena.unlink()
            del arena
            gc.collect()
            os.fstat(reused)  # still ours
            assert os.write(reused, b"x") == 1
        finally:
            os.close(reused)


def test_a_servers_descriptor_budget_counts_its_arena(tmp_path: Path) -> None:
    """With a tight RLIMIT_NOFILE the arena's kept descriptor is within what the server
    counted: its client_fds plus what it holds open never exceed the limit."""
    shm, flags = _shm(tmp_path)
    nofile = 128
    server = ServerProc(tmp_path / "fds", extra=flags, nofile=nofile).start()
    try:
        log = server.log.read_text()
        fields = dict(kv.split("=", 1) for kv in log.split(" start ")[-1].split() if "=" in kv)
        client_fds = int(fields["client_fds"])
        open_now = len(os.listdir(f"/proc/{server.pid}/fd"))
        assert open_now + client_fds <= nofile, (open_now, client_fds)
        assert held(_family(shm, server)[0])
    finally:
        assert server.stop() == 0


# -- clients of a dead server --------------------------------------------------------------


def test_clients_of_a_swept_dead_server_keep_their_bytes_and_get_no_wrong_kv(
    tmp_path: Path,
) -> None:
    shm, flags = _shm(tmp_path)
    ident = tiny_identity()
    tokens, kv = prompt_kv(11, 64)
    n = ident.layout.tokens_per_chunk
    victim = ServerProc(tmp_path / "victim", extra=flags).start()
    other: ServerProc | None = None
    client = victim.client()
    try:
        client.put_prompt(ident, PUBLIC, tokens, kv)
        hit = client.lookup(ident, PUBLIC, tokens)
        chunks = len(hit.hits)
        assert chunks > 0
        raw = client.alloc_buffer(chunks * 4096)
        nb = ident.layout.chunk_nbytes
        outs = [
            raw[i * 4096 : i * 4096 + nb].view(np.float16).reshape(ident.layout.chunk_shape)
            for i in range(chunks)
        ]
        assert client.load(hit, outs).loaded == chunks
        snapshot = raw.copy()
        files = _family(shm, victim)
        victim.kill()
        age(*files)
        other = ServerProc(tmp_path / "other", extra=flags).start()
        assert not any(p.exists() for p in files)  # swept
        assert "stale_arenas_removed" in other.log.read_text()
        # the client's mapping of the removed buffer lives on, bytes unchanged
        assert np.array_equal(raw, snapshot)
        for i, o in enumerate(outs):
            assert np.array_equal(o, kv[:, :, :, i * n : (i + 1) * n])
        # the dead server serves nothing, and nothing wrong
        with pytest.raises(KVLifeError):
            client.load(client.lookup(ident, PUBLIC, tokens))
        # a new server of the victim's store: what it serves is right (or a miss)
        again = ServerProc(tmp_path / "victim", extra=flags).start()
        try:
            with again.client() as c2:
                got = c2.load(c2.lookup(ident, PUBLIC, tokens))
                for i, a in enumerate(got.arrays[: got.loaded]):
                    assert np.array_equal(a, kv[:, :, :, i * n : (i + 1) * n])
        finally:
            assert again.stop() == 0
    finally:
        with contextlib.suppress(Exception):
            client.close()
        if victim.alive():
            victim.kill()
        if other is not None:
            assert other.stop() == 0


# -- many files ----------------------------------------------------------------------------


def test_many_dead_families_all_go_and_a_live_one_stays(tmp_path: Path) -> None:
    shm, _ = _shm(tmp_path)
    dead = dead_pid()
    count = 3000
    made = []
    for i in range(count):
        p = shm / f"kvlife-{i:016x}-{dead}"
        p.touch()
        made.append(p)
    age(*made)
    live = Arena(shm / f"kvlife-{'f' * 16}-{dead_pid()}", MiB)  # a dead pid, but locked
    age(live.path)
    try:
        swept = sweep(shm, grace_s=0)
        assert swept.files == count and set(swept.servers) == {dead}  # one pid, many stores
        assert not [p for p in made if p.exists()]
        assert live.path.exists() and held(live.path)
    finally:
        live.unlink()


def test_sigkill_of_a_busy_server_then_a_sweep_leaves_no_file(tmp_path: Path) -> None:
    """A killed server with several shared buffers: the next sweep takes every file of it
    and counts their bytes; the dead pid is reported once."""
    shm, flags = _shm(tmp_path)
    server = ServerProc(tmp_path / "busy", extra=flags).start()
    with server.client() as c:
        for _ in range(3):
            c.alloc_buffer(MiB)
        files = _family(shm, server)
        assert len(files) == 4
        os.kill(server.pid, signal.SIGKILL)
        assert server.proc is not None
        server.proc.wait()
    age(*files)
    swept = sweep(shm)
    assert swept.files == 4 and swept.servers == [server.pid]
    assert swept.nbytes >= 3 * MiB
    assert not any(p.exists() for p in files)


def test_the_sweep_thread_safety_of_a_server_in_this_process(tmp_path: Path) -> None:
    """Sweeps from many threads at once over one dead family: each file is counted once."""
    dead = dead_pid()
    files = [write_file(tmp_path / f"{PREFIX}-{dead}")] + [
        write_file(tmp_path / f"{PREFIX}-{dead}-buf-{i:016x}") for i in range(50)
    ]
    age(*files)
    totals: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        s = sweep(tmp_path)
        with lock:
            totals.append(s.files)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(totals) == len(files)
    assert not any(p.exists() for p in files)
