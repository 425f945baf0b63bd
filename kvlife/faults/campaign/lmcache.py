"""LMCache beside kvlife: the campaign's disk faults against LMCache's local-disk backend.

LMCache is never imported into kvlife's process: :mod:`.lmcache_child` runs in the
interpreter named by ``KVLIFE_LMCACHE_PYTHON`` (a virtual environment with LMCache
installed, see :mod:`kvlife.bench.peer_lmcache`), and its counts come back as JSON.
Without that interpreter the part is skipped, and the campaign's JSON says why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvlife.faults.campaign.tally import Campaign, KindTally

ENV = "KVLIFE_LMCACHE_PYTHON"


def run(root: Path, seed: int, n: int, campaign: Campaign) -> None:
    """``n`` injections of each LMCache disk kind, tallied as system ``lmcache``."""
    python = os.environ.get(ENV, "")
    if not python or not Path(python).exists():
        campaign.skipped.append(f"lmcache: no LMCache interpreter ({ENV} is not set)")
        return
    root.mkdir(parents=True, exist_ok=True)
    out = root / "lmcache.json"
    env = dict(os.environ)
    env.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    cmd = [python, "-m", "kvlife.faults.campaign.lmcache_child"]
    cmd += ["--dir", str(root / "disk"), "--n", str(n), "--seed", str(seed), "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        campaign.skipped.append(f"lmcache: the LMCache child failed: {proc.stderr[-500:]}")
        return
    for d in json.loads(out.read_text()):
        t = KindTally(d["kind"], "local-disk", "lmcache")
        t.injections = d["injections"]
        t.detections = d["detections"]
        t.served_chunks = d["served_chunks"]
        t.wrong_chunks = d["wrong_chunks"]
        t.wrong_bytes = d["wrong_bytes"]
        t.acked_lost = d["acked_lost"]
        t.recovery_s = list(d["recovery"])
        if d["kind"] == "restart" and t.acked_lost:
            t.note("its index lives in memory only: after a restart nothing stored is found")
        if t.wrong_bytes:
            t.note("no checksum: damaged files are served as hits")
        campaign.add(t)
