"""The wire of a RemoteStore: its one connection to ``kvlife serve`` at a time, the
exchange of one request and its reply, and the grants handed back.

Calls are serialised on the connection (one lock): a request is sent, then its partial
replies (a streamed load) and its reply are read; work the client does meanwhile
(``after_send``: the copies of a hinted load) runs inside that serialisation. A request
whose reply was not read when something failed leaves the stream out of step: the
connection is dropped, which makes the server release everything its session held,
and the next call connects again (a restarted server is picked up by itself; a forked
child gets its own connection). A lost or unreachable server is
:class:`~kvlife.core.errors.StoreUnavailable`.

Load grants go back to the server without a round trip of their own: they ride ahead
of the next request (at most :data:`RELEASE_BATCH` wait).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np

from kvlife.client.connection import Connection, error_from_reply, next_epoch
from kvlife.core import errors
from kvlife.core.errors import KVLifeError, StoreUnavailable
from kvlife.server import protocol

RELEASE_BATCH = 8
"""Finished loads whose grants wait for the next request before being sent alone."""

OnPart = Callable[[Connection, Any], None]
"""Takes one partial reply (a streamed chunk's grant) on the connection it came on."""
OnConnection = Callable[[Connection], None]
"""Work on the connection around a request (before it, or while the server handles it)."""


class StaleExtents(Exception):
    """Staged extents taken from a connection that was replaced before they were used."""


class Wire:
    """One RemoteStore's connection to its server, replaced when it is lost."""

    def __init__(self, socket_path: str, timeout: float | None, token: str | None = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._token = token
        """Sent in every ``hello`` (a reconnect authenticates again)."""
        self.conn: Connection | None = None
        self.epoch = 0
        """The number of this wire's current connection, unique in the process
        (:func:`~kvlife.client.connection.next_epoch`): pending puts and lookups remember
        theirs, and what they were told holds on that connection only (what a lost
        connection leased is gone; another client's lookup names another server's
        frames and arena)."""
        self.lock = threading.Lock()
        self.names: list[str] = []
        """The server's tier names, fastest first (from its ``hello``)."""
        self.closed = False
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def connected(self) -> Connection:
        """The connection, made now if there is none (under :attr:`lock`)."""
        if self.conn is not None and self._pid != os.getpid():
            # a forked child (engines fork their workers): the parent's connection and
            # leases are the parent's; this process gets its own session
            self.conn.sock.detach()
            self.conn = None
            self._pool = None
        if self.conn is not None:
            return self.conn
        self._pid = os.getpid()
        try:
            conn = Connection(self.socket_path, self.timeout)
        except OSError as exc:
            raise protocol.unavailable(self.socket_path, exc) from None
        try:
            greeting: dict[str, Any] = {"version": protocol.PROTOCOL_VERSION}
            if self._token is not None:
                greeting["token"] = self._token
            hello = self.roundtrip(conn, "hello", greeting)
            if hello["arena"]:  # "": none to map (kvlife.client.copies)
                # a principal's arena is sparse: not populated (Connection.map_arena)
                populate = not hello.get("principal")
                conn.map_arena(hello["arena"], hello["arena_bytes"], populate)
        except OSError as exc:
            refusal = conn.refusal()  # shed for a budget: the server said why
            conn.close()
            if refusal is not None:
                raise refusal from None
            raise protocol.unavailable(self.socket_path, exc) from None
        except BaseException:
            conn.close()
            raise
        conn.hello = hello
        self.names = list(hello["tiers"])
        self.epoch = next_epoch()
        conn.epoch = self.epoch
        self.conn = conn
        return conn

    def roundtrip(
        self,
        conn: Connection,
        verb: str,
        args: dict[str, Any],
        on_part: OnPart | None = None,
        after_send: OnConnection | None = None,
    ) -> Any:
        """Send one request (the waiting grant releases ahead of it), run ``after_send``,
        read its partial replies into ``on_part`` and return its result."""
        rid = next(conn.rid)
        frame = protocol.pack([rid, verb, args])
        if conn.releases:  # grants of finished loads ride along (no reply, in order)
            frame = _releases(conn.releases) + frame
            conn.releases.clear()
        conn.pending = True
        conn.sock.sendall(frame)
        failed: BaseException | None = None
        if after_send is not None:  # work while the server handles the request
            try:
                after_send(conn)
            except Exception as exc:  # the reply is read first: the stream stays in step
                failed = exc
        while True:
            body = protocol.recv_frame(conn.sock)
            if body is None:
                raise ConnectionResetError("the server closed the connection")
            reply = msgpack.unpackb(body, raw=False)
            if reply[0] != rid:
                if reply[0] == 0 and reply[1] is False:
                    # about the connection, not a request (shed for a budget, a frame
                    # it could not read): raised as sent; the connection is dropped
                    kind, message = reply[2]
                    raise error_from_reply(kind, message)
                raise ConnectionResetError(f"reply {reply[0]} to request {rid}")
            if reply[1] != protocol.PART:
                break
            if on_part is None:
                raise ConnectionResetError(f"a partial reply to {verb}")
            if failed is None:
                try:
                    on_part(conn, reply[2])
                except Exception as exc:  # read the stream to its end first
                    failed = exc
        conn.pending = False
        if not reply[1]:
            kind, message = reply[2]
            raise error_from_reply(kind, message)
        if failed is not None:
            # the reply granted what a copy that failed will never release: hand it
            # back now (no reply; a lost connection released it anyway)
            load = reply[2].get("load") if verb == "load" else None
            if load:
                with contextlib.suppress(OSError):
                    conn.sock.sendall(_releases([load]))
            raise failed
        return reply[2]

    def call(self, verb: str, args: dict[str, Any]) -> Any:
        return self.call_on(verb, args)[0]

    def call_on(
        self,
        verb: str,
        args: dict[str, Any],
        on_part: OnPart | None = None,
        after_send: OnConnection | None = None,
        before: OnConnection | None = None,
        after_reply: OnConnection | None = None,
    ) -> tuple[Any, Connection]:
        """The result and the connection it came on: grants name offsets in that
        connection's arena (another thread may reconnect to a new server meanwhile).
        ``before`` runs on the connection first (under the same lock), ``after_send``
        once the request is sent and before its reply is read, ``after_reply`` once a
        result came (still under the lock: what it sends follows the request)."""
        if self.closed:
            raise errors.StoreClosedError(f"RemoteStore for {self.socket_path} is closed")
        with self.lock:
            conn = self.connected()
            try:
                if before is not None:
                    try:
                        before(conn)
                    except StaleExtents:
                        raise
                    except BaseException:
                        # it may have sent half of an exchange (a deferred put whose
                        # chunks were not all written): the server must abort it, and
                        # closing the connection makes it do so
                        self.drop()
                        raise
                result = self.roundtrip(conn, verb, args, on_part, after_send)
                if after_reply is not None:
                    conn.pending = True  # what it sends belongs to this exchange
                    after_reply(conn)
                    conn.pending = False
                return result, conn
            except (OSError, ValueError, msgpack.UnpackException) as exc:
                if not conn.pending:  # the exchange is complete: not the connection's
                    raise  # error (a reply's, or a copy's that failed meanwhile)
                self.drop()
                if isinstance(exc, KVLifeError):
                    raise
                raise protocol.unavailable(self.socket_path, exc) from None
            except BaseException:
                # out of step (an interrupt, a connection-level refusal): the server
                # releases what the exchange granted when the connection goes
                if conn.pending:
                    self.drop()
                raise

    def connect(self) -> None:
        """Connect now if not connected (its ``hello`` only: a wrong path, a server
        that sheds the client or refuses its token fails here, typed)."""
        if self.closed:
            raise errors.StoreClosedError(f"RemoteStore for {self.socket_path} is closed")
        with self.lock:
            self.connected()

    def put_share(self) -> int:
        """Bytes of the arena this client's puts may hold at once (its server's
        ``--session-put-share``, from its ``hello``; 0 if it named none)."""
        with self.lock:
            if self.closed:
                return 0  # the call that follows raises StoreClosedError
            return int(self.connected().hello.get("put_share", 0))

    def mapped(self) -> bool:
        """Whether this client maps its server's arena (False: its session puts and
        loads through the socket, :mod:`kvlife.client.copies`)."""
        with self.lock:
            if self.closed:
                return True  # the call that follows raises StoreClosedError
            return self.connected().arena is not None

    def release(self, load: int, conn: Connection) -> None:
        """Give a load's grant back: with the next request (no round trip of its own),
        or now when many are waiting. A lost connection released it anyway."""
        with self.lock:
            if conn is not self.conn:
                return
            conn.releases.append(load)
            if len(conn.releases) < RELEASE_BATCH:
                return
            frames = _releases(conn.releases)
            conn.releases.clear()
            try:
                conn.sock.sendall(frames)
            except OSError:
                self.drop()

    def disown(self, conn: Connection) -> None:
        """Drop ``conn`` (if it still is the connection) after a reply this client could
        not read (:mod:`kvlife.client.replies`): the server then releases what its
        session held (a grant, a pending put, staged extents), and the next call
        connects again."""
        with self.lock:
            if conn is self.conn:
                self.drop()

    def drop(self) -> None:
        """Close the connection (the server then releases what its session held)."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def view(self, conn: Connection, off: int, dtype: str, shape: Sequence[int]) -> np.ndarray:
        """The extent at ``off`` of ``conn``'s mapping of the arena, as an array."""
        if conn.arena is None:
            raise StoreUnavailable(f"lost the connection to {self.socket_path} during a call")
        dt = np.dtype(dtype)
        n = dt.itemsize
        for d in shape:
            n *= d
        if not 0 <= off <= conn.arena_bytes - n:
            raise errors.ProtocolError(f"server granted [{off}, +{n}) outside its arena")
        try:
            raw = np.frombuffer(conn.arena, np.uint8, count=n, offset=off)
        except ValueError as exc:  # the mapping was closed: the connection was lost
            raise StoreUnavailable(f"lost the connection to {self.socket_path}: {exc}") from None
        return raw.view(dt).reshape(shape)

    def pool(self) -> ThreadPoolExecutor:
        """Threads for the calls that return at once (``put_async``, ``load_async``)."""
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvlife-remote")
            return self._pool

    def close(self) -> None:
        """Wait for the calls in the background, then close for good."""
        pool = self._pool
        if pool is not None:
            pool.shutdown(wait=True)
        with self.lock:
            self.closed = True
            self.drop()


def _releases(loads: list[int]) -> bytes:
    """``release`` requests of these loads, asking for no reply."""
    return b"".join(protocol.pack([0, "release", {"load": i}]) for i in loads)
