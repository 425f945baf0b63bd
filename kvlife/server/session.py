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

On a server with principals (``--tenants``, :mod:`kvlife.tenancy`) every session has the
principal of its peer's credentials or of the token its ``hello`` sent; without one only
``hello`` is served (:class:`~kvlife.core.errors.NotAuthenticated`). Its puts and lookups
use its own scopes' keyed namespaces (:mod:`kvlife.server.context`); a load's key of an
object it may not read is loaded as a key that is not stored (the same reply); the
verbs of the whole store are an admin's (:data:`kvlife.tenancy.ADMIN_VERBS`); ``info``
and ``counters`` show a tenant its own figures only, an admin every principal's and the
store's. Its ``hello`` binds it to its principal's own arena when its peer may map that
file (:mod:`kvlife.server.shm_arenas`); a session bound to none puts and loads through
the socket (:mod:`kvlife.server.shm_copies`), and the verbs that hand out arena extents
or shared files are refused to it.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from kvlife.core.errors import InvalidArgument, NotPermitted, ProtocolError
from kvlife.core.identity import KEY_BYTES, ChunkKey, Namespace
from kvlife.core.sources import Source
from kvlife.server import protocol
from kvlife.server.context import UNKNOWN_PEER, PartSender, Peer, SessionContext
from kvlife.server.heap import HeapPolicy
from kvlife.server.identities import IdentityCache
from kvlife.server.limits import INFINITE, Account, Ledger, Limits, budgets
from kvlife.server.live import LATENCY_BOUNDS, LiveFigures
from kvlife.server.loads import Loads
from kvlife.server.puts import Puts
from kvlife.server.shm_arenas import TenantArenas
from kvlife.server.shm_copies import MAPPED_VERBS, Copies
from kvlife.store.facade import KVStore
from kvlife.tenancy.policy import ADMIN_VERBS, WITHHELD, Tenancy
from kvlife.tiers.shm import Arena, ShmTier

