"""``close`` while other threads put, load, invalidate and evict: every call either
completes or raises a typed error (StoreClosedError), none hangs, none reaches a tier
that is closing (a plan made after close began used to run on the closed disk tier and
raise ``RuntimeError: cannot schedule new futures after shutdown`` from its I/O pool),
and the store reopens with a clean audit."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from kvlife.core.errors import KVLifeError, StoreClosedError
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.store import KVStore
from tests.conftest import prompt_kv

ROUNDS = 12


def _hammer(store: KVStore, identity: ModelIdentity, seed: int, stop: threading.Event,
            typed: Counter[str], untyped: list[BaseException]) -> None:  # fmt: skip
    i = 0
    while not stop.is_set():
        i += 1
        tokens, kv = prompt_kv(seed * 1000 + i % 7, 64)
        calls: list[Callable[[], object]] = [
            partial(store.put_prompt, identity, PUBLIC, tokens, kv),
            partial(store.get, identity, PUBLIC, tokens),
        ]
        if i % 5 == 0:
            calls.append(lambda: store.invalidate(weights_digest=identity.weights_digest))
        if i % 3 == 0:
            calls.append(lambda: store.evict("dram", 4096))
        for call in calls:
            try:
                call()
            except KVLifeError as exc:
                typed[type(exc).__name__] += 1
            except BaseException as exc:  # what this test is about
                untyped.append(exc)


@pytest.mark.parametrize("write_through", [False, True])
def test_calls_racing_close_end_typed_and_leave_a_clean_store(
    tmp_path: Path, identity: ModelIdentity, write_through: bool
) -> None:
    typed: Counter[str] = Counter()
    untyped: list[BaseException] = []
    for rnd in range(ROUNDS):
        path = tmp_path / f"r{rnd}"
        store = KVStore.open(
            path, dram_bytes=1 << 20, disk_bytes=16 << 20, write_through=write_through
        )
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=_hammer, args=(store, identity, s, stop, typed, untyped), daemon=True
            )
            for s in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(0.03 + 0.01 * (rnd % 4))  # close at different points of their work
        store.close(flush=rnd % 2 == 1)
        stop.set()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a call racing close never returned"
        with KVStore.open(path, dram_bytes=1 << 20, disk_bytes=16 << 20) as again:
            assert again.check().problems == []
    assert untyped == [], [f"{type(e).__name__}: {e}" for e in untyped[:5]]
    assert set(typed) <= {StoreClosedError.__name__}, typed
    assert typed[StoreClosedError.__name__] > 0  # the calls did race the close
