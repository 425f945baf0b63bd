"""Red team, issue 28 seam 3: staged extents matched by identity, offsets cached per
staged extent. A client that replays the ids of extents a put adopted (now replicas,
their offsets cached by the server at the time) must get a typed error and change no
replica's bytes; a put naming its own extents of another chunk layout (another dtype)
is a typed error that takes none of them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client import puts as client_puts
from kvlife.client.puts import copy_telling
from kvlife.core.errors import ProtocolError
from kvlife.core.identity import PUBLIC, token_bytes
from kvlife.server import protocol
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc, quiet, wait_for

N = TINY.tokens_per_chunk


def _args(tokens: np.ndarray, staged: list[int]) -> dict[str, object]:
    return {
        "identity": protocol.encode_identity(tiny_identity()),
        "namespace": str(PUBLIC),
        "tokens": token_bytes(tokens),
        "staged": staged,
    }


def _same(remote: RemoteStore, tokens: np.ndarray, kv: np.ndarray, n: int) -> None:
    got = remote.load(remote.lookup(tiny_identity(), PUBLIC, tokens))
    assert got.loaded == n
    for i, a in enumerate(got.arrays):
        want = kv[:, :, :, i * N : (i + 1) * N]
        assert np.array_equal(a.view(np.uint16), want.view(np.uint16))


def test_replaying_the_ids_of_adopted_extents_is_a_typed_error(remote: RemoteStore) -> None:
    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(61, 2 * N))  # stages 2 extents
    conn = remote._wire.conn
    assert conn is not None
    adopted = [sid for pool in conn.staged.values() for sid, _ in pool][:2]
    assert len(adopted) == 2
    tokens, kv = prompt_kv(62, 2 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)  # adopts them: replicas now
    _same(remote, tokens, kv, 2)
    # the replay: the server must not hand the replicas' extents out again
    with pytest.raises(ProtocolError, match="no staged extent"):
        remote._wire.call("put", _args(prompt_kv(63, 2 * N)[0], adopted))
    _same(remote, tokens, kv, 2)
    assert remote.lookup(ident, PUBLIC, prompt_kv(63, 2 * N)[0]).hits == []
    # and the pool goes on: later puts exact, the replicas untouched
    for seed in range(64, 68):
        t, k = prompt_kv(seed, 2 * N)
        remote.put_prompt(ident, PUBLIC, t, k)
        _same(remote, t, k, 2)
    _same(remote, tokens, kv, 2)
    state = quiet(remote)
    assert state["arena_extents"] == int(str(state["shm_replicas"])) + int(str(state["staged"]))


def test_a_put_of_another_dtype_on_staged_extents_is_a_typed_error_that_takes_none(
    remote: RemoteStore,
) -> None:
    from dataclasses import replace

    from kvlife.core.identity import ModelIdentity

    ident = tiny_identity()
    remote.put_prompt(ident, PUBLIC, *prompt_kv(71, 2 * N))  # stages 2 float16 extents
    conn = remote._wire.conn
    assert conn is not None
    mine = [sid for pool in conn.staged.values() for sid, _ in pool][:2]
    assert len(mine) == 2
    staged_before = quiet(remote)["staged"]
    other = ModelIdentity(
        layout=replace(TINY, dtype="bfloat16"),
        model_id="tiny",
        weights_digest="w0",
        tokenizer_digest="t0",
    )
    args = _args(prompt_kv(72, 2 * N)[0], mine)
    args["identity"] = protocol.encode_identity(other)
    with pytest.raises(ProtocolError, match="not a chunk of this put's layout"):
        remote._wire.call("put", args)
    assert quiet(remote)["staged"] == staged_before  # none taken
    assert remote.lookup(other, PUBLIC, prompt_kv(72, 2 * N)[0]).hits == []
    # the extents are still this session's: the next float16 put adopts them, exact
    tokens, kv = prompt_kv(73, 2 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)
    _same(remote, tokens, kv, 2)


def test_a_deferred_put_that_fails_its_prepare_holds_no_extent_after_its_session(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deferred put naming its staged extents and an id the session does not hold
    fails typed at its commit; when its session ends the extents it named go back to
    the arena at once. Its error was kept with its traceback, whose frames held them in
    a reference cycle that only the collector freed (after a full collection froze it:
    up to ``--gc-whole-every``), so other clients' puts found the arena full (found by
    a red team, 2026-12-06). Checked with ``stats``, which collects nothing."""
    ident = tiny_identity()
    with server.client() as observer:
        for attempt in range(3):
            attacker = server.client()
            attacker.put_prompt(ident, PUBLIC, *prompt_kv(80 + attempt, 2 * N))  # stages 2
            real = attacker._puts.take_staged

            def plus_unknown(shape: object, count: int, real: Any = real) -> Any:
                got = real(shape, count - 1)
                assert got is not None
                conn, extents = got
                return conn, [*extents, [999_999, extents[0][1]]]

            monkeypatch.setattr(attacker._puts, "take_staged", plus_unknown)

            def freeze_first(*args: Any, copy: Any = copy_telling, **kw: Any) -> None:
                # once the server has failed the deferred put's prepare (its frames are
                # read in order; a moment is ample), a whole collection (info) freezes
                # what is live, the put's error among it
                time.sleep(0.3)
                observer.server_info()
                copy(*args, **kw)

            monkeypatch.setattr(client_puts, "copy_telling", freeze_first)
            with pytest.raises(ProtocolError, match="no staged extent 999999"):
                attacker.put_prompt(ident, PUBLIC, *prompt_kv(90 + attempt, 2 * N))
            attacker.close()
            monkeypatch.undo()
        quiet_stats = _settled_stats(observer)
        dram = next(t for t in quiet_stats["tiers"] if t["name"] == "dram")
        # every extent in use is a replica's: none held by a failed put's error
        assert quiet_stats["arena"]["arena_used_bytes"] == dram["used_bytes"]
        assert quiet_stats["arena"]["arena_extents"] == 6  # three puts of two chunks


def _settled_stats(store: RemoteStore) -> dict[str, Any]:
    """``stats`` once only this connection remains (no collection on the way)."""
    box: dict[str, Any] = {}

    def settled() -> bool:
        box.update(store.server_stats())
        return bool(box["sessions"] == 1)

    wait_for(settled, what="one session left")
    return box
