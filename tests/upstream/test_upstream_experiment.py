"""`kvlife experiment upstream --quick` runs (tiny Llama) and writes its JSON and plot:
every workload and strategy, exact strategies asserted identical to the full recompute,
no stale KV served; and the identity assertion fires on a differing output. Speed is
not checked here: the figures come from the command, in README and docs/upstream.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlife.cli import main
from kvlife.experiments.upstream import STRATEGIES, OutputMismatch, check_identical
from kvlife.upstream.workloads import WORKLOADS


def test_the_upstream_experiment_writes_its_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "u.json", tmp_path / "u.png"
    argv = ["experiment", "upstream", "--quick", "--model", "tiny", "--no-progress"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    got = json.loads(out.read_text())
    assert set(got["workloads"]) == set(WORKLOADS)
    for w in got["workloads"].values():
        assert w["requests"] == 3 and len(w["prompt_tokens"]) == 3
        assert any(w["superseded"])  # every workload has an upstream update
        rows = w["strategies"]
        assert list(rows) == list(STRATEGIES)
        total = rows["full"]["tokens_total"]
        assert rows["full"]["tokens_recomputed"] == total
        for name, r in rows.items():
            assert r["stale_tokens"] == 0 and r["stale_events"] == []
            assert 0 < r["tokens_recomputed"] <= total and r["ttft_s"] > 0
            if name == "segment":
                assert r["kl_mean"] >= 0 and 0 <= r["top1_agree"] <= 1
                assert 0 <= r["greedy_agree"] <= r["greedy_prefix"] <= 1
            else:
                assert r["outputs_identical"] is True
        # every workload updates a source: the store drops what depended on the old one
        assert rows["depgraph"]["invalidated"] > 0
        assert rows["depgraph"]["invalidated_unit"] == "chunks"
        # reuse saves work: every reusing strategy recomputes less than everything
        for name in ("prefix", "depgraph", "segment"):
            assert rows[name]["tokens_recomputed"] < total
            assert rows[name]["reused_tokens"] > 0
    assert got["summary"]["depgraph"]["stale_tokens"] == 0


def test_an_exact_strategy_with_another_output_fails_the_run() -> None:
    check_identical("prefix", 0, [1, 2, 3], [1, 2, 3])
    with pytest.raises(OutputMismatch, match="request 4"):
        check_identical("depgraph", 4, [1, 2, 3], [1, 2, 4])
