"""The one interface every simulated device implements, and the simplest device: local DRAM.

A replay engine moves KV objects between tiers on a virtual clock. It needs to ask any
device the same three questions (when does this read finish, when does this write finish,
forget this object) and to collect typed statistics at the end, without knowing whether
the device is DRAM, a CXL expander, an SSD with garbage collection or a network link.
:class:`DeviceModel` is that seam. Every model here is free of real I/O and of wall-clock
time: ``t_now`` and the returned completion times are virtual seconds.

Queueing contract: a device serves requests first come, first served in the order of the
calls, so calls must come in non-decreasing ``t_now`` (ties keep call order, giving the
deterministic (time, sequence) order); a call from the past raises
:class:`~kvlife.sim.errors.ClockOrderError`.

Also here: :class:`LatencyRecorder` and :class:`LatencyStats` (per-I/O latency summaries),
:class:`FcfsServer` (a busy-until server shared by the memory and network models) and
:class:`SupportsWriteHints`, the capability interface of devices that accept placement
hints (an SSD's write streams / FDP reclaim-unit handles).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

import numpy as np

from kvlife.sim.errors import ClockOrderError, DeviceConfigError, RequestError


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of a set of per-I/O latencies, in seconds (all zero when ``count`` is 0)."""

    count: int
    """Number of I/Os summarised."""
    mean_s: float
    """Mean latency."""
    p50_s: float
    """Median latency."""
    p99_s: float
    """99th percentile latency."""
    p999_s: float
    """99.9th percentile latency."""
    max_s: float
    """Largest latency."""

    @staticmethod
    def of(latencies: np.ndarray) -> LatencyStats:
        """Summarise an array of latencies (seconds)."""
        if latencies.size == 0:
            return LatencyStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        p50, p99, p999 = np.percentile(latencies, [50.0, 99.0, 99.9])
        return LatencyStats(
            count=int(latencies.size),
            mean_s=float(latencies.mean()),
            p50_s=float(p50),
            p99_s=float(p99),
            p999_s=float(p999),
            max_s=float(latencies.max()),
        )


