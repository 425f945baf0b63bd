"""Accuracy of the online reuse predictor (:mod:`kvlife.policy.reuse`) on a trace.

The predictor runs inside ``prefixtree-admit`` during a policy-only replay; each new
block's estimated reuse probability at its first insert is compared with the trace's
future: the block is *reused* if it is touched again later. Precision and recall of
"will be reused" are reported at several thresholds (the policy admits warm at its own,
0.1), with the base rate, so a sweep says how much its admission knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlife.policy.prefixtree import PrefixTreePolicy
from kvlife.policy.reuse import CLASS_NAMES
from kvlife.replay.belady import next_use
from kvlife.replay.cache import DRAM, CacheSim
from kvlife.trace.model import Trace

THRESHOLDS = (0.1, 0.3, 0.5)


def predictor_accuracy(
    trace: Trace, share: float = 0.1, thresholds: Sequence[float] = THRESHOLDS
) -> dict[str, Any]:
    """Precision and recall of the reuse predictor of ``prefixtree-admit`` replayed with
    capacity ``share`` of the unique blocks."""
    cap = max(1, int(trace.n_unique_blocks() * share))
    sim = CacheSim("prefixtree-admit", cap)
    pol = sim.policies[DRAM]
    assert isinstance(pol, PrefixTreePolicy) and pol.predictor is not None
    log: dict[object, float] = {}
    pol.log = log
    sim.run(trace)
    blocks = trace.blocks
    nxt = next_use(blocks)
    # reused: the first touch of the block has a later one
    _, first = np.unique(blocks, return_index=True)
    reused = dict(zip(blocks[first].tolist(), (nxt[first] < blocks.size).tolist(), strict=True))
    keys = list(log)
    truth = np.array([reused[k] for k in keys], dtype=bool)
    prob = np.array([log[k] for k in keys], dtype=np.float64)
    out: dict[str, Any] = {
        "policy": "prefixtree-admit",
        "share": share,
        "blocks": len(keys),
        "base_rate": float(truth.mean()) if keys else 0.0,
        "thresholds": {},
        "class_estimates": pol.predictor.estimates(),
    }
    for th in thresholds:
        pred = prob >= th
        tp = int((pred & truth).sum())
        out["thresholds"][str(th)] = {
            "predicted_reused": int(pred.sum()),
            "precision": tp / int(pred.sum()) if pred.any() else 0.0,
            "recall": tp / int(truth.sum()) if truth.any() else 0.0,
        }
    return out


__all__ = ["CLASS_NAMES", "predictor_accuracy"]
