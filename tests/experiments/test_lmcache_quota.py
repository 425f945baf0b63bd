"""LMCache's own per-``cache_salt`` quotas (IsolatedLRU, QuotaManager, L2 eviction
controller) driven on the burst workload in LMCache's interpreter, beside kvlife's
re-implementation of them: the same prefix hits request by request.

LMCache pins torch, so it lives in a virtualenv of its own (docs/tenants.md); the tests
that run it are skipped when none is found (``$KVLIFE_LMCACHE_PYTHON``, else the venv
docs/tenants.md makes at ``/tmp/peer-lmc``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvlife.experiments import sharing_scope
from kvlife.experiments.sharing_scope import (
    IsolatedLRUModel,
    burst_workload,
    lmcache_quota_hits,
    quota_comparison,
)

_DEFAULT = Path("/tmp/peer-lmc/bin/python")


def _peer() -> str:
    env = os.environ.get("KVLIFE_LMCACHE_PYTHON")
    if env:
        return env
    if _DEFAULT.exists():
        return str(_DEFAULT)
    pytest.skip(
        "no LMCache interpreter: KVLIFE_LMCACHE_PYTHON is not set and /tmp/peer-lmc is not "
        "there (python3 -m venv /tmp/peer-lmc && /tmp/peer-lmc/bin/pip install "
        "torch==2.13.0 lmcache==0.5.6; docs/tenants.md)"
    )


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> str:
    python = _peer()
    monkeypatch.setenv("KVLIFE_LMCACHE_PYTHON", python)
    return python


@pytest.mark.parametrize("seed,tenants", [(0, 4), (1, 3)])
def test_lmcache_and_the_re_implementation_hit_the_same_blocks_request_by_request(
    peer: str, seed: int, tenants: int
) -> None:
    working_set = 40
    trace, _, _ = burst_workload(seed, tenants, working_set)
    capacity = tenants * working_set + working_set // 2
    budget = capacity // tenants
    real, why = lmcache_quota_hits(trace, capacity, {n: budget for n in trace.tenant_names})
    assert real is not None, why
    assert real["policy"] == "IsolatedLRUEvictionPolicy"
    # The quotas did bite (the bursting tenant lost blocks), so agreement means something.
    assert real["evicted"].get("t0", 0) > 0
    model = IsolatedLRUModel(capacity, dict.fromkeys(range(len(trace.tenant_names)), budget))
    blocks, offs, ten = trace.blocks.tolist(), trace.offsets.tolist(), trace.tenants.tolist()
    mine = [model.request(ten[r], blocks[offs[r] : offs[r + 1]]) for r in range(trace.n_requests)]
    assert real["prefix_hits"] == mine
    evicted = {trace.tenant_names[s]: n for s, n in model.evicted.items()}
    assert real["evicted"] == evicted


def test_the_comparison_has_lmcaches_own_arm_when_an_interpreter_is_found(peer: str) -> None:
    q = quota_comparison(seed=0)
    assert q["lmcache_version"] == "0.5.6"
    assert "lmcache_note" not in q
    real = q["lmcache-isolated-lru"]
    model = q["lmcache-isolated-lru (re-implementation)"]
    assert real == model
    assert (
        real["worst_other_tenant_during_burst"]
        < q["kvlife-shares"]["worst_other_tenant_during_burst"]
    )


def test_without_an_interpreter_the_arm_is_left_out_with_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sharing_scope, "lmcache_python", lambda: None)
    q = quota_comparison(seed=0)
    assert "lmcache-isolated-lru" not in q
    assert "lmcache==0.5.6" in q["lmcache_note"]
    assert "KVLIFE_LMCACHE_PYTHON" in q["lmcache_note"]
    assert np.isfinite(q["lmcache-isolated-lru (re-implementation)"]["tenants"]["t0"]["hit_ratio"])
