"""Typed errors of kvlife.

Every failure a caller can act on has its own class, and every message names what was
wrong (the object, the path, the field) so that no one has to read a traceback from deep
inside a tier to find out. All inherit from :class:`KVLifeError`.
"""

from __future__ import annotations


class KVLifeError(Exception):
    """Base class of every error kvlife raises on purpose."""


class IllegalTransition(KVLifeError):
    """A lifecycle move that the transition table does not allow."""

    def __init__(self, obj: str, state: str, move: str) -> None:
        self.obj = obj
        self.state = state
        self.move = move
        super().__init__(f"illegal lifecycle move {move!r} for object {obj} in state {state}")


class LayoutMismatch(KVLifeError, ValueError):
    """A KV array whose dtype or shape does not match the model identity's KV layout."""


class PartialChunkError(KVLifeError, ValueError):
    """A chunk with fewer tokens than the layout's tokens per chunk was offered for storage."""


class InvalidArgument(KVLifeError, ValueError):
    """An argument with a value kvlife cannot use (named in the message)."""


class StorePathError(KVLifeError, OSError):
    """The store path cannot be created, opened or written."""


class StoreLockedError(KVLifeError):
    """Another process holds the store open (kvlife stores are single-process)."""


class StoreFormatError(KVLifeError):
    """The store on disk was written in a format this version cannot read."""


class StoreClosedError(KVLifeError):
    """An operation on a store that has been closed."""


class CloseNotStarted(KVLifeError, RuntimeError):
    """A ``close()`` asked from inside a callback (a sink's ``emit``, ``check``'s
    progress) could not start the thread it closes the store on (the interpreter is
    exiting, or no thread can be made): nothing was closed, the store is still open and
    a later ``close()`` from outside the callback closes it."""


class StorageFullError(KVLifeError, OSError):
    """The device ran out of space (ENOSPC) or the tier's byte budget cannot hold the data."""


class ChecksumMismatch(KVLifeError):
    """A replica's bytes do not match the checksum recorded when it was sealed."""

    def __init__(self, key_hex: str, where: str, detail: str) -> None:
        self.key_hex = key_hex
        self.where = where
        super().__init__(f"replica {key_hex[:16]}… in {where} is corrupt: {detail}")


class ReplicaNotFound(KVLifeError, KeyError):
    """A tier was asked for a replica it does not hold."""


class ReplicaReadError(KVLifeError):
    """A replica could not be read (an I/O error): a miss, but not proof of corruption,
    so the replica is kept."""

    def __init__(self, key_hex: str, where: str, detail: str) -> None:
        self.key_hex = key_hex
        self.where = where
        super().__init__(f"replica {key_hex[:16]}… in {where} could not be read: {detail}")


class CorruptFrame(ChecksumMismatch):
    """A transformed replica's frame that fails its own verification (magic, descriptor
    checksum, the descriptor recorded with the replica, payload length or xxh3-64)."""


class RemoteTierError(KVLifeError):
    """A remote tier (Redis, Mooncake Store) could not be reached or answered wrongly; the
    tier is marked unhealthy and retried after a backoff. Reads turn this into a miss."""


class LeaseError(KVLifeError):
    """A publication to a shared tier was refused because the writer's lease expired,
    was revoked or was superseded (a stale fencing token): nothing of it is visible."""


class IndexUnreachable(RemoteTierError):
    """The global index could not be read: no remote KV may be served (a miss)."""


class StoreUnavailable(KVLifeError, ConnectionError):
    """The store server cannot be reached (not running, restarting, or it went away
    mid-call). An engine treats it as a miss and goes on computing; the client
    reconnects on a later call once the server is back."""


class ProtocolError(KVLifeError, ValueError):
    """A message to or from the store server that is malformed (bad framing, types,
    ranges or lengths, an unknown verb, or a grant the session does not hold)."""


class RemoteError(KVLifeError):
    """An unexpected failure inside the store server, reported to the client (the
    server logs it and keeps serving)."""


class LimitExceeded(KVLifeError):
    """The store server refused a request, a connection or a resource because it would
    exceed one of its budgets (the message names the budget, its value and the
    ``kvlife serve`` flag that sets it); nothing of the refused request was kept. The
    server counts every refusal (``state``: ``refused_<budget>``)."""


class NotAuthenticated(KVLifeError):
    """The store server does not know who is connected: a token that is forged, expired
    or of no principal, or a peer whose Unix user and groups no principal names
    (docs/server.md, "Trust boundary"). The message never says which of these it was."""


class NotPermitted(KVLifeError):
    """A principal asked for something its role does not allow: writing a scope it may
    not write (public needs an admin), naming another principal's namespace, or a verb
    that reads or changes the whole store. It is decided by the principal and the
    request alone, never by what is stored, so it reveals nothing about other tenants."""
