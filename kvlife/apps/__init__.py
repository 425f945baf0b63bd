"""Demos: the SmolLM2 chat (:mod:`.chat`, ``kvlife demo``) and the store-only synthetic
workload (:mod:`.synthetic`, ``kvlife demo --synthetic``)."""
