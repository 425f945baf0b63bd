"""The command line: demo, info and check on a real store, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife.cli import main
from kvlife.core.identity import PUBLIC
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity


def _make_store(path: Path) -> None:
    with KVStore.open(path, dram_bytes=1 << 20, disk_bytes=1 << 24) as store:
        for i in range(3):
            tokens, kv = prompt_kv(i, 4 * TINY.tokens_per_chunk)
            store.put_prompt(tiny_identity(), PUBLIC, tokens, kv)


def test_demo_runs_and_serves_no_wrong_kv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo.json"
    args = [
        "demo",
        "--synthetic",
        "--dir",
        str(tmp_path / "s"),
        "--users",
        "3",
        "--turns",
        "2",
        "--dram-mib",
        "32",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "wrong KV served" in text and "0 wrong" in text
    data = json.loads(out.read_text())
    assert [p["name"] for p in data["phases"]] == [
        "turns before fault",
        "turns after fault",
        "after restart",
    ]
    assert sum(p["wrong_kv_served"] for p in data["phases"]) == 0
    assert data["recovered"] > 0
    assert data["phases"][-1]["tokens_disk"] > 0


def test_info_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _make_store(tmp_path)
    assert main(["info", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["objects_by_state"]["indexed"] == 12
    assert info["lifetime_counters"]["chunks_stored"] == 12
    assert main(["info", str(tmp_path)]) == 0
    assert "indexed" in capsys.readouterr().out
    assert main(["check", str(tmp_path)]) == 0
    assert "12 ok, 0 bad" in capsys.readouterr().out
    seg = next((tmp_path / "disk" / "segments").glob("seg-*.kvs"))
    with seg.open("r+b") as fh:
        fh.seek(4096 + 10)
        fh.write(b"\xff\xff\xff")
    assert main(["check", str(tmp_path)]) == 1
    assert "1 bad" in capsys.readouterr().out
    assert main(["check", str(tmp_path), "--fix"]) == 0
    assert main(["check", str(tmp_path)]) == 0
    assert "11 ok, 0 bad" in capsys.readouterr().out


def test_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvlife: error:") and "not a kvlife store" in err
    assert main(["bench", "nope"]) == 2
    with KVStore.open(tmp_path / "held", dram_bytes=1 << 20, disk_bytes=1 << 20):
        assert main(["info", str(tmp_path / "held")]) == 1
        assert "already open in this process" in capsys.readouterr().err
