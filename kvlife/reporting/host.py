"""One engine host replayed against its configured hierarchy: the report's main run.

1. **Cache decisions**: :class:`~kvlife.replay.cache.CacheSim` (the store's placement
   engine, DRAM and SSD tiers, the policy, tenant quotas if any) with an event sink that
   keeps the device moves (:mod:`kvlife.replay.ops`) and the lifecycle analysis
   (:mod:`kvlife.reporting.lifecycle`).
2. **Remote tier and faults**, in arrival order: the remote tier extends each local
   prefix and takes the request's blocks write-through; faults cut prefixes.
3. **Timing**: a discrete-event simulation (events by ``(time, sequence)``), as
   :func:`kvlife.replay.engine.simulate`, but with per-block SSD I/O through the FTL
   (:mod:`kvlife.sim.ssd_tier`) and the remote tier through the network model.
   A request's SSD reads are issued when it starts; its SSD trims, demotions and direct
   SSD placements right after them (the room for its KV is made when it is admitted, in
   arrival order, so the FTL never holds more than the tier's capacity); its new DRAM
   blocks and remote write-through when its prefill is done.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from kvlife.core.events import LifecycleEvent
from kvlife.policy.shares import TenantShares
from kvlife.replay.cache import CacheRun, CacheSim, pos_bucket
from kvlife.replay.engine import ComputeModel
from kvlife.replay.ftl_disk import FTLDisk
from kvlife.replay.metrics import (
    per_tenant,
    percentiles,
    ratio,
    reuse_distances,
    touch_classes,
    trace_summary,
)
from kvlife.replay.ops import OpsRecorder, RequestOps, split_requests
from kvlife.replay.tenants import (
    block_owners,
    parse_tenant_shares,
    shares_policy,
    with_derived_tenants,
)
from kvlife.reporting.config import HostConfig
from kvlife.reporting.faults import FaultInjector
from kvlife.reporting.lifecycle import LifecycleAnalysis, trace_lifetimes
from kvlife.reporting.remote import RemoteTier
from kvlife.sim.device import LocalDRAM
from kvlife.sim.network import RDMA_100G, TCP_25G, NetworkLink
from kvlife.sim.ssd_tier import SSDTier, SSDTierConfig
from kvlife.trace.model import Trace

POSITION_CLASSES = ("pos0", "pos1-3", "pos4-15", "pos16+")


def first_positions(trace: Trace) -> dict[int, int]:
    """Each block id -> its position bucket where the trace first holds it."""
    lens = np.diff(trace.offsets)
    pos = np.arange(trace.n_touches, dtype=np.int64) - np.repeat(trace.offsets[:-1], lens)
    ids, first = np.unique(trace.blocks, return_index=True)
    buckets = [pos_bucket(int(p)) for p in pos[first].tolist()]
    return dict(zip(ids.tolist(), buckets, strict=True))


def tenanted(trace: Trace, cfg: HostConfig) -> Trace:
    """``trace`` with derived tenants folded into ``cfg.tenant_groups`` (if asked)."""
    if not cfg.tenants:
        return trace
    t = with_derived_tenants(trace, cfg.tenants)
    k = min(cfg.tenant_groups, len(t.tenant_names))
    prefix = "user" if cfg.tenants == "user" else "org"
    return replace(
        t,
        tenants=(t.tenants % k).astype(np.int32),
        tenant_names=tuple(f"{prefix}-group{i}" for i in range(k)),
    )


def run_host(trace: Trace, cfg: HostConfig) -> dict[str, Any]:
    """Replay ``trace`` on one host and return the report dictionary (JSON-ready, plus
    ``_``-prefixed arrays for the plots)."""
    t0 = time.perf_counter()
    trace = tenanted(trace, cfg)
    block_bytes = cfg.kv_bytes_per_token * trace.block_tokens
    dram_blocks = cfg.dram_bytes // block_bytes
    ssd_blocks = cfg.ssd_bytes // block_bytes
    positions = first_positions(trace)

    def classify(key: str, _e: LifecycleEvent) -> str:
        return POSITION_CLASSES[positions.get(int(key, 16), 3)]

    life = LifecycleAnalysis(classify)
    rec = OpsRecorder(tee=life)
    sim = CacheSim(cfg.policy, dram_blocks, ssd_blocks, sink=rec, block_bytes=block_bytes)
    quotas: dict[str, TenantShares[object, str]] = {}
    if cfg.tenant_shares:
        fractions = parse_tenant_shares(cfg.tenant_shares, trace)
        owners = block_owners(trace)
        quotas = {
            tier: shares_policy(cfg.policy, cap, fractions, owners)
            for tier, cap in sim.caps.items()
        }
        sim.policies.update(quotas)
    run = sim.run(trace)
    ops = split_requests(rec.rows, run)
    rec.rows = []
    t_cache = time.perf_counter() - t0

    # remote tier and faults, in arrival order
    n = trace.n_requests
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    pd = run.prefix_dram.tolist()
    pk = run.prefix_disk.tolist()
    remote = RemoteTier(cfg.remote_bytes // block_bytes) if cfg.remote_bytes else None
    faults = FaultInjector(cfg.faults)
    local = [0] * n
    rq = [0] * n
    stall = [0.0] * n
    rw = [0] * n
    for r in range(n):
        req = blocks[offs[r] : offs[r + 1]]
        p = pd[r] + pk[r]
        q = remote.extend(req, p) if remote is not None else 0
        keep, q, kind = faults.cut(p, pd[r], q)
        if kind == "remote_timeout":
            stall[r] = cfg.faults.remote_timeout_s
        local[r], rq[r] = keep, q
        if remote is not None:
            rw[r] = remote.store(req)

    timing = _simulate(trace, cfg, ops, pd, local, rq, rw, stall, block_bytes, positions)
    report = _summarise(trace, cfg, run, ops, pd, local, rq, rw, block_bytes, timing)
    report["remote"] = (
        {
            "capacity_blocks": remote.capacity,
            "hits": remote.hits,
            "writes": remote.writes,
            "evictions": remote.evictions,
        }
        if remote is not None
        else None
    )
    report["faults"] = {"config": asdict(cfg.faults), **faults.out.figures()}
    if quotas:
        report["tenant_shares"] = {tier: p.figures() for tier, p in quotas.items()}
    lens = np.diff(trace.offsets)
    report["lifecycle"] = {
        "replay": life.result(),
        "trace": trace_lifetimes(
            trace.blocks,
            np.repeat(trace.timestamps, lens),
            touch_classes(trace) % 4,
            POSITION_CLASSES,
        ),
    }
    report["_lifespans"] = life.samples()
    report["reuse_distance_touches"] = reuse_distances(trace)
    elapsed = time.perf_counter() - t0
    report["speed"] = {
        "seconds": elapsed,
        "cache_seconds": t_cache,
        "timing_seconds": timing["seconds"],
        "block_touches_per_s": ratio(trace.n_touches, elapsed),
        "ssd_host_unit_writes_per_s": ratio(
            report["ssd"]["host_unit_writes"] if report["ssd"] else 0, timing["seconds"]
        ),
    }
    return report


_START, _DONE = 1, 2


def _simulate(
    trace: Trace,
    cfg: HostConfig,
    ops: list[RequestOps],
    pd: list[int],
    local: list[int],
    rq: list[int],
    rw: list[int],
    stall: list[float],
    block_bytes: int,
    positions: dict[int, int],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    compute: ComputeModel = cfg.compute
    n = trace.n_requests
    arrival = trace.timestamps.tolist()
    inp = trace.input_tokens.tolist()
    bt = trace.block_tokens
    dram = LocalDRAM(name="dram")
    tier = (
        SSDTier(
            SSDTierConfig(
                capacity_bytes=max(block_bytes, cfg.ssd_bytes // block_bytes * block_bytes),
                op=cfg.ssd_op,
                streams=len(POSITION_CLASSES) if cfg.fdp else 1,
            ),
            block_bytes,
            drives=cfg.ssd_drives,
        )
        if cfg.ssd_bytes >= block_bytes
        else None
    )
    ssd = FTLDisk(tier, ops, block_bytes, positions) if tier is not None else None
    net = (
        NetworkLink(RDMA_100G if cfg.remote_link == "rdma" else TCP_25G, "remote")
        if cfg.remote_bytes
        else None
    )
    rate = compute.prefill_tokens_per_s
    ttft = np.zeros(n)
    queue = np.zeros(n)
    load = np.zeros(n)
    busy = 0.0
    io: dict[str, list[tuple[float, int, int]]] = {"dram": [], "ssd": [], "remote": []}
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    free = compute.instances
    waiting: deque[int] = deque()
    push, pop = heapq.heappush, heapq.heappop
    arrivals = deque(range(n))
    last = 0.0
    while heap or arrivals:
        if arrivals and (not heap or arrival[arrivals[0]] <= heap[0][0]):
            r = arrivals.popleft()
            t = arrival[r]
            if free:
                free -= 1
                push(heap, (t, seq, _START, r))
                seq += 1
            else:
                waiting.append(r)
            continue
        t, _, kind, r = pop(heap)
        last = max(last, t)
        o = ops[r]
        if kind == _START:
            queue[r] = t - arrival[r]
            done = t
            n_dram = min(pd[r], local[r])
            if n_dram:
                nb = n_dram * block_bytes
                done = max(done, dram.read(t, nb, r))
                io["dram"].append((t, nb, 0))
            n_ssd = local[r] - n_dram
            disk_io = ssd.start(t, r, n_ssd) if ssd is not None else None
            if disk_io is not None:
                done = max(done, disk_io.done)
                if n_ssd:
                    io["ssd"].append((t, n_ssd * block_bytes, 0))
            if rq[r] and net is not None:
                nb = rq[r] * block_bytes
                done = max(done, net.read(t, nb, r))
                io["remote"].append((t, nb, 0))
            done += stall[r]  # a remote fetch that timed out before it was given up
            if disk_io is not None:
                # the demotions the FTL wrote were read from DRAM
                if o.demotions:
                    dram.read(t, len(o.demotions) * block_bytes, r)
                    io["dram"].append((t, len(o.demotions) * block_bytes, 0))
                if disk_io.written_bytes:
                    io["ssd"].append((t, 0, disk_io.written_bytes))
            load[r] = done - t
            cached = min((local[r] + rq[r]) * bt, inp[r])
            work = max(inp[r] - cached, 1) / rate
            busy += work
            push(heap, (done + work, seq, _DONE, r))
            seq += 1
        else:
            ttft[r] = t - arrival[r]
            nb = (o.dram_new + o.promotions) * block_bytes
            if nb:
                dram.write(t, nb, r)
                io["dram"].append((t, 0, nb))
            if rw[r] and net is not None:
                nb = rw[r] * block_bytes
                net.write(t, nb, r)
                io["remote"].append((t, 0, nb))
            if waiting:
                push(heap, (t, seq, _START, waiting.popleft()))
                seq += 1
            else:
                free += 1
    span = max(last, float(arrival[-1]) if n else 0.0, 1e-9)
    ctx = trace.input_tokens + trace.output_tokens / 2.0
    tpot = compute.decode_s_per_token + compute.decode_s_per_context_token * ctx
    tpot = np.where(trace.output_tokens > 0, tpot, np.nan).astype(np.float64)
    dstat = dram.stats()
    util: dict[str, float] = {
        "prefill_instances": busy / (compute.instances * span),
        "dram": (dstat.bytes_read + dstat.bytes_written)
        / (dram.config.bandwidth_bytes_per_s * span),
    }
    net_fig = None
    if net is not None:
        ns = net.stats()
        util["remote_link"] = (ns.busy_in_s + ns.busy_out_s) / (2 * span)
        net_fig = {
            "bytes_read": ns.bytes_read,
            "bytes_written": ns.bytes_written,
            "read_p99_s": ns.read_latency.p99_s,
            "queue_p99_s": ns.queue_delay.p99_s,
            "link_in_utilisation": ns.busy_in_s / span,
            "link_out_utilisation": ns.busy_out_s / span,
        }
    ssd_fig = None
    if tier is not None:
        ssd_fig = tier.figures(span)
        util["ssd_dies"] = float(ssd_fig["utilisation"])  # type: ignore[arg-type]
        ssd_fig["gc_windows"] = len(tier.gc_windows)
    return {
        "ttft": ttft,
        "tpot": tpot,
        "queue": queue,
        "load": load,
        "span_s": span,
        "utilisation": util,
        "ssd": ssd_fig,
        "network": net_fig,
        "dram_bytes": (dstat.bytes_read, dstat.bytes_written),
        "io": io,
        "gc_windows": tier.gc_windows if tier is not None else [],
        "seconds": time.perf_counter() - t0,
    }


def _summarise(
    trace: Trace,
    cfg: HostConfig,
    run: CacheRun,
    ops: list[RequestOps],
    pd: list[int],
    local: list[int],
    rq: list[int],
    rw: list[int],
    block_bytes: int,
    timing: dict[str, Any],
) -> dict[str, Any]:
    touches = trace.n_touches
    n_dram = sum(min(a, b) for a, b in zip(pd, local, strict=True))
    n_local = sum(local)
    n_ssd = n_local - n_dram
    n_remote = sum(rq)
    hits = n_local + n_remote
    new_blocks = int(run.new.sum()) + int(run.dropped.sum())
    computed = int((trace.offsets[1:] - trace.offsets[:-1]).sum()) - hits
    dram_r, dram_w = timing["dram_bytes"]
    ssd = timing["ssd"]
    net = timing["network"]
    ssd_r = n_ssd * block_bytes
    ssd_w = sum(len(o.demotions) + len(o.disk_new) for o in ops) * block_bytes
    rem_r = net["bytes_read"] if net else 0
    rem_w = net["bytes_written"] if net else 0
    read_total = dram_r + ssd_r + rem_r
    write_total = dram_w + ssd_w + rem_w
    loaded = hits * block_bytes
    prefix = np.asarray(local, np.int64) + np.asarray(rq, np.int64)
    rows = {
        "prefix": prefix,
        "present": run.present,
        "new": run.new,
        "ttft": timing["ttft"],
        "tpot": timing["tpot"],
    }
    tenants = per_tenant(trace, rows, block_bytes)
    ttft = timing["ttft"]
    cfg_d = asdict(cfg)
    return {
        "trace": trace_summary(trace),
        "config": {**cfg_d, "block_bytes": block_bytes},
        "latency": {
            "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(timing["tpot"]),
            "queue_s": percentiles(timing["queue"]),
            "load_s": percentiles(timing["load"]),
        },
        "hits": {
            "block_touches": touches,
            "prefix_hits": hits,
            "per_tier": {"dram": n_dram, "ssd": n_ssd, "remote": n_remote},
            "prefix_hit_ratio": ratio(hits, touches),
            "per_tier_ratio": {
                "dram": ratio(n_dram, touches),
                "ssd": ratio(n_ssd, touches),
                "remote": ratio(n_remote, touches),
            },
            "block_hit_ratio_local": ratio(int(run.present.sum()), touches),
            "computed_blocks": computed,
        },
        "bytes": {
            "loaded": loaded,
            "stored_new": new_blocks * block_bytes,
            "read": {"dram": dram_r, "ssd": ssd_r, "remote": rem_r},
            "written": {"dram": dram_w, "ssd": ssd_w, "remote": rem_w},
        },
        "amplification": {
            "read": ratio(read_total, loaded),
            "write": ratio(write_total, new_blocks * block_bytes),
            "ssd_waf": ssd["waf"] if ssd else None,
            "write_to_nand_per_new_byte": ratio(
                ssd_w * (ssd["waf"] if ssd else 0.0), new_blocks * block_bytes
            ),
        },
        "ssd": ssd,
        "network": net,
        "utilisation": timing["utilisation"],
        "span_s": timing["span_s"],
        "local": {
            "promotions": int(run.promoted.sum()),
            "demotions": int(run.demoted.sum()),
            "dropped_blocks": int(run.dropped.sum()),
            "evictions": {k: v.evictions for k, v in run.tiers.items()},
        },
        "isolation": isolation(tenants),
        "tenants": tenants,
        "_ttft": ttft,
        "_arrival": trace.timestamps,
        "_io": timing["io"],
        "_gc_windows": timing["gc_windows"],
    }


def isolation(tenants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Fairness between tenants: Jain's index of hit ratios, and the spread of P99 TTFT."""
    if len(tenants) < 2:
        return {"tenants": len(tenants), "note": "one tenant: nothing to isolate"}
    hr = np.array([t["prefix_hit_ratio"] for t in tenants.values()], dtype=np.float64)
    jain = float(hr.sum() ** 2 / (hr.size * (hr**2).sum())) if (hr**2).sum() else 1.0
    p99 = [t["ttft_s"]["p99"] for t in tenants.values() if "ttft_s" in t]
    return {
        "tenants": len(tenants),
        "jain_hit_ratio": jain,
        "hit_ratio_min": float(hr.min()),
        "hit_ratio_max": float(hr.max()),
        "ttft_p99_max_over_min": (max(p99) / min(p99)) if p99 and min(p99) > 0 else None,
    }
