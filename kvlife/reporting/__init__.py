"""kvlife.reporting: ``kvlife report``, one run of a real trace and all the metrics.

- :mod:`kvlife.reporting.config`: the configured hierarchy (DRAM, SSD through the FTL
  model, a remote tier through the network model, faults, tenant quotas, compute).
- The SSD tier (:mod:`kvlife.replay.ftl_disk` over :mod:`kvlife.sim.ssd_tier`) and the
  per-request device operations it runs (:mod:`kvlife.replay.ops`) are shared with
  ``kvlife replay --disk-model ftl``.
- :mod:`kvlife.reporting.remote`: a shared remote tier (write-through, LRU capacity).
- :mod:`kvlife.reporting.faults`: seeded simulated faults and their counted outcomes.
- :mod:`kvlife.reporting.host`: one host: cache decisions, device timing, the metrics.
- :mod:`kvlife.reporting.cluster`: many hosts behind a prefix-affinity router and one
  shared tier (RDMA pool, CPU DRAM pool, CXL shared memory, or none).
- :mod:`kvlife.reporting.lifecycle`: the lifecycle distribution of an event stream
  (replayed or from a live store's event log).
- :mod:`kvlife.reporting.html`, :mod:`kvlife.reporting.cli`: the report files and the
  command.
"""
