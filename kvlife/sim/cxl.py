"""CXL device models: a DRAM expander and a CXL-attached SSD with a device DRAM cache.

Why: CXL memory is pitched as a KV-cache tier between host DRAM and NVMe, but the two
kinds behave very differently. A CXL DRAM expander is plain memory a NUMA hop or two
away (about 2-3x local DRAM latency, a fraction of its bandwidth). A CXL-SSD answers
loads from its internal DRAM cache in well under a microsecond and from NAND in tens of
microseconds, so its latency is bimodal and depends on the working set: exactly the
property a KV-cache placement policy has to see. Both are
:class:`~kvlife.sim.device.DeviceModel` implementations on a virtual clock. Parameter
sources are listed in docs/sim.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from kvlife.sim.device import (
    DeviceModel,
    DeviceStats,
    FcfsServer,
    MemoryConfig,
    MemoryDevice,
    check_positive,
)
from kvlife.sim.errors import DeviceConfigError


@dataclass(frozen=True, slots=True)
class CXLDramConfig:
    """A CXL Type-3 DRAM expander card behind one CXL link."""

    latency_s: float = 250e-9
    """Idle load latency (about 2.5x local DDR5's 100 ns; measured cards span 2x-5x)."""
    bandwidth_bytes_per_s: float = 26e9
    """Sustained bandwidth of a PCIe 5.0 x8 CXL link (32 GB/s raw per direction, derated)."""

    def __post_init__(self) -> None:
        check_positive("CXLDramConfig", "latency_s", self.latency_s)
        check_positive("CXLDramConfig", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)


class CXLDramExpander(MemoryDevice):
    """CXL DRAM expander: local-DRAM behaviour with higher latency and lower bandwidth."""

    def __init__(self, config: CXLDramConfig | None = None, name: str = "cxl-dram") -> None:
        self.cxl_config = config or CXLDramConfig()
        super().__init__(
            MemoryConfig(
                latency_s=self.cxl_config.latency_s,
                bandwidth_bytes_per_s=self.cxl_config.bandwidth_bytes_per_s,
            ),
            name,
        )


@dataclass(frozen=True, slots=True)
class CXLSSDConfig:
    """A CXL-attached SSD (memory-semantic SSD) with an internal DRAM cache in front of NAND."""

    cache_bytes: int = 1 << 30
    """Capacity of the device's DRAM cache (bytes)."""
    cache_page_bytes: int = 4096
    """Granularity of the DRAM cache and of NAND reads (bytes)."""
    hit_latency_s: float = 600e-9
    """Load latency when the data is in the device DRAM (CXL link + controller + DRAM)."""
    flash_read_s: float = 25e-6
    """NAND read of one cache page on a miss, added to the hit path (tR of fast NAND)."""
    flash_program_s: float = 200e-6
    """NAND program of one dirty page written back on eviction (occupies a flash unit)."""
    flash_units: int = 16
    """Independent NAND units (dies) serving misses and write-backs in parallel."""
    link_bandwidth_bytes_per_s: float = 26e9
    """Sustained CXL link bandwidth (PCIe 5.0 x8, derated)."""

    def __post_init__(self) -> None:
        for name in ("cache_bytes", "cache_page_bytes", "flash_units"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DeviceConfigError(f"CXLSSDConfig.{name} must be an integer >= 1, got {v!r}")
        if self.cache_page_bytes > self.cache_bytes:
            raise DeviceConfigError(
                f"CXLSSDConfig: cache_page_bytes={self.cache_page_bytes} is larger than "
                f"cache_bytes={self.cache_bytes}"
            )
        check_positive("CXLSSDConfig", "hit_latency_s", self.hit_latency_s)
        check_positive("CXLSSDConfig", "flash_read_s", self.flash_read_s)
        check_positive("CXLSSDConfig", "flash_program_s", self.flash_program_s)
        check_positive(
            "CXLSSDConfig", "link_bandwidth_bytes_per_s", self.link_bandwidth_bytes_per_s
        )

    @property
    def cache_pages(self) -> int:
        return self.cache_bytes // self.cache_page_bytes


@dataclass(frozen=True, slots=True)
class CXLSSDStats(DeviceStats):
    """Statistics of a :class:`CXLSSD`: the common ones plus its cache behaviour."""

    cache_hits: int
    """Page reads served from the device DRAM."""
    cache_misses: int
    """Page reads that went to NAND."""
    unmapped_page_reads: int
    """Page reads of data never written (served without NAND)."""
    writebacks: int
    """Dirty pages programmed to NAND on eviction."""

    @property
    def hit_ratio(self) -> float:
        n = self.cache_hits + self.cache_misses
        return math.nan if n == 0 else self.cache_hits / n


class CXLSSD(DeviceModel[CXLSSDStats]):
    """CXL-SSD: LRU write-back DRAM cache over NAND, bimodal read latency.

    A read of ``nbytes`` of a key touches the key's cache pages ``0 .. n-1``. Cached pages
    are ready at once; each missing page is read from its NAND unit (a FCFS server chosen
    by ``(key, page)``) and then cached. The request completes when its last page is ready,
    its bytes have crossed the link, plus the hit latency. Writes go to the cache (dirty)
    and complete at DRAM speed; dirty pages evicted later are programmed to NAND in the
    background, occupying a unit, so heavy writing slows later misses. ``trim`` drops a
    key's pages without writing them back.
    """

    def __init__(self, config: CXLSSDConfig | None = None, name: str = "cxl-ssd") -> None:
        super().__init__(name)
        self.config = config or CXLSSDConfig()
        self._cache: OrderedDict[tuple[int, int], bool] = OrderedDict()
        """(key, page) -> dirty; most recently used last."""
        self._stored: dict[int, int] = {}
        """key -> pages written (present in the cache or on NAND)."""
        self._units = [FcfsServer() for _ in range(self.config.flash_units)]
        self._link = FcfsServer()
        self._hits = 0
        self._misses = 0
        self._unmapped = 0
        self._writebacks = 0

    def _pages(self, nbytes: int) -> int:
        return -(-nbytes // self.config.cache_page_bytes)

    def _unit(self, key: int, page: int) -> FcfsServer:
        return self._units[(key * 1_000_003 + page) % len(self._units)]

    def _insert(self, t: float, key: int, page: int, dirty: bool) -> None:
        slot = (key, page)
        if slot in self._cache:
            self._cache[slot] = self._cache[slot] or dirty
            self._cache.move_to_end(slot)
            return
        self._cache[slot] = dirty
        while len(self._cache) > self.config.cache_pages:
            (ekey, epage), edirty = self._cache.popitem(last=False)
            if edirty:
                self._writebacks += 1
                self._unit(ekey, epage).serve(t, self.config.flash_program_s)

    def read(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        stored = self._stored.get(key, 0)
        ready = t_now
        for page in range(self._pages(nbytes)):
            slot = (key, page)
            if slot in self._cache:
                self._hits += 1
                self._cache.move_to_end(slot)
            elif page < stored:
                self._misses += 1
                _, end = self._unit(key, page).serve(t_now, self.config.flash_read_s)
                ready = max(ready, end)
                self._insert(t_now, key, page, dirty=False)
            else:
                self._unmapped += 1
        _, end = self._link.serve(ready, nbytes / self.config.link_bandwidth_bytes_per_s)
        return self._record_read(t_now, nbytes, end + self.config.hit_latency_s)

    def write(self, t_now: float, nbytes: int, key: int) -> float:
        self._admit(t_now, nbytes)
        n = self._pages(nbytes)
        old = self._stored.get(key, 0)
        for page in range(n, old):
            self._cache.pop((key, page), None)
        if n:
            self._stored[key] = n
        else:
            self._stored.pop(key, None)
        _, end = self._link.serve(t_now, nbytes / self.config.link_bandwidth_bytes_per_s)
        for page in range(n):
            self._insert(t_now, key, page, dirty=True)
        return self._record_write(t_now, nbytes, end + self.config.hit_latency_s)

    def trim(self, key: int) -> None:
        self._trims += 1
        for page in range(self._stored.pop(key, 0)):
            self._cache.pop((key, page), None)

    def stats(self) -> CXLSSDStats:
        return self._stats_as(
            CXLSSDStats,
            cache_hits=self._hits,
            cache_misses=self._misses,
            unmapped_page_reads=self._unmapped,
            writebacks=self._writebacks,
        )


__all__ = [
    "CXLSSD",
    "CXLDramConfig",
    "CXLDramExpander",
    "CXLSSDConfig",
    "CXLSSDStats",
]
