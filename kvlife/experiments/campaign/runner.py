"""The campaign's configuration and its run: which parts, how many injections of each.

:class:`Budget` says how many injections each part gets; :data:`SHORT` is the default
(a test runs it in well under a minute), :data:`FULL` the ``--full`` campaign (at least
10,000 injections over at least 10 kinds and at least 1,000 SIGKILLs). Kinds are
interleaved in a seeded random order, so each fault meets a store that the faults
before it left behind. The SIGKILL rounds (and the served deployment, whose client
processes are forked too) run in a process of their own
(:mod:`kvlife.experiments.campaign.kill_driver`), which never starts a thread before it forks.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvlife.experiments.campaign import combos, lmcache, remote, vllm
from kvlife.experiments.campaign.embedded import (
    DAMAGE_KINDS,
    EmbeddedRig,
    damage_round,
    stale_catalog_round,
)
from kvlife.experiments.campaign.tally import Campaign, KindTally

PARTS = (
    "embedded",
    "combos",
    "kills",
    "serve",
    "redis",
    "mooncake",
    "lmcache",
    "lmcache-mp",
    "vllm",
)
DEFAULT_PARTS = PARTS[:-1]
"""What runs unless ``--parts`` says otherwise: all but vLLM (each of its injections
starts two or three engines, minutes on a CPU)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """Injections per part of the campaign."""

    per_kind: int
    """In-process kinds against the embedded store (each of the ten)."""
    slow: int
    """Slow I/O injections (each takes up to a second: fewer)."""
    stale: int
    """Stale-catalog rounds (close, restore, reopen)."""
    damage: int
    """Rounds of each on-disk damage kind (file truncated, byte flipped, restart)."""
    kills: int
    """SIGKILLs of writer processes at commit, demotion and compaction steps."""
    serve_kills: int
    """Client processes of ``kvlife serve`` SIGKILLed."""
    server_kills: int
    """``kvlife serve`` SIGKILLed and restarted."""
    remote: int
    """Injections per remote kind (time-out, partition, fenced publish) on Redis, and
    as many on Mooncake."""
    lmcache: int
    """Injections per LMCache fault kind."""
    lmcache_mp: int
    """Clients of LMCache's MP server SIGKILLed mid-STORE, per transfer mode."""
    vllm: int
    """Injections per vLLM kind (forward failing part-way, engine killed mid-step, one
    tensor-parallel rank's load failing)."""
    combos: int = 0
    """Drawn combinations of faults in one operation (after the named ones)."""
    kill_combos: int = 0
    """SIGKILLs of writers that lost one of their segment writes first."""
    probe: int = 3
    """Owed chunks checked after each in-process injection."""


SHORT = Budget(
    per_kind=8,
    slow=3,
    stale=2,
    damage=2,
    kills=18,
    serve_kills=4,
    server_kills=1,
    remote=3,
    lmcache=3,
    lmcache_mp=2,
    vllm=1,
    combos=8,
    kill_combos=4,
)
FULL = Budget(
    per_kind=1000,
    slow=150,
    stale=120,
    damage=120,
    kills=1000,
    serve_kills=150,
    server_kills=20,
    remote=100,
    lmcache=60,
    lmcache_mp=15,
    vllm=2,
    combos=400,
    kill_combos=100,
)


