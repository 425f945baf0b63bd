"""``kvlife serve`` with several client processes: clients SIGKILLed with puts and loads
in flight (a worker restart), and the server SIGKILLed and started again.

Everything that talks to the server runs in a process forked from the kill driver:
the clients (:func:`client`) put prompts, load and check others, hold prepared puts,
and log every acknowledged put; a checker (:func:`checker`) connects after each kill,
loads acknowledged prompts (write-through: each must be there, byte for byte),
checks what it served against the oracle and logs how long the server took to answer
again. The server is a real ``python -m kvlife.cli serve`` process.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from kvlife.core.errors import KVLifeError
from kvlife.experiments.campaign import oracle
from kvlife.experiments.campaign.tally import KindTally
from kvlife.experiments.campaign.workload import identity, make_prompt
from kvlife.faults.crash import AckLog, read_log

MiB = 1 << 20
CLIENTS = 3


class Server:
    """A ``kvlife serve`` child process (start, SIGKILL, restart)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "store"
        # a Unix socket path holds at most 107 bytes: a short directory of its own
        self.sockdir = Path(tempfile.mkdtemp(prefix="kvf-"))
        self.socket = self.sockdir / "serve.sock"
        self.pid_file = root / "serve.pid"
        self.log = root / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it; the seconds until it answers (its recovery time)."""
        self.pid_file.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "kvlife.cli", "serve", str(self.path),
            "--socket", str(self.socket), "--pid-file", str(self.pid_file),
            "--dram-bytes", str(2 * MiB), "--disk-bytes", str(256 * MiB),
            "--staging-bytes", str(4 * MiB), "--write-through",
        ]  # fmt: skip
        started = time.perf_counter()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not self.pid_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvlife serve did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.01)
        return time.perf_counter() - started

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.sockdir, ignore_errors=True)


def _remote(sock: Path) -> object:
    from kvlife.client import RemoteStore

    return RemoteStore(sock, timeout=10)


def client(sock: Path, logp: Path, seed: int, cid: int) -> None:
    """A client process: puts its prompts (``put n`` once acknowledged), loads and checks
    earlier ones, holds prepared puts; until killed."""
    log = AckLog(logp)
    store = None
    while store is None:  # the server may be starting again
        try:
            store = _remote(sock)
        except KVLifeError:
            time.sleep(0.02)
    rng = random.Random(seed * 7919 + cid)
    ident = identity()
    n = 0
    log.line("ready")
    while True:
        try:
            op = rng.random()
            if op < 0.5 or n == 0:
                p = make_prompt(seed * 1000 + cid, n)
                store.put_prompt(ident, p.namespace, p.tokens, p.kv())  # type: ignore[attr-defined]
                log.line(f"put {n}")
                n += 1
            elif op < 0.65:
                p = make_prompt(seed * 1000 + cid, n)
                pending = store.prepare_put(ident, p.namespace, p.tokens, p.kv())  # type: ignore[attr-defined]
                log.line("held")
                time.sleep(0.002 * rng.random())
                store.abort_put(pending)  # type: ignore[attr-defined]
            else:
                p = make_prompt(seed * 1000 + cid, rng.randrange(n))
                res = store.get(ident, p.namespace, p.tokens)  # type: ignore[attr-defined]
                v = oracle.check(p.keys, res.arrays)
                log.line(f"served {v.served} {v.wrong_bytes}")
        except KVLifeError as exc:
            log.line(f"error {type(exc).__name__}")
            time.sleep(0.01)
            try:
                store = _remote(sock)
            except KVLifeError:
                time.sleep(0.05)


def checker(sock: Path, logp: Path, seed: int, acked: dict[int, tuple[int, int]]) -> None:
    """Wait for the server to answer, then load the acknowledged prompts ``acked`` names
    (client -> range of prompt numbers) and check them."""
    log = AckLog(logp)
    started = time.perf_counter()
    store = None
    while store is None:
        try:
            store = _remote(sock)
        except KVLifeError:
            if time.perf_counter() - started > 60:
                raise
            time.sleep(0.01)
    log.line(f"up {time.perf_counter() - started:.6f}")
    ident = identity()
    for cid, (lo, hi) in acked.items():
        for n in range(lo, hi):
            p = make_prompt(seed * 1000 + cid, n)
            res = store.get(ident, p.namespace, p.tokens)  # type: ignore[attr-defined]
            v = oracle.check(p.keys, res.arrays)
            log.line(f"served {v.served} {v.wrong_bytes}")
            if res.loaded < len(p.keys):
                log.line(f"lost {len(p.keys) - res.loaded}")
    store.close()  # type: ignore[attr-defined]
    log.line("checked")


def _fork(fn: object, *args: object) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)  # type: ignore[operator]
        except BaseException:
            sys.stderr.write(traceback.format_exc())
            code = 3
        finally:
            os._exit(code)
    return pid


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _fold(logp: Path, t: KindTally, acked: dict[int, int] | None, cid: int) -> None:
    for line in read_log(logp):
        if line.kind == "put" and acked is not None:
            acked[cid] = max(acked.get(cid, 0), int(line.args[0]) + 1)
        elif line.kind == "served":
            t.served_chunks += int(line.args[0])
            if int(line.args[1]):
                t.wrong_chunks += 1
                t.wrong_bytes += int(line.args[1])
        elif line.kind == "lost":
            t.acked_lost += int(line.args[0])
            t.note("an acknowledged put of a write-through server was not all there")
        elif line.kind == "up":
            t.recovery_s.append(float(line.args[0]))
        elif line.kind == "error":
            t.typed_errors += 1


def _check(
    srv: Server,
    root: Path,
    seed: int,
    acked: dict[int, int],
    t: KindTally,
    k: int,
    checked: dict[int, int] | None = None,
) -> None:
    """Check, in a forked process, what ``acked`` says each client acknowledged: every
    prompt since the last check (``checked``, updated) and the 5 before it; every one
    when ``checked`` is None (the final check)."""
    logp = root / f"check-{k}.log"
    ranges = {}
    for cid, hi in acked.items():
        lo = 0 if checked is None else max(0, checked.get(cid, 0) - 5)
        ranges[cid] = (lo, hi)
        if checked is not None:
            checked[cid] = hi
    pid = _fork(checker, srv.socket, logp, seed, ranges)
    _, status = os.waitpid(pid, 0)
    _fold(logp, t, None, -1)
    if not any(line.kind == "checked" for line in read_log(logp)):
        t.note(f"checker failed (status {status})")
    elif checked is not None:  # the check after a kill: the store came back and held
        t.detections += 1


def run(root: Path, seed: int, client_kills: int, server_kills: int) -> list[KindTally]:
    """SIGKILL ``client_kills`` clients and ``server_kills`` servers; the tallies."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    worker = KindTally("worker-restart", "serve")
    crash = KindTally("server-sigkill", "serve")
    srv = Server(root)
    srv.start()
    acked: dict[int, int] = {}
    checked: dict[int, int] = {}
    running: dict[int, tuple[int, Path]] = {}
    gen = 0

    def spawn(cid: int) -> None:
        nonlocal gen
        gen += 1
        logp = root / f"client-{cid}-{gen}.log"
        running[cid] = (_fork(client, srv.socket, logp, seed, cid), logp)

    def reap(cid: int, t: KindTally) -> None:
        pid, logp = running.pop(cid)
        _kill(pid)
        _fold(logp, t, acked, cid)

    try:
        for cid in range(CLIENTS):
            spawn(cid)
        total = client_kills + server_kills
        kinds = ["client"] * client_kills + ["server"] * server_kills
        rng.shuffle(kinds)
        for k, kind in enumerate(kinds[:total]):
            time.sleep(rng.uniform(0.05, 0.3))
            if kind == "client":
                cid = rng.randrange(CLIENTS)
                reap(cid, worker)
                worker.injections += 1
                worker.sigkills += 1
                _check(srv, root, seed, acked, worker, k, checked)
                spawn(cid)
            else:
                srv.kill()
                crash.injections += 1
                crash.sigkills += 1
                for cid in list(running):
                    reap(cid, crash)  # their logs say what was acknowledged before
                crash.recovery_s.append(srv.start())
                _check(srv, root, seed, acked, crash, k, checked)
                for cid in range(CLIENTS):
                    spawn(cid)
        for cid in list(running):
            reap(cid, worker)
        _check(srv, root, seed, acked, worker, len(kinds))
    finally:
        for cid in list(running):
            pid, _ = running.pop(cid)
            _kill(pid)
        srv.stop()
    return [t for t in (worker, crash) if t.injections]
