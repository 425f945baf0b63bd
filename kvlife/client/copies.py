"""The client side of the socket data path (:mod:`kvlife.server.shm_copies`): a
RemoteStore whose session maps no arena (its principal has no Unix user it runs as, e.g.
a token only) puts each prompt with its chunks' bytes in the request and loads with the
bytes in the reply. Copies both ways; a two-phase put (``prepare_put``) and shared
buffers need a mapping and are refused by the server (NotPermitted)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvlife.client import replies
from kvlife.client.handles import RemoteLookup
from kvlife.client.wire import Wire
from kvlife.core.errors import InvalidArgument, ProtocolError
from kvlife.core.identity import ChunkKey, KVLayout
from kvlife.native.copies import stream_copy
from kvlife.results import LoadResult, LookupResult, PutResult
from kvlife.server import protocol
from kvlife.server.limits import page_charge

_FRAME = protocol.MAX_MESSAGE // 2
"""Chunk bytes of one ``put_inline`` at most (the frame holds the prompt besides)."""


def put_inline(
    wire: Wire, args: dict[str, Any], layout: KVLayout, chunks: list[np.ndarray]
) -> PutResult:
    """One piece of a put (``args`` as for ``prepare_put``) with its chunks' bytes."""
    data = [np.ascontiguousarray(c).tobytes() for c in chunks]
    r, conn = wire.call_on("put_inline", {**args, "chunks": data})
    try:
        return replies.put_result(r, "put_inline reply")
    except ProtocolError:
        wire.disown(conn)
        raise


def inline_piece_chunks(layout: KVLayout) -> int:
    """Chunks of ``layout`` in one ``put_inline`` frame, at least one."""
    return max(1, _FRAME // page_charge(layout.chunk_nbytes))


def load_inline(
    wire: Wire,
    lookup: LookupResult,
    outs: Sequence[np.ndarray] | None,
    request_id: str,
    on_chunk: Callable[[int, np.ndarray], None] | None,
) -> LoadResult:
    """The hits' bytes through the socket, as many frames as they take."""
    hits = lookup.hits
    arrays: list[np.ndarray] = []
    tiers: dict[str, int] = {}
    corrupt: list[ChunkKey] = []
    vanished = read_errors = 0
    while len(arrays) < len(hits):
        rest = hits[len(arrays) :]
        args: dict[str, Any] = {
            "keys": b"".join(h.key for h in rest),
            "starts": [h.start for h in rest],
            "chunks_total": lookup.chunks_total,
            "accept": protocol.encode_accept(lookup.accept),
            "inline": True,
        }
        if isinstance(lookup, RemoteLookup) and lookup.identity is not None:
            args["layout"] = protocol.encode_layout(lookup.identity.layout)
        if request_id:
            args["request_id"] = request_id
        r, conn = wire.call_on("load", args)
        try:  # every field read before any chunk of the reply is kept
            chunks = _inline(r, len(rest))
            done = replies.outcome(r, "inline load reply")
        except ProtocolError:
            wire.disown(conn)
            raise
        for dtype, shape, data in chunks:
            i = len(arrays)
            src = np.frombuffer(data, np.dtype(dtype)).reshape(shape)
            # without an output buffer: a read-only view of the reply's bytes
            out = copy_into(outs[i], src) if outs is not None else src
            arrays.append(out)
            if on_chunk is not None:
                on_chunk(i, out)
        for k, v in done.tiers.items():
            tiers[k] = tiers.get(k, 0) + v
        corrupt += done.corrupt
        vanished += done.vanished
        read_errors += done.read_errors
        if r.get("more") is not True or not chunks:
            break
    return LoadResult(
        arrays,
        len(arrays),
        len(hits),
        tiers=tiers,
        corrupt=corrupt,
        vanished=vanished,
        read_errors=read_errors,
    )


def _inline(r: Any, hits: int) -> list[tuple[str, tuple[int, ...], bytes]]:
    """An inline load reply's chunks: at most ``hits``, each [dtype, shape, bytes] whose
    bytes are the size its dtype and shape say (ProtocolError otherwise)."""
    what = "inline load reply"
    chunks = r.get("inline") if isinstance(r, dict) else None
    if not isinstance(chunks, list) or len(chunks) > hits:
        raise ProtocolError(f"{what}'s chunks are not a list of at most {hits}")
    out = []
    for c in chunks:
        if not isinstance(c, list) or len(c) != 3 or not isinstance(c[2], bytes):
            raise ProtocolError(f"{what}'s chunk is not [dtype, shape, bytes]: {str(c)[:64]}")
        _, dtype, shape = replies.extent([0, c[0], c[1]], f"{what}'s chunk")
        if len(c[2]) != np.dtype(dtype).itemsize * math.prod(shape):
            raise ProtocolError(f"{what}'s chunk of {len(c[2])} bytes is not {dtype}{shape}")
        out.append((dtype, shape, c[2]))
    return out


def copy_into(out: np.ndarray, src: np.ndarray) -> np.ndarray:
    """``src`` copied into the caller's output buffer ``out`` (returned), which must have
    the replica's shape and dtype (InvalidArgument, naming both, if not); by streaming
    stores where it can (:func:`kvlife.native.copies.stream_copy`)."""
    if out.shape != src.shape or out.dtype != src.dtype:
        raise InvalidArgument(
            f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
            f"{src.dtype}{list(src.shape)}"
        )
    stream_copy(out, src)
    return out
