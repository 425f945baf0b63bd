"""The load protocol, server side: lookups, loads by grant (streamed, confirmed from the
lookup's hints) or into shared buffers, releases, and the shared buffers themselves
(the client side is :mod:`kvlife.client.loads`).

1. ``lookup``: the store's lookup; for each DRAM hit, where its replica lies now in the
   arena (offset and allocation generation: the *hints*; 0, 0 for other tiers).
2. ``load`` of the hits' keys (with the layout when the client knows it), one of two
   ways:

   a. *into* the session's shared buffers (``into`` names buffer and offset per hit):
      the store loads straight into views of them (disk reads by O_DIRECT in chunk
      order, :func:`read_depth` in flight; DRAM hits copied here); the reply grants
      nothing. With ``stream``, each chunk's number goes out in a partial reply as soon
      as it and every chunk before it verified in its buffer, unless it is the last or
      the load was published by then: the final reply counts those.
   b. by *grant*: the grant is charged first (every chunk at the layout's size); the
      store loads the hits, DRAM hits as views of their replicas, disk hits read into
      fresh arena extents in chunk order, :func:`read_depth` in flight (at least two
      chunks, so that a chunk's checksum overlaps the next read).
      With ``stream``, each disk chunk's (offset, dtype, shape) goes out in a partial
      reply as soon as it and every chunk before it verified, unless the load was
      published by then (every read finished): the final reply grants those. Leading
      chunks whose replica is the very extent the client's ``hints`` named (same
      offset, same generation) are *confirmed*: the client copied them already while
      this pinned them. The rest get grants (a chunk read outside the arena is copied into an
      extent first). The reply counts streamed, confirmed and granted chunks; every
      array handed out is held as the session's load grant (pinned) until released.
3. ``release`` of a load: its arrays are dropped (extents of deleted replicas freed),
   its budget given back. A session that ends releases all of its grants.

``alloc_buffer`` / ``free_buffer``: a shared-memory file of the session's (charged to the
buffer and descriptor budgets), removed when freed or when the session ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import NotPermitted, ProtocolError
from kvlife.core.identity import ChunkKey, KVLayout
from kvlife.core.payload import numpy_dtype
from kvlife.native.copies import stream_copy
from kvlife.results import ChunkHit, LookupResult
from kvlife.server import protocol
from kvlife.server.buffers import SharedBuffer
from kvlife.server.context import SessionContext
from kvlife.server.limits import page_charge
from kvlife.store.api import LoadProgress
from kvlife.store.direct import Confirmed, FrameHint
from kvlife.store.frame_loads import FrameLoad
from kvlife.tiers.shm import Arena
from kvlife.transforms.contract import Accept

STREAM_BYTES_IN_FLIGHT = 2 << 20
"""Bytes of disk reads a streamed load keeps in flight (at least two chunks: the
checksum of one overlaps the read of the next)."""

FRAME_DEPTH = 1
"""Frame reads in flight of a load into shared buffers read by the extension (its
reader thread reads chunk i + 1 while this thread verifies chunk i). Four, as a
client's direct reads keep (:data:`kvlife.client.direct.DEPTH`), measured slower here
at every chunk size from 256 KiB to 16 MiB with the server on one vCPU: the reads
finish together, so the client's copies start later, and the readers' checks take the
server's vCPU (docs/data-path-log.md, "The server's frame reads at four in flight")."""

EARLY_REST = 512 << 10
"""A streamed chunk's landed bytes are told early (``early`` loads) until at most this
many are left: those are copied once it verified (about 55 µs here), and each early
part costs the client a wake-up and a read."""

_NO_HINT = (0, 0)
"""The hint of a hit not in this session's arena."""


@dataclass(slots=True)
class _Grant:
    arrays: list[np.ndarray]
    """What the client was granted (pinned until it releases the load)."""
    charge: int
    """Bytes of the grant budget it holds."""


