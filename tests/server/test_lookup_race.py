"""Lookups and loads from several client processes raced against puts, evictions from
DRAM and invalidations on a real ``kvlife serve`` with DRAM and disk tiers: every chunk
a reader is served, by a hint of its lookup (a copy from where the replica lay, which
the server confirms), a grant or a disk read, holds that chunk's bytes; a chunk whose
extent went to another chunk meanwhile is a miss, never another chunk's bytes.

Marked slow (about 15 s of three client processes on a shared machine). It does not
reach the stale-hint case itself (a lookup, then its prompt invalidated, another put
into its extents and it put again, all before the load: three writer calls in a few
milliseconds): a server confirming every hint regardless passed it;
``test_held_a_stale_hint_whose_extent_holds_another_chunk_is_never_served`` in
test_lookup_pass_served.py makes that case happen in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import ROOT, ServerProc, child_env

SECONDS = 4


@pytest.mark.slow
def test_held_raced_lookups_and_loads_are_served_only_their_own_bytes(tmp_path: Path) -> None:
    # DRAM of 40 chunks for 8 prompts of 6: most lookups all in DRAM (hinted loads),
    # puts evict some to disk, invalidations free extents that puts then reuse
    srv = ServerProc(tmp_path / "srv", dram=40 << 10).start()
    try:
        roles = [("writer", 1), ("reader", 2), ("reader", 3)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.server.lookup_race_worker",
                    role,
                    str(srv.socket),
                    str(SECONDS),
                    str(seed),
                ],
                cwd=ROOT,
                env=child_env(),
                stdout=subprocess.PIPE,
            )
            for role, seed in roles
        ]
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
        codes = [p.returncode for p in procs]
    finally:
        srv.stop()
    assert codes == [0, 0, 0], outs
    ops = json.loads(outs[0])
    assert ops["put"] and ops["evict"] and ops["invalidate"], ops
    seen = [json.loads(o) for o in outs[1:]]
    assert all(s["loaded"] and s["all_dram"] for s in seen), seen
