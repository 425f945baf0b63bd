"""vLLM's connector under ``kvlife serve --tenants`` (issue 24, "every engine path carries
the tenant"), a real vLLM against a real server with principals.

One conversation of two turns, prefilled in steps of 128 tokens (so a turn's chunks
are saved over several steps, each later save chained after the chunks before it):
turn 2 must load every chunk turn 1 saved, as many as against a server without
principals, and another principal sending the identical prompt under the identical
``cache_salt`` must hit nothing of it. The engine of the conversation is the principal
of its Unix user (``SO_PEERCRED``: its sessions map its own arena); the other engine
names its principal by a token (``kvlife.token_file``: its sessions map no arena, so its
puts and loads go through the socket).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from tests.server.conftest import MiB, ServerProc
from tests.server.tenants import TOKENS, tenant_server, write_config
from tests.vllm.conftest import run_engine, tiny_spec

CHUNK = 64
STEP = 128
"""Tokens vLLM prefills per step (``max_num_batched_tokens``)."""
rng = np.random.default_rng(24)
TURN1 = [int(t) for t in rng.integers(5, 1000, size=5 * CHUNK + 10)]
TURN2 = TURN1 + [int(t) for t in rng.integers(5, 1000, size=2 * CHUNK + 17)]
SALT = "conversation-1"
NEW = 8


def _spec(model: Path, socket: Path, token_file: Path | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "kvlife.socket": str(socket),
        "kvlife.chunk_tokens": CHUNK,
        # each cache_salt a request scope: under --tenants the principal's own, keyed
        "kvlife.salt_kind": "request",
    }
    if token_file is not None:
        extra["kvlife.token_file"] = str(token_file)
    turns = [{"tokens": t, "max_tokens": NEW, "cache_salt": SALT} for t in (TURN1, TURN2)]
    return tiny_spec(model, turns, extra, max_num_batched_tokens=STEP)


def _cached(run: dict[str, Any]) -> list[int]:
    return [r["cached_tokens"] for r in run["requests"]]


def _outputs(run: dict[str, Any]) -> list[list[int]]:
    return [r["output_ids"] for r in run["requests"]]


def test_a_conversation_under_tenants_loads_what_it_saved_and_no_one_else_does(
    tiny_model: Path, tmp_path: Path
) -> None:
    plain = ServerProc(tmp_path / "plain", dram=64 * MiB, disk=64 * MiB).start()
    try:
        ref = run_engine(_spec(tiny_model, plain.socket), tmp_path, "plain")
    finally:
        plain.stop()
    # the reference: turn 2 loads turn 1's five full chunks from kvlife
    assert _cached(ref) == [0, 5 * CHUNK]

    config = write_config(tmp_path / "tenants.toml", bob_uid=os.geteuid())
    token_file = tmp_path / "alice.token"
    token_file.write_text(TOKENS["alice"])
    token_file.chmod(0o600)
    srv = tenant_server(tmp_path / "tenants", config, dram=64 * MiB).start()
    try:
        bob = run_engine(_spec(tiny_model, srv.socket), tmp_path, "bob")
        alice = run_engine(_spec(tiny_model, srv.socket, token_file), tmp_path, "alice")
    finally:
        srv.stop()

    # bob's turn 2 finds every chunk his turn 1 saved over three steps, as without
    # principals, and computes the same tokens
    assert _cached(bob) == _cached(ref)
    assert _outputs(bob) == _outputs(ref)
    worker = bob["counters"]["worker"]
    assert worker["put_errors"] == 0 and worker["blocks_failed"] == 0
    assert worker["tiers"] == {"dram": 5}
    # alice's identical prompt under the identical salt hits nothing of bob's; her own
    # turn 1, saved through the socket, is hers to load in her turn 2
    assert _cached(alice) == [0, 5 * CHUNK]
    assert _outputs(alice) == _outputs(ref)
    assert alice["counters"]["worker"]["put_errors"] == 0
