"""``kvlife bench invalidate`` runs (embedded and through a real ``kvlife serve``) and
writes JSON of the documented shape; nothing here looks at how fast anything was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife import cli
from tests.helpers.machine import assert_machine_figures


def test_bench_invalidate_quick_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "inv.json"
    assert (
        cli.main(["bench", "invalidate", "--quick", "--dir", str(tmp_path), "--json", str(out)])
        == 0
    )
    assert "stale hits" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "invalidate"
    assert_machine_figures(doc)
    assert doc["chunks"] == 400 and doc["chunk_bytes"] > 0
    assert [r["store"] for r in doc["runs"]] == ["embedded", "served"]
    for run in doc["runs"]:
        assert run["stored"] == doc["chunks"] and run["fill_s"] > 0
        assert [s["invalidation"] for s in run["steps"]] == ["source", "weights"]
        for step in run["steps"]:
            assert step["removed"] > 0 and step["call_s"] > 0
            assert step["stale_chunks_hit"] == 0
            assert step["kept_chunks_hit"] == step["kept_chunks_asked"] > 0
            assert set(step["tiers"]) == {"dram", "disk"}
            for tier in step["tiers"].values():
                assert tier["freed_bytes"] == step["removed"] * doc["chunk_bytes"]
                if run["store"] == "embedded":
                    assert 0 <= tier["freed_s"] <= step["call_s"]
                else:
                    assert tier["freed_s"] is None
    assert not list(tmp_path.glob(".kvlife-bench-inval-*")), "scratch directory left behind"
