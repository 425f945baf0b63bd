"""Damaged store files: every later load returns the right bytes or a miss, never wrong bytes.

Between runs (store closed) the tests damage the disk tier's own files the way a bad
disk, a stray writer or an operator would: truncate a segment, overwrite bytes in a
payload or a frame header, swap frames, delete a segment or the catalog. Then they
reopen and load every chunk on its own (so one loss does not hide the others) and check
that what is served is bit-exact, that damaged objects are counted (``corrupt`` when a
load finds them, ``recovery_dropped`` when reopening does) and invalidated for good, and
that ``DiskTier.check`` reports damage that reopening has not already dropped.

Frames are located through the documented segment format (:mod:`kvlife.tiers.disk.frame`)
by the damage helpers of :mod:`kvlife.faults.damage`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import ChunkKey
from kvlife.faults.damage import (
    Frame,
    catalog_file,
    flip,
    overwrite,
    scan_frames,
    segment_dir,
)
from kvlife.store import KVStore
from kvlife.tiers.disk.catalog import CatalogMissing
from kvlife.tiers.disk.frame import HEADER_BYTES, HEADER_USED, frame_len
from kvlife.tiers.disk.tier import DiskTier
from tests.helpers.workload import (
    IDENTITY,
    ChunkRef,
    KiB,
    MiB,
    Prompt,
    assert_served_correctly,
    chunk_refs,
    kv_for_key,
    load_chunk,
    load_prompt,
    make_prompt,
    put,
    same_bytes,
)

SEED = 4242
PROMPTS = 10
SEGMENT_BYTES = 64 * KiB
"""Eight 8 KiB frames per segment, so a few puts span several segments."""

Verify = Literal["none", "header", "full"]


def open_store(path: Path, verify: Verify = "header") -> KVStore:
    """A disk-only store: every load reads (and verifies) a frame."""
    return KVStore.open(
        path,
        dram_bytes=0,
        disk_bytes=64 * MiB,
        segment_bytes=SEGMENT_BYTES,
        verify_on_open=verify,
    )


def disk_of(store: KVStore) -> DiskTier:
    tier = store.tier("disk")
    assert isinstance(tier, DiskTier)
    return tier


@dataclass(slots=True)
class Built:
    """A closed store holding a known workload."""

    path: Path
    prompts: list[Prompt]
    refs: dict[ChunkKey, ChunkRef]
    frames: list[Frame]

    def segments(self) -> dict[Path, list[Frame]]:
        out: dict[Path, list[Frame]] = {}
        for f in self.frames:
            out.setdefault(f.segment, []).append(f)
        return out


def build(path: Path, prompts: int = PROMPTS) -> Built:
    store = open_store(path)
    try:
        written = [make_prompt(SEED, i) for i in range(prompts)]
        for p in written:
            put(store, p)
    finally:
        store.close()
    refs: dict[ChunkKey, ChunkRef] = {}
    for p in written:
        for ref in chunk_refs(p):
            refs.setdefault(ref.key, ref)
    frames = scan_frames(path)
    # A fresh store holds exactly one frame per distinct key.
    assert sorted(f.key for f in frames) == sorted(refs)
    return Built(path, written, refs, frames)


@pytest.fixture
def built(tmp_path: Path) -> Built:
    return build(tmp_path / "store")


@dataclass(slots=True)
class Audit:
    """What loading every chunk on its own gave."""

    served: set[ChunkKey] = field(default_factory=set)
    corrupt: set[ChunkKey] = field(default_factory=set)
    missed: set[ChunkKey] = field(default_factory=set)


def audit(store: KVStore, built: Built) -> Audit:
    """Load every chunk alone, then every prompt whole; fail on any wrong byte."""
    out = Audit()
    for key, ref in built.refs.items():
        got = load_chunk(store, ref)
        assert got.loaded == len(got.arrays) <= 1
        if got.loaded:
            assert same_bytes(got.arrays[0], kv_for_key(key)), f"wrong bytes for {key.hex()}"
            out.served.add(key)
        elif got.corrupt:
            assert got.corrupt == [key]
            out.corrupt.add(key)
        else:
            out.missed.add(key)
    for prompt in built.prompts:
        got = load_prompt(store, prompt)
        assert got.corrupt == [], "a replica went bad between two loads"
        assert_served_correctly(got, prompt.keys)
    return out


def assert_checked(store: KVStore, quarantined: set[ChunkKey]) -> None:
    """check() finds nothing new and lists exactly the rows the open quarantined (not
    served, kept in the catalog until ``check(fix=True)``)."""
    report = disk_of(store).check()
    assert not report.problems and not report.orphan_segments, report
    assert len(report.quarantined) == len(quarantined), report.quarantined
    for key in quarantined:
        assert any(key.hex()[:16] in q for q in report.quarantined), key.hex()


def assert_gone_for_good(built: Built, gone: set[ChunkKey], verify: Verify = "header") -> None:
    """After another reopen the damaged keys stay missing, the rest load, and nothing is
    counted twice (what the last open quarantined stays quarantined). check(fix=True)
    then deletes the quarantined rows, and the store is clean and the same after it."""
    store = open_store(built.path, verify)
    try:
        assert store.counters.recovery_dropped == 0, "quarantined damage was counted again"
        result = audit(store, built)
        assert result.served == set(built.refs) - gone
        assert result.corrupt == set()
        report = disk_of(store).check()
        assert not report.problems and not report.orphan_segments
        assert disk_of(store).check(fix=True).fixed
        assert disk_of(store).check().clean
    finally:
        store.close()
    store = open_store(built.path, verify)
    try:
        assert store.counters.recovery_dropped == 0
        assert audit(store, built).served == set(built.refs) - gone
        assert disk_of(store).check().clean
    finally:
        store.close()


def middle_frame(built: Built) -> Frame:
    """A frame with frames before and after it in the same segment."""
    for frames in built.segments().values():
        if len(frames) >= 3:
            return frames[1]
    raise AssertionError("the workload filled no segment with three frames")


# ------------------------------------------------------------------ truncation


@pytest.mark.parametrize("where", ["frame-boundary", "mid-header", "mid-payload", "in-padding"])
def test_truncated_segment_drops_the_cut_frames(built: Built, where: str) -> None:
    victim = middle_frame(built)
    cut = {
        "frame-boundary": victim.offset,
        "mid-header": victim.offset + 100,
        "mid-payload": victim.payload_offset + victim.payload_len // 2,
        # Only the zero padding after the payload goes: the victim itself is intact.
        "in-padding": victim.payload_offset + victim.payload_len + 100,
    }[where]
    os.truncate(victim.segment, cut)
    # A frame is lost when the cut falls before the end of its payload.
    lost = {
        f.key
        for f in built.frames
        if f.segment == victim.segment and f.payload_offset + f.payload_len > cut
    }
    assert (victim.key in lost) == (where != "in-padding")
    assert lost, "the cut removed nothing"
    store = open_store(built.path)
    try:
        assert store.counters.recovery_dropped == len(lost)
        result = audit(store, built)
        assert result.served == set(built.refs) - lost
        assert result.missed == lost
        assert_checked(store, lost)
    finally:
        store.close()
    assert_gone_for_good(built, lost)


# ------------------------------------------------------------------ payload damage


def damage_payload_of_second_chunk(built: Built) -> tuple[Prompt, Frame]:
    prompt = next(p for p in built.prompts if len(p.keys) >= 3)
    frame = next(f for f in built.frames if f.key == prompt.keys[1])
    flip(frame.segment, frame.payload_offset + 37, 5)
    return prompt, frame


def test_payload_overwrite_is_caught_on_load(built: Built) -> None:
    prompt, frame = damage_payload_of_second_chunk(built)
    store = open_store(built.path)
    try:
        # Header-only verification on open cannot see payload damage: it is still indexed.
        assert store.counters.recovery_dropped == 0
        found = store.lookup(IDENTITY, prompt.namespace, prompt.tokens)
        assert len(found.hits) == len(prompt.keys)
        got = store.load(found)
        assert got.loaded == 1, "the chunk before the damaged one must still load"
        assert_served_correctly(got, prompt.keys)
        assert got.corrupt == [frame.key]
        assert not got.complete
        assert store.counters.corrupt == 1
        # The damaged object is invalidated: a second lookup stops before it.
        again = store.lookup(IDENTITY, prompt.namespace, prompt.tokens)
        assert [h.key for h in again.hits] == [prompt.keys[0]]
        result = audit(store, built)
        assert result.served == set(built.refs) - {frame.key}
        assert disk_of(store).check().clean
    finally:
        store.close()
    assert_gone_for_good(built, {frame.key})


def test_full_verify_on_open_drops_payload_damage(built: Built) -> None:
    _, frame = damage_payload_of_second_chunk(built)
    store = open_store(built.path, verify="full")
    try:
        assert store.counters.recovery_dropped == 1
        result = audit(store, built)
        assert result.served == set(built.refs) - {frame.key}
        assert store.counters.corrupt == 0
    finally:
        store.close()
    assert_gone_for_good(built, {frame.key}, verify="full")


@pytest.mark.parametrize("via", ["disk-tier", "store"])
def test_check_reports_payload_damage_and_fix_removes_it(built: Built, via: str) -> None:
    """check(fix=False) names the damaged replica; check(fix=True) removes it; afterwards
    the store serves a miss for it (not an exception, not wrong bytes)."""
    prompt, frame = damage_payload_of_second_chunk(built)
    store = open_store(built.path)
    try:
        check = disk_of(store).check if via == "disk-tier" else store.check
        report = check()
        assert not report.clean
        assert report.bad_keys == [frame.key]
        assert len(report.problems) == 1 and frame.key.hex()[:16] in report.problems[0]
        assert report.ok == report.rows - 1 == len(built.refs) - 1
        assert not check(fix=False).fixed
        fixed = check(fix=True)
        assert fixed.fixed and fixed.bad_keys == [frame.key]
        assert check().clean
        found = store.lookup(IDENTITY, prompt.namespace, prompt.tokens)
        assert [h.key for h in found.hits] == [prompt.keys[0]]
        got = store.load(found)
        assert got.loaded == 1
        assert_served_correctly(got, prompt.keys)
        result = audit(store, built)
        assert result.served == set(built.refs) - {frame.key}
        assert store.counters.corrupt + store.counters.recovery_dropped == 1
    finally:
        store.close()
    assert_gone_for_good(built, {frame.key})


# ------------------------------------------------------------------ headers and swaps


def test_frame_header_overwrite_is_dropped_on_open(built: Built) -> None:
    victim = middle_frame(built)
    flip(victim.segment, victim.offset + 60, 8)  # inside the key field of the header
    store = open_store(built.path)
    try:
        assert store.counters.recovery_dropped == 1
        result = audit(store, built)
        assert result.served == set(built.refs) - {victim.key}
        assert result.missed == {victim.key}
        assert_checked(store, {victim.key})
    finally:
        store.close()
    assert_gone_for_good(built, {victim.key})


@pytest.mark.parametrize("what", ["payloads", "whole-frames"])
def test_swapped_frames_are_never_served_for_each_other(built: Built, what: str) -> None:
    seg, frames = next((s, fs) for s, fs in built.segments().items() if len(fs) >= 2)
    a, b = frames[0], frames[-1]
    assert a.payload_len == b.payload_len
    start, length = (
        (HEADER_BYTES, a.payload_len) if what == "payloads" else (0, frame_len(a.payload_len))
    )
    data = bytearray(seg.read_bytes())
    pa = bytes(data[a.offset + start : a.offset + start + length])
    pb = bytes(data[b.offset + start : b.offset + start + length])
    assert pa != pb
    data[a.offset + start : a.offset + start + length] = pb
    data[b.offset + start : b.offset + start + length] = pa
    seg.write_bytes(bytes(data))
    store = open_store(built.path)
    try:
        result = audit(store, built)
        assert result.served == set(built.refs) - {a.key, b.key}
        if what == "payloads":  # headers still match the catalog: found by the load
            assert result.corrupt == {a.key, b.key}
            assert store.counters.corrupt == 2
        else:  # each header names the other key: dropped on open
            assert result.missed == {a.key, b.key}
            assert store.counters.recovery_dropped == 2
    finally:
        store.close()
    assert_gone_for_good(built, {a.key, b.key})


# ------------------------------------------------------------------ missing files


def test_deleted_segment_file_drops_its_replicas(built: Built) -> None:
    seg, frames = next((s, fs) for s, fs in built.segments().items() if len(fs) >= 2)
    seg.unlink()
    lost = {f.key for f in frames}
    store = open_store(built.path)
    try:
        assert store.counters.recovery_dropped == len(lost)
        result = audit(store, built)
        assert result.served == set(built.refs) - lost
        assert_checked(store, lost)
    finally:
        store.close()
    assert_gone_for_good(built, lost)


def test_deleted_catalog_is_refused_and_segments_kept(built: Built) -> None:
    """Without its catalog no frame can be trusted to be committed and not invalidated:
    the open is refused with an error naming the catalog, and the segment files (the
    operator's data) are left alone. Moving them away starts an empty, working store."""
    for f in catalog_file(built.path).parent.glob("catalog.sqlite*"):
        f.unlink()
    segdir = built.path / "disk" / "segments"
    before = {p.name: p.read_bytes() for p in segdir.iterdir()}
    with pytest.raises(CatalogMissing, match=r"catalog\.sqlite.*missing"):
        open_store(built.path)
    assert {p.name: p.read_bytes() for p in segdir.iterdir()} == before
    shutil.rmtree(segdir)
    store = open_store(built.path)
    try:
        assert store.indexed_keys() == []
        assert disk_of(store).check().clean
        prompt = built.prompts[0]
        put(store, prompt)
        got = load_prompt(store, prompt)
        assert got.complete
        assert_served_correctly(got, prompt.keys)
    finally:
        store.close()


@pytest.mark.parametrize("where", ["header-page", "table-pages"])
def test_corrupt_catalog_raises_a_typed_error_naming_it(built: Built, where: str) -> None:
    """A catalog SQLite cannot read is reported as a kvlife error naming the file, and
    the store directory is left unlocked so that the operator can act."""
    cat = catalog_file(built.path)
    size = cat.stat().st_size
    page = 4096
    assert size >= 3 * page, "catalog too small to damage past its first page"
    rng = np.random.default_rng(7)
    if where == "header-page":
        overwrite(cat, 0, rng.bytes(100))
    else:
        overwrite(cat, page, rng.bytes(size - page))
    with pytest.raises(KVLifeError, match=r"catalog\.sqlite"):
        open_store(built.path)
    # The failed open released the lock: after moving catalog and segments away it opens.
    for f in cat.parent.glob("catalog.sqlite*"):
        f.unlink()
    shutil.rmtree(built.path / "disk" / "segments")
    store = open_store(built.path)
    try:
        assert store.indexed_keys() == []
    finally:
        store.close()


# ------------------------------------------------------------------ property


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("pristine") / "store")


