"""A server's loads of disk hits read from their frames by the extension, without pins or
the I/O pool (issue 28, kvlife.store.frame_loads): loads into a session's shared buffers
and into arena extents (grants), streamed or not. Real ``kvlife serve`` processes, real
segment files: the bytes are the stored ones, the server counts ``frame_loads`` and the
tier's loads once, a frame corrupted on the disk is a counted miss with nothing after it
kept, and a server that promotes disk hits promotes the chunks a frame load counted."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.bench.server.loads import shared_chunks
from kvlife.client import RemoteStore
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.native import frames as native
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import disk_server, put_on_disk

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_chunk=32)
"""8 KiB chunks: a whole number of pages, as O_DIRECT reads them."""
N = LAYOUT.tokens_per_chunk
CHUNKS = 4
IDENT = ModelIdentity(layout=LAYOUT, model_id="frames", weights_digest="w0", tokenizer_digest="t0")


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProc]:
    server = disk_server(tmp_path / "store")
    yield server
    server.stop()


@pytest.fixture
def client(srv: ServerProc) -> Iterator[RemoteStore]:
    c = srv.client()
    yield c
    c.close()


def _on_disk(store: RemoteStore, seed: int) -> tuple[np.ndarray, list[bytes]]:
    return put_on_disk(store, IDENT, CHUNKS, seed)


def _shared(store: RemoteStore) -> list[np.ndarray]:
    return shared_chunks(store, LAYOUT, CHUNKS)


def _private() -> list[np.ndarray]:
    return [np.empty(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]


@pytest.mark.parametrize("into", ["shared", "private"])
@pytest.mark.parametrize("how", ["load", "load_async"])
def test_disk_loads_read_frames_exact_and_count_once(
    client: RemoteStore, into: str, how: str
) -> None:
    tokens, stored = _on_disk(client, 1)
    for round_ in range(2):
        lk = client.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        before = copy.deepcopy(client.counters)
        outs = _shared(client) if into == "shared" else _private()
        if how == "load":
            res = client.load(lk, outs)
        else:
            handle = client.load_async(lk, outs)
            for i in range(CHUNKS):
                got = handle.chunk(i, timeout=30)
                assert got is not None and got.tobytes() == stored[i]
            res = handle.wait(timeout=30)
        assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}, round_
        assert [a.tobytes() for a in res.arrays] == stored
        after = client.counters
        assert after.frame_loads - before.frame_loads == CHUNKS
        assert after.tier("disk").loaded - before.tier("disk").loaded == CHUNKS
        assert after.loads - before.loads == 1
        assert after.direct_loads == before.direct_loads == 0


@pytest.mark.parametrize("into", ["shared", "private"])
def test_a_corrupt_frame_is_a_counted_miss_with_nothing_after_it(
    srv: ServerProc, client: RemoteStore, into: str
) -> None:
    tokens, stored = _on_disk(client, 2)
    lk = client.lookup(IDENT, PUBLIC, tokens)
    frame = {f.key: f for f in scan_frames(srv.path)}[lk.hits[1].key]
    flip(frame.segment, frame.offset + HEADER_BYTES + 100, 1)
    before = copy.deepcopy(client.counters)
    outs = _shared(client) if into == "shared" else _private()
    res = client.load(lk, outs)
    assert res.loaded == 1 and res.corrupt == [lk.hits[1].key]
    assert res.arrays[0].tobytes() == stored[0]
    after = client.counters
    assert after.corrupt - before.corrupt == 1
    assert after.frame_loads - before.frame_loads == 1
    assert len(client.lookup(IDENT, PUBLIC, tokens).hits) == 1  # retired


def test_a_server_that_promotes_has_the_frame_loaded_chunks_promoted(tmp_path: Path) -> None:
    """A server that promotes disk hits (the default) reads them from their frames too,
    then promotes them into DRAM: the next lookup finds them there."""
    server = ServerProc(
        tmp_path / "store", dram=4 * MiB, disk=64 * MiB, staging=4 * MiB, extra=("--write-through",)
    ).start()
    try:
        c = server.client()
        tokens, stored = _on_disk(c, 3)
        lk = c.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        res = c.load(lk, _shared(c))
        assert res.loaded == CHUNKS and [a.tobytes() for a in res.arrays] == stored
        assert c.counters.frame_loads == CHUNKS
        c.drain()
        assert c.lookup(IDENT, PUBLIC, tokens).tiers() == {"dram": CHUNKS}
        assert c.counters.promotions == CHUNKS
        c.close()
    finally:
        server.stop()
