"""The budgets of ``kvlife serve``: everything a client can make the server hold is
bounded, server-wide and per client, and every refusal is a typed, counted error.

:class:`Limits` holds the settings (each a ``kvlife serve`` flag, made from the field and
its help text in one place, :func:`add_flags`); :class:`Ledger` holds what the sessions
hold of each budget and refuses a take that would exceed either bound with
:class:`~kvlife.core.errors.LimitExceeded`, before anything is allocated.

The per-session bounds (the ``--session-*`` flags) bind a *client*: the process at the
other end of the connection (:class:`Peer`, its ``SO_PEERCRED`` pid). Every connection
of one process is charged to the same peer, so a second connection does not double what
a client may hold. A session's own holdings are one :class:`Account` that the ledger
gives back whole when the session ends, so no path can leak a budget past its
connection.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from kvlife.core.errors import InvalidArgument, LimitExceeded

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_REQUEST = 16 * MiB
"""The protocol's own ceiling on a frame (``protocol.MAX_MESSAGE``)."""


def _f(default: object, text: str) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True, slots=True)
class Limits:
    """Every budget of ``kvlife serve`` (docs/server.md, "Limits"). Bytes of arena-backed
    budgets are shares of the arena (``dram_bytes + staging_bytes``). The ``session_*``
    bounds bind one client process, all its connections together."""

    max_connections: int = _f(512, "connections served at once; more are shed (typed error)")
    """Connections served at once; a connection beyond it gets a LimitExceeded reply and
    is closed (one thread per connection)."""
    session_connections: int = _f(256, "connections of one client process; more are shed")
    """Connections of one client process (a process that leaks connections is shed
    itself, not the others)."""
    backlog: int = _f(1024, "listen backlog (capped by net.core.somaxconn)")
    """Connections the kernel queues before ``accept``: a burst of clients waits there."""
    fd_reserve: int = _f(
        64, "descriptors kept free for the store's own files; connections and buffers shed first"
    )
    """Descriptors (RLIMIT_NOFILE) kept for the store itself: connections and shared
    buffers (one descriptor each) may use the rest; at most half of what is left after
    start-up is reserved when the limit is low."""
    max_request_bytes: int = _f(MAX_REQUEST, "largest request frame (bytes)")
    """Largest request frame; a longer length prefix ends the connection after an error
    reply (the stream cannot be resynchronised)."""
    body_timeout_s: float = _f(30.0, "seconds from a frame's first byte to its last")
    """A frame whose bytes do not all arrive within this ends its connection."""
    bodies_bytes: int = _f(
        256 * MiB, "request bodies being received at once, all connections (bytes)"
    )
    """Bytes of large request bodies being received at once, all connections together
    (bodies are read in pieces; the announced length is never allocated up front). A
    frame that would exceed it is read, discarded and refused."""
    session_bodies_bytes: int = _f(
        64 * MiB, "request bodies one client process may be sending at once (bytes)"
    )
    """The same for one client: slow senders of one process cannot hold the whole
    bodies budget for a body deadline at a time."""
    max_chunks: int = _f(16384, "chunks in one lookup, put or load")
    """Chunks in one lookup, put or load: bounds the work (hashing, index updates under
    the store's lock) and the memory of one request."""
    max_extra_key_bytes: int = _f(16 * KiB, "bytes of extra keys in one request")
    """Bytes of ``extra_keys`` in one request (each chunk's key hashes all of them)."""
    identity_cache_bytes: int = _f(
        1 * MiB, "decoded model identities kept for the next request, all sessions (bytes)"
    )
    """Model identities decoded once and kept for the requests that repeat them (a
    lookup's identity), all sessions together; the oldest go first."""
    audits: int = _f(1, "audits (the check verb) running at once, all sessions")
    """Audits running at once: ``check`` reads every replica; one more is refused."""
    puts: int = _f(16384, "pending puts, all sessions")
    session_puts: int = _f(1024, "pending puts of one client")
    put_share: float = _f(
        1.0, "arena share that pending puts and staged extents may hold, all sessions"
    )
    """Pending puts (every chunk, whole pages, whether it reserved an extent or another
    put is writing it) and staged extents, as a share of the arena."""
    session_put_share: float = _f(
        0.5, "arena share that one client's puts and staged extents may hold"
    )
    """The same for one client: it cannot take the whole arena from the others. A client's
    ``put_prompt`` larger than half of it is stored in several puts, each within it."""
    session_staged_bytes: int = _f(256 * MiB, "staged extents one client may hold (bytes)")
    """Extents staged for one client's next puts (within half its put share: the other
    half is left for its puts)."""
    loads: int = _f(16384, "load grants held, all sessions")
    session_loads: int = _f(1024, "load grants one client may hold")
    grant_share: float = _f(4.0, "bytes of load grants held, all sessions (share of the arena)")
    """Bytes of the chunks granted to clients and not released yet (whole pages each), as
    a share of the arena: grants pin extents (disk reads, replicas evicted since)."""
    session_grant_share: float = _f(
        1.0, "bytes of load grants one client may hold (share of the arena)"
    )
    buffers: int = _f(4096, "shared buffers, all sessions")
    session_buffers: int = _f(256, "shared buffers of one client")
    buffer_bytes: int = _f(64 * GiB, "bytes of shared buffers, all sessions")
    session_buffer_bytes: int = _f(16 * GiB, "bytes of shared buffers of one client")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise InvalidArgument(f"--{flag(f.name)} must be > 0, got {value}")
        if self.max_request_bytes > MAX_REQUEST:
            raise InvalidArgument(
                f"--max-request-bytes {self.max_request_bytes} exceeds the protocol's {MAX_REQUEST}"
            )


