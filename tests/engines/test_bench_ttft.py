"""`kvlife bench ttft` runs on a tiny model and writes JSON of the documented shape."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvlife.bench.ttft import main


def test_bench_ttft_json_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ttft.json"
    assert (
        main(
            ["--tiny", "--prefixes", "64,128", "--repeat", "1", "--no-progress", "--json", str(out)]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert [r["prefix_tokens"] for r in data["rows"]] == [64, 128]
    for row in data["rows"]:
        for key in (
            "full_prefill_ttft_s",
            "dram_hit_ttft_s",
            "disk_hit_ttft_s",
            "dram_ideal_s",
            "disk_ideal_s",
            "dram_vs_ideal",
            "disk_vs_ideal",
        ):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert row["prefix_bytes"] == row["prefix_tokens"] * data["bytes_per_token"]
    assert data["targets"] == []  # no prefix >= 1024 in this run
    assert not list(tmp_path.glob(".kvlife-bench-ttft-*")), "scratch directory left behind"