def run_embedded(root: Path, seed: int, b: Budget, campaign: Campaign) -> None:
    """The ten in-process kinds, interleaved, against one embedded store."""
    rig = EmbeddedRig(root / "embedded", seed)
    kinds: dict[str, Callable[[KindTally], None]] = {
        "bitflip-payload": lambda t: rig.inject_bitflip(t, "payload"),
        "bitflip-header": lambda t: rig.inject_bitflip(t, "header"),
        "lost-write": rig.inject_lost_write,
        "enospc": lambda t: rig.inject_errno_write(t, errno.ENOSPC),
        "eio-write": lambda t: rig.inject_errno_write(t, errno.EIO),
        "eio-read": rig.inject_eio_read,
        "slow-io": rig.inject_slow,
        "speculative-rollback": rig.inject_spec_rollback,
        "model-upgrade": rig.inject_model_upgrade,
    }
    order = [k for k in kinds for _ in range(b.slow if k == "slow-io" else b.per_kind)]
    rng = random.Random(seed)
    rng.shuffle(order)
    try:
        for name in order:
            t = campaign.tally(name, "embedded")
            before = t.injections
            for _ in range(5):  # a fault that did not fire (nothing to hit) is retried
                kinds[name](t)
                if t.injections > before:
                    break
            rig.probe(t, b.probe)
    finally:
        rig.close()
    t = campaign.tally("stale-catalog", "embedded")
    for i in range(b.stale):
        stale_catalog_round(root / "stale", seed * 10_000 + i, t)
    for kind in DAMAGE_KINDS:
        t = campaign.tally(kind, "embedded")
        for i in range(b.damage):
            damage_round(root / "damage", seed * 10_000 + i, kind, t)


def run_forked(
    root: Path, seed: int, b: Budget, parts: tuple[str, ...], campaign: Campaign
) -> None:
    """The SIGKILL rounds (those combined with a lost write too) and the served
    deployment, through the kill driver process."""
    out = root / "forked.json"
    cmd = [
        sys.executable,
        "-m",
        "kvlife.experiments.campaign.kill_driver",
        "--root",
        str(root / "forked"),
        "--kills",
        str(b.kills if "kills" in parts else 0),
        "--kill-combos",
        str(b.kill_combos if "combos" in parts else 0),
        "--serve-kills",
        str(b.serve_kills if "serve" in parts else 0),
        "--server-kills",
        str(b.server_kills if "serve" in parts else 0),
        "--seed",
        str(seed),
        "--json",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=dict(os.environ))
    doc = json.loads(out.read_text())
    for d in doc["tallies"]:
        t = KindTally(d["kind"], d["deployment"], d["system"])
        for k, v in d.items():
            if k in ("kind", "deployment", "system", "recovery_s", "recovery"):
                continue
            setattr(t, k, v)
        t.recovery_s = list(d["recovery"])
        campaign.add(t)
    campaign.skipped.extend(doc.get("skipped", []))


def run(
    root: Path,
    seed: int,
    full: bool,
    parts: tuple[str, ...] = DEFAULT_PARTS,
    done: Callable[[Campaign, str], object] | None = None,
) -> Campaign:
    """Run the campaign's ``parts`` under the private directory ``root``; ``done`` is
    called after each part (to save what is counted so far)."""
    b = FULL if full else SHORT
    campaign = Campaign(seed, full)
    steps: list[tuple[str, Callable[[], None]]] = [
        ("kills+serve+combos", lambda: run_forked(root, seed, b, parts, campaign)),
        ("embedded", lambda: run_embedded(root, seed, b, campaign)),
        ("combos", lambda: combos.run(root / "combos", seed, b.combos, campaign, b.probe)),
        ("redis", lambda: remote.run(root / "redis", seed, b.remote, campaign)),
        ("mooncake", lambda: remote.run_mooncake(root / "mooncake", seed, b.remote, campaign)),
        ("lmcache", lambda: lmcache.run(root / "lmcache", seed, b.lmcache, campaign)),
        ("lmcache-mp", lambda: lmcache.run_mp(root / "lmcache-mp", seed, b.lmcache_mp, campaign)),
        ("vllm", lambda: vllm.run(root / "vllm", seed, b.vllm, campaign)),
    ]
    for name, step in steps:
        if name not in parts and not set(name.split("+")) & set(parts):
            continue
        step()
        if done is not None:
            done(campaign, name)
    return campaign


def stamp() -> dict[str, object]:
    """Where and when the campaign ran."""
    return {
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
