"""The oracle machine's rules through ``kvlife serve``: a real server process and two
client processes, each a worker that runs rule steps it is sent on a
:class:`~tests.helpers.oracle_targets.StoreDriver` over its own ``RemoteStore``
(``kvlife.connect``), so the two clients' calls really are two processes' calls.

:class:`Rig` owns the server and the workers (one per test module: starting processes
costs more than an example); :class:`ServedTarget` is the oracle machine's target over
a rig, one model family (one set of keys) per example. A reopen stops the server
(SIGTERM: it flushes) or kills it (SIGKILL: a crash) and starts it again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.client import RemoteStore
from kvlife.core.errors import KVLifeError, StoreUnavailable
from kvlife.core.identity import ChunkKey
from tests.helpers.damage import copy_crash_image
from tests.helpers.oracle import CHUNK, LAYOUT, PromptSpec, Universe
from tests.helpers.oracle_targets import (
    DISK_BYTES,
    POOL_CHUNKS,
    AsyncOut,
    CheckOut,
    LoadOut,
    PrepOut,
    PutOut,
    StoreDriver,
    damage_frames,
)
from tests.server.conftest import ServerProc

SERVED_DRAM_CHUNKS = 2
"""The server's DRAM tier, in chunks: a three-chunk prompt straddles DRAM and disk."""
REPLY_TIMEOUT = 120.0
LOSS_COUNTERS = (
    "corrupt",
    "evicted",
    "demote_failed",
    "recovery_dropped",
    "segments_unrecoverable",
)
"""Counters of a loss the store counted (the served store has no per-key events here)."""


class WorkerError(KVLifeError):
    """A typed kvlife error a client process got (its type and message in the text)."""


class WorkerBug(Exception):
    """Anything else a client process raised (a bug, or an untyped error)."""


# ---------------------------------------------------------------------------- worker


def worker_main(conn: multiprocessing.connection.Connection, socket_path: str) -> None:
    """A client process: runs the steps it is sent and replies with plain data."""
    store = RemoteStore(socket_path, timeout=60, lazy=True)
    driver: StoreDriver | None = None
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        try:
            if op == "quit":
                with contextlib.suppress(KVLifeError):
                    store.close()
                conn.send(("ok", None))
                return
            if op == "reset":
                driver = _reset(store, driver, Universe(args[0]))
                result: Any = None
            elif op == "reconnect":
                assert driver is not None
                _reconnect(store, driver)
                result = None
            elif op == "losses":
                c = store.counters
                result = sum(getattr(c, n) for n in LOSS_COUNTERS)
            else:
                assert driver is not None
                result = getattr(driver, op)(*args)
            conn.send(("ok", result))
        except BaseException as exc:
            conn.send(
                (
                    "err",
                    isinstance(exc, KVLifeError),
                    f"{type(exc).__module__}.{type(exc).__name__}: {exc}",
                    traceback.format_exc(limit=6),
                )
            )


def _reset(store: RemoteStore, old: StoreDriver | None, u: Universe) -> StoreDriver:
    """A new example: what the last one left pending is aborted, buffers start fresh."""
    if old is not None:
        for p, _ in old.pendings.values():
            with contextlib.suppress(KVLifeError):
                store.abort_put(p)  # type: ignore[arg-type]
        old.await_all()
        for aid in list(old.loads):
            old.load_async_finish(aid, False, False)
    driver = StoreDriver(store, u)
    _reconnect(store, driver)
    return driver


def _reconnect(store: RemoteStore, driver: StoreDriver) -> None:
    """Reach the (restarted) server and map a shared buffer pool there: loads in
    ``pool`` mode land in it directly."""
    deadline = time.monotonic() + 30
    while True:
        try:
            store.server_state()
            break
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    buf = store.alloc_buffer(POOL_CHUNKS * CHUNK)
    driver.handed.pool = buf.view(np.float16).reshape(POOL_CHUNKS, *LAYOUT.chunk_shape)


# ---------------------------------------------------------------------------- rig


