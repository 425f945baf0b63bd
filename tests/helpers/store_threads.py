"""Store calls on threads of their own, for the attack tests that hold a call in the
file seam (``FaultyIO.stall``) and let another run meanwhile: the call's result or
exception kept, joins bounded, stalls released."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvlife.core.events import EventSink
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.faults.fileio import FaultyIO, Stall
from kvlife.store import KVStore
from tests.conftest import TINY

N = TINY.tokens_per_chunk


def open_small(
    path: Path,
    io: FaultyIO | None = None,
    *,
    sink: EventSink | None = None,
    promote: bool = False,
    write_through: bool = False,
    dram_bytes: int = 1 << 20,
    disk_bytes: int = 16 << 20,
) -> KVStore:
    """The small store of the close-race and failed-delete attacks: DRAM over a 16 MiB
    disk tier of 1 MiB segments (``io``: the file seam, to stall or fail its calls)."""
    return KVStore.open(
        path,
        dram_bytes=dram_bytes,
        disk_bytes=disk_bytes,
        segment_bytes=1 << 20,
        promote_on_hit=promote,
        write_through=write_through,
        sink=sink,
        fileio=io,
    )


def assert_exact(arrays: list[np.ndarray], kv: np.ndarray) -> None:
    """Each array is the chunk of ``kv`` at its position."""
    for i, arr in enumerate(arrays):
        assert np.array_equal(arr, chunk_of(kv, i)), f"chunk {i} served other KV"


def reopen_clean(
    path: Path,
    identity: ModelIdentity,
    prompts: Sequence[tuple[np.ndarray, np.ndarray, int | None]],
) -> None:
    """The directory reopens (:func:`open_small`), audits clean, and serves each prompt's
    ``n`` chunks exact (``n`` None: any number of leading chunks, each exact)."""
    with open_small(path) as again:
        assert again.check().problems == []
        for tokens, kv, n in prompts:
            got = again.get(identity, PUBLIC, tokens)
            if n is not None:
                assert got.loaded == n, (got.loaded, n)
            assert_exact(got.arrays, kv)


class CloseOnce:
    """A callback (``check()``'s ``progress``) that closes ``store`` the first time it is
    called; ``calls`` keeps what that ``close()`` did (None, or its exception)."""

    def __init__(self, store: KVStore, flush: bool = False) -> None:
        self.store = store
        self.flush = flush
        self.calls: list[BaseException | None] = []

    def __call__(self, _: object) -> None:
        if not self.calls:
            try:
                self.store.close(flush=self.flush)
                self.calls.append(None)
            except BaseException as exc:  # reported by the test
                self.calls.append(exc)


class Call:
    """A store call on a thread of its own; its result or exception kept."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # reported by the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 30.0) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "a store call never returned (deadlock?)"

    def alive(self) -> bool:
        return self.thread.is_alive()

    def done(self, timeout_s: float) -> bool:
        """Whether the call has returned, waiting at most ``timeout_s`` for it."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


def blocked(call: Call, settle_s: float = 0.3) -> bool:
    """Whether ``call`` is still running after a moment (it waits for something held)."""
    call.thread.join(settle_s)
    return call.alive()


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def release(*stalls: Stall | None) -> None:
    for s in stalls:
        if s is not None:
            s.release()


def chunk_of(kv: np.ndarray, i: int) -> np.ndarray:
    """Chunk ``i`` of a TINY prompt's KV."""
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def assert_loads_exactly(
    store: KVStore, identity: ModelIdentity, tokens: np.ndarray, kv: np.ndarray, chunks: int
) -> None:
    got = store.get(identity, PUBLIC, tokens)
    assert got.loaded == chunks, (got.loaded, chunks)
    for i, arr in enumerate(got.arrays):
        assert np.array_equal(arr, chunk_of(kv, i)), f"chunk {i} served other KV"
