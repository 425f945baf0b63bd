"""A cluster of engine hosts behind a prefix-affinity router, with one shared KV tier.

Why: one host cannot say where a shared remote tier or its network saturates, nor what
CXL shared memory changes against an RDMA pool. This simulates ``hosts`` engine hosts
(per-host DRAM and SSD, prefill compute) over a trace:

1. **Routing** (arrival order), as llm-d's precise-prefix scorer and Dynamo's KV router
   do: the router keeps, per host, an LRU index of the blocks it sent there (bounded by
   the host's local capacity) and sends a request to the host with the longest indexed
   prefix, less a load penalty (requests routed there in the last ``window_s``);
   ties go to the least loaded host.
2. **Local cache decisions** per host: :class:`~kvlife.replay.cache.CacheSim` (the store's
   placement engine) over the host's requests.
3. **Shared tier** (arrival order): after a request's local prefix, the run of following
   blocks the shared tier holds is fetched; computed blocks are written through (LRU
   within its capacity). Decisions depend on order only, so they are made once and
   timed for every design and load.
4. **Timing** per design and load (the trace's arrival times divided by the load): a
   discrete-event simulation with per-host DRAM, local SSD (bandwidth model: the FTL runs
   in the one-host report), a per-host link to the shared tier and the shared tier's own
   aggregate link, all FCFS (:mod:`kvlife.sim`).

Designs (:data:`DESIGNS`): ``rdma-pool`` (memory servers reached over RDMA, as Mooncake
Store), ``cpu-dram-pool`` (the same servers through the kernel TCP stack, as a
Redis/Valkey or LMCache server), ``cxl-shared`` (a CXL memory pool behind a CXL switch,
load/store from every host, as TraCT), ``local-ssd`` (no shared tier). A resource is
*saturated* at a load where its utilisation reaches :data:`SATURATED`.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.replay.cache import CacheSim
from kvlife.replay.engine import ComputeModel
from kvlife.replay.metrics import percentiles, ratio
from kvlife.reporting.remote import RemoteTier
from kvlife.sim.cxl import CXLDramConfig, CXLDramExpander
from kvlife.sim.device import DeviceModel, LocalDRAM, MemoryConfig, MemoryDevice
from kvlife.sim.network import NetworkLink, NetworkLinkConfig
from kvlife.trace.model import Trace

GiB = 1 << 30
TiB = 1 << 40
SATURATED = 0.8


@dataclass(frozen=True, slots=True)
class SharedDesign:
    """How hosts reach the shared tier: a per-host link and the tier's aggregate link."""

    name: str
    host_bytes_per_s: float
    """Per-host bandwidth to the shared tier."""
    pool_bytes_per_s: float
    """Aggregate bandwidth of the shared tier (all its servers or devices)."""
    rtt_s: float
    per_message_s: float
    """Host software time per transfer (0 for CXL loads/stores by DMA)."""
    memory: bool = False
    """True: the link is memory (CXL), modelled as a memory device, not a network."""
    note: str = ""


