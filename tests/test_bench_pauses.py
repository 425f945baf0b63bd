"""``kvlife bench pauses`` runs two real ``kvlife serve`` (the collector's policy, and
Python's collector as it is) and writes JSON of the documented shape; nothing here
looks at how long anything took."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife import cli
from tests.helpers.machine import assert_machine_figures


def test_bench_pauses_quick_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pauses.json"
    assert cli.main(["bench", "pauses", "--quick", "--dir", str(tmp_path), "--json", str(out)]) == 0
    assert "longest put without the policy" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "pauses"
    assert_machine_figures(doc)
    assert doc["chunks"] == 64 * doc["chunks_per_put"] and doc["chunk_bytes"] == 1024
    assert [r["server"] for r in doc["runs"]] == ["policy", "python"]
    policy, python = doc["runs"]
    assert policy["gc"]["gc_frozen_objects"] > 0 and python["gc"] == {}
    assert python["flags"] == ["--gc-whole-every", "0"]
    for r in doc["runs"]:
        assert len(r["windows"]) == 8
        assert r["windows"][-1]["chunks"] == doc["chunks"]
        for w in [*r["windows"], r]:
            for call in ("put", "lookup"):
                s = w[call]
                assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
        assert r["info_ms"] > 0 and r["connect_ms"] > 0
    assert doc["longest_ratio"] > 0 and doc["p99_ratio"] > 0
    assert not list(tmp_path.glob("kvp-*"))  # its scratch is gone
