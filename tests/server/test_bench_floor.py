"""The protocol floor of ``kvlife bench server`` (issue 28): a real bare server process
that must hash every byte it is given and read every byte it is asked for, or the floor
raises (speed is never asserted here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.bench.limits import raw_write
from kvlife.bench.server.floor import FloorError, FloorServer
from kvlife.bench.server.run import add_round_trip_bounds
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.shm import SHM_DIR
from tests.server.conftest import ROOT

CHUNK = 256 << 10
N = 3


def _chunks(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, CHUNK // 2, dtype=np.uint16) for _ in range(N)]


def _aligned(chunks: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for c in chunks:
        a = aligned_empty(c.nbytes)
        a[:] = c.view(np.uint8)
        out.append(a)
    return out


@pytest.fixture
def floor() -> Iterator[FloorServer]:
    f = FloorServer(SHM_DIR, N * CHUNK)
    yield f
    f.stop()


@pytest.mark.parametrize(("notice", "client_seals"), [(64 << 10, False), (0, False), (0, True)])
def test_a_floor_put_lands_every_byte_and_returns_its_seals(
    floor: FloorServer, notice: int, client_seals: bool
) -> None:
    for seed in range(3):  # the server's hashing state starts afresh for every put
        chunks = _chunks(seed)
        took = floor.put(chunks, notice, client_seals)
        assert took > 0
        assert bytes(floor.shm[: N * CHUNK]) == b"".join(c.tobytes() for c in chunks)


def test_a_floor_load_reads_the_file_into_the_shared_memory(
    floor: FloorServer, tmp_path: Path
) -> None:
    chunks = _chunks(7)
    path = tmp_path / "raw"
    raw_write(path, _aligned(chunks), direct=False)
    floor.open_file(path, direct=False)
    floor.shm[:] = 0
    assert floor.load(chunks) > 0
    assert bytes(floor.shm[: N * CHUNK]) == b"".join(c.tobytes() for c in chunks)


def test_a_floor_load_of_other_bytes_raises(floor: FloorServer, tmp_path: Path) -> None:
    """The seals checked are those of the chunks the caller expects: a file that holds
    other bytes is caught, so the floor cannot be faster by reading nothing."""
    path = tmp_path / "raw"
    raw_write(path, _aligned(_chunks(1)), direct=False)
    floor.open_file(path, direct=False)
    with pytest.raises(FloorError, match="not the chunks'"):
        floor.load(_chunks(2))


@pytest.mark.parametrize("call", ["put", "round_trips"])
def test_a_floor_server_killed_mid_run_is_a_clear_error_and_stop_cleans_up(call: str) -> None:
    f = FloorServer(SHM_DIR, N * CHUNK)
    try:
        assert f.proc is not None
        os.kill(f.proc.pid, signal.SIGKILL)
        f.proc.wait(timeout=10)
        with pytest.raises(FloorError):
            if call == "put":
                f.put(_chunks(0), 0)
            else:
                f.round_trips(rounds=1, gap_s=0)
    finally:
        f.stop()
    assert not f.shm_path.exists()
    assert f.proc is not None and f.proc.returncode is not None


def test_round_trips_are_timed_both_ways_and_a_put_after_them_still_lands(
    floor: FloorServer,
) -> None:
    rt = floor.round_trips(rounds=5, gap_s=0.001)
    assert rt["rounds"] == 5 and rt["gap_ms"] == 1.0
    assert 0 < rt["hot_us"] < 1e6 and 0 < rt["idle_us"] <= rt["idle_p90_us"] < 1e6
    # the pings left nothing unread on the connection: the next reply is a put's seals
    chunks = _chunks(3)
    floor.put(chunks, 0)
    assert bytes(floor.shm[: N * CHUNK]) == b"".join(c.tobytes() for c in chunks)


def test_the_round_trip_bound_is_the_limit_time_over_itself_plus_one_round_trip() -> None:
    r: dict[str, Any] = {
        "round_trip": {"idle_us": 100.0, "hot_us": 50.0},
        "put_dram": [{"chunk_bytes": 1 << 20, "chunks_per_call": 4, "memcpy_gbps": 4.194304}],
        "load_disk": [{"chunk_bytes": 1 << 20, "chunks_per_call": 2, "raw_gbps": 2.097152}],
        "put_write_through": [{"chunk_bytes": 1 << 20, "chunks_per_call": 1}],  # no limit
    }
    add_round_trip_bounds(r)
    # 4 MiB at 4.194304 GB/s is 1 ms: 1 / 1.1; 2 MiB at 2.097152 GB/s the same
    assert abs(r["put_dram"][0]["round_trip_bound"] - 1 / 1.1) < 1e-9
    assert abs(r["load_disk"][0]["round_trip_bound"] - 1 / 1.1) < 1e-9
    assert abs(r["put_dram"][0]["round_trip_bound_hot"] - 1 / 1.05) < 1e-9
    assert "round_trip_bound" not in r["put_write_through"][0]
    add_round_trip_bounds({"put_dram": []})  # no round trip measured: nothing to add


def test_a_put_larger_than_the_shared_memory_is_refused(floor: FloorServer) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        floor.put(_chunks(0) + _chunks(1), 0)


def test_a_killed_bench_leaves_no_shared_memory_and_no_floor_server(tmp_path: Path) -> None:
    """The shared memory's name is removed once both processes map it: a bench killed
    with SIGKILL leaves no file holding memory, and its floor server, whose connection
    closed, exits."""
    shm = tmp_path / "shm"
    shm.mkdir()
    code = (
        "import sys, time; from pathlib import Path; "
        "from kvlife.bench.server.floor import FloorServer; "
        f"f = FloorServer(Path(sys.argv[1]), {N * CHUNK}); "
        "print(f.proc.pid, flush=True); time.sleep(120)"
    )
    bench = subprocess.Popen(
        [sys.executable, "-c", code, str(shm)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert bench.stdout is not None
        child = int(bench.stdout.readline())
        assert not list(shm.iterdir())  # the floor is up: nothing under a name
    finally:
        bench.kill()
        bench.wait()
    deadline = time.monotonic() + 20
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists(), "the floor server outlived its bench"
    assert not list(shm.iterdir())
