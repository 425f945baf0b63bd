"""``kvlife bench lmcache-mp --quick`` against LMCache's real MP server, when a peer venv
with LMCache is there (skipped otherwise): the JSON's shape only, never speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlife.bench.peer_lmcache_mp import (
    MODES,
    MPPeerConfig,
    PeerUnavailable,
    find_peer_python,
    run_lmcache_mp,
)

ROOT = Path(__file__).resolve().parents[1]
PEER = find_peer_python()


@pytest.mark.skipif(PEER is None, reason="no peer venv with LMCache (see peer_lmcache_mp.py)")
def test_lmcache_mp_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "mp.json"
    before = {p.name for p in Path("/dev/shm").iterdir()}
    cmd = ["bench", "lmcache-mp", "--python", str(PEER), "--quick", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "kvlife.cli", *cmd],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "retrieve GB/s" in proc.stdout
    r = json.loads(out.read_text())
    assert r["peer"] == "lmcache-mp"
    assert set(r["versions"]) == {"lmcache", "torch", "pyzmq", "cuda_available"}
    cfg = MPPeerConfig.small()
    assert [(p["mode"], p["chunk_bytes"]) for p in r["points"]] == [
        (m, s) for s in cfg.sizes for m in MODES
    ]
    for p in r["points"]:
        assert p["chunks_per_call"] == cfg.chunks_per_call and p["reps"] == cfg.reps
        assert p["verified"] is True
        for k in ("store_gbps", "retrieve_gbps", "store_p99_ms", "retrieve_p99_ms"):
            assert p[k] > 0
    assert r["points"][0]["transfer_context"] == "LMCacheDrivenTransferContext"
    assert (
        r["points"][1]["transfer_context"] == "EngineDrivenTransferContext/EngineDrivenContextShm"
    )
    left = {p.name for p in Path("/dev/shm").iterdir()} - before
    assert not {n for n in left if n.startswith("lmcache_")}  # L1 pool and KV segments


def test_a_python_without_lmcache_is_unavailable_with_a_reason() -> None:
    with pytest.raises(PeerUnavailable, match="cannot import"):
        run_lmcache_mp(Path(sys.executable), MPPeerConfig.small())


def test_bad_settings_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="transfer mode"):
        run_lmcache_mp(Path(sys.executable), MPPeerConfig(modes=("cuda_ipc",)))
    with pytest.raises(ValueError, match="blocks of 256 KiB"):
        run_lmcache_mp(Path(sys.executable), MPPeerConfig(sizes=(256 << 10,)))
