"""``kvlife top`` under a real terminal (a detached tmux session of its own) against a
real ``kvlife serve``, and the ``stats`` verb it asks (hypothesis over its arguments)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlife.core.identity import PUBLIC
from kvlife.server import protocol
from kvlife.server.live import LATENCY_BOUNDS, LiveFigures, quantile
from kvlife.server.server import ServeConfig, open_store
from kvlife.server.session import ServerState
from kvlife.tiers.shm import ShmTier
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, MiB, ServerProc, child_env, wait_for

N = TINY.tokens_per_chunk
TMUX = shutil.which("tmux")


class Tmux:
    """A tmux server on a private socket name, with one detached session."""

    def __init__(self, command: str) -> None:
        self.name = f"kvlife-top-{uuid.uuid4().hex[:12]}"
        self._run("new-session", "-d", "-x", "120", "-y", "40", command)
        self.server_pid = int(self._run("display-message", "-p", "#{pid}").strip())
        self.pane_pid = int(self._run("display-message", "-p", "#{pane_pid}").strip())

    def _run(self, *args: str) -> str:
        assert TMUX is not None
        # the pane's size is the terminal's: COLUMNS and LINES (pytest-xdist's workers
        # set 80 x 24) would override it, and top drew 24 lines of a 40-line pane
        env = {k: v for k, v in child_env().items() if k not in ("COLUMNS", "LINES")}
        out = subprocess.run(
            [TMUX, "-L", self.name, *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=True,
        )
        return out.stdout

    def screen(self) -> str:
        return self._run("capture-pane", "-p")

    def kill(self) -> None:
        for pid in (self.pane_pid, self.server_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path / "store").start()
    yield srv
    assert srv.stop() == 0


def _figure(screen: str, label: str) -> int | None:
    found = re.search(re.escape(label) + r" (\d+)", screen)
    return int(found.group(1)) if found else None


@pytest.mark.skipif(TMUX is None, reason="needs tmux")
def test_top_shows_a_live_store_in_a_terminal(server: ServerProc) -> None:
    cmd = f"{sys.executable} -m kvlife.cli top --socket {server.socket} --interval 0.2"
    tmux = Tmux(f"cd {ROOT} && {cmd}")
    try:
        box: list[str] = []

        def shows(label: str, want: int) -> bool:
            box[:] = [tmux.screen()]
            return _figure(box[0], label) == want

        titles = ("tiers", "requests", "recent lifecycle events", "dram", "disk")
        # a frame can be captured half drawn: wait for one whole frame (a slow machine
        # once showed the figures before the last panel's title)
        wait_for(
            lambda: shows("chunks stored", 0) and all(t in box[0] for t in titles),
            60,
            f"a whole first frame with {titles}",
        )
        ident = tiny_identity()
        store = server.client()
        try:
            tokens, kv = prompt_kv(1, 3 * N)
            store.put_prompt(ident, PUBLIC, tokens, kv)
            wait_for(lambda: shows("chunks stored", 3), 30, f"3 chunks stored: {box}")
            store.load(store.lookup(ident, PUBLIC, tokens))
            other, _ = prompt_kv(2, 1 * N)
            store.lookup(ident, PUBLIC, other)  # one chunk missed
            wait_for(lambda: shows("missed", 1), 30, f"a miss: {box}")
            screen = box[0]
            assert "hit ratio 75.0%" in screen and "chunks hit 3" in screen, screen
            # the tier row: name, used, budget, use, served 3, missed 1
            assert re.search(r"dram\s*│(?:[^│]*│){3}\s*3\s*│\s*1\s*│", screen), screen
            assert store.evict("dram", 1 << 30) > 0  # demoted to disk, evicted from DRAM
            wait_for(lambda: shows("loads", 1) and " evict " in box[0], 30, f"events: {box}")
            screen = box[0]
            assert re.search(r"offload\s*│\s*indexed\s*│\s*dram -> disk", screen), screen
            more, mkv = prompt_kv(3, 2 * N)
            store.put_prompt(ident, PUBLIC, more, mkv)
            wait_for(lambda: shows("chunks stored", 5), 30, f"the figures change: {box}")
            assert re.search(r"│ load\s*│\s*1\s*│", box[0]), box[0]  # one load request
        finally:
            store.close()
    finally:
        tmux.kill()


def test_top_once_prints_one_frame(server: ServerProc) -> None:
    ident = tiny_identity()
    store = server.client()
    try:
        tokens, kv = prompt_kv(4, 2 * N)
        store.put_prompt(ident, PUBLIC, tokens, kv)
    finally:
        store.close()
    out = subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "top", "--socket", str(server.socket), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    assert _figure(out.stdout, "chunks stored") == 2
    # one frame: latencies since the server started, p50/p90/p99 of the one put's commit
    assert "since the server started" in out.stdout
    assert re.search(r"put: commit\s*│\s*1\s*│\s*-\s*│(\s*[\d.]+ ms\s*│){3}", out.stdout)
    assert "recent lifecycle events" in out.stdout


def test_top_without_a_server_says_so(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "top", "--socket", str(tmp_path / "x.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=child_env(),
    )
    assert out.returncode == 1 and "kvlife top: no server on" in out.stderr


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerState]:
    live = LiveFigures(ring=64)
    path = tmp_path_factory.mktemp("stats") / "store"
    cfg = ServeConfig(path, dram_bytes=2 * MiB, disk_bytes=8 * MiB, staging_bytes=MiB)
    store = open_store(cfg, live.events)
    shm = store.tier("dram")
    assert isinstance(shm, ShmTier)
    for seed in range(4):  # events in the ring: demotions and evictions
        tokens, kv = prompt_kv(seed, 2 * N)
        store.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        store.evict("dram", 1 << 30)
    assert len(live.events.after(0, 64)) >= 16
    yield ServerState(store, shm, "none", live=live)
    store.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(since=st.integers(0, 2**63 - 1), events=st.integers(0, 256))
def test_stats_answers_the_events_after_since(state: ServerState, since: int, events: int) -> None:
    args = protocol.check_args("stats", {"since": since, "events": events})
    session = state.open_session()
    try:
        reply = session.handle("stats", args)
    finally:
        state.close_session(session)
    assert isinstance(reply, dict)
    protocol.ok_reply(1, reply)  # goes on the wire as it is
    seqs = [e["seq"] for e in reply["events"]]
    assert seqs == sorted(seqs) and all(s > since for s in seqs) and len(seqs) <= events
    ring = [e.seq for e in state.live.events.after(since, 64)]
    assert seqs == ring[len(ring) - len(seqs) :]  # the latest ones
    assert reply["latency_bounds"] == list(LATENCY_BOUNDS)
    assert {t["name"] for t in reply["tiers"]} == {"dram", "disk"}
    assert reply["counters"]["chunks_stored"] == 8


@given(
    st.lists(
        st.integers(0, 50), min_size=len(LATENCY_BOUNDS) + 1, max_size=len(LATENCY_BOUNDS) + 1
    ),
    st.floats(0.01, 1.0),
)
def test_a_quantile_lies_in_its_bucket(counts: list[int], q: float) -> None:
    got = quantile(q, counts)
    if not sum(counts):
        assert got is None
        return
    assert got is not None
    total, seen = sum(counts), 0
    for i, n in enumerate(counts):  # the bucket the q-th observation falls in
        seen += n
        if n and seen >= q * total:
            lo = LATENCY_BOUNDS[i - 1] if 0 < i <= len(LATENCY_BOUNDS) else 0.0
            hi = LATENCY_BOUNDS[min(i, len(LATENCY_BOUNDS) - 1)]
            assert (lo if i < len(LATENCY_BOUNDS) else hi) <= got <= hi
            break
