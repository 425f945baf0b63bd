"""`kvlife bench remote --quick` runs end to end and writes JSON of the documented shape
(never a speed check: the machine is shared)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife.cli import main
from tests.helpers.machine import assert_machine_figures


def test_bench_remote_quick_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "remote.json"
    assert main(["bench", "remote", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "remote" and data["quick"] is True
    assert_machine_figures(data)
    row_keys = {
        "size",
        "objects",
        "kvlife_put_gbps",
        "kvlife_get_gbps",
        "raw_put_gbps",
        "raw_get_gbps",
        "put_ratio",
        "get_ratio",
        "wrong",
    }
    assert [r["size"] for r in data["redis"]] == [256 << 10, 1 << 20]
    assert set(data["redis_raw_calls"]) == {"raw", "unpacked", "kvlife"}
    for r in data["redis"]:
        assert set(r) == row_keys | {"unpacked"} and r["wrong"] == 0 and r["kvlife_get_gbps"] > 0
        assert set(r["unpacked"]) == {"raw_put_gbps", "put_ratio"}
    mc = data["mooncake"]
    assert "rows" in mc or "skipped" in mc
    if "rows" in mc:  # which raw calls each figure used is named beside them
        assert set(mc["raw_calls"]) == {
            "raw",
            "new_arrays",
            "bytes_api",
            "known_checksum",
            "whole_batch",
            "bare_verified",
            "bare_published",
            "put_in_halves",
            "kvlife",
        }
        assert mc["tier"]["corrupt"] == 0
    for r in mc.get("rows", []):
        assert set(r) == row_keys | {
            "new_arrays",
            "bytes_api",
            "known_checksum",
            "whole_batch",
            "bare_verified",
            "put_in_halves",
            "cpu_ms",
        }
        v = r["bare_verified"]
        assert set(v) == {
            "put_gbps",
            "get_gbps",
            "serial_get_gbps",
            "pipelined_get_gbps",
            "put_ratio",
            "get_ratio",
            "kvlife_put_vs_bare",
            "kvlife_get_vs_bare",
            "published_put_gbps",
            "kvlife_put_vs_published",
        }
        assert v["get_gbps"] == max(v["serial_get_gbps"], v["pipelined_get_gbps"]) > 0
        assert v["put_gbps"] > 0 and v["published_put_gbps"] > 0
        h = r["put_in_halves"]
        assert set(h) == {"raw_put_gbps", "of_one_call", "second_call_ms"}
        assert h["raw_put_gbps"] > 0 and h["of_one_call"] > 0
        assert set(r["whole_batch"]) == {"kvlife_get_gbps", "get_ratio"}
        assert set(r["cpu_ms"]) == {"kvlife_put", "kvlife_get", "raw_put", "raw_get"}
        assert all(v >= 0 for v in r["cpu_ms"].values())
        assert r["wrong"] == 0
        assert set(r["new_arrays"]) == {"kvlife_get_gbps", "raw_get_gbps", "get_ratio"}
        assert set(r["bytes_api"]) == {"raw_put_gbps", "raw_get_gbps", "put_ratio", "get_ratio"}
        assert set(r["known_checksum"]) == {"kvlife_put_gbps", "put_ratio"}
    lk = data["lookup"]
    assert lk["chunks"] == 128 and 0 < lk["median_ms"] <= lk["p99_ms"]
    faults = {f["fault"]: f for f in data["faults"]}
    assert set(faults) >= {
        "none",
        "delay-5ms",
        "bandwidth-50MB/s",
        "drop",
        "reset",
        "partition",
        "truncate",
        "flip",
    }
    for f in faults.values():
        assert f["wrong_bytes"] == 0 and 0.0 <= f["hit_ratio"] <= 1.0
    assert faults["none"]["hit_ratio"] == 1.0


@pytest.mark.parametrize("reps", ["0", "-3", "1001", "two"])
def test_bench_remote_refuses_a_repetition_count_it_cannot_run(
    reps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "remote", "--reps", reps])
    assert exc.value.code == 2
    assert "--reps" in capsys.readouterr().err
