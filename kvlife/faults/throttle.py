"""A throttled tier: any tier of a store's chain behind a read-bandwidth limit and an
added latency, to study a slow device (a throttled disk, a congested network) with the
real store and the real tier underneath.

:func:`throttle` wraps a built tier; the wrapper is the same tier in every respect (its
capability interfaces included, so the store treats it as it would treat the tier) except
that each read first waits ``latency_s`` and then for its bytes to pass a token bucket
filling at ``read_bytes_s``. Bytes are never changed: a throttled read returns what the
tier returned. The limits can be changed while the store is open
(:meth:`ThrottledTier.set_limits`), so an experiment sweeps bandwidths on one store.

The registered tier kind ``throttled-disk`` (:class:`ThrottledDiskOptions`: the disk
tier's options plus ``read_mb_s`` and ``read_latency_ms``) builds a disk tier and wraps
it, so a :class:`~kvlife.store.TierSpec` names a throttled disk in a chain; importing
this module registers it. The crossover experiment (:mod:`kvlife.experiments.crossover`)
uses it; so can the fault campaign.
"""

from __future__ import annotations

import threading
import time
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import (
    CapacityShortfall,
    ChecksumsWrites,
    KeepsEdges,
    PersistsCounters,
    ReadResult,
    ReplicaMeta,
    ReportsLostReplicas,
    Reservation,
    SealedInMemory,
    SharedTier,
    SupportsAdopt,
    SupportsAudit,
    SupportsBatchDelete,
    Tier,
)
from kvlife.tiers.kinds import DiskOptions
from kvlife.tiers.registry import TierContext, TierKind, register_tier_kind, tier_kind

MB = 1_000_000
"""Bandwidths are in decimal megabytes per second, as devices are rated."""

CAPABILITIES: tuple[type[ABC], ...] = (
    SupportsBatchDelete,
    KeepsEdges,
    SupportsAdopt,
    ChecksumsWrites,
    SealedInMemory,
    ReportsLostReplicas,
    SupportsAudit,
    PersistsCounters,
    SharedTier,
)
"""The capability interfaces a wrapper carries over from the tier it wraps."""


