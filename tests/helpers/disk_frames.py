"""Disk-tier frames for tests of their layout and accounting: keys, payloads, batches
stored, the whole space accounting checked, and every way of reading back checked
exact (tests/tiers/test_disk_payload_alignment.py, tests/attack/test_disk_padding_attack.py)."""

from __future__ import annotations

import itertools

import blake3
import numpy as np

from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import ReadResult, ReplicaMeta
from kvlife.tiers.disk import DiskTier
from kvlife.tiers.disk.frame import ALIGNED_FROM, HEADER_BYTES, PAYLOAD_ALIGN, frame_len, frame_room


def frame_key(tag: str, i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(f"{tag}-{i}".encode()).digest())


def frame_payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def frame_metas(keys: list[ChunkKey], arrs: list[np.ndarray]) -> list[ReplicaMeta]:
    return [ReplicaMeta(k, "uint8", a.shape) for k, a in zip(keys, arrs, strict=True)]


def store_frames(
    tier: DiskTier, tag: str, sizes: list[int], seed: int = 0
) -> dict[ChunkKey, np.ndarray]:
    keys = [frame_key(tag, i) for i in range(len(sizes))]
    arrs = [frame_payload(seed + i, n) for i, n in enumerate(sizes)]
    assert tier.store(frame_metas(keys, arrs), arrs)
    return dict(zip(keys, arrs, strict=True))


def check_invariants(tier: DiskTier, *, capacity: bool = True) -> None:
    """The space accounting of the tier, all of it: every segment's ``live`` is the
    ``frame_room`` of the rows naming it (so never negative), no row names a retired
    segment or reaches past a segment's length, large payloads aligned, frames never
    overlap, every sealed segment with no live frame retired, no reservation left,
    capacity never passed."""
    table = tier._table
    with table.lock:
        room: dict[int, int] = {}
        spans: dict[int, list[tuple[int, int]]] = {}
        for row in table.rows.values():
            seg = table.segments[row.seg]
            assert not seg.doomed, f"a row names retired segment {row.seg}"
            assert row.off % 4096 == 0
            assert row.off + frame_len(row.nbytes) <= seg.length
            if row.nbytes >= ALIGNED_FROM:
                assert (row.off + HEADER_BYTES) % PAYLOAD_ALIGN == 0, (row.off, row.nbytes)
            room[row.seg] = room.get(row.seg, 0) + frame_room(row.nbytes)
            spans.setdefault(row.seg, []).append((row.off, row.off + frame_len(row.nbytes)))
        for sid, seg in table.segments.items():
            assert seg.live == room.get(sid, 0), (sid, seg.live, room.get(sid, 0))
            if seg is not table.active and seg.live == 0 and sid not in table.held:
                assert seg.doomed, f"sealed segment {sid} holds no live frame but is kept"
        for ranges in spans.values():
            ranges.sort()
            for (_, end), (start, _) in itertools.pairwise(ranges):
                assert start >= end, "frames overlap"
        assert table.reserved == 0, f"{table.reserved} bytes still reserved"
    if capacity:
        assert tier.used_bytes <= tier.capacity_bytes


def expect_reads(tier: DiskTier, want: dict[ChunkKey, np.ndarray]) -> None:
    """Every way of reading: new arrays, aligned and unaligned caller buffers, batched
    and pipelined; each result bit-exact."""
    keys = list(want)
    for got, key in zip(tier.read_batch(keys), keys, strict=True):
        assert isinstance(got, np.ndarray), got
        assert np.array_equal(got, want[key])
    aligned = [np.zeros_like(want[k]) for k in keys]
    unaligned = [np.zeros(want[k].nbytes + 1, np.uint8)[1:] for k in keys]
    for outs in (aligned, unaligned):
        for got, out, key in zip(tier.read_batch(keys, outs), outs, keys, strict=True):
            assert got is out
            assert np.array_equal(out, want[key])
    for outs_p in ([None] * len(keys), [np.zeros_like(want[k]) for k in keys]):
        results: dict[int, ReadResult] = {}

        def done(i: int, result: ReadResult, results: dict[int, ReadResult] = results) -> None:
            results[i] = result

        assert tier.read_pipelined(keys, outs_p, done) == len(keys)
        for i, key in enumerate(keys):
            got = results[i]
            assert isinstance(got, np.ndarray), got
            assert np.array_equal(got, want[key])
