"""What the protocol objects of one session share: the server, the session's holdings of
the budgets, its lock and ids, and the checks every request passes before it reaches
the store (a prompt decoded, chunks per request, extra-key bytes, a chunk that fits the
arena), and who is connected: the peer's credentials and, on a server with principals
(``--tenants``), the session's principal, which turns the namespace a request names into
the keyed namespace of its scope (:mod:`kvlife.tenancy.scopes`) and searches its
readable scopes on a lookup. A request may name the chunk before its tokens by every
token before them (``prefix_tokens``) rather than by a key: the server derives the key
in the keyed namespace, which no client can (:meth:`kvlife.core.objects.PromptRef.chained`).
:mod:`kvlife.server.loads` and :mod:`kvlife.server.puts` each hold one."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlife.core.errors import (
    InvalidArgument,
    NotAuthenticated,
    ProtocolError,
    StorageFullError,
)
from kvlife.core.identity import ROOT_PARENT, ChunkKey, KVLayout, Namespace
from kvlife.core.objects import PromptRef
from kvlife.results import LookupResult
from kvlife.server import protocol
from kvlife.server.limits import Account, Charge
from kvlife.server.shm_arenas import admits, owner_of
from kvlife.tenancy.policy import WITHHELD
from kvlife.tenancy.principals import REFUSED, Principal

if TYPE_CHECKING:
    from kvlife.server.session import ServerState

PartSender = Callable[[bytes], None]
"""Sends one frame to the session's client (partial replies of a streamed load)."""


@dataclass(frozen=True, slots=True)
class Peer:
    """Who the kernel says connected (``SO_PEERCRED``): the client cannot choose these."""

    pid: int | None
    """The client's pid (None: outside this pid namespace, or unknown)."""
    uid: int | None
    """Its effective Unix user when it connected."""
    gid: int | None
    """Its effective primary Unix group when it connected."""


UNKNOWN_PEER = Peer(None, None, None)


