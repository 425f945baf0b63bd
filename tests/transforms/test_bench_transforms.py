"""bench transforms runs and writes JSON of the documented shape (no speeds are checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife.bench import transforms
from kvlife.cli import BENCHES


def test_bench_transforms_quick_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert BENCHES["transforms"] == "kvlife.bench.transforms"
    out = tmp_path / "t.json"
    assert transforms.main(["--quick", "--json", str(out)]) == 0
    assert "enc GB/s" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "transforms" and doc["dtype"] == "float16"
    labels = {label for label, _, _ in transforms.CONFIGS}
    labels |= {label for label, _, _ in transforms.PARITY_CONFIGS}
    assert {p["transform"] for p in doc["points"]} == labels
    assert {p["data"] for p in doc["points"]} == {"normal", "kv-like"}
    for p in doc["points"]:
        assert p["encode_gbps"] > 0 and p["decode_gbps"] > 0 and p["memcpy_gbps"] > 0
        assert p["bits_per_element"] > 0 and p["ratio"] > 0
        assert p["exactness"] in ("exact", "lossless", "lossy", "lossy-sparse")
    bits = doc["bits_by_chunk"]
    quant = {label for label, name, _ in transforms.CONFIGS if name in ("int8", "int4", "int2")}
    assert {b["transform"] for b in bits} == quant
    for b in bits:
        assert b["chunk_tokens"] == 64 and b["shape"] == [30, 2, 3, 64, 64]
        # sinks only in the chunk at the sequence start
        assert b["bits_first"] >= b["bits_later"] > 0
        assert (b["bits_first"] > b["bits_later"]) == bool(b["params"].get("sink_tokens"))
    files = doc["parity_files"]
    assert {f["transform"] for f in files} == {label for label, _, _ in transforms.PARITY_CONFIGS}
    for f in files:
        assert f["protect_gbps"] > 0 and f["rebuild_gbps"] > 0 and f["file_bytes"] > 0
    assert {"sparse-25-knorm", "lossless-zstd1", "int4-g32"} <= labels


@pytest.mark.slow  # the bfloat16 quick run above covers the benchmark's shape
def test_bench_transforms_float32(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert transforms.main(["--quick", "--dtype", "float32", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["dtype"] == "float32"
    assert all(p["bits_per_element"] > 0 for p in doc["points"])