DESIGNS: dict[str, SharedDesign | None] = {
    "rdma-pool": SharedDesign(
        "rdma-pool",
        25e9,
        8 * 25e9,
        5e-6,
        1e-6,
        note="8 memory servers; 2x100 Gb/s RoCE per host and per server",
    ),
    "cpu-dram-pool": SharedDesign(
        "cpu-dram-pool",
        9e9,
        8 * 9e9,
        30e-6,
        10e-6,
        note="the same 8 servers through kernel TCP (100 Gb/s NICs, ~9 GB/s per stream)",
    ),
    "cxl-shared": SharedDesign(
        "cxl-shared",
        52e9,
        16 * 26e9,
        600e-9,
        0.0,
        memory=True,
        note="CXL switch; PCIe 5 x16 per host, 16 x8 memory devices (TraCT-style pool)",
    ),
    "local-ssd": None,
}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster and its sweep."""

    hosts: int = 64
    kv_bytes_per_token: int = 327680
    """KV bytes per token (327,680: Llama-3-70B fp16; the Mooncake trace's 182,790 unique
    blocks are then ~30 TB)."""
    dram_bytes: int = 256 * GiB
    """Per-host DRAM for KV."""
    ssd_bytes: int = 0
    """Per-host local SSD for KV in the shared-tier designs (0: none)."""
    local_ssd_bytes: int = 0
    """Per-host local SSD of the ``local-ssd`` design (0: the shared tier's capacity split
    over the hosts, so that every design has the same total capacity)."""
    ssd_bytes_per_s: float = 4 * 6.5e9
    """Per-host local SSD read/write bandwidth (4 PCIe 4 NVMe drives)."""
    shared_bytes: int = 16 * TiB
    """Shared tier capacity."""
    policy: str = "lru"
    compute: ComputeModel = field(
        default_factory=lambda: ComputeModel(
            prefill_tokens_per_s=20_000.0,
            decode_s_per_token=0.03,
            decode_s_per_context_token=5e-7,
            instances=1,
        )
    )
    """Per host: one 70B prefill instance (tensor-parallel over 8 GPUs)."""
    loads: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0)
    """Request-rate multipliers to sweep."""
    designs: tuple[str, ...] = tuple(DESIGNS)
    affinity_window_s: float = 30.0
    """Seconds of routed requests that count as a host's load."""
    load_penalty_blocks: float = 2.0
    """Blocks of prefix match one recently routed request is worth."""
    routing: str = "affinity"
    """affinity (prefix-aware, load-penalised) or round-robin (no affinity)."""

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise InvalidArgument("a cluster needs at least one host")
        for d in self.designs:
            if d not in DESIGNS:
                raise InvalidArgument(f"unknown design {d!r}; known: {', '.join(DESIGNS)}")
        if self.routing not in ("affinity", "round-robin"):
            raise InvalidArgument(f"routing {self.routing!r}: affinity or round-robin")
        if not self.loads or min(self.loads) <= 0:
            raise InvalidArgument("loads must be positive multipliers")


def local_ssd(cfg: ClusterConfig) -> int:
    """Per-host SSD bytes of the local-ssd design."""
    return cfg.local_ssd_bytes or cfg.shared_bytes // cfg.hosts


def subset(trace: Trace, idx: np.ndarray, name: str) -> Trace:
    """The requests ``idx`` of ``trace`` (in that order) as a trace of their own."""
    lens = np.diff(trace.offsets)[idx]
    offs = np.zeros(idx.size + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    parts = [trace.blocks[trace.offsets[i] : trace.offsets[i + 1]] for i in idx.tolist()]
    blocks = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    cats = trace.categories[idx] if trace.categories.size else trace.categories
    return Trace(
        name=name,
        block_tokens=trace.block_tokens,
        timestamps=trace.timestamps[idx],
        input_tokens=trace.input_tokens[idx],
        output_tokens=trace.output_tokens[idx],
        offsets=offs,
        blocks=blocks,
        tenants=trace.tenants[idx],
        tenant_names=trace.tenant_names,
        categories=cats,
        category_names=trace.category_names,
        reuse_info=trace.reuse_info,
    )


def route(trace: Trace, cfg: ClusterConfig, cap_blocks: int) -> np.ndarray:
    """Host of every request by prefix affinity with a load penalty (module docstring)."""
    n = trace.n_requests
    if cfg.routing == "round-robin":
        return np.arange(n, dtype=np.int64) % cfg.hosts
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    times = trace.timestamps.tolist()
    index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(cfg.hosts)]
    holders: dict[int, set[int]] = {}
    recent: deque[tuple[float, int]] = deque()
    load = [0] * cfg.hosts
    out = np.zeros(n, np.int64)
    pen = cfg.load_penalty_blocks
    for r in range(n):
        t = times[r]
        while recent and recent[0][0] < t - cfg.affinity_window_s:
            load[recent.popleft()[1]] -= 1
        req = blocks[offs[r] : offs[r + 1]]
        best, score = min(range(cfg.hosts), key=load.__getitem__), 0.0
        best_score = -pen * load[best]
        for h in holders.get(req[0], ()) if req else ():
            idx = index[h]
            m = 0
            for b in req:
                if b not in idx:
                    break
                m += 1
            score = m - pen * load[h]
            if score > best_score or (score == best_score and load[h] < load[best]):
                best, best_score = h, score
        out[r] = best
        load[best] += 1
        recent.append((t, best))
        idx = index[best]
        for b in req:
            if b in idx:
                idx.move_to_end(b)
            else:
                idx[b] = None
                holders.setdefault(b, set()).add(best)
                if len(idx) > cap_blocks:
                    old, _ = idx.popitem(last=False)
                    hs = holders[old]
                    hs.discard(best)
                    if not hs:
                        del holders[old]
    return out


