"""The replay engine: a discrete-event simulation of prefill instances and KV tiers.

Cache decisions come from :class:`~kvlife.replay.cache.CacheSim` (requests in arrival
order, the store's own policy code). Timing is a discrete-event simulation on a virtual
clock, events ordered by ``(time, sequence)``:

- **arrival**: the request joins the FCFS queue of ``instances`` prefill instances;
- **start**: an instance takes it; its usable prefix is read from each tier's device
  model (one read per tier of all its blocks), and prefill of the uncached tokens runs
  once the reads complete: ``max(input - prefix tokens, 1) / prefill_tokens_per_s``;
- **prefill done**: the first token is out (TTFT = now - arrival); the new blocks (and
  promotions) are written to their tier, demotions read from DRAM and written to disk,
  asynchronously; the instance takes the next request.

With ``planner``, each start first asks whether the prefix is worth reading: the
predicted read time (each tier's latency and time per byte, :class:`kvlife.planner.TierCost`
calibrated on an idle copy of its device model, then learnt from the reads this simulation
made, queueing included) is
compared with the prefill time it saves, and a prefix predicted slower to read than to
recompute is prefilled with the rest (counted in ``Timing.declined``), except one in
``PROBE_EVERY``, read anyway so the estimate follows a tier whose queue drained. Under the linear
prefill model of :class:`ComputeModel` that is the planner's load-or-recompute choice
(``kvlife.planner.tokens_to_load`` with a flat prefill profile) for a prefix read from
both tiers at once.

With an :class:`~kvlife.replay.ftl_disk.FTLDisk` (``kvlife replay --disk-model ftl``),
the disk tier is timed per block through the page-level FTL instead of a bandwidth
model: at **start**, the request's disk reads, then its trims, demotions and direct disk
placements (demotions are still read from DRAM when the prefill is done).

Decode runs on separate instances (prefill/decode disaggregation, as in Mooncake), so
TPOT = ``decode_s_per_token + decode_s_per_context_token x context``, with the context at
mid-decode. Devices are :mod:`kvlife.sim` models, called in event order.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument
from kvlife.planner import TierCost
from kvlife.replay.cache import DISK, DRAM, CacheRun
from kvlife.replay.ftl_disk import FTLDisk
from kvlife.sim.device import DeviceModel, LocalDRAM, MemoryConfig, MemoryDevice
from kvlife.trace.model import Trace


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Inference speed. Default: an 8B-class model on one datacenter GPU per instance."""

    prefill_tokens_per_s: float = 10_000.0
    """Prefill throughput of one instance (tokens per second)."""
    decode_s_per_token: float = 0.02
    """Decode time per output token at an empty context (seconds)."""
    decode_s_per_context_token: float = 2e-7
    """Extra decode time per token of context (attention over the KV)."""
    instances: int = 8
    """Prefill instances serving the queue."""

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.instances >= 1):
            raise InvalidArgument("prefill_tokens_per_s must be > 0 and instances >= 1")
        if self.decode_s_per_token < 0 or self.decode_s_per_context_token < 0:
            raise InvalidArgument("decode times must be >= 0")


COMPUTE_PRESETS: dict[str, ComputeModel] = {
    "gpu-8b": ComputeModel(),
    # measured by the lead on this machine's CPU (SmolLM2-135M, transformers, fp32)
    "smollm2-135m-cpu": ComputeModel(
        prefill_tokens_per_s=500.0, decode_s_per_token=0.05, instances=1
    ),
}

DEVICE_KINDS = ("dram", "cxl", "nvme", "rdma", "tcp")


