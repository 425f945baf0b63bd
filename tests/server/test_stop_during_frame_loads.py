"""A server stopped while its clients' disk loads are under way (issue 28's native load
paths under close). The extension reads those frames on threads of its own, into a
session's shared buffer, into arena extents a load grants, or, for a client with direct
reads, in the client (the server confirms them): a stop (SIGTERM) that tore down an
arena, a session or the store under those reads would crash the server or hand out
bytes that are not the stored ones. Real ``kvlife serve`` processes, real segment files:
each stop lands at a random moment of three clients' loads in a loop, the server exits 0,
every load that returned whole holds the stored bytes, the clients see only the typed
``StoreUnavailable``, and the store restarted on the same directory serves the prompt
whole again."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvlife.bench.server.loads import shared_chunks
from kvlife.client import RemoteStore
from kvlife.core.errors import StoreUnavailable
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.native import frames as native
from tests.server.conftest import MiB, ServerProc
from tests.server.direct_rig import disk_server, put_on_disk

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

LAYOUT = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=512)
"""6 MiB chunks: the last frame of each load is read in pieces (``native.DEFAULT_PIECE``)."""
CHUNKS = 3
IDENT = ModelIdentity(layout=LAYOUT, model_id="stop", weights_digest="w0", tokenizer_digest="t0")
KINDS = ("ordinary", "shared", "direct")
"""Loads into the caller's own buffers (the server reads into arena extents it grants),
into the session's shared buffer (the server reads into it), and by a client that reads
the frames itself."""


def _loader(
    srv: ServerProc,
    kind: str,
    tokens: np.ndarray,
    stored: list[bytes],
    stop: threading.Event,
    done: dict[str, int],
    errors: list[BaseException],
) -> None:
    try:
        store = RemoteStore(srv.socket, timeout=30, direct_reads=kind == "direct")
    except BaseException as exc:
        errors.append(exc)
        return
    try:
        if kind == "ordinary":
            outs = [np.zeros(LAYOUT.chunk_shape, np.float16) for _ in range(CHUNKS)]
        else:  # chunk views of one shared buffer of the session
            outs = shared_chunks(store, LAYOUT, CHUNKS)
        while not stop.is_set():
            lk = store.lookup(IDENT, PUBLIC, tokens)
            res = store.load(lk, outs)
            if res.loaded == CHUNKS:  # whole: every byte the stored one
                assert [a.tobytes() for a in res.arrays] == stored, kind
                done[kind] += 1
    except StoreUnavailable:
        pass  # the server stopped: the typed error a client is promised
    except BaseException as exc:
        errors.append(exc)
    finally:
        with contextlib.suppress(StoreUnavailable):
            store.close()


def test_a_server_stopped_during_frame_loads_exits_cleanly_and_serves_them_whole_after(
    tmp_path: Path,
) -> None:
    rng = random.Random(28)
    path = tmp_path / "store"
    srv = disk_server(path, dram=24 * MiB, disk=128 * MiB)
    with srv.client() as setup:
        tokens, stored = put_on_disk(setup, IDENT, CHUNKS, seed=5)
    for _ in range(3):
        stop = threading.Event()
        done = dict.fromkeys(KINDS, 0)
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_loader, args=(srv, k, tokens, stored, stop, done, errors))
            for k in KINDS
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while min(done.values()) < 2 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.05))  # a random moment of the loads in flight
        assert srv.stop() == 0, srv.log.read_text()[-3000:]
        stop.set()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
        assert not errors, errors
        assert min(done.values()) >= 2, done  # every kind of load ran before the stop
        srv.start()
    with srv.client() as after:
        lk = after.lookup(IDENT, PUBLIC, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        res = after.load(lk, None)
        assert res.loaded == CHUNKS
        assert [a.tobytes() for a in res.arrays] == stored
    assert srv.stop() == 0
