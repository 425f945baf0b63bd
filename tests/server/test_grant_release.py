"""Every load grant is released on every path (issue 18, hole 8): the client's copies
out of the arena fail at random, on every load path (copies from a lookup's hints while
the server pins, streamed disk reads, ordinary grants), and afterwards the server holds
no grant, the arena holds only replicas, and the client serves correct bytes.

A copy fails through its output buffer: a numpy subclass whose ``np.copyto`` raises
now and then (a copy that faults, as a bad or unmapped buffer would). Before the fix a
failed hinted copy raised out of the round trip before the reply's load was released,
and the server kept those extents pinned until the session ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client.handles import RemoteLookup
from kvlife.core.identity import PUBLIC
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc, quiet, wait_for

N = TINY.tokens_per_chunk
PROMPTS = 6
CHUNKS = 4


class CopyFault(RuntimeError):
    """An injected failure of the client's copy."""


class CopyIOFault(OSError):
    """The same as an OSError (which the client must not take for a lost connection)."""


class FlakyBuffer(np.ndarray):
    """An output buffer whose copies fail with probability ``p`` (drawn from ``rng``)."""

    rng: np.random.Generator
    p: float
    fault: type[Exception]

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.copyto and self.rng.random() < self.p:
            raise self.fault("injected: the copy into this buffer failed")
        return super().__array_function__(func, types, args, kwargs)


def flaky(rng: np.random.Generator, p: float, fault: type[Exception]) -> FlakyBuffer:
    buf = np.empty(TINY.chunk_shape, np.float16).view(FlakyBuffer)
    buf.rng, buf.p, buf.fault = rng, p, fault
    return buf


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServerProc, RemoteStore]]:
    srv = ServerProc(tmp_path / "store").start()
    store = srv.client()
    yield srv, store
    store.close()
    assert srv.stop() == 0


@pytest.mark.parametrize(("seed", "fault"), [(1, CopyFault), (2, CopyIOFault)])
def test_failed_copies_release_every_grant(
    served: tuple[ServerProc, RemoteStore], seed: int, fault: type[Exception]
) -> None:
    _, store = served
    rng = np.random.default_rng(seed)
    ident = tiny_identity()
    prompts = [prompt_kv(100 + i, CHUNKS * N) for i in range(PROMPTS)]
    for tokens, kv in prompts:
        store.put_prompt(ident, PUBLIC, tokens, kv)
    failed = {"hinted": 0, "grant": 0, "streamed": 0}
    for _ in range(120):
        i = int(rng.integers(PROMPTS))
        tokens, kv = prompts[i]
        where = str(rng.choice(["hinted", "grant", "streamed"]))
        if where == "streamed":  # disk hits: streamed grants while the server reads
            store.evict("dram", 1 << 40)
        else:
            store.drain()  # promotions back into DRAM have run
        lookup = store.lookup(ident, PUBLIC, tokens)
        assert isinstance(lookup, RemoteLookup)
        if where != "streamed" and not all(lookup.hints[1::2]):
            store.load(lookup)  # disk hits since an eviction: promoted back into DRAM
            store.drain()
            lookup = store.lookup(ident, PUBLIC, tokens)
            assert isinstance(lookup, RemoteLookup)
        if where == "hinted":
            assert all(lookup.hints[1::2]), "every hit in DRAM, with its place"
        if where == "grant":  # a lookup without hints: the grant path
            lookup = dataclasses.replace(lookup, hints=())
        outs = [flaky(rng, 0.3, fault) for _ in lookup.hits]
        try:
            res = store.load(lookup, outs)
        except fault:
            failed[where] += 1
            continue
        for j, arr in enumerate(res.arrays):  # what was loaded is right
            assert np.array_equal(np.asarray(arr), kv[:, :, :, j * N : (j + 1) * N])
    assert all(failed.values()), failed  # every path saw failures
    snap = quiet(store)  # the waiting releases go with it
    assert snap["loads"] == 0 and snap["held_loads"] == 0 and snap["held_grant_bytes"] == 0

    def only_replicas() -> bool:
        store.drain()
        s = store.server_state()
        return bool(s["arena_extents"] == s["shm_replicas"] + s["staged"])

    # (the extents staged for this client's next puts are its own, held by its session)
    wait_for(only_replicas, what="arena extents to be exactly the replicas and staged")
    # and the connection is in step: loads still serve the right bytes
    tokens, kv = prompts[0]
    got = store.get(ident, PUBLIC, tokens)
    assert got.loaded == CHUNKS
    assert np.array_equal(np.concatenate(got.arrays, axis=3), kv)
