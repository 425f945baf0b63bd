"""The SSD tier of a report run: :class:`~kvlife.sim.ssd.SSDModel` (page-mapped FTL with
GC, over-provisioning and write streams) sized for a KV tier, plus GC windows.

Why a coarse mapping unit: a KV block of the Mooncake trace is 512 tokens, 64 MiB for an
8B model, i.e. 4,096 NAND pages of 16 KiB; the FTL does ~1.26M page writes per second, so
an hour of trace at 16 KiB pages would take ten minutes. The tier therefore maps in
units of ``unit_bytes`` (1 MiB by default: one unit is 64 NAND pages on one die) and
charges each unit's NAND time as ``pages per unit / planes`` page operations. For
objects much larger than a superblock's share of one die (every KV block here) each die
sees the same work as at 16 KiB pages, so die time, GC copies and WAF are unchanged;
only placement granularity inside an object is coarser (docs/report.md).

A read is *under GC* when it is issued while some die is still busy with work booked
by a garbage-collection episode (GC episodes run inside host writes; after each write
that ran GC, the GC window extends to the latest die busy-until time).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvlife.sim import ftl_kernels as fk
from kvlife.sim.device import LatencyRecorder
from kvlife.sim.ssd import NAND_TIMING, CellType, NandTiming, SSDConfig, SSDModel

NAND_PAGE_BYTES = 16384


@dataclass(frozen=True, slots=True)
class SSDTierConfig:
    """A KV tier on one SSD."""

    capacity_bytes: int
    """Logical capacity the cache may use (the device adds ``op`` on top)."""
    op: float = 0.07
    """Over-provisioning, physical / logical - 1."""
    streams: int = 1
    """FDP reclaim-unit handles / write streams (hints pick one per lifecycle class)."""
    unit_bytes: int = 1 << 20
    """FTL mapping unit (a multiple of 16 KiB NAND pages; see the module docstring)."""
    superblock_bytes: int = 512 << 20
    """Erase unit (superblock striped over all dies)."""
    planes: int = 4
    """Planes per die operated together (multi-plane read and program)."""
    channels: int = 8
    dies_per_channel: int = 4
    cell: str = "tlc"

    def ssd_config(self) -> SSDConfig:
        k = self.unit_bytes // NAND_PAGE_BYTES
        base = NAND_TIMING[CellType.from_name(self.cell)]
        scale = k / self.planes
        timing = NandTiming(
            read_s=base.read_s * scale, program_s=base.program_s * scale, erase_s=base.erase_s
        )
        ppb = self.superblock_bytes // self.unit_bytes
        logical = max(1, self.capacity_bytes // self.unit_bytes)
        cfg = SSDConfig.for_logical_pages(logical, ppb, self.op, page_bytes=self.unit_bytes)
        # a real die block holds 1024 NAND pages; erase time is charged pro rata per die
        return replace(
            cfg,
            cell=CellType.from_name(self.cell),
            timing=timing,
            n_streams=self.streams,
            n_channels=self.channels,
            dies_per_channel=self.dies_per_channel,
            die_block_pages=max(1, 1024 // k),
        )


class SSDTier:
    """An :class:`SSDModel` with a lifecycle-class hint per write and GC windows."""

    def __init__(self, cfg: SSDTierConfig, name: str = "ssd") -> None:
        self.cfg = cfg
        self.model = SSDModel(cfg.ssd_config(), name)
        self.n_dies = self.model.config.n_dies
        self._gc_until = -1.0
        self._gc_time = self.model.ftl.counters().gc_die_time_s
        self.reads_under_gc = LatencyRecorder()
        self.reads_clear = LatencyRecorder()
        self.gc_windows: list[tuple[float, float]] = []

    def write(self, t: float, nbytes: int, key: int, hint: int) -> float:
        done = self.model.write_hinted(t, nbytes, key, hint % self.cfg.streams)
        gc = float(self.model.ftl.arrays.fctr[fk.FC_GC_DIE_TIME])
        if gc != self._gc_time:  # this write ran GC: its work is booked on the dies
            self._gc_time = gc
            until = float(self.model.ftl.arrays.busy[: self.n_dies].max())
            self._gc_until = max(self._gc_until, until)
            self.gc_windows.append((t, until))
        return done

    def read(self, t: float, nbytes: int, key: int) -> float:
        done = self.model.read(t, nbytes, key)
        (self.reads_under_gc if t < self._gc_until else self.reads_clear).add(done - t)
        return done

    def trim(self, key: int) -> None:
        self.model.trim(key)

    def busy_die_seconds(self) -> float:
        """Die-seconds of NAND work (host reads and programs, GC copies and erases)."""
        c = self.model.ftl.counters()
        tm = self.model.config.nand_timing
        host = c.host_page_reads * tm.read_s + c.host_page_writes * tm.program_s
        return float(host + c.gc_die_time_s)

    def figures(self, span_s: float) -> dict[str, object]:
        """WAF, GC, reads under GC and utilisation over a run of ``span_s`` seconds."""
        st = self.model.stats()
        c = st.ftl
        under = self.reads_under_gc.values()
        clear = self.reads_clear.values()
        both = np.concatenate([under, clear])

        def p(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if a.size else 0.0

        cfg = self.model.config
        return {
            "logical_bytes": cfg.logical_bytes,
            "physical_bytes": cfg.physical_pages * cfg.page_bytes,
            "op": cfg.effective_op,
            "streams": cfg.n_streams,
            "unit_bytes": cfg.page_bytes,
            "host_unit_writes": c.host_page_writes,
            "nand_unit_writes": c.nand_page_writes,
            "waf": c.waf if c.host_page_writes else 1.0,
            "gc_copies": c.gc_copies,
            "gc_runs": c.gc_runs,
            "erases": c.erases,
            "gc_time_s": c.gc_time_s,
            "gc_share_of_span": c.gc_time_s / span_s if span_s > 0 else 0.0,
            "read_p50_s": p(both, 50),
            "read_p99_s": p(both, 99),
            "reads_under_gc": int(under.size),
            "read_p99_under_gc_s": p(under, 99),
            "read_p99_clear_s": p(clear, 99),
            "write_p99_s": st.write_latency.p99_s,
            "max_erase_count": st.max_erase_count,
            "utilisation": self.busy_die_seconds() / (self.n_dies * span_s) if span_s else 0.0,
        }