@dataclass(slots=True)
class _Decisions:
    host: np.ndarray
    pd: np.ndarray
    pk: np.ndarray
    new: np.ndarray
    promoted: np.ndarray
    demoted: np.ndarray
    shared_q: np.ndarray
    shared_w: np.ndarray


def decide(trace: Trace, cfg: ClusterConfig, shared: bool) -> _Decisions:
    """Routing, per-host cache decisions and (if ``shared``) shared-tier decisions."""
    bb = cfg.kv_bytes_per_token * trace.block_tokens
    dram_b = cfg.dram_bytes // bb
    ssd_b = (cfg.ssd_bytes if shared else local_ssd(cfg)) // bb
    host = route(trace, cfg, dram_b + ssd_b)
    n = trace.n_requests
    pd, pk, new, pm, dm = (np.zeros(n, np.int64) for _ in range(5))
    for h in range(cfg.hosts):
        idx = np.flatnonzero(host == h)
        if idx.size == 0:
            continue
        run = CacheSim(cfg.policy, dram_b, ssd_b).run(subset(trace, idx, f"host{h}"))
        pd[idx], pk[idx], new[idx] = run.prefix_dram, run.prefix_disk, run.new
        pm[idx], dm[idx] = run.promoted, run.demoted
    q = np.zeros(n, np.int64)
    w = np.zeros(n, np.int64)
    if shared:
        tier = RemoteTier(cfg.shared_bytes // bb)
        blocks = trace.blocks.tolist()
        offs = trace.offsets.tolist()
        local = (pd + pk).tolist()
        for r in range(n):
            req = blocks[offs[r] : offs[r + 1]]
            q[r] = tier.extend(req, local[r])
            w[r] = tier.store(req)
    return _Decisions(host, pd, pk, new, pm, dm, q, w)


def _link(design: SharedDesign, bw: float, name: str) -> DeviceModel:  # type: ignore[type-arg]
    if design.memory:
        return CXLDramExpander(
            CXLDramConfig(latency_s=design.rtt_s, bandwidth_bytes_per_s=bw), name
        )
    return NetworkLink(NetworkLinkConfig(bw, design.rtt_s, design.per_message_s), name)


def _busy(dev: DeviceModel) -> float:  # type: ignore[type-arg]
    """Seconds a device's transfer queue was busy."""
    if isinstance(dev, NetworkLink):
        ns = dev.stats()
        return max(ns.busy_in_s, ns.busy_out_s)
    assert isinstance(dev, MemoryDevice)
    ms = dev.stats()
    return (ms.bytes_read + ms.bytes_written) / dev.config.bandwidth_bytes_per_s


def simulate(
    trace: Trace, cfg: ClusterConfig, dec: _Decisions, design: SharedDesign | None, load: float
) -> dict[str, Any]:
    """Time one design at one load (the trace's arrivals divided by ``load``)."""
    bb = cfg.kv_bytes_per_token * trace.block_tokens
    c = cfg.compute
    H = cfg.hosts
    n = trace.n_requests
    arrival = (trace.timestamps / load).tolist()
    inp = trace.input_tokens.tolist()
    host = dec.host.tolist()
    pd, pk = dec.pd.tolist(), dec.pk.tolist()
    q = dec.shared_q.tolist() if design else [0] * n
    w = dec.shared_w.tolist() if design else [0] * n
    wr = (dec.new + dec.promoted).tolist()
    dm = dec.demoted.tolist()
    dram = [LocalDRAM(name=f"dram{h}") for h in range(H)]
    ssd = [
        MemoryDevice(
            MemoryConfig(latency_s=80e-6, bandwidth_bytes_per_s=cfg.ssd_bytes_per_s), f"ssd{h}"
        )
        for h in range(H)
    ]
    links = [_link(design, design.host_bytes_per_s, f"link{h}") for h in range(H)] if design else []
    pool = _link(design, design.pool_bytes_per_s, "pool") if design else None
    free = [c.instances] * H
    waiting: list[deque[int]] = [deque() for _ in range(H)]
    ttft = np.zeros(n)
    busy = 0.0
    heap: list[tuple[float, int, int, int]] = [(arrival[r], r, 0, r) for r in range(n)]
    heapq.heapify(heap)
    seq = n
    bt = trace.block_tokens
    rate = c.prefill_tokens_per_s
    last = 0.0
    while heap:
        t, _, kind, r = heapq.heappop(heap)
        last = t
        h = host[r]
        if kind == 0:  # arrival
            if free[h]:
                free[h] -= 1
                heapq.heappush(heap, (t, seq, 1, r))
                seq += 1
            else:
                waiting[h].append(r)
        elif kind == 1:  # start: loads, then prefill of the rest
            done = t
            if pd[r]:
                done = max(done, dram[h].read(t, pd[r] * bb, r))
            if pk[r]:
                done = max(done, ssd[h].read(t, pk[r] * bb, r))
            if dm[r]:
                ssd[h].write(t, dm[r] * bb, r)
            if q[r] and pool is not None:
                nb = q[r] * bb
                done = max(done, links[h].read(t, nb, r), pool.read(t, nb, r))
            cached = min((pd[r] + pk[r] + q[r]) * bt, inp[r])
            work = max(inp[r] - cached, 1) / rate
            busy += work
            heapq.heappush(heap, (done + work, seq, 2, r))
            seq += 1
        else:  # prefill done: first token; new KV written locally and through
            ttft[r] = t - arrival[r]
            if wr[r]:
                dram[h].write(t, wr[r] * bb, r)
            if w[r] and pool is not None:
                nb = w[r] * bb
                links[h].write(t, nb, r)
                pool.write(t, nb, r)
            if waiting[h]:
                heapq.heappush(heap, (t, seq, 1, waiting[h].popleft()))
                seq += 1
            else:
                free[h] += 1
    span = max(last, arrival[-1] if n else 0.0, 1e-9)
    ctx = trace.input_tokens + trace.output_tokens / 2.0
    tpot = np.where(
        trace.output_tokens > 0, c.decode_s_per_token + c.decode_s_per_context_token * ctx, np.nan
    )
    touches = trace.n_touches
    hit_d, hit_s, hit_r = int(dec.pd.sum()), int(dec.pk.sum()), int(sum(q))
    util = {
        "compute": busy / (H * c.instances * span),
        "ssd_max": max(_busy(s) for s in ssd) / span,
        "host_link_max": max(_busy(x) for x in links) / span if links else 0.0,
        "pool": _busy(pool) / span if pool is not None else 0.0,
    }
    names = {
        "pool": "shared tier",
        "host_link_max": "host link",
        "compute": "prefill compute",
        "ssd_max": "local SSD",
    }
    hot = max(util, key=util.__getitem__)
    shared_read = sum(q) * bb
    return {
        "load": load,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot.astype(np.float64)),
        "prefix_hit_ratio": ratio(hit_d + hit_s + hit_r, touches),
        "shared_hit_ratio": ratio(hit_r, touches),
        "per_tier_ratio": {
            "dram": ratio(hit_d, touches),
            "ssd": ratio(hit_s, touches),
            "shared": ratio(hit_r, touches),
        },
        "bytes": {
            "shared_read": shared_read,
            "shared_written": sum(w) * bb,
            "shared_read_gb_per_s": shared_read / span / 1e9,
        },
        "utilisation": util,
        "busiest": names[hot],
        "saturated": names[hot] if util[hot] >= SATURATED else "",
        "span_s": span,
    }


