"""Attacks on the DRAM seals (README, "DRAM seals"): a replica changed in memory must
be caught where its seal is verified (demotion, flush, ``check``, every load with
``verify_dram_on_load``), never reported healthy; a healthy one never flagged."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.store import Accept, KVStore, StoreConfig, TierSpec
from tests.attack.test_ownership import _writable_alias
from tests.conftest import TINY, prompt_kv

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk


def _store(path: Path, transform: str | None) -> KVStore:
    options = (("segment_bytes", 1 << 16),)
    disk = (
        TierSpec("disk", "disk", 1 << 24, options=options, transform=transform)
        if transform
        else TierSpec("disk", "disk", 1 << 24, options=options)
    )
    return KVStore(path, StoreConfig(tiers=(TierSpec("memory", "dram", 6 * C), disk)))


@pytest.mark.parametrize("transform", ["int8", None])
def test_a_returned_array_changed_before_its_promotion_is_never_sealed_healthy(
    tmp_path: Path, identity: ModelIdentity, transform: str | None
) -> None:
    """The promotion of a disk hit copies the array the load returned. Exact frames
    carry the checksum the disk read verified into DRAM, so a change made before the
    copy fails the seal at ``check``; a decoded frame carries the seal the load took as
    it decoded, before it handed the array out (it was hashed as copied, so the change
    was sealed as healthy). The promotion is held back (a plan holds its sequencer turn)
    so the change lands first, as it would under load."""
    accept = Accept.lossy() if transform else Accept.EXACT
    tokens, kv = prompt_kv(1, 3 * N)
    with _store(tmp_path, transform) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        store.evict("dram", 6 * C)
        core = store._core
        hold, held = threading.Event(), threading.Event()

        def busy_plan() -> None:
            with core.seq.turn(core.seq.take()):
                held.set()
                hold.wait(30)

        plan = threading.Thread(target=busy_plan)
        plan.start()
        assert held.wait(10)
        got = store.load(store.lookup(identity, PUBLIC, tokens, accept=accept))
        assert got.tiers == {"disk": 3}
        want = [a.copy() for a in got.arrays]
        _writable_alias(got.arrays[0])[...] = 0  # before the promotion copies it
        hold.set()
        plan.join(10)
        store.drain()
        report = store.check()
        again = store.load(store.lookup(identity, PUBLIC, tokens, accept=accept))
        changed = not np.array_equal(again.arrays[0], want[0])
        assert not (report.clean and changed), "a changed replica was sealed as healthy"
