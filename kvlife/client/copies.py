"""The client side of the socket data path (:mod:`kvlife.server.shm_copies`): a
RemoteStore whose session maps no arena (its principal has no Unix user it runs as, e.g.
a token only) puts each prompt with its chunks' bytes in the request and loads with the
bytes in the reply. Copies both ways; a two-phase put (``prepare_put``) and shared
buffers need a mapping and are refused by the server (NotPermitted)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvlife.client.handles import RemoteLookup
from kvlife.client.wire import Wire
from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey, KVLayout
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
    return protocol.decode_put_result(wire.call("put_inline", {**args, "chunks": data}))


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
        r = wire.call("load", args)
        for dtype, shape, data in r["inline"]:
            i = len(arrays)
            src = np.frombuffer(data, np.dtype(dtype)).reshape(shape)
            # without an output buffer: a read-only view of the reply's bytes
            out = copy_into(outs[i], src) if outs is not None else src
            arrays.append(out)
            if on_chunk is not None:
                on_chunk(i, out)
        for k, v in r["tiers"].items():
            tiers[str(k)] = tiers.get(str(k), 0) + int(v)
        corrupt += protocol.split_keys(r["corrupt"])
        vanished += r["vanished"]
        read_errors += r["read_errors"]
        if not r.get("more") or not r["inline"]:
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


def copy_into(out: np.ndarray, src: np.ndarray) -> np.ndarray:
    """``src`` copied into the caller's output buffer ``out`` (returned), which must have
    the replica's shape and dtype (InvalidArgument, naming both, if not)."""
    if out.shape != src.shape or out.dtype != src.dtype:
        raise InvalidArgument(
            f"output buffer {out.dtype}{list(out.shape)} does not fit replica "
            f"{src.dtype}{list(src.shape)}"
        )
    np.copyto(out, src)
    return out