class LatencyRecorder:
    """Appends per-I/O latencies cheaply and summarises them on demand."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values = array("d")

    def add(self, latency_s: float) -> None:
        self._values.append(latency_s)

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> np.ndarray:
        """A copy of the recorded latencies, in call order."""
        return np.array(self._values, dtype=np.float64)

    def summary(self) -> LatencyStats:
        return LatencyStats.of(np.frombuffer(self._values, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """What every device model reports."""

    name: str
    """Device name."""
    reads: int
    """Read requests served."""
    writes: int
    """Write requests served."""
    trims: int
    """Trim / delete requests served."""
    bytes_read: int
    """Bytes requested by reads."""
    bytes_written: int
    """Bytes requested by writes."""
    read_latency: LatencyStats
    """Per-read latency (completion minus ``t_now``)."""
    write_latency: LatencyStats
    """Per-write latency (completion minus ``t_now``)."""


StatsT = TypeVar("StatsT", bound=DeviceStats, covariant=True)
S = TypeVar("S", bound=DeviceStats)


class DeviceModel(ABC, Generic[StatsT]):
    """A memory or storage device on a virtual clock.

    ``read`` and ``write`` take the request time ``t_now`` (seconds), a size in bytes and
    the caller's integer key for the object, and return the completion time (seconds,
    ``>= t_now``). ``trim`` tells the device that the object's bytes are dead (a TRIM /
    deallocate for an SSD, nothing for DRAM). ``stats`` returns a typed snapshot.
    """

    name: str

    def __init__(self, name: str) -> None:
        self.name = name
        self._last_t = 0.0
        self._reads = 0
        self._writes = 0
        self._trims = 0
        self._bytes_read = 0
        self._bytes_written = 0
        self._read_lat = LatencyRecorder()
        self._write_lat = LatencyRecorder()

    @abstractmethod
    def read(self, t_now: float, nbytes: int, key: int) -> float:
        """Read ``nbytes`` of object ``key`` requested at ``t_now``; returns completion time."""

    @abstractmethod
    def write(self, t_now: float, nbytes: int, key: int) -> float:
        """Write ``nbytes`` of object ``key`` requested at ``t_now``; returns completion time."""

    @abstractmethod
    def trim(self, key: int) -> None:
        """Declare object ``key`` dead; later reads of it are reads of unwritten space."""

    def delete(self, key: int) -> None:
        """Same as :meth:`trim` (the name a key-value caller expects)."""
        self.trim(key)

    @abstractmethod
    def stats(self) -> StatsT:
        """A typed snapshot of the device's counters."""

    # -- helpers for implementations ---------------------------------------------------

    def _admit(self, t_now: float, nbytes: int) -> None:
        """Check a request's arguments and the FCFS clock order."""
        if not math.isfinite(t_now) or t_now < 0.0:
            raise RequestError(f"{self.name}: t_now must be a finite time >= 0, got {t_now!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0:
            raise RequestError(f"{self.name}: nbytes must be an integer >= 0, got {nbytes!r}")
        if t_now < self._last_t:
            raise ClockOrderError(
                f"{self.name}: request at t_now={t_now!r} s is earlier than the previous "
                f"request at {self._last_t!r} s; issue requests in time order"
            )
        self._last_t = t_now

    def _record_read(self, t_now: float, nbytes: int, done: float) -> float:
        self._reads += 1
        self._bytes_read += nbytes
        self._read_lat.add(done - t_now)
        return done

    def _record_write(self, t_now: float, nbytes: int, done: float) -> float:
        self._writes += 1
        self._bytes_written += nbytes
        self._write_lat.add(done - t_now)
        return done

    def _stats_as(self, cls: type[S], **extra: Any) -> S:
        """Stats of class ``cls`` (a DeviceStats subclass): the common counters plus
        ``extra`` device-specific fields."""
        return cls(**asdict_shallow(self._base_stats()), **extra)

    def _base_stats(self) -> DeviceStats:
        return DeviceStats(
            name=self.name,
            reads=self._reads,
            writes=self._writes,
            trims=self._trims,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            read_latency=self._read_lat.summary(),
            write_latency=self._write_lat.summary(),
        )


class SupportsWriteHints(ABC):
    """Capability: the device accepts a placement hint (write stream / FDP handle) per write."""

    @property
    @abstractmethod
    def n_streams(self) -> int:
        """Number of distinct hints; valid hints are ``0 .. n_streams - 1``."""

    @abstractmethod
    def write_hinted(self, t_now: float, nbytes: int, key: int, hint: int) -> float:
        """Like :meth:`DeviceModel.write`, placing the data with hint ``hint``."""


@dataclass(slots=True)
class FcfsServer:
    """A first-come-first-served server: a request starts when the server is free.

    ``serve`` returns ``(start, end)`` of the service and makes the server busy until
    ``end``. Used for a memory channel, a NAND die, a link direction.
    """

    busy_until: float = 0.0
    busy_time: float = field(default=0.0)
    """Total service time given (for utilisation)."""

    def serve(self, t: float, service_s: float) -> tuple[float, float]:
        start = max(t, self.busy_until)
        end = start + service_s
        self.busy_until = end
        self.busy_time += service_s
        return start, end


def check_positive(owner: str, field_name: str, value: float) -> None:
    """Raise DeviceConfigError unless ``value`` is a finite number > 0."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise DeviceConfigError(f"{owner}.{field_name} must be a finite number > 0, got {value!r}")


def check_non_negative(owner: str, field_name: str, value: float) -> None:
    """Raise DeviceConfigError unless ``value`` is a finite number >= 0."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise DeviceConfigError(f"{owner}.{field_name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """A byte-addressable memory seen through one queue: load latency plus bandwidth.

    Defaults describe one socket of DDR5 server DRAM: an idle load-to-use latency of about
    100 ns and about 200 GB/s of streaming bandwidth (8 channels of DDR5-4800 at
    38.4 GB/s peak each, derated for achievable throughput). Sources in docs/sim.md.
    """

    latency_s: float = 100e-9
    """Idle access latency of the first byte (seconds)."""
    bandwidth_bytes_per_s: float = 200e9
    """Sustained bandwidth shared by all requests (bytes per second)."""

    def __post_init__(self) -> None:
        check_positive("MemoryConfig", "latency_s", self.latency_s)
        check_positive("MemoryConfig", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)


class MemoryDevice(DeviceModel[DeviceStats]):
    """A memory without per-object state: ``latency + nbytes / bandwidth``, FCFS on bandwidth.

    The bandwidth is one FCFS server (transfers of concurrent requests queue behind each
    other); the access latency overlaps with other transfers, as a pipelined memory
    controller does. Keys are accepted and ignored.
    """

    def __init__(self, config: MemoryConfig, name: str) -> None:
        super().__init__(name)
        self.config = config
        self._bus = FcfsServer()

    def _access(self, t_now: float, nbytes: int) -> float:
        _, end = self._bus.serve(t_now, nbytes / self.config.bandwidth_bytes_per_s)
        return end + self.config.latency_s

    def read(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        return self._record_read(t_now, nbytes, self._access(t_now, nbytes))

    def write(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        return self._record_write(t_now, nbytes, self._access(t_now, nbytes))

    def trim(self, key: int) -> None:
        self._trims += 1

    def stats(self) -> DeviceStats:
        return self._base_stats()


class LocalDRAM(MemoryDevice):
    """Host DRAM of the local socket (the fastest tier; the yardstick for CXL)."""

    def __init__(self, config: MemoryConfig | None = None, name: str = "dram") -> None:
        super().__init__(config or MemoryConfig(), name)


def asdict_shallow(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict without deep-copying nested dataclasses."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}
