"""The collector's policy of ``kvlife serve`` (:mod:`kvlife.server.heap`): what survives a
full collection is frozen, so later full collections walk only what is new; garbage
made since is still collected; a cycle frozen while it lived is collected by the whole
collection, on its timer; ``stop`` gives the collector back as it was. Then a real
``kvlife serve``: the policy is on by default, its figures in ``stats``, off with
``--gc-whole-every 0``; a bad value is named. A put that finds the arena full of
garbage-held extents collects once and goes on."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import StorageFullError
from kvlife.core.identity import PUBLIC, token_bytes
from kvlife.server import protocol
from kvlife.server.heap import HeapPolicy
from kvlife.server.server import ServeConfig, open_store
from kvlife.server.session import ServerState
from kvlife.tiers.shm import ShmTier
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, ServerProc, child_env


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> tuple[_Node, weakref.ref[_Node]]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


@pytest.fixture
def policy() -> Iterator[HeapPolicy]:
    p = HeapPolicy(whole_every_s=3600).start()
    try:
        yield p
    finally:
        p.stop()


def test_survivors_of_a_full_collection_are_frozen_and_new_garbage_still_goes(
    policy: HeapPolicy,
) -> None:
    assert gc.get_freeze_count() > 0  # what lived at the start
    assert gc.get_threshold()[2] == 1  # a full collection may follow every middle one
    kept = [_Node() for _ in range(20_000)]  # live objects made after the start
    before = gc.get_freeze_count()
    gc.collect()  # a full collection: its survivors are frozen
    assert policy.full_collections >= 1
    assert gc.get_freeze_count() >= before + len(kept)
    node, ref = _cycle()  # garbage made after the freeze: an ordinary collection takes it
    del node
    gc.collect()
    assert ref() is None


def test_a_cycle_frozen_while_it_lived_is_collected_by_the_whole_collection(
    policy: HeapPolicy,
) -> None:
    node, ref = _cycle()
    gc.collect()  # frozen while it lives
    del node
    gc.collect()
    assert ref() is not None  # frozen: the full collections no longer walk it
    assert policy.whole() >= 2
    assert ref() is None
    assert policy.whole_collections == 1 and policy.whole_collected >= 2


def test_the_whole_collection_runs_on_its_timer_and_stop_gives_the_collector_back() -> None:
    callbacks, thresholds = list(gc.callbacks), gc.get_threshold()
    p = HeapPolicy(whole_every_s=0.05).start()
    try:
        node, ref = _cycle()
        gc.collect()
        del node
        deadline = time.monotonic() + 30
        while p.whole_collections < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.whole_collections >= 1
        assert ref() is None  # collected by the timer's whole collection, not by us
    finally:
        p.stop()
    assert gc.get_freeze_count() == 0
    assert gc.callbacks == callbacks and gc.get_threshold() == thresholds
    with pytest.raises(ValueError, match="whole_every_s"):
        HeapPolicy(whole_every_s=0)


def test_kvlife_serve_freezes_by_default_and_not_with_zero(tmp_path: Path) -> None:
    tokens, kv = prompt_kv(3, 64)
    for extra, frozen in (((), True), (("--gc-whole-every", "0"), False)):
        srv = ServerProc(tmp_path / f"s{len(extra)}", extra=extra).start()
        try:
            with srv.client() as c:
                assert c.put_prompt(tiny_identity(), PUBLIC, tokens, kv).stored == 4
                figures = c.server_stats()["gc"]
                c.server_info()  # an ordinary collection: walks only what is not frozen
                after_info = c.server_stats()["gc"]
                c.server_state()  # the whole collection: leases and extents exact
                after_state = c.server_stats()["gc"]
            if frozen:
                assert figures["gc_frozen_objects"] > 0
                assert figures["gc_whole_collections"] == 0  # not due for ten minutes
                assert after_info["gc_whole_collections"] == 0
                assert after_state["gc_whole_collections"] == 1
            else:
                assert figures == after_info == after_state == {}
        finally:
            assert srv.stop() == 0


def test_a_bad_gc_whole_every_is_named(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvlife.cli", "serve", str(tmp_path / "s")]
    for bad in ("-1", "soon", "inf", "nan", "1e10"):  # a timer past a year overflows
        out = subprocess.run(
            [*cmd, "--gc-whole-every", bad], cwd=ROOT, env=child_env(), capture_output=True
        )
        assert out.returncode != 0
        assert b"--gc-whole-every" in out.stderr
    config = tmp_path / "kvlife.toml"
    for bad in ("-5", "inf", "nan"):
        config.write_text(
            f'[store]\npath = "{tmp_path / "s"}"\n[server]\ngc_whole_every_s = {bad}\n'
        )
        out = subprocess.run(
            [sys.executable, "-m", "kvlife.cli", "config", "check", str(config)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
        )
        assert out.returncode != 0
        assert b"gc_whole_every_s" in out.stdout + out.stderr
    for bad_s in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="whole_every_s"):
            HeapPolicy(whole_every_s=bad_s)


def test_a_put_that_finds_the_arena_full_of_garbage_collects_once_and_goes_on(
    tmp_path: Path,
) -> None:
    """Extents whose last views sit in an unreachable reference cycle are garbage the
    collector has not freed yet: a put that finds no room collects once and takes them
    (counted ``arena_reclaims``); another within ``RECLAIM_EVERY_S`` finds the arena
    full, typed, and collects nothing."""
    store = open_store(
        ServeConfig(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=0, staging_bytes=1 << 20)
    )
    shm = store.tier("dram")
    assert isinstance(shm, ShmTier)
    state = ServerState(store, shm, "none")
    session = state.open_session()
    args = {
        "identity": protocol.encode_identity(tiny_identity()),
        "namespace": str(PUBLIC),
        "tokens": token_bytes(prompt_kv(5, 3 * TINY.tokens_per_chunk)[0]),
    }

    def fill_with_garbage() -> None:
        made = state.arena.alloc_many(TINY.chunk_nbytes, np.float16, TINY.chunk_shape, 1 << 20)
        assert made
        holder = _Node()
        holder.other = holder  # a cycle: only the collector frees it
        holder.views = made  # type: ignore[attr-defined]

    was = gc.isenabled()
    gc.disable()  # no collection but the one the put makes
    try:
        fill_with_garbage()
        reply = session.handle("prepare_put", args)
        assert isinstance(reply, dict) and len(reply["slots"]) == 3
        assert state.events["arena_reclaims"] == 1
        session.handle("abort_put", {"put": reply["put"]})
        fill_with_garbage()
        with pytest.raises(StorageFullError, match="no room to stage chunk"):
            session.handle("prepare_put", args)
        assert state.events["arena_reclaims"] == 1  # at most once every RECLAIM_EVERY_S
    finally:
        if was:
            gc.enable()
        gc.collect()
        state.close_session(session)
        store.close()
