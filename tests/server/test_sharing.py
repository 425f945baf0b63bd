"""Several client processes share one server: each puts its own prompts and a shared
set, then loads every worker's prompts and verifies every byte it is served."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server.conftest import ROOT, ServerProc, child_env, quiet

WORKERS = 3
PROMPTS = 6


def test_client_processes_share_one_store(server: ServerProc) -> None:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.server.workers",
                "share",
                str(server.socket),
                str(w),
                str(WORKERS),
                str(PROMPTS),
            ],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for w in range(WORKERS)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()
        results.append(json.loads(out))
    # every chunk of every worker's prompts and of the shared ones was served, verified
    for r in results:
        assert r["loaded"] == r["chunks"] == (WORKERS + 1) * PROMPTS * 4
    with server.client() as c:
        snap = quiet(c)
        assert snap["puts"] == snap["loads"] == snap["tentative"] == 0
        info = c.info()
        # each worker's own prompts once, the shared prompts once (not once per worker)
        assert info.objects_by_state["indexed"] == (WORKERS + 1) * PROMPTS * 4
        assert c.counters.chunks_stored == (WORKERS + 1) * PROMPTS * 4
