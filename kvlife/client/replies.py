"""Checks of the server's load and put replies, made before the client keeps anything
of them: every field the client reads, of its type and within its bounds, else a
ProtocolError naming the field.

Why: the client acts on these fields (copies out of the arena at the offsets a grant
names, keeps the chunks a reply confirms, keeps staged extents for its next puts); a
field of another type used as it came failed deep inside with TypeError or KeyError,
or was read as something it does not say (a ``confirmed`` of ``True``, a grant's
offset of ``1.5``). A reply the client cannot read is refused whole, as a lookup's is
(:func:`kvlife.client.loads._lookup_fields`): nothing of it is kept, and the caller
drops the connection (:meth:`kvlife.client.wire.Wire.disown`), so that the server
releases what the session held for it (a grant, a pending put, staged extents) and
the next call connects again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlife.core.errors import ProtocolError
from kvlife.core.identity import KEY_BYTES, ChunkKey
from kvlife.results import PutResult
from kvlife.server import protocol

MAX_DIMS = 8
"""Dimensions of a granted chunk at most (a chunk is five)."""
PUT_COUNTS = [f.name for f in dataclasses.fields(PutResult) if f.name != "keys"]
"""The counts of a put reply (every field of a PutResult but its keys)."""
DTYPE_KINDS = "biuf"
"""Kinds of dtype a grant may name: numbers (an object or structured dtype is refused)."""


def _dict(r: Any, what: str) -> dict[str, Any]:
    if not isinstance(r, dict):
        raise ProtocolError(f"{what} is no map: {str(r)[:64]}")
    return r


def count(r: dict[str, Any], name: str, what: str, high: int | None = None) -> int:
    """Field ``name`` of ``r``: an int >= 0 (and <= ``high``)."""
    if name not in r:
        raise ProtocolError(f"{what} has no {name}")
    v = r[name]
    if type(v) is not int or v < 0 or (high is not None and v > high):
        bound = f" <= {high}" if high is not None else ""
        raise ProtocolError(f"{what}'s {name} {str(v)[:64]} is not a number >= 0{bound}")
    return v


def keys(r: dict[str, Any], name: str, what: str) -> list[ChunkKey]:
    """Field ``name`` of ``r``: chunk keys, one blob."""
    blob = r.get(name)
    if not isinstance(blob, bytes) or len(blob) % KEY_BYTES:
        raise ProtocolError(f"{what}'s {name} is not whole keys: {str(blob)[:64]}")
    return protocol.split_keys(blob)


def extent(g: Any, what: str) -> tuple[int, str, tuple[int, ...]]:
    """A grant of an arena extent: [offset >= 0, a numeric dtype, a shape of ints >= 0]."""
    if not isinstance(g, list | tuple) or len(g) != 3:
        raise ProtocolError(f"{what} is not [offset, dtype, shape]: {str(g)[:64]}")
    off, dtype, shape = g
    if type(off) is not int or off < 0:
        raise ProtocolError(f"{what}'s offset {str(off)[:64]} is not a number >= 0")
    try:
        kind = np.dtype(dtype).kind if type(dtype) is str else ""
    except TypeError:
        kind = ""
    if kind == "" or kind not in DTYPE_KINDS:
        raise ProtocolError(f"{what}'s dtype {str(dtype)[:64]} is no numeric dtype")
    if not (
        isinstance(shape, list | tuple)
        and len(shape) <= MAX_DIMS
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"{what}'s shape {str(shape)[:64]} is not numbers >= 0")
    return off, dtype, tuple(shape)


def part(p: Any) -> tuple[int, int, str, tuple[int, ...]]:
    """A streamed chunk's partial reply: [chunk number, offset, dtype, shape]."""
    if not isinstance(p, list | tuple) or len(p) != 4 or type(p[0]) is not int:
        raise ProtocolError(f"load's streamed part is not [chunk, offset, dtype, shape]: {p!r:.64}")
    off, dtype, shape = extent(p[1:], "load's streamed part")
    return p[0], off, dtype, shape


def landed_part(p: Any) -> tuple[int, int, str, tuple[int, ...], int]:
    """A streamed chunk's landed bytes, told before it verified: [chunk number, offset,
    dtype, shape, bytes landed] (bytes > 0)."""
    if (
        not isinstance(p, list | tuple)
        or len(p) != 5
        or type(p[0]) is not int
        or type(p[4]) is not int
        or p[4] <= 0
    ):
        raise ProtocolError(
            f"load's landed part is not [chunk, offset, dtype, shape, bytes]: {p!r:.64}"
        )
    off, dtype, shape = extent(p[1:4], "load's landed part")
    return p[0], off, dtype, shape, p[4]