RECLAIM_EVERY_S = 10.0
"""The most often a full arena makes the server collect its garbage (a whole collection
of a heap of 256,000 chunks takes about 0.6 s)."""


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
        tenancy: Tenancy | None = None,
        live: LiveFigures | None = None,
    ) -> None:
        self.store = store
        self.live = live if live is not None else LiveFigures()
        """Request latencies and recent lifecycle events (the ``stats`` verb; fed by the
        server, and by the store's event sink when it was opened with
        ``live.events``)."""
        self.tenancy = tenancy
        """Principals, scopes and their counters (None: one trusted tenant)."""
        self.shm = shm
        self.arena: Arena = shm.arena
        self.socket_path = socket_path
        self.limits = limits if limits is not None else Limits()
        self.ledger = Ledger(budgets(self.limits, self.arena.size, descriptors))
        """The budgets; ``descriptors``: how many connections and shared buffers the
        descriptor limit leaves room for."""
        self.tenant_arenas = (
            TenantArenas(shm, tenancy.config.arenas) if tenancy is not None else None
        )
        """Each principal's own arena (None: one arena, every client maps it)."""
        self.identities = IdentityCache(self.limits.identity_cache_bytes)
        """Model identities decoded once, for every session (``--identity-cache-bytes``)."""
        self.sessions: dict[int, Session] = {}
        self.heap: HeapPolicy | None = None
        """The collector's policy of the process serving (set by ``kvlife serve``;
        None: Python's collector as it is)."""
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self.released_puts = 0
        """Pending puts aborted because their client went away."""
        self.released_loads = 0
        """Load grants dropped because their client went away."""
        self.events: dict[str, int] = dict.fromkeys(
            (
                "accept_errors",
                "body_timeouts",
                "unreplied_errors",
                "internal_errors",
                "arena_reclaims",
            ),
            0,
        )
        """``accept_errors``: accept calls that failed (descriptors ran out: the server
        shed a connection instead of ending); ``body_timeouts``: connections ended by the
        body deadline; ``unreplied_errors``: failed requests that asked for no reply
        (rid 0); ``internal_errors``: handler bugs (logged, RemoteError);
        ``arena_reclaims``: collections run because a put found the arena full
        (:meth:`reclaim`)."""
        self._reclaimed = float("-inf")
        """When :meth:`reclaim` last collected (``time.monotonic``)."""

    def count(self, event: str) -> None:
        with self.lock:
            self.events[event] += 1

    def reclaim(self) -> bool:
        """Collect the garbage that may hold arena extents (an extent whose last view
        sits in a reference cycle, a traceback's frame), at most once every
        :data:`RECLAIM_EVERY_S`: a put the arena has no room for tries once more after
        it. Whether it ran (counted ``arena_reclaims``)."""
        now = time.monotonic()
        with self.lock:
            if now - self._reclaimed < RECLAIM_EVERY_S:
                return False
            self._reclaimed = now
            self.events["arena_reclaims"] += 1
        if self.heap is not None:
            self.heap.whole()
        else:
            gc.collect()
        return True

    def open_session(
        self,
        account: Account | None = None,
        part: PartSender | None = None,
        peer: Peer = UNKNOWN_PEER,
    ) -> Session:
        """A new session; ``account``: what its connection holds already (the connection
        and its descriptor) and the client it is charged to, given back with everything
        else when it closes (None: a client of its own); ``part``: where its partial
        replies go; ``peer``: who connected (its principal's credentials)."""
        if account is None:
            account = self.ledger.open(None)
        with self.lock:
            session = Session(self, next(self._ids), account, part, peer)
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

    def snapshot(self, whole: bool = True) -> dict[str, Any]:
        """Leases and arena figures (``state``; tests check no lease outlives its client).
        Collects garbage first: an extent whose last view sits in a reference cycle (a
        traceback's frame) is freed by the collector, not by reference counting. With
        the collector's policy, ``whole``: the whole collection (a frozen cycle is not
        walked by the others; ``state``), else an ordinary one, which walks only what
        is not frozen (``info``: an operator's look at a live server does not stop it
        for a walk of every object, 1.1-1.4 s at 256,000 chunks)."""
        if self.heap is not None and whole:
            self.heap.whole()
        else:
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
            **self.shm.arena_stats(),
        }


_OWN_PREFIX = "a tenant's prefix invalidation names the key of a stored chunk it may read"


