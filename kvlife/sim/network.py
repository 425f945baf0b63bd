"""Network link model: bandwidth, round-trip time, per-message overhead and queueing.

Why: a remote KV store (Redis, Mooncake Store) is reached over a link whose cost is not
one bandwidth number. Small transfers pay the round trip and the per-message software
overhead; large ones pay serialization; concurrent ones queue behind each other. This
model gives all three on a virtual clock, behind the common
:class:`~kvlife.sim.device.DeviceModel` interface, so a replay engine can put a remote
tier next to local ones.

A read is a fetch: a request message out, the payload back. A write is a push: the
payload out, an acknowledgement back. Each direction of the full-duplex link is a FCFS
server for serialization; the host's per-message processing is a FCFS server too (one
core driving the NIC). Propagation is half the RTT each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlife.sim.device import (
    DeviceModel,
    DeviceStats,
    FcfsServer,
    LatencyRecorder,
    LatencyStats,
    check_non_negative,
    check_positive,
)


@dataclass(frozen=True, slots=True)
class NetworkLinkConfig:
    """A network path to a remote store. Defaults: a 100 Gb/s RDMA (RoCE) path."""

    bandwidth_bytes_per_s: float = 12.5e9
    """Line rate of each direction (bytes per second); 100 Gb/s = 12.5e9."""
    rtt_s: float = 5e-6
    """Round-trip time of a minimal message (propagation, switches, NIC)."""
    per_message_overhead_s: float = 1e-6
    """Host software time per message (posting a work request, completion handling)."""

    def __post_init__(self) -> None:
        check_positive("NetworkLinkConfig", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        check_non_negative("NetworkLinkConfig", "rtt_s", self.rtt_s)
        check_non_negative(
            "NetworkLinkConfig", "per_message_overhead_s", self.per_message_overhead_s
        )


RDMA_100G = NetworkLinkConfig()
"""100 Gb/s RoCE/InfiniBand: a few microseconds RTT, about 1 µs of host time per message."""

TCP_25G = NetworkLinkConfig(
    bandwidth_bytes_per_s=3.125e9, rtt_s=30e-6, per_message_overhead_s=10e-6
)
"""25 Gb/s Ethernet through the kernel TCP stack: tens of microseconds RTT and overhead."""


@dataclass(frozen=True, slots=True)
class NetworkStats(DeviceStats):
    """Statistics of a :class:`NetworkLink`: the common ones plus queueing and utilisation."""

    messages: int
    """Messages sent (one per read or write)."""
    queue_delay: LatencyStats
    """Time payloads waited for the link or the host (seconds), per message."""
    busy_out_s: float
    """Serialization time spent on the outbound direction (writes)."""
    busy_in_s: float
    """Serialization time spent on the inbound direction (read responses)."""


class NetworkLink(DeviceModel[NetworkStats]):
    """A full-duplex link with per-message overhead; keys are accepted and ignored."""

    def __init__(self, config: NetworkLinkConfig | None = None, name: str = "net") -> None:
        super().__init__(name)
        self.config = config or NetworkLinkConfig()
        self._host = FcfsServer()
        self._out = FcfsServer()
        self._in = FcfsServer()
        self._queue = LatencyRecorder()
        self._messages = 0

    def _transfer(self, t_now: float, nbytes: int, link: FcfsServer, fetch: bool) -> float:
        cfg = self.config
        self._messages += 1
        h_start, h_end = self._host.serve(t_now, cfg.per_message_overhead_s)
        half = cfg.rtt_s / 2.0
        # A fetch's payload leaves the remote end after the request has crossed the link.
        ready = h_end + half if fetch else h_end
        x_start, x_end = link.serve(ready, nbytes / cfg.bandwidth_bytes_per_s)
        self._queue.add((h_start - t_now) + (x_start - ready))
        # Fetch: payload arrives half an RTT after serialization. Push: the ack returns a
        # full RTT after the last byte left.
        return x_end + (half if fetch else cfg.rtt_s)

    def read(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        done = self._transfer(t_now, nbytes, self._in, fetch=True)
        return self._record_read(t_now, nbytes, done)

    def write(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        done = self._transfer(t_now, nbytes, self._out, fetch=False)
        return self._record_write(t_now, nbytes, done)

    def trim(self, key: int) -> None:
        # A remote delete is fire-and-forget for the caller; it is counted, not timed.
        self._trims += 1

    def stats(self) -> NetworkStats:
        return self._stats_as(
            NetworkStats,
            messages=self._messages,
            queue_delay=self._queue.summary(),
            busy_out_s=self._out.busy_time,
            busy_in_s=self._in.busy_time,
        )


__all__ = ["RDMA_100G", "TCP_25G", "NetworkLink", "NetworkLinkConfig", "NetworkStats"]
