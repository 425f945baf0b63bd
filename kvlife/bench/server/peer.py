"""LMCache's multi-process mode on the same chunks, beside kvlife's server."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvlife.bench.server.config import ServerBenchConfig


def peer_lmcache(cfg: ServerBenchConfig, server_cpus: str, work: Path) -> dict[str, Any]:
    """LMCache's MP server and client on the same chunks (kvlife/bench/peer_lmcache_mp),
    its server on the CPU kvlife's servers ran on; a dict saying why when not run."""
    from kvlife.bench import peer_lmcache_mp as mp

    python = mp.find_peer_python(cfg.peer_python)
    if not cfg.peer or python is None or (cfg.quick and cfg.peer_python is None):
        why = "not asked" if not cfg.peer else "no peer venv found"
        if cfg.peer and python is not None:
            why = "quick run (pass --peer-python to run it)"
        return {"peer": "lmcache-mp", "skipped": why}
    peer_cfg = mp.MPPeerConfig(
        sizes=cfg.sizes,
        chunks_per_call=cfg.chunks_per_call,
        reps=cfg.reps,
        server_cpus=tuple(int(c) for c in server_cpus.split(",")) if server_cpus else (),
    )
    if cfg.quick:
        peer_cfg = replace(mp.MPPeerConfig.small(), server_cpus=peer_cfg.server_cpus)
    (work / "lmc").mkdir(exist_ok=True)
    try:
        return mp.run_lmcache_mp(python, peer_cfg, work / "lmc")
    except (mp.PeerUnavailable, RuntimeError, ValueError, OSError) as exc:
        return {"peer": "lmcache-mp", "skipped": f"failed: {exc}"[:2000]}