class Session:
    """One connection's verbs: the load protocol (:class:`~kvlife.server.loads.Loads`)
    and the put protocol (:class:`~kvlife.server.puts.Puts`) over one shared
    :class:`~kvlife.server.context.SessionContext`, and the management verbs."""

    def __init__(
        self,
        server: ServerState,
        sid: int,
        account: Account,
        part: PartSender | None = None,
        peer: Peer = UNKNOWN_PEER,
    ) -> None:
        self.server = server
        self.ctx = SessionContext(server, sid, account, part, peer)
        self.sid = sid
        self.account = account
        """What this session holds of each budget (given back whole when it ends), and
        the client process it is charged to."""
        self.loads = Loads(self.ctx)
        self.puts = Puts(self.ctx)
        self.copies = Copies(self.ctx)
        store = server.store
        self.handlers: dict[str, Callable[[dict[str, Any]], object]] = {
            "hello": self.hello,
            "lookup": self.loads.lookup,
            "direct_kept": self.loads.direct_kept,
            "load": self.loads.load,
            "release": self.loads.release,
            "alloc_buffer": self.loads.alloc_buffer,
            "free_buffer": self.loads.free_buffer,
            "prepare_put": self.puts.prepare_put,
            "put": self.puts.put,
            "put_commit": self.puts.put_commit,
            "put_written": self.puts.put_written,
            "commit_put": self.puts.commit_put,
            "abort_put": self.puts.abort_put,
            "put_inline": self.copies.put_inline,
            "invalidate": self.invalidate,
            "evict": lambda a: store.evict(a["tier"], a["nbytes"]),
            "flush": lambda a: store.flush(),
            "drain": lambda a: store.drain(),
            "info": self.info,
            "counters": self.counters,
            "check": self.check,
            "state": self.state,
            "stats": self.stats,
        }

    def refused(self, verb: str, error: Exception, put: int | None = None) -> None:
        """A request of ``verb`` this session sent was refused before any handler ran
        (its arguments failed the protocol's checks). A ``put_commit`` so refused aborts
        the deferred put it would have committed, and a ``commit_put`` or ``abort_put``
        the pending put it names (``put``, when its id was an int): the client was told
        the put failed, and its chunks must not stay TENTATIVE (holding the prompt and
        the session's budget) until the session's next put or its end."""
        if verb == "put_commit":
            self.puts.refuse_commit(f"its put_commit was refused: {error}")
        elif verb in ("commit_put", "abort_put") and put is not None:
            self.puts.refuse_pending(put, f"its {verb} was refused: {error}")

    def handle(self, verb: str, args: dict[str, Any], rid: int = 0) -> object:
        self.ctx.rid = rid
        if self.server.tenancy is None or verb == "hello":
            return self._handler(verb, args)(args)
        return self._as_tenant(verb, args)

    def _handler(self, verb: str, args: dict[str, Any]) -> Callable[[dict[str, Any]], object]:
        if verb == "load" and args.get("inline"):
            return self.copies.load_inline  # the bytes in the reply (shm_copies)
        return self.handlers[verb]

    def _as_tenant(self, verb: str, args: dict[str, Any]) -> object:
        """``verb`` for the session's principal: refused if it has none, or if the verb
        is the whole store's and it is no admin; a load's keys it may not read withheld;
        what its lookups and puts did counted to it."""
        tenancy = self.server.tenancy
        assert tenancy is not None
        principal = self.ctx.tenant()
        if verb in ADMIN_VERBS and not principal.admin:
            raise NotPermitted(f"{verb!r} acts on the whole store: admin principals only")
        if not self.ctx.mapped and verb in MAPPED_VERBS and not args.get("inline"):
            raise NotPermitted(MAPPED_VERBS[verb])
        if verb == "load":
            args = self._readable_keys(args)
        result = self._handler(verb, args)(args)
        count = tenancy.counters.add
        if verb == "lookup" and isinstance(result, dict):
            hit = len(result["keys"]) // KEY_BYTES
            count(
                principal.name,
                lookups=1,
                lookup_chunks_hit=hit,
                lookup_chunks_miss=result["chunks_total"] - hit,
                lookup_chunks_refused=int(bool(result["refusal"])),
            )
        elif verb == "load":
            count(principal.name, loads=1)
        elif isinstance(result, dict) and "stored" in result:  # a put's result
            count(
                principal.name,
                puts=1,
                chunks_stored=result["stored"],
                chunks_already_present=result["already_present"],
                chunks_dropped=result["dropped"],
            )
        return result

    def _readable_keys(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` of a load with every key its principal may not read (another
        tenant's, whatever way it learnt it) or that the store does not know replaced by
        :data:`WITHHELD`, a key no chunk has: the load then answers as for a key that is
        not stored."""
        tenancy = self.server.tenancy
        assert tenancy is not None
        principal = self.ctx.tenant()
        keys = protocol.split_keys(args["keys"])
        stored = self.server.store.namespaces_of(keys)
        may = tenancy.scopes.may_read
        # a key the store does not know is withheld too: the load pins what it finds
        # under a later hold of the store's lock, so a key let through as unknown here
        # could name another tenant's chunk committed in between (a miss either way)
        if all(ns is not None and may(principal, ns) for ns in stored):
            return args
        kept = [
            k if ns is not None and may(principal, ns) else WITHHELD
            for k, ns in zip(keys, stored, strict=True)
        ]
        return {**args, "keys": b"".join(kept)}

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
        tenancy = self.server.tenancy
        principal = ""
        if tenancy is not None:
            if "token" in args:
                # a refused token leaves the session with no principal at all (not its
                # peer's): a client that sent a token meant to be someone else
                self.ctx.principal = None
                self.ctx.principal = tenancy.config.by_token(args["token"])
            p = self.ctx.tenant()
            principal = p.name
            self.ctx.bind()  # its principal's arena, if its peer may map it
        ctx = self.ctx
        return {
            "principal": principal,
            "session": self.sid,
            # the arena this client maps ("": none, it puts and loads through the socket)
            "arena": str(ctx.arena.path) if ctx.mapped else "",
            "arena_bytes": ctx.arena.size if ctx.mapped else 0,
            "tiers": list(store.tier_names),
            "path": str(store.path),
            # what this client's puts may hold at once: a put_prompt larger than half of
            # it goes in several puts (kvlife.client.puts)
            "put_share": self.server.ledger.table["put_bytes"].session,
        }

    def invalidate(self, args: dict[str, Any]) -> object:
        """The store's invalidation. With principals, a tenant's covers one namespace
        it may write (named: NotPermitted without one, since a count over others'
        objects would reveal them), and its prefix must be the key of a stored object
        it may read (NotPermitted, one message, for any other key: a prefix
        invalidation follows the chain of chunks after the key, and the chain through
        another tenant's chunks would tell whether they are stored); an admin names any
        namespace in full (``user:bob``), or none."""
        ns = args.get("namespace")
        prefix = args.get("prefix")
        tenancy = self.server.tenancy
        principal = self.ctx.tenant() if tenancy is not None else None
        # a tenant names a scope as its lookups and puts do (``user`` too), read below
        namespace = (
            protocol.decode_namespace(ns)
            if ns is not None and (principal is None or principal.admin)
            else None
        )
        if tenancy is not None:
            assert principal is not None
            if not principal.admin:
                if ns is None:
                    raise NotPermitted(
                        "a tenant's invalidate must name one of its namespaces (admins only "
                        "invalidate across namespaces)"
                    )
                namespace = self.ctx.namespace(ns, write=True)
                if prefix is not None:
                    (stored,) = self.server.store.namespaces_of([ChunkKey(prefix)])
                    if stored is None or not tenancy.scopes.may_read(principal, stored):
                        raise NotPermitted(_OWN_PREFIX)
            elif namespace is not None:
                namespace = Namespace(namespace.kind, namespace.name, tenancy.scopes.secret)
        source, before = wire_source(args)
        return self.server.store.invalidate(
            weights_digest=args.get("weights_digest"),
            adapter_id=args.get("adapter_id"),
            namespace=namespace,
            prefix=ChunkKey(prefix) if prefix is not None else None,
            source=source,
            before_version=before,
            model=args.get("model"),
            keep_weights_digest=args.get("keep_weights_digest"),
        )

    def info(self, args: dict[str, Any]) -> object:
        """The store's figures and the server's; for a tenant (not an admin) of a server
        with principals, its own: tier names and capacities, its counters and its
        sessions, none of the store's occupancy (which moves with others' objects)."""
        principal = self.ctx.principal
        tenancy = self.server.tenancy
        if tenancy is not None and (principal is None or not principal.admin):
            return self._tenant_info()
        out = self.server.store.info().to_json()
        out["server"] = {"socket": self.server.socket_path, **self.server.snapshot(whole=False)}
        if tenancy is not None:
            out["principals"] = tenancy.counters.every()
            out["shares"] = self.server.store.share_figures()
        return out

    def state(self, args: dict[str, Any]) -> object:
        """Leases and arena figures; a tenant's (not an admin's) own sessions only."""
        if self.server.tenancy is not None and not self.ctx.tenant().admin:
            return self._tenant_info()["server"]
        return self.server.snapshot()

    def stats(self, args: dict[str, Any]) -> object:
        """What ``kvlife top`` draws, cheap enough to ask every second (no audit, no
        collection, no pass over the index): the tiers' figures, the counters since
        open, sessions and leases, the latency histograms (bucket bounds and counts) and
        the lifecycle events after sequence number ``since`` (the last ``events`` of
        them, 32 by default). The whole store's: an admin's verb on a server with
        principals."""
        server = self.server
        store = server.store
        with server.lock:
            sessions = list(server.sessions.values())
        events = server.live.events.after(args.get("since", 0), args.get("events", 32))
        return {
            "time": time.time(),
            "tiers": [
                {
                    "name": name,
                    "capacity_bytes": tier.capacity_bytes,
                    "used_bytes": tier.used_bytes,
                }
                for name, tier in ((n, store.tier(n)) for n in store.tier_names)
            ],
            "counters": store.counters.as_dict(),
            "sessions": len(sessions),
            "leases": {
                "load": sum(len(s.loads.grants) for s in sessions),
                "put": sum(len(s.puts.pending) for s in sessions),
            },
            "latency_bounds": list(LATENCY_BOUNDS),
            "latency": server.live.latencies(),
            "gc": server.heap.figures() if server.heap is not None else {},
            "arena": server.arena.stats(),  # no collection first: what is held now
            "events": [
                {
                    "seq": e.seq,
                    "time": e.time,
                    "kind": e.kind,
                    "key": e.key,
                    "state": e.state,
                    "tier": e.tier,
                    "dst_tier": e.dst_tier,
                    "nbytes": e.nbytes,
                    "reason": e.reason,
                }
                for e in events
            ],
        }

    def _tenant_info(self) -> dict[str, Any]:
        principal = self.ctx.tenant()
        tenancy = self.server.tenancy
        assert tenancy is not None
        store = self.server.store
        own = tenancy.counters.of(principal.name)
        withheld = {"withheld": "occupancy is the store's; a tenant sees its own counters"}
        with self.server.lock:
            sessions = sum(1 for s in self.server.sessions.values() if s.ctx.principal is principal)
        return {
            "path": str(store.path),
            "tiers": [
                {
                    "name": name,
                    "capacity_bytes": store.tier(name).capacity_bytes,
                    "used_bytes": 0,
                    "replicas": 0,
                    "details": withheld,
                }
                for name in store.tier_names
            ],
            "objects_by_state": {},
            "bytes_by_state": {},
            "counters": own,
            "lifetime_counters": {},
            "principal": {
                "name": principal.name,
                "organisation": principal.organisation,
                "admin": principal.admin,
                "sessions": sessions,
            },
            "server": {"socket": self.server.socket_path, "sessions": sessions},
        }

    def counters(self, args: dict[str, Any]) -> object:
        """The store's counters; a tenant's own (StoreCounters names) on a server with
        principals, unless it is an admin."""
        tenancy = self.server.tenancy
        if tenancy is not None:
            principal = self.ctx.tenant()
            if not principal.admin:
                return tenancy.counters.of(principal.name)
        return self.server.store.counters.as_dict()

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


def wire_source(args: dict[str, Any]) -> tuple[Source | str | None, int | None]:
    """An ``invalidate``'s ``source``, ``source_lo`` and ``source_hi`` as the store's
    ``source`` and ``before_version``: ``[v, v + 1)`` is ``Source(name, v)``, ``[0, b)``
    the name before ``b``, no bounds the name (every version); any other range is not
    one a client sends (InvalidArgument)."""
    name = args.get("source")
    lo, hi = args.get("source_lo", 0), args.get("source_hi")
    if name is None:
        if "source_lo" in args or hi is not None:
            raise InvalidArgument("invalidate: source_lo and source_hi need a source")
        return None, None
    if lo == 0:
        return name, hi
    if hi == lo + 1:
        return Source(name, lo), None
    raise InvalidArgument(
        f"invalidate: source versions [{lo}, {hi}) of {name!r} are not a range a client sends"
    )
