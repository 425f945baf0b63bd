"""SSD model: a page-mapped FTL with garbage collection, TRIM, write streams (FDP) and timing.

Why: KV-cache offload treats an SSD as a bandwidth number, but KV objects die at very
different ages (a shared system prompt lives for hours, a one-off prompt for seconds), and
an SSD that mixes them in one erase block pays for it in garbage collection: write
amplification (WAF), wear, and read tails while GC occupies the dies. This module lets a
KV workload be replayed against such a device.

Three layers:

- :class:`SSDConfig` (frozen, validated): NAND geometry, over-provisioning, cell type and
  its latencies, channels and dies, write streams, GC policy.
- :class:`Ftl`: the logical-page (LBA) level simulator, a thin class over the numba
  kernels in :mod:`kvlife.sim.ftl_kernels`. Raw workloads (the WAF validation, the
  benchmark, the lifetime-hints experiment) drive it directly. :meth:`Ftl.audit` checks
  every internal invariant and returns the violations it finds.
- :class:`SSDModel`: the :class:`~kvlife.sim.device.DeviceModel` a replay engine uses.
  It keeps a key -> logical-pages map (like a key-value store on a block device) and
  TRIMs an object's pages when the object is deleted. It accepts placement hints
  (:class:`~kvlife.sim.device.SupportsWriteHints`): hint ``h`` selects write stream /
  FDP reclaim-unit handle ``h``.

Over-provisioning follows the convention of Desnoyers' analysis: ``op`` is
``physical / logical - 1``, so ``op=0.07`` gives ``physical = 1.07 x logical``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np
from numpy.typing import NDArray

from kvlife.sim import ftl_kernels as fk
from kvlife.sim.device import DeviceModel, DeviceStats, LatencyStats, SupportsWriteHints
from kvlife.sim.errors import (
    DeviceConfigError,
    DeviceFullError,
    RequestError,
    UnknownCellTypeError,
)

_MAX_PAGES = 2**31 - 1  # the maps are int32


class CellType(Enum):
    """NAND cell type (bits per cell), which sets the default read/program/erase latencies."""

    SLC = "slc"
    MLC = "mlc"
    TLC = "tlc"
    QLC = "qlc"

    @classmethod
    def from_name(cls, name: str) -> CellType:
        """Parse ``"tlc"`` / ``"TLC"``; anything else raises :class:`UnknownCellTypeError`."""
        if isinstance(name, str):
            for c in cls:
                if c.value == name.strip().lower():
                    return c
        raise UnknownCellTypeError(name, tuple(c.value for c in cls))


class GcPolicy(Enum):
    """How garbage collection picks its victim block."""

    GREEDY = "greedy"
    """Fewest valid pages (what Desnoyers' closed form describes)."""
    COST_BENEFIT = "cost-benefit"
    """Largest (1 - u) * age / (1 + u), Rosenblum and Ousterhout's LFS cleaner."""

    @classmethod
    def from_name(cls, name: str) -> GcPolicy:
        for p in cls:
            if p.value == name.strip().lower():
                return p
        known = ", ".join(p.value for p in cls)
        raise DeviceConfigError(f"unknown GC policy {name!r}; known policies: {known}")


@dataclass(frozen=True, slots=True)
class NandTiming:
    """Latencies of the three NAND array operations (seconds, per page or per block)."""

    read_s: float
    """Page read (array to page register), tR."""
    program_s: float
    """Page program (register to array), tPROG."""
    erase_s: float
    """Block erase, tBERS."""

    def __post_init__(self) -> None:
        for name in ("read_s", "program_s", "erase_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise DeviceConfigError(f"NandTiming.{name} must be a finite number > 0, got {v!r}")


NAND_TIMING: dict[CellType, NandTiming] = {
    # Representative values; docs/sim.md lists the sources and how uncertain each is.
    CellType.SLC: NandTiming(read_s=25e-6, program_s=200e-6, erase_s=1.5e-3),
    CellType.MLC: NandTiming(read_s=50e-6, program_s=600e-6, erase_s=3.0e-3),
    CellType.TLC: NandTiming(read_s=75e-6, program_s=750e-6, erase_s=3.8e-3),
    CellType.QLC: NandTiming(read_s=140e-6, program_s=2.5e-3, erase_s=10e-3),
}
"""Default latencies per cell type."""


def _require_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DeviceConfigError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SSDConfig:
    """Geometry, timing and FTL policy of a simulated SSD."""

    n_blocks: int = 1024
    """Physical erase blocks (each a superblock striped across all dies)."""
    op: float = 0.07
    """Over-provisioning, ``physical / logical - 1`` (0.07 means physical = 1.07 x logical)."""
    page_bytes: int = 16384
    """NAND page size, the FTL's mapping unit (bytes)."""
    block_bytes: int = 256 * 16384
    """Erase-block size (bytes); a whole number of pages."""
    cell: CellType = CellType.TLC
    """Cell type; sets the default latencies (``NAND_TIMING``)."""
    timing: NandTiming | None = None
    """Latencies overriding the cell type's defaults, or None for the defaults."""
    n_channels: int = 8
    """Flash channels (each a FCFS bus shared by its dies)."""
    dies_per_channel: int = 4
    """Dies per channel (each a FCFS server for reads, programs and erases)."""
    channel_bytes_per_s: float = 1.2e9
    """Channel transfer rate (ONFI 4.x / Toggle 4.0 class, 1200 MT/s x 8 bit)."""
    controller_overhead_s: float = 5e-6
    """Fixed controller time added to every host command (firmware, PCIe, DMA setup)."""
    n_streams: int = 1
    """Write streams / FDP reclaim-unit handles; each has its own open host block and GC block."""
    gc_policy: GcPolicy = GcPolicy.GREEDY
    """Victim selection."""
    gc_reserve_blocks: int = 1
    """GC runs when a stream needs a block and at most this many blocks are free."""
    die_block_pages: int | None = 1024
    """Pages of one real per-die NAND block, or None to charge the full erase time.

    A simulated block is a superblock striped over all dies and is usually much smaller
    than a real one (so that a small simulated device still has many blocks), leaving each
    die only ``pages_per_block / n_dies`` pages of it. Charging a full tBERS per die for so
    few pages would overstate the erase cost of GC per page by that ratio, so the erase
    time is charged pro rata: ``erase_s * min(1, pages per die / die_block_pages)``.
    3D TLC blocks hold on the order of a thousand 16 KiB pages or more.
    """

    def __post_init__(self) -> None:
        _require_int("SSDConfig", "n_blocks", self.n_blocks, 1)
        if not (isinstance(self.op, int | float) and math.isfinite(self.op) and self.op > 0):
            raise DeviceConfigError(
                f"SSDConfig.op (over-provisioning) must be a finite number > 0, got {self.op!r}"
            )
        _require_int("SSDConfig", "page_bytes", self.page_bytes, 1)
        _require_int("SSDConfig", "block_bytes", self.block_bytes, 1)
        if self.page_bytes > self.block_bytes:
            raise DeviceConfigError(
                f"SSDConfig: page_bytes={self.page_bytes} is larger than "
                f"block_bytes={self.block_bytes}; a block holds one or more pages"
            )
        if self.block_bytes % self.page_bytes != 0:
            raise DeviceConfigError(
                f"SSDConfig: block_bytes={self.block_bytes} is not a whole number of "
                f"pages of {self.page_bytes} bytes"
            )
        if not isinstance(self.cell, CellType):
            raise UnknownCellTypeError(self.cell, tuple(c.value for c in CellType))
        if self.timing is not None and not isinstance(self.timing, NandTiming):
            raise DeviceConfigError(f"SSDConfig.timing must be a NandTiming, got {self.timing!r}")
        if not isinstance(self.gc_policy, GcPolicy):
            raise DeviceConfigError(
                f"SSDConfig.gc_policy must be a GcPolicy, got {self.gc_policy!r}"
            )
        _require_int("SSDConfig", "n_channels", self.n_channels, 1)
        _require_int("SSDConfig", "dies_per_channel", self.dies_per_channel, 1)
        _require_int("SSDConfig", "n_streams", self.n_streams, 1)
        _require_int("SSDConfig", "gc_reserve_blocks", self.gc_reserve_blocks, 1)
        for name in ("channel_bytes_per_s",):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise DeviceConfigError(f"SSDConfig.{name} must be a finite number > 0, got {v!r}")
        v = self.controller_overhead_s
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise DeviceConfigError(
                f"SSDConfig.controller_overhead_s must be a finite number >= 0, got {v!r}"
            )
        if self.die_block_pages is not None:
            _require_int("SSDConfig", "die_block_pages", self.die_block_pages, 1)
        if self.physical_pages > _MAX_PAGES:
            raise DeviceConfigError(
                f"SSDConfig: {self.physical_pages} physical pages exceed the model's limit "
                f"of {_MAX_PAGES}; use larger pages or fewer blocks"
            )
        if self.logical_pages < 1:
            raise DeviceConfigError("SSDConfig: the device has no logical page")
        # GC can always make progress only if, with every stream's two open blocks and the
        # reserve set aside, some sealed block still holds an invalid page.
        held = (self.gc_reserve_blocks + 2 * self.n_streams) * self.pages_per_block
        spare = self.physical_pages - self.logical_pages
        if spare <= held:
            raise DeviceConfigError(
                f"SSDConfig: over-provisioning too small: {spare} spare pages "
                f"(op={self.op}, {self.n_blocks} blocks of {self.pages_per_block} pages) "
                f"must exceed the {held} pages held by {self.n_streams} stream(s) x 2 open "
                f"blocks + {self.gc_reserve_blocks} reserve block(s); add blocks or raise op"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_bytes // self.page_bytes

    @property
    def physical_pages(self) -> int:
        return self.n_blocks * self.pages_per_block

    @property
    def logical_pages(self) -> int:
        """User-visible pages: ``floor(physical / (1 + op))``."""
        return int(self.physical_pages / (1.0 + self.op))

    @property
    def logical_bytes(self) -> int:
        return self.logical_pages * self.page_bytes

    @property
    def n_dies(self) -> int:
        return self.n_channels * self.dies_per_channel

    @property
    def nand_timing(self) -> NandTiming:
        return self.timing if self.timing is not None else NAND_TIMING[self.cell]

    @property
    def erase_charge_s(self) -> float:
        """Die time charged for erasing one die's share of a block (see ``die_block_pages``)."""
        t = self.nand_timing.erase_s
        if self.die_block_pages is None:
            return t
        per_die = -(-self.pages_per_block // self.n_dies)
        return t * min(1.0, per_die / self.die_block_pages)

    @property
    def effective_op(self) -> float:
        """``physical / logical - 1`` after rounding logical pages down."""
        return self.physical_pages / self.logical_pages - 1.0

    @staticmethod
    def for_logical_pages(
        logical_pages: int, pages_per_block: int, op: float, page_bytes: int = 16384
    ) -> SSDConfig:
        """The smallest device with at least ``logical_pages`` at over-provisioning ``op``.

        Other fields keep their defaults; change them with ``dataclasses.replace``.
        """
        _require_int("SSDConfig", "logical_pages", logical_pages, 1)
        _require_int("SSDConfig", "pages_per_block", pages_per_block, 1)
        _require_int("SSDConfig", "page_bytes", page_bytes, 1)
        if not (isinstance(op, int | float) and math.isfinite(op) and op > 0):
            raise DeviceConfigError(
                f"SSDConfig.op (over-provisioning) must be a finite number > 0, got {op!r}"
            )
        n_blocks = math.ceil(logical_pages * (1.0 + op) / pages_per_block)
        return SSDConfig(
            n_blocks=n_blocks,
            op=op,
            page_bytes=page_bytes,
            block_bytes=page_bytes * pages_per_block,
        )


@dataclass(frozen=True, slots=True)
class FtlCounters:
    """Counters of an :class:`Ftl`; subtract two snapshots to measure a window."""

    host_page_writes: int
    """Pages written by the host."""
    nand_page_writes: int
    """Pages programmed into NAND (host writes plus GC copies)."""
    gc_copies: int
    """Valid pages relocated by GC."""
    gc_events: int
    """Victim blocks collected (one erase each)."""
    gc_runs: int
    """GC episodes (each collects one or more victims in one go)."""
    erases: int
    """Block erases."""
    trimmed_pages: int
    """Mapped pages deallocated by TRIM."""
    host_page_reads: int
    """Mapped pages read by the host."""
    unmapped_page_reads: int
    """Host page reads of unmapped (never written or trimmed) pages."""
    gc_die_time_s: float
    """Die-seconds spent on GC reads, programs and erases (summed over dies)."""
    n_dies: int
    """Dies of the device (to turn die-seconds into device-seconds)."""

    @property
    def gc_time_s(self) -> float:
        """GC time in device-seconds: die-seconds of GC work / number of dies.

        The time the whole device would be busy doing nothing but GC; comparable across
        runs of the same device, and the share of a run's span it takes is the fraction of
        NAND capacity lost to GC.
        """
        return self.gc_die_time_s / self.n_dies

    @property
    def waf(self) -> float:
        """Write amplification: NAND page writes / host page writes (nan before any write)."""
        if self.host_page_writes == 0:
            return math.nan
        return self.nand_page_writes / self.host_page_writes

    def since(self, earlier: FtlCounters) -> FtlCounters:
        """The counts accumulated between ``earlier`` and this snapshot."""
        return FtlCounters(
            host_page_writes=self.host_page_writes - earlier.host_page_writes,
            nand_page_writes=self.nand_page_writes - earlier.nand_page_writes,
            gc_copies=self.gc_copies - earlier.gc_copies,
            gc_events=self.gc_events - earlier.gc_events,
            gc_runs=self.gc_runs - earlier.gc_runs,
            erases=self.erases - earlier.erases,
            trimmed_pages=self.trimmed_pages - earlier.trimmed_pages,
            host_page_reads=self.host_page_reads - earlier.host_page_reads,
            unmapped_page_reads=self.unmapped_page_reads - earlier.unmapped_page_reads,
            gc_die_time_s=self.gc_die_time_s - earlier.gc_die_time_s,
            n_dies=self.n_dies,
        )


def _as_lpns(lpns: NDArray[np.integer] | list[int], n_lpn: int) -> NDArray[np.int64]:
    arr = np.ascontiguousarray(lpns, dtype=np.int64)
    if arr.ndim != 1:
        raise RequestError(f"logical pages must be a 1-D array, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= n_lpn):
        raise RequestError(
            f"logical page out of range [0, {n_lpn}): min {int(arr.min())}, max {int(arr.max())}"
        )
    return arr


class Ftl:
    """Logical-page level SSD simulator (page-mapped FTL, GC, TRIM, streams, NAND timing).

    All methods take logical page numbers (``0 .. config.logical_pages - 1``). Writes and
    reads return the virtual completion time of the command; the FCFS order is the call
    order (see :mod:`kvlife.sim.device`).
    """

    def __init__(self, config: SSDConfig) -> None:
        self.config = config
        tm = config.nand_timing
        self._st = fk.new_ftl_arrays(
            pages_per_block=config.pages_per_block,
            n_blocks=config.n_blocks,
            logical_pages=config.logical_pages,
            n_streams=config.n_streams,
            gc_policy=fk.GC_GREEDY if config.gc_policy is GcPolicy.GREEDY else fk.GC_COST_BENEFIT,
            gc_reserve=config.gc_reserve_blocks,
            n_dies=config.n_dies,
            n_channels=config.n_channels,
            t_read=tm.read_s,
            t_prog=tm.program_s,
            t_erase=config.erase_charge_s,
            t_xfer=config.page_bytes / config.channel_bytes_per_s,
            t_cmd=config.controller_overhead_s,
        )

    @property
    def arrays(self) -> fk.FtlArrays:
        """The kernel state (for kernels such as :func:`~kvlife.sim.ftl_kernels.replay_objects`)."""
        return self._st

    def check_stream(self, stream: int) -> None:
        """Raise RequestError unless ``stream`` names one of the device's streams."""
        if isinstance(stream, bool) or not isinstance(stream, int | np.integer):
            raise RequestError(f"stream must be an integer, got {stream!r}")
        if not 0 <= stream < self.config.n_streams:
            raise RequestError(
                f"stream {stream} out of range: the device has {self.config.n_streams} stream(s)"
            )

    def write(self, t_now: float, lpns: NDArray[np.integer] | list[int], stream: int = 0) -> float:
        """One write command of the given logical pages on ``stream``."""
        self.check_stream(stream)
        arr = _as_lpns(lpns, self.config.logical_pages)
        return float(fk.write_pages(self._st, arr, int(stream), float(t_now)))

    def read(self, t_now: float, lpns: NDArray[np.integer] | list[int]) -> float:
        """One read command of the given logical pages (unmapped pages cost no NAND time)."""
        arr = _as_lpns(lpns, self.config.logical_pages)
        return float(fk.read_pages(self._st, arr, float(t_now)))

    def trim(self, lpns: NDArray[np.integer] | list[int]) -> None:
        """Deallocate the given logical pages (idempotent)."""
        arr = _as_lpns(lpns, self.config.logical_pages)
        fk.trim_pages(self._st, arr)

    def fill_sequential(self, stream: int = 0, t_now: float = 0.0) -> float:
        """Write every logical page once, in order (the usual preconditioning)."""
        self.check_stream(stream)
        return float(
            fk.write_sequential(self._st, 0, self.config.logical_pages, int(stream), t_now)
        )

    def write_uniform_random(
        self, count: int, seed: int, stream: int = 0, t_now: float = 0.0
    ) -> float:
        """Overwrite ``count`` uniformly random logical pages (seeded), submitted at ``t_now``."""
        self.check_stream(stream)
        if count < 0:
            raise RequestError(f"count must be >= 0, got {count}")
        return float(fk.write_uniform_random(self._st, int(count), int(seed), int(stream), t_now))

    def mapped(self, lpns: NDArray[np.integer] | list[int]) -> NDArray[np.bool_]:
        """Whether each logical page currently maps to a physical page."""
        arr = _as_lpns(lpns, self.config.logical_pages)
        return np.asarray(self._st.l2p[arr] != fk.UNMAPPED)

    def placement(self, lpns: NDArray[np.integer] | list[int]) -> NDArray[np.int64]:
        """Physical block holding each logical page, or -1 where unmapped."""
        arr = _as_lpns(lpns, self.config.logical_pages)
        ppn = self._st.l2p[arr].astype(np.int64)
        return np.where(ppn >= 0, ppn // self.config.pages_per_block, -1)

    def block_stream(self, blocks: NDArray[np.integer] | list[int]) -> NDArray[np.int64]:
        """Stream that owns each block (its last writer since the last erase)."""
        return np.array(self._st.blk[np.asarray(blocks, dtype=np.int64), fk.B_STREAM])

    def counters(self) -> FtlCounters:
        c = self._st.ctr
        f = self._st.fctr
        return FtlCounters(
            host_page_writes=int(c[fk.C_HOST_WRITES]),
            nand_page_writes=int(c[fk.C_NAND_WRITES]),
            gc_copies=int(c[fk.C_GC_COPIES]),
            gc_events=int(c[fk.C_GC_VICTIMS]),
            gc_runs=int(c[fk.C_GC_RUNS]),
            erases=int(c[fk.C_ERASES]),
            trimmed_pages=int(c[fk.C_TRIMS]),
            host_page_reads=int(c[fk.C_HOST_READS]),
            unmapped_page_reads=int(c[fk.C_UNMAPPED_READS]),
            gc_die_time_s=float(f[fk.FC_GC_DIE_TIME]),
            n_dies=self.config.n_dies,
        )

    @property
    def live_pages(self) -> int:
        """Logical pages currently mapped."""
        return int(self._st.ctr[fk.C_LIVE])

    @property
    def free_blocks(self) -> int:
        return int(self._st.ctr[fk.C_FREE_COUNT])

    def erase_counts(self) -> NDArray[np.int64]:
        """Erases per physical block (a copy)."""
        return np.array(self._st.blk[:, fk.B_ERASES])

    def count_unmapped_reads(self, n: int) -> None:
        """Count ``n`` page reads of space no logical page backs (reads past a key's end)."""
        self._st.ctr[fk.C_UNMAPPED_READS] += n

    def audit(self) -> list[str]:
        """Check every FTL invariant; returns a description of each violation (empty if sound).

        Checked: L2P and P2L are inverse on every live page; per-block valid counts match
        the live pages in the block; the live-page counter matches; each sealed block sits
        in exactly the bucket of its valid count and no other block is in a bucket; the
        free ring holds exactly the free blocks, which are empty; no page past an open
        block's write pointer holds data; NAND writes = host writes + GC copies.
        """
        st = self._st
        cfg = self.config
        ppb = cfg.pages_per_block
        problems: list[str] = []
        l2p = st.l2p.astype(np.int64)
        p2l = st.p2l.astype(np.int64)
        mapped = np.flatnonzero(l2p != fk.UNMAPPED)
        back = p2l[l2p[mapped]]
        bad = mapped[back != mapped]
        if bad.size:
            problems.append(
                f"{bad.size} logical pages whose physical page maps elsewhere: {bad[:5]}"
            )
        live_phys = np.flatnonzero(p2l != fk.UNMAPPED)
        if live_phys.size != mapped.size:
            problems.append(
                f"{live_phys.size} live physical pages but {mapped.size} mapped logical pages"
            )
        if np.unique(l2p[mapped]).size != mapped.size:
            problems.append("two logical pages share one physical page")
        if int(st.ctr[fk.C_LIVE]) != mapped.size:
            problems.append(f"live counter {int(st.ctr[fk.C_LIVE])} != {mapped.size} mapped pages")
        valid = np.bincount(live_phys // ppb, minlength=cfg.n_blocks)
        bad_blocks = np.flatnonzero(valid != st.blk[:, fk.B_VALID])
        if bad_blocks.size:
            problems.append(f"valid counts wrong in blocks {bad_blocks[:5]}")
        state = st.blk[:, fk.B_STATE]
        # Buckets: walk every list.
        seen = np.zeros(cfg.n_blocks, dtype=np.int64)
        for v in range(ppb + 1):
            b = int(st.bucket_head[v])
            prev = -1
            steps = 0
            while b >= 0:
                steps += 1
                if steps > cfg.n_blocks:
                    problems.append(f"bucket {v} list has a cycle")
                    break
                seen[b] += 1
                if int(st.blk[b, fk.B_PREV]) != prev:
                    problems.append(f"block {b} has a wrong back link in bucket {v}")
                if state[b] != fk.BS_SEALED:
                    problems.append(f"block {b} in bucket {v} is not sealed (state {state[b]})")
                if int(st.blk[b, fk.B_VALID]) != v:
                    problems.append(
                        f"block {b} with {st.blk[b, fk.B_VALID]} valid is in bucket {v}"
                    )
                prev = b
                b = int(st.blk[b, fk.B_NEXT])
        sealed = state == fk.BS_SEALED
        if np.any(seen[sealed] != 1):
            problems.append("a sealed block is missing from the buckets or listed twice")
        if np.any(seen[~sealed] != 0):
            problems.append("a block that is not sealed sits in a bucket")
        # Free ring.
        head = int(st.ctr[fk.C_FREE_HEAD])
        count = int(st.ctr[fk.C_FREE_COUNT])
        ring = st.free_ring[(head + np.arange(count)) % cfg.n_blocks]
        free = np.flatnonzero(state == fk.BS_FREE)
        if np.unique(ring).size != count or set(ring.tolist()) != set(free.tolist()):
            problems.append(
                f"free ring ({count} entries) does not hold exactly the {free.size} free blocks"
            )
        if free.size and (np.any(valid[free] != 0) or np.any(st.blk[free, fk.B_WPTR] != 0)):
            problems.append("a free block holds data or has a non-zero write pointer")
        # Open blocks: nothing past the write pointer, one open block per (stream, kind).
        for s in range(cfg.n_streams):
            for kind, want in ((fk.K_HOST, fk.BS_OPEN_HOST), (fk.K_GC, fk.BS_OPEN_GC)):
                b = int(st.open_blk[s, kind])
                if b < 0:
                    continue
                if state[b] != want or int(st.blk[b, fk.B_STREAM]) != s:
                    problems.append(f"open block {b} of stream {s} has state {state[b]}")
                wptr = int(st.blk[b, fk.B_WPTR])
                if np.any(p2l[b * ppb + wptr : (b + 1) * ppb] != fk.UNMAPPED):
                    problems.append(f"open block {b} holds data past its write pointer {wptr}")
        n_open = int(np.count_nonzero((state == fk.BS_OPEN_HOST) | (state == fk.BS_OPEN_GC)))
        if n_open != int(np.count_nonzero(st.open_blk >= 0)):
            problems.append("a block is open but no stream owns it")
        if np.any(state == fk.BS_VICTIM):
            problems.append("a victim block was left half collected")
        c = self.counters()
        if c.nand_page_writes != c.host_page_writes + c.gc_copies:
            problems.append(
                f"NAND writes {c.nand_page_writes} != host writes {c.host_page_writes} "
                f"+ GC copies {c.gc_copies}"
            )
        return problems


@dataclass(frozen=True, slots=True)
class SSDStats(DeviceStats):
    """Statistics of an :class:`SSDModel`: the common ones plus FTL counters."""

    ftl: FtlCounters
    """Page-level counters (host and NAND writes, GC, TRIM)."""
    waf: float
    """NAND page writes / host page writes over the device's life (nan before any write)."""
    live_pages: int
    """Logical pages currently mapped."""
    free_blocks: int
    """Erased blocks ready for writing."""
    max_erase_count: int
    """Most erases of any block (wear)."""
    mean_erase_count: float
    """Mean erases per block."""


class SSDModel(DeviceModel[SSDStats], SupportsWriteHints):
    """An SSD as a tier device: objects (keys) on a page-mapped FTL with GC and streams.

    Each key owns a list of logical pages, allocated when it is first written. Writing a
    key again overwrites its pages in place (growing or shrinking the list as needed);
    :meth:`trim` TRIMs its pages and returns them to the free pool. Reading a key that is
    not stored, or beyond its stored size, reads unmapped pages (no NAND time, counted in
    ``unmapped_page_reads``), as reading a deallocated LBA does on a real drive.
    """

    def __init__(self, config: SSDConfig | None = None, name: str = "ssd") -> None:
        super().__init__(name)
        self.config = config or SSDConfig()
        self.ftl = Ftl(self.config)
        n = self.config.logical_pages
        # Free logical pages as a stack; popping from the end hands out low LPNs first.
        self._free = np.arange(n - 1, -1, -1, dtype=np.int64)
        self._free_top = n
        self._extents: dict[int, NDArray[np.int64]] = {}

    @property
    def n_streams(self) -> int:
        return self.config.n_streams

    @property
    def capacity_bytes(self) -> int:
        """Logical capacity (what the host can store at once)."""
        return self.config.logical_bytes

    def free_bytes(self) -> int:
        """Logical bytes not held by any key."""
        return self._free_top * self.config.page_bytes

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.config.page_bytes)

    def stored_bytes(self, key: int) -> int:
        """Bytes of logical space held by ``key`` (0 if not stored)."""
        ext = self._extents.get(key)
        return 0 if ext is None else int(ext.size) * self.config.page_bytes

    def _release(self, lpns: NDArray[np.int64]) -> None:
        if lpns.size == 0:
            return
        self.ftl.trim(lpns)
        self._free[self._free_top : self._free_top + lpns.size] = lpns[::-1]
        self._free_top += int(lpns.size)

    def _allocate(self, key: int, n: int) -> NDArray[np.int64]:
        old = self._extents.get(key)
        have = 0 if old is None else int(old.size)
        if old is not None and n <= have:
            self._release(old[n:])
            ext = old[:n].copy()
        else:
            extra = n - have
            if extra > self._free_top:
                raise DeviceFullError(
                    f"{self.name}: writing key {key} needs {extra} more pages but only "
                    f"{self._free_top} of {self.config.logical_pages} are free; trim first"
                )
            new = self._free[self._free_top - extra : self._free_top][::-1].copy()
            self._free_top -= extra
            ext = new if old is None else np.concatenate([old, new])
        if n == 0:
            self._extents.pop(key, None)
        else:
            self._extents[key] = ext
        return ext

    def write(self, t_now: float, nbytes: int, key: int) -> float:
        return self.write_hinted(t_now, nbytes, key, 0)

    def write_hinted(self, t_now: float, nbytes: int, key: int, hint: int) -> float:
        self._admit(t_now, nbytes)
        self.ftl.check_stream(hint)
        ext = self._allocate(key, self.pages_for(nbytes))
        done = self.ftl.write(t_now, ext, int(hint))
        return self._record_write(t_now, nbytes, done)

    def read(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        n = self.pages_for(nbytes)
        ext = self._extents.get(key)
        lpns = ext[:n] if ext is not None else np.empty(0, dtype=np.int64)
        if n > lpns.size:
            self.ftl.count_unmapped_reads(n - int(lpns.size))
        done = self.ftl.read(t_now, lpns)
        return self._record_read(t_now, nbytes, done)

    def trim(self, key: int) -> None:
        self._trims += 1
        ext = self._extents.pop(key, None)
        if ext is not None:
            self._release(ext)

    def stats(self) -> SSDStats:
        c = self.ftl.counters()
        erases = self.ftl.erase_counts()
        return self._stats_as(
            SSDStats,
            ftl=c,
            waf=c.waf,
            live_pages=self.ftl.live_pages,
            free_blocks=self.ftl.free_blocks,
            max_erase_count=int(erases.max()),
            mean_erase_count=float(erases.mean()),
        )


__all__ = [
    "NAND_TIMING",
    "CellType",
    "Ftl",
    "FtlCounters",
    "GcPolicy",
    "LatencyStats",
    "NandTiming",
    "SSDConfig",
    "SSDModel",
    "SSDStats",
]
