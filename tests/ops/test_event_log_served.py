"""``kvlife serve --events FILE``: a served store writes its lifecycle events (schema v1)
for ``kvlife report --events``, the same log the embedded stores write; a restarted
server appends to it; a log it cannot write stops the server before it makes anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvlife.core.identity import PUBLIC
from kvlife.trace.events_io import read_events
from kvlife.trace.schema import validate_event
from tests.conftest import prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env


def test_a_served_store_logs_its_lifecycle_and_a_restart_appends(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    srv = ServerProc(tmp_path / "store", dram=64 * 4096, disk=4 << 20, extra=("--events", str(log)))
    srv.start()
    try:
        with srv.client() as c:
            tokens, kv = prompt_kv(7, 64)
            put = c.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
            hit = c.lookup(tiny_identity(), PUBLIC, tokens)
            assert c.load(hit).complete
            gone = c.invalidate(prefix=put.keys[2])
    finally:
        assert srv.stop() == 0
    first = log.read_text().splitlines()
    for line in first:
        validate_event(json.loads(line))
    events = read_events(log)
    keys = {bytes(k).hex() for k in put.keys}
    by_kind: dict[str, set[str]] = {}
    for e in events:
        by_kind.setdefault(e.kind, set()).add(e.key)
    assert len(keys) == 4 and by_kind["put"] == keys and by_kind["commit"] == keys
    assert by_kind["load"] == keys
    dropped = {bytes(k).hex() for k in put.keys[2:]}
    assert gone == 2 and by_kind["invalidate"] == dropped
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    srv.start()  # the same log: what recovery brings back is appended
    assert srv.stop() == 0
    after = log.read_text().splitlines()
    assert after[: len(first)] == first and len(after) > len(first)
    recovered = {e.key for e in read_events(log)[len(first) :] if e.kind == "recover"}
    assert recovered == keys - dropped


def test_an_event_log_in_a_missing_folder_stops_serve_leaving_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlife.cli",
            "serve",
            str(tmp_path / "store"),
            "--dram-bytes",
            str(1 << 20),
            "--events",
            str(tmp_path / "nodir" / "e.jsonl"),
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "kvlife: error:" in done.stderr, done.stderr
    assert "event log" in done.stderr
    assert list(tmp_path.iterdir()) == []
