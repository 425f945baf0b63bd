"""kvlife.sim: device models on a virtual clock, and experiments that replay KV traffic on them.

Why: KV-cache backends are usually judged by a bandwidth number, but SSD garbage
collection, CXL hit/miss bimodality and network queueing decide what a KV tier really
costs. These models answer "when does this read/write finish" on a virtual clock, with no
real I/O, so a replay engine can put any of them behind a tier.

Modules (imported on demand; the FTL kernels compile with numba on first use):

- :mod:`kvlife.sim.device`: the common :class:`~kvlife.sim.device.DeviceModel` interface,
  latency summaries, and local DRAM.
- :mod:`kvlife.sim.ssd`: page-mapped FTL with greedy / cost-benefit GC, TRIM, write streams
  (FDP reclaim-unit handles) and NAND timing; ``Ftl`` (logical pages) and ``SSDModel`` (keys).
- :mod:`kvlife.sim.ftl_kernels`: the numba kernels behind ``Ftl``.
- :mod:`kvlife.sim.ssd_tier`: ``SSDModel`` drives sized and mapped for a KV tier of
  large objects, with GC windows and reads under GC (``kvlife replay --disk-model ftl``,
  ``kvlife report``).
- :mod:`kvlife.sim.cxl`: CXL DRAM expander and CXL-SSD with a device DRAM cache.
- :mod:`kvlife.sim.network`: network link with bandwidth, RTT, per-message overhead, queueing.
- :mod:`kvlife.sim.kvstream`: synthetic and Mooncake-trace KV write/read/delete streams.
- :mod:`kvlife.sim.lifetime_hints`: the "do KV lifetimes predict SSD WAF?" experiment.
- :mod:`kvlife.sim.validation`, :mod:`kvlife.sim.bench_ssd`: Desnoyers validation, benchmark.
- :mod:`kvlife.sim.errors`: typed errors.
"""
