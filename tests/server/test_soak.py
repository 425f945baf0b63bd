"""A soak of ``kvlife serve``: client processes doing every put and load path,
invalidations, evictions and flushes for a while, clients SIGKILLed at random and
replaced, a watchdog that fails the test when the server stops answering, and at the
end: every lease drained, the arena's extents exactly the DRAM replicas, every chunk
served checked against its bytes, the server's RSS back within a bound.

The workload (``tests/server/soak_worker.py``) holds the pattern that deadlocked the
server in issue 19 (an arena lock re-entered by a weakref finalizer that the cyclic
collector ran inside ``Arena.alloc``): one client loops "evict all of DRAM, then streamed
loads of 32 chunks", two loop "prepare 8 new one-token chunks, abort". Nothing in it is
hostile: each client is an ordinary ``RemoteStore`` user.

The default suite runs it for ``SHORT_S`` seconds; ``make test-slow`` for
``$KVLIFE_SOAK_SECONDS`` (default 600):

    KVLIFE_SOAK_SECONDS=3600 .venv/bin/python -m pytest -q -m slow tests/server/test_soak.py

Other knobs (environment): ``KVLIFE_SOAK_CLIENTS`` (mixed clients, default 3),
``KVLIFE_SOAK_DEADLINE_S`` (the watchdog's deadline, default 10), ``KVLIFE_SOAK_KILL_S``
(mean seconds between kills, default 4), ``KVLIFE_SOAK_RSS_MIB`` (the RSS bound, default
64), ``KVLIFE_SOAK_SEED``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.errors import StoreUnavailable
from kvlife.server.server import arena_prefix
from kvlife.tiers.shm import SHM_DIR
from tests.server import soak_worker as sw
from tests.server.conftest import ROOT, MiB, ServerProc, child_env, quiet, wait_for

SHORT_S = 60
SOAK_S = int(os.environ.get("KVLIFE_SOAK_SECONDS", "600"))
CLIENTS = int(os.environ.get("KVLIFE_SOAK_CLIENTS", "3"))
DEADLINE_S = float(os.environ.get("KVLIFE_SOAK_DEADLINE_S", "10"))
"""A server that does not answer ``state`` (or ``kvlife info``) within this is hung."""
KILL_S = float(os.environ.get("KVLIFE_SOAK_KILL_S", "4"))
RSS_MIB = int(os.environ.get("KVLIFE_SOAK_RSS_MIB", "64"))
SEED = int(os.environ.get("KVLIFE_SOAK_SEED", "19"))
NOFILE = 1024
"""The server's descriptor limit (a common default; the test machine's may be larger)."""
FD_SLACK = 16
"""Descriptors the server may hold at the end beyond those it had at the start (disk
segment files and the catalog's written since)."""
STATE_EVERY_S = 1.0
HOLD_AFTER_S = 2.0
"""A ``state`` call waiting this long holds back the bursts of connections."""
INFO_EVERY_S = 15.0
"""``kvlife info`` is a process of its own (an interpreter start): every 15 s."""
INFO_START_S = 30.0
"""What ``kvlife info`` may take beyond the deadline: its interpreter's start-up."""
REQUIRED_OPS = (
    "put_prompt",
    "prepare_commit",
    "prepare_abort",
    "prepare_held",
    "prepare_one_token",
    "load_none_dram",
    "load_none_disk",
    "load_outs_dram",
    "load_outs_disk",
    "load_shared_dram",
    "load_shared_disk",
    "load_async_disk",
    "load_sub",
    "get",
    "invalidate_prefix",
    "evict_some",
    "evict_all",
    "flush",
    "burst",
)
"""Calls every soak must have made, all clients together (rarer ones are only
reported: namespace invalidations, reconnects)."""


def rss(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of a process, in bytes (the arena is in RssShmem)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem"):
            out[name] = int(value.split()[0]) * 1024
    return out


@dataclass
class Worker:
    role: str
    seed: int
    stats: Path
    log: Path
    proc: subprocess.Popen[bytes]


class Watchdog(threading.Thread):
    """Asks the server ``state`` every second and keeps a ``kvlife info --socket``
    running every ``INFO_EVERY_S`` beside it; records a failure when either does not
    answer within its deadline or the server process is gone. Samples the server's RSS
    too."""

    def __init__(self, srv: ServerProc, work: Path, started: float) -> None:
        super().__init__(name="soak-watchdog", daemon=True)
        self.srv = srv
        self.work = work
        self.started = started
        self.failure: str | None = None
        self.failed = threading.Event()
        self.halt = threading.Event()
        self.slowest_state = 0.0
        self.slowest_info = 0.0
        self.rss_peak = 0
        self.asking_since: float | None = None
        """When the ``state`` call now waiting was sent (None: none is waiting)."""
        self._info: tuple[subprocess.Popen[bytes], float] | None = None
        """The ``kvlife info`` running now and when it started."""

    def _fail(self, why: str) -> None:
        self.failure = f"at {time.monotonic() - self.started:.1f} s: {why}"
        self.failed.set()

    def run(self) -> None:
        try:
            self._watch()
        except BaseException as exc:  # a watchdog that died would let a hang pass
            self._fail(f"the watchdog failed: {exc!r}")
        finally:
            if self._info is not None and self._info[0].poll() is None:
                self._info[0].kill()
                self._info[0].wait()

    def _watch(self) -> None:
        store = RemoteStore(self.srv.socket, timeout=DEADLINE_S, lazy=True)
        next_info = time.monotonic() + INFO_EVERY_S
        try:
            while not self.halt.wait(STATE_EVERY_S):
                if self.srv.proc is None or self.srv.proc.poll() is not None:
                    self._fail("the server exited")
                    return
                with contextlib.suppress(OSError):
                    self.rss_peak = max(self.rss_peak, rss(self.srv.pid)["VmRSS"])
                t0 = self.asking_since = time.monotonic()
                try:
                    store.server_state()
                except StoreUnavailable as exc:
                    self._fail(f"`state` did not answer within {DEADLINE_S} s ({exc})")
                    return
                self.asking_since = None
                self.slowest_state = max(self.slowest_state, time.monotonic() - t0)
                why = self._info_check()
                if why:
                    self._fail(why)
                    return
                if self._info is None and time.monotonic() >= next_info:
                    self._info_start()
                    next_info = time.monotonic() + INFO_EVERY_S
        finally:
            store.close()

    def _info_start(self) -> None:
        cmd = [sys.executable, "-m", "kvlife.cli", "info", "--socket", str(self.srv.socket)]
        with (
            (self.work / "info.json").open("wb") as out,
            (self.work / "info.err").open("wb") as err,
        ):
            proc = subprocess.Popen(
                [*cmd, "--json"], cwd=ROOT, env=child_env(), stdout=out, stderr=err
            )
        self._info = (proc, time.monotonic())

    def _info_check(self) -> str:
        """Why the running ``kvlife info`` failed ("" while it runs in time or after it
        answered)."""
        if self._info is None:
            return ""
        proc, t0 = self._info
        took = time.monotonic() - t0
        if proc.poll() is None:
            # the interpreter's start-up is not the server's: it gets its own allowance
            if took > DEADLINE_S + INFO_START_S:
                return f"`kvlife info` did not answer within {DEADLINE_S + INFO_START_S} s"
            return ""
        self._info = None
        self.slowest_info = max(self.slowest_info, took)
        out = (self.work / "info.json").read_bytes()
        if proc.returncode != 0 or "server" not in json.loads(out):
            err = (self.work / "info.err").read_text(errors="replace")[-2000:]
            return f"`kvlife info` failed ({proc.returncode}): {err}"
        return ""


@dataclass
class Soak:
    """One soak: the server, its clients, the watchdog."""

    srv: ServerProc
    work: Path
    seconds: float
    rng: np.random.Generator
    workers: list[Worker] = field(default_factory=list)
    kills: int = 0
    retired: list[Path] = field(default_factory=list)
    """Stats files of killed workers (their last summary counts too)."""
    next_seed: int = 0

    @property
    def stop_file(self) -> Path:
        return self.work / "stop"

    def hold(self, suspect: bool) -> None:
        """While the server is slow to answer the watchdog, no burst of connections
        starts: a hung server's stack dump (100 threads at most) keeps the threads that
        matter rather than a burst's waiting ones."""
        hold = self.work / "hold"
        if suspect:
            hold.touch()
        else:
            hold.unlink(missing_ok=True)

    def spawn(self, role: str) -> Worker:
        self.next_seed += 1
        seed = SEED * 1_000_000 + self.next_seed
        stats = self.work / f"{role}-{seed}.json"
        log = self.work / f"{role}-{seed}.log"
        argv = [str(self.srv.socket), str(seed), str(stats), str(self.stop_file)]
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.server.soak_worker", role, *argv],
                cwd=ROOT,
                env=child_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        w = Worker(role, seed, stats, log, proc)
        self.workers.append(w)
        return w

    def check_workers(self) -> None:
        """A worker that exited by itself failed: wrong bytes, or an error no client may
        get (its traceback is in its log)."""
        for w in self.workers:
            rc = w.proc.poll()
            if rc is not None:
                raise AssertionError(
                    f"{w.role} client {w.seed} exited {rc}:\n{w.log.read_text()[-4000:]}"
                )

    def kill_one(self) -> None:
        w = self.workers[int(self.rng.integers(len(self.workers)))]
        self.check_workers()
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.wait()
        self.workers.remove(w)
        self.retired.append(w.stats)
        self.kills += 1
        self.spawn(w.role)

    def stop_workers(self, dog: Watchdog) -> None:
        """Ask every worker to stop and wait for it (a hung server is the watchdog's to
        report: the wait ends when it fails)."""
        self.stop_file.touch()
        deadline = time.monotonic() + DEADLINE_S + sw.CALL_TIMEOUT_S
        while not dog.failed.wait(0.1):
            running = [w for w in self.workers if w.proc.poll() is None]
            for w in self.workers:
                if w.proc.returncode not in (None, 0):
                    raise AssertionError(
                        f"{w.role} client {w.seed} failed ({w.proc.returncode}):\n"
                        f"{w.log.read_text()[-4000:]}"
                    )
            if not running:
                return
            if time.monotonic() > deadline:
                w = running[0]
                raise AssertionError(
                    f"{w.role} client {w.seed} did not stop:\n{w.log.read_text()[-4000:]}"
                )

    def kill_workers(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()

    def totals(self) -> tuple[Counter[str], Counter[str], int]:
        ops: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        verified = 0
        for path in [*self.retired, *(w.stats for w in self.workers)]:
            with contextlib.suppress(FileNotFoundError):
                s = json.loads(path.read_text(encoding="utf-8"))
                ops.update(s["ops"])
                refused.update({f"{s['role']}:{k}": v for k, v in s["refused"].items()})
                verified += s["chunks_verified"]
        return ops, refused, verified


def hang_report(srv: ServerProc) -> str:
    """Where the server's threads were, from faulthandler's dump on SIGABRT (the server
    dies of it): the distinct stacks inside kvlife with how many threads had each, those
    in the arena first; threads idle in a request's wait or a pool's are left out."""
    assert srv.proc is not None
    if srv.proc.poll() is None:
        os.kill(srv.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            srv.proc.wait(timeout=10)
    text = srv.log.read_text(errors="replace")
    start = text.find("Thread 0x")
    if start < 0:
        return text[-4000:]
    stacks: Counter[str] = Counter()
    for block in text[start:].split("\n\n"):
        frames = block.strip().split("\n")[1:]
        if frames and "kvlife/" in block and "in recv_exact" not in frames[0]:
            stacks["\n".join(frames)] += 1
    ranked = sorted(stacks.items(), key=lambda kv: ("tiers/shm.py" not in kv[0], -kv[1]))
    body = "\n\n".join(f"{n} thread(s):\n{stack}" for stack, n in ranked)
    return f"{body[:12000]}\n(every thread: {srv.log})"


def run_soak(tmp_path: Path, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # the server dumps every thread's stack on SIGABRT (sent when it hangs), leaves no
    # core file, and has the common default of 1,024 descriptors (the limits are
    # inherited; this process's own are put back at once)
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    core = resource.getrlimit(resource.RLIMIT_CORE)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, core[1]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, nofile[1]), nofile[1]))
    try:
        # a DRAM tier smaller than the working set (32 hot chunks, 96 of the pool, in
        # 4 KiB pages): placement demotes and evicts all the time
        srv = ServerProc(tmp_path / "store", dram=96 * 4096, disk=32 * MiB, staging=2 * MiB)
        srv.start()
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, core)
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    work = tmp_path / "clients"
    work.mkdir()
    started = time.monotonic()
    soak = Soak(srv, work, seconds, np.random.default_rng(SEED))
    dog = Watchdog(srv, work, started)
    rss_start = rss(srv.pid)
    fds_start = len(os.listdir(f"/proc/{srv.pid}/fd"))
    try:
        dog.start()
        soak.spawn("hot")
        soak.spawn("abort")
        soak.spawn("abort")
        soak.spawn("burst")
        for _ in range(CLIENTS):
            soak.spawn("mixed")
        next_kill = started + soak.rng.exponential(KILL_S)
        while time.monotonic() - started < seconds and not dog.failed.is_set():
            dog.failed.wait(0.2)
            asking = dog.asking_since
            soak.hold(asking is not None and time.monotonic() - asking > HOLD_AFTER_S)
            soak.check_workers()
            if time.monotonic() >= next_kill:
                soak.kill_one()
                next_kill = time.monotonic() + soak.rng.exponential(KILL_S)
        if not dog.failed.is_set():
            soak.stop_workers(dog)
        dog.halt.set()
        dog.join()
        if dog.failure is not None:
            raise AssertionError(f"the server hung {dog.failure}\nits threads:\n{hang_report(srv)}")
        ops, refused, verified = soak.totals()
        print(
            f"soak {seconds:.0f} s: {soak.kills} clients killed; {verified} chunks verified; "
            f"ops {dict(sorted(ops.items()))}; refused {dict(refused)}; "
            f"slowest state {dog.slowest_state:.3f} s, kvlife info {dog.slowest_info:.2f} s"
        )
        missing = [op for op in REQUIRED_OPS if not ops[op]]
        assert not missing, f"the soak never did {missing}: {dict(ops)}"
        # the server ran throughout and no client went beyond an ordinary engine's use:
        # none may have been turned away
        unavailable = {k: v for k, v in refused.items() if k.endswith(":StoreUnavailable")}
        assert not unavailable, f"clients turned away by a healthy server: {unavailable}"
        assert soak.kills >= 1
        try:
            _check_end(srv, rss_start, dog.rss_peak, fds_start)
        except StoreUnavailable as exc:  # the checker's calls time out at the deadline
            raise AssertionError(
                f"the server stopped answering at the end ({exc})\nits threads:\n{hang_report(srv)}"
            ) from None
    except BaseException:
        soak.kill_workers()
        if srv.proc is not None and srv.proc.poll() is None:
            srv.kill()
        # a killed server leaves its arena and buffer files in shared memory (a restart
        # of its store would remove them; none comes)
        for f in SHM_DIR.glob(f"{arena_prefix(srv.path)}-{srv.pid}*"):
            f.unlink(missing_ok=True)
        raise
    assert srv.stop() == 0, srv.log.read_text()[-4000:]


def _check_end(srv: ServerProc, rss_start: dict[str, int], rss_peak: int, fds_start: int) -> None:
    """Only the checker left: no lease, every extent a replica, no buffer file, right
    bytes, descriptors and RSS back."""
    checker = RemoteStore(srv.socket, timeout=DEADLINE_S)
    try:
        snap = quiet(checker)
        for lease in ("puts", "loads", "buffers", "staged", "tentative"):
            assert snap[lease] == 0, (lease, snap)
        arena = Path(str(checker.info().tiers[0].details["arena"]))
        assert not list(arena.parent.glob(arena.name + "-buf-*"))

        def settled() -> bool:
            # a promotion job of a finished load may hold its read extents a moment
            # longer (drain waits for it): a leak would never settle
            checker.drain()
            snap.update(checker.server_state())
            return bool(snap["arena_extents"] == snap["shm_replicas"])

        wait_for(settled, timeout=30, what="arena extents to be exactly the DRAM replicas")
        assert snap["arena_used_bytes"] == snap["shm_used_bytes"], snap
        client = sw.Client(str(srv.socket), 0, sw.Stats(srv.path.parent / "end.json", "end", 0))
        try:
            for p in range(sw.POOL):
                client.load_plain(checker, p)  # misses allowed, wrong bytes raise
            for p in range(sw.HOT):
                client.load_async(checker, sw.HOT_NS, 1000 + p, shared=False)
        finally:
            client.close()
        report = checker.check()
        assert report.clean, report
        quiet(checker)
        end = rss(srv.pid)
        fds = len(os.listdir(f"/proc/{srv.pid}/fd"))
        print(
            f"server RSS: start {rss_start['VmRSS'] / MiB:.0f} MiB, peak "
            f"{rss_peak / MiB:.0f} MiB, end {end['VmRSS'] / MiB:.0f} MiB "
            f"(anon {rss_start['RssAnon'] / MiB:.0f} -> {end['RssAnon'] / MiB:.0f} MiB); "
            f"descriptors {fds_start} -> {fds}"
        )
        assert fds <= fds_start + FD_SLACK, (fds_start, fds)
        assert end["VmRSS"] <= rss_start["VmRSS"] + RSS_MIB * MiB, (rss_start, end)
    finally:
        checker.close()


@pytest.mark.slow  # a minute of load: a long tier (make test-slow)
def test_soak_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_soak(tmp_path, SHORT_S, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 600)
def test_soak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_soak(tmp_path, SOAK_S, monkeypatch)
