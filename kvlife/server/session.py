"""One client connection of ``kvlife serve`` and what every session shares.

A :class:`Session` is a small composition: the load protocol
(:mod:`kvlife.server.loads`: lookups, loads, grants, shared buffers) and the put protocol
(:mod:`kvlife.server.puts`: two-phase and staged puts) over one
:class:`~kvlife.server.context.SessionContext`, plus the management verbs; each
protocol's module states its steps. :class:`ServerState` holds the store, the arena,
the live sessions, the budgets and the server's counters.

Everything a session holds is tied to its connection: when the client goes away (a
clean close, a crash, a SIGKILL), :meth:`Session.close` aborts its pending puts (their
TENTATIVE objects become DELETED and their arena extents are freed) and drops its load
grants (the extents of deleted replicas it was still reading are freed). A client names
only ids the server gave this session (``put``, ``load``); an id of another session, or
one already used, is a :class:`~kvlife.core.errors.ProtocolError`. Arena offsets only
travel from the server to the client, never the other way.

Everything a session holds is also charged to the server's budgets
(:mod:`kvlife.server.limits`) before it is allocated: pending puts, staged extents,
load grants and shared buffers, in counts and in bytes, per client process (all its
sessions together) and server-wide; one request's chunks and extra-key bytes are
bounded too, and so are the audits running at once. A refusal is a typed
:class:`~kvlife.core.errors.LimitExceeded`, counted, with nothing of the request kept.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import threading
from collections.abc import Callable
from typing import Any

from kvlife.core.errors import ProtocolError
from kvlife.core.identity import ChunkKey
from kvlife.server import protocol
from kvlife.server.context import PartSender, SessionContext
from kvlife.server.identities import IdentityCache
from kvlife.server.limits import INFINITE, Account, Ledger, Limits, budgets
from kvlife.server.loads import Loads
from kvlife.server.puts import Puts
from kvlife.store.facade import KVStore
from kvlife.tiers.shm import Arena, ShmTier


class ServerState:
    """What every session shares: the store, its shared-memory tier, the live sessions,
    the budgets and the server's counters."""

    def __init__(
        self,
        store: KVStore,
        shm: ShmTier,
        socket_path: str,
        limits: Limits | None = None,
        descriptors: int = INFINITE,
    ) -> None:
        self.store = store
        self.shm = shm
        self.arena: Arena = shm.arena
        self.socket_path = socket_path
        self.limits = limits if limits is not None else Limits()
        self.ledger = Ledger(budgets(self.limits, self.arena.size, descriptors))
        """The budgets; ``descriptors``: how many connections and shared buffers the
        descriptor limit leaves room for."""
        self.identities = IdentityCache(self.limits.identity_cache_bytes)
        """Model identities decoded once, for every session (``--identity-cache-bytes``)."""
        self.sessions: dict[int, Session] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self.released_puts = 0
        """Pending puts aborted because their client went away."""
        self.released_loads = 0
        """Load grants dropped because their client went away."""
        self.events: dict[str, int] = dict.fromkeys(
            ("accept_errors", "body_timeouts", "unreplied_errors", "internal_errors"), 0
        )
        """``accept_errors``: accept calls that failed (descriptors ran out: the server
        shed a connection instead of ending); ``body_timeouts``: connections ended by the
        body deadline; ``unreplied_errors``: failed requests that asked for no reply
        (rid 0); ``internal_errors``: handler bugs (logged, RemoteError)."""

    def count(self, event: str) -> None:
        with self.lock:
            self.events[event] += 1

    def open_session(
        self, account: Account | None = None, part: PartSender | None = None
    ) -> Session:
        """A new session; ``account``: what its connection holds already (the connection
        and its descriptor) and the client it is charged to, given back with everything
        else when it closes (None: a client of its own); ``part``: where its partial
        replies go."""
        if account is None:
            account = self.ledger.open(None)
        with self.lock:
            session = Session(self, next(self._ids), account, part)
            self.sessions[session.sid] = session
            return session

    def close_session(self, session: Session) -> None:
        try:
            puts, loads = session.close()
        finally:
            self.ledger.close(session.account)
        with self.lock:
            self.sessions.pop(session.sid, None)
            self.released_puts += puts
            self.released_loads += loads

    def snapshot(self) -> dict[str, Any]:
        """Leases and arena figures (``state``; tests check no lease outlives its client).
        Collects garbage first: an extent whose last view sits in a reference cycle (a
        traceback's frame) is freed by the collector, not by reference counting."""
        gc.collect()
        with self.lock:
            sessions = list(self.sessions.values())
        info = self.store.info()
        return {
            "sessions": len(sessions),
            "puts": sum(len(s.puts.pending) for s in sessions),
            "loads": sum(len(s.loads.grants) for s in sessions),
            "buffers": sum(len(s.loads.buffers) for s in sessions),
            "staged": sum(len(s.puts.staged) for s in sessions),
            "tentative": info.objects_by_state.get("tentative", 0),
            "shm_replicas": len(self.shm.replica_keys()),
            "shm_used_bytes": self.shm.used_bytes,
            "released_puts": self.released_puts,
            "released_loads": self.released_loads,
            **self.events,
            **self.ledger.figures(),
            **self.arena.stats(),
        }


