"""vLLM with its default multiprocess engine (scheduler in the engine-core process, the
model in a worker process) sharing one store served by ``kvlife serve``
(``kvlife.socket``). Needs the store server (``kvlife.client``); without it this module
is skipped, and the embedded single-process path (test_connector_e2e) is the e2e test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import ROOT, run_engine
from tests.vllm.test_connector_e2e import CHUNK, NEW, P1, _spec

pytest.importorskip("kvlife.client.remote")


@pytest.fixture
def server(tmp_path: Path) -> Any:
    sock = tmp_path / "kv.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvlife.cli",
            "serve",
            str(tmp_path / "store"),
            "--socket",
            str(sock),
            "--dram-bytes",
            str(64 << 20),
            "--disk-bytes",
            str(256 << 20),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert proc.poll() is None, "kvlife serve exited"
        assert time.monotonic() < deadline, "kvlife serve did not open its socket"
        time.sleep(0.2)
    yield sock
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def test_multiprocess_vllm_shares_a_served_store(
    server: Path, tiny_model: Path, tmp_path: Path
) -> None:
    spec = _spec(tiny_model, None, [{"tokens": P1, "max_tokens": NEW}] * 2)
    spec |= {
        "multiprocess": True,
        "kvlife": {"kvlife.socket": str(server), "kvlife.chunk_tokens": CHUNK},
    }
    first = run_engine(spec, tmp_path, "served-1")
    a, b = first["requests"]
    assert a["cached_tokens"] == 0 and b["cached_tokens"] == 4 * CHUNK
    assert a["output_ids"] == b["output_ids"]
    spec["requests"] = spec["requests"][:1]
    second = run_engine(spec, tmp_path, "served-2")  # a new engine, the same server
    assert second["requests"][0]["cached_tokens"] == 4 * CHUNK
    assert second["requests"][0]["output_ids"] == a["output_ids"]


@pytest.mark.parametrize("direct", [True, False])
def test_a_worker_reads_its_disk_hits_directly_unless_told_not_to(
    server: Path, tiny_model: Path, tmp_path: Path, direct: bool
) -> None:
    """The prompt's chunks evicted from the server's DRAM between two engines: the
    second engine's worker loads them from disk, by default reading their frames itself
    (into new arrays, verified, confirmed by the server: the server counts direct
    loads); ``kvlife.direct_reads: false`` loads them through the server. The same
    tokens either way."""
    from kvlife.client import RemoteStore

    spec = _spec(tiny_model, None, [{"tokens": P1, "max_tokens": NEW}])
    spec |= {
        "multiprocess": True,
        "kvlife": {
            "kvlife.socket": str(server),
            "kvlife.chunk_tokens": CHUNK,
            "kvlife.direct_reads": direct,
        },
    }
    first = run_engine(spec, tmp_path, "disk-1")["requests"][0]
    admin = RemoteStore(server, timeout=60)
    try:
        admin.flush()
        admin.evict("dram", 1 << 40)
        before = admin.counters
        second = run_engine(spec, tmp_path, "disk-2")["requests"][0]
        # the worker's word of what it kept is counted when the server reads it, after
        # the load's reply: a little later than the engine's exit, seen from this session
        deadline = time.monotonic() + 10
        after = admin.counters
        while after.direct_loads - before.direct_loads < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
            after = admin.counters
    finally:
        admin.close()
    assert second["cached_tokens"] == 4 * CHUNK
    assert second["output_ids"] == first["output_ids"]
    loaded = after.tier("disk").loaded - before.tier("disk").loaded
    assert loaded == 4  # the four full chunks before the last token, from disk
    assert after.direct_loads - before.direct_loads == (4 if direct else 0)
