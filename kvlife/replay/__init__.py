"""kvlife.replay: replay request traces through the store's own index and policy code.

- :mod:`kvlife.replay.cache`: the cache model (tiers as policy-ordered key sets, exactly
  the decisions :class:`kvlife.store.KVStore` takes per request).
- :mod:`kvlife.replay.engine`: the discrete-event simulation (compute model, tier timing
  through :mod:`kvlife.sim` device models) on a virtual clock.
- :mod:`kvlife.replay.ops`: a cache replay's per-request device operations (block keys),
  cut from its lifecycle events.
- :mod:`kvlife.replay.ftl_disk`: the disk tier timed per block through the page-level
  FTL (:mod:`kvlife.sim.ssd_tier`), for ``kvlife replay --disk-model ftl`` and
  ``kvlife report``.
- :mod:`kvlife.replay.metrics`: hit ratios, TTFT/TPOT, bytes, amplification, lifespans,
  reuse distances, overall and per tenant.
- :mod:`kvlife.replay.live`: the same trace against a real ``KVStore``.
- :mod:`kvlife.replay.report`, :mod:`kvlife.replay.cli`: tables, JSON, HTML with plots.
"""
