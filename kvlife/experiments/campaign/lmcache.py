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
import time
from pathlib import Path

from kvlife.experiments.campaign.tally import Campaign, KindTally

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
    cmd = [python, "-m", "kvlife.experiments.campaign.lmcache_child"]
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


def run_mp(root: Path, seed: int, n: int, campaign: Campaign) -> None:
    """LMCache's MP server side by side (its own part: each run starts a server)."""
    python = os.environ.get(ENV, "")
    if not python or not Path(python).exists():
        campaign.skipped.append(f"lmcache-mp: no LMCache interpreter ({ENV} is not set)")
        return
    root.mkdir(parents=True, exist_ok=True)
    _run_mp(Path(python), root, seed, n, campaign)


def _run_mp(python: Path, root: Path, seed: int, n: int, campaign: Campaign) -> None:
    """LMCache's MP server: ``n`` clients SIGKILLed mid-STORE per transfer mode, then a
    new client retrieves every hit (:mod:`.lmcache_mp_child`). A control run first (each
    client killed only after its STORE returned) must serve every hit right in
    ``engine_driven`` mode, or the check itself is wrong and the part is skipped."""
    from kvlife.bench.peer_lmcache_mp import _env, _MPServer

    for mode in ("engine_driven", "lmcache_driven"):
        results = {}
        for run in ("control", "kill"):
            srv = _MPServer(python, 32, 1.0, root / f"mp-{mode}-{run}.log", ())
            out = root / f"mp-{mode}-{run}.json"
            try:
                srv.wait_ready(time.monotonic() + 600)
                cmd = [str(python), "-m", "kvlife.experiments.campaign.lmcache_mp_child", srv.url]
                cmd += [mode, str(n if run == "kill" else 2), str(seed), str(out), run]
                proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1800)
            finally:
                srv.stop()
            if proc.returncode != 0 or not out.exists():
                campaign.skipped.append(
                    f"lmcache-mp {mode}: the client failed: {proc.stderr[-300:]}"
                )
                break
            results[run] = json.loads(out.read_text())
        else:
            control, got = results["control"], results["kill"]
            if mode == "engine_driven" and control["wrong_bytes"]:
                campaign.skipped.append("lmcache-mp: the control run served wrong bytes")
                return
            t = KindTally(f"client-killed-mid-store ({mode})", "mp-server", "lmcache")
            t.injections = t.sigkills = got["kills"]
            t.served_chunks = got["served_chunks"]
            t.wrong_chunks = got["wrong_chunks"]
            t.wrong_bytes = got["wrong_bytes"]
            t.note(
                f"control (killed after STORE returned): {control['served_chunks']} chunks "
                f"served, {control['wrong_bytes']} bytes wrong"
            )
            if mode == "lmcache_driven" and got["wrong_bytes"]:
                t.note(
                    "a new client's RETRIEVE reports success but the server scatters into "
                    "the first registered client's memory (LMCache's ServerBenchClient "
                    "clients share one identity): the new client's blocks stay unwritten"
                )
            campaign.add(t)
