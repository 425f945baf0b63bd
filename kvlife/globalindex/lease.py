"""A host's publication lease: a fencing token from a Redis counter (monotonic across
every host) and a deadline on the server's clock. A publication carries both; the
index's publish script refuses a token below the host's floor (superseded or revoked)
or a deadline that passed (the host was partitioned or paused)."""

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
    """Expiry on the index server's clock (ms since the epoch)."""
    local_deadline: float
    """The same expiry on this host's monotonic clock (taken conservatively, when the
    request was sent)."""

    def remaining_s(self) -> float:
        return self.local_deadline - time.monotonic()
