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

from kvlife.core.errors import InvalidArgument
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
        logical = max(1, self.capacity_bytes // self.unit_bytes)
        # a small (test) drive gets smaller superblocks, so that its spare area still
        # holds every stream's open blocks and the GC reserve (SSDConfig's condition)
        fit = int(logical * self.op / (2 * (1 + 2 * self.streams)))
        ppb = max(1, min(self.superblock_bytes // self.unit_bytes, fit))
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
    """``drives`` identical :class:`SSDModel` drives, with a lifecycle-class hint per write
    and GC windows per drive. A key is written to the drive with the most free space
    and stays there until it is trimmed (objects are ``object_bytes``; each drive holds
    ``ceil(objects / drives)`` of them, so the tier never runs out before the cache)."""

    def __init__(
        self, cfg: SSDTierConfig, object_bytes: int, drives: int = 1, name: str = "ssd"
    ) -> None:
        if drives < 1 or object_bytes < 1:
            raise InvalidArgument("an SSD tier needs drives >= 1 and objects >= 1 byte")
        self.cfg = cfg
        per_drive = -(-(cfg.capacity_bytes // object_bytes) // drives) * object_bytes
        per = replace(cfg, capacity_bytes=per_drive)
        self.models = [SSDModel(per.ssd_config(), f"{name}{i}") for i in range(drives)]
        self.n_dies = self.models[0].config.n_dies
        self._drive: dict[int, int] = {}
        self._gc_until = [-1.0] * drives
        self._gc_time = [0.0] * drives
        self.reads_under_gc = LatencyRecorder()
        self.reads_clear = LatencyRecorder()
        self.gc_windows: list[tuple[float, float]] = []

    def write(self, t: float, nbytes: int, key: int, hint: int) -> float:
        d = self._drive.get(key, -1)
        if d < 0:
            free = [m.free_bytes() for m in self.models]
            d = self._drive[key] = free.index(max(free))
        m = self.models[d]
        done = m.write_hinted(t, nbytes, key, hint % self.cfg.streams)
        gc = float(m.ftl.arrays.fctr[fk.FC_GC_DIE_TIME])
        if gc != self._gc_time[d]:  # this write ran GC: its work is booked on the dies
            self._gc_time[d] = gc
            until = float(m.ftl.arrays.busy[: self.n_dies].max())
            self._gc_until[d] = max(self._gc_until[d], until)
            self.gc_windows.append((t, until))
        return done

    def read(self, t: float, nbytes: int, key: int) -> float:
        d = self._drive.get(key, 0)  # a key never written reads unmapped space
        done = self.models[d].read(t, nbytes, key)
        (self.reads_under_gc if t < self._gc_until[d] else self.reads_clear).add(done - t)
        return done

    def trim(self, key: int) -> None:
        d = self._drive.pop(key, -1)
        if d >= 0:
            self.models[d].trim(key)

    def busy_die_seconds(self) -> float:
        """Die-seconds of NAND work (host reads and programs, GC copies and erases)."""
        total = 0.0
        for m in self.models:
            c = m.ftl.counters()
            tm = m.config.nand_timing
            total += c.host_page_reads * tm.read_s + c.host_page_writes * tm.program_s
            total += c.gc_die_time_s
        return total

    def figures(self, span_s: float) -> dict[str, object]:
        """WAF, GC, reads under GC and utilisation over a run of ``span_s`` seconds."""
        stats = [m.stats() for m in self.models]
        host = sum(s.ftl.host_page_writes for s in stats)
        nand = sum(s.ftl.nand_page_writes for s in stats)
        gc_s = sum(s.ftl.gc_time_s for s in stats)
        under = self.reads_under_gc.values()
        clear = self.reads_clear.values()
        both = np.concatenate([under, clear])

        def p(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if a.size else 0.0

        cfg = self.models[0].config
        k = len(self.models)
        dies = self.n_dies * k
        return {
            "drives": k,
            "logical_bytes": cfg.logical_bytes * k,
            "physical_bytes": cfg.physical_pages * cfg.page_bytes * k,
            "op": cfg.effective_op,
            "streams": cfg.n_streams,
            "unit_bytes": cfg.page_bytes,
            "host_unit_writes": host,
            "nand_unit_writes": nand,
            "waf": nand / host if host else 1.0,
            "gc_copies": sum(s.ftl.gc_copies for s in stats),
            "gc_runs": sum(s.ftl.gc_runs for s in stats),
            "erases": sum(s.ftl.erases for s in stats),
            "gc_time_s": gc_s / k,
            "gc_share_of_span": gc_s / k / span_s if span_s > 0 else 0.0,
            "read_p50_s": p(both, 50),
            "read_p99_s": p(both, 99),
            "reads_under_gc": int(under.size),
            "reads_clear": int(clear.size),
            "read_p99_under_gc_s": p(under, 99),
            "read_p99_clear_s": p(clear, 99),
            "write_p99_s": max(s.write_latency.p99_s for s in stats),
            "max_erase_count": max(s.max_erase_count for s in stats),
            "utilisation": self.busy_die_seconds() / (dies * span_s) if span_s else 0.0,
        }
