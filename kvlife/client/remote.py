"""RemoteStore: the public API of :class:`~kvlife.store.KVStore`, served by ``kvlife
serve`` over its Unix socket, with bulk bytes through the server's shared-memory arena.

A load is one round trip that names the arena extents holding the verified chunks (DRAM
replicas as they are, disk reads landed in the arena), one copy from the arena into the
caller's buffers (or new arrays), and a release that rides along with the next request
(no round trip of its own). When every hit is in DRAM and the lookup said where, the
copy is made while the server pins and confirms those extents (docs/server.md, Data
plane). ``put_prompt`` is one round trip once the server has staged extents for the
chunk shape: a deferred ``put`` goes out, the chunks are copied into staged extents
while the server prepares it, a ``put_commit`` commits them (adopted as the DRAM
replicas without a copy); ``prepare_put``/``commit_put`` are two round trips.

When the server cannot be reached every call raises
:class:`~kvlife.core.errors.StoreUnavailable` (an engine treats it as a miss); the next
call tries to reconnect, so a restarted server is picked up by itself. Pending puts and
loads of a lost connection are gone (the server aborted them); finishing one raises
StoreUnavailable. A RemoteStore may be shared by the threads of a process: calls are
serialised on its one connection, and the copies that overlap a round trip (hinted
loads, staged puts) run inside that serialisation; grant copies run outside it. Threads
that load in parallel each want a RemoteStore of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from kvlife.client.connection import Connection, StagedShape, error_from_reply, split_keys
from kvlife.client.handles import RemoteLoadHandle, RemoteLookup, RemotePendingPut
from kvlife.core import errors
from kvlife.core.errors import InvalidArgument, KVLifeError, StoreUnavailable
from kvlife.core.identity import (
    ROOT_PARENT,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    token_bytes,
)
from kvlife.core.objects import TierName
from kvlife.core.payload import numpy_dtype
from kvlife.results import (
    ChunkHit,
    LoadResult,
    LookupResult,
    PutResult,
    StoreCounters,
    StoreInfo,
    TierInfo,
)
from kvlife.server import protocol
from kvlife.store.writes import split_chunks
from kvlife.tiers.base import AuditReport
from kvlife.transforms.contract import Accept

Tokens = Sequence[int] | np.ndarray
RELEASE_BATCH = 8
"""Finished loads whose grants wait for the next request before being sent alone."""


class _StaleExtents(Exception):
    """Staged extents taken from a connection that was replaced before they were used."""


def _shape_key(layout: KVLayout) -> StagedShape:
    return (layout.dtype, *layout.chunk_shape)


_PUT_COUNTS = [f.name for f in dataclasses.fields(PutResult) if f.name != "keys"]


def _put_result(r: dict[str, Any]) -> PutResult:
    return PutResult(**{k: r[k] for k in _PUT_COUNTS}, keys=split_keys(r["keys"]))


class RemoteStore:
    """A store served by ``kvlife serve`` (same public API as ``KVStore``)."""

    def __init__(
        self, socket_path: str | Path, *, timeout: float | None = 60.0, lazy: bool = False
    ) -> None:
        """Connect to the server on ``socket_path`` (StoreUnavailable if it is not there;
        with ``lazy`` the first call connects instead, so a client may start first)."""
        self.socket_path = str(socket_path)
        self._timeout = timeout
        self._conn: Connection | None = None
        self._epoch = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._pid = os.getpid()
        self._names: list[str] = []
        if not lazy:
            self._call("info", {})  # connect now: a wrong path fails here, typed

    @classmethod
    def connect(
        cls, socket_path: str | Path, *, timeout: float | None = 60.0, lazy: bool = False
    ) -> RemoteStore:
        return cls(socket_path, timeout=timeout, lazy=lazy)

    # ------------------------------------------------------------------ wire

    def _connected(self) -> Connection:
        if self._conn is not None and self._pid != os.getpid():
            # a forked child (engines fork their workers): the parent's connection and
            # leases are the parent's; this process gets its own session
            self._conn.sock.detach()
            self._conn = None
            self._pool = None
        if self._conn is not None:
            return self._conn
        self._pid = os.getpid()
        try:
            conn = Connection(self.socket_path, self._timeout)
        except OSError as exc:
            raise protocol.unavailable(self.socket_path, exc) from None
        try:
            hello = self._roundtrip(conn, "hello", {"version": protocol.PROTOCOL_VERSION})
            conn.map_arena(hello["arena"], hello["arena_bytes"])
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
        self._names = list(hello["tiers"])
        self._epoch += 1
        conn.epoch = self._epoch
        self._conn = conn
        return conn

    def _roundtrip(
        self,
        conn: Connection,
        verb: str,
        args: dict[str, Any],
        on_part: Callable[[Connection, Any], None] | None = None,
        after_send: Callable[[Connection], None] | None = None,
    ) -> Any:
        rid = next(conn.rid)
        frame = protocol.pack([rid, verb, args])
        if conn.releases:  # grants of finished loads ride along (no reply, in order)
            frame = (
                b"".join(protocol.pack([0, "release", {"load": i}]) for i in conn.releases) + frame
            )
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
                    conn.sock.sendall(protocol.pack([0, "release", {"load": load}]))
            raise failed
        return reply[2]

    def _call(self, verb: str, args: dict[str, Any]) -> Any:
        return self._call_on(verb, args)[0]

    def _call_on(
        self,
        verb: str,
        args: dict[str, Any],
        on_part: Callable[[Connection, Any], None] | None = None,
        after_send: Callable[[Connection], None] | None = None,
        before: Callable[[Connection], None] | None = None,
    ) -> tuple[Any, Connection]:
        """The result and the connection it came on: grants name offsets in that
        connection's arena (another thread may reconnect to a new server meanwhile).
        ``before`` runs on the connection first (under the same lock), ``after_send``
        once the request is sent and before its reply is read."""
        if self._closed:
            raise errors.StoreClosedError(f"RemoteStore for {self.socket_path} is closed")
        with self._lock:
            conn = self._connected()
            try:
                if before is not None:
                    try:
                        before(conn)
                    except _StaleExtents:
                        raise
                    except BaseException:
                        # it may have sent half of an exchange (a deferred put whose
                        # chunks were not all written): the server must abort it, and
                        # closing the connection makes it do so
                        self._drop()
                        raise
                return self._roundtrip(conn, verb, args, on_part, after_send), conn
            except (OSError, ValueError, msgpack.UnpackException) as exc:
                if not conn.pending:  # the exchange is complete: not the connection's
                    raise  # error (a reply's, or a copy's that failed meanwhile)
                self._drop()
                if isinstance(exc, KVLifeError):
                    raise
                raise protocol.unavailable(self.socket_path, exc) from None
            except BaseException:
                # out of step (an interrupt, a connection-level refusal): the server
                # releases what the exchange granted when the connection goes
                if conn.pending:
                    self._drop()
                raise

    def _release(self, load: int, conn: Connection) -> None:
        """Give a load's grant back: with the next request (no round trip of its own),
        or now when many are waiting. A lost connection released it anyway."""
        with self._lock:
            if conn is not self._conn:
                return
            conn.releases.append(load)
            if len(conn.releases) < RELEASE_BATCH:
                return
            frames = b"".join(protocol.pack([0, "release", {"load": i}]) for i in conn.releases)
            conn.releases.clear()
            try:
                conn.sock.sendall(frames)
            except OSError:
                self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _view(self, conn: Connection, off: int, dtype: str, shape: Sequence[int]) -> np.ndarray:
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

    @staticmethod
    def _prompt(
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        start: int,
        parent: ChunkKey,
        extra_keys: Sequence[bytes],
    ) -> dict[str, Any]:
        if not isinstance(identity, ModelIdentity):
            raise InvalidArgument(
                f"identity must be a ModelIdentity, got {type(identity).__name__}"
            )
        if not isinstance(namespace, Namespace):
            raise InvalidArgument(f"namespace must be a Namespace, got {type(namespace).__name__}")
        args: dict[str, Any] = {
            "identity": protocol.encode_identity(identity),
            "namespace": str(namespace),
            "tokens": token_bytes(tokens),
        }
        if start:
            args["start"] = start
        if parent != ROOT_PARENT:
            args["parent"] = bytes(parent)
        if extra_keys:
            args["extra_keys"] = [bytes(e) for e in extra_keys]
        return args

    # ------------------------------------------------------------------ puts

    def put_prompt(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        request_id: str = "",
    ) -> PutResult:
        """Store a prompt's chunks. With extents staged for this chunk shape (the server
        stages them with the first put of that shape), one round trip: a deferred ``put``
        goes out, every chunk is copied into a staged extent while the server prepares
        it, and ``put_commit`` commits the ones the store lacks; otherwise prepare, copy,
        commit (docs/server.md, Data plane)."""
        args, layout, chunks = self._put_args(
            identity, namespace, tokens, kv, start, parent, extra_keys, request_id
        )
        if not chunks:
            return self.commit_put(self._prepare(args, layout, chunks))
        taken = self._take_staged(_shape_key(layout), len(chunks))
        if taken is None:
            args["stage"] = len(chunks)  # extents for the next put of this size
            return self.commit_put(self._prepare(args, layout, chunks))
        first, extents = taken
        dtype = chunks[0].dtype.str
        args["staged"] = [sid for sid, _ in extents]
        args["deferred"] = True

        def write(conn: Connection) -> None:
            # the put goes first (no reply): the server prepares it while we copy
            if conn is not first:
                raise _StaleExtents  # reconnected since: nothing sent yet
            conn.sock.sendall(protocol.pack([0, "put", args]))
            for (_, off), chunk in zip(extents, chunks, strict=True):
                np.copyto(self._view(conn, off, dtype, layout.chunk_shape), chunk)

        try:
            r, conn = self._call_on("put_commit", {}, before=write)
        except _StaleExtents:  # the extents were another connection's: the two-phase put
            del args["staged"], args["deferred"]
            args["stage"] = len(chunks)
            return self.commit_put(self._prepare(args, layout, chunks))
        self._add_staged(conn, _shape_key(layout), r["staged"])
        return _put_result(r)

    def _take_staged(self, shape: StagedShape, count: int) -> tuple[Connection, list[Any]] | None:
        """``count`` staged extents of chunks of ``shape`` of the current connection, if
        it has them (out of its pool: the put that uses them gives back what it kept)."""
        with self._lock:
            conn = self._conn
            pool = conn.staged.get(shape) if conn is not None else None
            if conn is None or pool is None or len(pool) < count:
                return None
            taken = pool[-count:]
            del pool[-count:]
            return conn, taken

    def _add_staged(self, conn: Connection, shape: StagedShape, extents: list[Any]) -> None:
        with self._lock:
            if conn is self._conn and extents:
                conn.staged.setdefault(shape, []).extend(extents)

    def prepare_put(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        request_id: str = "",
    ) -> RemotePendingPut:
        """Validate here, reserve extents on the server for the chunks it lacks, and copy
        them in (the arrays are not referenced after this returns)."""
        return self._prepare(
            *self._put_args(identity, namespace, tokens, kv, start, parent, extra_keys, request_id)
        )

    def _put_args(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        start: int,
        parent: ChunkKey,
        extra_keys: Sequence[bytes],
        request_id: str,
    ) -> tuple[dict[str, Any], KVLayout, list[np.ndarray]]:
        """A put's wire arguments, its layout and its chunks (validated here, as the
        embedded store does: LayoutMismatch, PartialChunkError)."""
        args = self._prompt(identity, namespace, tokens, start, parent, extra_keys)
        layout = identity.layout
        ntokens = len(args["tokens"]) // 4
        chunks = split_chunks(kv, layout, ntokens // layout.tokens_per_chunk, ntokens)
        if request_id:
            args["request_id"] = request_id
        return args, layout, chunks

    def _prepare(
        self, args: dict[str, Any], layout: KVLayout, chunks: list[np.ndarray]
    ) -> RemotePendingPut:
        reply, conn = self._call_on("prepare_put", args)
        pending = RemotePendingPut(
            reply["put"],
            conn.epoch,
            split_keys(reply["keys"]),
            layout.tokens_per_chunk,
            reply["present"],
            reply["in_flight"],
        )
        self._add_staged(conn, _shape_key(layout), reply["staged"])
        dtype = chunks[0].dtype.str if chunks else "u1"
        try:
            for index, off in reply["slots"]:
                np.copyto(self._view(conn, off, dtype, layout.chunk_shape), chunks[index])
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
        if pending.epoch != self._epoch:
            raise StoreUnavailable(
                f"the connection to {self.socket_path} was lost since this put was prepared "
                "(the server aborted it)"
            )

    def commit_put(self, pending: RemotePendingPut) -> PutResult:
        self._finish(pending)
        return _put_result(self._call("commit_put", {"put": pending.put}))

    def put_async(self, pending: RemotePendingPut) -> Future[PutResult]:
        return self._io_pool().submit(self.commit_put, pending)

    def abort_put(self, pending: RemotePendingPut, reason: str = "aborted by caller") -> None:
        self._finish(pending)
        self._call("abort_put", {"put": pending.put, "reason": reason[:4096]})

    # ------------------------------------------------------------------ reads

    def lookup(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        accept: Accept = Accept.EXACT,
    ) -> LookupResult:
        if not isinstance(accept, Accept):
            raise InvalidArgument(f"accept must be an Accept, got {type(accept).__name__}")
        args = self._prompt(identity, namespace, tokens, start, parent, extra_keys)
        if accept != Accept.EXACT:
            args["opts"] = {"accept": protocol.encode_accept(accept)}
        r, conn = self._call_on("lookup", args)
        n = identity.layout.tokens_per_chunk
        names = [TierName(t) for t in self._names]
        # the reply's fields are msgpack str/int/float already: no per-hit conversions
        # (a 128-chunk lookup builds 128 hits)
        hits = [
            ChunkHit(i, key, start + i * n, names[t], *f)
            for i, (key, t, f) in enumerate(
                zip(split_keys(r["keys"]), r["tiers"], r["forms"], strict=True)
            )
        ]
        refusal = str(r["refusal"])
        return RemoteLookup(
            hits,
            r["chunks_total"],
            n,
            accept,
            int(bool(refusal)),
            refusal,
            identity,
            tuple(r.get("hints", ())),
            conn.epoch,
        )

    def load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> LoadResult:
        return self._load(lookup, outs, request_id, None)

    def _load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None,
        request_id: str,
        on_chunk: Callable[[int, np.ndarray | None], None] | None,
    ) -> LoadResult:
        hits = lookup.hits
        if outs is not None and len(outs) != len(hits):
            raise InvalidArgument(f"{len(outs)} output buffers for {len(hits)} hits")
        if not hits:
            return LoadResult([], 0, 0)
        args: dict[str, Any] = {
            "keys": b"".join(h.key for h in hits),
            "starts": [h.start for h in hits],
            "chunks_total": lookup.chunks_total,
            "accept": protocol.encode_accept(lookup.accept),
        }
        early = None
        epoch = lookup.epoch if isinstance(lookup, RemoteLookup) else -1
        if isinstance(lookup, RemoteLookup) and lookup.identity is not None:
            # the layout lets the server read disk hits straight into arena extents
            args["layout"] = protocol.encode_layout(lookup.identity.layout)
            if outs is not None:  # all in DRAM: copied here from the hints, any buffers
                early = self._hinted(lookup, outs, args)
            if outs is not None and early is None:
                into = self._targets(outs, lookup.identity.layout)
                if into is not None:
                    args["into"] = into
        if request_id:
            args["request_id"] = request_id
        arrays: list[np.ndarray] = []

        def take(conn: Connection, i: int, off: int, dtype: str, shape: Sequence[int]) -> None:
            src = self._view(conn, off, dtype, shape)
            if outs is not None:
                out = outs[i]
                if out.shape != src.shape or out.dtype != src.dtype:
                    raise InvalidArgument(
                        f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
                        f"{src.dtype}{list(src.shape)}"
                    )
                np.copyto(out, src)
            else:
                out = np.empty(src.shape, src.dtype)
                np.copyto(out, src)
                out.flags.writeable = False
            del src
            arrays.append(out)
            if on_chunk is not None:
                on_chunk(i, out)

        def part(conn: Connection, p: list[Any]) -> None:
            # a chunk read from disk, sent as soon as it verified: copied while the
            # server reads the next ones
            if p[0] != len(arrays):
                raise errors.ProtocolError(f"streamed chunk {p[0]} out of order")
            take(conn, p[0], p[1], p[2], p[3])

        args["stream"] = True
        copied: list[np.ndarray] = []
        after = None
        if early is not None and outs is not None:
            dst = outs

            def after(conn: Connection) -> None:
                # copy every DRAM hit from where the lookup saw it while the server
                # pins it; it confirms the extents still hold those replicas
                if conn.epoch != epoch:
                    return  # another server's arena since the lookup: nothing is copied
                for out, (off, dtype) in zip(dst, early, strict=True):
                    np.copyto(out, self._view(conn, off, dtype, out.shape))
                    copied.append(out)

        r, conn = self._call_on("load", args, part, after)
        if "into" in r:  # landed in the caller's shared buffers: nothing to copy
            assert outs is not None
            landed = list(outs[: r["into"]])
            if on_chunk is not None:
                for i, a in enumerate(landed):
                    on_chunk(i, a)
            return self._result(landed, r)
        del arrays[r["streamed"] :]  # a streamed chunk invalidated meanwhile is a miss
        confirmed = r.get("confirmed", 0)
        try:
            if confirmed:
                if confirmed > len(copied):  # granted nothing for chunks it confirmed
                    confirmed = 0  # and this client did not copy: they are a miss
                    r["grants"] = []
                arrays += copied[:confirmed]
                if on_chunk is not None:
                    for i, a in enumerate(arrays):
                        on_chunk(i, a)
            for j, (off, dtype, shape) in enumerate(r["grants"]):
                take(conn, r["streamed"] + confirmed + j, off, dtype, shape)
        finally:
            if r["load"]:
                self._release(r["load"], conn)
        return self._result(arrays, r)

    def _hinted(
        self, lookup: RemoteLookup, outs: Sequence[np.ndarray], args: dict[str, Any]
    ) -> list[tuple[int, str]] | None:
        """(offset, dtype) of each hit when every hit is a DRAM replica whose place the
        lookup on this connection named and every buffer fits it (the hints go into
        ``args``); else None (the load takes the grant path)."""
        hints = lookup.hints
        conn = self._conn
        if conn is None or conn.epoch != lookup.epoch or len(hints) != 2 * len(outs):
            return None
        if lookup.identity is None:
            return None
        layout = lookup.identity.layout
        dtype = numpy_dtype(layout.dtype)
        early: list[tuple[int, str]] = []
        for i, out in enumerate(outs):
            if not hints[2 * i + 1] or out.shape != layout.chunk_shape or out.dtype != dtype:
                return None
            early.append((hints[2 * i], dtype.str))
        args["hints"] = list(hints)
        return early

    @staticmethod
    def _result(arrays: list[np.ndarray], r: dict[str, Any]) -> LoadResult:
        tiers = {str(k): int(v) for k, v in r["tiers"].items()}
        return LoadResult(
            arrays,
            len(arrays),
            r["requested"],
            tiers=tiers,
            corrupt=split_keys(r["corrupt"]),
            vanished=r["vanished"],
            read_errors=r["read_errors"],
        )

    def _targets(self, outs: Sequence[np.ndarray], layout: KVLayout) -> list[int] | None:
        """(buffer, offset) of each output buffer if all lie in this connection's shared
        buffers and fit the layout; else None (the grant path, one copy here)."""
        conn = self._conn
        if conn is None or not conn.buffers or not outs:
            return None
        dtype = numpy_dtype(layout.dtype)
        into: list[int] = []
        for out in outs:
            if out.shape != layout.chunk_shape or out.dtype != dtype or not out.flags.c_contiguous:
                return None
            addr = out.ctypes.data
            for base, size, bid, _ in conn.buffers:
                if base <= addr and addr + out.nbytes <= base + size:
                    into += [bid, addr - base]
                    break
            else:
                return None
        return into

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of shared memory (uint8, page-aligned) that the server writes into:
        a load whose output buffers all lie in such memory lands there directly (disk
        reads by O_DIRECT, DRAM hits copied by the server), with no copy in this process.
        Slice it into chunk-shaped views. It lasts as long as the connection; after a
        reconnect loads into it take the ordinary path (still correct, one copy more)."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"buffer size must be a positive int, got {nbytes!r}")
        r, conn = self._call_on("alloc_buffer", {"nbytes": nbytes})
        fd = os.open(r["path"], os.O_RDWR | os.O_NOFOLLOW)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, r["nbytes"], flags=flags)
        finally:
            os.close(fd)
        arr = np.frombuffer(mapping, np.uint8, count=nbytes)
        with self._lock:
            conn.buffers.append((arr.ctypes.data, r["nbytes"], r["buffer"], mapping))
        return arr

    def load_async(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> RemoteLoadHandle:
        handle = RemoteLoadHandle(len(lookup.hits))
        fut = self._io_pool().submit(self._load, lookup, outs, request_id, handle._chunk_done)
        fut.add_done_callback(handle._finish)
        return handle

    def get(
        self, identity: ModelIdentity, namespace: Namespace, tokens: Tokens, **kwargs: object
    ) -> LoadResult:
        return self.load(self.lookup(identity, namespace, tokens, **kwargs))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ management

    def invalidate(
        self,
        *,
        weights_digest: str | None = None,
        adapter_id: str | None = None,
        namespace: Namespace | None = None,
        prefix: ChunkKey | None = None,
    ) -> int:
        args: dict[str, Any] = {}
        if weights_digest is not None:
            args["weights_digest"] = weights_digest
        if adapter_id is not None:
            args["adapter_id"] = adapter_id
        if namespace is not None:
            args["namespace"] = str(namespace)
        if prefix is not None:
            args["prefix"] = bytes(prefix)
        n: int = self._call("invalidate", args)
        return n

    def evict(self, tier: str, nbytes: int) -> int:
        """:meth:`KVStore.evict <kvlife.store.KVStore.evict>` in the server's store:
        ``nbytes``' worth of replicas out of ``tier`` (not "until ``nbytes`` are free");
        returns the payload bytes evicted."""
        n: int = self._call("evict", {"tier": tier, "nbytes": nbytes})
        return n

    def flush(self) -> int:
        n: int = self._call("flush", {})
        return n

    def drain(self) -> None:
        self._call("drain", {})

    def check(self) -> AuditReport:
        """The server's audit of its store (read-only: no fix through the socket)."""
        r = dict(self._call("check", {}))
        r.pop("clean", None)
        return AuditReport(**r)

    def info(self) -> StoreInfo:
        r = self._call("info", {})
        return StoreInfo(
            path=r["path"],
            tiers=[TierInfo(**t) for t in r["tiers"]],
            objects_by_state=r["objects_by_state"],
            bytes_by_state=r["bytes_by_state"],
            counters=r["counters"],
            lifetime_counters=r["lifetime_counters"],
        )

    def server_info(self) -> dict[str, Any]:
        """``info`` as the server sends it, with its ``server`` section (sessions, leases,
        arena)."""
        out: dict[str, Any] = self._call("info", {})
        return out

    def server_state(self) -> dict[str, Any]:
        """Live sessions, leases held, TENTATIVE objects and arena figures."""
        out: dict[str, Any] = self._call("state", {})
        return out

    @property
    def counters(self) -> StoreCounters:
        """The server's counters since it opened the store (all clients together)."""
        return StoreCounters().add(self._call("counters", {}))

    @property
    def tier_names(self) -> list[TierName]:
        if self._conn is None:
            self._call("info", {})
        return [TierName(n) for n in self._names]

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvlife-remote")
            return self._pool

    def close(self, *, flush: bool = False) -> None:
        """Close the connection (the server keeps the store open for other clients);
        ``flush=True`` asks the server to flush first."""
        if self._closed:
            return
        with contextlib.suppress(StoreUnavailable):
            if flush:
                self.flush()
            elif self._conn is not None and self._conn.releases:
                self._call("state", {})  # hands the waiting grants back
        pool = self._pool
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
