"""Attacks on invalidation and close versus puts in flight (issue 18, hole 5; README,
"Invalidation wins over puts in flight"): puts committed by ``put_async`` while the
store closes, and invalidations of every selector racing commits from threads."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.core.identity import (
    PUBLIC,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)
from kvlife.core.sources import Source, SourceSpan
from kvlife.store import KVStore
from kvlife.store.writes import Writer
from tests.conftest import TINY, prompt_kv, tiny_identity

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk


def open_store(path: Path, **kw: Any) -> KVStore:
    return KVStore.open(path, dram_bytes=64 * C, disk_bytes=1 << 24, segment_bytes=1 << 20, **kw)


def test_close_while_background_commits_run_closes_the_store(
    tmp_path: Path, identity: ModelIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` aborted the pending puts from a list taken outside the index lock; a
    ``put_async`` commit that took one of them in between made its ``abort_put`` raise
    InvalidArgument ("already committed"), out of ``close`` before anything was
    released: the store stayed open, locked, its tiers and threads alive. The window
    is widened here (each abort waits a moment first) so the background commits win it
    every time; nothing else is changed."""
    real = Writer.abort_put

    def slow_abort(self: Writer, pending: Any, reason: str) -> None:
        time.sleep(0.02)  # the background commit thread takes its next put meanwhile
        real(self, pending, reason)

    monkeypatch.setattr(Writer, "abort_put", slow_abort)
    store = open_store(tmp_path, write_through=True)
    prompts = [prompt_kv(i, 2 * N) for i in range(12)]
    futures = [store.put_async(store.prepare_put(identity, PUBLIC, t, kv)) for t, kv in prompts]
    store.close()  # must close whatever the commits do meanwhile
    assert store._core.closed
    done = [f for f in futures if f.exception(timeout=30) is None]
    monkeypatch.setattr(Writer, "abort_put", real)
    with open_store(tmp_path) as again:  # the lock was released; acknowledged puts kept
        for (t, kv), f in zip(prompts, futures, strict=True):
            if f in done:
                got = again.get(identity, PUBLIC, t)
                assert got.loaded == 2
                assert np.array_equal(got.arrays[1], np.ascontiguousarray(kv[:, :, :, N:, :]))


ALICE = Namespace(NamespaceKind.USER, "alice")


SELECTORS = ["namespace", "prefix", "weights", "adapter", "source", "other-weights"]
DOC = [SourceSpan(Source("doc", 1), 0, N)]
"""The prompts' first chunk comes from ``doc@1`` (every chunk depends on it)."""


def _selector(selector: str, ident: ModelIdentity, root: Any) -> dict[str, Any]:
    return {
        "namespace": {"namespace": ALICE},
        "prefix": {"prefix": root},
        "weights": {"weights_digest": ident.weights_digest},
        "adapter": {"adapter_id": "lora-a"},
        "source": {"source": "doc", "before_version": 2},
        "other-weights": {"model": ident.model_id, "keep_weights_digest": "a newer one"},
    }[selector]


