"""``kvlife serve``: one process owns a store directory and serves it to many processes.

The server opens the store as the embedded one does (it takes the directory lock and
recovers), with its first tier in shared memory (:class:`~kvlife.tiers.shm.ShmTier`).
It listens on a Unix socket created with mode 0600 (owner only) and serves each
connection on its own thread: the store core does its I/O outside its lock, so
connections proceed in parallel. Every frame is decoded and validated
(:mod:`kvlife.server.protocol`) before use; a bad one gets a typed error reply and the
connection goes on (an oversized length ends it: the stream cannot be resynchronised).
SIGTERM or SIGINT stops it: connections are closed (their leases released), the store
is flushed and closed, the socket, arena and pid file removed. One structured log line
(:mod:`kvlife.core.logs`, logger ``kvlife.serve``; JSON with ``--log-json``) per start,
recovery, quarantine and stop, and per object caught corrupt or lost. With ``--metrics
HOST:PORT`` the server exports Prometheus metrics (:mod:`kvlife.server.prometheus`) and its
start line names the URL; the ``stats`` verb answers ``kvlife top``.

Nothing a client does ends the server: connections beyond ``--max-connections``, or
beyond the descriptors left after ``--fd-reserve``, are shed (a typed error reply, then
closed); should ``accept`` still run out of descriptors, a spare one is given up to
accept and shed the connection, and the listener goes on (:mod:`kvlife.server.limits`
lists every budget).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvlife.core.errors import (
    InvalidArgument,
    KVLifeError,
    LimitExceeded,
    ProtocolError,
    RemoteError,
)
from kvlife.core.events import EventSink, fan_out
from kvlife.core.identity import digest_bytes
from kvlife.core.logs import LogSink, flush_logs, log_event
from kvlife.report import format_bytes
from kvlife.server import protocol
from kvlife.server.address import check_bindable
from kvlife.server.context import UNKNOWN_PEER, PartSender, Peer
from kvlife.server.heap import WHOLE_EVERY_S, HeapPolicy
from kvlife.server.limits import Account, Limits
from kvlife.server.live import LiveFigures
from kvlife.server.reader import BodyTimeout, Discarded, FrameReader, peek_rid
from kvlife.server.session import ServerState, Session
from kvlife.server.stale_arenas import Swept, sweep
from kvlife.store.config import GiB, MiB, StoreConfig
from kvlife.store.facade import KVStore
from kvlife.tenancy.policy import Tenancy
from kvlife.tenancy.principals import TenancyConfig, load_config
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.shm import SHM_DIR, ShmTier
from kvlife.trace.events_io import open_event_file

if TYPE_CHECKING:  # the publisher (pyzmq) and the exporter are imported only when asked for
    from kvlife.ops.kv_events import KVEventPublisher, KVEventsConfig
    from kvlife.server.prometheus import MetricsServer

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
    limits: Limits = field(default_factory=Limits)
    """Every budget a client can make the server hold (docs/server.md, Limits)."""
    tenants: Path | TenancyConfig | None = None
    """The principals' configuration (a TOML file, :mod:`kvlife.tenancy.principals`, or
    the principals of a configuration file): tenants enforced by the store. None: every
    client of the server's Unix user is trusted alike (the socket is then 0600; with
    principals it is 0666 and each peer is mapped)."""
    store: StoreConfig | None = None
    """The store's settings from a configuration file (:mod:`kvlife.ops.config`): its
    chain, whose first tier becomes the shared-memory arena, its options and quotas.
    None: the chain is ``dram_bytes``/``disk_bytes``/``disk_transform`` and the other
    fields above."""
    kv_events: KVEventsConfig | None = None
    """Publish KV events for routers (:mod:`kvlife.ops.kv_events`); None: none."""
    metrics: tuple[str, int] | None = None
    """Serve Prometheus metrics on ``http://HOST:PORT/metrics`` (port 0: a free one;
    None: no metrics)."""
    log_json: bool = False
    """Log lines as JSON objects (:mod:`kvlife.core.logs`)."""
    gc_whole_every_s: float = WHOLE_EVERY_S
    """Seconds between whole collections of the server process's garbage (0: the
    collector as Python leaves it; :mod:`kvlife.server.heap`)."""
    events: Path | None = None
    """Write the store's lifecycle events to this file (schema v1, docs/events.md:
    JSON lines appended to, so a restarted server continues its log; ``.parquet``
    written anew), for ``kvlife report --events``. None: no log."""
    fileio: FileIO | None = None
    """The disk tier's file seam (None: plain files). Tests pass a
    :class:`~kvlife.faults.fileio.FaultyIO` to stall or fail a served store's reads."""

    @property
    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else self.path / DEFAULT_SOCKET


