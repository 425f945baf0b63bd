"""The SSD benchmark runs on a tiny configuration and writes the documented JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

from kvlife.sim.bench_ssd import main


def test_bench_runs_tiny_and_writes_json(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"page_writes_per_s", "host_page_writes_per_s", "validation", "speed"} <= set(d)
    assert d["page_writes_per_s"] > 0
    ops = [row["op"] for row in d["validation"]]
    assert ops == [0.07, 0.125, 0.2, 0.28, 0.5, 0.3]
    for row in d["validation"]:
        assert {"closed_form_waf", "simulated_waf", "error_pct"} <= set(row)
        assert row["simulated_waf"] >= 1.0
