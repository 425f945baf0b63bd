"""``kvlife serve``: one process owns a store directory and serves it to many processes.

The server opens the store as the embedded one does (it takes the directory lock and
recovers), with its first tier in shared memory (:class:`~kvlife.tiers.shm.ShmTier`).
It listens on a Unix socket created with mode 0600 (owner only) and serves each
connection on its own thread: the store core does its I/O outside its lock, so
connections proceed in parallel. Every frame is decoded and validated
(:mod:`kvlife.server.protocol`) before use; a bad one gets a typed error reply and the
connection goes on (an oversized length ends it: the stream cannot be resynchronised).
SIGTERM or SIGINT stops it: connections are closed (their leases released), the store
is flushed and closed, the socket, arena and pid file removed. One log line per start,
recovery and stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from kvlife.core.errors import InvalidArgument, KVLifeError, ProtocolError, RemoteError
from kvlife.core.identity import digest_bytes
from kvlife.server import protocol
from kvlife.server.session import PartSender, ServerState, Session
from kvlife.store.config import GiB, MiB, StoreConfig
from kvlife.store.facade import KVStore
from kvlife.tiers.shm import SHM_DIR, ShmTier

DEFAULT_SOCKET = "serve.sock"
MAX_SOCKET_PATH = 107
"""Longest Unix socket path Linux takes (sun_path is 108 bytes with its NUL)."""
"""Socket file name inside the store directory when ``--socket`` is not given."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Settings of ``kvlife serve``."""

    path: Path
    """Store directory."""
    socket: Path | None = None
    """Unix socket path (default ``PATH/serve.sock``)."""
    dram_bytes: int = 1 * GiB
    """Budget of the shared-memory DRAM tier."""
    disk_bytes: int = 8 * GiB
    """Budget of the disk tier (0: none)."""
    staging_bytes: int = 256 * MiB
    """Arena room beyond the DRAM budget: puts being written, disk reads being handed out."""
    pid_file: Path | None = None
    write_through: bool = False
    promote_on_hit: bool = True
    disk_transform: str = ""
    """Registered transform the disk tier encodes replicas with (empty: exact)."""
    verify_dram_on_load: bool = False
    """Verify every load from the arena against the replica's seal
    (:attr:`~kvlife.store.config.StoreConfig.verify_dram_on_load`)."""
    cpus: tuple[int, ...] = ()
    """CPUs the server's threads run on (empty: any). Keeping the server off the CPUs
    its clients copy on lets it handle a request while the client copies: a Unix socket
    wakes the reader on the writer's CPU, where it waits for the copy to finish."""
    shm_dir: Path = SHM_DIR
    """Where the arena and the sessions' shared buffers live: a tmpfs (``/dev/shm``, or
    one mounted ``huge=always`` so that direct I/O into the arena runs at full speed)."""

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else self.path / DEFAULT_SOCKET


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"1"``, ``"0,2"`` or ``"2-5"``: the CPU numbers (InvalidArgument naming a bad
    one)."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise InvalidArgument(f"--cpus {text!r}: {part!r} is not a CPU or a range") from None
        if first < 0 or last < first:
            raise InvalidArgument(f"--cpus {text!r}: {part!r} is not a CPU or a range")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Run this thread (and every thread it makes later) on ``cpus`` only."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot run on cpus {sorted(cpus)}: {exc}") from None


def arena_prefix(path: Path) -> str:
    """Arena file names of one store directory start with this (``-<pid>`` follows)."""
    return "kvlife-" + digest_bytes(str(path.resolve()).encode()).hex()[:16]


def _remove_stale_arenas(shm_dir: Path, prefix: str) -> None:
    """Arenas of servers of this store that died without cleaning up (the caller holds
    the store's lock, so no live server of it can own one)."""
    for f in shm_dir.glob(prefix + "-*"):
        with contextlib.suppress(OSError):
            f.unlink()


def open_store(cfg: ServeConfig) -> KVStore:
    """The store with its first tier in shared memory."""
    if cfg.dram_bytes <= 0:
        raise InvalidArgument("kvlife serve needs a DRAM tier (--dram-bytes > 0)")
    base = StoreConfig(
        dram_bytes=cfg.dram_bytes,
        disk_bytes=cfg.disk_bytes,
        write_through=cfg.write_through,
        promote_on_hit=cfg.promote_on_hit,
    )
    if not cfg.shm_dir.is_dir():
        raise InvalidArgument(f"shared-memory directory {cfg.shm_dir} does not exist")
    arena = cfg.shm_dir / f"{arena_prefix(cfg.path)}-{os.getpid()}"
    shm = replace(
        base.chain[0],
        kind="shm",
        options=(("arena_path", str(arena)), ("staging_bytes", cfg.staging_bytes)),
    )
    rest = tuple(
        replace(spec, transform=cfg.disk_transform) if spec.kind == "disk" else spec
        for spec in base.chain[1:]
    )
    config = StoreConfig(
        tiers=(shm, *rest),
        write_through=cfg.write_through,
        promote_on_hit=cfg.promote_on_hit,
        verify_dram_on_load=cfg.verify_dram_on_load,
    )
    return KVStore(cfg.path, config)


