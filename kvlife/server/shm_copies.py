"""Puts and loads through the socket, for a session that maps no arena: a principal with
no Unix user (a token only), or a peer its principal's arena does not admit
(:mod:`kvlife.server.shm_arenas`). Copies both ways, never a mapping: such a client
cannot be given any arena, since a file it could map would be mappable by every other
process of its Unix user, whichever principal they are.

``put_inline``: a prompt with its chunks' bytes in the request (one per whole chunk, of
the layout's size), stored as ``put_prompt`` stores (``chained`` as for a staged put).
A ``load`` with ``inline``: the hits' bytes in the reply, in order, as far as one frame
holds (:data:`INLINE_BYTES`; the rest is a miss at the tail, the client asks again).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlife.core.errors import ProtocolError
from kvlife.core.payload import numpy_dtype
from kvlife.results import ChunkHit, LookupResult
from kvlife.server import protocol
from kvlife.server.context import SessionContext
from kvlife.server.limits import page_charge
from kvlife.server.loads import load_keys
from kvlife.server.puts import prepare_piece
from kvlife.transforms.contract import Accept

INLINE_BYTES = protocol.MAX_MESSAGE // 2
"""Chunk bytes in one inline load's reply at most (the frame's other fields fit in the
rest)."""

_NO_MAPPING = (
    "this session maps no arena (its principal has no Unix user its peer is, e.g. a "
    "token only): it puts with put_inline and loads with inline, through the socket"
)
MAPPED_VERBS = {
    "prepare_put": _NO_MAPPING,
    "put": _NO_MAPPING,
    "alloc_buffer": _NO_MAPPING,
    "load": _NO_MAPPING,
}
"""Verbs that hand a client arena extents or shared files: refused, with why, to a
session that maps no arena (a ``load`` with ``inline`` excepted)."""


class Copies:
    """The socket data path of one session."""

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx

    def put_inline(self, args: dict[str, Any]) -> object:
        ctx = self.ctx
        p = ctx.prompt(args, write=True)
        layout = p.identity.layout
        ctx.fits(layout)
        nchunks = len(p.tokens) // layout.tokens_per_chunk
        data: list[bytes] = args["chunks"]
        if len(data) != nchunks:
            raise ProtocolError(f"{len(data)} chunks sent for a prompt of {nchunks} whole chunks")
        dtype = numpy_dtype(layout.dtype)
        chunks = []
        for i, b in enumerate(data):
            if len(b) != layout.chunk_nbytes:
                raise ProtocolError(
                    f"chunk {i} is {len(b)} bytes; the layout's chunks are {layout.chunk_nbytes}"
                )
            chunks.append(np.frombuffer(b, dtype).reshape(layout.chunk_shape))
        charge = {"puts": 1, "put_bytes": nchunks * page_charge(layout.chunk_nbytes)}
        ctx.take(charge, f"session {ctx.sid}'s put of {nchunks} chunks")
        try:
            store = ctx.store
            pending = prepare_piece(ctx, p, chunks, args)
            # the tier copies each chunk into the replica's home arena (not adopted:
            # these arrays are no arena's)
            return protocol.encode_put_result(store.commit_put(pending))
        finally:
            ctx.give(charge)

    def load_inline(self, args: dict[str, Any]) -> object:
        """The hits' bytes in the reply (keys the principal may not read were withheld
        by the session before this: they load as keys not stored)."""
        ctx = self.ctx
        keys, starts = load_keys(ctx, args)
        layout = protocol.decode_layout(args["layout"]) if "layout" in args else None
        per = max(1, INLINE_BYTES // layout.chunk_nbytes) if layout is not None else 1
        nkeys = len(keys)
        keys, starts = keys[:per], starts[:per]  # one frame's worth
        dram = ctx.shm.name
        lookup = LookupResult(
            [ChunkHit(i, k, s, dram) for i, (k, s) in enumerate(zip(keys, starts, strict=True))],
            args["chunks_total"],
            layout.tokens_per_chunk if layout is not None else 1,
            protocol.decode_accept(args["accept"]) if "accept" in args else Accept.EXACT,
        )
        res = ctx.store.load(lookup, None, request_id=args.get("request_id", ""))
        chunks: list[list[Any]] = []
        size = 0
        for arr in res.arrays:
            size += arr.nbytes
            if chunks and size > INLINE_BYTES:
                break  # the rest is a miss at the tail
            chunks.append([arr.dtype.str, list(arr.shape), arr.tobytes()])
        # cut short by the frame, not by a miss: the client asks again for the rest
        cut = len(chunks) < len(res.arrays) or len(res.arrays) == len(keys)
        more = cut and len(chunks) < nkeys
        return {
            "more": more,
            "load": 0,
            "grants": [],
            "inline": chunks,
            "requested": res.requested,
            "tiers": dict(res.tiers),
            "corrupt": b"".join(res.corrupt),
            "vanished": res.vanished,
            "read_errors": res.read_errors,
        }
