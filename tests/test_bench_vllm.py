"""``kvlife bench vllm --quick`` runs four real vLLM engines (children in .venv-vllm,
which ``make test`` builds) and writes JSON of the documented shape. Never a speed check:
``--jobs 3`` runs the three engines that do not share a store at once (the disk run still
after the DRAM run whose store it reopens), which takes the wall time of about two
engines instead of four."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.bench.vllm import PHASES
from kvlife.bench.vllm_trace import ENGINE_THREADS
from kvlife.interpreters import ROOT

pytestmark = [
    pytest.mark.skipif(
        not (ROOT / ".venv-vllm" / "bin" / "python").exists(),
        reason="needs .venv-vllm (make test builds it before running the suite)",
    ),
    # about two minutes (four engines on two vCPUs): in `make test-slow`, so that the
    # default suite stays under 15 minutes; tests/vllm runs real engines in the default one
    pytest.mark.slow,
]


def test_bench_vllm_quick_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "bench-vllm.json"
    cmd = ["bench", "vllm", "--quick", "--jobs", "3", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "kvlife.cli", *cmd],
        cwd=tmp_path,
        # the engines' thread settings left to the benchmark (ENGINE_THREADS)
        env={k: v for k, v in os.environ.items() if k not in ENGINE_THREADS}
        | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["identical_outputs"] is True
    assert set(data["total_ttft_s"]) == set(PHASES) == set(data["ratio_vs_vllm_apc"])
    assert set(data["total_ttft_after_first_s"]) == set(PHASES)
    assert set(data["ratio_vs_vllm_apc_after_first"]) == set(PHASES)
    # the connector's time in the engine's thread, per request of each kvlife run
    spent = data["turns"][0]["connector_s"]["kvlife dram"]
    assert set(spent) == {"lookup_s", "wait_s", "gather_s", "stage_s", "load_s", "path_s"}
    assert spent["gather_s"] > 0  # the first turn's prompt is saved: a miss is not free
    assert len(data["turns"]) == 2
    assert data["settings"]["jobs"] == 3
    second = data["turns"][1]
    assert set(second["ttft_s"]) == set(PHASES)
    assert second["cached_tokens"]["vllm"] == 0  # no reuse at all without a cache
    assert second["cached_tokens"]["kvlife dram"] > 0  # the system prompt, from kvlife
    assert second["kvlife_chunks"]["kvlife dram"].get("dram", 0) > 0
    assert data["turns"][0]["kvlife_chunks"]["kvlife disk"].get("disk", 0) > 0
    load = data["connector_load_vs_memcpy"]  # the DRAM run's loads against memcpy
    assert load["ratio"] > 0 and load["bytes"] > 0 and load["memcpy_s"] > 0
    assert load["ratio_vs_warm"] > 0 and load["memcpy_warm_s"] > 0  # the cache-resident copy
    assert (
        data["engine_env"]
        == ENGINE_THREADS
        == {
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
    )
    assert set(load["breakdown_s"]) >= {"lookup_s", "read_s", "scatter_s", "gather_s"}
    assert "tpot_saves_on_vs_off" in data  # None with --quick (no saves-off run)
    assert set(data["tpot_s"]) == set(PHASES)
    assert "greedy outputs of every run are identical" in proc.stdout