def make_device(kind: str, name: str) -> DeviceModel[object]:  # type: ignore[type-var]
    """A tier timing model by name (see docs/replay.md for the parameters)."""
    if kind == "dram":
        return LocalDRAM(name=name)
    if kind == "cxl":
        from kvlife.sim.cxl import CXLDramExpander

        return CXLDramExpander(name=name)
    if kind == "nvme":
        # a simple bandwidth model of one PCIe 4 NVMe SSD: 80 us, 6.5 GB/s reads
        return MemoryDevice(MemoryConfig(latency_s=80e-6, bandwidth_bytes_per_s=6.5e9), name)
    if kind in ("rdma", "tcp"):
        from kvlife.sim.network import RDMA_100G, TCP_25G, NetworkLink

        return NetworkLink(RDMA_100G if kind == "rdma" else TCP_25G, name)
    raise InvalidArgument(f"unknown device {kind!r}; known: {', '.join(DEVICE_KINDS)}")


@dataclass(slots=True)
class Timing:
    """Per-request times (seconds) and the byte timeline of each tier."""

    ttft: NDArray[np.float64]
    tpot: NDArray[np.float64]
    queue: NDArray[np.float64]
    """Time from arrival to start of prefill."""
    load: NDArray[np.float64]
    """Time spent reading the usable prefix."""
    declined: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """Per request, the prefix blocks the planner chose to recompute (``planner`` only)."""
    io: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    """Per tier: (time, bytes read, bytes written) of each device call."""
    device_stats: dict[str, object] = field(default_factory=dict)


_ARRIVAL, _START, _DONE = 0, 1, 2


def _predict(cost: TierCost, inflight: list[tuple[float, int]], t: float, nbytes: int) -> float:
    """A read of ``nbytes`` at ``t``: the tier's latency, then its bytes behind those
    still in flight (the queue depth, in bytes), at the learnt time per byte."""
    return cost.seconds(_queued(inflight, t) + nbytes)


def _queued(inflight: list[tuple[float, int]], t: float) -> int:
    """Bytes of reads still in flight at ``t`` (finished ones dropped)."""
    while inflight and inflight[0][0] <= t:
        heapq.heappop(inflight)
    return sum(n for _, n in inflight)


def _calibrated(name: str, device: DeviceModel[object], block_bytes: int) -> TierCost:  # type: ignore[type-var]
    """A tier's cost seeded from two reads of an idle copy of its device model (one
    block, 64 blocks), as the store calibrates a tier: latency and time per byte."""
    import copy

    idle = copy.deepcopy(device)
    cost = TierCost(name)
    small = idle.read(0.0, block_bytes, -1)
    large = idle.read(1e6, 64 * block_bytes, -1) - 1e6
    cost.calibrate((block_bytes, small), (64 * block_bytes, large))
    return cost


PROBE_EVERY = 32
"""With the planner, one prefix in this many that it would recompute is read anyway."""


