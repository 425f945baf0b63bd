"""The put protocol, client side: the one-round-trip put into staged extents and the
two-phase put (the server side is :mod:`kvlife.server.puts`).

The KV is validated here first, as the embedded store does (``split_chunks``:
LayoutMismatch, PartialChunkError), before anything is sent.

Two-phase (``prepare_put`` / ``commit_put``, and ``put_prompt`` while no extents are
staged for the chunk shape):

1. ``prepare_put`` sends the prompt; the server creates the TENTATIVE objects, reserves
   one arena extent per chunk it lacks and replies with their offsets (and, when asked
   with ``stage``, extents staged for this connection's next puts of that shape).
2. This side copies each new chunk into its extent (a failed copy aborts the put).
3. ``commit_put`` (or ``abort_put``) names the put; the server seals the extents and
   commits them, adopted as the DRAM replicas without a copy.

Staged (``put_prompt`` once extents of the chunk shape are staged for this connection):

1. One staged extent per chunk is taken from this connection's pool.
2. A deferred ``put`` naming them goes out with no reply wanted; the server prepares
   the put while this side copies every chunk into its extent.
3. ``put_commit`` is the one round trip: the server seals and adopts the extents of the
   new chunks; the extents of chunks it already held go back to the pool, with the
   replacements it staged for the adopted ones. A prepare that failed is raised here.

A copy that fails after the deferred ``put`` went out drops the connection (the server
aborts the put with the session). Extents taken from a connection that another thread
replaced before they were used fall back to the two-phase put on the new connection.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvlife.client.connection import Connection, StagedShape
from kvlife.client.handles import RemotePendingPut
from kvlife.client.wire import StaleExtents, Wire
from kvlife.core.errors import InvalidArgument, KVLifeError, StoreUnavailable
from kvlife.core.identity import KVLayout
from kvlife.core.objects import PromptRef
from kvlife.results import PutResult
from kvlife.server import protocol
from kvlife.store.writes import split_chunks


def _shape_key(layout: KVLayout) -> StagedShape:
    return (layout.dtype, *layout.chunk_shape)


class Puts:
    """The client side of the put protocol on one :class:`Wire`."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    def put_prompt(self, prompt: PromptRef, kv: object, request_id: str) -> PutResult:
        args, layout, chunks = self._args(prompt, kv, request_id)
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

        def write(conn: Connection) -> None:
            # the put goes first (no reply): the server prepares it while we copy
            if conn is not first:
                raise StaleExtents  # reconnected since: nothing sent yet
            conn.sock.sendall(protocol.pack([0, "put", args]))
            for (_, off), chunk in zip(extents, chunks, strict=True):
                np.copyto(view(conn, off, dtype, layout.chunk_shape), chunk)

        try:
            r, conn = self.wire.call_on("put_commit", {}, before=write)
        except StaleExtents:  # the extents were another connection's: the two-phase put
            del args["staged"], args["deferred"]
            args["stage"] = len(chunks)
            return self.commit_put(self._prepare(args, layout, chunks))
        self.add_staged(conn, _shape_key(layout), r["staged"])
        return protocol.decode_put_result(r)

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
        them in (the arrays are not referenced after this returns)."""
        return self._prepare(*self._args(prompt, kv, request_id))

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
        reply, conn = self.wire.call_on("prepare_put", args)
        pending = RemotePendingPut(
            reply["put"],
            conn.epoch,
            protocol.split_keys(reply["keys"]),
            layout.tokens_per_chunk,
            reply["present"],
            reply["in_flight"],
        )
        self.add_staged(conn, _shape_key(layout), reply["staged"])
        dtype = chunks[0].dtype.str if chunks else "u1"
        try:
            for index, off in reply["slots"]:
                np.copyto(self.wire.view(conn, off, dtype, layout.chunk_shape), chunks[index])
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
        if pending.epoch != self.wire.epoch:
            raise StoreUnavailable(
                f"the connection to {self.wire.socket_path} was lost since this put was "
                "prepared (the server aborted it)"
            )

    def commit_put(self, pending: RemotePendingPut) -> PutResult:
        self._finish(pending)
        return protocol.decode_put_result(self.wire.call("commit_put", {"put": pending.put}))

    def put_async(self, pending: RemotePendingPut) -> Future[PutResult]:
        return self.wire.pool().submit(self.commit_put, pending)

    def abort_put(self, pending: RemotePendingPut, reason: str) -> None:
        self._finish(pending)
        self.wire.call("abort_put", {"put": pending.put, "reason": reason[:4096]})