def run_cluster(trace: Trace, cfg: ClusterConfig) -> dict[str, Any]:
    """Every design at every load; findings in words."""
    t0 = time.perf_counter()
    bb = cfg.kv_bytes_per_token * trace.block_tokens
    decisions = {
        shared: decide(trace, cfg, shared)
        for shared in {DESIGNS[d] is not None for d in cfg.designs}
    }
    t_dec = time.perf_counter() - t0
    designs = []
    for name in cfg.designs:
        design = DESIGNS[name]
        dec = decisions[design is not None]
        points = [simulate(trace, cfg, dec, design, load) for load in cfg.loads]
        sat = next((p["load"] for p in points if p["saturated"]), None)
        designs.append(
            {
                "design": name,
                "note": design.note
                if design
                else f"per-host DRAM and {local_ssd(cfg) / 2**40:.2f} TiB of local SSD each, "
                "no shared tier",
                "points": points,
                "saturates_at_load": sat,
                "saturated_resource": next((p["saturated"] for p in points if p["saturated"]), ""),
            }
        )
    dec = next(iter(decisions.values()))
    hosts_used = int(np.unique(dec.host).size)
    counts = np.bincount(dec.host, minlength=cfg.hosts)
    report = {
        "hosts": cfg.hosts,
        "config": {**asdict(cfg), "block_bytes": bb},
        "trace": {
            "name": trace.name,
            "requests": trace.n_requests,
            "span_s": float(trace.timestamps[-1]) if trace.n_requests else 0.0,
            "unique_blocks": trace.n_unique_blocks(),
            "kv_bytes_unique": trace.n_unique_blocks() * bb,
            "note": (
                f"{trace.name}: {trace.n_requests:,} requests over "
                f"{float(trace.timestamps[-1]) / 60:.0f} min, {trace.n_unique_blocks():,} unique "
                f"blocks x {bb / 2**20:.0f} MiB = {trace.n_unique_blocks() * bb / 1e12:.1f} TB "
                f"of KV; loads are the trace's request rate times the factor (arrival "
                f"times divided by it; cache decisions depend only on order)"
            ),
        },
        "routing": {
            "hosts_used": hosts_used,
            "requests_per_host_max": int(counts.max()),
            "requests_per_host_mean": float(counts.mean()),
        },
        "designs": designs,
        "speed": {"seconds": time.perf_counter() - t0, "decision_seconds": t_dec},
    }
    report["findings"] = findings(report)
    return report