MAX_CPUS = 1 << 16
"""CPU numbers ``--cpus`` accepts are below it (Linux's NR_CPUS is at most 8192)."""


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
        if last >= MAX_CPUS:  # before building the set: 0-99999999 is 10**8 ints
            raise InvalidArgument(
                f"--cpus {text!r}: cannot run on cpus beyond {MAX_CPUS - 1} (got {last})"
            )
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


def open_store(cfg: ServeConfig, sink: EventSink | None = None) -> KVStore:
    """The store with its first tier in shared memory (``sink``: its lifecycle events)."""
    if cfg.store is None and cfg.dram_bytes <= 0:
        raise InvalidArgument("kvlife serve needs a DRAM tier (--dram-bytes > 0)")
    base = cfg.store or StoreConfig(
        dram_bytes=cfg.dram_bytes,
        disk_bytes=cfg.disk_bytes,
        write_through=cfg.write_through,
        promote_on_hit=cfg.promote_on_hit,
    )
    if base.chain[0].kind not in ("memory", "shm"):
        raise InvalidArgument(
            f"kvlife serve keeps its first tier in shared memory: tier {base.chain[0].name!r} "
            f"is {base.chain[0].kind}, not memory or shm"
        )
    if not cfg.shm_dir.is_dir():
        raise InvalidArgument(f"shared-memory directory {cfg.shm_dir} does not exist")
    arena = cfg.shm_dir / f"{arena_prefix(cfg.path)}-{os.getpid()}"
    shm = replace(
        base.chain[0],
        kind="shm",
        options=(("arena_path", str(arena)), ("staging_bytes", cfg.staging_bytes)),
    )
    if cfg.store is not None:  # the file's chain and settings, as they are
        return KVStore(
            cfg.path, replace(cfg.store, tiers=(shm, *base.chain[1:])), sink=sink, fileio=cfg.fileio
        )
    rest = tuple(
        replace(spec, transform=cfg.disk_transform) if spec.kind == "disk" else spec
        for spec in base.chain[1:]
    )
    # quotas: the tenants' shares of each tier, from the principals' configuration
    tenants = load_config(cfg.tenants) if isinstance(cfg.tenants, Path) else cfg.tenants
    shares = tenants.shares if tenants is not None else ()
    config = StoreConfig(
        tiers=(shm, *rest),
        write_through=cfg.write_through,
        promote_on_hit=cfg.promote_on_hit,
        verify_dram_on_load=cfg.verify_dram_on_load,
        tenant_shares=shares,
    )
    return KVStore(cfg.path, config, sink=sink, fileio=cfg.fileio)


