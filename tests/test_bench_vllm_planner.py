"""``kvlife bench vllm --planner --quick`` runs six real vLLM engines (children in
.venv-vllm) over a throttled disk and writes JSON of the documented shape. Never a
speed check; in the slow tier (six engine starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.bench.vllm_planner import POLICIES
from kvlife.interpreters import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ROOT / ".venv-vllm" / "bin" / "python").exists(),
        reason="needs .venv-vllm (make test builds it before running the suite)",
    ),
]


def test_bench_vllm_planner_quick_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    cmd = [sys.executable, "-m", "kvlife.cli", "bench", "vllm", "--planner", "--quick"]
    proc = subprocess.run(
        [*cmd, "--json", str(out)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["identical_outputs"] is True
    assert data["prefill_profile"]["samples"]
    assert [p["bandwidth_mb_s"] for p in data["points"]] == [1.0, 1000.0]
    for point in data["points"]:
        assert set(point["total_ttft_s"]) == set(POLICIES)
        assert len(point["turns"]) == 2
        assert set(point["planner_decisions"]) >= {"planner_loads", "planner_recomputes"}
