"""``kvlife replay --tenant-shares``: the simulator enforces the quotas the store does
(the same TenantShares policy), tenants taken from the trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.replay.runner import ReplayConfig, replay
from kvlife.replay.tenants import block_owners, parse_tenant_shares
from kvlife.trace.model import Trace, TraceBuilder

ROOT = Path(__file__).resolve().parents[2]


def _burst() -> Trace:
    """b puts four blocks, a bursts through twenty of its own, b asks for its four."""
    t = TraceBuilder("burst", 16)
    t.add(0.0, 64, 1, [101, 102, 103, 104], tenant="b")
    for i in range(5):
        t.add(1.0 + i, 64, 1, [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4], tenant="a")
    t.add(9.0, 64, 1, [101, 102, 103, 104], tenant="b")
    return t.build()


def test_equal_shares_keep_b_through_as_burst_and_count_evictions() -> None:
    trace = _burst()
    plain = replay(trace, ReplayConfig(dram_blocks=8, timing=False))
    shared = replay(trace, ReplayConfig(dram_blocks=8, timing=False, tenant_shares="equal"))
    assert plain["prefix_hit_ratio"] == 0.0  # a's burst took b's blocks
    assert shared["prefix_hit_ratio"] == pytest.approx(4 / trace.n_touches)
    figures = shared["tenant_shares"]["dram"]
    assert figures["b"]["evicted"] == 0 and figures["a"]["evicted"] == 16
    assert figures["a"]["share"] == figures["b"]["share"] == 4
    assert "tenant_shares" not in plain


def test_owners_and_the_spec() -> None:
    trace = _burst()
    owners = block_owners(trace)
    assert owners[101] == "b" and owners[1] == "a"
    assert parse_tenant_shares("a=0.25,b=0.5", trace) == {"a": 0.25, "b": 0.5}
    for bad in ("a=2", "a", "a=0.7,b=0.7", "a=x"):
        with pytest.raises(InvalidArgument):
            parse_tenant_shares(bad, trace)


def test_the_replay_command_takes_tenant_shares(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "replay", "--max-requests", "200", "--dram",
         "5%", "--tenant-shares", "equal", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    tiers = report["tenant_shares"]
    assert set(tiers) == {"dram"} and len(tiers["dram"]) >= 2
    assert all(set(f) == {"share", "used", "keys", "evicted"} for f in tiers["dram"].values())


def test_replay_derives_tenants_for_a_trace_without_them(tmp_path: Path) -> None:
    """Two conversations (each request extends the last) with two heads: two users, two
    organisations, and equal shares between them."""
    lines = []
    for i in range(6):
        conv = i % 2
        head = [0, 10 + conv]
        body = [100 * (conv + 1) + j for j in range(i // 2 + 1)]
        lines.append({"timestamp": i, "input_length": 1024, "output_length": 1,
                      "hash_ids": head + body})  # fmt: skip
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.json"
    subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "replay", "--trace", str(trace_file), "--dram",
         "50%", "--derive-tenants", "user", "--tenant-shares", "equal", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert set(report["tenant_shares"]["dram"]) == {"user0", "user1"}