def findings(report: dict[str, Any]) -> list[str]:
    """The answers in words: what saturates where, and what each design changes."""
    out = []
    for d in report["designs"]:
        pts = d["points"]
        top = pts[-1]
        if d["saturates_at_load"] is not None:
            out.append(
                f"{d['design']}: {d['saturated_resource']} saturates at "
                f"{d['saturates_at_load']:g}x the trace's rate (utilisation >= {SATURATED})"
            )
        else:
            u = top["utilisation"]
            out.append(
                f"{d['design']}: nothing saturates up to {top['load']:g}x; busiest is "
                f"{top['busiest']} (pool {u['pool']:.2f}, host link {u['host_link_max']:.2f}, "
                f"compute {u['compute']:.2f})"
            )
    base = next((d for d in report["designs"] if d["design"] == "rdma-pool"), None)
    for d in report["designs"]:
        if base is None or d is base:
            continue
        for p, b in zip(d["points"], base["points"], strict=True):
            if b["ttft_s"]["p99"] > 0:
                out.append(
                    f"{d['design']} vs rdma-pool at {p['load']:g}x: TTFT P99 "
                    f"{p['ttft_s']['p99']:.3f} s vs {b['ttft_s']['p99']:.3f} s "
                    f"({p['ttft_s']['p99'] / b['ttft_s']['p99']:.2f}x), hit ratio "
                    f"{p['prefix_hit_ratio']:.3f} vs {b['prefix_hit_ratio']:.3f}"
                )
    return out
