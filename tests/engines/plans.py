"""What the planned-prefill tests share: a store on a throttled disk, a cost model seeded
with a tier speed, and a policy that always returns one fixed plan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvlife.faults.throttle import ThrottledDiskOptions
from kvlife.planner import CostModel, Plan, PrefillProfile
from kvlife.planner.plan import make_plan
from kvlife.results import ChunkHit
from kvlife.store import KVStore, StoreConfig, TierSpec

FixedPolicy = Callable[[CostModel, Sequence[ChunkHit], int], Plan]


def throttled_store(path: Path, mb_s: float = 0.0) -> KVStore:
    """A store of one disk tier behind the throttle (``mb_s`` 0: unthrottled until a
    test sets a speed), no promotion, so every load reads the disk."""
    spec = TierSpec(
        "throttled-disk",
        "disk",
        256 << 20,
        options=ThrottledDiskOptions(read_mb_s=mb_s, segment_bytes=16 << 20, direct_io=False),
    )
    return KVStore(path, StoreConfig(tiers=(spec,), promote_on_hit=False))


def seeded_model(tokens_per_chunk: int, spb: float = 1e-9) -> CostModel:
    """A cost model with a fixed prefill profile and the disk's seconds per byte."""
    m = CostModel(PrefillProfile(0.0, 1e-4, 1e-9), tokens_per_chunk)
    m.tier("disk").per_byte.seed(spb)
    return m


def fixed(front: int, stop: int) -> FixedPolicy:
    """A policy that always plans chunks ``[0, front)`` computed and ``[front, stop)``
    loaded."""

    def policy(model: CostModel, hits: Sequence[ChunkHit], n: int) -> Plan:
        return make_plan(model, hits, n, front, stop)

    return policy
