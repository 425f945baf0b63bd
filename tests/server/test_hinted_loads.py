"""Loads that copy DRAM hits from where the lookup saw them, while the server pins them:
the server confirms a copy only if the extent still holds the replica the lookup named
(same offset, same allocation generation). An extent freed and reused by another put,
a replica replaced, a lookup from before a server restart: never the wrong bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client.handles import RemoteLookup
from kvlife.core.errors import ProtocolError, StoreUnavailable
from kvlife.core.identity import PUBLIC
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc

N = TINY.tokens_per_chunk


def _outs(n: int) -> list[np.ndarray]:
    return [np.zeros(TINY.chunk_shape, np.float16) for _ in range(n)]


def _exact(arrays: list[np.ndarray], kv: np.ndarray) -> bool:
    return all(
        np.array_equal(a.view(np.uint16), kv[:, :, :, i * N : (i + 1) * N].view(np.uint16))
        for i, a in enumerate(arrays)
    )


def test_a_fresh_lookup_is_loaded_from_its_hints(remote: RemoteStore) -> None:
    tokens, kv = prompt_kv(61, 3 * N)
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    lk = remote.lookup(tiny_identity(), PUBLIC, tokens)
    assert isinstance(lk, RemoteLookup) and len(lk.hints) == 6 and all(lk.hints[1::2])
    confirmed: list[int] = []
    roundtrip = remote._wire.roundtrip

    def spy(conn: object, verb: str, *rest: object) -> object:
        r = roundtrip(conn, verb, *rest)  # type: ignore[arg-type]
        if verb == "load":
            confirmed.append(r["confirmed"])
            assert r["grants"] == [], "confirmed chunks get no grant"
        return r

    remote._wire.roundtrip = spy  # type: ignore[method-assign,assignment]
    outs = _outs(3)
    got = remote.load(lk, outs)
    remote._wire.roundtrip = roundtrip  # type: ignore[method-assign]
    assert confirmed == [3]
    assert got.loaded == 3 and all(a is o for a, o in zip(got.arrays, outs, strict=True))
    assert _exact(got.arrays, kv)


def test_an_extent_reused_by_another_put_is_never_served_from_the_hint(
    remote: RemoteStore,
) -> None:
    ident = tiny_identity()
    tokens, kv = prompt_kv(62, 2 * N)
    remote.put_prompt(ident, PUBLIC, tokens, kv)
    stale = remote.lookup(ident, PUBLIC, tokens)
    assert isinstance(stale, RemoteLookup)
    remote.invalidate(prefix=stale.hits[0].key)  # the extents go back to the arena
    others = []
    for seed in (63, 64, 65):  # staged extents go first, then the freed ones
        other_tokens, other_kv = prompt_kv(seed, 2 * N)
        remote.put_prompt(ident, PUBLIC, other_tokens, other_kv)
        other = remote.lookup(ident, PUBLIC, other_tokens)
        assert isinstance(other, RemoteLookup)
        others.append((other, other_kv))
    reused = set(stale.hints[0::2]) & {o for other, _ in others for o in other.hints[0::2]}
    assert reused, "first fit: another prompt took the freed extents"
    # the stale lookup's chunks are gone: a miss, whatever the extents hold now
    assert remote.load(stale, _outs(2)).loaded == 0
    # stored again elsewhere: the same keys load, through grants, with their own bytes
    remote.put_prompt(ident, PUBLIC, tokens, kv)
    got = remote.load(stale, _outs(2))
    assert got.loaded == 2 and _exact(got.arrays, kv)
    for other, other_kv in others:
        assert _exact(remote.load(other, _outs(2)).arrays, other_kv)


def test_forged_hints_are_never_confirmed(remote: RemoteStore) -> None:
    tokens, kv = prompt_kv(64, 2 * N)
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    lk = remote.lookup(tiny_identity(), PUBLIC, tokens)
    assert isinstance(lk, RemoteLookup)
    args = {
        "keys": b"".join(h.key for h in lk.hits),
        "starts": [h.start for h in lk.hits],
        "chunks_total": lk.chunks_total,
    }
    offs, gens = lk.hints[0::2], lk.hints[1::2]
    for hints in ([offs[0], gens[0] + 1, offs[1], gens[1]], [offs[1], gens[1], offs[0], gens[0]]):
        r = remote._wire.call("load", {**args, "hints": hints})
        assert r["confirmed"] == 0 and len(r["grants"]) == 2
        remote._wire.release(r["load"], remote._wire.conn)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="two per key"):
        remote._wire.call("load", {**args, "hints": [offs[0], gens[0]]})


def test_a_lookup_from_before_a_restart_loads_its_own_bytes_or_misses(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "store").start()
    try:
        client = srv.client()
        tokens, kv = prompt_kv(65, 2 * N)
        client.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
        client.flush()
        old = client.lookup(tiny_identity(), PUBLIC, tokens)
        srv.kill()
        srv.start()
        other_tokens, other_kv = prompt_kv(66, 2 * N)
        with RemoteStore(srv.socket, timeout=30) as writer:  # fills the new arena first
            writer.put_prompt(tiny_identity(), PUBLIC, other_tokens, other_kv)
        with pytest.raises(StoreUnavailable):
            client.load(old, _outs(2))
        got = client.load(old, _outs(2))  # reconnected: no hints of the old arena used
        assert _exact(got.arrays, kv)
        client.close()
    finally:
        srv.stop()


def test_part_of_a_lookup_keeps_its_hints_and_loads_its_own_chunks(remote: RemoteStore) -> None:
    tokens, kv = prompt_kv(67, 4 * N)
    remote.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
    lk = remote.lookup(tiny_identity(), PUBLIC, tokens)
    assert isinstance(lk, RemoteLookup)
    part = lk.sub(1, 3)
    assert isinstance(part, RemoteLookup) and part.identity == lk.identity
    assert [h.index for h in part.hits] == [1, 2] and part.hints == lk.hints[2:6]
    assert lk.sub(3, 9).hints == lk.hints[6:8] and lk.sub(5, 9).hints == ()
    confirmed: list[int] = []
    roundtrip = remote._wire.roundtrip

    def spy(conn: object, verb: str, *rest: object) -> object:
        r = roundtrip(conn, verb, *rest)  # type: ignore[arg-type]
        if verb == "load":
            confirmed.append(r["confirmed"])
        return r

    remote._wire.roundtrip = spy  # type: ignore[method-assign,assignment]
    got = remote.load(part, _outs(2))
    remote._wire.roundtrip = roundtrip  # type: ignore[method-assign]
    assert confirmed == [2] and got.loaded == 2
    assert _exact(got.arrays, kv[:, :, :, N : 3 * N])
