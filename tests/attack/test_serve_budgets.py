"""Attacks on the budgets of ``kvlife serve`` (issue 19; docs/server.md, "Limits"):
false refusals of an ordinary client and a per-session budget a client evades by
opening a second connection. Real server processes, real client processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env

N = TINY.tokens_per_chunk
WIDE = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=32)
"""128 KiB chunks: a few dozen make a long prompt of a small model."""


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    s = ServerProc(tmp_path / "store").start()  # 8 MiB DRAM + 4 MiB staging: 12 MiB arena
    yield s
    assert s.stop() == 0


def test_a_lone_client_may_put_a_prompt_larger_than_half_the_arena(srv: ServerProc) -> None:
    """Issue 19 asked that "a session may not take more than its share *while others
    wait*". The embedded store with the same 8 MiB DRAM stores this 7 MiB prompt; over
    the server, with nobody else connected, it is refused outright."""
    identity = ModelIdentity(model_id="m", weights_digest="w", tokenizer_digest="t", layout=WIDE)
    rng = np.random.default_rng(0)
    n = 56  # 7 MiB: over half of the 12 MiB arena, under the 8 MiB DRAM budget
    tokens = rng.integers(0, 50_000, n * WIDE.tokens_per_chunk)
    kv = rng.standard_normal(
        (WIDE.num_layers, 2, WIDE.num_kv_heads, len(tokens), WIDE.head_dim)
    ).astype(np.float16)
    with srv.client() as client:
        assert client.server_state()["sessions"] == 1
        res = client.put_prompt(identity, PUBLIC, tokens, kv)
        assert res.stored == n
        got = client.get(identity, PUBLIC, tokens)
        assert got.loaded == n and np.array_equal(got.arrays[-1], kv[:, :, :, -32:, :])


HOG = textwrap.dedent(
    """
    import sys, time
    from kvlife.client import RemoteStore
    from kvlife.core.errors import LimitExceeded
    from kvlife.core.identity import PUBLIC
    from tests.conftest import TINY, prompt_kv, tiny_identity

    held = []
    for conn in range(2):  # one client process, two connections
        store = RemoteStore(sys.argv[1], timeout=30)
        try:
            for seed in range(100):
                tokens, kv = prompt_kv(1000 * conn + seed, 64 * TINY.tokens_per_chunk)
                held.append((store, store.prepare_put(tiny_identity(), PUBLIC, tokens, kv)))
        except LimitExceeded:
            pass
    print("ready", len(held), flush=True)
    sys.stdin.readline()
    """
)


def test_a_second_connection_does_not_double_a_clients_share(srv: ServerProc) -> None:
    """docs/server.md: ``--session-put-share`` means "one client cannot take the arena
    from the others". A hog process opens two connections, fills each one's share with
    uncommitted tiny-chunk puts, and waits; an ordinary client's put then fails."""
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(srv.socket)],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None
        line = hog.stdout.readline()
        assert line.startswith("ready"), line
        # a prompt of its own: the hog's seeds are 0-99 and 1000-1099 (a put of the hog's
        # pending chunks would leave them to the hog: stored 0, in flight 64)
        tokens, kv = prompt_kv(5000, 64 * N)
        with srv.client() as other:
            try:
                stored = other.put_prompt(tiny_identity(), PUBLIC, tokens, kv).stored
            except KVLifeError as exc:
                pytest.fail(f"a client with two connections took the arena: {exc}")
            assert stored == 64
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(timeout=60)


def test_identities_a_client_sends_are_not_held_without_a_budget(srv: ServerProc) -> None:
    """Issue 19: budgets for everything a client can make the server hold. A lookup's
    identity is decoded once per session and kept (a lookup repeats its identity); 64
    distinct identities of maximal strings per connection stay held until it closes."""
    from kvlife.server import protocol
    from tests.server.test_limits import Raw

    base = protocol.encode_identity(tiny_identity())
    fields = [k for k, v in base.items() if isinstance(v, str) and k != "layout"]
    with srv.client() as client:
        client.server_state()
        rss0, _ = srv.rss()
        conns = [Raw(srv.socket) for _ in range(20)]
        try:
            rid = 1
            for ci, conn in enumerate(conns):
                for j in range(64):
                    ident = dict(base)
                    for f in fields:
                        ident[f] = f"{ci}-{j}-{f}-".ljust(4096, "x")
                    conn.send(
                        rid,
                        "lookup",
                        {"identity": ident, "namespace": "public", "tokens": b"\0" * 64},
                    )
                    assert conn.reply()[1] is True
                    rid += 1
            rss, _ = srv.rss()
            assert rss - rss0 < 16 << 20, f"+{(rss - rss0) >> 20} MiB held for 20 sessions"
        finally:
            for conn in conns:
                conn.close()
