"""One client connection of ``kvlife serve``: its leases (pending puts, load grants) and
the verbs it may call.

Everything a session holds is tied to its connection: when the client goes away (a
clean close, a crash, a SIGKILL), :meth:`Session.close` aborts its pending puts (their
TENTATIVE objects become DELETED and their arena extents are freed) and drops its load
grants (the extents of deleted replicas it was still reading are freed). A client names
only ids the server gave this session (``put``, ``load``); an id of another session, or
one already used, is a :class:`~kvlife.core.errors.ProtocolError`. Arena offsets only
travel from the server to the client, never the other way.

Everything a session holds is also charged to the server's budgets
(:mod:`kvlife.server.limits`) before it is allocated: pending puts, staged extents,
load grants and shared buffers, in counts and in bytes, per session and server-wide;
one request's chunks and extra-key bytes are bounded too. A refusal is a typed
:class:`~kvlife.core.errors.LimitExceeded`, counted, with nothing of the request kept.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import (
    InvalidArgument,
    KVLifeError,
    ProtocolError,
    StorageFullError,
)
from kvlife.core.identity import KEY_BYTES, ROOT_PARENT, ChunkKey, KVLayout, ModelIdentity
from kvlife.core.payload import numpy_dtype
from kvlife.results import ChunkHit, LookupResult, PutResult
from kvlife.server import protocol
from kvlife.server.buffers import SharedBuffer
from kvlife.server.limits import INFINITE, Held, Ledger, Limits, budgets, page_charge
from kvlife.store.facade import KVStore
from kvlife.store.reads import LoadHandle
from kvlife.store.writes import PendingPut
from kvlife.tiers.shm import Arena, ShmTier
from kvlife.transforms.contract import Accept

PartSender = Callable[[bytes], None]
"""Sends one frame to the session's client (partial replies of a streamed load)."""

_PUT_FIELDS = dataclasses.fields(PutResult)
STREAM_BYTES_IN_FLIGHT = 2 << 20
"""Bytes of disk reads a streamed load keeps in flight (at least one chunk)."""


@dataclass(slots=True)
class _Staged:
    """A put into staged extents between its prepare and its commit."""

    pending: PendingPut
    ids: list[int]
    views: list[np.ndarray]
    layout: KVLayout
    refill: list[list[int]]
    """Extents staged for the client in place of those the new chunks take."""


@dataclass(slots=True)
class _Put:
    pending: PendingPut
    views: list[np.ndarray]
    """Arena extents the client writes, one per new chunk (sealed at commit)."""
    charge: int
    """Bytes of the put budget it holds (every chunk, whole pages)."""


@dataclass(slots=True)
class _Load:
    arrays: list[np.ndarray]
    """What the client was granted (pinned until it releases the load)."""
    charge: int
    """Bytes of the grant budget it holds."""


def _put_reply(res: PutResult) -> dict[str, Any]:
    """A PutResult on the wire (its keys as one blob)."""
    out = {f.name: getattr(res, f.name) for f in _PUT_FIELDS}
    out["keys"] = b"".join(res.keys)
    return out