def simulate(
    trace: Trace,
    run: CacheRun,
    compute: ComputeModel,
    devices: dict[str, DeviceModel[object]],  # type: ignore[type-var]
    block_bytes: int,
    *,
    planner: bool = False,
    ftl: FTLDisk | None = None,
) -> Timing:
    """Time the requests of ``trace`` given the cache decisions of ``run``; with
    ``planner``, each prefix is read or recomputed, whichever is predicted faster; with
    ``ftl``, the disk tier is that FTL (``devices`` then has no disk)."""
    if ftl is not None and (planner or DISK in devices):
        raise InvalidArgument("the FTL disk is timed alone: no planner, no disk device beside it")

    n = trace.n_requests
    arrival = trace.timestamps.tolist()
    inp = trace.input_tokens.tolist()
    pd = run.prefix_dram.tolist()
    pk = run.prefix_disk.tolist()
    new = run.new.tolist()
    prom = run.promoted.tolist()
    dem = run.demoted.tolist()
    bt = trace.block_tokens
    first = DRAM if DRAM in devices else DISK
    dram = devices.get(DRAM)
    disk = devices.get(DISK)
    rate = compute.prefill_tokens_per_s
    ttft = np.zeros(n)
    queue_t = np.zeros(n)
    load_t = np.zeros(n)
    declined = np.zeros(n, np.int64)
    costs = {name: _calibrated(name, device, block_bytes) for name, device in devices.items()}
    refused = 0
    inflight: dict[str, list[tuple[float, int]]] = {name: [] for name in devices}
    """Per tier, reads not finished: (done, bytes), the queue a new read waits behind."""
    io: dict[str, list[tuple[float, int, int]]] = {name: [] for name in devices}
    if ftl is not None:
        io[DISK] = []
    heap: list[tuple[float, int, int, int]] = [(arrival[r], r, _ARRIVAL, r) for r in range(n)]
    heapq.heapify(heap)
    seq = n
    free = compute.instances
    waiting: deque[int] = deque()
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        t, _, kind, r = pop(heap)
        if kind == _ARRIVAL:
            if free:
                free -= 1
                push(heap, (t, seq, _START, r))
                seq += 1
            else:
                waiting.append(r)
        elif kind == _START:
            queue_t[r] = t - arrival[r]
            done = t
            blocks = pd[r] + pk[r]
            if planner and blocks:
                # parallel reads, as below; a tier never read predicts 0 (it is read)
                reads = [(DRAM, pd[r]), (DISK, pk[r])]
                predicted = max(
                    _predict(costs[tier], inflight[tier], t, b * block_bytes)
                    for tier, b in reads
                    if b and tier in costs
                )
                if predicted > min(blocks * bt, inp[r]) / rate:
                    refused += 1
                    # every PROBE_EVERY-th refusal reads anyway: a tier that is never
                    # read is never seen to have become fast again (its queue drained)
                    if refused % PROBE_EVERY:
                        declined[r] = blocks
            if declined[r] == 0:
                for tier, device, b in ((DRAM, dram, pd[r]), (DISK, disk, pk[r])):
                    if b and device is not None:
                        nb = b * block_bytes
                        # the read waits behind the bytes in flight: it is those and
                        # its own that its time says something of
                        queued = _queued(inflight[tier], t)
                        got = device.read(t, nb, r)
                        costs[tier].observe(queued + nb, got - t)
                        heapq.heappush(inflight[tier], (got, nb))
                        done = max(done, got)
                        io[tier].append((t, nb, 0))
            if ftl is not None:
                got_io = ftl.start(t, r, 0 if declined[r] else pk[r])
                done = max(done, got_io.done)
                if got_io.read_bytes:
                    io[DISK].append((t, got_io.read_bytes, 0))
                if got_io.written_bytes:
                    io[DISK].append((t, 0, got_io.written_bytes))
            load_t[r] = done - t
            cached = 0 if declined[r] else min(blocks * bt, inp[r])
            end = done + max(inp[r] - cached, 1) / rate
            push(heap, (end, seq, _DONE, r))
            seq += 1
        else:
            ttft[r] = t - arrival[r]
            wrote = (new[r] + prom[r]) * block_bytes
            if wrote and first in devices:  # else the FTL wrote them at the start
                devices[first].write(t, wrote, r)
                io[first].append((t, 0, wrote))
            if dem[r] and dram is not None and ftl is not None:  # written by the FTL
                dram.read(t, dem[r] * block_bytes, r)
                io[DRAM].append((t, dem[r] * block_bytes, 0))
            if dem[r] and dram is not None and disk is not None:
                nb = dem[r] * block_bytes
                dram.read(t, nb, r)
                disk.write(t, nb, r)
                io[DRAM].append((t, nb, 0))
                io[DISK].append((t, 0, nb))
            if waiting:
                push(heap, (t, seq, _START, waiting.popleft()))
                seq += 1
            else:
                free += 1
    ctx = trace.input_tokens + trace.output_tokens / 2.0
    tpot = compute.decode_s_per_token + compute.decode_s_per_context_token * ctx
    tpot = np.where(trace.output_tokens > 0, tpot, np.nan)
    return Timing(
        ttft=ttft,
        tpot=tpot.astype(np.float64),
        queue=queue_t,
        load=load_t,
        declined=declined,
        io=io,
        device_stats={name: d.stats() for name, d in devices.items()},
    )
