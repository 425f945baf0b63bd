"""``kvlife bench server --quick`` runs and writes JSON of the documented shape (speed is
never asserted: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.bench.server.cli import build_parser
from kvlife.bench.server.config import ROUND_TRIP_POINTS
from kvlife.bench.server.floor import QUICK_ROUND_TRIPS
from kvlife.bench.server.run import CEILING_BOUNDS
from kvlife.native import frames as native_frames
from tests.helpers.machine import assert_machine_figures
from tests.server.conftest import ROOT, child_env


def test_bench_server_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlife.cli",
            "bench",
            "server",
            "--quick",
            "--rounds",
            "3",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "lookup of a 16-chunk prompt" in proc.stdout and "aggregate GB/s" in proc.stdout
    assert "machine: memcpy" in proc.stdout
    r = json.loads(out.read_text())
    assert_machine_figures(r)
    assert set(r) >= {
        "config",
        "lookup",
        "load_dram",
        "load_dram_verified",
        "load_disk",
        "put_dram",
        "put_write_through",
        "scaling",
        "targets",
        "peer_lmcache",
    }
    lk = r["lookup"]
    for k in (
        "inproc_p50_us",
        "inproc_p99_us",
        "server_p50_us",
        "server_p99_us",
        "ratio_p50",
        "ratio_p99",
        "inproc_cpu_p50_us",
        "client_cpu_p50_us",
    ):
        assert lk[k] > 0
    assert lk["server_cpu_us_per_lookup"] >= 0  # clock ticks of 10 ms: a quick run may see none
    assert [p["chunk_bytes"] for p in r["load_dram"]] == [256 << 10, 1 << 20]
    for key, limit in (
        ("load_dram", "memcpy_gbps"),
        ("load_dram_verified", "memcpy_gbps"),
        ("load_disk", "raw_gbps"),
        ("put_dram", "memcpy_gbps"),
        ("put_write_through", "raw_gbps"),
    ):
        for p in r[key]:
            assert p["server_gbps"] > 0 and p[limit] > 0
            assert abs(p["ratio"] - p["server_gbps"] / p[limit]) < 1e-9
    assert [p["clients"] for p in r["scaling"]] == [1, 2]
    for p in r["scaling"]:
        assert len(p["per_client_p99_ms"]) == p["clients"] and p["aggregate_gbps"] > 0
    for key in ("load_dram", "load_disk"):
        for p in r[key]:
            assert p["shared_gbps"] > 0 and p["ratio_shared"] > 0
            # loads without buffers (new arrays from the client's pool), beside
            assert p["new_gbps"] > 0
            assert abs(p["ratio_new"] - p["new_gbps"] / p["server_gbps"] * p["ratio"]) < 1e-9
    assert "CPU µs per chunk" in proc.stdout
    for p in r["load_disk"]:  # the CPU each side spent per chunk (issue 28)
        cpu = p["cpu"]
        for phase in ("ordinary", "shared", "raw"):
            assert cpu[f"client_{phase}_us_per_chunk"] >= 0
            assert cpu[f"server_{phase}_us_per_chunk"] >= 0
        assert cpu["server_ordinary_us_per_chunk"] > 0  # the server read and hashed
        assert cpu["hash_us_per_chunk"] > 0
        # every ordinary load (with landed parts and without), shared load and load
        # into new arrays, the warm-up's too, read its frames without pins
        calls = 4 * (r["config"]["reps"] + 1)
        want = calls * p["chunks_per_call"] if native_frames.available() else 0
        assert p["frame_loaded_chunks"] == want
    for p in r["put_dram"]:  # the same puts into an in-process store, beside
        assert p["inproc_gbps"] > 0
        assert abs(p["ratio_inproc"] - p["inproc_gbps"] / p["memcpy_gbps"]) < 1e-9
        # the verified put's ceilings: a copy and its seal, one thread or two
        assert p["sealed_gbps"] > 0 and p["split_gbps"] > 0
        assert abs(p["ratio_sealed"] - p["sealed_gbps"] / p["memcpy_gbps"]) < 1e-9
        # the same puts hashed by the server: told by put_written, and at the commit
        for name in ("server_hashed", "unnoticed"):
            assert p[f"{name}_gbps"] > 0
            assert abs(p[f"ratio_{name}"] - p[f"{name}_gbps"] / p["memcpy_gbps"]) < 1e-9
        # the client's own copy alone (streaming stores), and the put against it
        assert p["stream_gbps"] > 0
        assert abs(p["of_stream"] - p["server_gbps"] / p["stream_gbps"]) < 1e-9
        # what the put cost the server's CPU, beside its time (issue 28)
        c = p["server_cpu"]
        assert c["ms_per_put"] > 0 and c["floor_ms_per_put"] > 0
        assert 0 < c["busy"] < 5  # CPU seconds over wall seconds of one put
        # and the server's time in the store's prepare and its commit, per put: both
        # inside the put's own time (the reply follows both handlers; medians, so a
        # margin)
        h = p["server_halves"]
        put_ms = 1e3 * p["chunks_per_call"] * p["chunk_bytes"] / (p["server_gbps"] * 1e9)
        assert h["prepare_ms"] > 0 and h["commit_ms"] > 0
        assert h["prepare_ms"] + h["commit_ms"] < 2 * put_ms
    for p in r["load_dram"]:  # the DRAM loads against a streaming copy of their bytes
        assert p["stream_gbps"] > 0
        assert abs(p["of_stream"] - p["server_gbps"] / p["stream_gbps"]) < 1e-9
        assert abs(p["shared_of_stream"] - p["shared_gbps"] / p["stream_gbps"]) < 1e-9
        assert abs(p["new_of_stream"] - p["new_gbps"] / p["stream_gbps"]) < 1e-9
    assert all("stream_gbps" not in p for p in r["load_disk"])
    assert "of a streaming copy of the same bytes alone" in proc.stdout
    assert "no buffers: new arrays" in proc.stdout and "into new arrays, of a" in proc.stdout
    assert "ceiling: copy + seal, one thread" in proc.stdout
    assert "of the client's streaming copy of the same bytes alone" in proc.stdout
    assert "the server's CPU per put" in proc.stdout
    assert "in put_commit (the last hash and the store's commit" in proc.stdout
    for p in r["put_write_through"]:
        assert "server_cpu" not in p and "server_halves" not in p
    # the protocol's floor, a bare server with no store, beside the DRAM puts and the
    # disk loads (kvlife/bench/server/floor.py)
    # and beside the disk loads the direct reads and their native-only ceiling, and the
    # ceiling of a load into the caller's own buffers (raw reads, each piece copied out)
    disk_series = ("floor", "direct", "direct_new", "verified", "copied", "no_landed", "frames_raw")
    for key, series in (("put_dram", ("floor", "floor_sealed")), ("load_disk", disk_series)):
        for p in r[key]:
            limit = p["memcpy_gbps" if key == "put_dram" else "raw_gbps"]
            for name in series:
                assert p[f"{name}_gbps"] > 0
                assert abs(p[f"ratio_{name}"] - p[f"{name}_gbps"] / limit) < 1e-9
    for key in ("load_dram", "put_write_through"):
        assert all("floor_gbps" not in p for p in r[key])
    assert all("copied_gbps" not in p for p in r["load_dram"])  # no reads to copy beside
    for p in r["load_disk"]:  # each kind of load against its own ceiling
        assert abs(p["ordinary_of_copied"] - p["server_gbps"] / p["copied_gbps"]) < 1e-9
        assert abs(p["shared_of_verified"] - p["shared_gbps"] / p["verified_gbps"]) < 1e-9
    assert "against their ceilings: into the caller's buffers" in proc.stdout
    # and each load against raw reads of the very bytes it reads, where the frames lie
    for p in r["load_disk"]:
        for name in ("server", "shared", "direct", "verified"):
            got = p[f"{name}_of_frames_raw"]
            assert abs(got - p[f"{name}_gbps"] / p["frames_raw_gbps"]) < 1e-9
    assert "against raw reads of the frames' own bytes" in proc.stdout
    assert all("frames_raw_gbps" not in p for p in r["load_dram"])
    # the ordinary loads without landed parts, round by round beside them
    assert all(0 < p["landed_time_ratio"] < 10 for p in r["load_disk"])
    assert "the caller's buffers, no landed parts" in proc.stdout
    assert all("no_landed_gbps" not in p for p in r["load_dram"])
    assert "ceiling: raw reads, each piece copied out + hashed beside" in proc.stdout
    assert "floor: a bare server, no store" in proc.stdout
    assert "ceiling: the same reads verified, native only" in proc.stdout
    assert "direct reads into new arrays (the vLLM worker's loads)" in proc.stdout
    assert any(t["name"].endswith("KiB_direct_new") for t in r["targets"])
    for p in r["put_write_through"]:  # no ceilings of a DRAM put there
        assert "sealed_gbps" not in p
    assert isinstance(r["shm_huge_pages"], bool)
    assert r["config"]["reps"] == 3 and "rounds per load and put point: 3" in proc.stdout
    rt = r["round_trip"]  # one idle round trip to the bare server, and what it bounds
    assert (
        rt["rounds"] == QUICK_ROUND_TRIPS
        and rt["hot_us"] > 0
        and 0 < rt["idle_us"] <= rt["idle_p90_us"]
    )
    assert ROUND_TRIP_POINTS == (
        ("put_dram", "memcpy_gbps"),
        ("load_disk", "raw_gbps"),
        ("put_write_through", "raw_gbps"),
    )
    for key, limit in ROUND_TRIP_POINTS:
        for p in r[key]:
            t = p["chunk_bytes"] * p["chunks_per_call"] / (p[limit] * 1e9)
            assert abs(p["round_trip_bound"] - t / (t + rt["idle_us"] / 1e6)) < 1e-9
            assert abs(p["round_trip_bound_hot"] - t / (t + rt["hot_us"] / 1e6)) < 1e-9
    for p in r["load_disk"]:  # each ceiling's time plus one idle round trip
        raw_t = p["chunk_bytes"] * p["chunks_per_call"] / (p["raw_gbps"] * 1e9)
        for ceiling, bound in CEILING_BOUNDS:
            t = p["chunk_bytes"] * p["chunks_per_call"] / (p[f"{ceiling}_gbps"] * 1e9)
            assert abs(p[bound] - raw_t / (t + rt["idle_us"] / 1e6)) < 1e-9
    assert "the most a served load reaches (its ceiling's time plus one round" in proc.stdout
    assert "one round trip to a bare server on the server's CPU" in proc.stdout
    assert "the limit's time plus one round trip, idle / back to back" in proc.stdout
    assert {"shm_dir", "server_cpus", "client_cpus"} <= set(r["config"])
    names = {t["name"] for t in r["targets"]}
    assert {
        "lookup_median",
        "lookup_p99",
        "load_dram_1024KiB",
        "load_disk_256KiB_shared",
        "put_write_through_256KiB",
    } <= names
    assert all(isinstance(t["met"], bool) for t in r["targets"])
    assert not list(tmp_path.glob("kvsrv-*"))  # its work directory is removed
    assert not list(Path(r["config"]["shm_dir"]).glob("kvlife-floor-*"))


def test_a_bench_server_under_a_deep_directory_serves_on_a_short_socket(tmp_path: Path) -> None:
    """A work directory deeper than a Unix socket path may be (pytest-xdist's temporary
    directories, a user's ``--dir``): the server's socket goes to a short directory of
    its own, removed when it stops; before, ``kvlife serve`` refused the path."""
    from kvlife.bench.server.servers import BenchServer
    from kvlife.server.server import MAX_SOCKET_PATH
    from kvlife.tiers.shm import SHM_DIR

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep / "served.sock")) > MAX_SOCKET_PATH
    server = BenchServer(deep / "served", 16 << 20, 0, SHM_DIR)
    try:
        assert len(str(server.socket)) <= MAX_SOCKET_PATH
        with server.client() as store:
            assert store.counters.chunks_stored == 0
    finally:
        server.stop()
    assert not server.socket.parent.exists()


@pytest.mark.parametrize("bad", ["0", "-2", "ten", "1.5", "1001"])
def test_bench_server_refuses_a_round_count_that_is_not_1_to_1000(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--rounds", bad])
    assert exc.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_bench_server_takes_a_round_count() -> None:
    assert build_parser().parse_args(["--rounds", "40"]).rounds == 40
    assert build_parser().parse_args([]).rounds is None
