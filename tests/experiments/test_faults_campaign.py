"""``kvlife experiment faults``: the short campaign runs end to end with real processes
(forked writers SIGKILLed at commit, demotion and compaction steps, a real ``kvlife
serve`` and its clients) and faults in combination within one operation, its JSON has
the documented shape and kvlife serves no wrong byte; and the checks are live: the
oracle catches one flipped bit, the campaign (single kinds and combinations) counts the
wrong bytes of a read path that hands out damaged arrays and the acknowledged data a
store loses silently, and the SIGKILL rounds count acknowledged data lost when a store
directory loses it."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from kvlife.experiments.campaign import combos, oracle
from kvlife.experiments.campaign.embedded import EmbeddedRig
from kvlife.experiments.campaign.kill_driver import one_round
from kvlife.experiments.campaign.kills import Ledger, Plan, tally_verification
from kvlife.experiments.campaign.payload import payload
from kvlife.experiments.campaign.tally import SCHEMA, KindTally
from kvlife.results import LoadResult, LookupResult
from kvlife.store import KVStore

ROOT = Path(__file__).resolve().parents[2]
KIND_FIELDS = {
    "kind",
    "deployment",
    "system",
    "injections",
    "sigkills",
    "detections",
    "served_chunks",
    "wrong_chunks",
    "wrong_bytes",
    "stale_served",
    "acked_lost",
    "lost_explained",
    "recomputed",
    "typed_errors",
    "recovery_s",
    "notes",
}


def _check_tallies(doc: dict[str, Any], system: str = "kvlife") -> dict[str, dict[str, Any]]:
    """The campaign JSON's shape, and ``system`` served no wrong or stale byte and lost
    nothing acknowledged; returns its rows by kind."""
    assert doc["schema"] == SCHEMA
    for k in doc["kinds"]:
        assert set(k) == KIND_FIELDS, k["kind"]
        assert set(k["recovery_s"]) == {"count", "p50", "max", "mean"}
    tot = doc["totals"][system]
    assert tot["wrong_bytes"] == 0 and tot["wrong_chunks"] == 0
    assert tot["stale_served"] == 0 and tot["acked_lost"] == 0
    return {k["kind"]: k for k in doc["kinds"] if k["system"] == system}


def _all_detected(kinds: dict[str, dict[str, Any]], names: Iterable[str]) -> None:
    """Every injection of each of ``names`` fired and was detected."""
    for name in names:
        assert kinds[name]["detections"] == kinds[name]["injections"] > 0, name


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_short_campaign_runs_with_zero_wrong_bytes_for_kvlife(tmp_path: Path) -> None:
    out, report = tmp_path / "f.json", tmp_path / "f.html"
    cmd = [sys.executable, "-m", "kvlife.cli", "experiment", "faults", "--json", str(out)]
    cmd += ["--report", str(report), "--parts", "embedded,combos,kills,serve,redis"]
    cmd += ["--seed", "3", "--workdir", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), timeout=300)
    doc = json.loads(out.read_text())
    assert doc["seed"] == 3 and doc["full"] is False
    kinds = _check_tallies(doc)
    tot = doc["totals"]["kvlife"]
    assert tot["kinds"] >= 10 and tot["sigkills"] >= 20 and tot["served_chunks"] > 0
    _all_detected(kinds, ("bitflip-payload", "bitflip-header", "lost-write", "enospc", "eio-read"))
    assert kinds["worker-restart"]["sigkills"] > 0 and kinds["server-sigkill"]["sigkills"] > 0
    assert any(k.startswith("sigkill-commit:") for k in kinds)
    _all_detected(kinds, ("remote-timeout", "remote-partition", "fenced-publish"))
    # every named combination fired (all its faults in one operation) and was detected
    _all_detected(kinds, (combos.row_name(op, faults) for op, faults in combos.NAMED))
    drawn = [k for k in kinds.values() if k["kind"].startswith("combo:")]
    assert sum(k["injections"] for k in drawn) >= len(combos.NAMED) + 4
    ops = {k["kind"].rsplit("@", 1)[1] for k in drawn}
    assert set(combos.OPERATIONS) < ops  # and SIGKILLs after a lost write:
    killed = [k for k in drawn if k["kind"].startswith("combo:lost-write+sigkill@commit:")]
    assert sum(k["injections"] for k in killed) > 0 and all(k["sigkills"] for k in killed)
    html = report.read_text()
    assert "data:image/png;base64," in html and "<table>" in html
    assert not list(tmp_path.glob("kvlife-faults-*")), "the scratch directory is removed"


def test_combinations_are_drawn_over_compatible_faults_only() -> None:
    assert all(combos.compatible(faults, op) for op, faults in combos.NAMED)
    # one channel each: two flips would replace each other; one fault ends the operation
    assert not combos.compatible(("bitflip-header", "bitflip-payload"), "load")
    assert not combos.compatible(("eio-read", "enospc"), "compaction")
    assert not combos.compatible(("stale-catalog", "eio-read"), "reopen")
    for seed in range(20):
        a = [combos.draw(random.Random(seed)) for _ in range(30)]
        assert a == [combos.draw(random.Random(seed)) for _ in range(30)]  # seeded
        for op, faults in a:
            assert 2 <= len(faults) <= 3 and combos.compatible(faults, op), (op, faults)


def test_the_oracle_catches_one_flipped_bit() -> None:
    key = bytes(range(32))
    good = payload(key)
    assert oracle.check([key], [good]).wrong_bytes == 0
    bad = good.copy().view(np.uint8)
    bad.reshape(-1)[1000] ^= 1
    v = oracle.check([key], [bad])
    assert (v.wrong_chunks, v.wrong_bytes) == (1, 1)
    assert oracle.wrong_bytes(key, good.tobytes()[:1024]) == 1024  # a truncated read


class _DamagingReads:
    """A store whose loads hand out one byte changed per array (a read path with its
    verification off): the campaign's oracle must count it."""

    def __init__(self, store: KVStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def load(self, found: LookupResult) -> LoadResult:
        res = self._store.load(found)
        arrays = []
        for a in res.arrays:
            b = np.array(a, copy=True)
            b.view(np.uint8).reshape(-1)[7] ^= 0x10
            arrays.append(b)
        res.arrays = arrays
        return res


def test_the_campaign_counts_wrong_bytes_from_a_damaging_read_path(tmp_path: Path) -> None:
    rig = EmbeddedRig(tmp_path, seed=5)
    try:
        honest = KindTally("eio-read", "embedded")
        for _ in range(3):
            rig.inject_eio_read(honest)
            rig.probe(honest, 3)
        assert honest.wrong_bytes == 0 and honest.served_chunks > 0
        rig.store = cast(KVStore, _DamagingReads(rig.store))
        t = KindTally("eio-read", "embedded")
        for _ in range(3):
            rig.inject_eio_read(t)
            rig.probe(t, 3)
        assert t.wrong_chunks == t.served_chunks > 0 and t.wrong_bytes == t.served_chunks
    finally:
        rig.close()


class _ForgetfulLoads(_DamagingReads):
    """A store whose loads come back empty with nothing reported (data lost silently)."""

    def load(self, found: LookupResult) -> LoadResult:
        res = self._store.load(found)
        res.arrays = []
        res.loaded = 0
        return res


def test_combinations_count_wrong_bytes_and_silent_losses(tmp_path: Path) -> None:
    rig = combos.Rig.make("put", tmp_path, seed=5)
    faults = ("eio-read", "slow-io")
    try:
        honest = KindTally("combo", "embedded")
        assert any(combos._op_load(rig, faults, honest) for _ in range(5))
        assert honest.wrong_bytes == honest.acked_lost == 0 and honest.served_chunks > 0
        real = rig.store
        rig.store = cast(KVStore, _DamagingReads(real))
        t = KindTally("combo", "embedded")
        combos._op_load(rig, faults, t)
        assert t.wrong_chunks == t.served_chunks > 0 and t.wrong_bytes == t.served_chunks
        rig.store = cast(KVStore, _ForgetfulLoads(real))
        lost = KindTally("combo", "embedded")
        combos._op_load(rig, faults, lost)
        assert lost.acked_lost > 0
    finally:
        rig.store = real
        rig.close()


def test_sigkill_rounds_count_acknowledged_data_a_store_lost(tmp_path: Path) -> None:
    rng = random.Random(0)
    ledger = Ledger("commit", 11)
    t = KindTally("sigkill-commit:fsynced", "embedded")
    assert one_round(tmp_path, ledger, Plan("commit", "fsynced", 6, 11, 0), 1, t, None, rng)
    assert t.sigkills == 1 and ledger.owed, "the writer acknowledged puts before the kill"
    check = Plan("commit", "frame-written", 1, 11, ledger.next_first, max_puts=0)
    one_round(tmp_path, ledger, check, 2, KindTally("verify", "embedded"), t, rng)
    assert t.acked_lost == 0 and t.detections == 1 and t.served_chunks == len(ledger.owed)
    owed = len(ledger.owed)
    shutil.rmtree(tmp_path / "store")  # a store that lost everything it acknowledged
    lost = KindTally("sigkill-commit:fsynced", "embedded")
    one_round(tmp_path, ledger, check, 3, KindTally("verify", "embedded"), lost, rng)
    assert lost.acked_lost == owed > 0 and lost.served_chunks == 0


def test_a_corrupt_chunk_after_a_kill_is_lost_unless_a_write_was_lost_on_purpose() -> None:
    lines: list[tuple[str, tuple[str, ...]]] = [("ready", ("0.01",)), ("dropped", ("1",))]
    lines += [("corrupt", ("ab",)), ("miss", ("cd",))]
    lines.append(("verified", ("5",)))
    plain = KindTally("sigkill-commit:fsynced", "embedded")
    assert tally_verification(lines, plain)
    assert plain.acked_lost == 2 and plain.lost_explained == 0
    combined = KindTally("combo:lost-write+sigkill@commit:fsynced", "embedded")
    assert tally_verification(lines, combined, lost_writes=True)
    # the corrupt chunk, and one missing chunk for the one frame recovery dropped
    assert combined.acked_lost == 0 and combined.lost_explained == 2
    lines.insert(3, ("miss", ("ef",)))  # a second miss: more than recovery reported
    over = KindTally("combo:lost-write+sigkill@commit:fsynced", "embedded")
    tally_verification(lines, over, lost_writes=True)
    assert over.acked_lost == 1


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="Mooncake runs in a private network namespace: root and unshare",
)
def test_remote_kinds_on_mooncake(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    cmd = [sys.executable, "-m", "kvlife.cli", "experiment", "faults", "--json", str(out)]
    cmd += ["--parts", "mooncake", "--workdir", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), timeout=300)
    doc = json.loads(out.read_text())
    assert not doc["skipped"], doc["skipped"]
    kinds = _check_tallies(doc)
    assert set(kinds) == {"remote-timeout", "remote-partition", "fenced-publish"}
    _all_detected(kinds, kinds)
    for k in kinds.values():
        assert k["deployment"] == "mooncake" and k["served_chunks"] > 0


