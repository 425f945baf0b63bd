"""Shape of ``kvlife bench io --quick`` output: keys present, numbers positive and finite.

Never asserts that anything is fast: the numbers of a quick run on a shared machine mean
nothing; the full benchmark is run by hand.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

from kvlife.bench.io import (
    IOBenchConfig,
    format_report,
    main,
    parse_size,
    run_io_bench,
    size_label,
)
from kvlife.report import format_table
from tests.helpers.machine import assert_machine_figures

RATIO_KEYS = ("disk_store_vs_raw", "disk_load_vs_raw", "mem_put_vs_memcpy", "mem_get_vs_memcpy")
USER_PATH_KEYS = ("disk_store_unaligned_vs_raw", "disk_writeback_vs_raw", "disk_load_new_vs_raw")
SEAL_KEYS = ("mem_get_verified_vs_memcpy", "disk_writeback_sealed_vs_raw")
SEAL_DIAGNOSTICS = ("seal_vs_memcpy", "mem_put_seal_share", "mem_get_verified_vs_get")
DEVICE_DIAGNOSTICS = ("disk_store_device_share", "disk_store_device_vs_raw")


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_quick_run_writes_json_of_the_right_shape(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default scratch directory is made in the cwd
    out = tmp_path / "out.json"
    assert main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    for key in ("limits", "kvlife", "ratios", "lookup_128_chunks_us", "direct_io", "targets"):
        assert key in doc
    labels = [size_label(s) for s in IOBenchConfig.quick_config().sizes]
    assert list(doc["ratios"]) == labels
    for label in labels:
        for key in RATIO_KEYS + USER_PATH_KEYS + SEAL_KEYS:
            assert _positive_finite(doc["ratios"][label][key]), (label, key)
        assert _positive_finite(doc["diagnostics"][label]["disk_load_new_first_vs_raw"])
        for key in SEAL_DIAGNOSTICS + DEVICE_DIAGNOSTICS:
            assert _positive_finite(doc["diagnostics"][label][key]), (label, key)
        # the device's write calls are part of the store's time, not more
        assert doc["diagnostics"][label]["disk_store_device_share"] <= 1.0
        assert _positive_finite(doc["kvlife"][label]["seal_gbps"])
        for key in ("memcpy_gbps", "raw_write_gbps", "raw_read_gbps"):
            assert _positive_finite(doc["limits"][label][key]), (label, key)
        for key, value in doc["kvlife"][label].items():
            assert _positive_finite(value), (label, key)
    assert _positive_finite(doc["lookup_128_chunks_us"])
    assert doc["lookup"]["chunks"] == 128
    assert _positive_finite(doc["lookup"]["vs_keys"])
    for key in ("cpu_median_us", "key_computation_cpu_median_us", "vs_keys_cpu"):
        assert _positive_finite(doc["lookup"][key]), key
    assert {t["metric"] for t in doc["targets"]} >= {"lookup_128_chunks_us", "lookup_vs_keys"}
    assert isinstance(doc["direct_io"], bool)
    assert_machine_figures(doc)
    assert "peers" not in doc
    # the scratch directory is removed afterwards
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvlife-bench-io-")]
    printed = capsys.readouterr().out
    assert "disk store (aligned)" in printed and "lookup of a 128-chunk prompt" in printed
    assert "disk store time inside the device's write calls" in printed
    assert "DRAM seal (xxh3-128)" in printed and "demotion (seal verified)" in printed
    assert "machine: memcpy" in printed and "Python loop" in printed
    assert "lookup ÷ its chunk keys alone" in printed
    assert "in CPU time: lookup" in printed


def test_run_io_bench_returns_the_same_document(tmp_path: Path) -> None:
    cfg = IOBenchConfig.quick_config(
        sizes=(8192,), batch=2, repeat=1, lookup_iters=3, directory=tmp_path, progress=False
    )
    doc = run_io_bench(cfg)
    assert list(doc["ratios"]) == ["8KiB"]  # type: ignore[call-overload]
    assert "lookup of a 128-chunk prompt" in format_report(doc)
    json.dumps(doc, allow_nan=False)


def test_missing_peer_is_skipped_with_a_reason(tmp_path: Path, monkeypatch) -> None:
    import kvlife.bench.io.run as io_run
    from kvlife.bench.peer_lmcache import PeerUnavailable

    def unavailable() -> str:
        raise PeerUnavailable("lmcache is not installed here")

    monkeypatch.setattr(io_run, "check_available", unavailable)
    cfg = IOBenchConfig.quick_config(
        sizes=(8192,),
        batch=2,
        repeat=1,
        lookup_iters=3,
        directory=tmp_path,
        progress=False,
        peer="lmcache",
    )
    doc = run_io_bench(cfg)
    assert doc["peers"] == {
        "lmcache": {"available": False, "reason": "lmcache is not installed here"}
    }


def test_sizes_parse_and_print() -> None:
    assert parse_size("256KiB") == 256 * 1024
    assert parse_size("2MiB") == parse_size("2M") == 2 << 20
    assert parse_size("4096") == 4096
    assert size_label(16 << 20) == "16MiB"
    with pytest.raises(ValueError):
        parse_size("lots")
    with pytest.raises(ValueError):
        IOBenchConfig(sizes=(1000,))


def test_table_aligns_columns() -> None:
    text = format_table(["name", "GB/s"], [["a", "1.50"], ["longer", "12.00"]])
    lines = text.splitlines()
    assert lines[0].startswith("name") and lines[2].endswith(" 1.50")
    assert len(lines[2]) == len(lines[3])
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["only one"]])


def test_user_paths_are_reported_beside_their_limit_with_a_target(tmp_path: Path) -> None:
    """From 2 MiB up every user path has a target entry against its raw limit (shape
    only: whether it is met depends on the machine)."""
    cfg = IOBenchConfig.quick_config(
        sizes=(2 << 20,), batch=2, repeat=1, lookup_iters=3, directory=tmp_path, progress=False
    )
    doc = run_io_bench(cfg)
    targets = doc["targets"]
    assert isinstance(targets, list)
    by_metric = {t["metric"]: t for t in targets if t["size"] == "2MiB"}
    for key in RATIO_KEYS + USER_PATH_KEYS:
        entry = by_metric[key]
        assert set(entry) == {"metric", "size", "value", "target", "met"}
        assert _positive_finite(entry["value"]) and isinstance(entry["met"], bool)
    for key in USER_PATH_KEYS:
        assert by_metric[key]["target"] == ">= 0.85"
    text = format_report(doc)
    assert "disk load new arrays" in text and "≥0.85" in text


def test_machine_figures_say_how_they_read(tmp_path: Path) -> None:
    """The machine figures use O_DIRECT exactly where the directory takes it (tmpfs may
    not: then buffered I/O, and the line says so), say whether the disk tier reads in
    native code; the scratch file is removed."""
    from kvlife.bench.limits import format_machine, machine_figures
    from kvlife.native import frames
    from kvlife.tiers.disk.fileio import probe_direct_io

    dirs = [tmp_path]
    if Path("/dev/shm").is_dir():
        dirs.append(Path(tempfile.mkdtemp(prefix="kvlife-machine-test-", dir="/dev/shm")))
    try:
        for where in dirs:
            fig = machine_figures(where, quick=True, best_of=1)
            assert_machine_figures({"machine": fig})
            assert fig["direct_io"] is probe_direct_io(where)
            label = "raw O_DIRECT" if fig["direct_io"] else "raw buffered"
            assert label in format_machine(fig)
            assert fig["native_reads"] is frames.available()
            said = "read natively" if fig["native_reads"] else "read through Python"
            assert said in format_machine(fig)
            assert list(where.iterdir()) == []
    finally:
        for where in dirs[1:]:
            shutil.rmtree(where, ignore_errors=True)


def test_machine_figures_say_how_idle_cpus_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpuidle driver and haltpoll's polling time are read from the kernel's files
    (None where a file is missing or says nothing readable) and printed with the
    machine line."""
    from kvlife.bench import limits

    driver, poll = tmp_path / "current_driver", tmp_path / "guest_halt_poll_ns"
    monkeypatch.setattr(limits, "CPUIDLE", driver)
    monkeypatch.setattr(limits, "HALT_POLL", poll)
    assert limits.idle_wait() == {"cpuidle_driver": None, "halt_poll_ns": None}
    driver.write_text("haltpoll\n")
    poll.write_text("200000\n")
    said = limits.idle_wait()
    assert said == {"cpuidle_driver": "haltpoll", "halt_poll_ns": 200000}
    fig = limits.machine_figures(tmp_path, quick=True, best_of=1)
    assert fig["cpuidle_driver"] == "haltpoll" and fig["halt_poll_ns"] == 200000
    assert "idle CPUs: haltpoll, polling 200 µs before they halt" in limits.format_machine(fig)
    poll.write_text("not a number")
    driver.write_text("acpi_idle")
    fig = limits.machine_figures(tmp_path, quick=True, best_of=1)
    assert fig["halt_poll_ns"] is None
    line = limits.format_machine(fig)
    assert line.endswith("idle CPUs: acpi_idle") and "polling" not in line