def split_keys(blob: bytes) -> list[ChunkKey]:
    return [ChunkKey(blob[i : i + KEY_BYTES]) for i in range(0, len(blob), KEY_BYTES)]


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
    ) -> None:
        self.store = store
        self.shm = shm
        self.arena: Arena = shm.arena
        self.socket_path = socket_path
        self.limits = limits if limits is not None else Limits()
        self.ledger = Ledger(budgets(self.limits, self.arena.size, descriptors))
        """The budgets; ``descriptors``: how many connections and shared buffers the
        descriptor limit leaves room for."""
        self.sessions: dict[int, Session] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self.released_puts = 0
        """Pending puts aborted because their client went away."""
        self.released_loads = 0
        """Load grants dropped because their client went away."""
        self.events: dict[str, int] = dict.fromkeys(
            ("accept_errors", "body_timeouts", "unreplied_errors", "internal_errors"), 0
        )
        """``accept_errors``: accept calls that failed (descriptors ran out: the server
        shed a connection instead of ending); ``body_timeouts``: connections ended by the
        body deadline; ``unreplied_errors``: failed requests that asked for no reply
        (rid 0); ``internal_errors``: handler bugs (logged, RemoteError)."""

    def count(self, event: str) -> None:
        with self.lock:
            self.events[event] += 1

    def open_session(self, held: Held | None = None) -> Session:
        """A new session; ``held``: what its connection holds already (the connection
        and its descriptor), given back with everything else when it closes."""
        with self.lock:
            session = Session(self, next(self._ids), held if held is not None else {})
            self.sessions[session.sid] = session
            return session

    def close_session(self, session: Session) -> None:
        try:
            puts, loads = session.close()
        finally:
            self.ledger.give_all(session.held)
        with self.lock:
            self.sessions.pop(session.sid, None)
            self.released_puts += puts
            self.released_loads += loads

    def snapshot(self) -> dict[str, Any]:
        """Leases and arena figures (``state``; tests check no lease outlives its client).
        Collects garbage first: an extent whose last view sits in a reference cycle (a
        traceback's frame) is freed by the collector, not by reference counting."""
        gc.collect()
        with self.lock:
            sessions = list(self.sessions.values())
        info = self.store.info()
        return {
            "sessions": len(sessions),
            "puts": sum(len(s.puts) for s in sessions),
            "loads": sum(len(s.loads) for s in sessions),
            "buffers": sum(len(s.buffers) for s in sessions),
            "staged": sum(len(s.staged) for s in sessions),
            "tentative": info.objects_by_state.get("tentative", 0),
            "shm_replicas": len(self.shm.replica_keys()),
            "shm_used_bytes": self.shm.used_bytes,
            "released_puts": self.released_puts,
            "released_loads": self.released_loads,
            **self.events,
            **self.ledger.figures(),
            **self.arena.stats(),
        }


