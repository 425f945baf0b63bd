"""The put protocol, client side: the one-round-trip put into staged extents and the
two-phase put (the server side is :mod:`kvlife.server.puts`).

The KV is validated here first, as the embedded store does (``split_chunks``:
LayoutMismatch, PartialChunkError), before anything is sent.

Two-phase (``prepare_put`` / ``commit_put``, and ``put_prompt`` while no extents are
staged for the chunk shape):

1. ``prepare_put`` sends the prompt; the server creates the TENTATIVE objects, reserves
   one arena extent per chunk it lacks and replies with their offsets (and, when asked
   with ``stage``, extents staged for this connection's next puts of that shape).
2. This side copies each new chunk into its extent (a failed copy aborts the put), by
   non-temporal stores where it is large (:func:`kvlife.native.copies.stream_copy`).
3. ``commit_put`` (or ``abort_put``) names the put; the server seals the extents and
   commits them, adopted as the DRAM replicas without a copy.

Staged (``put_prompt`` once extents of the chunk shape are staged for this connection):

1. One staged extent per chunk is taken from this connection's pool.
2. A deferred ``put`` naming them goes out with no reply wanted; the server prepares
   the put while this side copies every chunk into its extent.
   A put of at most :data:`SEAL_PUT_BYTES` is hashed here as it is copied, each block
   hashed and then copied from this core's cache (:func:`kvlife.native.copies.copy_sealed`,
   where the extension can), and its seals go with ``put_commit``. A larger one (or
   without the extension): every 2 MiB or so (a sixteenth of a large put),
   ``put_written`` (no reply) tells the server how many bytes are written: it hashes them
   (the seals) while the rest is copied. In the last step the notices go at each half
   of what is left, down to 256 KiB (:func:`notice_points`), so that the commit hashes
   little after the last byte.
3. ``put_commit`` is the one round trip: the server seals and adopts the extents of the
   new chunks (with the seals it was sent, or those it hashed); the extents of chunks it
   already held go back to the pool, with the replacements it staged for the adopted
   ones. A prepare that failed is raised here.

A copy that fails after the deferred ``put`` went out drops the connection (the server
aborts the put with the session). Extents taken from a connection that another thread
replaced before they were used fall back to the two-phase put on the new connection.

In pieces (``put_prompt`` of more than half the client's put share, which the server
names in its ``hello``): the server refuses any put that would make a client hold more
than its share of the arena (the extents of a pending put cannot be taken back from the
client writing them), so a larger prompt goes in several puts of whole chunks, in order,
each within half the share (the other half is left for staged extents), each committed
before the next is prepared: piece ``i + 1`` starts where piece ``i`` ended (its
``start``) and continues its chain (its ``parent`` is piece ``i``'s last key), so the
keys are those of one put. The result adds the pieces up. A piece that fails (the
arena full, a budget) raises; the pieces before it stay stored, a prefix of the prompt,
as a save made step by step leaves one. An invalidation covers the whole put, as it
covers one put prepared before it returned: a piece after the first is sent
``chained``, and the server stores nothing of it if the chunk it continues is no
longer live (an invalidation took the pieces before it; docs/server.md, Limits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvlife.client import copies, replies
from kvlife.client.connection import Connection, StagedShape
from kvlife.client.handles import RemotePendingPut
from kvlife.client.wire import StaleExtents, Wire
from kvlife.core.errors import (
    InvalidArgument,
    KVLifeError,
    ProtocolError,
    StorageFullError,
    StoreUnavailable,
)
from kvlife.core.identity import KVLayout
from kvlife.core.objects import PromptRef
from kvlife.native.copies import copy_sealed, sealing, stream_copy
from kvlife.results import PutResult
from kvlife.server import protocol
from kvlife.server.limits import page_charge
from kvlife.store.writes import split_chunks

WRITTEN_NOTICE_BYTES = 2 << 20
"""A staged put tells the server how many of its bytes it has written (``put_written``)
every :func:`notice_step` bytes: the server hashes them (the chunks' seals) while the
rest is copied, so that the commit hashes only the last step instead of every chunk.

2 MiB, not 1 (issue 28, 2026-12-04, machine alone, one server, puts of 4 x 2 MiB with
the two settings alternated put by put, 60 each, three runs): 0.42 / 0.40 / 0.38 of
memcpy against 0.36 / 0.36 / 0.37, the server's CPU per put 2.05-2.25 ms against
2.33-2.38. Each notice costs the server a wake-up, a read, a decode and a dispatch
(about 80 us of its CPU here), more than hashing a MiB less at the commit saves; 4 MiB
was worse again at 2 MiB chunks (0.38), and at 16 MiB chunks the step stays a
sixteenth of the put (4 MiB: 0.75, against 0.72 at 8 MiB and 0.67 at 16)."""

SEAL_PUT_BYTES = 32 << 20
"""A staged put of at most this many bytes is sealed here, as it is copied
(:func:`~kvlife.native.copies.copy_sealed`, where the extension can), and its seals go
with ``put_commit``: the server hashes nothing. A larger one tells the server what is
written (``put_written``) and the server hashes it beside the copy.

Why (issue 28, 2026-12-07, scratch A/B on the 2-vCPU machine alone: one server pinned
to one vCPU, the client on the other, 40-60 puts of 4 chunks each way, alternated put
by put): the server's CPU per put fell from 2.7-3.5 ms to 0.75-1.25 ms at every size,
and the put took 0.77 / 0.88 / 0.89 of the time with 1 / 2 / 4 MiB chunks (the server,
which prepares the put and hashes on one vCPU, was what the put waited for), 0.99 at 8
MiB and 1.05 at 16 MiB (there the hashing copy, at about 1.4x a streaming copy's time,
is what the put waits for, and the server's hash beside the streaming copy costs the
put nothing). With several clients on one server, the server's CPU is shared, and the
seals cost it nothing at any size."""

NOTICES_PER_PUT = 16
"""At most about this many ``put_written`` per put: each costs a message here and a
wake-up there."""


def notice_step(total: int, least: int = WRITTEN_NOTICE_BYTES) -> int:
    """Bytes copied between two ``put_written`` of a put of ``total`` bytes (``least``:
    at least that many; 0: none at all)."""
    return max(least, total // NOTICES_PER_PUT) if least > 0 else total + 1


TAIL_NOTICE_BYTES = 256 << 10
"""Within the last :func:`notice_step` of a put, ``put_written`` goes at each half of
what is left, down to this many bytes: the commit hashes at most about this much after
the last byte is written, instead of a whole step."""


def notice_points(total: int, step: int, tail: int = TAIL_NOTICE_BYTES) -> list[int]:
    """The bytes written at which a put of ``total`` bytes sends ``put_written``: every
    ``step``, then at halves of the rest down to ``tail`` (none for a put of at most
    one step: its server may still be preparing it when the last byte is written)."""
    points = list(range(step, total, step))
    if not points:
        return []
    tail = max(1, tail)  # halving stops at a byte at the latest
    at = points[-1]
    while (total - at) // 2 >= tail:
        at += (total - at) // 2
        points.append(at)
    return points


def copy_telling(
    dsts: Iterable[np.ndarray],
    chunks: list[np.ndarray],
    step: int,
    points: list[int],
    tell: Callable[[int], None],
) -> None:
    """Copy each chunk into its extent (C-contiguous, of the chunk's shape, taken from
    ``dsts`` when its chunk's turn comes), in order, and ``tell`` how many bytes are
    copied once past each of ``points`` (never at the end). Pieces are contiguous in the
    extent: whole rows (layers), about ``step`` bytes at once; in the last ``step`` of
    the put (the halved notices) pieces of whole heads (``[layer, k or v, heads]``) end
    where a notice falls inside a row, so that the last notices of a put of large
    chunks (a row of a 16 MiB chunk is 2 MiB) are told where they fall."""
    if not chunks:
        return
    shape = chunks[0].shape
    per_row = shape[1] * shape[2]  # heads in a row: [k or v, head]
    unit = max(1, chunks[0].nbytes // (shape[0] * per_row))  # bytes of one head
    bulk = max(1, step // (unit * per_row)) * per_row  # whole rows, about a step
    at = iter(points)
    total = sum(c.nbytes for c in chunks)
    fine = total - step  # from here on (the halved notices) pieces of whole heads
    point = next(at, total)
    done = 0
    for dst, chunk in zip(dsts, chunks, strict=True):
        u, units = 0, shape[0] * per_row
        while u < units:
            need = max(1, -(-(point - done) // unit))  # heads up to the next notice
            if done < fine:
                need = -(-need // per_row) * per_row  # whole rows
            k = min(bulk, units - u, need)
            _copy_units(dst, chunk, u, u + k, shape[1], shape[2])
            done += k * unit
            u += k
            if done >= point and done < total:
                tell(done)
                while point <= done:
                    point = next(at, total)


def _copy_units(dst: np.ndarray, src: np.ndarray, u0: int, u1: int, kv: int, heads: int) -> None:
    """Copy heads ``u0`` to ``u1`` of a chunk (numbered row by row, k then v) into its
    extent: whole rows at once, else the heads of one row's k or v at a time."""
    per_row = kv * heads
    while u0 < u1:
        r, rest = divmod(u0, per_row)
        if rest == 0 and u1 - u0 >= per_row:
            k = (u1 - u0) // per_row
            stream_copy(dst[r : r + k], src[r : r + k])
            u0 += k * per_row
            continue
        j, h = divmod(rest, heads)
        k = min(u1 - u0, heads - h)
        stream_copy(dst[r, j, h : h + k], src[r, j, h : h + k])
        u0 += k


def _shape_key(layout: KVLayout) -> StagedShape:
    return (layout.dtype, *layout.chunk_shape)


class Puts:
    """The client side of the put protocol on one :class:`Wire`."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.seal_copies = True
        """A staged put's chunks are hashed here as they are copied (where the extension
        can, :func:`kvlife.native.copies.sealing`) and the seals sent with its commit;
        False: the server hashes them (``put_written`` notices, :attr:`notice_bytes`)."""
        self.notice_bytes = WRITTEN_NOTICE_BYTES
        """The least bytes copied between two ``put_written`` of a staged put (0: none,
        the server hashes every chunk at the commit; ``kvlife bench server`` measures
        both)."""

    def put_prompt(
        self, prompt: PromptRef, kv: object, request_id: str, *, inline: bool = False
    ) -> PutResult:
        """``inline``: through the socket even if this session maps an arena."""
        args, layout, chunks = self._args(prompt, kv, request_id)
        inline = inline or not self.wire.mapped()  # no arena: through the socket
        per = self.piece_chunks(layout)
        if inline:
            per = min(per, copies.inline_piece_chunks(layout))
        try:
            if len(chunks) <= per:
                return self._one(args, layout, chunks, inline)
            return self._put_pieces(prompt, args, layout, chunks, per, inline)
        except StorageFullError:
            if inline or not self._tenant():
                raise
            # the principal's own arena had no room to stage it: through the socket (the
            # server copies it into that arena, or into its own when that is full)
            return self.put_prompt(prompt, chunks, request_id, inline=True)

    def _tenant(self) -> bool:
        """Whether this session has a principal (a server with ``--tenants``): its arena
        is its principal's own, which may be smaller than the server's."""
        with self.wire.lock:
            return bool(self.wire.connected().hello.get("principal"))

    def piece_chunks(self, layout: KVLayout) -> int:
        """Chunks of ``layout`` in one piece of a put: half the client's put share, at
        least one chunk (a server that names no share: no limit)."""
        share = self.wire.put_share()
        if share <= 0:
            return 1 << 62
        return max(1, share // 2 // page_charge(layout.chunk_nbytes))

    def _put_pieces(
        self,
        prompt: PromptRef,
        args: dict[str, Any],
        layout: KVLayout,
        chunks: list[np.ndarray],
        per: int,
        inline: bool,
    ) -> PutResult:
        """``chunks`` in puts of ``per`` chunks, in order, each committed before the next
        is prepared and chained to the one before."""
        tokens: bytes = args["tokens"]
        step = 4 * layout.tokens_per_chunk  # bytes of one chunk's token ids
        results: list[PutResult] = []
        for first in range(0, len(chunks), per):
            last = min(first + per, len(chunks))
            piece = dict(args)
            # the last piece keeps a trailing partial chunk's tokens, as one put would
            piece["tokens"] = tokens[first * step : last * step if last < len(chunks) else None]
            if first:
                piece["start"] = prompt.start + first * layout.tokens_per_chunk
                piece["parent"] = bytes(results[-1].keys[-1])
                piece.pop("prefix_tokens", None)  # the parent is named by its key now
                # stores nothing if the piece before was invalidated since (server)
                piece["chained"] = True
            results.append(self._one(piece, layout, chunks[first:last], inline))
        return joined(results, layout.tokens_per_chunk)

    def _one(
        self, args: dict[str, Any], layout: KVLayout, chunks: list[np.ndarray], inline: bool
    ) -> PutResult:
        """One put, through the socket if ``inline``."""
        if inline:
            return copies.put_inline(self.wire, args, layout, chunks)
        return self._put(args, layout, chunks)

    def _put(self, args: dict[str, Any], layout: KVLayout, chunks: list[np.ndarray]) -> PutResult:
        """One put: into staged extents when this connection has enough of the shape,
        else two-phase (asking for extents staged for the next put of this size)."""
        if not self.wire.mapped():
            return copies.put_inline(self.wire, args, layout, chunks)
        if not chunks:
            return self.commit_put(self._prepare(args, layout, chunks))
        taken = self.take_staged(_shape_key(layout), len(chunks))
        if taken is None:
            args["stage"] = len(chunks)  # extents for the next put of this size
            return self.commit_put(self._prepare(args, layout, chunks))
        first, extents = taken
        dtype = chunks[0].dtype.str
        args["staged"] = [sid for sid, _ in extents]
        args["deferred"] = True
        view = self.wire.view
        commit: dict[str, Any] = {}
        total = len(chunks) * layout.chunk_nbytes
        sealing_here = self.seal_copies and total <= SEAL_PUT_BYTES and sealing()

        def write(conn: Connection) -> None:
            # the put goes first (no reply): the server prepares it while we copy
            if conn is not first:
                raise StaleExtents  # reconnected since: nothing sent yet
            conn.sock.sendall(protocol.pack([0, "put", args]))
            dsts = (view(conn, off, dtype, layout.chunk_shape) for _, off in extents)
            if sealing_here:  # each chunk hashed as it is copied: the server hashes nothing
                commit["seals"] = b"".join(
                    copy_sealed(dst, c) for dst, c in zip(dsts, chunks, strict=True)
                )
                return
            step = notice_step(total, self.notice_bytes)
            points = notice_points(total, step, TAIL_NOTICE_BYTES)

            def tell(done: int) -> None:
                # the server hashes what is written while we copy the rest
                conn.sock.sendall(protocol.pack([0, "put_written", {"bytes": done}]))

            copy_telling(dsts, chunks, step, points, tell)

        try:
            r, conn = self.wire.call_on("put_commit", commit, before=write)
        except StaleExtents:  # the extents were another connection's: the two-phase put
            del args["staged"], args["deferred"]
            args["stage"] = len(chunks)
            return self.commit_put(self._prepare(args, layout, chunks))
        try:  # every field read before any staged extent of it is kept
            result, extents = replies.put_result(r), replies.staged(r, "put reply")
        except ProtocolError:
            self.wire.disown(conn)  # the server frees the extents it staged for us
            raise
        self.add_staged(conn, _shape_key(layout), extents)
        return result

    def take_staged(self, shape: StagedShape, count: int) -> tuple[Connection, list[Any]] | None:
        """``count`` staged extents of chunks of ``shape`` of the current connection, if
        it has them (out of its pool: the put that uses them gives back what it kept)."""
        with self.wire.lock:
            conn = self.wire.conn
            pool = conn.staged.get(shape) if conn is not None else None
            if conn is None or pool is None or len(pool) < count:
                return None
            taken = pool[-count:]
            del pool[-count:]
            return conn, taken

    def add_staged(self, conn: Connection, shape: StagedShape, extents: list[Any]) -> None:
        with self.wire.lock:
            if conn is self.wire.conn and extents:
                conn.staged.setdefault(shape, []).extend(extents)

    def prepare_put(self, prompt: PromptRef, kv: object, request_id: str) -> RemotePendingPut:
        """Validate here, reserve extents on the server for the chunks it lacks, and copy
        them in (the arrays are not referenced after this returns). A session that maps
        no arena has no extents to copy into, nor one whose principal's arena has no room
        for them: the put is held here, its chunks copied, and the commit sends it whole
        (through the socket: ``put_inline``)."""
        args, layout, chunks = self._args(prompt, kv, request_id)
        if self.wire.mapped():
            try:
                return self._prepare(args, layout, chunks)
            except StorageFullError:
                if not self._tenant():
                    raise
                # its principal's own arena has no room to stage it: held, as below
        copied = [np.array(c, copy=True) for c in chunks]
        held = (prompt, copied, request_id)
        return RemotePendingPut(0, 0, [], layout.tokens_per_chunk, 0, 0, held=held)

    def _args(
        self, prompt: PromptRef, kv: object, request_id: str
    ) -> tuple[dict[str, Any], KVLayout, list[np.ndarray]]:
        """A put's wire arguments, its layout and its chunks (validated here, as the
        embedded store does: LayoutMismatch, PartialChunkError)."""
        args = protocol.encode_prompt(prompt)
        layout = prompt.identity.layout
        ntokens = len(args["tokens"]) // 4
        chunks = split_chunks(kv, layout, ntokens // layout.tokens_per_chunk, ntokens)
        if request_id:
            args["request_id"] = request_id
        return args, layout, chunks

    def _prepare(
        self, args: dict[str, Any], layout: KVLayout, chunks: list[np.ndarray]
    ) -> RemotePendingPut:
        r, conn = self.wire.call_on("prepare_put", args)
        try:  # every field read before the put or a staged extent of it is kept
            reply = replies.prepared(r, len(chunks))
        except ProtocolError:
            self.wire.disown(conn)  # the server aborts the put and frees its extents
            raise
        pending = RemotePendingPut(
            reply.put,
            conn.epoch,
            reply.keys,
            layout.tokens_per_chunk,
            reply.present,
            reply.in_flight,
        )
        self.add_staged(conn, _shape_key(layout), reply.staged)
        dtype = chunks[0].dtype.str if chunks else "u1"
        try:
            for index, off in reply.slots:
                stream_copy(self.wire.view(conn, off, dtype, layout.chunk_shape), chunks[index])
                pending.stored_chunks.append(index)
        except BaseException:
            with contextlib.suppress(KVLifeError):
                self.abort_put(pending, "client failed to write the chunks")
            raise
        return pending

    def _finish(self, pending: RemotePendingPut) -> None:
        if not isinstance(pending, RemotePendingPut):
            raise InvalidArgument(f"not a pending put of a RemoteStore: {type(pending).__name__}")
        if pending.done:
            raise InvalidArgument(
                "this pending put was already committed or aborted, or its store was closed"
            )
        pending.done = True
        if pending.held is None and pending.epoch != self.wire.epoch:
            raise StoreUnavailable(
                f"the connection to {self.wire.socket_path} was lost since this put was "
                "prepared (the server aborted it)"
            )

    def commit_put(self, pending: RemotePendingPut) -> PutResult:
        self._finish(pending)
        if pending.held is not None:
            (prompt, chunks, request_id), pending.held = pending.held, None
            return self.put_prompt(prompt, chunks, request_id)
        r, conn = self.wire.call_on("commit_put", {"put": pending.put})
        try:
            return replies.put_result(r, "commit_put reply")
        except ProtocolError:
            self.wire.disown(conn)
            raise

    def put_async(self, pending: RemotePendingPut) -> Future[PutResult]:
        return self.wire.pool().submit(self.commit_put, pending)

    def abort_put(self, pending: RemotePendingPut, reason: str) -> None:
        self._finish(pending)
        if pending.held is not None:
            pending.held = None  # nothing of it was sent
            return
        self.wire.call("abort_put", {"put": pending.put, "reason": reason[:4096]})


def joined(results: list[PutResult], tokens_per_chunk: int) -> PutResult:
    """The result of one put made of the puts of its pieces, in order: the counts added
    up, the keys in order, the tokens covered from the start as far as every chunk
    before was stored or present."""
    covered = 0
    for r in results:
        covered += r.tokens_stored_or_present
        if r.tokens_stored_or_present < r.chunks * tokens_per_chunk:
            break
    return PutResult(
        chunks=sum(r.chunks for r in results),
        stored=sum(r.stored for r in results),
        already_present=sum(r.already_present for r in results),
        in_flight=sum(r.in_flight for r in results),
        dropped=sum(r.dropped for r in results),
        tokens_stored_or_present=covered,
        keys=[k for r in results for k in r.keys],
    )