class Rig:
    """A ``kvlife serve`` process and two client processes."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.path = base / "store"
        self.write_through = False
        self.server = self._server().start()
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, str(self.server.socket)))
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        self.sessions = 0
        self.damaged: set[ChunkKey] = set()
        """Keys whose frames an example damaged (their rows may outlive the example)."""

    def _server(self) -> ServerProc:
        return ServerProc(
            self.path,
            dram=SERVED_DRAM_CHUNKS * CHUNK,
            disk=DISK_BYTES,
            extra=("--write-through",) if self.write_through else (),
        )

    def send(self, c: int, op: str, *args: Any) -> None:
        self.pipes[c].send((op, args))

    def receive(self, c: int) -> Any:
        pipe = self.pipes[c]
        if not pipe.poll(REPLY_TIMEOUT):
            raise WorkerBug(f"client {c} did not answer within {REPLY_TIMEOUT} s")
        reply = pipe.recv()
        if reply[0] == "ok":
            return reply[1]
        _, typed, text, where = reply
        if typed:
            raise WorkerError(text)
        raise WorkerBug(f"client {c}: {text}\n{where}")

    def call(self, c: int, op: str, *args: Any) -> Any:
        self.send(c, op, *args)
        return self.receive(c)

    def restart(self, crash: bool, write_through: bool) -> None:
        if crash:
            self.server.kill()
        else:
            assert self.server.stop() == 0, "kvlife serve did not stop cleanly"
        self.write_through = write_through
        self.server = self._server().start()
        self.sessions += 1

    def close(self) -> None:
        for c in range(len(self.pipes)):
            with contextlib.suppress(Exception):
                self.call(c, "quit")
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.server.stop()


class ServedTarget:
    """The oracle machine's target: one example's family of keys on a rig."""

    def __init__(self, rig: Rig, universe: Universe) -> None:
        self.rig = rig
        self.u = universe
        self.write_through = rig.write_through
        self.images = 0
        for c in range(2):
            rig.call(c, "reset", universe.family)
        self.losses_first = self._losses()
        self.losses_carried = 0
        """Losses counted by the server sessions of this example that ended."""

    def _losses(self) -> int:
        total: int = self.rig.call(0, "losses")
        return total

    def configure(self, dram_chunks: int) -> None:
        """The server's DRAM tier is fixed (:data:`SERVED_DRAM_CHUNKS`)."""

    def put(self, c: int, spec: PromptSpec, form: str) -> PutOut:
        out: PutOut = self.rig.call(c, "put", spec, form)
        return out

    def prepare(self, c: int, spec: PromptSpec, form: str) -> PrepOut:
        out: PrepOut = self.rig.call(c, "prepare", spec, form)
        return out

    def commit(self, c: int, hid: int) -> PutOut:
        out: PutOut = self.rig.call(c, "commit", hid)
        return out

    def commit_async(self, c: int, hid: int) -> int:
        fid: int = self.rig.call(c, "commit_async", hid)
        return fid

    def await_commit(self, c: int, fid: int) -> PutOut:
        out: PutOut = self.rig.call(c, "await_commit", fid)
        return out

    def abort(self, c: int, hid: int) -> None:
        self.rig.call(c, "abort", hid)

    def lookup(
        self, c: int, spec: PromptSpec, chunk: int | None = None, keep: bool = True
    ) -> tuple[list[ChunkKey], int]:
        out: tuple[list[ChunkKey], int] = self.rig.call(c, "lookup", spec, chunk, keep)
        return out

    def load(self, c: int, lid: int, mode: str, scribble_now: bool) -> LoadOut:
        out: LoadOut = self.rig.call(c, "load", lid, mode, scribble_now)
        return out

    def load_async_start(self, c: int, lid: int, mode: str, depth: int) -> int:
        aid: int = self.rig.call(c, "load_async_start", lid, mode, depth)
        return aid

    def load_async_finish(self, c: int, aid: int, reverse: bool, scribble_now: bool) -> AsyncOut:
        out: AsyncOut = self.rig.call(c, "load_async_finish", aid, reverse, scribble_now)
        return out

    def invalidate(self, c: int, **criteria: Any) -> int:
        n: int = self.rig.call(c, "invalidate_kw", criteria)
        return n

    def race_commit_invalidate(
        self, c: int, hid: int, criteria: dict[str, Any]
    ) -> tuple[PutOut | KVLifeError, int]:
        """Client ``c`` commits while the other client invalidates, at the same time."""
        self.rig.send(c, "commit", hid)
        self.rig.send(1 - c, "invalidate_kw", criteria)
        try:
            got: PutOut | KVLifeError = self.rig.receive(c)
        except WorkerError as exc:
            got = exc
        n: int = self.rig.receive(1 - c)
        return got, n

    def evict(self, c: int, tier: str, nbytes: int, scribbling: bool) -> int:
        n: int = self.rig.call(c, "evict", tier, nbytes, scribbling)
        return n

    def scribble(self, c: int) -> tuple[int, int]:
        out: tuple[int, int] = self.rig.call(c, "scribble")
        return out

    def flush(self, c: int) -> None:
        self.rig.call(c, "flush")

    def drain(self, c: int) -> None:
        self.rig.call(c, "drain")

    def check(self, c: int, fix: bool) -> CheckOut:
        """The server's audit (read-only), less what earlier examples damaged."""
        out: CheckOut = self.rig.call(c, "check", False)
        theirs = {k.hex()[:16] for k in self.rig.damaged if k not in self.u.meta}
        return CheckOut(
            [k for k in out.bad_keys if k.hex()[:16] not in theirs],
            [p for p in out.problems if p[:16] not in theirs],
            out.orphans,
            [q for q in out.quarantined if q[:16] not in theirs],
        )

    def reopen(self, flush: bool, crash: bool, write_through: bool) -> tuple[Path, bool]:
        """Stop the server (it flushes) or kill it, copy its files, start it again."""
        self.losses_carried += self._losses()  # a new server counts from 0
        for c in range(2):
            self.rig.call(c, "await_all")
        self.rig.restart(crash, write_through)
        self.images += 1
        image = self.rig.base / f"{self.u.family}-image{self.images}"
        self.write_through = write_through
        copy_crash_image(self.rig.path, image)
        for c in range(2):
            self.rig.call(c, "reconnect")
        return image, not crash

    def corrupt(self, key: ChunkKey, part: str) -> bool:
        self.rig.call(0, "drain")
        self.rig.damaged.add(key)
        return damage_frames(self.rig.path, key, part)

    def sync(self, tick: int) -> None:
        """Nothing to take: the served store's events stay in the server."""

    def explained(self, key: ChunkKey, since: int) -> bool:
        """A loss counter moved since the server (re)started in this example (the
        server keeps no per-key events for a client to read)."""
        return self.losses_carried + self._losses() > self.losses_first

    def close(self) -> None:
        """Leave the server clean for the next example: this family's keys go."""
        for weights in self.u.all_weights():
            with contextlib.suppress(KVLifeError):
                self.rig.call(0, "invalidate_kw", {"weights_digest": weights})