class Server:
    """The listener and one thread per connection."""

    def __init__(self, cfg: ServeConfig, stop: threading.Event | None = None) -> None:
        """``stop``: set to stop serving (the signal handlers' event, installed before
        the pid file announces the server). Its lines go to the ``kvlife.serve`` logger
        (:func:`run` configures where they are written)."""
        self.cfg = cfg
        self._log = logging.getLogger("kvlife.serve")
        self.live = LiveFigures()
        """Request latencies and recent lifecycle events (``stats``, metrics)."""
        self.metrics: MetricsServer | None = None
        self._stop = stop if stop is not None else threading.Event()
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # dead servers' arenas (killed: none removed them) give their memory back first
        try:
            swept = sweep(cfg.shm_dir) if cfg.shm_dir.is_dir() else Swept()
        except OSError as exc:  # the memory is not this start's to lose over
            self.log("stale_arenas_sweep_failed", logging.WARNING, error=exc)
            swept = Swept()
        if swept.files:
            self.log(
                "stale_arenas_removed",
                logging.WARNING,
                files=swept.files,
                bytes=swept.nbytes,
                dead_servers=",".join(map(str, swept.servers)),
                shm_dir=cfg.shm_dir,
            )
        _preflight(cfg)  # nothing made yet: a place it cannot use fails before any is
        if cfg.cpus:  # first: every thread made from here on inherits it
            pin_cpus(cfg.cpus)
        # lock first (inside KVStore), then clean up what a dead server left
        prefix = arena_prefix(cfg.path)
        # the KV-events publisher first: it announces what recovery brings back
        self.kv_events = _kv_events(cfg.kv_events)
        self.event_log: EventLog | None = None
        sinks: list[EventSink] = [] if self.kv_events is None else [self.kv_events]
        try:
            cfg.path.mkdir(parents=True, exist_ok=True)
            if cfg.events is not None:
                self.event_log = EventLog(cfg.events)
                sinks.append(self.event_log.sink)
            sink = fan_out(*sinks, self.live.events, LogSink(tenants=cfg.tenants is not None))
            self.store = _open_with_cleanup(cfg, prefix, sink)
        except BaseException:
            self._close_event_outputs(failed=True)
            raise
        shm = self.store.tier(self.store.tier_names[0])
        assert isinstance(shm, ShmTier)
        self._log_recovery()
        self._spare: int | None = None
        listening = False
        try:
            self.listener = self._listen(cfg.socket_path)
            listening = True
            # kept to give up when accept runs out of descriptors: the connection is
            # then accepted, told why and closed, instead of the error ending the server
            self._spare = os.open(os.devnull, os.O_RDONLY)
            nofile, fds = _descriptors(cfg.limits)
            tenancy = Tenancy.open(cfg.path, cfg.tenants) if cfg.tenants is not None else None
            self.state = ServerState(
                self.store, shm, str(cfg.socket_path), cfg.limits, fds, tenancy, self.live
            )
            if cfg.metrics is not None:
                from kvlife.server.prometheus import serve, server_registry

                self.metrics = serve(server_registry(self.state, self.live), *cfg.metrics)
            self._last_accept_log = 0.0
            self.log(
                "start",
                pid=os.getpid(),
                store=cfg.path,
                socket=cfg.socket_path,
                arena=shm.arena.path,
                huge_pages="yes" if shm.arena.huge_pages else "no",
                cpus=",".join(map(str, sorted(os.sched_getaffinity(0)))),
                dram_bytes=cfg.dram_bytes,
                disk_bytes=cfg.disk_bytes,
                nofile=nofile,
                client_fds=fds,
                max_connections=cfg.limits.max_connections,
                metrics=self.metrics.url if self.metrics is not None else "off",
            )
            if self.kv_events is not None:
                ev = self.kv_events
                self.log(
                    f"kv_events endpoint={ev.endpoint} bound={'yes' if ev.bound else 'no'} "
                    f"replay={ev.replay_endpoint or '-'} topic={ev.config.topic!r}"
                )
            # the lines above are written before the pid file appears: whoever waits for
            # the pid file (a supervisor, a test) reads the start line beside it
            flush_logs()
            if cfg.pid_file is not None:
                _write_pid_file(cfg.pid_file)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            if listening:  # no socket file left for a client to connect to in vain
                self.listener.close()
                with contextlib.suppress(OSError):
                    cfg.socket_path.unlink()
            if self._spare is not None:
                os.close(self._spare)
            self.store.close(flush=False)  # releases the lock, removes the arena
            self._close_event_outputs(failed=True)
            raise

    def _close_event_outputs(self, failed: bool = False) -> None:
        """Close the KV-events publisher and the event log (``failed``: a start that
        failed leaves no event file it made)."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.event_log is not None:
            self.event_log.close(failed)

    def log(self, event: str, level: int = logging.INFO, **fields: object) -> None:
        """One structured line (:mod:`kvlife.core.logs`)."""
        log_event(self._log, event, level, **fields)

    def _log_recovery(self) -> None:
        """What the open recovered and set aside: a ``recovery`` line, and a
        ``quarantine`` line when rows or segment files were quarantined."""
        c = self.store.counters
        self.log(
            "recovery",
            store=self.cfg.path,
            recovered=c.recovered,
            dropped=c.recovery_dropped,
            objects=len(self.store.indexed_keys()),
        )
        for name in self.store.tier_names:
            details = self.store.tier(name).details()
            rows = details.get("recovery_dropped", 0)
            segments = details.get("segments_quarantined", 0)
            if rows or segments:  # found at this open (rows_held: every open's)
                self.log(
                    "quarantine",
                    logging.WARNING,
                    tier=name,
                    rows=rows,
                    segments=segments,
                    rows_held=details.get("rows_quarantined", 0),
                )

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
            # with principals every peer is mapped from its credentials, so any local
            # user may connect (and is refused unless the configuration names it)
            os.chmod(tmp, 0o666 if self.cfg.tenants is not None else 0o600)
            sock.listen(self.cfg.limits.backlog)
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
                except OSError as exc:
                    if self._stop.is_set():
                        break
                    self._accept_failed(exc)
                    continue
                self._admit(conn)
        finally:
            self._shutdown()

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own, or shed it (a typed error reply, then
        closed) when the connection or descriptor budget is spent. Its budgets are
        charged to the process that connected (every connection of a client shares
        them)."""
        ledger = self.state.ledger
        peer = peer_credentials(conn)
        account = ledger.open(peer.pid)
        try:
            ledger.take(account, {"connections": 1, "descriptors": 1}, "a new connection")
        except LimitExceeded as exc:
            ledger.close(account)
            _shed(conn, exc)
            return
        conn.settimeout(protocol.POLL_WAIT_S)  # waits in poll: see POLL_WAIT_S
        t = threading.Thread(target=self._serve_conn, args=(conn, account, peer), daemon=True)
        with self._lock:
            self._conns[conn.fileno()] = conn
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        try:
            t.start()
        except RuntimeError as exc:  # no thread to be had: shed, as for descriptors
            with self._lock:
                self._conns.pop(conn.fileno(), None)
            ledger.close(account)
            self.state.count("accept_errors")
            _shed(conn, LimitExceeded(f"the server cannot start a thread: {exc}"))

    def _accept_failed(self, exc: OSError) -> None:
        """``accept`` failed: out of descriptors, give up the spare one to accept the
        waiting connection and shed it; anything else, wait a moment. Never raised: a
        client must not be able to end the server."""
        self.state.count("accept_errors")
        now = time.monotonic()
        if now - self._last_accept_log > 10:
            self._last_accept_log = now
            self.log("accept_failed", logging.WARNING, error=exc, counted="accept_errors")
        if exc.errno in (errno.EMFILE, errno.ENFILE) and self._spare is not None:
            os.close(self._spare)
            self._spare = None
            try:
                conn, _ = self.listener.accept()
            except OSError:
                pass
            else:
                _shed(
                    conn,
                    self.state.ledger.refuse(
                        "descriptors",
                        f"the server is out of descriptors ({exc.strerror}); "
                        "RLIMIT_NOFILE and --fd-reserve set how many",
                    ),
                )
            with contextlib.suppress(OSError):
                self._spare = os.open(os.devnull, os.O_RDONLY)
        if self._spare is None:  # still none: descriptors freed by others will do
            with contextlib.suppress(OSError):
                self._spare = os.open(os.devnull, os.O_RDONLY)
        time.sleep(0.01)

    def _serve_conn(self, conn: socket.socket, account: Account, peer: Peer) -> None:
        session = self.state.open_session(account, _part_sender(conn), peer)
        fd = conn.fileno()
        reader = FrameReader(conn, self.cfg.limits, self.state.ledger, account)
        try:
            while not self._stop.is_set():
                try:
                    body = reader.next()
                except protocol.Idle:
                    continue
                except Discarded as exc:  # read and dropped: the stream is in step
                    reply: bytes | None = protocol.error_reply(exc.rid, exc)
                else:
                    if body is None:
                        break
                    reply = self._dispatch(session, body)
                if reply is not None:
                    try:
                        conn.sendall(reply)
                    except OSError:
                        break
        except ProtocolError as exc:  # the stream cannot go on: told why, then closed
            if isinstance(exc, BodyTimeout):
                self.state.count("body_timeouts")
            with contextlib.suppress(OSError):
                conn.sendall(protocol.error_reply(0, exc))
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.pop(fd, None)
            with contextlib.suppress(OSError):
                conn.close()
            try:
                self.state.close_session(session)
            except Exception as exc:  # the store is closing under us; logged, not raised
                self.log("session_cleanup_failed", logging.ERROR, session=session.sid, error=exc)

    def _dispatch(self, session: Session, body: bytes) -> bytes | None:
        """The reply to one frame: none for a request of rid 0 (success or failure);
        an error reply of rid 0 for a frame that is no request (its rid unknown)."""
        try:
            req = protocol.decode_request(body, self.cfg.limits)
        except protocol.Rejected as exc:
            session.refused(exc.verb, exc, exc.put)
            return self._error(exc.rid, exc)
        except protocol.DecodeLimit as exc:
            # refused before it was built, so its rid is read from its first bytes
            self.state.ledger.refuse("decoded", "")
            return protocol.error_reply(peek_rid(body), exc)
        except ProtocolError as exc:  # not a request: no rid to answer
            return protocol.error_reply(0, exc)
        began = time.perf_counter()
        try:
            result = session.handle(req.verb, req.args, req.rid)
            self.state.live.observe(req.verb, time.perf_counter() - began)
        except KVLifeError as exc:
            return self._error(req.rid, exc)
        except Exception as exc:  # a bug: logged, reported, and the server keeps serving
            self.state.count("internal_errors")
            self.log(
                "internal_error", logging.ERROR, error=repr(exc), traceback=traceback.format_exc()
            )
            return self._error(req.rid, RemoteError(f"{type(exc).__name__}: {exc}"))
        return protocol.ok_reply(req.rid, result) if req.rid else None

    def _error(self, rid: int, exc: BaseException) -> bytes | None:
        if not rid:  # the client asked for no reply: a reply would answer its next request
            self.state.count("unreplied_errors")
            return None
        return protocol.error_reply(rid, exc)

    def _shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(OSError):
            self.cfg.socket_path.unlink()
        if self._spare is not None:
            with contextlib.suppress(OSError):
                os.close(self._spare)
            self._spare = None
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
            self._close_event_outputs()  # after the store's last events (the flush)
            if self.kv_events is not None:
                ev = self.kv_events
                self.log(f"kv_events batches={ev.batches} events={ev.events} dropped={ev.dropped}")
            if self.cfg.pid_file is not None:
                with contextlib.suppress(OSError):
                    self.cfg.pid_file.unlink()
            self.log("stop", pid=os.getpid(), store=self.cfg.path, flushed=flushed)