class Server:
    """The listener and one thread per connection."""

    def __init__(self, cfg: ServeConfig, log: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self._log = log
        self._stop = threading.Event()
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        if cfg.cpus:  # first: every thread made from here on inherits it
            pin_cpus(cfg.cpus)
        cfg.path.mkdir(parents=True, exist_ok=True)
        # lock first (inside KVStore), then clean up what a dead server left
        prefix = arena_prefix(cfg.path)
        self.store = _open_with_cleanup(cfg, prefix)
        shm = self.store.tier(self.store.tier_names[0])
        assert isinstance(shm, ShmTier)
        self.state = ServerState(self.store, shm, str(cfg.socket_path))
        c = self.store.counters
        self.log(
            f"recovery store={cfg.path} recovered={c.recovered} dropped={c.recovery_dropped} "
            f"objects={len(self.store.indexed_keys())}"
        )
        try:
            self.listener = self._listen(cfg.socket_path)
            if cfg.pid_file is not None:
                cfg.pid_file.write_text(f"{os.getpid()}\n", encoding="utf-8")
        except BaseException:
            self.store.close(flush=False)  # releases the lock, removes the arena
            raise
        self.log(
            f"start pid={os.getpid()} store={cfg.path} socket={cfg.socket_path} "
            f"arena={shm.arena.path} huge_pages={'yes' if shm.arena.huge_pages else 'no'} "
            f"cpus={','.join(map(str, sorted(os.sched_getaffinity(0))))} "
            f"dram_bytes={cfg.dram_bytes} disk_bytes={cfg.disk_bytes}"
        )

    def log(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print(f"{stamp} kvlife serve: {line}", file=self._log, flush=True)

    def _listen(self, path: Path) -> socket.socket:
        if path.exists() or path.is_symlink():
            path.unlink()  # a dead server's socket: we hold the store lock now
        # bound and listening under a temporary name, then renamed: the socket path
        # appears only once connections are accepted (a client that waits for the file
        # is never refused)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise InvalidArgument(
                f"socket path {path} is {len(os.fsencode(path))} bytes; a Unix socket path "
                f"has at most {MAX_SOCKET_PATH} (use a shorter --socket)"
            )
        # the temporary name is no longer than the final one (the path length limit)
        tmp = path.with_name("." + str(os.getpid())[-max(1, len(path.name) - 1) :])
        if tmp.exists() and not tmp.is_socket():
            tmp = path  # never remove someone's file: bind in place
        tmp.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(tmp))
            os.chmod(tmp, 0o600)
            sock.listen(64)
            if tmp != path:
                os.rename(tmp, path)
        except OSError as exc:
            sock.close()
            tmp.unlink(missing_ok=True)
            raise InvalidArgument(f"cannot listen on {path}: {exc}") from exc
        finally:
            os.umask(old)
        sock.settimeout(0.2)
        return sock

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._stop.is_set():
                        break
                    raise
                conn.settimeout(protocol.POLL_WAIT_S)  # waits in poll: see POLL_WAIT_S
                t = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True)
                with self._lock:
                    self._conns[conn.fileno()] = conn
                    self._threads = [x for x in self._threads if x.is_alive()]
                    self._threads.append(t)
                t.start()
        finally:
            self._shutdown()

    def _serve_conn(self, conn: socket.socket) -> None:
        session = self.state.open_session()
        session.part = _part_sender(conn)
        fd = conn.fileno()
        try:
            while not self._stop.is_set():
                try:
                    body = protocol.recv_frame(conn, idle_ok=True)
                except protocol.Idle:
                    continue
                except ProtocolError as exc:
                    with contextlib.suppress(OSError):
                        conn.sendall(protocol.error_reply(0, exc))
                    break
                except OSError:
                    break
                if body is None:
                    break
                reply = self._dispatch(session, body)
                if reply is not None:
                    try:
                        conn.sendall(reply)
                    except OSError:
                        break
        finally:
            with self._lock:
                self._conns.pop(fd, None)
            with contextlib.suppress(OSError):
                conn.close()
            try:
                self.state.close_session(session)
            except Exception as exc:  # the store is closing under us; logged, not raised
                self.log(f"session {session.sid} cleanup failed: {exc}")

    def _dispatch(self, session: Session, body: bytes) -> bytes | None:
        rid = 0
        try:
            req = protocol.decode_request(body)
            rid = req.rid
            result = session.handle(req.verb, req.args, rid)
            return protocol.ok_reply(rid, result) if rid else None
        except protocol.Rejected as exc:
            return protocol.error_reply(exc.rid, exc) if exc.rid else None
        except KVLifeError as exc:
            return protocol.error_reply(rid, exc) if rid or isinstance(exc, ProtocolError) else None
        except Exception as exc:  # a bug: logged, reported, and the server keeps serving
            self.log(f"internal error: {exc!r}\n{traceback.format_exc()}")
            return protocol.error_reply(rid, RemoteError(f"{type(exc).__name__}: {exc}"))

    def _shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(OSError):
            self.cfg.socket_path.unlink()
        with self._lock:
            conns = list(self._conns.values())
            threads = list(self._threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=10)
        flushed = 0
        try:
            flushed = self.store.flush() if self.store.tier_names[1:] else 0
        finally:
            self.store.close(flush=False)
            if self.cfg.pid_file is not None:
                with contextlib.suppress(OSError):
                    self.cfg.pid_file.unlink()
            self.log(f"stop pid={os.getpid()} store={self.cfg.path} flushed={flushed}")


def _part_sender(conn: socket.socket) -> PartSender:
    def send(frame: bytes) -> None:
        # a client that went away: the final reply fails too and ends the session
        with contextlib.suppress(OSError):
            conn.sendall(frame)

    return send


def _open_with_cleanup(cfg: ServeConfig, prefix: str) -> KVStore:
    from kvlife.store.lock import drop_dir_lock, take_dir_lock

    # take the lock once to learn that no other server lives, clean up, then open
    fh = take_dir_lock(cfg.path)
    try:
        _remove_stale_arenas(cfg.shm_dir, prefix)
    finally:
        drop_dir_lock(cfg.path, fh)
    return open_store(cfg)


def run(cfg: ServeConfig) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean stop."""
    server = Server(cfg)

    def on_signal(signum: int, frame: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.serve_forever()
    return 0
