"""Prefix invalidation across restarts (issue 18, hole 4): every durable chunk stays
reachable from every ancestor key it was chained from, whatever of its chain lived only
in DRAM, was lost in a crash or was dropped as corrupt; and no link outlives the chunks
it leads to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv
from tests.helpers.workload import disk_of

C = TINY.chunk_nbytes
N = TINY.tokens_per_chunk


def open_store(path: Path, dram_chunks: int = 3, **kw: Any) -> KVStore:
    return KVStore.open(
        path, dram_bytes=dram_chunks * C, disk_bytes=1 << 24, segment_bytes=1 << 20, **kw
    )


def on_disk(store: KVStore, keys: list[ChunkKey]) -> list[bool]:
    held = set(store.tier("disk").replica_keys())
    return [k in held for k in keys]


def demote_last(store: KVStore, identity: ModelIdentity, tokens: np.ndarray) -> None:
    """Demote only the last chunk of a 3-chunk prompt (touch the first two, evict one)."""
    store.lookup(identity, PUBLIC, tokens[: 2 * N])
    store.evict("dram", C)


def test_a_chunk_demoted_alone_is_reached_from_its_dram_only_ancestors_after_a_crash(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """X0->X1->X2 write-back, only X2 demoted, closed without flush: X0 and X1 are gone,
    but invalidating X0 must still take X2, so re-putting X0 and X1 never serves X2."""
    tokens, kv = prompt_kv(1, 3 * N)
    with open_store(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        demote_last(store, identity, tokens)
        assert on_disk(store, keys) == [False, False, True]
        store.close(flush=False)
    with open_store(tmp_path) as store:
        assert store.indexed_keys() == [keys[2]]
        assert store.invalidate(prefix=keys[0]) == 1
        assert store.indexed_keys() == []
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        hit = store.lookup(identity, PUBLIC, tokens)
        assert hit.tokens == 2 * N, "an invalidated chunk is served again"
        loaded = store.load(hit)
        assert loaded.loaded == 2
    with open_store(tmp_path) as store:  # and the invalidation itself was durable
        assert store.lookup(identity, PUBLIC, tokens).tokens == 2 * N


def test_the_links_survive_an_invalidation_from_the_middle_after_a_crash(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The same from X1 (a DRAM-only middle chunk): X2 is reached, X0 is not."""
    tokens, kv = prompt_kv(2, 3 * N)
    with open_store(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        demote_last(store, identity, tokens)
        store.close(flush=False)
    with open_store(tmp_path) as store:
        assert store.invalidate(prefix=keys[1]) == 1
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        assert store.lookup(identity, PUBLIC, tokens).tokens == 2 * N


def test_a_dram_only_middle_chunk_between_two_durable_ones(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """X0 and X2 on disk, X1 only in DRAM and lost: invalidating X0 takes both."""
    tokens, kv = prompt_kv(3, 3 * N)
    with open_store(tmp_path, promote_on_hit=False) as store:
        store.put_prompt(identity, PUBLIC, tokens[:N], kv[:, :, :, :N])
        store.evict("dram", 3 * C)  # X0 down
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        demote_last(store, identity, tokens)  # X2 down, X1 stays
        assert on_disk(store, keys) == [True, False, True]
        store.close(flush=False)
    with open_store(tmp_path) as store:
        assert set(store.indexed_keys()) == {keys[0], keys[2]}
        assert store.invalidate(prefix=keys[0]) == 2
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        assert store.lookup(identity, PUBLIC, tokens).tokens == 2 * N


def test_an_ancestor_learned_after_its_durable_descendant(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """X2 is stored first on its own (explicit parent X1) and made durable; X0 and X1 are
    put later and never leave DRAM. After a crash X2 is still chained after X0."""
    tokens, kv = prompt_kv(4, 3 * N)
    with open_store(tmp_path, write_through=True) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    with open_store(tmp_path) as store:  # only the keys were needed; start afresh
        assert store.invalidate(prefix=keys[0]) == 3
    with open_store(tmp_path, dram_chunks=4) as store:
        alone = store.put_prompt(
            identity,
            PUBLIC,
            tokens[2 * N :],
            kv[:, :, :, 2 * N :],
            start=2 * N,
            parent=keys[1],
        )
        assert alone.keys == [keys[2]]
        store.flush()
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        assert on_disk(store, keys) == [False, False, True]
        store.close(flush=False)
    with open_store(tmp_path) as store:
        assert store.invalidate(prefix=keys[0]) == 1
        assert store.indexed_keys() == []


def test_a_durable_chunk_is_reached_past_a_neighbour_the_audit_dropped(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """X1's frame is damaged and ``check --fix`` deletes its row (the tier drops it on
    its own, not through an invalidation): X2 stays chained after X0 across restarts."""
    tokens, kv = prompt_kv(5, 3 * N)
    with open_store(tmp_path, dram_chunks=0) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    frame = next(f for f in scan_frames(tmp_path) if f.key == keys[1])
    flip(frame.segment, frame.payload_offset + 3, 2)
    with open_store(tmp_path, dram_chunks=0) as store:
        report = store.check(fix=True)
        assert report.bad_keys == [keys[1]]
    with open_store(tmp_path, dram_chunks=0) as store:
        assert set(store.indexed_keys()) == {keys[0], keys[2]}
        assert store.invalidate(prefix=keys[0]) == 2
        store.put_prompt(identity, PUBLIC, tokens[: 2 * N], kv[:, :, :, : 2 * N])
        assert store.lookup(identity, PUBLIC, tokens).tokens == 2 * N


def test_links_go_with_the_chunks_they_lead_to(tmp_path: Path, identity: ModelIdentity) -> None:
    """A kept link leads to a stored chunk: invalidating, evicting and dropping the chunks
    drops their links (and the links of their DRAM-only ancestors) in the same step."""
    tokens, kv = prompt_kv(6, 3 * N)
    with open_store(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        demote_last(store, identity, tokens)
        disk = disk_of(store)
        assert sorted(disk.load_edges()) == sorted([(keys[2], keys[1]), (keys[1], keys[0])])
        store.invalidate(prefix=keys[0])
        assert disk.load_edges() == []
        # a chunk evicted from both tiers (dropped) takes its links along too
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        demote_last(store, identity, tokens)
        assert disk.load_edges() != []
        store.evict("dram", 3 * C)  # X0, X1 demoted as well
        store.evict("disk", 1 << 24)  # and everything dropped
        assert store.indexed_keys() == []
        assert disk.load_edges() == []
    with open_store(tmp_path) as store:
        assert disk_of(store).load_edges() == []


def test_links_of_a_store_written_before_links_were_kept_are_added_at_open(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A catalog whose rows carry no links (an older store) gets every row's own link at
    open, so a chunk dropped later still leaves its descendants reachable."""
    from tests.helpers.damage import sql

    tokens, kv = prompt_kv(7, 3 * N)
    with open_store(tmp_path, dram_chunks=0) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    sql(tmp_path, "DELETE FROM edges")
    with open_store(tmp_path, dram_chunks=0) as store:
        assert sorted(disk_of(store).load_edges()) == sorted(
            [(keys[1], keys[0]), (keys[2], keys[1])]
        )
