"""Replay runs: one configuration (:func:`replay`), capacity sweeps (:func:`sweep`),
and the capacity syntax of the CLI (:func:`parse_capacity`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import EventSink
from kvlife.policy.shares import TenantShares
from kvlife.replay.cache import DISK, DRAM, CacheRun, CacheSim
from kvlife.replay.engine import ComputeModel, Timing, make_device, simulate
from kvlife.replay.ftl_disk import DISK_MODELS, FTLDisk
from kvlife.replay.metrics import (
    per_tenant,
    percentiles,
    ratio,
    reuse_distances,
    trace_summary,
)
from kvlife.replay.ops import OpsRecorder, split_requests
from kvlife.sim.ssd_tier import SSDTier, SSDTierConfig
from kvlife.trace.model import Trace

DEFAULT_KV_BYTES_PER_TOKEN = 131072
"""Llama-3-8B in fp16: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes."""

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_capacity(text: str, unique_blocks: int, block_bytes: int) -> int:
    """Blocks for ``10%`` (of the trace's unique blocks), ``2GiB`` (bytes) or ``0``."""
    s = text.strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%|[kmgt]i?b|b|blocks)?", s)
    if m is None:
        raise InvalidArgument(f"capacity {text!r}: use a share like 10% or bytes like 2GiB")
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit == "%":
        return int(unique_blocks * value / 100.0)
    if unit == "blocks":
        return int(value)
    if value == 0:
        return 0
    return int(value * _UNITS[unit]) // block_bytes


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay: policy, tier capacities (blocks) and devices, compute model."""

    policy: str = "lru"
    """Eviction policy by registered name."""
    dram_blocks: int = 0
    """DRAM tier capacity in blocks (0: no DRAM tier)."""
    disk_blocks: int = 0
    """Disk tier capacity in blocks (0: no disk tier)."""
    dram_device: str = "dram"
    """Timing model of the first tier (dram, cxl)."""
    disk_device: str = "nvme"
    """Timing model of the second tier (nvme, rdma, tcp, cxl)."""
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    """KV bytes per token of the modelled model."""
    compute: ComputeModel = field(default_factory=ComputeModel)
    """Prefill and decode speed."""
    timing: bool = True
    """Run the discrete-event timing simulation (off: policy-only)."""
    class_hints: bool = True
    """Pass object classes to class-aware policies."""
    tenant_shares: str = ""
    """Quotas between the trace's tenants (``equal`` or ``name=fraction,...``,
    :mod:`kvlife.replay.tenants`); empty: one budget per tier."""
    planner: bool = False
    """Time the run a second time with the load-or-recompute planner (the cache
    decisions are the same; ``report["planner"]`` has its TTFT beside the first's)."""
    disk_model: str = "bandwidth"
    """How the disk tier is timed: ``bandwidth`` (``disk_device``'s model of the bytes)
    or ``ftl`` (per block through the page-level FTL with GC, :mod:`kvlife.replay.ftl_disk`;
    ``report["disk_ftl"]`` has its WAF, GC and reads under GC)."""
    disk_drives: int = 1
    """FTL: NVMe drives the disk tier is striped over."""
    disk_op: float = 0.07
    """FTL: over-provisioning of the drives (physical / logical - 1)."""

    def __post_init__(self) -> None:
        if self.disk_model not in DISK_MODELS:
            raise InvalidArgument(
                f"disk model {self.disk_model!r}; known: {', '.join(DISK_MODELS)}"
            )
        if self.disk_model == "ftl":
            if self.disk_device != "nvme":
                raise InvalidArgument(
                    f"the FTL models an SSD: disk device must be nvme, not {self.disk_device!r}"
                )
            if self.planner:
                raise InvalidArgument("the planner is timed with the bandwidth disk model")
            if self.disk_drives < 1 or not 0 < self.disk_op < 1:
                raise InvalidArgument("the FTL disk needs drives >= 1 and 0 < op < 1")


def _quotas(sim: CacheSim, trace: Trace, cfg: ReplayConfig) -> dict[str, TenantShares[object, str]]:
    """Each tier's TenantShares when the replay has quotas (they replace the tiers'
    policies before the run)."""
    if not cfg.tenant_shares:
        return {}
    from kvlife.replay.tenants import block_owners, parse_tenant_shares, shares_policy

    fractions = parse_tenant_shares(cfg.tenant_shares, trace)
    owners = block_owners(trace)
    out = {
        tier: shares_policy(cfg.policy, cap, fractions, owners) for tier, cap in sim.caps.items()
    }
    sim.policies.update(out)
    return out


def replay(
    trace: Trace,
    cfg: ReplayConfig,
    *,
    sink: EventSink | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` and return the report dictionary (JSON-ready)."""
    block_bytes = cfg.kv_bytes_per_token * trace.block_tokens
    t0 = time.perf_counter()
    ftl = cfg.timing and cfg.disk_blocks > 0 and cfg.disk_model == "ftl"
    # the FTL needs each request's disk blocks: cut from the replay's events
    recorder = OpsRecorder(tee=sink) if ftl else None
    sim = CacheSim(
        cfg.policy,
        cfg.dram_blocks,
        cfg.disk_blocks,
        sink=recorder or sink,
        block_bytes=block_bytes,
        track_lifespans=cfg.timing,
        class_hints=cfg.class_hints,
    )
    quotas = _quotas(sim, trace, cfg)
    run = sim.run(trace, progress)
    t_cache = time.perf_counter() - t0
    report = summarise(trace, cfg, run, block_bytes)
    if quotas:
        report["tenant_shares"] = {tier: p.figures() for tier, p in quotas.items()}
    if cfg.timing:
        devices = {}
        if cfg.dram_blocks:
            devices[DRAM] = make_device(cfg.dram_device, DRAM)
        disk = None
        if recorder is not None:
            tier = SSDTier(
                SSDTierConfig(capacity_bytes=cfg.disk_blocks * block_bytes, op=cfg.disk_op),
                block_bytes,
                drives=cfg.disk_drives,
            )
            disk = FTLDisk(tier, split_requests(recorder.rows, run), block_bytes)
            recorder.rows = []
        elif cfg.disk_blocks:
            devices[DISK] = make_device(cfg.disk_device, DISK)
        t1 = time.perf_counter()
        timing = simulate(trace, run, cfg.compute, devices, block_bytes, ftl=disk)
        t_timing = time.perf_counter() - t1
        if disk is not None:
            end = float(np.max(trace.timestamps + timing.ttft)) if trace.n_requests else 0.0
            figures = disk.tier.figures(max(end, 1e-9))
            figures["timing_seconds"] = t_timing
            report["disk_ftl"] = figures
        rows = {
            "prefix": run.prefix_dram + run.prefix_disk,
            "present": run.present,
            "new": run.new,
            "ttft": timing.ttft,
            "tpot": timing.tpot,
        }
        report["ttft_s"] = percentiles(timing.ttft)
        report["tpot_s"] = percentiles(timing.tpot)
        report["queue_s"] = percentiles(timing.queue)
        report["load_s"] = percentiles(timing.load)
        report["tenants"] = per_tenant(trace, rows, block_bytes)
        report["lifespan_s"] = {k: percentiles(v) for k, v in sorted(run.lifespans.items())}
        report["reuse_distance_touches"] = reuse_distances(trace)
        report["timeline"] = _timeline(timing.io, float(trace.timestamps[-1]) + 1.0)
        report["_ttft"] = timing.ttft  # for plots; dropped from JSON
        if cfg.planner:
            report["planner"] = _planned(trace, run, cfg, block_bytes, timing)
    elapsed = time.perf_counter() - t0
    report["speed"] = {
        "seconds": elapsed,
        "cache_seconds": t_cache,
        "block_touches_per_s": ratio(trace.n_touches, elapsed),
    }
    if "disk_ftl" in report:  # the FTL's speed: host writes of mapping units per second
        ftl = report["disk_ftl"]
        report["speed"]["ftl_host_unit_writes_per_s"] = ratio(
            int(ftl["host_unit_writes"]), ftl["timing_seconds"]
        )
    return report


def _planned(
    trace: Trace, run: CacheRun, cfg: ReplayConfig, block_bytes: int, loaded: Timing
) -> dict[str, Any]:
    """The same run timed with the planner on fresh devices, against ``loaded`` (every
    usable prefix read)."""
    devices = {}
    if cfg.dram_blocks:
        devices[DRAM] = make_device(cfg.dram_device, DRAM)
    if cfg.disk_blocks:
        devices[DISK] = make_device(cfg.disk_device, DISK)
    timing = simulate(trace, run, cfg.compute, devices, block_bytes, planner=True)
    with_prefix = int(((run.prefix_dram + run.prefix_disk) > 0).sum())
    return {
        "ttft_s": percentiles(timing.ttft),
        "ttft_s_always_load": percentiles(loaded.ttft),
        "mean_ttft_s": float(timing.ttft.mean()),
        "mean_ttft_s_always_load": float(loaded.ttft.mean()),
        "requests_with_prefix": with_prefix,
        "requests_recomputed": int((timing.declined > 0).sum()),
        "blocks_recomputed": int(timing.declined.sum()),
        "load_s": percentiles(timing.load),
    }


def summarise(trace: Trace, cfg: ReplayConfig, run: CacheRun, block_bytes: int) -> dict[str, Any]:
    touches = trace.n_touches
    prefix = int(run.prefix_dram.sum() + run.prefix_disk.sum())
    tiers: dict[str, Any] = {}
    read = written = 0
    for name, tc in run.tiers.items():
        tiers[name] = {
            "capacity_blocks": cfg.dram_blocks if name == DRAM else cfg.disk_blocks,
            "block_hit_ratio": ratio(tc.block_hits, touches),
            "prefix_hit_ratio": ratio(tc.prefix_hits, touches),
            "bytes_read": tc.reads * block_bytes,
            "bytes_written": tc.inserts * block_bytes,
            "evictions": tc.evictions,
        }
        read += tc.reads * block_bytes
        written += tc.inserts * block_bytes
    cfg_d = asdict(cfg)
    return {
        "trace": trace_summary(trace),
        "config": {**cfg_d, "block_bytes": block_bytes},
        "block_hit_ratio": ratio(int(run.present.sum()), touches),
        "prefix_hit_ratio": ratio(prefix, touches),
        "tiers": tiers,
        "bytes_requested": touches * block_bytes,
        "bytes_loaded": prefix * block_bytes,
        "bytes_stored": int(run.new.sum()) * block_bytes,
        "read_amplification": ratio(read, prefix * block_bytes),
        "write_amplification": ratio(written, int(run.new.sum()) * block_bytes),
        "dropped_blocks": int(run.dropped.sum()),
        "promotions": int(run.promoted.sum()),
        "demotions": int(run.demoted.sum()),
    }


def _timeline(io: dict[str, list[tuple[float, int, int]]], end: float) -> dict[str, Any]:
    """Bytes read and written per tier in 60 bins over the trace."""
    edges = np.linspace(0.0, end, 61)
    out: dict[str, Any] = {"t_s": edges[:-1].tolist()}
    for name, rows in io.items():
        a = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
        r, _ = np.histogram(a[:, 0], edges, weights=a[:, 1])
        w, _ = np.histogram(a[:, 0], edges, weights=a[:, 2])
        out[name] = {"read": r.tolist(), "written": w.tolist()}
    return out


def sweep(
    trace: Trace,
    policies: Sequence[str],
    shares: Sequence[float],
    *,
    tier: str = DRAM,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Policy-only hit ratios of each policy at each capacity (share of unique blocks)."""
    unique = trace.n_unique_blocks()
    curves: dict[str, Any] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for pol in policies:
        pts = []
        for share in shares:
            cap = max(1, int(unique * share))
            run = CacheSim(pol, cap if tier == DRAM else 0, cap if tier == DISK else 0).run(trace)
            pts.append(
                {
                    "share": share,
                    "capacity_blocks": cap,
                    "block_hit_ratio": ratio(int(run.present.sum()), trace.n_touches),
                    "prefix_hit_ratio": ratio(
                        int(run.prefix_dram.sum() + run.prefix_disk.sum()), trace.n_touches
                    ),
                }
            )
            if progress is not None:
                progress(1)
        curves[pol] = pts
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    runs = len(policies) * len(shares)
    return {
        "trace": trace.name,
        "unique_blocks": unique,
        "block_touches": trace.n_touches,
        "ideal_hit_ratio": ratio(trace.n_touches - unique, trace.n_touches),
        "curves": curves,
        "speed": {
            "seconds": elapsed,
            "block_touches_per_s": ratio(trace.n_touches * runs, elapsed),
            "cpu_seconds": cpu,
            "block_touches_per_cpu_s": ratio(trace.n_touches * runs, cpu),
        },
    }
