"""Model identities decoded once for every session of ``kvlife serve``, within a budget
in bytes (``--identity-cache-bytes``).

A lookup repeats its identity with every request, and decoding one (a ``KVLayout`` and
a ``ModelIdentity`` built and validated, their digest hashed) costs more than the rest of
a lookup's checks, so a decoded identity is kept, keyed by its fields. One cache serves
every session (the sessions of one model share an entry), and it holds at most its
budget: an entry is charged the size of its strings plus :data:`ENTRY_BYTES`, and the
oldest entries go first. A client that sends many identities only pushes entries out
(their next request decodes them again, some microseconds); nothing it sends stays held
beyond the budget, however many connections it opens. Before this, each session kept up
to 64 identities of up to seven 4,096-character strings, charged to nothing (20
connections held 51 MiB).

Only identities whose strings are all short (:data:`MAX_CACHED_CHARS`) are kept; a
longer one (the protocol allows 4,096 characters a field, for a model id that is a
path) is decoded for each request. A long string is malloc'd in the arena of the thread
that decoded it, and an entry pushed out by another connection's thread frees it there,
in the middle of that arena, which then keeps its high-water mark: with a 1 MiB budget,
20 connections sending distinct identities of 4,096-character strings still grew the
server by 25 MiB (one budget's worth per malloc arena). Short strings come from Python's
own allocator, which has no per-thread arenas (the same attack with 40-character strings:
+1 MiB over identical identities).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from kvlife.core.identity import ModelIdentity
from kvlife.server import protocol

ENTRY_BYTES = 2048
"""What an entry holds beyond its strings: its key, the identity and its layout
(measured with tracemalloc: about 1.6 KiB for an identity of short strings)."""

MAX_CACHED_CHARS = 256
"""Longest string of an identity that is kept (a 64-digit hex digest, a hub model name
and revision, most model paths fit)."""

Key = tuple[tuple[str, object], ...]


def identity_key(raw: dict[str, Any]) -> Key:
    """The cache key of a checked identity map: every field and every layout field,
    name and value, in the order the client sent them (not sorted: sorting took most
    of a lookup's checks; a client that orders its fields otherwise gets an entry of its
    own, the same identity). The names keep two maps of other values apart (a layout
    field name is none of the identity's)."""
    fields = dict(raw)
    layout = fields.pop("layout")
    return (*fields.items(), *layout.items())


class IdentityCache:
    """Decoded identities by their fields, at most ``limit`` bytes of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        """What the entries are charged, together (never above ``limit``)."""
        self._entries: dict[Key, tuple[ModelIdentity, int]] = {}
        self._lock = threading.Lock()
        """Held to change the entries; a lookup reads without it (one dict lookup)."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, raw: dict[str, Any]) -> ModelIdentity:
        """The identity of a checked identity map (InvalidArgument if its values are
        bad: nothing is kept then)."""
        key = identity_key(raw)
        hit = self._entries.get(key)
        if hit is not None:
            return hit[0]
        identity = protocol.decode_identity(raw)
        strings = [v for _, v in key if type(v) is str]
        cost = ENTRY_BYTES + sum(sys.getsizeof(v) for v in strings)
        if cost > self.limit or any(len(v) > MAX_CACHED_CHARS for v in strings):
            return identity  # used for this request only (see MAX_CACHED_CHARS)
        with self._lock:
            if key in self._entries:  # another session decoded it meanwhile
                return identity
            entries = self._entries
            while self.nbytes + cost > self.limit:  # the oldest first (insertion order)
                _, freed = entries.pop(next(iter(entries)))
                self.nbytes -= freed
            entries[key] = (identity, cost)
            self.nbytes += cost
        return identity
