"""A served load without buffers hands out new arrays whose memory comes from the
client's pool and goes back to it, warm, once the caller drops the last view of one
(issue 28: fresh memory, faulted in page by page by the copy, made such a load several
times slower; the vLLM worker loads this way). A real ``kvlife serve``. The contract:
every array handed out holds its chunk's stored bytes, whatever the memory held before;
memory the caller still holds a view of is never handed out again; the arrays are
read-only; the pool keeps no more idle memory than the client had handed out at once."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from tests.conftest import prompt_kv
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import disk_server, put_on_disk

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=256)
"""512 KiB chunks."""
N = LAYOUT.tokens_per_chunk
CHUNKS = 3
IDENT = ModelIdentity(layout=LAYOUT, model_id="pool", weights_digest="w0", tokenizer_digest="t0")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[RemoteStore]:
    srv = ServerProc(tmp_path / "store", dram=32 * MiB, staging=16 * MiB).start()
    c = srv.client()
    yield c
    c.close()
    srv.stop()


def _put(store: RemoteStore, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    tokens, kv = prompt_kv(seed, CHUNKS * N, LAYOUT)
    store.put_prompt(IDENT, PUBLIC, tokens, kv)
    return tokens, [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N]) for i in range(CHUNKS)]


def _load(store: RemoteStore, tokens: np.ndarray) -> list[np.ndarray]:
    res = store.load(store.lookup(IDENT, PUBLIC, tokens))
    assert res.loaded == CHUNKS
    return list(res.arrays)


def _reused(store: RemoteStore) -> int:
    return store._loads._new_arrays.reused


def test_arrays_dropped_are_reused_and_hold_the_new_bytes(client: RemoteStore) -> None:
    a_tokens, a = _put(client, 1)
    b_tokens, b = _put(client, 2)
    first = _load(client, a_tokens)
    for got, want in zip(first, a, strict=True):
        assert np.array_equal(got, want) and not got.flags.writeable
    del first, got
    gc.collect()
    before = _reused(client)
    second = _load(client, b_tokens)  # the same sizes: the memory of the first load
    assert _reused(client) - before == CHUNKS
    for got, want in zip(second, b, strict=True):
        assert np.array_equal(got, want)


def test_memory_the_caller_still_holds_is_never_handed_out_again(client: RemoteStore) -> None:
    a_tokens, a = _put(client, 3)
    b_tokens, b = _put(client, 4)
    kept = _load(client, a_tokens)
    view = kept[1][2:, :, 1:]  # a view alone keeps the memory too
    del kept[1]
    for _ in range(4):
        again = _load(client, b_tokens)
        for got, want in zip(again, b, strict=True):
            assert np.array_equal(got, want)
        del again
        gc.collect()
    assert np.array_equal(kept[0], a[0]) and np.array_equal(kept[1], a[2])
    assert np.array_equal(view, a[1][2:, :, 1:])


def test_bytes_a_caller_wrote_into_a_dropped_array_never_reach_the_next_load(
    client: RemoteStore,
) -> None:
    """An array made writable again and scribbled on, then dropped: the next load that
    reuses its memory overwrites every byte."""
    a_tokens, _ = _put(client, 5)
    b_tokens, b = _put(client, 6)
    for arr in _load(client, a_tokens):
        arr.flags.writeable = True  # its base, the pool's memory, is writable
        arr.reshape(-1).view(np.uint8)[:] = 0xEE
        del arr
    gc.collect()
    before = _reused(client)
    for got, want in zip(_load(client, b_tokens), b, strict=True):
        assert np.array_equal(got, want)
    assert _reused(client) - before == CHUNKS


def test_idle_memory_is_bounded_by_what_was_handed_out_at_once(client: RemoteStore) -> None:
    """Loads of the same chunks one after another, each dropped: the pool keeps one
    load's memory idle, and the next load takes all of it."""
    tokens, _ = _put(client, 7)
    pool = client._loads._new_arrays
    for _ in range(3):
        _load(client, tokens)
        gc.collect()
    before = _reused(client)
    held = _load(client, tokens)  # takes back what the last load gave
    assert _reused(client) - before == CHUNKS
    assert pool.idle_bytes == 0
    del held
    gc.collect()
    _load(client, tokens)
    gc.collect()
    assert pool.idle_bytes <= CHUNKS * LAYOUT.chunk_nbytes  # never more than at once


def test_a_disk_load_without_buffers_copies_landed_bytes_into_pool_memory(
    tmp_path: Path,
) -> None:
    """The early copies of a streamed disk load (landed parts) go into the same pool's
    arrays; a chunk handed out holds its stored bytes, the second load reuses the first's
    memory."""
    srv = disk_server(tmp_path / "store", dram=8 * MiB, disk=64 * MiB)
    c = srv.client()
    try:
        tokens, stored = put_on_disk(c, IDENT, CHUNKS, 8)
        for round_ in range(2):
            lk = c.lookup(IDENT, PUBLIC, tokens)
            assert lk.tiers() == {"disk": CHUNKS}
            res = c.load(lk)
            assert res.loaded == CHUNKS
            for got, want in zip(res.arrays, stored, strict=True):
                assert got.tobytes() == want
            if round_ == 0:
                del res, got
                gc.collect()
                before = _reused(c)
        assert _reused(c) > before
    finally:
        c.close()
        srv.stop()


def test_a_chunk_replaced_between_lookup_and_load_is_never_handed_out_stale(
    client: RemoteStore,
) -> None:
    """DRAM hits of a load without buffers are copied from the lookup's hints into
    new arrays while the server confirms them: a prompt invalidated and put again with
    other bytes after the lookup gives a miss or the bytes stored now, never the old."""
    tokens, old = _put(client, 9)
    for round_ in range(6):
        lk = client.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"dram": CHUNKS}
        client.invalidate(namespace=PUBLIC)
        _, kv = prompt_kv(100 + round_, CHUNKS * N, LAYOUT)
        client.put_prompt(IDENT, PUBLIC, tokens, kv)  # the same keys, other bytes
        new = [np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N]) for i in range(CHUNKS)]
        res = client.load(lk)
        for i, got in enumerate(res.arrays):
            assert not got.flags.writeable
            assert np.array_equal(got, new[i]) and not np.array_equal(got, old[i])
        old = new
        del res
        gc.collect()
