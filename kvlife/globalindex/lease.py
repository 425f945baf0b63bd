"""A host's publication lease: a fencing token from a Redis counter (monotonic across
every host), granted in every bucket with a deadline on that bucket's node's clock. A
publication or a delete carries the token only; the bucket's script refuses it unless
the host's current lease there has that token (not revoked, not superseded) and its
deadline has not passed (the host was partitioned or paused): the client's own idea of
time is never trusted."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    """One lease held by a host."""

    host: str
    token: int
    """Fencing token (INCR of the index's counter)."""
    deadline_ms: int
    """Expiry on a bucket's node's clock (ms since the epoch), for reports: the buckets
    enforce their own."""
    local_deadline: float
    """The same expiry on this host's monotonic clock (taken conservatively, when the
    request was sent)."""
    incarnation: str = ""
    """The index's incarnation the token was granted under (an index that loses its
    state loses its tokens with it)."""

    def remaining_s(self) -> float:
        return self.local_deadline - time.monotonic()