@dataclass(frozen=True, slots=True)
class Damage:
    """Where random bytes overwrite a segment file."""

    segment: int
    """Index into the sorted segment files (modulo their number)."""
    region: Literal["anywhere", "header", "payload"]
    """Aim at the whole file, or at the header or payload of one frame."""
    frame: int
    """Frame of the segment aimed at (modulo their number)."""
    position: float
    """Start of the overwrite as a fraction of the region."""
    length: int
    seed: int
    """Seed of the noise written."""


damages = st.builds(
    Damage,
    segment=st.integers(0, 63),
    region=st.sampled_from(["anywhere", "header", "payload"]),
    frame=st.integers(0, 63),
    position=st.floats(0.0, 1.0, exclude_max=True),
    length=st.one_of(st.integers(1, 16), st.integers(1, 3 * HEADER_BYTES)),
    seed=st.integers(0, 2**32 - 1),
)


def damage_start(damage: Damage, size: int, frames: list[Frame]) -> int:
    if damage.region == "anywhere" or not frames:
        return int(damage.position * size)
    f = frames[damage.frame % len(frames)]
    if damage.region == "header":
        return f.offset + int(damage.position * HEADER_USED)
    return f.payload_offset + int(damage.position * f.payload_len)


def _meaningful_ranges(f: Frame) -> Iterator[tuple[int, int]]:
    """Byte ranges of a frame that verification covers (header fields, payload)."""
    yield f.offset, f.offset + HEADER_USED
    yield f.payload_offset, f.payload_offset + f.payload_len


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(damage=damages)
@example(damage=Damage(0, "header", 0, 0.0, 40, seed=1))
@example(damage=Damage(1, "payload", 3, 0.99, 64, seed=2))  # payload end and padding
@example(damage=Damage(0, "anywhere", 0, 0.05, 8, seed=3))  # header padding only
def test_random_overwrite_never_serves_wrong_bytes(
    pristine: Built, tmp_path_factory: pytest.TempPathFactory, damage: Damage
) -> None:
    path = tmp_path_factory.mktemp("damaged") / "store"
    shutil.copytree(pristine.path, path)
    built = Built(path, pristine.prompts, pristine.refs, scan_frames(path))
    segs = sorted(segment_dir(path).glob("seg-*.kvs"))
    seg = segs[damage.segment % len(segs)]
    before = seg.read_bytes()
    start = damage_start(damage, len(before), [f for f in built.frames if f.segment == seg])
    end = min(len(before), start + damage.length)
    noise = np.random.default_rng(damage.seed).bytes(end - start)
    overwrite(seg, start, noise)
    after = seg.read_bytes()
    # Frames whose verified bytes really changed (noise may repeat the old bytes).
    damaged = {
        f.key
        for f in built.frames
        if f.segment.name == seg.name
        and any(before[lo:hi] != after[lo:hi] for lo, hi in _meaningful_ranges(f))
    }
    event(f"frames damaged: {len(damaged)}")
    store = open_store(path)
    try:
        indexed = set(store.indexed_keys())
        assert store.counters.recovery_dropped == len(damaged - indexed)
        # What reopening did not drop, check() names (and nothing else) ...
        report = disk_of(store).check()
        assert set(report.bad_keys) == damaged & indexed
        # ... and a load finds it corrupt; everything else is served bit-exact.
        result = audit(store, built)
        assert result.served == set(built.refs) - damaged
        assert result.corrupt == damaged & indexed
        assert store.counters.corrupt == len(damaged & indexed)
        assert_checked(store, damaged - indexed)
    finally:
        store.close()