class Session:
    """The leases of one connection and the handlers of its verbs."""

    def __init__(self, server: ServerState, sid: int, held: Held) -> None:
        self.server = server
        self.sid = sid
        self.held = held
        """What this session holds of each budget (given back whole when it ends)."""
        self.ledger = server.ledger
        self.limits = server.limits
        self.puts: dict[int, _Put] = {}
        self.loads: dict[int, _Load] = {}
        self.buffers: dict[int, SharedBuffer] = {}
        self.staged: dict[int, np.ndarray] = {}
        """Arena extents staged for this session's next puts, by id (the client writes
        them, a ``put`` adopts them; freed with the session)."""
        self.deferred: _Staged | None = None
        """A deferred ``put`` waiting for its ``put_commit`` (the client is copying)."""
        self.deferred_error: KVLifeError | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.closed = False
        self.part: PartSender | None = None
        """Where partial replies go (set by the server for each request)."""
        self.rid = 0
        """Id of the request being handled (partial replies carry it)."""
        self._identities: dict[tuple[object, ...], ModelIdentity] = {}
        """Identities this session sent, decoded once (a lookup repeats its identity)."""
        self.handlers: dict[str, Callable[[dict[str, Any]], object]] = {
            "hello": self.hello,
            "lookup": self.lookup,
            "load": self.load,
            "release": self.release,
            "alloc_buffer": self.alloc_buffer,
            "free_buffer": self.free_buffer,
            "prepare_put": self.prepare_put,
            "put": self.put,
            "put_commit": self.put_commit,
            "commit_put": self.commit_put,
            "abort_put": self.abort_put,
            "invalidate": self.invalidate,
            "evict": lambda a: self.server.store.evict(a["tier"], a["nbytes"]),
            "flush": lambda a: self.server.store.flush(),
            "drain": lambda a: self.server.store.drain(),
            "info": self.info,
            "counters": lambda a: self.server.store.counters.as_dict(),
            "check": self.check,
            "state": lambda a: self.server.snapshot(),
        }

    def handle(self, verb: str, args: dict[str, Any], rid: int = 0) -> object:
        self.rid = rid
        return self.handlers[verb](args)

    def close(self) -> tuple[int, int]:
        """Abort every pending put, drop every load grant; how many of each."""
        with self._lock:
            self.closed = True
            puts = list(self.puts.values())
            loads = len(self.loads)
            buffers = list(self.buffers.values())
            self.puts.clear()
            self.loads.clear()
            self.buffers.clear()
            self.staged.clear()  # their extents go back to the arena with the views
        for buf in buffers:
            buf.drop()
        deferred = int(self.deferred is not None)
        self._drop_deferred(f"client of session {self.sid} went away")
        for put in puts:
            put.views.clear()
            self.server.store.abort_put(put.pending, f"client of session {self.sid} went away")
        return len(puts) + deferred, loads

    # ------------------------------------------------------------------ verbs

    def hello(self, args: dict[str, Any]) -> object:
        if args["version"] != protocol.PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol {args['version']}, server {protocol.PROTOCOL_VERSION}"
            )
        store = self.server.store
        return {
            "session": self.sid,
            "arena": str(self.server.arena.path),
            "arena_bytes": self.server.arena.size,
            "tiers": list(store.tier_names),
            "path": str(store.path),
        }

    def _prompt(self, args: dict[str, Any]) -> dict[str, Any]:
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
        raw = args["identity"]
        memo = tuple(sorted((k, v) for k, v in raw.items() if k != "layout")) + tuple(
            sorted(raw["layout"].items())
        )
        identity = self._identities.get(memo)
        if identity is None:
            identity = protocol.decode_identity(raw)
            if len(self._identities) >= 64:
                self._identities.clear()
            self._identities[memo] = identity
        self._chunks(len(tokens) // 4 // max(1, identity.layout.tokens_per_chunk))
        return {
            "identity": identity,
            "namespace": protocol.decode_namespace(args["namespace"]),
            "tokens": np.frombuffer(tokens, "<u4"),
            "start": args.get("start", 0),
            "parent": ChunkKey(args.get("parent", ROOT_PARENT)),
            "extra_keys": list(args.get("extra_keys", ())),
        }

    def lookup(self, args: dict[str, Any]) -> object:
        p = self._prompt(args)
        opts = dict(args.get("opts", {}))
        if "accept" in opts:
            opts["accept"] = protocol.decode_accept(opts["accept"])
        res = self.server.store.lookup(
            p["identity"],
            p["namespace"],
            p["tokens"],
            start=p["start"],
            parent=p["parent"],
            extra_keys=p["extra_keys"],
            **opts,
        )
        names = list(self.server.store.tier_names)
        shm = self.server.shm
        hints: list[int] = []
        for h in res.hits:
            where = shm.hint(h.key) if h.tier == shm.name else None
            hints += where if where is not None else (0, 0)
        return {
            "keys": b"".join(h.key for h in res.hits),
            # where each DRAM hit lies now (offset, generation; 0, 0 for other tiers): a
            # load may copy from there at once and have the server confirm it
            "hints": hints,
            "tiers": [names.index(h.tier) for h in res.hits],
            "chunks_total": res.chunks_total,
            # each hit's representation: what it will serve and what decoding it costs
            "forms": [
                [h.transform, h.exactness, h.stored_nbytes, h.decode_nbytes, h.decode_seconds]
                for h in res.hits
            ],
            "refusal": res.refusal,
        }

    def load(self, args: dict[str, Any]) -> object:
        keys = split_keys(args["keys"])
        starts = args["starts"]
        if len(starts) != len(keys):
            raise ProtocolError(f"{len(starts)} starts for {len(keys)} keys")
        if len(keys) > args["chunks_total"]:
            raise ProtocolError(f"{len(keys)} hits of a prompt of {args['chunks_total']} chunks")
        self._chunks(len(keys))
        layout = protocol.decode_layout(args["layout"]) if "layout" in args else None
        if layout is not None:
            self._fits(layout)
        if "into" in args:
            lookup = self._lookup_of(args, keys, layout)
            return self._load_into(lookup, args["into"], layout, args.get("request_id", ""))
        # the grant is charged before the load: every chunk at its layout's size (none
        # known: at the size it turns out to have, checked before it is handed out)
        charge = len(keys) * page_charge(layout.chunk_nbytes) if layout is not None else 0
        grant = {"loads": 1, "grant_bytes": charge}
        self.ledger.take(self.held, grant, f"session {self.sid}'s load of {len(keys)} chunks")
        try:
            return self._load(args, keys, layout, charge)
        except BaseException:
            self.ledger.give(self.held, grant)
            raise

    def _lookup_of(
        self, args: dict[str, Any], keys: list[ChunkKey], layout: KVLayout | None
    ) -> LookupResult:
        shm = self.server.shm.name
        return LookupResult(
            [
                ChunkHit(i, k, s, shm)
                for i, (k, s) in enumerate(zip(keys, args["starts"], strict=True))
            ],
            args["chunks_total"],
            layout.tokens_per_chunk if layout is not None else 1,
            protocol.decode_accept(args["accept"]) if "accept" in args else Accept.EXACT,
        )

    def _load(
        self, args: dict[str, Any], keys: list[ChunkKey], layout: KVLayout | None, charge: int
    ) -> object:
        """A load through grants (``charge``: what its grant holds of the budget so far)."""
        store, arena = self.server.store, self.server.arena
        lookup = self._lookup_of(args, keys, layout)
        # hits on slower tiers are read straight into arena extents; DRAM hits are served
        # as views of their replicas (out None). load_async reads chunk by chunk, so a
        # chunk whose tier changed since this check is still read correctly either way.
        request_id = args.get("request_id", "")
        shm_tier = self.server.shm
        streamed: list[np.ndarray] = []
        kept = 0
        if layout is None or all(shm_tier.contains(k) for k in keys):
            # every hit in DRAM (or no layout: fresh memory, copied below): the caller's
            # thread, no hand-offs to the I/O pool
            res = store.load(lookup, None, request_id=request_id)
        else:
            dtype = numpy_dtype(layout.dtype)
            outs = [
                None
                if shm_tier.contains(k)
                else arena.alloc(layout.chunk_nbytes, dtype, layout.chunk_shape)
                for k in keys
            ]
            # reads in chunk order, few in flight: the client copies chunk i out of the
            # arena while chunk i + 1 is read (all at once they would finish together)
            depth = max(1, STREAM_BYTES_IN_FLIGHT // layout.chunk_nbytes)
            handle = store.load_async(lookup, outs, request_id=request_id, depth=depth)  # type: ignore[arg-type]
            streamed = self._stream(handle) if args.get("stream") else []
            res = handle.wait()
        grants: list[list[object]] = []
        # streamed chunks that the load's publication still counts (one invalidated
        # meanwhile is not), chunks the client already copied from its lookup's hints,
        # then grants for the rest
        held: list[np.ndarray] = streamed[: res.loaded]
        kept = len(held)
        confirmed = self._confirm(args.get("hints"), res.arrays, len(keys)) if not kept else 0
        held += res.arrays[:confirmed]
        for arr in res.arrays[kept + confirmed :]:
            off = arena.offset_of(arr)
            if off is None:  # a disk read into fresh memory: into the arena for the client
                dst = arena.alloc(arr.nbytes, arr.dtype, arr.shape)
                if dst is None:
                    break  # no room to hand it over: the rest is a miss
                np.copyto(dst, arr)
                arr = dst
                off = arena.offset_of(arr)
                assert off is not None
            held.append(arr)
            grants.append([off, arr.dtype.str, list(arr.shape)])
        actual = sum(page_charge(a.nbytes) for a in held)
        if actual > charge:  # no layout was given: charged now, before it is handed out
            self.ledger.take(self.held, {"grant_bytes": actual - charge}, f"session {self.sid}")
        elif held and actual < charge:
            self.ledger.give(self.held, {"grant_bytes": charge - actual})
        lid = 0
        if held:
            with self._lock:
                lid = next(self._ids)
                self.loads[lid] = _Load(held, actual)
        else:
            self.ledger.give(self.held, {"loads": 1, "grant_bytes": charge})
        return {
            "load": lid,
            "grants": grants,
            "streamed": kept,
            "confirmed": confirmed,
            "requested": res.requested,
            "tiers": dict(res.tiers),
            "corrupt": b"".join(res.corrupt),
            "vanished": res.vanished + (res.loaded - len(held)),
            "read_errors": res.read_errors,
        }

    def _confirm(self, hints: list[int] | None, arrays: list[np.ndarray], nkeys: int) -> int:
        """Leading chunks whose served replica is the extent the client's hint named,
        same offset and generation: the client's copy from there, made after the lookup
        and finished before it releases this load, read only that replica (the extent
        was not reallocated before this pin, and cannot be until the release)."""
        if not hints:
            return 0
        if len(hints) != 2 * nkeys:
            raise ProtocolError(f"{len(hints)} hint numbers for {nkeys} keys: two per key")
        arena = self.server.arena
        n = 0
        for arr, i in zip(arrays, range(0, len(hints), 2), strict=False):
            off = arena.offset_of(arr)
            gen = hints[i + 1]
            if off is None or off != hints[i] or not gen or arena.generation(off) != gen:
                break
            n += 1
        return n

    def _stream(self, handle: LoadHandle) -> list[np.ndarray]:
        """Send each chunk's grant as soon as it (and every chunk before it) verified, so
        the client copies chunk i while later chunks are still read. Only arena arrays
        are streamed; the first other one (or a miss) ends the stream."""
        sent: list[np.ndarray] = []
        if self.part is None or not self.rid:
            return sent
        for i in range(len(handle)):
            arr = handle.chunk(i)
            off = self.server.arena.offset_of(arr) if arr is not None else None
            if arr is None or off is None:
                break
            sent.append(arr)
            self.part(protocol.part_reply(self.rid, [i, off, arr.dtype.str, list(arr.shape)]))
        return sent

    def _load_into(
        self, lookup: LookupResult, into: list[int], layout: KVLayout | None, request_id: str
    ) -> object:
        """Load straight into the session's shared buffers (no grants, no client copy)."""
        if layout is None:
            raise ProtocolError("a load into shared buffers needs the layout")
        if len(into) != 2 * len(lookup.hits):
            raise ProtocolError(f"{len(into)} target numbers for {len(lookup.hits)} hits")
        outs = []
        for i in range(0, len(into), 2):
            buf = self.buffers.get(into[i])
            if buf is None:
                raise ProtocolError(f"session {self.sid} holds no buffer {into[i]}")
            outs.append(buf.view(into[i + 1], layout))
        store = self.server.store
        if all(self.server.shm.contains(h.key) for h in lookup.hits):
            res = store.load(lookup, outs, request_id=request_id)
        else:  # reads in parallel on the I/O pool
            res = store.load_async(lookup, outs, request_id=request_id).wait()
        return {
            "load": 0,
            "grants": [],
            "into": res.loaded,
            "requested": res.requested,
            "tiers": dict(res.tiers),
            "corrupt": b"".join(res.corrupt),
            "vanished": res.vanished,
            "read_errors": res.read_errors,
        }

    def alloc_buffer(self, args: dict[str, Any]) -> object:
        size = page_charge(args["nbytes"])
        # one descriptor each: the server's mapping keeps one open
        charge = {"buffers": 1, "buffer_bytes": size, "descriptors": 1}
        self.ledger.take(self.held, charge, f"session {self.sid}'s shared buffers")
        try:
            buf = SharedBuffer.create(Path(f"{self.server.arena.path}-buf"), size)
        except BaseException:
            self.ledger.give(self.held, charge)
            raise
        with self._lock:
            bid = next(self._ids)
            self.buffers[bid] = buf
        return {"buffer": bid, "path": str(buf.path), "nbytes": buf.size}

    def free_buffer(self, args: dict[str, Any]) -> object:
        with self._lock:
            buf = self.buffers.pop(args["buffer"], None)
        if buf is None:
            raise ProtocolError(f"session {self.sid} holds no buffer {args['buffer']}")
        buf.drop()
        self.ledger.give(self.held, {"buffers": 1, "buffer_bytes": buf.size, "descriptors": 1})
        return None

    def release(self, args: dict[str, Any]) -> object:
        with self._lock:
            load = self.loads.pop(args["load"], None)
        if load is None:
            raise ProtocolError(f"session {self.sid} holds no load {args['load']}")
        load.arrays.clear()
        self.ledger.give(self.held, {"loads": 1, "grant_bytes": load.charge})
        return None

    def prepare_put(self, args: dict[str, Any]) -> object:
        p = self._prompt(args)
        layout = p["identity"].layout
        self._fits(layout)
        nchunks = len(p["tokens"]) // layout.tokens_per_chunk
        # every chunk is charged, whether it gets an extent or another put is writing it
        # (its lists are held either way), before anything is made
        charge = nchunks * page_charge(layout.chunk_nbytes)
        lease = {"puts": 1, "put_bytes": charge}
        self.ledger.take(self.held, lease, f"session {self.sid}'s put of {nchunks} chunks")
        try:
            return self._prepare_put(args, p, layout, nchunks, charge)
        except BaseException:
            self.ledger.give(self.held, lease)
            raise

    def _prepare_put(
        self, args: dict[str, Any], p: dict[str, Any], layout: KVLayout, nchunks: int, charge: int
    ) -> object:
        dtype = numpy_dtype(layout.dtype)
        # zero-memory stand-ins: only the chunks the store does not hold get an extent
        dummy = np.lib.stride_tricks.as_strided(
            np.zeros(1, dtype), shape=layout.chunk_shape, strides=(0,) * 5, writeable=False
        )
        store = self.server.store
        pending = store.prepare_put(
            p["identity"],
            p["namespace"],
            p["tokens"],
            [dummy] * nchunks,
            start=p["start"],
            parent=p["parent"],
            extra_keys=p["extra_keys"],
            request_id=args.get("request_id", ""),
        )
        index = {k: i for i, k in enumerate(pending.keys)}
        views: list[np.ndarray] = []
        slots: list[list[int]] = []
        try:
            for j, (rec, _) in enumerate(pending.items):
                view = self.server.arena.alloc(layout.chunk_nbytes, dtype, layout.chunk_shape)
                if view is None:
                    raise StorageFullError(
                        f"the arena has no room to stage chunk {index[rec.key]} of this put "
                        f"({self.server.arena.stats()})"
                    )
                pending.items[j] = (rec, view)
                views.append(view)
                off = self.server.arena.offset_of(view)
                assert off is not None
                slots.append([index[rec.key], off])
        except BaseException:
            views.clear()
            pending.items[:] = [(rec, dummy) for rec, _ in pending.items]
            store.abort_put(pending, "no room to stage the put")
            raise
        staged = self._stage(layout, args.get("stage", 0))
        with self._lock:  # last: from here on commit or abort gives its budget back
            pid = next(self._ids)
            self.puts[pid] = _Put(pending, views, charge)
        return {
            "put": pid,
            "keys": b"".join(pending.keys),
            "slots": slots,
            "present": pending.present,
            "in_flight": pending.in_flight,
            "staged": staged,
        }

    def _stage(self, layout: KVLayout, count: int) -> list[list[int]]:
        """Up to ``count`` new staged extents of one chunk of ``layout`` ([id, offset]
        each), as far as the session's staging budget and the arena's room allow."""
        dtype = numpy_dtype(layout.dtype)
        n = layout.chunk_nbytes
        size = page_charge(n)
        out: list[list[int]] = []
        for _ in range(count):
            if self.closed or not self._try_stage(size):
                break  # staging is best effort: a put without it takes two round trips
            view = self.server.arena.alloc(n, dtype, layout.chunk_shape)
            if view is None:
                self._unstage_bytes(size)
                break
            off = self.server.arena.offset_of(view)
            assert off is not None
            with self._lock:
                sid = next(self._ids)
                self.staged[sid] = view
            out.append([sid, off])
        return out

    def _try_stage(self, size: int) -> bool:
        """Charge one staged extent (to the staged and the put budgets), if it fits."""
        return self.ledger.try_take(self.held, {"staged_bytes": size, "put_bytes": size})

    def _unstage_bytes(self, size: int) -> None:
        self.ledger.give(self.held, {"staged_bytes": size, "put_bytes": size})

    def put(self, args: dict[str, Any]) -> object:
        """The one-round-trip put: the client wrote every chunk of the prompt into the
        staged extents it names (one per chunk, in order); the chunks the store lacks are
        adopted as they are (no copy), the other extents stay staged for the client.

        ``deferred``: the client sends this before writing the chunks (no reply) and
        ``put_commit`` after, so the store prepares the put while the client copies;
        an error of the prepare is raised by the ``put_commit``."""
        if not args.get("deferred"):
            return self._finish_staged(self._begin_staged(args))
        self._drop_deferred("a new deferred put replaced it")
        try:
            self.deferred = self._begin_staged(args)
        except KVLifeError as exc:
            self.deferred_error = exc
        return None

    def put_commit(self, args: dict[str, Any]) -> object:
        staged, error = self.deferred, self.deferred_error
        self.deferred, self.deferred_error = None, None
        if error is not None:
            raise error
        if staged is None:
            raise ProtocolError(f"session {self.sid} has no deferred put to commit")
        return self._finish_staged(staged)

    def _drop_deferred(self, reason: str) -> None:
        staged, self.deferred, self.deferred_error = self.deferred, None, None
        if staged is not None:
            self._drop_views(staged.views)
            self._unstage(staged.refill)
            self.server.store.abort_put(staged.pending, reason)

    def _drop_views(self, views: list[np.ndarray]) -> None:
        """Staged extents a put took and will not give back: freed, uncharged."""
        self.ledger.give(self.held, {"put_bytes": sum(page_charge(v.nbytes) for v in views)})
        views.clear()

    def _unstage(self, extents: list[list[int]]) -> None:
        """Staged extents the client was never told of (their put failed): freed."""
        with self._lock:
            views = [self.staged.pop(sid, None) for sid, _ in extents]
        for view in views:
            if view is not None:
                self._unstage_bytes(page_charge(view.nbytes))

    def _begin_staged(self, args: dict[str, Any]) -> _Staged:
        p = self._prompt(args)
        layout = p["identity"].layout
        ids = args["staged"]
        nchunks = len(p["tokens"]) // layout.tokens_per_chunk
        if len(ids) != nchunks or len(set(ids)) != len(ids):
            raise ProtocolError(f"{len(ids)} distinct staged extents for {nchunks} chunks")
        views: list[np.ndarray] = []
        with self._lock:
            for sid in ids:
                view = self.staged.get(sid)
                if view is None:
                    raise ProtocolError(f"session {self.sid} holds no staged extent {sid}")
                if view.shape != layout.chunk_shape or view.dtype != numpy_dtype(layout.dtype):
                    raise ProtocolError(
                        f"staged extent {sid} is {view.dtype}{list(view.shape)}, not a chunk "
                        "of this put's layout"
                    )
                views.append(view)
            for sid in ids:  # the put owns them now; unused ones are staged again later
                del self.staged[sid]
        # still the session's (put budget), no longer staged
        self.ledger.give(self.held, {"staged_bytes": sum(page_charge(v.nbytes) for v in views)})
        try:
            pending = self.server.store.prepare_put(
                p["identity"],
                p["namespace"],
                p["tokens"],
                views,
                start=p["start"],
                parent=p["parent"],
                extra_keys=p["extra_keys"],
                request_id=args.get("request_id", ""),
            )
        except BaseException:
            self._drop_views(views)
            raise
        # replacements for the extents the new chunks will take, made now (a deferred put
        # is prepared while the client copies): the commit only hands them out
        refill = self._stage(layout, len(pending.items))
        return _Staged(pending, ids, views, layout, refill)

    def _finish_staged(self, staged: _Staged) -> dict[str, Any]:
        pending, arena = staged.pending, self.server.arena
        used = {arena.offset_of(arr) for _, arr in pending.items}
        for _, arr in pending.items:
            arr.flags.writeable = False  # sealed: the tier adopts it without a copy
        try:
            res = self.server.store.commit_put(pending)
        except BaseException:
            self._drop_views(staged.views)
            self._unstage(staged.refill)
            raise
        pending.items.clear()
        kept: list[list[int]] = []
        gone = 0
        with self._lock:
            for sid, view in zip(staged.ids, staged.views, strict=True):
                off = arena.offset_of(view)
                if off in used or self.closed:
                    gone += page_charge(view.nbytes)
                    continue  # a replica now (or the session ended): never staged again
                assert off is not None
                self.staged[sid] = view
                kept.append([sid, off])
        staged.views.clear()
        self.ledger.give(self.held, {"put_bytes": gone})
        # back where they were taken from a moment ago: no check
        self.ledger.force(
            self.held, {"staged_bytes": page_charge(staged.layout.chunk_nbytes) * len(kept)}
        )
        out = _put_reply(res)
        short = len(staged.ids) - len(kept) - len(staged.refill)  # the arena was full
        out["staged"] = kept + staged.refill + self._stage(staged.layout, max(0, short))
        return out

    def _take_put(self, pid: int) -> _Put:
        with self._lock:
            put = self.puts.pop(pid, None)
        if put is None:
            raise ProtocolError(f"session {self.sid} holds no pending put {pid}")
        return put

    def commit_put(self, args: dict[str, Any]) -> object:
        put = self._take_put(args["put"])
        for view in put.views:
            view.flags.writeable = False  # sealed: the tier adopts it without a copy
        put.views.clear()
        try:
            return _put_reply(self.server.store.commit_put(put.pending))
        finally:
            self._put_done(put)

    def abort_put(self, args: dict[str, Any]) -> object:
        put = self._take_put(args["put"])
        put.views.clear()
        try:
            self.server.store.abort_put(put.pending, args.get("reason", "aborted by caller"))
        finally:
            self._put_done(put)
        return None

    def _put_done(self, put: _Put) -> None:
        self.ledger.give(self.held, {"puts": 1, "put_bytes": put.charge})

    def invalidate(self, args: dict[str, Any]) -> object:
        ns = args.get("namespace")
        prefix = args.get("prefix")
        return self.server.store.invalidate(
            weights_digest=args.get("weights_digest"),
            adapter_id=args.get("adapter_id"),
            namespace=protocol.decode_namespace(ns) if ns is not None else None,
            prefix=ChunkKey(prefix) if prefix is not None else None,
        )

    def info(self, args: dict[str, Any]) -> object:
        out = self.server.store.info().to_json()
        out["server"] = {"socket": self.server.socket_path, **self.server.snapshot()}
        return out

    def check(self, args: dict[str, Any]) -> object:
        report = self.server.store.check(fix=False)
        return {**dataclasses.asdict(report), "clean": report.clean}

    def _fits(self, layout: KVLayout) -> None:
        if layout.chunk_nbytes > self.server.arena.size:
            raise InvalidArgument(
                f"a chunk of this layout is {layout.chunk_nbytes} bytes, more than the "
                f"server's whole arena ({self.server.arena.size} bytes)"
            )

    def _chunks(self, n: int) -> None:
        if n > self.limits.max_chunks:
            raise self.ledger.refuse(
                "chunks",
                f"{n} chunks in one request; at most {self.limits.max_chunks} (--max-chunks)",
            )
