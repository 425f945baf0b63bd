"""``kvlife bench stages``: its probes resolve and record, its analysis assigns records
to calls, and a quick run through two real probed servers lays out real calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.bench import stage_probes
from kvlife.bench.stage_probes import (
    CLIENT_PROBES,
    SERVER_PROBES,
    Probe,
    ProbeMissing,
    Recorder,
)
from kvlife.bench.stages import analyse


def test_every_probe_resolves_and_is_put_back() -> None:
    """A renamed function fails here, not as a stage silently missing from the report."""
    import kvlife.server.protocol as protocol
    import kvlife.server.puts as puts

    before = (protocol.decode_request, puts.Puts.put_commit, puts._hash_written)
    rec = Recorder()
    rec.install(SERVER_PROBES + CLIENT_PROBES)
    try:
        assert protocol.decode_request is not before[0]
        assert puts.Puts.__dict__["put_commit"] is not before[1]
        assert puts._hash_written is not before[2]
    finally:
        rec.uninstall()
    assert (protocol.decode_request, puts.Puts.put_commit, puts._hash_written) == before


def test_a_missing_probe_installs_nothing() -> None:
    import kvlife.server.protocol as protocol

    original = protocol.decode_request
    rec = Recorder()
    with pytest.raises(ProbeMissing, match="no_such_function"):
        rec.install(
            (
                Probe("kvlife.server.protocol", "decode_request", "decoded"),
                Probe("kvlife.server.protocol", "no_such_function", "nothing"),
            )
        )
    assert protocol.decode_request is original
    with pytest.raises(ProbeMissing, match=r"no\.such\.module"):
        rec.install((Probe("no.such.module", "f", "x"),))


def test_a_probe_records_calls_that_return_and_calls_that_raise() -> None:
    rec = Recorder()

    def half(x: int) -> int:
        if x % 2:
            raise ValueError(x)
        return x // 2

    probed = rec.wrap("half", half)
    assert probed(8) == 4
    with pytest.raises(ValueError):
        probed(3)
    assert [r[0] for r in rec.records] == ["half", "half"]
    assert all(r[1] <= r[2] for r in rec.records)
    assert rec.records[0][2] <= rec.records[1][1]


def test_records_go_to_the_call_during_which_they_returned() -> None:
    windows = [("load", 10.0, 11.0), ("load", 20.0, 21.0), ("put", 30.0, 31.0)]
    records = [
        ("read", 9.0, 10.5, 1),  # entered before the call (waiting), returned in it
        ("step", 10.1, 10.2, 1),
        ("step", 10.3, 10.4, 1),  # the second "step" of the call: step #1
        ("step", 20.1, 20.3, 1),
        ("late", 20.9, 21.5, 1),  # returned after the call: not the call's
        ("read", 19.0, 20.2, 1),
        ("put", 30.2, 30.9, 2),
    ]
    got = analyse("load", windows, records, skip=0)
    assert got["calls"] == 2
    assert got["call_us"] == pytest.approx(1e6)
    stages = {s["stage"]: s for s in got["stages"]}
    assert set(stages) == {"read #0", "step #0", "step #1"}
    assert stages["read #0"]["calls"] == 2
    assert stages["read #0"]["start_us"] == pytest.approx(-1e6)
    assert stages["step #0"]["start_us"] == pytest.approx(1e5)
    assert stages["step #0"]["end_us"] == pytest.approx(2.5e5)
    assert stages["step #1"]["calls"] == 1  # one call of two: kept (half)
    assert [s["stage"] for s in got["stages"]] == ["read #0", "step #0", "step #1"]
    skipped = analyse("load", windows, records, skip=1)
    assert skipped["calls"] == 1 and {s["stage"] for s in skipped["stages"]} == {
        "read #0",
        "step #0",
    }
    assert analyse("other", windows, records, skip=0)["calls"] == 0


def test_the_probed_server_refuses_a_command_that_is_not_serve(tmp_path: Path) -> None:
    assert stage_probes.main([str(tmp_path / "out"), "info"]) == 2


def _stage(kind: dict[str, object], name: str) -> dict[str, float]:
    for s in kind["stages"]:  # type: ignore[attr-defined]
        if s["stage"] == name:
            return s  # type: ignore[no-any-return]
    raise AssertionError(f"no stage {name!r} in {[s['stage'] for s in kind['stages']]}")  # type: ignore[attr-defined]


def test_a_quick_run_lays_out_real_served_calls(tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "bench", "stages", "--quick", "--chunk-mib", "1",
         "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["kinds"]) == {"load_shared", "load_ordinary", "put"}
    for key in ("memcpy_gbps", "raw_read_gbps", "raw_write_gbps", "python_loop_mips"):
        assert r["machine"][key] > 0
    for name, kind in r["kinds"].items():
        assert kind["calls"] >= 10, name
        assert kind["call_us"] > 0
        for s in kind["stages"]:
            assert s["end_us"] >= s["start_us"], (name, s)
            assert s["calls"] * 2 >= kind["calls"]
            assert s["end_us"] <= kind["call_us"] * 3, (name, s)  # medians of one call's
    for name in ("load_shared", "load_ordinary"):
        kind = r["kinds"][name]
        # the bench's disk server promotes nothing: its disk loads read their frames in
        # the extension's run from the connection's thread (kvlife.store.frame_loads)
        reads = _stage(kind, "native frame reads started #0")
        first = _stage(kind, "frame load: chunk checked #0")
        published = _stage(kind, "frame load published #0")
        assert _stage(kind, "request decoded #0")["end_us"] > 0
        assert reads["start_us"] < first["start_us"] < published["end_us"]
        assert _stage(kind, "frame load: chunk checked #1")["start_us"] >= first["start_us"]
    assert _stage(r["kinds"]["load_ordinary"], "grant released #0")["calls"] > 0
    put = r["kinds"]["put"]
    prepared = _stage(put, "put prepared #0")
    commit = _stage(put, "put_commit #0")
    store = _stage(put, "store commit #0")
    assert prepared["end_us"] <= commit["start_us"] <= store["start_us"] < commit["end_us"]
    assert "served DRAM put" in done.stdout and "native frame reads started #0" in done.stdout
    # a new prompt before each put, as kvlife bench server makes them (not four reused)
    assert r["config"]["reuse_prompts"] is False
    assert "(a new prompt each)" in done.stdout
