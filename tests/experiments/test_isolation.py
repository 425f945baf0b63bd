"""``kvlife experiment isolation``: its statistics, and the command (``--quick``) through a
real ``kvlife serve --tenants``: B never hits what A stored, the positive control and the
token-hash baseline do (timing figures are the benchmark's, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvlife.experiments.isolation import auc, bootstrap

ROOT = Path(__file__).resolve().parents[2]


def test_auc_is_the_mann_whitney_statistic() -> None:
    assert auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert auc(np.array([1.0, 2.0]), np.array([3.0, 4.0])) == 0.0
    assert auc(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.5  # ties count half
    rng = np.random.default_rng(0)
    same = rng.normal(size=400), rng.normal(size=400)
    lo, hi = bootstrap(*same, seed=1, n=300)
    assert lo < 0.5 < hi and hi - lo < 0.15


def test_the_command_runs_the_three_probes(tmp_path: Path) -> None:
    out, png = tmp_path / "i.json", tmp_path / "i.png"
    subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "experiment", "isolation", "--quick",
         "--chunks", "2", "--json", str(out), "--plot", str(png)],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    cross, control, baseline = result["probes"]
    assert cross["trials_per_arm"] == [30, 30]
    assert cross["hits_in_stored_arm"] == 0  # B never hits A's prompt
    assert control["hits_in_stored_arm"] == 30 * 2  # A does, every chunk
    assert baseline["hits_in_stored_arm"] == 30 * 2  # and so does B without tenants
    for p in result["probes"]:
        lo, hi = p["auc_ci95"]
        assert 0.0 <= lo <= p["auc"] <= hi <= 1.0
    assert isinstance(result["cross_tenant_meets_target"], bool)
    assert png.stat().st_size > 0


def test_the_engine_probes_run_through_the_hf_engine(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "experiment", "isolation", "--trials", "3",
         "--engine-trials", "3", "--chunks", "2", "--repeats", "1", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    probes = {p["probe"]: p for p in json.loads(out.read_text())["probes"]}
    cross = probes["cross-tenant, HF engine (prefill)"]
    control = probes["within one tenant, HF engine (positive control)"]
    assert cross["hits_in_stored_arm"] == 0 and cross["direction"] == "stored faster"
    assert control["hits_in_stored_arm"] == 3 * 2  # A's engine reuses A's chunks