class Session:
    """One connection's verbs: the load protocol (:class:`~kvlife.server.loads.Loads`)
    and the put protocol (:class:`~kvlife.server.puts.Puts`) over one shared
    :class:`~kvlife.server.context.SessionContext`, and the management verbs."""

    def __init__(
        self, server: ServerState, sid: int, account: Account, part: PartSender | None = None
    ) -> None:
        self.server = server
        self.ctx = SessionContext(server, sid, account, part)
        self.sid = sid
        self.account = account
        """What this session holds of each budget (given back whole when it ends), and
        the client process it is charged to."""
        self.loads = Loads(self.ctx)
        self.puts = Puts(self.ctx)
        store = server.store
        self.handlers: dict[str, Callable[[dict[str, Any]], object]] = {
            "hello": self.hello,
            "lookup": self.loads.lookup,
            "load": self.loads.load,
            "release": self.loads.release,
            "alloc_buffer": self.loads.alloc_buffer,
            "free_buffer": self.loads.free_buffer,
            "prepare_put": self.puts.prepare_put,
            "put": self.puts.put,
            "put_commit": self.puts.put_commit,
            "commit_put": self.puts.commit_put,
            "abort_put": self.puts.abort_put,
            "invalidate": self.invalidate,
            "evict": lambda a: store.evict(a["tier"], a["nbytes"]),
            "flush": lambda a: store.flush(),
            "drain": lambda a: store.drain(),
            "info": self.info,
            "counters": lambda a: store.counters.as_dict(),
            "check": self.check,
            "state": lambda a: server.snapshot(),
        }

    def handle(self, verb: str, args: dict[str, Any], rid: int = 0) -> object:
        self.ctx.rid = rid
        return self.handlers[verb](args)

    def close(self) -> tuple[int, int]:
        """Abort every pending put, drop every load grant; how many of each."""
        with self.ctx.lock:
            self.ctx.closed = True
        loads = self.loads.close()
        puts = self.puts.close(f"client of session {self.sid} went away")
        return puts, loads

    # ------------------------------------------------------------------ verbs

    def hello(self, args: dict[str, Any]) -> object:
        if args["version"] != protocol.PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol {args['version']}, server {protocol.PROTOCOL_VERSION}"
            )
        store = self.server.store
        return {
            "session": self.sid,
            "arena": str(self.server.arena.path),
            "arena_bytes": self.server.arena.size,
            "tiers": list(store.tier_names),
            "path": str(store.path),
            # what this client's puts may hold at once: a put_prompt larger than half of
            # it goes in several puts (kvlife.client.puts)
            "put_share": self.server.ledger.table["put_bytes"].session,
        }

    def invalidate(self, args: dict[str, Any]) -> object:
        ns = args.get("namespace")
        prefix = args.get("prefix")
        return self.server.store.invalidate(
            weights_digest=args.get("weights_digest"),
            adapter_id=args.get("adapter_id"),
            namespace=protocol.decode_namespace(ns) if ns is not None else None,
            prefix=ChunkKey(prefix) if prefix is not None else None,
        )

    def info(self, args: dict[str, Any]) -> object:
        out = self.server.store.info().to_json()
        out["server"] = {"socket": self.server.socket_path, **self.server.snapshot()}
        return out

    def check(self, args: dict[str, Any]) -> object:
        """The store's read-only audit. It reads every replica: ``--audits`` of them run
        at once, server-wide; one more is refused (LimitExceeded), not queued, so that
        no connection thread waits behind an audit."""
        audit = {"audits": 1}
        self.ctx.take(audit, f"session {self.sid}'s audit")
        try:
            report = self.server.store.check(fix=False)
        finally:
            self.ctx.give(audit)
        return {**dataclasses.asdict(report), "clean": report.clean}
