"""The shared-memory arena: its allocator (a state machine against a model), extents
freed only when their last view dies, capacity enforced, adoption without a copy."""

from __future__ import annotations

import gc
import itertools
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlife.core.errors import InvalidArgument
from kvlife.tiers.base import CapacityShortfall, ReplicaMeta
from kvlife.tiers.buffers import ALIGN
from kvlife.tiers.shm import Allocator, Arena, ShmTier
from tests.test_tier_contract import key


class AllocatorMachine(RuleBasedStateMachine):
    """Extents never overlap, stay in range, are reused after a free, and a full free
    coalesces the arena back into one extent."""

    PAGES = 64

    def __init__(self) -> None:
        super().__init__()
        self.alloc = Allocator(self.PAGES * ALIGN)
        self.live: dict[int, int] = {}

    @rule(pages=st.integers(1, 20))
    def allocate(self, pages: int) -> None:
        nbytes = pages * ALIGN - (pages % 3)  # sizes that are not page multiples too
        off = self.alloc.alloc(nbytes)
        if off is None:
            # first fit: no free extent is large enough
            assert self.alloc.largest_free < pages * ALIGN
            return
        assert off % ALIGN == 0 and off + pages * ALIGN <= self.PAGES * ALIGN
        for o, n in self.live.items():
            assert off + pages * ALIGN <= o or o + n <= off, "overlap"
        self.live[off] = pages * ALIGN

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(off, self.live.pop(off))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        n = self.live.pop(off)
        self.alloc.free(off, n)
        with pytest.raises(InvalidArgument):
            self.alloc.free(off, n)

    @invariant()
    def accounting(self) -> None:
        assert self.alloc.used == sum(self.live.values())
        assert self.alloc.extents == len(self.live)
        if not self.live:
            assert self.alloc.largest_free == self.PAGES * ALIGN


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_extent_outlives_its_replica_while_a_view_is_held(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", 4 * ALIGN)
    a = arena.alloc(ALIGN, np.uint8, (ALIGN,))
    assert a is not None
    view = a[10:20]
    del a
    gc.collect()
    assert arena.extents == 1  # the slice keeps the extent
    del view
    gc.collect()
    assert arena.extents == 0 and arena.used_bytes == 0
    got = [arena.alloc(ALIGN, np.uint8, (ALIGN,)) for _ in range(5)]
    assert sum(g is not None for g in got) == 4  # capacity enforced, freed room reused


def test_shm_tier_adopts_sealed_extents_and_copies_others(tmp_path: Path) -> None:
    tier = ShmTier(2 * ALIGN, "dram", tmp_path / "arena", ALIGN)
    staged = tier.arena.alloc(ALIGN, np.uint8, (ALIGN,))
    assert staged is not None
    staged[:] = 7
    staged.flags.writeable = False
    meta = ReplicaMeta(key(1), "uint8", (ALIGN,))
    res = tier.prepare_store([meta])
    assert not isinstance(res, CapacityShortfall)
    tier.commit_store(res, [staged])
    assert tier.adopted == 1 and tier.arena.extents == 1
    other = np.full(ALIGN, 9, np.uint8)
    assert tier.store([ReplicaMeta(key(2), "uint8", (ALIGN,))], [other])
    assert tier.arena.extents == 2 and tier.adopted == 1
    assert isinstance(
        tier.prepare_store([ReplicaMeta(key(3), "uint8", (ALIGN,))]), CapacityShortfall
    )
    del staged
    tier.delete(key(1))
    gc.collect()
    assert tier.arena.extents == 1 and tier.used_bytes == ALIGN == tier.footprint(ALIGN - 5)
    assert np.array_equal(tier.read(key(2)), other)
    tier.close()
    assert not (tmp_path / "arena").exists()


def test_extents_made_in_a_batch_are_those_made_one_by_one(tmp_path: Path) -> None:
    """``alloc_many``: each extent with its offset (no look-up after), disjoint, as many
    as fit when the arena runs out (the rest of the batch not made), each freed when
    its own last view dies."""
    arena = Arena(tmp_path / "arena", 10 * ALIGN)
    made = arena.alloc_many(3 * ALIGN - 5, np.uint8, (3 * ALIGN - 5,), 5)
    assert len(made) == 3 and arena.extents == 3  # 3 pages each: the fourth does not fit
    spans = sorted((off, off + 3 * ALIGN) for _, off in made)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for view, off in made:
        assert arena.offset_of(view) == off and view.flags.writeable
    assert arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 0) == []
    view, off = made.pop(1)
    del view
    gc.collect()
    assert arena.extents == 2
    assert [o for _, o in arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 1)] == [off]


def test_arena_file_is_owner_only(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", ALIGN)
    assert (tmp_path / "arena").stat().st_mode & 0o777 == 0o600
    with pytest.raises(InvalidArgument, match="exists already"):
        Arena(tmp_path / "arena", ALIGN)
    arena.unlink()


def test_huge_pages_are_seen_only_on_a_tmpfs_mounted_with_them(tmp_path: Path) -> None:
    """``huge_pages`` reads the mount of the directory: a plain directory is not one; a
    tmpfs mounted ``huge=always`` (root only) is, and an arena there says so."""
    from kvlife.tiers.shm import huge_pages

    assert not huge_pages(tmp_path)
    mnt = tmp_path / "huge"
    mnt.mkdir()
    opts = "huge=always,size=64m,mode=0700"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "kvlife-test", str(mnt)], check=False
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        assert huge_pages(mnt) and huge_pages(mnt / "sub" / "file")
        arena = Arena(mnt / "arena", 8 << 20)
        try:
            assert arena.huge_pages and arena.stats()["arena_huge_pages"] == 1
            view = arena.alloc(4 << 20, np.uint8, (4 << 20,))
            assert view is not None
            view[:] = 7
            assert int(view.sum()) == 7 * (4 << 20)
            del view
        finally:
            arena.unlink()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
