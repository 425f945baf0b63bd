"""``kvlife experiment sharing-scope``: the derivation of tenants from a trace's
structure, the scoped replays' invariants, the quota comparison and the command's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvlife.experiments.sharing_scope import (
    IsolatedLRUModel,
    quota_comparison,
    scope_table,
    synthetic_tenants,
)
from kvlife.replay.tenants import derive_tenants
from kvlife.trace.model import TraceBuilder

ROOT = Path(__file__).resolve().parents[2]


def test_a_conversation_is_one_user_and_a_shared_head_one_organisation() -> None:
    t = TraceBuilder("t", 512)
    t.add(0, 1, 1, [0, 1, 2, 3])  # user 0, org (0, 1)
    t.add(1, 1, 1, [0, 1, 2, 9, 10, 11])  # extends all but its last block: user 0
    t.add(2, 1, 1, [0, 1, 5, 6])  # same head, no extension: user 1, same org
    t.add(3, 1, 1, [0, 7, 8])  # another head: user 2, org 1
    t.add(4, 1, 1, [0, 1, 2, 9, 10, 11, 12])  # extends request 1 wholly: user 0
    tenants = derive_tenants(t.build())
    assert tenants.user.tolist() == [0, 0, 1, 2, 0]
    assert tenants.org.tolist() == [0, 0, 0, 1, 0]


def test_scopes_order_hits_and_only_wider_scopes_cross_users() -> None:
    trace, tenants = synthetic_tenants(3, orgs=3, users_per_org=4, conversations=2, turns=4)
    table = scope_table(trace, tenants, (10.0,), 1)  # room for everything
    rows = {r["scope"]: r for r in table["rows"]}
    assert rows["request"]["hit_ratio"] == 0.0
    assert rows["user"]["cross_user_hit_fraction"] == 0.0
    assert rows["organisation"]["cross_org_hit_fraction"] == 0.0
    assert rows["user"]["hit_ratio"] <= rows["organisation"]["hit_ratio"]
    assert rows["organisation"]["hit_ratio"] <= rows["global"]["hit_ratio"]
    assert rows["organisation"]["cross_user_hits"] > 0  # the shared system prompts
    assert rows["global"]["evictions"] == 0


def test_the_isolated_lru_model_evicts_a_salt_over_its_watermark_only() -> None:
    m = IsolatedLRUModel(100, {0: 10, 1: 10})
    m.request(1, [1, 2, 3])  # 3 < 0.8 * 10: kept
    m.request(0, list(range(100, 108)))  # 8 >= 8: 20% of salt 0 goes, last key first
    assert m.evicted == {0: 1} and 107 not in m.where
    assert all(k in m.where for k in (1, 2, 3))
    m2 = IsolatedLRUModel(100, {})
    m2.request(5, [1, 2])  # no quota: everything goes
    assert m2.evicted == {5: 2}


def test_shares_keep_the_other_tenants_through_a_burst() -> None:
    q = quota_comparison(seed=1)
    assert q["kvlife-shares"]["worst_other_tenant_during_burst"] == 1.0
    assert q["lru"]["worst_other_tenant_during_burst"] < 1.0


def test_the_command_writes_json_and_a_plot(tmp_path: Path) -> None:
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1,
                        "hash_ids": [0, 1 + i % 3, 100 + i]}) + "\n"
            for i in range(30)
        )
    )  # fmt: skip
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "experiment", "sharing-scope", "--trace",
         str(trace_file), "--capacities", "0.5", "--json", str(out), "--plot", str(png)],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["scopes"][0]["trace"] == "t.jsonl"
    row = result["scopes"][0]["rows"][0]
    for field in ("hit_ratio", "cross_user_hit_fraction", "bytes_per_tenant", "eviction_skew"):
        assert field in row
    assert "lmcache-isolated-lru (re-implementation)" in result["quotas"]
    assert png.stat().st_size > 0
