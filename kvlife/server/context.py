"""What the protocol objects of one session share: the server, the session's holdings of
the budgets, its lock and ids, and the checks every request passes before it reaches
the store (a prompt decoded, chunks per request, extra-key bytes, a chunk that fits the
arena). :mod:`kvlife.server.loads` and :mod:`kvlife.server.puts` each hold one."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlife.core.errors import InvalidArgument, ProtocolError
from kvlife.core.identity import ROOT_PARENT, ChunkKey, KVLayout
from kvlife.core.objects import PromptRef
from kvlife.server import protocol
from kvlife.server.limits import Account, Charge

if TYPE_CHECKING:
    from kvlife.server.session import ServerState

PartSender = Callable[[bytes], None]
"""Sends one frame to the session's client (partial replies of a streamed load)."""


class SessionContext:
    """One session's share of the server, and its checks of a request's size."""

    def __init__(
        self, server: ServerState, sid: int, account: Account, part: PartSender | None = None
    ) -> None:
        self.server = server
        self.store = server.store
        self.shm = server.shm
        self.arena = server.arena
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

    def prompt(self, args: dict[str, Any]) -> PromptRef:
        """The prompt of a ``lookup``, ``prepare_put`` or ``put``, its extra keys and
        chunks within the limits."""
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
        identity = self.server.identities.get(args["identity"])
        self.chunks(len(tokens) // 4 // max(1, identity.layout.tokens_per_chunk))
        return PromptRef(
            identity,
            protocol.decode_namespace(args["namespace"]),
            np.frombuffer(tokens, "<u4"),
            args.get("start", 0),
            ChunkKey(args.get("parent", ROOT_PARENT)),
            list(args.get("extra_keys", ())),
        )

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
                f"server's whole arena ({self.arena.size} bytes)"
            )
