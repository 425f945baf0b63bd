"""Reading request frames on the server, under its budgets.

A frame's announced length is never allocated up front (a 4-byte header alone cost the
server 16 MiB until its body timed out): small frames land in the connection's receive
buffer, which also takes whatever follows them in the same ``recv`` (a client sends its
grant releases and its request in one write: one wake-up, one ``recv``); a large body is
received in pieces, charged whole before its first piece to the budget of bodies in
flight, server-wide and of the client process that sends it. Every byte of a frame must
arrive within the body deadline once its first byte did; an idle connection waits as
long as it likes for a next frame.
"""

from __future__ import annotations

import socket
import struct
import time

from kvlife.core.errors import LimitExceeded, ProtocolError
from kvlife.server.limits import Account, Ledger, Limits
from kvlife.server.protocol import POLL_WAIT_S, Idle

RECV_BYTES = 256 << 10
"""The connection's receive buffer: frames up to this (header included) are read into
it whole; longer bodies are received in pieces of :data:`PIECE_BYTES`."""
PIECE_BYTES = 1 << 20
_LEN = struct.Struct(">I")


class FrameTooLarge(ProtocolError):
    """A length prefix beyond ``--max-request-bytes``: the connection ends."""


class BodyTimeout(ProtocolError):
    """A frame whose bytes did not all arrive within ``--body-timeout``: the connection
    ends."""


class Discarded(LimitExceeded):
    """A frame that was read and dropped because receiving it would exceed the budget of
    bodies in flight; ``rid`` is its request id when its first bytes said it (0 if not)."""

    def __init__(self, message: str, rid: int) -> None:
        super().__init__(message)
        self.rid = rid


class FrameReader:
    """The frames of one connection, one at a time."""

    def __init__(
        self, sock: socket.socket, limits: Limits, ledger: Ledger, account: Account
    ) -> None:
        self.sock = sock
        self.limits = limits
        self.ledger = ledger
        self.account = account
        """The connection's account: bodies are charged to its client process too."""
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._deadline = 0.0
        self._slow = False
        """The socket's timeout is the body deadline's (restored when the frame is in)."""

    def next(self) -> bytes | None:
        """The next frame's body; None at a clean end of stream between frames.
        :class:`~kvlife.server.protocol.Idle` when no frame began within the socket's
        timeout; FrameTooLarge and BodyTimeout end the connection; Discarded does not."""
        try:
            return self._next()
        finally:
            if self._slow:
                self._slow = False
                self.sock.settimeout(POLL_WAIT_S)

    def _next(self) -> bytes | None:
        if self._end == self._start:
            self._start = self._end = 0
            try:  # between frames: the socket's own (long) timeout, in poll
                k = self.sock.recv_into(self._view)
            except TimeoutError:
                raise Idle from None
            if k == 0:
                return None
            self._end = k
        self._deadline = time.monotonic() + self.limits.body_timeout_s
        while self._end - self._start < _LEN.size:
            self._need()
        (n,) = _LEN.unpack_from(self._buf, self._start)
        if n > self.limits.max_request_bytes:
            self.ledger.refuse("request_bytes", "")
            raise FrameTooLarge(
                f"frame of {n} bytes exceeds the limit of {self.limits.max_request_bytes} "
                "(--max-request-bytes)"
            )
        total = _LEN.size + n
        if total > RECV_BYTES:
            return self._large(n)
        while self._end - self._start < total:
            self._need()
        body = bytes(self._view[self._start + _LEN.size : self._start + total])
        self._start += total
        return body

    def _large(self, n: int) -> bytes:
        """A body longer than the receive buffer: in pieces, charged to the budget of
        bodies in flight before they are received (every byte buffered so far is this
        frame's: it is longer than the buffer)."""
        head = bytes(self._view[self._start + _LEN.size : self._end])
        self._start = self._end = 0
        got = len(head)
        pieces: list[bytes | bytearray] = [head]
        try:
            self.ledger.take(self.account, {"bodies_bytes": n}, f"a request body of {n} bytes")
        except LimitExceeded as refused:
            while got < n:  # read and drop: the stream stays in step
                k = self._recv(self._view[: min(RECV_BYTES, n - got)])
                if len(head) < 16:
                    head += bytes(self._view[: min(k, 16 - len(head))])
                got += k
            raise Discarded(str(refused), peek_rid(head)) from None
        try:
            while got < n:
                piece = bytearray(min(PIECE_BYTES, n - got))
                view = memoryview(piece)
                have = 0
                while have < len(piece):
                    have += self._recv(view[have:])
                pieces.append(piece)
                got += have
            return b"".join(pieces)
        finally:
            self.ledger.give(self.account, {"bodies_bytes": n})

    # ------------------------------------------------------------------ receiving

    def _need(self) -> None:
        """More bytes of the frame under way (moved to the front of the buffer first
        when they reach its end: a frame that fits the buffer fits it from the front)."""
        if self._end == RECV_BYTES:
            have = self._end - self._start
            self._buf[:have] = self._buf[self._start : self._end]
            self._start, self._end = 0, have
        self._end += self._recv(self._view[self._end :])

    def _recv(self, view: memoryview) -> int:
        """Some bytes of a frame under way, within its deadline (an end of stream inside
        a frame is a ConnectionResetError)."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._timeout()
        self._slow = True
        self.sock.settimeout(left)
        try:
            k = self.sock.recv_into(view)
        except TimeoutError:
            raise self._timeout() from None
        if k == 0:
            raise ConnectionResetError("the stream ended inside a frame")
        return k

    def _timeout(self) -> BodyTimeout:
        return BodyTimeout(
            f"a frame did not arrive within {self.limits.body_timeout_s} s of its first byte "
            "(--body-timeout)"
        )


def peek_rid(head: bytes) -> int:
    """The request id of a frame from its first bytes (``[rid, ...]``), or 0: a frame
    refused before it was decoded is answered to the request that sent it."""
    if len(head) < 2 or head[0] != 0x93:
        return 0
    tag = head[1]
    if tag <= 0x7F:
        return tag
    sizes = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    size = sizes.get(tag)
    if size is None or len(head) < 2 + size:
        return 0
    rid = int.from_bytes(head[2 : 2 + size], "big")
    return rid if rid < 2**63 else 0
