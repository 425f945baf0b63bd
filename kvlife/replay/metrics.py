"""Metrics of a replay: hit ratios, latency percentiles, bytes and amplification,
lifespans and reuse distances, overall, per tier and per tenant.

Definitions (docs/replay.md):

- *block hit ratio*: blocks present in some tier when their request arrives / block
  touches; *usable-prefix hit ratio*: blocks in the leading run of present blocks (what
  an engine can load instead of recomputing) / block touches; per tier by the tier the
  block is served from (DRAM first).
- *bytes requested*: block touches x block bytes (the KV the requests need);
  *read amplification*: bytes read from all tiers / bytes of usable-prefix hits loaded
  (demotion read-backs make it > 1); *write amplification*: bytes written to all tiers /
  bytes of new blocks stored (demotions and promotions make it > 1).
- *lifespan*: virtual seconds from a block's insertion to its leaving the last tier,
  for evicted blocks, per object class (request category / position bucket);
  *reuse distance*: block touches between two consecutive touches of the same block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvlife.replay.cache import POS_BUCKETS
from kvlife.trace.model import Trace


def trace_summary(trace: Trace) -> dict[str, Any]:
    """The ``trace`` section of a replay's and a report's JSON: name, requests, block
    touches, unique blocks, tokens per block, span (seconds from the first arrival)."""
    return {
        "name": trace.name,
        "requests": trace.n_requests,
        "block_touches": trace.n_touches,
        "unique_blocks": trace.n_unique_blocks(),
        "block_tokens": trace.block_tokens,
        "span_s": float(trace.timestamps[-1]) if trace.n_requests else 0.0,
    }


def percentiles(values: NDArray[np.float64] | list[float]) -> dict[str, float]:
    """count, mean, P50, P90, P99, max (NaNs ignored; zeros when empty)."""
    a = np.asarray(values, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(a, [50.0, 90.0, 99.0])
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


def touch_classes(trace: Trace) -> NDArray[np.int64]:
    """Object class of every block touch: category x 4 + position bucket."""
    lens = np.diff(trace.offsets)
    starts = np.repeat(trace.offsets[:-1], lens)
    pos = np.arange(trace.n_touches, dtype=np.int64) - starts
    bucket = np.where(pos == 0, 0, np.where(pos < 4, 1, np.where(pos < 16, 2, 3)))
    cat = np.repeat(trace.categories.astype(np.int64), lens)
    out: NDArray[np.int64] = cat * 4 + bucket
    return out


def class_name(trace: Trace, cls: int) -> str:
    return f"{trace.category_names[cls // 4]}/{POS_BUCKETS[cls % 4]}"


def reuse_distances(trace: Trace) -> dict[str, dict[str, float]]:
    """Reuse distance (touches since the previous touch of the block), per class."""
    blocks = trace.blocks
    if blocks.size == 0:
        return {}
    order = np.argsort(blocks, kind="stable")
    same = blocks[order][1:] == blocks[order][:-1]
    dist = (order[1:] - order[:-1])[same]
    cls = touch_classes(trace)[order[1:][same]]
    out = {"all": percentiles(dist.astype(np.float64))}
    for c in np.unique(cls):
        out[class_name(trace, int(c))] = percentiles(dist[cls == c].astype(np.float64))
    return out


def ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0


def per_tenant(
    trace: Trace, rows: dict[str, NDArray[Any]], block_bytes: int
) -> dict[str, dict[str, Any]]:
    """Hit ratios, TTFT/TPOT and bytes per tenant from per-request arrays."""
    lens = np.diff(trace.offsets)
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(trace.tenant_names):
        m = trace.tenants == i
        touches = int(lens[m].sum())
        prefix = int(rows["prefix"][m].sum())
        out[name] = {
            "requests": int(m.sum()),
            "block_touches": touches,
            "block_hit_ratio": ratio(int(rows["present"][m].sum()), touches),
            "prefix_hit_ratio": ratio(prefix, touches),
            "bytes_loaded": prefix * block_bytes,
            "bytes_stored": int(rows["new"][m].sum()) * block_bytes,
        }
        if "ttft" in rows:
            out[name]["ttft_s"] = percentiles(rows["ttft"][m])
            out[name]["tpot_s"] = percentiles(rows["tpot"][m])
    return out