def part_into(p: Any) -> int:
    """A load into shared buffers' partial reply: [chunk number], the chunk verified in
    its buffer."""
    if not isinstance(p, list | tuple) or len(p) != 1 or type(p[0]) is not int or p[0] < 0:
        raise ProtocolError(f"load's streamed part is not [chunk]: {p!r:.64}")
    return int(p[0])


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a load reply says of the chunks besides their bytes (every way of loading)."""

    requested: int
    tiers: dict[str, int]
    corrupt: list[ChunkKey]
    vanished: int
    read_errors: int


def outcome(r: dict[str, Any], what: str = "load reply") -> Outcome:
    tiers = r.get("tiers")
    if not (
        isinstance(tiers, dict)
        and all(type(k) is str and type(v) is int and v >= 0 for k, v in tiers.items())
    ):
        raise ProtocolError(f"{what}'s tiers are not counts by tier: {str(tiers)[:64]}")
    return Outcome(
        count(r, "requested", what),
        dict(tiers),
        keys(r, "corrupt", what),
        count(r, "vanished", what),
        count(r, "read_errors", what),
    )


@dataclass(frozen=True, slots=True)
class LoadReply:
    """A mapped load's reply, read."""

    load: int
    """The grant to release (0: none held)."""
    into: int | None
    """Chunks landed in the caller's shared buffers (None: not such a load)."""
    streamed: int
    confirmed: int
    grants: list[tuple[int, str, tuple[int, ...]]]
    outcome: Outcome


def load_reply(r: Any, hits: int, streamed: int) -> LoadReply:
    """A load reply for ``hits`` chunks of which ``streamed`` came in parts: the grant,
    then the chunks in shared buffers, or those streamed, confirmed and granted (no
    more of them than the hits), each field of its type."""
    what = "load reply"
    r = _dict(r, what)
    load = count(r, "load", what)
    done = outcome(r, what)
    if "into" in r:
        return LoadReply(load, count(r, "into", what, hits), 0, 0, [], done)
    kept = count(r, "streamed", what, streamed)
    confirmed = count(r, "confirmed", what, hits - kept) if "confirmed" in r else 0
    grants = r.get("grants")
    if not isinstance(grants, list) or kept + confirmed + len(grants) > hits:
        raise ProtocolError(
            f"{what}'s grants are not a list of at most {hits - kept - confirmed} extents: "
            f"{str(grants)[:64]}"
        )
    return LoadReply(
        load, None, kept, confirmed, [extent(g, f"{what}'s grant") for g in grants], done
    )


def put_result(r: Any, what: str = "put reply") -> PutResult:
    """A committed put's counts and keys, each of its type."""
    r = _dict(r, what)
    counts = {name: count(r, name, what) for name in PUT_COUNTS}
    return PutResult(**counts, keys=keys(r, "keys", what))


def staged(r: dict[str, Any], what: str) -> list[list[int]]:
    """A reply's ``staged`` extents: [id, offset] each, numbers >= 0."""
    extents = r.get("staged", [])
    if not (
        isinstance(extents, list)
        and all(
            isinstance(e, list) and len(e) == 2 and all(type(v) is int and v >= 0 for v in e)
            for e in extents
        )
    ):
        raise ProtocolError(f"{what}'s staged extents are not [id, offset]: {str(extents)[:64]}")
    return extents


@dataclass(frozen=True, slots=True)
class Prepared:
    """A ``prepare_put``'s reply, read."""

    put: int
    keys: list[ChunkKey]
    present: int
    in_flight: int
    slots: list[tuple[int, int]]
    """(chunk number, offset) of each extent to write."""
    staged: list[list[int]]


def prepared(r: Any, chunks: int) -> Prepared:
    """A ``prepare_put``'s reply for a put of ``chunks`` chunks: its extents name
    distinct chunks of it, at offsets >= 0."""
    what = "prepare_put reply"
    r = _dict(r, what)
    slots = r.get("slots")
    if not (
        isinstance(slots, list)
        and all(
            isinstance(s, list)
            and len(s) == 2
            and type(s[0]) is int
            and 0 <= s[0] < chunks
            and type(s[1]) is int
            and s[1] >= 0
            for s in slots
        )
        and len({s[0] for s in slots}) == len(slots)
    ):
        raise ProtocolError(
            f"{what}'s slots are not [chunk, offset] of distinct chunks of {chunks}: "
            f"{str(slots)[:64]}"
        )
    return Prepared(
        count(r, "put", what),
        keys(r, "keys", what),
        count(r, "present", what),
        count(r, "in_flight", what),
        [(s[0], s[1]) for s in slots],
        staged(r, what),
    )
