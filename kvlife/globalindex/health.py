"""Health of a remote endpoint: a failure marks it unhealthy until a backoff passes
(exponential, capped); calls made meanwhile fail fast as a typed error instead of
waiting on a dead server, and the first call after the backoff is the retry."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from redis.exceptions import RedisError

from kvlife.core.errors import RemoteTierError

T = TypeVar("T")

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    RedisError,
    OSError,
    EOFError,
    ValueError,
    IndexError,
    TypeError,
    UnicodeDecodeError,
)
"""What a damaged, cut or stalled connection raises inside redis-py and hiredis (a
flipped byte can turn a length into garbage, a truncated reply into a parse error)."""


@dataclass(slots=True)
class HealthCounters:
    failures: int = 0
    """Calls that failed on the transport."""
    fast_fails: int = 0
    """Calls refused without trying because the endpoint was in its backoff."""
    recoveries: int = 0
    """Times a call succeeded again after failures."""


class Health:
    """Backoff state of one endpoint (thread-safe)."""

    def __init__(self, name: str, base_s: float = 0.05, cap_s: float = 2.0) -> None:
        self.name = name
        self.base_s = base_s
        self.cap_s = cap_s
        self._lock = threading.Lock()
        self._streak = 0
        self._retry_at = 0.0
        self.last_error = ""
        self.counters = HealthCounters()

    @property
    def healthy(self) -> bool:
        return self._streak == 0

    def retry_in(self) -> float:
        return max(0.0, self._retry_at - time.monotonic())

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; a transport failure becomes RemoteTierError and starts a backoff;
        during the backoff the call is refused at once."""
        with self._lock:
            wait = self._retry_at - time.monotonic()
            if self._streak and wait > 0:
                self.counters.fast_fails += 1
                raise RemoteTierError(
                    f"{self.name} is unhealthy ({self.last_error}); retry in {wait:.2f} s"
                )
        try:
            result = fn()
        except TRANSPORT_ERRORS as exc:
            if _is_script_refusal(exc):
                raise
            self.failed(f"{what}: {type(exc).__name__}: {exc}")
            raise RemoteTierError(f"{self.name}: {what} failed: {exc}") from exc
        self.ok()
        return result

    def failed(self, why: str) -> None:
        with self._lock:
            self._streak += 1
            self.counters.failures += 1
            self.last_error = why[:200]
            backoff = min(self.cap_s, self.base_s * (2 ** (self._streak - 1)))
            self._retry_at = time.monotonic() + backoff

    def ok(self) -> None:
        with self._lock:
            if self._streak:
                self.counters.recoveries += 1
            self._streak = 0
            self._retry_at = 0.0


REFUSALS = (
    "KVLSTALE",
    "KVLEXPIRED",
    "KVLBANNED",
    "KVLNOSTAGE",
    "KVLLOST",
    "KVLRESET",
    "KVLMISMATCH",
)
"""Error prefixes of the index's own Lua scripts: refusals, not transport failures."""


def _is_script_refusal(exc: BaseException) -> bool:
    return isinstance(exc, RedisError) and str(exc).startswith(REFUSALS)