def flag(name: str) -> str:
    """The command-line flag of a field (``session_puts`` -> ``session-puts``,
    ``body_timeout_s`` -> ``body-timeout``)."""
    return (name[:-2] if name.endswith("_s") else name).replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`Limits`, with its help text and default."""
    group = parser.add_argument_group("limits (docs/server.md, Limits)")
    for f in dataclasses.fields(Limits):
        kind = float if isinstance(f.default, float) else int
        metavar = "S" if f.name.endswith("_s") else "F" if kind is float else "N"
        group.add_argument(
            f"--{flag(f.name)}",
            dest=f"limit_{f.name}",
            type=kind,
            metavar=metavar,
            default=f.default,
            help=f"{f.metadata['help']} (default {f.default})",
        )


Held = dict[str, int]
"""Amounts of some budgets held, by budget."""
Charge = dict[str, int]
"""Amounts of some budgets taken or given back together."""

INFINITE = 1 << 62


@dataclass(slots=True)
class Peer:
    """A client process: the per-session bounds bind what all its connections hold
    together (a second connection does not double its share)."""

    pid: int | None
    """Its ``SO_PEERCRED`` pid (the process that connected); None when the kernel could
    not say (a peer in another pid namespace): then the connection is a client alone."""
    held: Held = field(default_factory=dict)
    accounts: int = 0
    """Open accounts (connections) charged to it; it is forgotten at 0."""

    def name(self) -> str:
        return f"client process {self.pid}" if self.pid is not None else "a client of unknown pid"


@dataclass(slots=True)
class Account:
    """What one connection (its session) holds of each budget, charged to its
    :class:`Peer` too; given back whole when the connection ends."""

    peer: Peer
    held: Held = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Budget:
    """One budget: its server-wide and per-client bounds and the flags that set them."""

    total: int
    session: int
    """What one client (all its connections) may hold."""
    total_flag: str
    session_flag: str
    what: str


def budgets(limits: Limits, arena_bytes: int, descriptors: int) -> dict[str, Budget]:
    """The ledger's budgets, resolved against the arena and the descriptors free."""

    def share(fraction: float) -> int:
        return max(PAGE, int(fraction * arena_bytes))

    put_share = share(limits.session_put_share)
    return {
        "connections": Budget(
            limits.max_connections,
            limits.session_connections,
            "max-connections",
            "session-connections",
            "connections",
        ),
        "descriptors": Budget(descriptors, INFINITE, "fd-reserve", "", "descriptors"),
        "puts": Budget(limits.puts, limits.session_puts, "puts", "session-puts", "pending puts"),
        "put_bytes": Budget(
            share(limits.put_share),
            put_share,
            "put-share",
            "session-put-share",
            "bytes of pending puts and staged extents",
        ),
        # staging is best effort and keeps to half the client's put share: the other half
        # is always left for its puts (a put_prompt splits at half the share, so a client's
        # staged extents never refuse its own next put)
        "staged_bytes": Budget(
            share(limits.put_share),
            min(limits.session_staged_bytes, put_share // 2),
            "put-share",
            "session-staged-bytes",
            "bytes of staged extents",
        ),
        "loads": Budget(
            limits.loads, limits.session_loads, "loads", "session-loads", "load grants"
        ),
        "grant_bytes": Budget(
            share(limits.grant_share),
            share(limits.session_grant_share),
            "grant-share",
            "session-grant-share",
            "bytes of load grants",
        ),
        "buffers": Budget(
            limits.buffers, limits.session_buffers, "buffers", "session-buffers", "shared buffers"
        ),
        "buffer_bytes": Budget(
            limits.buffer_bytes,
            limits.session_buffer_bytes,
            "buffer-bytes",
            "session-buffer-bytes",
            "bytes of shared buffers",
        ),
        "bodies_bytes": Budget(
            limits.bodies_bytes,
            limits.session_bodies_bytes,
            "bodies-bytes",
            "session-bodies-bytes",
            "bytes of request bodies being received",
        ),
        "audits": Budget(limits.audits, limits.audits, "audits", "audits", "audits running"),
    }


PAGE = 4096
"""The arena's page (``kvlife.tiers.buffers.ALIGN``; not imported: ``kvlife serve
--help`` builds its flags from this module without numpy)."""
REQUEST_LIMITS = ("chunks", "extra_key_bytes", "request_bytes", "decoded")
"""Refusals of one request that no ledger budget counts (its size or its work)."""


def page_charge(nbytes: int) -> int:
    """What one chunk costs of a byte budget: whole pages, as in the arena (so a chunk
    of a few bytes is not free, and the lists of a lease are bounded too)."""
    return (max(nbytes, 1) + PAGE - 1) // PAGE * PAGE


class Ledger:
    """What the sessions hold of each budget, server-wide and per client, and the
    refusals."""

    def __init__(self, table: dict[str, Budget]) -> None:
        self.table = table
        self.used = dict.fromkeys(table, 0)
        self.refused = dict.fromkeys((*table, *REQUEST_LIMITS), 0)
        self._peers: dict[int, Peer] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ accounts

    def open(self, pid: int | None) -> Account:
        """An account for a new connection of the process ``pid`` (None: unknown, a
        client of its own), charged to that process with its other connections."""
        with self._lock:
            peer = self._peers.get(pid) if pid is not None else None
            if peer is None:
                peer = Peer(pid)
                if pid is not None:
                    self._peers[pid] = peer
            peer.accounts += 1
            return Account(peer)

    def close(self, account: Account) -> None:
        """Give back everything ``account`` holds (its connection ended) and forget its
        client once it has no connection left."""
        with self._lock:
            self._add(account, dict(account.held), -1)
            account.held.clear()
            peer = account.peer
            peer.accounts -= 1
            if peer.accounts == 0 and peer.pid is not None:
                self._peers.pop(peer.pid, None)

    @property
    def peers(self) -> int:
        """Client processes with a connection (those of unknown pid not counted)."""
        with self._lock:
            return len(self._peers)

    # ------------------------------------------------------------------ taking

    def take(self, account: Account, charge: Charge, who: str) -> None:
        """Add every amount of ``charge`` (budget -> amount) to ``account`` and its
        client, all or none: LimitExceeded, counted against the first budget that would
        be exceeded (nothing taken then)."""
        with self._lock:
            kind = self._over(account, charge)
            if kind is None:
                self._add(account, charge, 1)
                return
            why = self._why(account, kind, charge[kind], who)
        raise self.refuse(kind, why)

    def try_take(self, account: Account, charge: Charge) -> bool:
        """Like :meth:`take`, without a refusal (for best-effort holdings such as staged
        extents): False when it does not fit."""
        with self._lock:
            if self._over(account, charge) is not None:
                return False
            self._add(account, charge, 1)
        return True

    def force(self, account: Account, charge: Charge) -> None:
        """Take without a check: amounts moving back to where they were just released."""
        with self._lock:
            self._add(account, charge, 1)

    def give(self, account: Account, charge: Charge) -> None:
        """Give back what ``account`` holds of ``charge`` (more than it holds is a broken
        invariant: AssertionError, never clamped)."""
        with self._lock:
            for kind, amount in charge.items():
                if amount > account.held.get(kind, 0):
                    raise AssertionError(
                        f"{kind}: giving back {amount}, holding {account.held.get(kind, 0)}"
                    )
            self._add(account, charge, -1)

    def _over(self, account: Account, charge: Charge) -> str | None:
        mine = account.peer.held
        for kind, amount in charge.items():
            b = self.table[kind]
            if mine.get(kind, 0) + amount > b.session or self.used[kind] + amount > b.total:
                return kind
        return None

    def _add(self, account: Account, charge: Charge, sign: int) -> None:
        used, held, peer = self.used, account.held, account.peer.held
        for kind, amount in charge.items():
            held[kind] = held.get(kind, 0) + sign * amount
            peer[kind] = peer.get(kind, 0) + sign * amount
            used[kind] += sign * amount

    def refuse(self, kind: str, message: str) -> LimitExceeded:
        """The error of a refusal of ``kind`` (counted)."""
        with self._lock:
            self.refused[kind] += 1
        return LimitExceeded(message)

    def _why(self, account: Account, kind: str, amount: int, who: str) -> str:
        b = self.table[kind]
        peer = account.peer
        mine = peer.held.get(kind, 0)
        if mine + amount > b.session:
            return (
                f"{who} would make {peer.name()} ({peer.accounts} connection(s)) hold "
                f"{mine + amount} {b.what}; one client may hold {b.session} (--{b.session_flag})"
            )
        return (
            f"{who}: the server's sessions hold {self.used[kind]} {b.what}, {amount} more "
            f"would exceed {b.total} (--{b.total_flag})"
        )

    def figures(self) -> dict[str, int]:
        """``held_<budget>``, ``limit_<budget>`` and ``refused_<budget>`` of every budget
        (``state``, ``kvlife info``), and ``peers``: client processes connected."""
        with self._lock:
            out = {f"held_{k}": v for k, v in self.used.items()}
            out.update({f"limit_{k}": b.total for k, b in self.table.items()})
            out.update({f"refused_{k}": v for k, v in self.refused.items()})
            out["peers"] = len(self._peers)
        return out