class TokenBucket:
    """Bytes per second with a burst allowance; a taker that overdraws waits for the
    debt to be repaid (so concurrent readers share the rate, each waiting its turn).
    ``rate`` of 0 means unlimited."""

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self._lock = threading.Lock()
        self._rate = 0.0
        self._burst = 0
        self._tokens = 0.0
        self._last = time.monotonic()
        self.set_rate(rate_bytes_s, burst_bytes)

    def set_rate(self, rate_bytes_s: float, burst_bytes: int) -> None:
        if not rate_bytes_s >= 0 or burst_bytes < 0:
            raise InvalidArgument(
                f"token bucket needs rate >= 0 and burst >= 0, got {rate_bytes_s}, {burst_bytes}"
            )
        with self._lock:
            self._rate = float(rate_bytes_s)
            self._burst = burst_bytes
            self._tokens = float(burst_bytes)
            self._last = time.monotonic()

    @property
    def rate(self) -> float:
        return self._rate

    def take(self, nbytes: int) -> float:
        """Charge ``nbytes``; sleep until they are paid for. Returns the seconds slept."""
        with self._lock:
            if self._rate <= 0:
                return 0.0
            now = time.monotonic()
            self._tokens = min(float(self._burst), self._tokens + (now - self._last) * self._rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self._rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


@dataclass(slots=True)
class ThrottleCounters:
    """What a throttled tier did to its reads."""

    reads: int = 0
    """Read calls (``read_batch`` or ``read_verified``)."""
    bytes_read: int = 0
    """Bytes returned by those reads (the bytes charged to the bucket)."""
    waited_s: float = 0.0
    """Seconds spent waiting for the bucket and the added latency."""


class ThrottledTier(Tier):
    """``inner`` with reads limited to ``read_bytes_s`` (0: unlimited) after an added
    ``latency_s`` per read call; everything else is the inner tier's. Made by
    :func:`throttle`, which adds the inner tier's capability interfaces."""

    def __init__(
        self, inner: Tier, read_bytes_s: float, latency_s: float = 0.0, burst_bytes: int = 0
    ) -> None:
        self._inner = inner
        self.name = inner.name
        self.capacity_bytes = inner.capacity_bytes
        self.durability = inner.durability
        self._latency_s = 0.0
        self._bucket = TokenBucket(0.0, 0)
        self.counters = ThrottleCounters()
        self._counter_lock = threading.Lock()
        self.set_limits(read_bytes_s, latency_s, burst_bytes)

    @property
    def inner(self) -> Tier:
        """The tier underneath."""
        return self._inner

    @property
    def read_bytes_s(self) -> float:
        return self._bucket.rate

    @property
    def latency_s(self) -> float:
        return self._latency_s

    def set_limits(self, read_bytes_s: float, latency_s: float = 0.0, burst_bytes: int = 0) -> None:
        """Change the limits (applies to reads that start after the call)."""
        if not latency_s >= 0:
            raise InvalidArgument(f"tier {self.name!r}: latency must be >= 0 s, got {latency_s}")
        self._bucket.set_rate(read_bytes_s, burst_bytes)
        self._latency_s = float(latency_s)

    def _throttled(self, read: Callable[[], list[ReadResult]]) -> list[ReadResult]:
        t0 = time.monotonic()
        if self._latency_s > 0:
            time.sleep(self._latency_s)
        got = read()
        nbytes = sum(r.nbytes for r in got if isinstance(r, np.ndarray))
        self._bucket.take(nbytes)
        with self._counter_lock:
            self.counters.reads += 1
            self.counters.bytes_read += nbytes
            self.counters.waited_s += time.monotonic() - t0
        return got

    # ------------------------------------------------------------------ reads (throttled)

    def read_batch(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        return self._throttled(lambda: self._inner.read_batch(keys, outs))

    def read_verified(
        self, keys: Sequence[ChunkKey], outs: Sequence[np.ndarray | None] | None = None
    ) -> list[ReadResult]:
        inner = self._inner
        if not isinstance(inner, SealedInMemory):
            raise InvalidArgument(f"tier {self.name!r} does not seal replicas in memory")
        return self._throttled(lambda: inner.read_verified(keys, outs))

    # ------------------------------------------------------------------ the rest, as is

    @property
    def used_bytes(self) -> int:
        return self._inner.used_bytes

    def prepare_store(self, metas: Sequence[ReplicaMeta]) -> Reservation | CapacityShortfall:
        return self._inner.prepare_store(metas)

    def commit_store(self, reservation: Reservation, payloads: Sequence[np.ndarray]) -> None:
        self._inner.commit_store(reservation, payloads)

    def cancel_store(self, reservation: Reservation) -> None:
        self._inner.cancel_store(reservation)

    def contains(self, key: ChunkKey) -> bool:
        return self._inner.contains(key)

    def meta(self, key: ChunkKey) -> ReplicaMeta:
        return self._inner.meta(key)

    def delete(self, key: ChunkKey) -> int:
        return self._inner.delete(key)

    def replica_keys(self) -> list[ChunkKey]:
        return self._inner.replica_keys()

    def footprint(self, nbytes: int) -> int:
        return self._inner.footprint(nbytes)

    def close(self) -> None:
        self._inner.close()

    def details(self) -> dict[str, Any]:
        out = dict(self._inner.details())
        out["throttle"] = {
            "read_mb_s": self.read_bytes_s / MB,
            "latency_ms": self._latency_s * 1e3,
            "reads": self.counters.reads,
            "bytes_read": self.counters.bytes_read,
            "waited_s": round(self.counters.waited_s, 6),
        }
        return out


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: ThrottledTier, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


_CLASSES: dict[tuple[type[ABC], ...], type[ThrottledTier]] = {}
_CLASSES_LOCK = threading.Lock()


def _wrapper_class(caps: tuple[type[ABC], ...]) -> type[ThrottledTier]:
    """The wrapper class carrying ``caps``: each capability's methods forward to the
    inner tier (reads excepted: :class:`ThrottledTier` throttles them)."""
    with _CLASSES_LOCK:
        cls = _CLASSES.get(caps)
        if cls is None:
            space: dict[str, Any] = {}
            for cap in caps:
                for name in getattr(cap, "__abstractmethods__", ()):
                    if name not in vars(ThrottledTier):
                        space[name] = _forwarder(name)
            label = "".join(c.__name__ for c in caps)
            cls = type(f"ThrottledTier_{label}", (ThrottledTier, *caps), space)
            _CLASSES[caps] = cls
        return cls


def throttle(
    tier: Tier, read_bytes_s: float, latency_s: float = 0.0, burst_bytes: int = 0
) -> ThrottledTier:
    """``tier`` behind a read limit of ``read_bytes_s`` (0: unlimited) and ``latency_s``
    per read call, with the same capability interfaces as ``tier``."""
    caps = tuple(c for c in CAPABILITIES if isinstance(tier, c))
    return _wrapper_class(caps)(tier, read_bytes_s, latency_s, burst_bytes)


# ---------------------------------------------------------------------- the registered kind


@dataclass(frozen=True, slots=True, kw_only=True)
class ThrottledDiskOptions(DiskOptions):
    """A disk tier (:class:`~kvlife.tiers.kinds.DiskOptions`) behind a read throttle."""

    kind: ClassVar[str] = "throttled-disk"

    read_mb_s: float = 0.0
    """Read bandwidth limit in MB/s (decimal; 0: unlimited)."""
    read_latency_ms: float = 0.0
    """Latency added to every read call, in milliseconds."""

    def check(self) -> None:
        DiskOptions.check(self)
        if not self.read_mb_s >= 0:
            raise self.bad("read_mb_s", f"must be >= 0, got {self.read_mb_s}")
        if not self.read_latency_ms >= 0:
            raise self.bad("read_latency_ms", f"must be >= 0, got {self.read_latency_ms}")


def _throttled_disk(spec: Any, o: ThrottledDiskOptions, ctx: TierContext) -> Tier:
    disk = tier_kind("disk")
    inner = disk.build(spec, o, ctx)
    return throttle(inner, o.read_mb_s * MB, o.read_latency_ms / 1e3)


def _register() -> None:
    try:
        tier_kind("throttled-disk")
    except InvalidArgument:
        disk = tier_kind("disk")
        register_tier_kind(
            TierKind("throttled-disk", ThrottledDiskOptions, _throttled_disk, disk.footprint)
        )


_register()
