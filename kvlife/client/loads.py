"""The load protocol, client side: lookups, the three ways a load gets its bytes, and
shared output buffers (the server side is :mod:`kvlife.server.loads`).

1. ``lookup`` sends the prompt and gets the hits: each one's key, tier and
   representation and, for a DRAM hit, where its replica lies in the arena now (offset
   and allocation generation: the *hints*). The answer (:class:`RemoteLookup`)
   remembers the identity (the load needs the layout), the hints and the connection
   (its epoch) it came on.
2. ``load`` sends the hits' keys, starts and the layout, and gets the bytes one of
   three ways, chosen here:

   a. *hinted* (every hit a DRAM replica with a hint from this connection, the caller's
      buffers fitting the layout, or no buffers: new arrays taken from the client's pool
      first, :meth:`Loads._fresh`): the hints go with the request, and while the server
      pins the replicas this side copies each chunk from where the lookup saw it. The
      reply says how many leading chunks the server *confirmed* (the extent still holds
      that replica: same offset, same generation); the rest come as grants.
   b. *into shared buffers* (every buffer inside a buffer from ``alloc_buffer`` of this
      connection): the request names (buffer, offset) targets and the server writes
      the chunks there itself; nothing is copied here. With disk reads each chunk's
      number comes in a partial reply as soon as it verified in its buffer (an
      asynchronous load hands it out then, while the server reads the next); the last
      chunk, and any verified once the load was published, only with the final reply.
   c. *grants*: the server pins each chunk in the arena (a DRAM replica, or a disk read
      landed in a fresh extent) and replies with (offset, dtype, shape) per chunk; this
      side copies each into the caller's buffer or a new array. With disk reads the
      grants are *streamed*: each comes in a partial reply as soon as it verified and
      is copied while the server reads the next; the final reply says how many streamed
      chunks still count (one invalidated meanwhile is a miss) and grants the rest
      (chunks verified once the load was published among them).

3. The grant (what the server pinned for a, c) is released with the next request, or
   at once when a copy failed (:meth:`~kvlife.client.wire.Wire.release`).

Copies: one per chunk (arena to buffer) in a and c, none in b. A load without buffers
hands out read-only arrays from the client's pool (:meth:`Loads.new_array`): their memory
goes back to it when the caller drops the last view of one.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from kvlife.client import copies, direct, replies
from kvlife.client.connection import Connection
from kvlife.client.handles import RemoteLoadHandle, RemoteLookup
from kvlife.client.wire import Wire
from kvlife.core import errors
from kvlife.core.identity import KEY_BYTES, ChunkKey, KVLayout
from kvlife.core.objects import PromptRef, TierName
from kvlife.core.payload import numpy_dtype
from kvlife.native.copies import stream_copy
from kvlife.native.spans import spans
from kvlife.results import ChunkHit, LoadResult, LookupResult
from kvlife.server import protocol
from kvlife.tiers.buffers import RecyclingPool
from kvlife.transforms.contract import Accept

log = logging.getLogger("kvlife.client")

OnChunk = Callable[[int, np.ndarray | None], None]
"""Told of each chunk as soon as it is in its buffer (an asynchronous load's handle)."""


Said = tuple[int, bytes, int, TierName, tuple[Any, ...]]
"""What a lookup reply says of one hit: chunk number, key, position, tier and
representation (transform, class, stored bytes, decoded bytes, decode seconds)."""


def _record(said: Said) -> ChunkHit:
    """The hit record of what a lookup reply said of a chunk; ProtocolError for a
    representation of other fields or of other types (a record holds what it says)."""
    i, key, pos, tier, form = said
    if len(form) != 5:
        raise errors.ProtocolError(f"lookup reply's representation of {len(form)} fields, not 5")
    transform, exactness, stored, decoded, seconds = form
    if not (
        type(transform) is str
        and type(exactness) is str
        and type(stored) is int
        and type(decoded) is int
        and type(seconds) in (float, int)
    ):
        raise errors.ProtocolError(f"lookup reply's representation of other types: {form!r}")
    return ChunkHit(i, ChunkKey(key), pos, tier, transform, exactness, stored, decoded, seconds)


def _lookup_fields(r: Any) -> tuple[int, str, tuple[int, ...]]:
    """A lookup reply's chunk count, refusal and hints, each of its type (ProtocolError
    otherwise), checked against the count of its hits before ``_hits`` keeps any
    record of it: a garbled reply is refused whole, not read as a lookup whose refusal
    is ``'None'``, whose prompt has fewer chunks than its hits, or whose hints are no
    offsets. A reply without hints (a server that sends none) has none."""
    fields = ("keys", "tiers", "forms", "chunks_total", "refusal")
    if not isinstance(r, dict) or not all(f in r for f in fields):
        raise errors.ProtocolError(f"lookup reply without every field of {fields}")
    tiers, total, refusal = r["tiers"], r["chunks_total"], r["refusal"]
    hints = r.get("hints", [])
    if not isinstance(tiers, list):
        raise errors.ProtocolError("lookup reply's keys, tiers or forms of the wrong type")
    count = len(tiers)
    if type(total) is not int or total < count:
        raise errors.ProtocolError(f"lookup reply of {count} hits in {total!r} chunks")
    if type(refusal) is not str:
        raise errors.ProtocolError(f"lookup reply's refusal {refusal!r} is no text")
    if not (
        isinstance(hints, list)
        and len(hints) in (0, 2 * count)
        and (not hints or (set(map(type, hints)) == {int} and min(hints) >= 0))
    ):  # C-level passes, as _hits's: no Python step per hit
        raise errors.ProtocolError(
            f"lookup reply's hints are not two numbers >= 0 per hit: {str(hints)[:64]}"
        )
    return total, refusal, tuple(hints)


class Loads:
    """The client side of the load protocol on one :class:`Wire`."""

    def __init__(self, wire: Wire, direct_reads: bool = False) -> None:
        self.wire = wire
        self.direct_reads = direct_reads
        """Ask lookups for the disk hits' frames and read those here
        (:mod:`kvlife.client.direct`)."""
        self.early = True
        """Ask a served load into C-contiguous buffers (or new arrays) for its chunks'
        landed bytes before they verify, to copy them meanwhile (False: each chunk is
        copied once it verified; ``kvlife bench server`` times both, paired)."""
        self.direct_fallbacks = 0
        """Chunks of direct loads this side did not keep (not verified here, or not
        confirmed): each loaded through the server instead, which counts what it found."""
        self.direct_off: str | None = None
        """Why this client stopped asking for frames (``direct_reads`` turned False): a
        load found the server's segment files out of its reach
        (:func:`kvlife.client.direct.unreachable`); None while it reads them, or was
        not asked to."""
        self._fallbacks_lock = threading.Lock()
        """Direct loads run on several threads at once (``load_async``): each adds its
        fallbacks under it."""
        self._known: dict[tuple[Any, ...], ChunkHit] = {}
        """Hit records answered before, by everything they say (:meth:`_hits`)."""
        self._new_arrays = RecyclingPool(NEW_ARRAYS_KEEP_BYTES)
        """The memory of the new arrays a load without buffers hands out, taken back
        warm when the caller drops the last view of one (:meth:`new_array`)."""

    def new_array(self, shape: Sequence[int], dtype: np.dtype[Any]) -> np.ndarray:
        """A new writable array of ``shape`` and ``dtype`` (its contents undefined) for a
        load without buffers: page-aligned memory from this client's pool, recycled
        once no view of it is left, so that loads after the first do not fault every
        page of their chunks in (fresh memory, first touched by the copy, ran at a
        fifth of memcpy here; ``kvlife bench io``, "copy into freshly allocated
        arrays")."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self._new_arrays.take(nbytes).view(dtype).reshape(shape)

    def _hits(
        self, blob: bytes, tiers: list[int], forms: list[list[Any]], start: int, n: int
    ) -> list[ChunkHit]:
        """The hit records of a lookup reply, in one pass without a Python step per hit
        for a chunk seen before. A record is frozen, so one that says the same (chunk
        number, key, position, tier, representation) as a record answered before is
        that record: a repeated prompt, or one sharing a prefix, builds no new record
        for the chunks it shares. The keys are cut from the blob, the tier names and
        representations mapped, and the records found by C-level maps; only the
        records not seen before are built, one by one. The reply's fields are msgpack
        str/int/float already: no per-hit conversions."""
        if not (isinstance(blob, bytes) and isinstance(tiers, list) and isinstance(forms, list)):
            raise errors.ProtocolError("lookup reply's keys, tiers or forms of the wrong type")
        count = len(tiers)
        kb = KEY_BYTES
        if len(blob) != kb * count or len(forms) != count:
            raise errors.ProtocolError(
                f"lookup reply of {len(blob)} key bytes, {count} tiers, {len(forms)} forms"
            )
        names = [TierName(t) for t in self.wire.names]
        if count and (set(map(type, tiers)) != {int} or min(tiers) < 0 or max(tiers) >= len(names)):
            raise errors.ProtocolError(
                f"lookup reply names tiers other than 0..{len(names) - 1}: {tiers[:8]!r}"
            )
        known = self._known
        if len(known) > KNOWN_HITS:
            known.clear()  # bounded: a new prompt mix starts afresh
        ends = range(kb, kb * count + 1, kb)
        keys = map(blob.__getitem__, map(slice, range(0, kb * count, kb), ends))
        try:
            said = list(
                zip(
                    range(count),
                    keys,
                    range(start, start + count * n, n),
                    map(names.__getitem__, tiers),
                    map(tuple, forms),
                    strict=True,
                )
            )
            hits = list(map(known.get, said))
        except TypeError as exc:  # a representation that is no array, or holds one
            raise errors.ProtocolError(f"lookup reply's representations: {exc}") from None
        if None in hits:  # chunks not seen before (or since the last clear)
            new = [(i, _record(s)) for i, s in enumerate(said) if hits[i] is None]
            for i, hit in new:  # kept only once every record of the reply was read
                hits[i] = known[said[i]] = hit
        return cast(list[ChunkHit], hits)  # no None left

    def lookup(self, prompt: PromptRef, accept: Accept) -> RemoteLookup:
        args = protocol.encode_prompt(prompt)
        opts: dict[str, Any] = {}
        if accept != Accept.EXACT:
            opts["accept"] = protocol.encode_accept(accept)
        if self.direct_reads:
            opts["direct"] = True
        if opts:
            args["opts"] = opts
        r, conn = self.wire.call_on("lookup", args)
        n = prompt.identity.layout.tokens_per_chunk
        total, refusal, hints = _lookup_fields(r)  # read before any record is kept
        frames: tuple[direct.Frame | None, ...] = ()
        if "frames" in r:
            blob = r["keys"]
            count = len(r["tiers"])
            if not isinstance(blob, bytes) or len(blob) != KEY_BYTES * count:
                raise errors.ProtocolError("lookup reply's keys do not match its tiers")
            keys = [blob[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(count)]
            frames = direct.parse_frames(r["frames"], keys)
        hits = self._hits(r["keys"], r["tiers"], r["forms"], prompt.start, n)
        return RemoteLookup(
            hits,
            total,
            n,
            accept,
            int(bool(refusal)),
            refusal,
            prompt.identity,
            hints,
            conn.epoch,
            frames,
        )

    def load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None,
        request_id: str,
        on_chunk: OnChunk | None = None,
    ) -> LoadResult:
        hits = lookup.hits
        if not hits:
            return LoadResult([], 0, 0)
        if not self.wire.mapped():  # a session that maps no arena: through the socket
            return copies.load_inline(self.wire, lookup, outs, request_id, on_chunk)
        if isinstance(lookup, RemoteLookup) and lookup.frames:
            if outs is not None:
                if direct.usable(lookup.frames, outs):
                    return self._load_direct(lookup, outs, request_id, on_chunk)
            else:
                fresh = self._direct_arrays(lookup)
                if fresh is not None and direct.usable(lookup.frames, fresh):
                    return self._load_direct_new(lookup, fresh, request_id, on_chunk)
        res = self._load_mapped(lookup, outs, request_id, on_chunk)
        got = res.loaded
        if got == len(hits) or not res.vanished or res.corrupt or not _tenant(self.wire):
            return res
        # the rest was not handed over (with principals the session's arena is its
        # principal's own, which may have no room for the copies): through the socket
        tail = None if on_chunk is None else _shifted(on_chunk, got)
        rest = copies.load_inline(
            self.wire,
            lookup.sub(got, len(hits)),
            None if outs is None else outs[got:],
            request_id,
            tail,
        )
        tiers = dict(res.tiers)  # the server counts what it read, handed over or not
        if sum(tiers.values()) < got + rest.loaded:
            for tier, n in rest.tiers.items():
                tiers[tier] = tiers.get(tier, 0) + n
        return LoadResult(
            res.arrays + rest.arrays,
            got + rest.loaded,
            res.requested,
            tiers=tiers,
            corrupt=rest.corrupt,
            vanished=rest.vanished,
            read_errors=res.read_errors + rest.read_errors,
        )

    def _load_direct(
        self,
        lookup: RemoteLookup,
        outs: Sequence[np.ndarray],
        request_id: str,
        on_chunk: OnChunk | None,
    ) -> LoadResult:
        """Read the hits' disk frames here, verified, while the server confirms them
        live in those frames; the leading chunks both verified and confirmed are
        loaded, the rest through the server (:mod:`kvlife.client.direct`)."""
        hits = lookup.hits
        frames = [f for f in lookup.frames if f is not None]
        n = len(hits)
        try:  # the reads start first: they run while the request goes and the reply comes
            run = direct.start_reads(frames, outs)
        except (ValueError, OverflowError):  # buffers O_DIRECT cannot fill: nothing read
            # (or a frame past what the extension takes): through the server, which stages
            return self._load_mapped(lookup, outs, request_id, on_chunk)
        if run.reading == 0:  # not one segment file opened here: nothing to confirm
            run.close()
            self._none_opened(lookup, frames[0].path, n)
            return self._load_mapped(lookup, outs, request_id, on_chunk)
        args: dict[str, Any] = {
            "keys": b"".join(h.key for h in hits),
            "starts": [h.start for h in hits],
            "chunks_total": lookup.chunks_total,
            "direct": [x for f in frames for x in (f.seg, f.off)],
        }
        if request_id:
            args["request_id"] = request_id
        verified = [0]

        def kept(conn: Connection) -> None:
            # after the reply, under the connection's lock: the server counts what was
            # kept (the fewer of this and what it confirmed) when it reads this word
            if conn.epoch == lookup.epoch:  # else another server: its frames are not these
                verified[0] = run.finish()
            conn.sock.sendall(protocol.pack([0, "direct_kept", {"chunks": verified[0]}]))

        try:
            r, _ = self.wire.call_on("load", args, after_reply=kept)
        finally:
            run.close()  # spent already unless the exchange failed: the reads end first
        got = min(direct.confirmed(r, n), verified[0])
        with self._fallbacks_lock:
            self.direct_fallbacks += n - got
        if on_chunk is not None:
            for i in range(got):
                on_chunk(i, outs[i])
        tiers: dict[str, int] = {}
        for h in hits[:got]:
            tiers[h.tier] = tiers.get(h.tier, 0) + 1
        if got == n:
            return LoadResult(list(outs), n, n, tiers=tiers)
        # the rest through the server, which reads, verifies and counts what it finds
        rest = self._load_mapped(
            lookup.sub(got, n),
            outs[got:],
            request_id,
            None if on_chunk is None else _shifted(on_chunk, got),
        )
        for tier, k in rest.tiers.items():
            tiers[tier] = tiers.get(tier, 0) + k
        return LoadResult(
            list(outs[:got]) + rest.arrays,
            got + rest.loaded,
            n,
            tiers=tiers,
            corrupt=rest.corrupt,
            vanished=rest.vanished,
            read_errors=rest.read_errors,
        )

    def _load_mapped(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None,
        request_id: str,
        on_chunk: OnChunk | None,
    ) -> LoadResult:
        """A load through this session's arena (hints, grants, streamed parts)."""
        hits = lookup.hits
        args: dict[str, Any] = {
            "keys": b"".join(h.key for h in hits),
            "starts": [h.start for h in hits],
            "chunks_total": lookup.chunks_total,
            "accept": protocol.encode_accept(lookup.accept),
        }
        early = None
        fresh: list[np.ndarray] | None = None
        epoch = lookup.epoch if isinstance(lookup, RemoteLookup) else -1
        if isinstance(lookup, RemoteLookup) and lookup.identity is not None:
            # the layout lets the server read disk hits straight into arena extents
            args["layout"] = protocol.encode_layout(lookup.identity.layout)
            if outs is not None:  # all in DRAM: copied here from the hints, any buffers
                early = self._hinted(lookup, outs, args)
            else:  # new arrays: the same, into arrays taken now where every hit is hinted
                fresh = self._fresh(lookup)
                early = self._hinted(lookup, fresh, args) if fresh is not None else None
            if outs is not None and early is None:
                into = self._targets(outs, lookup.identity.layout)
                if into is not None:
                    args["into"] = into
        if request_id:
            args["request_id"] = request_id
        arrays: list[np.ndarray] = []
        view = self.wire.view
        landing = _Early(self.new_array)

        def take(conn: Connection, i: int, off: int, dtype: str, shape: Sequence[int]) -> None:
            src = view(conn, off, dtype, shape)
            start, held = landing.taken(i, off, src)
            if held is not None:  # its first bytes copied as they landed: the rest
                _copy_bytes(held, src, start, src.nbytes)
                out = held
            elif outs is not None:
                out = copies.copy_into(outs[i], src)
            else:
                out = self.new_array(src.shape, src.dtype)
                stream_copy(out, src)
            if outs is None:
                out.flags.writeable = False
            del src
            arrays.append(out)
            if on_chunk is not None:
                on_chunk(i, out)

        def on_landed(conn: Connection, p: list[Any]) -> None:
            # the first bytes of the chunk being read, landed but not verified yet:
            # copied now, kept only if the chunk's own part follows (take)
            i, off, dtype, shape, upto = replies.landed_part(p)
            if i != len(arrays) or i >= len(hits):
                raise errors.ProtocolError(f"landed bytes of chunk {i} out of order")
            src = view(conn, off, dtype, shape)
            if upto > src.nbytes:
                raise errors.ProtocolError(
                    f"landed part of {upto} bytes for a chunk of {src.nbytes}"
                )
            dst = landing.target(i, off, src, outs[i] if outs is not None else None)
            if dst is not None:
                _copy_bytes(dst, src, landing.upto, upto)
                landing.upto = max(landing.upto, upto)
            del src

        def part(conn: Connection, p: list[Any]) -> None:
            if "into" in args:
                # a chunk verified in the caller's shared buffer: handed out while the
                # server reads the next ones
                i = replies.part_into(p)
                if i != len(arrays) or i >= len(hits):
                    raise errors.ProtocolError(f"streamed chunk {i} out of order")
                assert outs is not None
                arrays.append(outs[i])
                if on_chunk is not None:
                    on_chunk(i, outs[i])
                return
            if isinstance(p, list | tuple) and len(p) == 5:
                on_landed(conn, list(p))
                return
            # a chunk read from disk, sent as soon as it verified: copied while the
            # server reads the next ones
            i, off, dtype, shape = replies.part(p)
            if i != len(arrays) or i >= len(hits):
                raise errors.ProtocolError(f"streamed chunk {i} out of order")
            take(conn, i, off, dtype, shape)

        args["stream"] = True
        if self.early and (outs is None or all(o.flags.c_contiguous for o in outs)):
            args["early"] = True  # landed bytes of a chunk being read copied meanwhile
        copied: list[np.ndarray] = []
        after = None
        dst = outs if outs is not None else fresh
        if early is not None and dst is not None:

            def after(conn: Connection) -> None:
                # copy every DRAM hit from where the lookup saw it while the server
                # pins it; it confirms the extents still hold those replicas
                if conn.epoch != epoch:
                    return  # another server's arena since the lookup: nothing is copied
                for out, (off, dtype) in zip(dst, early, strict=True):
                    stream_copy(out, view(conn, off, dtype, out.shape))
                    copied.append(out)

        r, conn = self.wire.call_on("load", args, part, after)
        try:  # every field read before anything of the reply is kept
            reply = replies.load_reply(r, len(hits), len(arrays))
            if reply.into is not None and (outs is None or "into" not in args):
                raise errors.ProtocolError("load reply of chunks in buffers it was not asked for")
        except errors.ProtocolError:
            self.wire.disown(conn)  # the server releases the grant it may hold
            raise
        if reply.into is not None:  # landed in the caller's shared buffers: nothing to copy
            assert outs is not None
            landed = list(outs[: reply.into])
            if on_chunk is not None:  # those not streamed (told already) are told now
                for i in range(len(arrays), len(landed)):
                    on_chunk(i, landed[i])
            return _result(landed, reply.outcome)
        del arrays[reply.streamed :]  # a streamed chunk invalidated meanwhile is a miss
        confirmed, grants = reply.confirmed, reply.grants
        try:
            if confirmed:
                if confirmed > len(copied):  # granted nothing for chunks it confirmed
                    confirmed = 0  # and this client did not copy: they are a miss
                    grants = []
                arrays += copied[:confirmed]
                if outs is None:  # new arrays, handed out read-only
                    for a in arrays:
                        a.flags.writeable = False
                if on_chunk is not None:
                    for i, a in enumerate(arrays):
                        on_chunk(i, a)
            # landed bytes count only for the chunk whose own part followed them: a chunk
            # granted here failed its frame after they were told, and was read again
            # (maybe into the same extent, maybe from another replica): copied whole
            landing.forget()
            for j, (off, dtype, shape) in enumerate(grants):
                take(conn, reply.streamed + confirmed + j, off, dtype, shape)
        finally:
            if reply.load:
                self.wire.release(reply.load, conn)
        return _result(arrays, reply.outcome)

    def load_async(
        self, lookup: LookupResult, outs: Sequence[np.ndarray] | None, request_id: str
    ) -> RemoteLoadHandle:
        handle = RemoteLoadHandle(len(lookup.hits))
        fut = self.wire.pool().submit(self.load, lookup, outs, request_id, handle._chunk_done)
        fut.add_done_callback(handle._finish)
        return handle

    def _none_opened(self, lookup: RemoteLookup, path: str, n: int) -> None:
        """A direct load of ``n`` chunks whose first segment file (``path``) did not
        open here goes through the server; where the server's segment files are out of
        this process's reach altogether, this client stops asking for frames (each
        lookup that names them costs more, each load a refused start), logged once and
        said by :attr:`direct_off`. A lookup answered on an earlier connection says
        nothing of the server now (its store may have moved since)."""
        conn = self.wire.conn
        now = conn is not None and conn.epoch == lookup.epoch
        why = direct.unreachable(path) if now else None
        with self._fallbacks_lock:
            self.direct_fallbacks += n
            if why is None or not self.direct_reads:
                return
            self.direct_off = why
            self.direct_reads = False
        log.warning(
            "direct reads off: the server's segment files are out of this process's "
            "reach (%s); its disk hits load through the server",
            why,
        )

    def _load_direct_new(
        self,
        lookup: RemoteLookup,
        fresh: list[np.ndarray],
        request_id: str,
        on_chunk: OnChunk | None,
    ) -> LoadResult:
        """A direct load without buffers into ``fresh`` (:meth:`_direct_arrays`): each
        array is handed out read-only, as every load without buffers hands them out,
        once its chunk is in (verified here and confirmed, or filled by the server)."""

        def sealed(i: int, a: np.ndarray | None) -> None:
            if a is not None:
                a.flags.writeable = False
            if on_chunk is not None:
                on_chunk(i, a)

        res = self._load_direct(lookup, fresh, request_id, sealed)
        for a in res.arrays:
            a.flags.writeable = False
        return res

    def _direct_arrays(self, lookup: RemoteLookup) -> list[np.ndarray] | None:
        """New arrays from this client's pool (page-aligned: O_DIRECT fills them) for a
        direct load without buffers whose every hit names its frame; None where a hit
        names none (the load goes through the server). The load hands out those it
        kept or the server filled; the others go back to the pool with their last
        reference."""
        n = len(lookup.hits)
        if lookup.identity is None or len(lookup.frames) != n or None in lookup.frames:
            return None
        return self._chunk_arrays(lookup.identity.layout, n)

    def _fresh(self, lookup: RemoteLookup) -> list[np.ndarray] | None:
        """New arrays for a load without buffers whose every hit the lookup on this
        connection placed in DRAM (:meth:`_hinted` copies into them from the hints
        while the server confirms, as into a caller's buffers); None otherwise (the
        grant path takes a new array per chunk granted). Those a load does not hand
        out go back to the pool with their last reference."""
        n = len(lookup.hits)
        if lookup.identity is None or not self._all_hinted(lookup, n):
            return None
        return self._chunk_arrays(lookup.identity.layout, n)

    def _chunk_arrays(self, layout: KVLayout, n: int) -> list[np.ndarray]:
        """``n`` new arrays of one chunk of ``layout`` each, from this client's pool."""
        dtype = numpy_dtype(layout.dtype)
        return [self.new_array(layout.chunk_shape, dtype) for _ in range(n)]

    def _all_hinted(self, lookup: RemoteLookup, n: int) -> bool:
        """Whether the lookup, made on this connection, placed each of ``n`` hits in
        DRAM (a hint, generation nonzero, for each)."""
        hints, conn = lookup.hints, self.wire.conn
        if conn is None or conn.epoch != lookup.epoch or len(hints) != 2 * n:
            return False
        return all(hints[1::2])

    def _hinted(
        self, lookup: RemoteLookup, outs: Sequence[np.ndarray], args: dict[str, Any]
    ) -> list[tuple[int, str]] | None:
        """(offset, dtype) of each hit when every hit is a DRAM replica whose place the
        lookup on this connection named and every buffer fits it (the hints go into
        ``args``); else None (the load takes the grant path)."""
        if lookup.identity is None or not self._all_hinted(lookup, len(outs)):
            return None
        hints = lookup.hints
        layout = lookup.identity.layout
        dtype = numpy_dtype(layout.dtype)
        early: list[tuple[int, str]] = []
        for i, out in enumerate(outs):
            if out.shape != layout.chunk_shape or out.dtype != dtype:
                return None
            early.append((hints[2 * i], dtype.str))
        args["hints"] = list(hints)
        return early

    def _targets(self, outs: Sequence[np.ndarray], layout: KVLayout) -> list[int] | None:
        """(buffer, offset) of each output buffer if all lie in this connection's shared
        buffers and fit the layout; else None (the grant path, one copy here)."""
        conn = self.wire.conn
        if conn is None or not conn.buffers or not outs:
            return None
        dtype = numpy_dtype(layout.dtype)
        into: list[int] = []
        for out, span in zip(outs, spans(outs), strict=True):
            if out.shape != layout.chunk_shape or out.dtype != dtype or not span.c_contiguous:
                return None
            addr = span.low
            for base, size, bid, _ in conn.buffers:
                if base <= addr and addr + out.nbytes <= base + size:
                    into += [bid, addr - base]
                    break
            else:
                return None
        return into

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of shared memory the server writes loads into (RemoteStore's
        ``alloc_buffer``): made by the server, mapped here, kept with the connection."""
        r, conn = self.wire.call_on("alloc_buffer", {"nbytes": nbytes})
        fd = os.open(r["path"], os.O_RDWR | os.O_NOFOLLOW)
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, r["nbytes"], flags=flags)
        finally:
            os.close(fd)
        arr = np.frombuffer(mapping, np.uint8, count=nbytes)
        with self.wire.lock:
            conn.buffers.append((arr.ctypes.data, r["nbytes"], r["buffer"], mapping))
        return arr


NEW_ARRAYS_KEEP_BYTES = 256 << 20
"""Idle memory a client keeps at most for the new arrays of its loads without buffers
(never more than it had taken from the pool at once, the arrays a load from DRAM takes
before the server confirms them included: :class:`~kvlife.tiers.buffers.RecyclingPool`)."""

KNOWN_HITS = 1 << 14
"""Hit records a client keeps to answer repeated lookups with (:meth:`Loads._hits`):
a few MiB at most."""


def _tenant(wire: Wire) -> bool:
    """Whether the session has a principal (a server with ``--tenants``)."""
    with wire.lock:
        return bool(wire.connected().hello.get("principal"))


def _shifted(on_chunk: OnChunk, by: int) -> OnChunk:
    def shifted(i: int, arr: np.ndarray | None) -> None:
        on_chunk(by + i, arr)

    return shifted


def _result(arrays: list[np.ndarray], done: replies.Outcome) -> LoadResult:
    return LoadResult(
        arrays,
        len(arrays),
        done.requested,
        tiers=done.tiers,
        corrupt=done.corrupt,
        vanished=done.vanished,
        read_errors=done.read_errors,
    )


class _Early:
    """The chunk whose landed bytes a streamed load copied before it verified (parts
    ``[i, offset, dtype, shape, bytes]``): where they went and how many. Its own part
    (``take``) copies only the rest, into the same array, if it names the same extent;
    anything else starts that chunk's copy over."""

    __slots__ = ("chunk", "dst", "new", "off", "upto")

    def __init__(self, new: Callable[[Sequence[int], np.dtype[Any]], np.ndarray]) -> None:
        self.new = new
        """Where a new array for a load without buffers comes from."""
        self.chunk = -1
        self.off = -1
        self.dst: np.ndarray | None = None
        self.upto = 0

    def forget(self) -> None:
        """No landed bytes held (the next copy of any chunk starts at byte 0)."""
        self.chunk, self.off, self.dst, self.upto = -1, -1, None, 0

    def target(
        self, i: int, off: int, src: np.ndarray, out: np.ndarray | None
    ) -> np.ndarray | None:
        """The array chunk ``i``'s landed bytes go into (the caller's buffer, or a new
        array), or None where they are not copied early (a buffer that does not fit
        the chunk: its own part raises that). A part naming another chunk, extent,
        dtype or shape than the bytes held starts over."""
        held = self.dst
        if (
            (i, off) != (self.chunk, self.off)
            or held is None
            or held.shape != src.shape
            or held.dtype != src.dtype
        ):
            dst = out if out is not None else self.new(src.shape, src.dtype)
            fits = dst.shape == src.shape and dst.dtype == src.dtype and dst.flags.c_contiguous
            self.chunk, self.off, self.upto = i, off, 0
            self.dst = dst if fits and dst.flags.writeable else None
        return self.dst

    def taken(self, i: int, off: int, src: np.ndarray) -> tuple[int, np.ndarray | None]:
        """Where chunk ``i``'s copy from ``src`` starts: after its landed bytes, into
        the array that holds them, when they were copied from that extent as that
        dtype and shape; else 0. Nothing is held after."""
        held, upto = self.dst, self.upto
        same = (i, off) == (self.chunk, self.off) and held is not None
        self.forget()
        if not same or held is None or held.shape != src.shape or held.dtype != src.dtype:
            return 0, None
        return upto, held


def _copy_bytes(dst: np.ndarray, src: np.ndarray, start: int, end: int) -> None:
    """Bytes ``start`` to ``end`` of C-contiguous ``src`` into the same bytes of ``dst``
    (C-contiguous too), by streaming stores where it can."""
    if end > start:
        flat = dst.reshape(-1).view(np.uint8)
        stream_copy(flat[start:end], src.reshape(-1).view(np.uint8)[start:end])
