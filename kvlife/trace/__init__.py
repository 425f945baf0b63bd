"""kvlife.trace: lifecycle-event schema, event files (JSON lines, Parquet), request traces.

- :mod:`kvlife.trace.schema`: schema v1 of :class:`~kvlife.core.events.LifecycleEvent`
  (the JSON Schema file ships as package data) and validation.
- :mod:`kvlife.trace.events_io`: readers and writers of event files (JSON lines, Parquet).
- :mod:`kvlife.trace.model`: :class:`~kvlife.trace.model.Trace`, requests as flat arrays.
- :mod:`kvlife.trace.importers`: Mooncake, Azure LLM and Alibaba bailian importers.
- :mod:`kvlife.trace.synthetic`: seeded chat, RAG, agent and reasoning workloads.
"""
