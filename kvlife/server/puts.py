"""The put protocol, server side: the two-phase put into reserved extents and the
one-round-trip put into staged extents (the client side is :mod:`kvlife.client.puts`).

Two-phase (``prepare_put``, then ``commit_put`` or ``abort_put``):

1. ``prepare_put``: the put is charged first (every chunk at whole pages, whether it
   gets an extent or not: its lists are held either way). The store's ``prepare_put``
   creates the TENTATIVE objects with zero-memory stand-ins for the chunks; each chunk
   the store lacks gets an arena extent (the arena full: StorageFullError, the put
   aborted). The reply names the put, the extents (chunk number, offset) and, with
   ``stage``, new extents staged for the session's next puts of that shape.
2. The client copies its chunks into the extents.
3. ``commit_put`` seals the extents (read-only) and runs the store's commit: the shm
   tier adopts each as the replica without a copy. ``abort_put`` rolls the put back.
   Either gives the put's budget back.

Staged (``put`` and ``put_commit``, on extents staged for the session):

1. A ``put`` names one staged extent per chunk of the prompt, in order (ids of this
   session, distinct, of the prompt's chunk shape). They leave the session's staged
   pool; the store's ``prepare_put`` takes them as the chunks' arrays; replacements for
   the extents the new chunks will take are staged at once.
2. ``deferred``: the client sent the ``put`` with no reply wanted before copying; the
   prepared put (or its error) waits here for the ``put_commit``, while the client
   copies. A ``put`` without it commits at once.
   ``put_written`` (no reply) says how many bytes the client wrote (its chunks in
   order): the new chunks' bytes are hashed then, while it copies the rest, and each
   chunk is sealed with that hash at commit.
3. ``put_commit`` hashes what no notice covered (the chunk the last notice stopped in
   from where it stopped, not whole again), seals the extents of the new chunks and
   commits; their extents become
   replicas. The extents of chunks the store held already go back to the staged pool
   with the replacements; the reply names them all.

A session that ends aborts its pending puts and its deferred put, and frees its staged
extents (:meth:`Puts.close`). Staging is best effort: within ``--session-staged-bytes``
and half of the client's put share (the other half is left for its puts), as far as the
arena has room.

Every put is charged to the client's put share before anything is made, and a two-phase
put larger than the share is refused: the extents of a pending put are the client's to
write until it commits or aborts, so the server cannot take them back from a client
that holds them, and refusing at the start is the only way to keep one client from
holding the arena. A ``put_prompt`` larger than half the share is split by the client
into several puts, each committed before the next is prepared (:mod:`kvlife.client.puts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvlife.core.errors import KVLifeError, ProtocolError, StorageFullError
from kvlife.core.identity import ChunkKey, KVLayout
from kvlife.core.objects import PromptRef
from kvlife.core.payload import numpy_dtype
from kvlife.server import protocol
from kvlife.server.context import SessionContext
from kvlife.server.limits import page_charge
from kvlife.store.writes import PendingPut


@dataclass(slots=True)
class _Put:
    pending: PendingPut
    views: list[np.ndarray]
    """Arena extents the client writes, one per new chunk (sealed at commit)."""
    charge: int
    """Bytes of the put budget it holds (every chunk, whole pages)."""


@dataclass(slots=True)
class _Staged:
    """A put into staged extents between its prepare and its commit."""

    pending: PendingPut
    ids: list[int]
    views: list[np.ndarray]
    layout: KVLayout
    refill: list[list[int]]
    """Extents staged for the client in place of those the new chunks take."""
    offsets: list[int]
    """The arena offset of each of :attr:`views` (kept with it since it was staged)."""
    new: list[ChunkKey | None]
    """The key of the new chunk each of :attr:`views` holds (None: a chunk the store
    holds already, whose extent stays staged)."""
    written: int = 0
    """Bytes the client said it wrote (``put_written``), hashed here since."""
    hashing: Any = None
    """The xxh3-128 state of the chunk being hashed (``put_written``)."""


class Puts:
    """The put protocol of one session: its pending puts, staged extents and deferred
    put."""

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx
        self.pending: dict[int, _Put] = {}
        self.staged: dict[int, tuple[np.ndarray, int]] = {}
        """Arena extents staged for this session's next puts, and their offsets, by id
        (the client writes them, a ``put`` adopts them; freed with the session)."""
        self.deferred: _Staged | None = None
        """A deferred ``put`` waiting for its ``put_commit`` (the client is copying)."""
        self.deferred_error: KVLifeError | None = None

    def close(self, reason: str) -> int:
        """Abort every pending put and the deferred one, free the staged extents; how
        many puts were aborted."""
        with self.ctx.lock:
            puts = list(self.pending.values())
            self.pending.clear()
            self.staged.clear()  # their extents go back to the arena with the views
        deferred = int(self.deferred is not None)
        self._drop_deferred(reason)
        for put in puts:
            put.views.clear()
            self.ctx.store.abort_put(put.pending, reason)
        return len(puts) + deferred

    # ------------------------------------------------------------------ two-phase

    def prepare_put(self, args: dict[str, Any]) -> object:
        ctx = self.ctx
        p = ctx.prompt(args, write=True)
        layout = p.identity.layout
        ctx.fits(layout)
        nchunks = len(p.tokens) // layout.tokens_per_chunk
        # every chunk is charged, whether it gets an extent or another put is writing it
        # (its lists are held either way), before anything is made
        charge = nchunks * page_charge(layout.chunk_nbytes)
        lease = {"puts": 1, "put_bytes": charge}
        ctx.take(lease, f"session {ctx.sid}'s put of {nchunks} chunks")
        try:
            return self._reserve(args, p, nchunks, charge)
        except BaseException:
            ctx.give(lease)
            raise

    def _reserve(self, args: dict[str, Any], p: PromptRef, nchunks: int, charge: int) -> object:
        """Prepare the put and reserve an extent per chunk the store lacks."""
        ctx = self.ctx
        layout = p.identity.layout
        dtype = numpy_dtype(layout.dtype)
        # zero-memory stand-ins: only the chunks the store does not hold get an extent
        dummy = np.lib.stride_tricks.as_strided(
            np.zeros(1, dtype), shape=layout.chunk_shape, strides=(0,) * 5, writeable=False
        )
        pending = self._prepare(p, [dummy] * nchunks, args)
        index = {k: i for i, k in enumerate(pending.keys)}
        views: list[np.ndarray] = []
        slots: list[list[int]] = []
        made: list[tuple[np.ndarray, int]] = []
        try:
            need = len(pending.items)
            made = ctx.arena.alloc_many(layout.chunk_nbytes, dtype, layout.chunk_shape, need)
            if len(made) < need and ctx.server.reclaim():  # extents only garbage held
                made += ctx.arena.alloc_many(
                    layout.chunk_nbytes, dtype, layout.chunk_shape, need - len(made)
                )
            for j, (rec, _) in enumerate(pending.items):
                if j >= len(made):
                    raise StorageFullError(
                        f"{ctx.arena_text()} has no room to stage chunk {index[rec.key]} of "
                        f"this put ({ctx.arena.stats()})"
                    )
                view, off = made[j]
                pending.items[j] = (rec, view)
                views.append(view)
                slots.append([index[rec.key], off])
        except BaseException:
            views.clear()
            made.clear()  # the extents go back to the arena with their last views
            pending.items[:] = [(rec, dummy) for rec, _ in pending.items]
            ctx.store.abort_put(pending, "no room to stage the put")
            raise
        staged = self._stage(layout, args.get("stage", 0))
        with ctx.lock:  # last: from here on commit or abort gives its budget back
            pid = ctx.new_id()
            self.pending[pid] = _Put(pending, views, charge)
        return {
            "put": pid,
            "keys": b"".join(pending.keys),
            "slots": slots,
            "present": pending.present,
            "in_flight": pending.in_flight,
            "staged": staged,
        }

    def commit_put(self, args: dict[str, Any]) -> object:
        put = self._take(args["put"])
        for view in put.views:
            view.flags.writeable = False  # sealed: the tier adopts it without a copy
        put.views.clear()
        try:
            return protocol.encode_put_result(self.ctx.store.commit_put(put.pending))
        finally:
            self._done(put)

    def abort_put(self, args: dict[str, Any]) -> object:
        self._abort(self._take(args["put"]), args.get("reason", "aborted by caller"))
        return None

    def _abort(self, put: _Put, reason: str) -> None:
        put.views.clear()
        try:
            self.ctx.store.abort_put(put.pending, reason)
        finally:
            self._done(put)

    def _take(self, pid: int) -> _Put:
        with self.ctx.lock:
            put = self.pending.pop(pid, None)
        if put is None:
            raise ProtocolError(f"session {self.ctx.sid} holds no pending put {pid}")
        return put

    def _done(self, put: _Put) -> None:
        self.ctx.give({"puts": 1, "put_bytes": put.charge})

    def _prepare(self, p: PromptRef, chunks: list[np.ndarray], args: dict[str, Any]) -> PendingPut:
        return prepare_piece(self.ctx, p, chunks, args)

    # ------------------------------------------------------------------ staged

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
            # kept without its traceback: its frames hold the staged extents the put
            # named, and kept here they would outlive the session in a reference cycle
            # (the session, this error, its frames) that only the collector frees
            self.deferred_error = exc.with_traceback(None)
        return None

    def put_written(self, args: dict[str, Any]) -> None:
        """The client of a deferred put wrote its first ``bytes`` bytes (its chunks in
        order, no reply): the new chunks' bytes among them are hashed now, while it
        copies the rest, and a chunk hashed whole is sealed with that hash at commit. A
        client that writes bytes again after saying they were written is caught where
        seals are verified, as one that writes after its put committed."""
        staged = self.deferred
        if staged is None:
            if self.deferred_error is None:
                raise ProtocolError(f"session {self.ctx.sid} has no deferred put being written")
            return  # its prepare failed: the put_commit raises that
        views = staged.views
        size = views[0].nbytes if views else 0
        upto = args["bytes"]
        if upto > size * len(views):
            raise ProtocolError(f"put_written of {upto} bytes, the put has {size * len(views)}")
        _hash_written(staged, upto)

    def put_commit(self, args: dict[str, Any]) -> object:
        staged, error = self.deferred, self.deferred_error
        seals = args.get("seals")
        if staged is not None and seals is not None and len(seals) != 16 * len(staged.views):
            self._drop_deferred("its commit named the wrong number of seals")
            raise ProtocolError(
                f"put_commit with {len(seals)} bytes of seals; the put has "
                f"{len(staged.views)} chunks (16 bytes each)"
            )
        self.deferred, self.deferred_error = None, None
        if error is not None:
            try:
                raise error
            finally:
                error = None  # no reference cycle through this frame
        if staged is None:
            raise ProtocolError(f"session {self.ctx.sid} has no deferred put to commit")
        if seals is not None:  # the client's: the chunks the notices left unhashed
            _take_seals(staged, seals)
        # the rest of the chunk the notices stopped in is hashed from where they stopped
        # (the tier would hash that chunk whole again), the chunks after it whole
        _hash_written(staged, sum(v.nbytes for v in staged.views))
        return self._finish_staged(staged)

    def _stage(self, layout: KVLayout, count: int) -> list[list[int]]:
        """Up to ``count`` new staged extents of one chunk of ``layout`` ([id, offset]
        each), as far as the session's staging budget and the arena's room allow."""
        ctx = self.ctx
        size = page_charge(layout.chunk_nbytes)
        # charged at once when the budgets have room for all (the common case), else
        # as many as fit, one by one: staging is best effort (a put without it takes
        # two round trips)
        charged = 0
        if count > 0 and not ctx.closed:
            if self._try_stage(size * count):
                charged = count
            else:
                while charged < count and self._try_stage(size):
                    charged += 1
        if not charged:
            return []
        made = ctx.arena.alloc_many(
            layout.chunk_nbytes, numpy_dtype(layout.dtype), layout.chunk_shape, charged
        )
        if len(made) < charged:  # the arena is full
            self._unstage_bytes(size * (charged - len(made)))
        out: list[list[int]] = []
        with ctx.lock:
            for view, off in made:
                sid = ctx.new_id()
                self.staged[sid] = (view, off)
                out.append([sid, off])
        return out

    def _try_stage(self, size: int) -> bool:
        """Charge one staged extent (to the staged and the put budgets), if it fits."""
        return self.ctx.try_take({"staged_bytes": size, "put_bytes": size})

    def _unstage_bytes(self, size: int) -> None:
        self.ctx.give({"staged_bytes": size, "put_bytes": size})

    def refuse_commit(self, reason: str) -> None:
        """The ``put_commit`` of the deferred put was refused before it was handled: the
        put is aborted (and a prepare's error, which that commit would have raised,
        forgotten)."""
        self._drop_deferred(reason)

    def refuse_pending(self, pid: int, reason: str) -> None:
        """A ``commit_put`` or ``abort_put`` naming pending put ``pid`` was refused
        before it was handled: that put is aborted (none of this session's: nothing)."""
        with self.ctx.lock:
            put = self.pending.pop(pid, None)
        if put is not None:
            self._abort(put, reason)

    def _drop_deferred(self, reason: str) -> None:
        staged, self.deferred, self.deferred_error = self.deferred, None, None
        if staged is not None:
            self._drop_views(staged.views)
            self._unstage(staged.refill)
            self.ctx.store.abort_put(staged.pending, reason)

    def _drop_views(self, views: list[np.ndarray]) -> None:
        """Staged extents a put took and will not give back: freed, uncharged."""
        self.ctx.give({"put_bytes": sum(page_charge(v.nbytes) for v in views)})
        views.clear()

    def _unstage(self, extents: list[list[int]]) -> None:
        """Staged extents the client was never told of (their put failed): freed."""
        with self.ctx.lock:
            views = [self.staged.pop(sid, None) for sid, _ in extents]
        for held in views:
            if held is not None:
                self._unstage_bytes(page_charge(held[0].nbytes))

    def _begin_staged(self, args: dict[str, Any]) -> _Staged:
        ctx = self.ctx
        p = ctx.prompt(args, write=True)
        layout = p.identity.layout
        ids = args["staged"]
        nchunks = len(p.tokens) // layout.tokens_per_chunk
        if len(ids) != nchunks or len(set(ids)) != len(ids):
            raise ProtocolError(f"{len(ids)} distinct staged extents for {nchunks} chunks")
        views: list[np.ndarray] = []
        offsets: list[int] = []
        dtype = numpy_dtype(layout.dtype)
        with ctx.lock:
            for sid in ids:
                held = self.staged.get(sid)
                if held is None:
                    raise ProtocolError(f"session {ctx.sid} holds no staged extent {sid}")
                view = held[0]
                if view.shape != layout.chunk_shape or view.dtype != dtype:
                    raise ProtocolError(
                        f"staged extent {sid} is {view.dtype}{list(view.shape)}, not a chunk "
                        "of this put's layout"
                    )
                views.append(view)
                offsets.append(held[1])
            for sid in ids:  # the put owns them now; unused ones are staged again later
                del self.staged[sid]
        # still the session's (put budget), no longer staged
        ctx.give({"staged_bytes": sum(page_charge(v.nbytes) for v in views)})
        try:
            pending = self._prepare(p, views, args)
        except BaseException:
            self._drop_views(views)
            raise
        # replacements for the extents the new chunks will take, made now (a deferred put
        # is prepared while the client copies): the commit only hands them out
        refill = self._stage(layout, len(pending.items))
        # the store took the extents themselves as the new chunks' arrays (no copy)
        by_id = {id(arr): rec.key for rec, arr in pending.items}
        new = [by_id.get(id(v)) for v in views]
        if sum(k is not None for k in new) != len(by_id):  # not the same objects: by offset
            arena = ctx.arena
            keys = {arena.offset_of(arr): rec.key for rec, arr in pending.items}
            new = [keys.get(off) for off in offsets]
        return _Staged(pending, ids, views, layout, refill, offsets, new)

    def _finish_staged(self, staged: _Staged) -> dict[str, Any]:
        ctx = self.ctx
        pending = staged.pending
        for _, arr in pending.items:
            arr.flags.writeable = False  # sealed: the tier adopts it without a copy
        try:
            res = ctx.store.commit_put(pending)
        except BaseException:
            self._drop_views(staged.views)
            self._unstage(staged.refill)
            raise
        pending.items.clear()
        kept: list[list[int]] = []
        gone = 0
        with ctx.lock:
            for sid, view, off, key in zip(
                staged.ids, staged.views, staged.offsets, staged.new, strict=True
            ):
                if key is not None or ctx.closed:
                    gone += page_charge(view.nbytes)
                    continue  # a replica now (or the session ended): never staged again
                self.staged[sid] = (view, off)
                kept.append([sid, off])
        staged.views.clear()
        ctx.give({"put_bytes": gone})
        # back where they were taken from a moment ago: no check
        ctx.force({"staged_bytes": page_charge(staged.layout.chunk_nbytes) * len(kept)})
        out = protocol.encode_put_result(res)
        short = len(staged.ids) - len(kept) - len(staged.refill)  # the arena was full
        out["staged"] = kept + staged.refill + self._stage(staged.layout, max(0, short))
        return out


def _take_seals(staged: _Staged, seals: bytes) -> None:
    """The client's seals (16 bytes a chunk, in order; length checked by the caller) for
    the new chunks not hashed whole here already: the xxh3-128 of each chunk's bytes as
    it copied them. A seal that is not its chunk's bytes is caught where seals are
    verified (a copy to disk, ``check``, a load with ``--verify-dram-on-load``) and the
    object invalidated, as after a write past the commit: never served as verified
    elsewhere, never persisted."""
    got = staged.pending.seals
    for i, key in enumerate(staged.new):
        if key is not None and key not in got:
            got[key] = bytes(seals[16 * i : 16 * i + 16])


def _hash_written(staged: _Staged, upto: int) -> None:
    """Hash the new chunks' bytes of ``staged`` from where its hashing stopped up to
    byte ``upto`` of its chunks in order (``upto`` checked by the caller); a chunk
    hashed to its end is sealed with that hash at commit."""
    views, pending = staged.views, staged.pending
    size = views[0].nbytes if views else 0
    while staged.written < upto:
        i, at = divmod(staged.written, size)
        end = min(upto, (i + 1) * size) - i * size
        key = staged.new[i]
        if key is not None and (at or key not in pending.seals):  # a new chunk unsealed
            if at == 0:
                staged.hashing = xxhash.xxh3_128()
            flat = views[i].reshape(-1).view(np.uint8)
            staged.hashing.update(flat[at:end].data)
            if end == size:
                pending.seals[key] = bytes(staged.hashing.digest())
        staged.written = i * size + end


def prepare_piece(
    ctx: SessionContext, p: PromptRef, chunks: list[np.ndarray], args: dict[str, Any]
) -> PendingPut:
    """The store's prepare of a put (or of one piece of a put in pieces, ``chained``) of
    ``chunks`` for ``p``: what every put protocol of a session, staged or inline, does.
    A parent named by its prefix tokens is derived here, in the namespace the put
    writes (with principals the keyed scope: the chain its lookups follow)."""
    store = ctx.store
    p = p.chained()
    pending = store.prepare_put(
        p.identity,
        p.namespace,
        p.tokens,
        chunks,
        start=p.start,
        parent=p.parent,
        extra_keys=p.extra_keys,
        sources=p.sources,
        request_id=args.get("request_id", ""),
    )
    if args.get("chained"):
        # a later piece of one put_prompt: if an invalidation took the piece before
        # it (its parent) since that piece was stored, this one stores nothing either
        # (its KV was computed before; an invalidation covers the whole put). After
        # the prepare: an invalidation from here on covers these TENTATIVE chunks
        # (chained after a parent still indexed), one before took the parent
        # (a parent the principal may not read counts as gone: whether another
        # tenant's chunk is live is not told by this put's result)
        store.continue_put(pending, ctx.visible(p.parent))
    return pending