def _shed(conn: socket.socket, exc: KVLifeError) -> None:
    """Tell a connection why it is not served (rid 0: before any request) and close it."""
    with contextlib.suppress(OSError):
        conn.settimeout(0.1)
        conn.sendall(protocol.error_reply(0, exc))
    with contextlib.suppress(OSError):
        conn.close()


_PEERCRED = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid."""


def peer_pid(conn: socket.socket) -> int | None:
    """The pid of the process that connected ``conn`` (``SO_PEERCRED``); None when the
    kernel cannot say (0: a process outside this pid namespace)."""
    return peer_credentials(conn).pid


_NOBODY = 65534
"""The overflow id the kernel reports for a user or group unmapped in this namespace."""


def peer_credentials(conn: socket.socket) -> Peer:
    """Who connected ``conn`` (``SO_PEERCRED``: pid, effective uid and gid when it
    connected, filled by the kernel); a field the kernel cannot say is None."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except (OSError, AttributeError):
        return UNKNOWN_PEER
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Peer(
        pid if pid > 0 else None,
        uid if 0 <= uid != _NOBODY else None,
        gid if 0 <= gid != _NOBODY else None,
    )


def _descriptors(limits: Limits) -> tuple[int, int]:
    """(RLIMIT_NOFILE, descriptors left for connections and shared buffers). The soft
    limit is raised to the hard one first; the reserve is ``--fd-reserve``, at most half
    of what the store left free (a low limit still serves some clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less listdir's own
    except OSError:
        used = 64
    free = (soft if soft != resource.RLIM_INFINITY else 1 << 20) - used
    left = free - min(limits.fd_reserve, free // 2)
    if left < 1:
        raise InvalidArgument(
            f"RLIMIT_NOFILE {soft} leaves no descriptor for clients ({used} in use)"
        )
    return soft, left


def _part_sender(conn: socket.socket) -> PartSender:
    def send(frame: bytes) -> None:
        # a client that went away: the final reply fails too and ends the session
        with contextlib.suppress(OSError):
            conn.sendall(frame)

    return send


def _preflight(cfg: ServeConfig) -> None:
    """The places a server makes, checked before it makes any (InvalidArgument naming
    the one it cannot use): the store path is a folder or can be made one, the socket's
    and the pid file's folders and the shared-memory folder exist, the metrics address
    can be bound, the arena fits the free room of the shared-memory filesystem. Otherwise the server
    would fail after creating a store, or after listening, and leave them behind."""
    if cfg.path.exists() and not cfg.path.is_dir():
        raise InvalidArgument(f"store path {cfg.path} is not a directory")
    places = [("socket", cfg.socket_path)]
    if cfg.pid_file is not None:
        places.append(("pid file", cfg.pid_file))
    for what, path in places:
        if path.parent != cfg.path and not path.parent.is_dir():  # the store's: made
            raise InvalidArgument(f"{what} {path}: its directory {path.parent} does not exist")
    if not cfg.shm_dir.is_dir():
        raise InvalidArgument(
            f"shared-memory directory {cfg.shm_dir} does not exist (or is not a directory)"
        )
    if cfg.events is not None:
        if cfg.events.is_dir():
            raise InvalidArgument(f"event log {cfg.events} is a directory")
        if not cfg.events.parent.is_dir():
            raise InvalidArgument(
                f"event log {cfg.events}: its directory {cfg.events.parent} does not exist"
            )
    if cfg.metrics is not None:
        try:  # the ops extra: imported when the server serves metrics, after the store
            import kvlife.server.prometheus  # noqa: F401
        except ImportError as exc:
            raise InvalidArgument(
                f"metrics need prometheus-client (pip install 'kvlife[ops]'): {exc}"
            ) from None
        check_bindable(*cfg.metrics)
    first = cfg.store.chain[0].capacity_bytes if cfg.store is not None else cfg.dram_bytes
    arena = first + cfg.staging_bytes
    fs = os.statvfs(cfg.shm_dir)
    size = fs.f_blocks * fs.f_frsize
    # free room, and the room of this store's arenas a dead server left (removed
    # before the new one is made): an arena that fits the size but not the room failed
    # only after the store was made (or, before its pages were allocated when made,
    # with SIGBUS in the first process to write a page the filesystem could not back)
    stale = 0
    for f in cfg.shm_dir.glob(arena_prefix(cfg.path) + "-*"):
        with contextlib.suppress(OSError):
            stale += f.stat().st_blocks * 512
    room = fs.f_bavail * fs.f_frsize + stale
    if arena > room:
        raise InvalidArgument(
            f"the arena ({format_bytes(arena)}: the first tier's {format_bytes(first)} "
            f"plus staging {format_bytes(cfg.staging_bytes)}) is larger than the free room "
            f"of the shared-memory filesystem {cfg.shm_dir} ({format_bytes(room)} free of "
            f"{format_bytes(size)})"
        )


class EventLog:
    """``--events FILE``: the store's lifecycle events written to a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.made = not path.exists()
        """Made by this server (removed again if its start fails)."""
        self.sink = open_event_file(path, append=True)

    def close(self, failed: bool = False) -> None:
        self.sink.close()
        if failed and self.made:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _kv_events(config: KVEventsConfig | None) -> KVEventPublisher | None:
    if config is None:
        return None
    from kvlife.ops.kv_events import KVEventPublisher

    return KVEventPublisher(config)


def _open_with_cleanup(cfg: ServeConfig, prefix: str, sink: EventSink | None = None) -> KVStore:
    from kvlife.store.lock import drop_dir_lock, take_dir_lock

    # take the lock once to learn that no other server lives, clean up, then open
    fh = take_dir_lock(cfg.path)
    try:
        _remove_stale_arenas(cfg.shm_dir, prefix)
    finally:
        drop_dir_lock(cfg.path, fh)
    return open_store(cfg, sink)


def run(cfg: ServeConfig) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean stop (a signal that arrives while the
    store opens stops the server as soon as it is up)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from kvlife.core.logs import configure

    logs = configure(sys.stderr, json_lines=cfg.log_json)
    try:
        server = Server(cfg, stop=stop)
        heap = HeapPolicy(cfg.gc_whole_every_s).start() if cfg.gc_whole_every_s > 0 else None
        server.state.heap = heap
        try:
            server.serve_forever()
        finally:
            if heap is not None:
                heap.stop()
    finally:
        logs.close()
    return 0


def _write_pid_file(path: Path) -> None:
    """Written whole or not at all (a temporary file renamed over it): whoever waits for
    the file to appear never reads it empty or half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{os.getpid()}\n", encoding="utf-8")
    os.replace(tmp, path)