class SessionContext:
    """One session's share of the server, and its checks of a request's size."""

    def __init__(
        self,
        server: ServerState,
        sid: int,
        account: Account,
        part: PartSender | None = None,
        peer: Peer = UNKNOWN_PEER,
    ) -> None:
        self.server = server
        self.store = server.store
        self.shm = server.shm
        self.arena = server.arena
        """The arena this session's extents are in (its grants, staged puts, hints):
        without principals the server's one arena; with them its principal's own
        (:meth:`bind`)."""
        self.mapped = server.tenancy is None
        """Whether the client maps :attr:`arena` (False: a session of a principal with
        no arena its peer may map; nothing of an arena is handed to it, it puts and
        loads through the socket: :mod:`kvlife.server.shm_copies`)."""
        self.ledger = server.ledger
        self.limits = server.limits
        self.sid = sid
        self.account = account
        """What this session holds of each budget (given back whole when it ends), and
        the client process it is charged to."""
        self.lock = threading.Lock()
        """Guards the leases of the session's protocol objects and its ids."""
        self.closed = False
        """The session ended: nothing more is staged or kept for it."""
        self.part = part
        """Where partial replies go (the server sets it for the connection)."""
        self.rid = 0
        """Id of the request being handled (partial replies carry it)."""
        self._ids = itertools.count(1)
        self.peer = peer
        """Who connected, as the kernel says."""
        self.tenancy = server.tenancy
        """The server's principals and scopes (None: a single-tenant server, every
        client trusted alike, namespaces as the client names them)."""
        self.principal: Principal | None = (
            self.tenancy.config.by_peer(peer.uid, peer.gid) if self.tenancy is not None else None
        )
        """The session's principal: its peer's, or its token's after ``hello`` (None on
        a server with principals: not authenticated, nothing but ``hello`` is served)."""
        self._by_peer = self.principal
        """The principal its peer's credentials name (None: none): the kernel's word,
        which no token expiry ends."""

    def tenant(self) -> Principal:
        """The session's principal (NotAuthenticated if it has none). A principal reached
        by a token is checked against the token's expiry on every request: a session
        that said ``hello`` before its token expired is not served after (it would
        otherwise keep the principal for as long as the connection lives)."""
        p = self.principal
        if p is None:
            raise NotAuthenticated(REFUSED)
        expires = p.token_expires
        if expires is not None and p is not self._by_peer and time.time() >= expires:
            self.principal = None  # as a refused hello leaves it: nothing is served
            raise NotAuthenticated(REFUSED)
        return p

    def bind(self) -> None:
        """On a server with principals: the session's arena becomes its principal's,
        if the peer's credentials are ones that arena admits (the kernel's word: a
        token names the principal, not the Unix user who may map its file); else the
        session maps none (:attr:`mapped` False)."""
        if self.tenancy is None:
            return
        arenas = self.server.tenant_arenas
        assert arenas is not None
        self.arena, self.mapped = self.server.arena, False
        principal = self.tenant()
        owner = owner_of(principal)
        if owner is None or not admits(owner, self.peer.uid, self.peer.gid):
            return
        try:
            arena = arenas.arena_of(principal)
        except StorageFullError:
            return  # no room for its arena in shared memory now: copies through the socket
        if arena is not None:
            self.arena, self.mapped = arena, True

    def new_id(self) -> int:
        """An id for a lease of this session (under :attr:`lock`)."""
        return next(self._ids)

    # ------------------------------------------------------------------ budgets

    def take(self, charge: Charge, who: str) -> None:
        """Charge the session's budgets (LimitExceeded, counted, if it would exceed
        one); ``who`` names the session and the lease in the refusal."""
        self.ledger.take(self.account, charge, who)

    def try_take(self, charge: Charge) -> bool:
        return self.ledger.try_take(self.account, charge)

    def give(self, charge: Charge) -> None:
        self.ledger.give(self.account, charge)

    def force(self, charge: Charge) -> None:
        """Charge without a check (bytes given back a moment ago, taken again)."""
        self.ledger.force(self.account, charge)

    # ------------------------------------------------------------------ requests

    def prompt(self, args: dict[str, Any], *, write: bool = False) -> PromptRef:
        """The prompt of a ``lookup``, ``prepare_put`` or ``put`` (``write``), its extra
        keys and chunks within the limits. On a server with principals its namespace is
        the keyed namespace of the scope it names (a put's: one its principal may write,
        else NotPermitted; a lookup's: the most private of those it searches)."""
        tokens = args["tokens"]
        if len(tokens) % 4:
            raise ProtocolError("tokens must be little-endian u32 ids (a multiple of 4 bytes)")
        extra = args.get("extra_keys", ())
        if extra:
            nbytes = sum(len(e) for e in extra)
            if nbytes > self.limits.max_extra_key_bytes:
                raise self.ledger.refuse(
                    "extra_key_bytes",
                    f"{nbytes} bytes of extra keys in one request; at most "
                    f"{self.limits.max_extra_key_bytes} (--max-extra-key-bytes)",
                )
        prefix = args.get("prefix_tokens")
        if prefix is not None and len(prefix) % 4:
            raise ProtocolError("prefix_tokens must be little-endian u32 ids")
        namespace = self.namespace(args["namespace"], write=write)
        identity = self.server.identities.get(args["identity"])
        # a prefix's chunks are hashed too (the parent is derived from them)
        ntokens = (len(tokens) + len(prefix or b"")) // 4
        self.chunks(ntokens // max(1, identity.layout.tokens_per_chunk))
        p = PromptRef(
            identity,
            namespace,
            np.frombuffer(tokens, "<u4"),
            args.get("start", 0),
            ChunkKey(args.get("parent", ROOT_PARENT)),
            list(args.get("extra_keys", ())),
            protocol.decode_spans(args.get("sources", [])),
            prefix_tokens=None if prefix is None else np.frombuffer(prefix, "<u4"),
        )
        p.check_prefix()  # kept, not derived yet: each scope a lookup searches has its own
        return p

    def namespace(self, text: str, *, write: bool = False) -> Namespace:
        """The namespace a request names by ``text``: as written on a single-tenant
        server; else the session principal's keyed scope (a write's: one it may write)."""
        if self.tenancy is None:
            return protocol.decode_namespace(text)
        scopes = self.tenancy.scopes
        principal = self.tenant()
        if write:
            return scopes.for_write(principal, text)
        return scopes.named(principal, text)

    def lookup(self, p: PromptRef, **opts: Any) -> LookupResult:
        """The store's lookup of ``p``. With principals: each scope its principal may
        read, most private first from the one ``p`` names, until one holds the whole
        prompt; the longest run of hits answers (a tie: the more private scope). The
        answer depends on the scopes the principal may read only. A parent named by its
        prefix tokens is derived in each scope (a parent key is one scope's)."""
        scopes = [p.namespace]
        if self.tenancy is not None:
            scopes = self.tenancy.scopes.wider(self.tenant(), p.namespace)
        best: LookupResult | None = None
        for ns in scopes:
            q = replace(p, namespace=ns).chained()
            res = self.store.lookup(
                q.identity,
                ns,
                q.tokens,
                start=q.start,
                parent=q.parent,
                extra_keys=q.extra_keys,
                sources=q.sources,
                **opts,
            )
            if best is None or len(res.hits) > len(best.hits):
                best = res
            if len(best.hits) == best.chunks_total:
                break
        assert best is not None
        return best

    def visible(self, key: ChunkKey) -> ChunkKey:
        """``key``, or :data:`~kvlife.tenancy.policy.WITHHELD` (a key no chunk has) when
        it is the key of an object the session's principal may not read, or of none
        (another tenant's may be committed before the store acts on it: the store's
        lock is let go in between): whatever the store does with it then (is it live?)
        answers as for a key not stored."""
        if self.tenancy is None:
            return key
        (stored,) = self.store.namespaces_of([key])
        if stored is not None and self.tenancy.scopes.may_read(self.tenant(), stored):
            return key
        return WITHHELD

    def chunks(self, n: int) -> None:
        """``n`` chunks in one request, within ``--max-chunks``."""
        if n > self.limits.max_chunks:
            raise self.ledger.refuse(
                "chunks",
                f"{n} chunks in one request; at most {self.limits.max_chunks} (--max-chunks)",
            )

    def fits(self, layout: KVLayout) -> None:
        """A chunk of ``layout`` fits the arena at all."""
        if layout.chunk_nbytes > self.arena.size:
            raise InvalidArgument(
                f"a chunk of this layout is {layout.chunk_nbytes} bytes, more than the "
                f"whole of {self.arena_text()}"
            )

    def arena_text(self) -> str:
        """Whose arena :attr:`arena` is and its size, for an error that it is full."""
        arenas = self.server.tenant_arenas
        name = arenas.whose(self.arena) if arenas is not None else None
        if name is None:
            return f"the server's arena ({self.arena.size} bytes)"
        return (
            f"principal {name}'s arena ({self.arena.size} bytes: arena_bytes, or [arenas] "
            "principal_bytes, in the tenants file)"
        )
