"""`kvlife experiment transforms --quick` runs on SmolLM2 and writes JSON of the documented
shape (one short window; quality numbers are not checked, except what must hold exactly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife.cli import EXPERIMENTS
from kvlife.experiments import transforms as experiment


def test_experiment_transforms_quick_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert EXPERIMENTS["transforms"] == "kvlife.experiments.transforms"
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    assert (
        experiment.main(["--quick", "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    )
    assert "mean KL" in capsys.readouterr().out
    assert png.stat().st_size > 0
    doc = json.loads(out.read_text())
    assert doc["experiment"] == "transforms" and doc["reference"] == "exact fp32"
    assert doc["stored_tokens"] == 64 and doc["scored_tokens"] == 32 and len(doc["windows"]) == 1
    assert doc["kv_shape"] == [30, 2, 3, 64, 64]
    rows = {r["label"]: r for r in doc["rows"]}
    chunked = experiment.chunked_rows([32], 64)
    assert set(rows) == {spec.label for spec in [*experiment.ROWS, *chunked]}
    assert doc["chunk_sizes"] == [32, 64]
    # every quantiser row again at 32-token chunks, the tuned ones with sinks per chunk too
    quant = [s.label for s in experiment.ROWS if s.transform in ("int8", "int4", "int2")]
    assert {f"{label} @32" for label in quant} <= set(rows)
    assert {"int4 tuned, sinks per chunk @32", "int2 tuned, sinks per chunk @32"} <= set(rows)
    for r in doc["rows"]:
        assert r["chunk_tokens"] == (32 if r["label"].endswith("@32") else 64)
        assert r["bits_per_element_later"] > 0
    # sinks only at the sequence start: a later chunk pays for none
    tuned, tuned32 = rows["int4 tuned"], rows["int4 tuned @32"]
    assert tuned32["bits_per_element_later"] < tuned32["bits_per_element"]
    assert tuned["bits_per_element_later"] < tuned["bits_per_element"]
    per_chunk = rows["int4 tuned, sinks per chunk @32"]
    assert per_chunk["bits_per_element_later"] == per_chunk["bits_per_element"]
    assert per_chunk["bits_per_element"] > tuned32["bits_per_element"]
    # without sinks or per-chunk choices, cutting the prefix changes nothing: int4 g32's
    # groups of 32 tokens fall on the same tokens
    assert rows["int4 g32 @32"]["bit_exact_of"] == "int4 g32"
    for r in doc["rows"]:
        assert r["bits_per_element"] > 0 and r["mean_kl"] >= -1e-9
        assert 0 <= r["top1"] <= 1 and 0 <= r["greedy_agreement"] <= 1
        assert set(r["meets"]) == {"near_lossless", "two_bit"}
        assert (r["recall"] is not None) == (r["transform"] == "sparse")
    ref = rows["exact fp32"]
    assert ref["mean_kl"] == 0 and ref["top1"] == 1 and ref["dppl"] == 0
    # lossless rows decode bit-identical KV, so they are the exact rows' results
    assert rows["lossless zstd fp32"]["bit_exact_of"] == "exact fp32"
    assert rows["lossless zstd fp16"]["bit_exact_of"] == "exact fp16"
    assert rows["lossless zstd fp16"]["byte_saving"] > 0.05
    assert rows["int8"]["bits_per_element"] < 9
    for label in ("sparse 25% snapkv", "sparse 25% knorm"):
        assert 0 < rows[label]["recall"] <= 1
        assert rows[label]["exactness"] == "lossy-sparse"


def test_license_windows_are_distinct_files_first(tmp_path: Path) -> None:
    class Tok:
        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

    (tmp_path / "A").write_text("a" * 25)
    (tmp_path / "B").write_text("b" * 12)
    (tmp_path / "A-copy").write_text("a" * 25)  # same text: used once
    (tmp_path / "C").write_text("c" * 3)  # too short
    wins = experiment.license_windows(Tok(), 3, 10, tmp_path)
    assert [(w.source, w.start) for w in wins] == [("A", 0), ("B", 0), ("A", 10)]
    assert all(len(w.ids) == 10 for w in wins)
    with pytest.raises(SystemExit):
        experiment.license_windows(Tok(), 5, 10, tmp_path)
