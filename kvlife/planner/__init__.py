"""The load / decode / recompute planner (issue 22): whether a hit should be loaded
depends on the tier's bandwidth, the replica's decode cost, the chunk's position and the
engine; this package decides it per request from a calibrated cost model.

- :mod:`kvlife.planner.estimate`: robust running estimates (an EWMA guarded by the
  median of recent samples) that the cost model learns with;
- :mod:`kvlife.planner.cost`: the cost model: per tier latency and time per byte learnt
  from observed loads, per transform decode time (the store's ``ChunkHit.decode_seconds``),
  the engine's prefill time as a function of start position and length (a fitted profile),
  and the overlap of a load in layer groups with the prefill behind it;
- :mod:`kvlife.planner.plan`: the typed plans (per chunk: load exact, load and decode,
  recompute; the split point where the engine computes the front while the back loads)
  and the chooser, plus :func:`~kvlife.planner.plan.tokens_to_load`, the seam an engine
  that can only load a prefix (vLLM's connector) asks.

The planner does no I/O: it answers from the model; engines execute its plans and feed
the model what they observe. See ``docs/planner.md``.
"""

from kvlife.planner.cost import CostModel, PrefillProfile, TierCost, layered_seconds
from kvlife.planner.estimate import RobustEstimate
from kvlife.planner.plan import (
    ChunkAction,
    ChunkPlan,
    Plan,
    PlanKind,
    candidates,
    choose,
    compute_only,
    load_only,
    split_only,
    tokens_to_load,
)

__all__ = [
    "ChunkAction",
    "ChunkPlan",
    "CostModel",
    "Plan",
    "PlanKind",
    "PrefillProfile",
    "RobustEstimate",
    "TierCost",
    "candidates",
    "choose",
    "compute_only",
    "layered_seconds",
    "load_only",
    "split_only",
    "tokens_to_load",
]
