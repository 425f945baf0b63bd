"""Crashes around a live server: clients SIGKILLed at random points of puts and loads
(the server must release every lease: no leaked extent, no orphan TENTATIVE object,
nothing wrong served), and the server SIGKILLed under running clients (they get
StoreUnavailable, reconnect to the restarted server, and every acknowledged put is
there byte for byte).

Client processes are forked from the test (light: no interpreter start-up per kill).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import StoreUnavailable
from tests.conftest import TINY, tiny_identity
from tests.server.conftest import MiB, ServerProc, quiet, wait_for
from tests.server.workers import expected, verify

N = TINY.tokens_per_chunk
PROMPTS = 40


def _child(sock: Path, seed: int, wfd: int) -> None:
    """Puts, held prepares, aborts and verified loads, a marker byte before each step."""
    rng = np.random.default_rng(seed)
    ident = tiny_identity()
    store = RemoteStore(sock, timeout=10)
    while True:
        p = int(rng.integers(0, PROMPTS))
        ns, tokens, kv = expected(0, p)
        op = rng.random()
        os.write(wfd, b"x")
        if op < 0.3:
            store.put_prompt(ident, ns, tokens, kv)
        elif op < 0.5:
            pending = store.prepare_put(ident, ns, tokens, kv)
            os.write(wfd, b"x")  # killed here: a put with granted extents, never committed
            time.sleep(0.001 * rng.random())
            if rng.random() < 0.5:
                store.commit_put(pending)
            else:
                store.abort_put(pending)
        elif op < 0.6:
            hits = store.lookup(ident, ns, tokens).hits
            if hits:
                store.invalidate(prefix=hits[-1].key)
        else:
            verify(store, 0, p)


def _fork(sock: Path, seed: int) -> tuple[int, int]:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(rfd)
        try:
            _child(sock, seed, wfd)
        finally:
            os._exit(0)
    os.close(wfd)
    return pid, rfd


def _check_clean(checker: RemoteStore, rng: np.random.Generator) -> None:
    snap = quiet(checker)
    assert snap["puts"] == 0, snap
    assert snap["loads"] == 0, snap
    assert snap["tentative"] == 0, snap

    def settled() -> bool:
        # every arena extent is a replica: nothing a dead client held stays allocated
        # (a promotion job of a finished load may hold its read extents a moment
        # longer: it is waited for, a leak would never settle)
        checker.drain()
        snap.update(checker.server_state())
        return bool(snap["arena_extents"] == snap["shm_replicas"])

    wait_for(settled, timeout=20, what="arena extents to be exactly the DRAM replicas")
    assert snap["arena_used_bytes"] == snap["shm_used_bytes"], snap
    for p in rng.choice(PROMPTS, 3, replace=False):
        verify(checker, 0, int(p))  # misses allowed, wrong bytes raise


def _kill_loop(server: ServerProc, kills: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    checker = server.client()
    done = 0
    try:
        for k in range(kills):
            pid, rfd = _fork(server.socket, seed * 100_000 + k)
            steps = int(rng.integers(1, 12))
            got = 0
            while got < steps:
                chunk = os.read(rfd, 64)
                if not chunk:
                    break  # the child died by itself: its status says why
                got += len(chunk)
            time.sleep(0.002 * rng.random())
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            os.close(rfd)
            assert os.WIFSIGNALED(status), f"client {k} exited by itself ({status}): a failure"
            done += 1
            _check_clean(checker, rng)
        for p in range(PROMPTS):
            verify(checker, 0, p)
        snap = checker.server_state()
        print(
            f"{done} kills; leases released: {snap['released_puts']} puts, "
            f"{snap['released_loads']} loads"
        )
        assert snap["released_puts"] > 0  # kills did land between a put's grant and commit
    finally:
        checker.close()
    return done


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[ServerProc]:
    # a DRAM tier of 96 chunk extents for 160 chunks: puts evict and demote all the time
    srv = ServerProc(tmp_path / "store", dram=96 * 4096, disk=32 * MiB, staging=MiB).start()
    yield srv
    assert srv.stop() == 0


def test_sigkilled_clients_leave_no_lease_behind(small_server: ServerProc) -> None:
    assert _kill_loop(small_server, 50, seed=1) == 50


@pytest.mark.slow
def test_sigkilled_clients_many(small_server: ServerProc) -> None:
    assert _kill_loop(small_server, 400, seed=2) == 400


def _acking_child(sock: Path, seed: int, wfd: int) -> None:
    """Puts its own prompts; writes the prompt number once ``put_prompt`` returned."""
    ident = tiny_identity()
    store = RemoteStore(sock, timeout=10)
    p = 0
    while True:
        ns, tokens, kv = expected(seed, p)
        try:
            store.put_prompt(ident, ns, tokens, kv)
        except StoreUnavailable:
            os.write(wfd, b"U\n")
            time.sleep(0.02)
            continue
        os.write(wfd, f"{p}\n".encode())
        p += 1


def test_server_sigkill_clients_see_unavailable_then_reconnect(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "store", dram=64 * 4096, extra=("--write-through",)).start()
    children = []
    for seed in (1, 2):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(rfd)
            try:
                _acking_child(srv.socket, seed, wfd)
            finally:
                os._exit(0)
        os.close(wfd)
        os.set_blocking(rfd, False)
        children.append((seed, pid, rfd))
    acked: dict[int, list[int]] = {1: [], 2: []}
    unavailable = {1: 0, 2: 0}

    def drain_pipes() -> None:
        for seed, _, rfd in children:
            try:
                data = os.read(rfd, 1 << 16)
            except BlockingIOError:
                continue
            for line in data.decode().split():
                if line == "U":
                    unavailable[seed] += 1
                else:
                    acked[seed].append(int(line))

    try:

        def progress(n: int) -> bool:
            drain_pipes()
            return all(len(a) >= n for a in acked.values())

        wait_for(lambda: progress(5), what="puts before the kill")
        srv.kill()
        time.sleep(0.3)
        drain_pipes()
        before = {s: len(a) for s, a in acked.items()}
        srv.start()  # recovers the directory; clients reconnect by themselves
        wait_for(lambda: progress(max(before.values()) + 5), what="puts after the restart")
        assert all(unavailable[s] > 0 for s in unavailable), unavailable
    finally:
        for _, pid, _ in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        drain_pipes()
        for _, _, rfd in children:
            os.close(rfd)
    checker = srv.client()
    try:
        snap = quiet(checker)
        assert snap["tentative"] == 0 and snap["puts"] == 0
        for seed, prompts in acked.items():
            for p in prompts:  # write-through: every acknowledged put survived the kill
                assert verify(checker, seed, p) == 4, (seed, p)
    finally:
        checker.close()
    assert srv.stop() == 0
    log = srv.log.read_text()
    assert log.count(" start ") == 2 and log.count(" stop ") == 1
    assert "recovery" in log