@pytest.mark.skipif(
    not Path(os.environ.get("KVLIFE_LMCACHE_PYTHON", "/nonexistent")).exists(),
    reason="LMCache's interpreter (KVLIFE_LMCACHE_PYTHON) is not installed here",
)
def test_lmcache_disk_backend_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    cmd = [sys.executable, "-m", "kvlife.cli", "experiment", "faults", "--json", str(out)]
    cmd += ["--parts", "lmcache", "--workdir", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), timeout=300)
    doc = json.loads(out.read_text())
    kinds = {k["kind"]: k for k in doc["kinds"] if k["system"] == "lmcache"}
    assert set(kinds) == {"file-truncated", "file-bitflip", "restart"}
    # the oracle sees what LMCache serves: it has no checksum, damaged files are hits
    assert kinds["file-truncated"]["wrong_bytes"] > 0
    assert kinds["file-bitflip"]["wrong_bytes"] > 0


@pytest.mark.slow
@pytest.mark.skipif(
    not Path(os.environ.get("KVLIFE_LMCACHE_PYTHON", "/nonexistent")).exists(),
    reason="LMCache's interpreter (KVLIFE_LMCACHE_PYTHON) is not installed here",
)
def test_lmcache_mp_server_clients_killed_mid_store(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    cmd = [sys.executable, "-m", "kvlife.cli", "experiment", "faults", "--json", str(out)]
    cmd += ["--parts", "lmcache-mp", "--workdir", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), timeout=900)
    doc = json.loads(out.read_text())
    assert not doc["skipped"], doc["skipped"]
    kinds = {k["kind"]: k for k in doc["kinds"]}
    engine = kinds["client-killed-mid-store (engine_driven)"]
    assert engine["sigkills"] == 2 and engine["wrong_bytes"] == 0  # and its control was clean
    assert "client-killed-mid-store (lmcache_driven)" in kinds
