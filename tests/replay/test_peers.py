"""The sweep's peers, run from their installed code: libCacheSim's algorithms and vLLM's
CPU offloading manager (its LRU and ARC, and its store_threshold admission) on the
sweep's own block sequence; bounded by Belady, and vLLM's admission behaving as vLLM
documents it (a block is stored only once it was offered store_threshold times)."""

from __future__ import annotations

import pytest

from kvlife.core.errors import KVLifeError
from kvlife.interpreters import vllm_python
from kvlife.replay.belady import belady_hits
from kvlife.replay.peers import libcachesim_curves, vllm_offload_curves
from kvlife.trace.model import Trace, TraceBuilder
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace


def _has_vllm() -> bool:
    try:
        vllm_python()
    except KVLifeError:
        return False
    return True


def twice(n: int) -> Trace:
    """n requests of 3 fresh blocks, then the same n again (every block touched twice)."""
    tb = TraceBuilder("twice", 16)
    reqs = [[0, 3 * i + 1, 3 * i + 2] for i in range(n)]
    for i, req in enumerate(reqs + reqs):
        tb.add(float(i), 48, 1, req)
    return tb.build()


def test_libcachesim_curves_are_bounded_by_belady() -> None:
    pytest.importorskip("libcachesim")
    trace = synthetic_trace(SyntheticConfig(seed=3, sessions=20))
    shares = [0.05, 0.3]
    curves, note = libcachesim_curves(trace, shares)
    assert note == "" and set(curves) == {"libcachesim-lru", "libcachesim-arc",
                                         "libcachesim-s3fifo"}  # fmt: skip
    for pts in curves.values():
        for pt in pts:
            best = belady_hits(trace.blocks, pt["capacity_blocks"]) / trace.n_touches
            assert 0 < pt["block_hit_ratio"] <= best


@pytest.mark.skipif(not _has_vllm(), reason="no interpreter with vLLM (KVLIFE_VLLM_PYTHON)")
def test_vllm_offloading_policies_and_store_threshold() -> None:
    trace = twice(40)  # 81 unique blocks; share 1.0 holds them all
    curves, note = vllm_offload_curves(trace, [1.0, 0.1])
    assert note == ""
    assert set(curves) == {"vllm-lru", "vllm-arc", "vllm-lru-store2", "vllm-arc-store2"}
    touches = trace.n_touches
    for name in ("vllm-lru", "vllm-arc"):
        full = curves[name][0]
        # everything fits: every touch after the first of its block hits (block 0 is
        # shared by all requests)
        assert full["block_hit_ratio"] * touches == touches - trace.n_unique_blocks()
        assert full["vllm_version"]
    for name in ("vllm-lru-store2", "vllm-arc-store2"):
        # a fresh block is stored only at its second offer, and none has a third: only
        # block 0 (offered by every request) is ever found
        assert curves[name][0]["block_hit_ratio"] * touches == 2 * 40 - 2
    for pts in curves.values():
        small = pts[1]
        assert small["block_hit_ratio"] * touches <= belady_hits(
            trace.blocks, small["capacity_blocks"]
        )