@pytest.mark.parametrize("selector", SELECTORS)
def test_a_put_prepared_before_an_invalidation_returned_is_never_stored(
    tmp_path: Path, selector: str
) -> None:
    """README: "``invalidate`` covers every put prepared before it returned, whether that
    put commits before or after". Two threads prepare and commit puts (sync and
    ``put_async``) of prompts that share their first chunk and differ in the second,
    while a third invalidates the family with one selector (the prefix: the shared
    first chunk), over and over. Every put during whose prepare-to-commit window an
    invalidation returned must not have stored its own (second) chunk.

    Before the fix an invalidation applied its rule, then waited for its sequencer turn
    (behind a commit's I/O) to delete: a put prepared in that wait was not covered,
    returned before the invalidation did, and was stored and served (a namespace
    deletion that returned while KV it should have covered went on being served)."""
    ident = tiny_identity(adapter_id="lora-a", adapter_digest="d")
    shared, _ = prompt_kv(7, N)
    root = prompt_chunk_keys(ident, ALICE, shared, sources=DOC)[0]
    lock = threading.Lock()
    returned = [0]  # invalidations that returned so far
    stop = time.monotonic() + 1.5
    hard = stop + 30.0  # on a busy machine: go on until a few puts were covered
    errors: list[BaseException] = []
    served: list[str] = []
    checked = [0]

    def running() -> bool:
        now = time.monotonic()
        return now < stop or (checked[0] < 5 and now < hard and not errors)

    class Registered(list[Any]):
        """The store's registry of invalidations under way: an invalidation's removal
        from it is the moment it stops covering new puts, counted here, under the
        store's lock, as its return. Counted after ``invalidate`` returned instead, a
        put prepared between that removal and the count (rightly not covered) was
        taken for one prepared before the invalidation returned."""

        def remove(self, value: Any) -> None:
            super().remove(value)
            with lock:
                returned[0] += 1

    with open_store(tmp_path) as store:
        store._core.invalidating = Registered()

        def putter(k: int) -> None:
            try:
                i = 0
                while running():
                    i += 1
                    own, kv = prompt_kv(1_000_000 * (k + 1) + i, 2 * N)
                    tokens = np.concatenate([shared, own[N:]])
                    pending = store.prepare_put(ident, ALICE, tokens, kv, sources=DOC)
                    with lock:
                        before = returned[0]
                    if i % 2:
                        store.commit_put(pending)
                    else:
                        store.put_async(pending).result(timeout=30)
                    with lock:
                        after = returned[0]
                    if after > before:  # a rule returned after this put was prepared
                        checked[0] += 1
                        if len(store.lookup(ident, ALICE, tokens, sources=DOC).hits) == 2:
                            served.append(f"put {k}/{i}")
            except BaseException as exc:
                errors.append(exc)

        def invalidator() -> None:
            try:
                while running():
                    store.invalidate(**_selector(selector, ident, root))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=putter, args=(k,)) for k in range(2)]
        threads.append(threading.Thread(target=invalidator))
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert errors == []
        assert checked[0] > 0
        assert served == [], f"{len(served)} of {checked[0]} covered puts were served"


@pytest.mark.parametrize("selector", SELECTORS)
def test_a_put_prepared_while_an_invalidation_waits_for_its_turn_is_covered(
    tmp_path: Path, selector: str
) -> None:
    """The sequence the race test above hits by chance, made certain: a plan is in its
    sequencer turn (a commit's I/O, held here by holding a turn), an invalidation
    applies its rule and waits for its own turn to delete; meanwhile a put of the family
    is prepared and returns. The invalidation then returns, the put commits: before the
    fix its chunks were stored and served, although it was prepared before the
    invalidation returned."""
    ident = tiny_identity(adapter_id="lora-a", adapter_digest="d")
    first, kv1 = prompt_kv(11, 2 * N)
    later, kv2 = prompt_kv(12, N)
    later = np.concatenate([first[:N], later])
    kv2 = np.concatenate([kv1[:, :, :, :N, :], kv2], axis=3)
    root = prompt_chunk_keys(ident, ALICE, first, sources=DOC)[0]
    with open_store(tmp_path) as store:
        store.put_prompt(ident, ALICE, first, kv1, sources=DOC)  # something for the rule
        core = store._core
        hold = threading.Event()
        held = threading.Event()

        def busy_plan() -> None:  # a plan in its turn, as a commit's I/O would be
            with core.seq.turn(core.seq.take()):
                held.set()
                hold.wait(30)

        plan = threading.Thread(target=busy_plan)
        plan.start()
        assert held.wait(10)
        before = store.counters.invalidated
        rule = threading.Thread(target=store.invalidate, kwargs=_selector(selector, ident, root))
        rule.start()
        deadline = time.monotonic() + 10
        while store.counters.invalidated == before:  # applied; now waiting for its turn
            assert time.monotonic() < deadline
            time.sleep(0.001)
        pending = store.prepare_put(ident, ALICE, later, kv2, sources=DOC)  # before the rule
        assert rule.is_alive()
        hold.set()
        rule.join(10)
        plan.join(10)
        res = store.commit_put(pending)
        assert res.stored == 0, f"{res.stored} chunks of a covered put were stored"
        assert store.lookup(ident, ALICE, later, sources=DOC).hits == []
        assert store.lookup(ident, ALICE, first, sources=DOC).hits == []