class Loads:
    """The load protocol of one session: its grants and its shared buffers."""

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx
        self.grants: dict[int, _Grant] = {}
        self.buffers: dict[int, SharedBuffer] = {}
        self.confirmed: Confirmed | None = None
        """The session's last direct load, until the client says what it kept."""

    def close(self) -> int:
        """Drop every grant and shared buffer; how many grants."""
        with self.ctx.lock:
            grants = len(self.grants)
            buffers = list(self.buffers.values())
            self.grants.clear()
            self.buffers.clear()
        for buf in buffers:
            buf.drop()
        return grants

    # ------------------------------------------------------------------ verbs

    def lookup(self, args: dict[str, Any]) -> object:
        """The store's lookup, answered in one pass: one comprehension per column of the
        reply (keys, tiers, representations) and one call to the DRAM tier for every
        hint (measured on Python 3.11: comprehensions over the frozen hit records beat
        ``map(attrgetter(...))``)."""
        ctx = self.ctx
        p = ctx.prompt(args)
        opts = dict(args.get("opts", {}))
        direct = bool(opts.pop("direct", False))
        if "accept" in opts:
            opts["accept"] = protocol.decode_accept(opts["accept"])
        res = ctx.lookup(p, **opts)  # the scopes its principal may read (context.py)
        number = {name: i for i, name in enumerate(ctx.store.tier_names)}
        shm = ctx.shm
        hits = res.hits
        keys = [h.key for h in hits]
        tiers = [number[h.tier] for h in hits]
        # only replicas in the arena this session maps (with principals: its own)
        arena = ctx.arena if ctx.mapped else None
        dram = number.get(shm.name, -1)
        if arena is None or dram not in tiers:
            hints = [0] * (2 * len(hits))
        else:
            where = shm.hints(keys, arena)
            if tiers.count(dram) != len(tiers):  # a hint only for a hit served from DRAM
                where = [w if t == dram else _NO_HINT for w, t in zip(where, tiers, strict=True)]
            hints = list(chain.from_iterable(where))
        out = {
            "keys": b"".join(keys),
            # where each DRAM hit lies now (offset, generation; 0, 0 for other tiers): a
            # load may copy from there at once and have the server confirm it
            "hints": hints,
            "tiers": tiers,
            "chunks_total": res.chunks_total,
            # each hit's representation: what it will serve and what decoding it costs
            # (tuples: msgpack writes them as the arrays it always wrote)
            "forms": [
                (h.transform, h.exactness, h.stored_nbytes, h.decode_nbytes, h.decode_seconds)
                for h in hits
            ],
            "refusal": res.refusal,
        }
        if direct and direct_reads(ctx) and hits:
            out["frames"] = frame_fields(ctx.store.frame_hints(hits))
        return out

    def load(self, args: dict[str, Any]) -> object:
        ctx = self.ctx
        # a direct load's confirmation counts only with the word that follows it: any
        # load, refused or not, ends the one before (a raw client's word after a refused
        # direct load would otherwise count an older one)
        self.confirmed = None
        keys, _ = load_keys(ctx, args)
        if "direct" in args:
            return self._confirm_direct(args, keys)
        layout = protocol.decode_layout(args["layout"]) if "layout" in args else None
        if layout is not None:
            ctx.fits(layout)
        if "into" in args:
            lookup = self._lookup_of(args, keys, layout)
            return self._into(
                lookup, args["into"], layout, args.get("request_id", ""), bool(args.get("stream"))
            )
        # the grant is charged before the load: every chunk at its layout's size (none
        # known: at the size it turns out to have, checked before it is handed out)
        charge = len(keys) * page_charge(layout.chunk_nbytes) if layout is not None else 0
        grant = {"loads": 1, "grant_bytes": charge}
        ctx.take(grant, f"session {ctx.sid}'s load of {len(keys)} chunks")
        try:
            return self._granted(args, keys, layout, charge)
        except BaseException:
            ctx.give(grant)
            raise

    def release(self, args: dict[str, Any]) -> object:
        with self.ctx.lock:
            grant = self.grants.pop(args["load"], None)
        if grant is None:
            raise ProtocolError(f"session {self.ctx.sid} holds no load {args['load']}")
        grant.arrays.clear()
        self.ctx.give({"loads": 1, "grant_bytes": grant.charge})
        return None

    def alloc_buffer(self, args: dict[str, Any]) -> object:
        ctx = self.ctx
        size = page_charge(args["nbytes"])
        # one descriptor each: the server's mapping keeps one open
        charge = {"buffers": 1, "buffer_bytes": size, "descriptors": 1}
        ctx.take(charge, f"session {ctx.sid}'s shared buffers")
        try:
            buf = SharedBuffer.create(Path(f"{ctx.arena.path}-buf"), size, ctx.arena.owner)
        except BaseException:
            ctx.give(charge)
            raise
        with ctx.lock:
            bid = ctx.new_id()
            self.buffers[bid] = buf
        return {"buffer": bid, "path": str(buf.path), "nbytes": buf.size}

    def free_buffer(self, args: dict[str, Any]) -> object:
        with self.ctx.lock:
            buf = self.buffers.pop(args["buffer"], None)
        if buf is None:
            raise ProtocolError(f"session {self.ctx.sid} holds no buffer {args['buffer']}")
        buf.drop()
        self.ctx.give({"buffers": 1, "buffer_bytes": buf.size, "descriptors": 1})
        return None

    # ------------------------------------------------------------------ the two ways

    def _lookup_of(
        self, args: dict[str, Any], keys: list[ChunkKey], layout: KVLayout | None
    ) -> LookupResult:
        shm = self.ctx.shm.name
        return LookupResult(
            [
                ChunkHit(i, k, s, shm)
                for i, (k, s) in enumerate(zip(keys, args["starts"], strict=True))
            ],
            args["chunks_total"],
            layout.tokens_per_chunk if layout is not None else 1,
            protocol.decode_accept(args["accept"]) if "accept" in args else Accept.EXACT,
        )

    def _granted(
        self, args: dict[str, Any], keys: list[ChunkKey], layout: KVLayout | None, charge: int
    ) -> object:
        """A load through grants (``charge``: what its grant holds of the budget so far)."""
        ctx = self.ctx
        store, arena = ctx.store, ctx.arena
        lookup = self._lookup_of(args, keys, layout)
        # hits on slower tiers are read straight into arena extents; DRAM hits are served
        # as views of their replicas (out None). load_async reads chunk by chunk, so a
        # chunk whose tier changed since this check is still read correctly either way.
        request_id = args.get("request_id", "")
        shm_tier = ctx.shm
        streamed: list[np.ndarray] = []
        kept = 0
        # the arena offset of each extent read into, by its view's id (the views live in
        # ``outs`` until the end: no other array shares their ids meanwhile)
        where: dict[int, int] = {}
        if layout is None or all(shm_tier.contains(k) for k in keys):
            # every hit in DRAM (or no layout: fresh memory, copied below): the caller's
            # thread, no hand-offs to the I/O pool
            res = store.load(lookup, None, request_id=request_id)
        else:
            missing = [i for i, k in enumerate(keys) if not shm_tier.contains(k)]
            made = arena.alloc_many(
                layout.chunk_nbytes, numpy_dtype(layout.dtype), layout.chunk_shape, len(missing)
            )
            # a chunk the arena had no room for is read into new memory (copied below)
            outs: list[np.ndarray | None] = [None] * len(keys)
            for i, (view, at) in zip(missing, made, strict=False):
                outs[i] = view
                where[id(view)] = at
            # reads in chunk order, few in flight: the client copies chunk i out of the
            # arena while chunk i + 1 is read (all at once they would finish together);
            # never fewer than two, so that the checksum of chunk i runs while chunk
            # i + 1 is read (one at a time, read and checksum ran one after the other)
            with self._disk_load(lookup, outs, layout, request_id) as handle:
                streamed = (
                    self._stream(handle, where, outs, bool(args.get("early")))
                    if args.get("stream")
                    else []
                )
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
            off = _offset(arena, where, arr)
            if off is None:  # a disk read into fresh memory: into the arena for the client
                dst = arena.alloc(arr.nbytes, arr.dtype, arr.shape)
                if dst is None:
                    break  # no room to hand it over: the rest is a miss
                stream_copy(dst, arr)
                arr = dst
                off = arena.offset_of(arr)
                assert off is not None
            held.append(arr)
            grants.append([off, arr.dtype.str, list(arr.shape)])
        # streamed chunks the publication does not count (invalidated while the load
        # ran) were sent all the same: the client copies each out of the arena when it
        # reads its part, which may be after this reply. Their extents stay pinned with
        # the grant until the client releases it; freed now, another put could reuse
        # and overwrite them before the client's copy, which hands the chunk out.
        pinned = held + streamed[kept:]
        actual = sum(page_charge(a.nbytes) for a in pinned)
        if actual > charge:  # no layout was given: charged now, before it is handed out
            ctx.take({"grant_bytes": actual - charge}, f"session {ctx.sid}")
        elif pinned and actual < charge:
            ctx.give({"grant_bytes": charge - actual})
        lid = 0
        if pinned:
            with ctx.lock:
                lid = ctx.new_id()
                self.grants[lid] = _Grant(pinned, actual)
        else:
            ctx.give({"loads": 1, "grant_bytes": charge})
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
        arena = self.ctx.arena
        n = 0
        for arr, i in zip(arrays, range(0, len(hints), 2), strict=False):
            off = arena.offset_of(arr)
            gen = hints[i + 1]
            if off is None or off != hints[i] or not gen or arena.generation(off) != gen:
                break
            n += 1
        return n

    @contextmanager
    def _disk_load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray | None],
        layout: KVLayout,
        request_id: str,
    ) -> Iterator[LoadProgress]:
        """A load with disk hits into ``outs`` (None: new memory), started: the leading
        hits served exact from disk read from their frames by the extension from this
        thread, without pins or the I/O pool (:mod:`kvlife.store.frame_loads`); where
        it cannot (principals, buffers O_DIRECT cannot fill), the store's
        ``load_async`` with :func:`read_depth` in flight. Its reads have ended when
        this exits, waited for or not (the buffers may go after it)."""
        store = self.ctx.store
        frames = (
            store.load_frames(lookup, outs, request_id=request_id, depth=FRAME_DEPTH)
            if self.ctx.tenancy is None
            else None
        )
        if frames is None:
            yield store.load_async(
                lookup,
                outs,  # type: ignore[arg-type]
                request_id=request_id,
                depth=read_depth(layout.chunk_nbytes),
            )
            return
        try:
            yield frames
        finally:
            frames.close()  # a no-op once waited

    def _stream(
        self,
        handle: LoadProgress,
        where: dict[int, int],
        outs: Sequence[np.ndarray | None],
        early: bool,
    ) -> list[np.ndarray]:
        """Send each chunk's grant as soon as it (and every chunk before it) verified, so
        the client copies chunk i while later chunks are still read. Only arena arrays
        are streamed; the first other one (or a miss) ends the stream, and the final
        reply grants the rest. ``where``: the offsets of the extents the load reads
        into, by their views' ids (any other array's is looked up).

        Chunks verified once the load was published (every read finished) get no
        partial reply of their own (issue 28): the final reply follows at once, and
        one frame replaces one per chunk (a ``sendall`` here, a wake-up, a read and an
        unpack on the client for each). The last chunk still gets one when it comes
        before the publication: the client copies it meanwhile (sent with the final
        reply instead, 4 x 2 MiB loads took 0.24-0.30 ms longer in two paired runs).

        ``early`` (the client asked for it): each chunk a frame load reads has its
        landed bytes told before it verified
        (:meth:`~kvlife.store.frame_loads.FrameLoad.landed`), in parts ``[i, offset,
        dtype, shape, bytes]``: a frame read whole once it landed, the one read in
        pieces (the run's last) as they land. The client copies them into the caller's
        buffer while the server verifies them and reads on, and keeps the copy only if
        chunk ``i``'s own part follows (the last :data:`EARLY_REST` bytes or fewer of a
        frame read in pieces are copied after it)."""
        ctx = self.ctx
        sent: list[np.ndarray] = []
        if ctx.part is None or not ctx.rid:
            return sent
        landed = handle.landed if early and isinstance(handle, FrameLoad) else None
        for i in range(len(handle)):
            out = outs[i]  # one per hit (None: read into new memory)
            if landed is not None and out is not None:
                self._tell_landed(landed, i, out, _offset(ctx.arena, where, out))
            arr = handle.chunk(i)
            if arr is None or handle.done():
                break
            off = _offset(ctx.arena, where, arr)
            if off is None:
                break
            sent.append(arr)
            ctx.part(protocol.part_reply(ctx.rid, [i, off, arr.dtype.str, list(arr.shape)]))
        return sent

    def _tell_landed(
        self, landed: Callable[[int, int], int], i: int, out: np.ndarray, off: int | None
    ) -> None:
        """Parts telling the client how many bytes of chunk ``i`` landed in its extent
        (``out``, at ``off``), not yet verified: all of a frame read whole once it
        landed; of one read in pieces, at each half of what is left until at most
        :data:`EARLY_REST` are (``landed`` says 0: none, its read or header failed)."""
        ctx = self.ctx
        if off is None or ctx.part is None:
            return
        size = out.nbytes
        told = 0
        while size - told > EARLY_REST:
            got = landed(i, told + (size - told) // 2)
            if got <= told:
                return
            told = min(got, size)
            ctx.part(protocol.part_reply(ctx.rid, [i, off, out.dtype.str, list(out.shape), told]))

    def _confirm_direct(self, args: dict[str, Any], keys: list[ChunkKey]) -> object:
        """The chunks a client reads from their disk frames itself (the frames its
        lookup named): how many, from the first, are live in those frames now
        (:mod:`kvlife.store.direct`). The load is counted when the client says how many
        it kept (:meth:`direct_kept`, the frame that follows)."""
        if not direct_reads(self.ctx):
            raise NotPermitted(
                "direct reads are for sessions of a server without principals that map its arena"
            )
        where = args["direct"]
        if len(where) != 2 * len(keys):
            raise ProtocolError(f"{len(where)} frame numbers for {len(keys)} keys")
        frames = list(zip(where[0::2], where[1::2], strict=True))
        found = self.ctx.store.confirm_direct(keys, frames, args.get("request_id", ""))
        self.confirmed = found  # counted once the client says how many it kept
        return {"confirmed": len(found.found)}

    def direct_kept(self, args: dict[str, Any]) -> None:
        """``direct_kept`` (no reply): how many chunks of its last direct load the client
        verified; the first that many confirmed are counted as loaded. One told of no
        direct load (or twice) counts nothing."""
        found, self.confirmed = self.confirmed, None
        if found is not None:
            self.ctx.store.record_direct(found, args["chunks"])

    def _stream_into(self, handle: LoadProgress) -> int:
        """Send each chunk's number as soon as it (and every chunk before it) verified
        in the client's shared buffer, so the client may use it while later chunks are
        read; the first miss ends the stream, and the final reply counts the rest. How
        many were sent.

        The last chunk, and any verified once the load was published, ride in the
        final reply (issue 28): the client has nothing to do with them before it (no
        copy), so one frame replaces one per chunk (see :meth:`_stream`), and this
        thread waits for the publication alone, not for the last chunk first and then
        the publication (one wake-up less)."""
        ctx = self.ctx
        if ctx.part is None or not ctx.rid:
            return 0
        sent = 0
        for i in range(len(handle) - 1):  # the last one rides in the final reply
            if handle.chunk(i) is None or handle.done():
                break
            ctx.part(protocol.part_reply(ctx.rid, [i]))
            sent += 1
        return sent

    def _into(
        self,
        lookup: LookupResult,
        into: list[int],
        layout: KVLayout | None,
        request_id: str,
        stream: bool,
    ) -> object:
        """Load straight into the session's shared buffers (no grants, no client copy):
        disk reads in chunk order, :func:`read_depth` in flight, each chunk's number sent
        in a partial reply (``stream``) once it and every chunk before it verified."""
        if layout is None:
            raise ProtocolError("a load into shared buffers needs the layout")
        if len(into) != 2 * len(lookup.hits):
            raise ProtocolError(f"{len(into)} target numbers for {len(lookup.hits)} hits")
        outs = []
        for i in range(0, len(into), 2):
            buf = self.buffers.get(into[i])
            if buf is None:
                raise ProtocolError(f"session {self.ctx.sid} holds no buffer {into[i]}")
            outs.append(buf.view(into[i + 1], layout))
        store = self.ctx.store
        if all(self.ctx.shm.contains(h.key) for h in lookup.hits):
            res = store.load(lookup, outs, request_id=request_id)
        else:
            # in chunk order, few in flight: chunk i is verified (and told to the client)
            # while later ones are read
            with self._disk_load(lookup, outs, layout, request_id) as handle:
                if stream:
                    self._stream_into(handle)
                res = handle.wait()
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


def _offset(arena: Arena, where: dict[int, int], arr: np.ndarray) -> int | None:
    """``arr``'s offset in ``arena``: from ``where`` (the extents a load read into, by
    their views' ids) or looked up (None: not an extent of it)."""
    off = where.get(id(arr))
    return off if off is not None else arena.offset_of(arr)


def direct_reads(ctx: SessionContext) -> bool:
    """Whether a session may read disk frames itself: it maps the server's arena, and
    the server has no principals (its segment files hold every tenant's frames; a
    principal that maps an arena of its own must not be told where they are)."""
    return ctx.mapped and ctx.tenancy is None


def frame_fields(found: list[FrameHint | None]) -> list[list[Any] | None]:
    """A lookup reply's ``frames``: for each hit ``[path, segment, offset, header]`` of
    its disk frame (the header: the used bytes a frame written for its row holds), or
    nil (not on disk, not exact)."""
    return [None if f is None else [f.path, f.row.seg, f.row.off, f.row.header()] for f in found]


def read_depth(chunk_nbytes: int) -> int:
    """Disk reads a load keeps in flight: :data:`STREAM_BYTES_IN_FLIGHT` worth, never
    fewer than two (the checksum of one chunk runs while the next is read)."""
    return max(2, STREAM_BYTES_IN_FLIGHT // max(chunk_nbytes, 1))


def load_keys(ctx: SessionContext, args: dict[str, Any]) -> tuple[list[ChunkKey], list[int]]:
    """A load request's keys and starts, checked against each other and the prompt's
    size, and charged to the session's per-request chunk bound."""
    keys = protocol.split_keys(args["keys"])
    starts = args["starts"]
    if len(starts) != len(keys):
        raise ProtocolError(f"{len(starts)} starts for {len(keys)} keys")
    if len(keys) > args["chunks_total"]:
        raise ProtocolError(f"{len(keys)} hits of a prompt of {args['chunks_total']} chunks")
    ctx.chunks(len(keys))
    return keys, starts
