"""Attacks on the disk tier's payload alignment (commit 88cff69): a frame of
``ALIGNED_FROM`` (2 MiB) of payload or more is placed after up to 60 KiB of zeros
(``frame_pad``) so that its payload starts at a multiple of ``PAYLOAD_ALIGN``; a live
frame is counted as ``frame_room`` (its frame plus the most padding it may need) in
``Segment.live``, in reservations and in the footprints.

Each test drives the tier (or the store) through a sequence an adversary would pick and
holds it to the store's promises: every read exact and verified, a failed write leaves
nothing visible and gives its space (padding included) back, ``live`` of every segment
equals the ``frame_room`` of the rows that name it and never goes negative, a sealed
segment whose frames are all gone is unlinked, capacity is never passed, the audits
stay clean and ``scan_frames`` finds exactly the frames the rows name (never one in the
zeros of a padding). Tried: payloads one byte either side of the threshold, page-sized
and not, empty, and larger than a segment; reads by ``read_batch`` and
``read_pipelined`` into new arrays, aligned and unaligned caller buffers; a failed
``pwritev`` at every buffer of a batch whose padding sits mid-group and mid-roll, and a
failed ``fdatasync``; stores written before the change (frames back to back; the layout
of the parent commit 2615491, byte for byte: checked with a worktree of it) reopened,
compacted under pressure and emptied; a process killed while writing large frames; the
store (``KVStore``) with chunks just under and over 2 MiB, evicting, reopened.

Found and fixed: a batch that fits the live budget was refused when the garbage sat in
the active segment and compaction's copies filled it and rolled it
(``test_garbage_in_the_active_segment_sealed_by_compaction_still_takes_a_fitting_batch``):
``Compactor.make_room`` (kvlife/tiers/disk/compaction.py) picked its candidates once,
before copying, and decided on the active segment only after; the copies landed in the
active segment behind its garbage, ``SegmentTable.place`` rolled it when the next copy
did not fit, so it was sealed with its garbage, no candidate of that call, and not the
active segment any more either. The same sequence was refused at the parent commit
(with ``frame_len`` in place of ``frame_room``): the change did not bring it, but large
frames (two per segment) make it easy to reach. ``make_room`` now chooses its candidate
again after each segment it compacts (each at most once per call). Also seen, also as before
the change: a kill during compaction leaves the copies it wrote before retiring their
source in the files, so the reopened tier's ``used_bytes`` may pass its capacity until
the next store compacts (the crash test checks capacity only after that store).
Everything else held.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC, ChunkKey, KVLayout, ModelIdentity
from kvlife.faults import crash
from kvlife.faults.crash import AckLog, read_log
from kvlife.faults.damage import scan_frames
from kvlife.faults.fileio import FaultyIO
from kvlife.store import KVStore
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk import segments as segments_module
from kvlife.tiers.disk.audit import audit_directory
from kvlife.tiers.disk.frame import (
    ALIGNED_FROM,
    HEADER_BYTES,
    PAYLOAD_ALIGN,
    frame_len,
    frame_room,
)
from kvlife.tiers.registry import footprint
from tests.helpers.disk_frames import (
    check_invariants,
    expect_reads,
    frame_key,
    frame_metas,
    frame_payload,
    store_frames,
)

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parent.parent.parent

EDGE_SIZES = [
    ALIGNED_FROM - 1,
    ALIGNED_FROM,
    ALIGNED_FROM + 1,
    4096,
    0,
    ALIGNED_FROM - 4096,
    ALIGNED_FROM + 4096,
    9 * MiB,  # larger than a segment: a segment of its own
    5,
    ALIGNED_FROM + 61_441,
]
"""Payload sizes one byte and one page either side of the threshold, tiny, empty, and
larger than the 5 MiB segments the tests use."""


# ---------------------------------------------------------------------------- helpers


def _open(root: Path, capacity: int, segment: int, io: FaultyIO | None = None) -> DiskTier:
    """A disk tier at ``root/disk`` (where the store keeps it: the audit of a closed
    directory and ``scan_frames`` find it there)."""
    cfg = DiskTierConfig(capacity_bytes=capacity, segment_bytes=segment)
    return DiskTier(root / "disk", cfg, fileio=io)


def _state(tier: DiskTier) -> tuple[int, int, dict[int, tuple[int, int]], dict[ChunkKey, object]]:
    table = tier._table
    with table.lock:
        segs = {s.id: (s.length, s.live) for s in table.segments.values()}
        return tier.used_bytes, tier.live_bytes, segs, dict(table.rows)


def _scan_matches_rows(root: Path, tier_rows: dict[ChunkKey, tuple[int, int, int]]) -> None:
    """``scan_frames`` of the closed directory finds every frame a row names, where it
    names it, and no frame inside a padding (the zeros between frames verify as none).
    Frames no row names are garbage past a row's end (a deleted or rolled-back frame),
    never overlapping a live one."""
    found = {(f.segment.name, f.offset): f for f in scan_frames(root)}
    for key, (sid, off, nbytes) in tier_rows.items():
        frame = found.get((f"seg-{sid:08d}.kvs", off))
        assert frame is not None, f"scan_frames misses {key.hex()[:8]} at {sid}@{off}"
        assert frame.key == key and frame.payload_len == nbytes


def _rows_of(tier: DiskTier) -> dict[ChunkKey, tuple[int, int, int]]:
    with tier._table.lock:
        return {k: (r.seg, r.off, r.nbytes) for k, r in tier._table.rows.items()}


@pytest.fixture
def back_to_back(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Place frames as the parent commit did: no padding. (Checked by hand with a
    ``git worktree`` of 2615491: the segment files it writes for the same batches are
    byte-identical, and the catalog rows name the same offsets.)"""
    monkeypatch.setattr(segments_module, "frame_pad", lambda tail, payload_len: 0)
    yield
    monkeypatch.undo()


# ---------------------------------------------------------------------------- attacks


def test_sizes_around_the_threshold_read_back_every_way_and_scan_clean(tmp_path: Path) -> None:
    tier = _open(tmp_path, 256 * MiB, 5 * MiB)
    try:
        want = store_frames(tier, "edge", EDGE_SIZES)
        want |= store_frames(tier, "again", list(reversed(EDGE_SIZES)), seed=50)
        check_invariants(tier)
        expect_reads(tier, want)
        # the footprint the placement charges is what a live frame counts as
        assert all(tier.footprint(n) == footprint("disk", n) == frame_room(n) for n in EDGE_SIZES)
        assert tier.live_bytes == sum(frame_room(a.nbytes) for a in want.values())
        assert tier.check().clean
        rows = _rows_of(tier)
    finally:
        tier.close()
    assert audit_directory(tmp_path).clean
    _scan_matches_rows(tmp_path, rows)
    # nothing but the frames the rows name: padding holds no frame-like bytes
    assert len(scan_frames(tmp_path)) == len(rows)
    tier = _open(tmp_path, 256 * MiB, 5 * MiB)
    try:
        check_invariants(tier)
        expect_reads(tier, want)
        # delete everything: every sealed segment goes, nothing is left counted
        tier.delete_batch(list(want))
        check_invariants(tier)
        assert tier.live_bytes == 0
        assert tier.segment_count == 1
    finally:
        tier.close()
    assert list((tmp_path / "disk" / "segments").iterdir()) == []


FAILING_BATCH = [4096, ALIGNED_FROM + 4096, ALIGNED_FROM, 5, ALIGNED_FROM + 1, 9 * MiB]
"""Small frame, then large ones behind padding in the same group, a frame that rolls
the segment, and one larger than a segment. FaultyIO writes one buffer per call:
padding, header, payload for each large frame."""
_BUFFERS = 3 * 4 + 2 * 2
"""pwritev calls (one per buffer) of FAILING_BATCH under FaultyIO."""


@pytest.mark.parametrize(
    "fault",
    [("pwritev", n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, _BUFFERS - 1)]
    + [("fdatasync", 0), ("fdatasync", 1), ("fdatasync", 2)],
)
def test_a_batch_failing_anywhere_leaves_nothing_and_gives_the_padding_back(
    tmp_path: Path, fault: tuple[str, int]
) -> None:
    op, after = fault
    io = FaultyIO()
    tier = _open(tmp_path, 64 * MiB, 5 * MiB, io)
    try:
        first = store_frames(tier, "first", [ALIGNED_FROM, 4096])  # the active segment not empty
        before = _state(tier)
        keys = [frame_key("failing", i) for i in range(len(FAILING_BATCH))]
        arrs = [frame_payload(100 + i, n) for i, n in enumerate(FAILING_BATCH)]
        io.arm(op, errno.EIO, after=after, once=True, path="seg-*.kvs")
        with pytest.raises(OSError):
            tier.store(frame_metas(keys, arrs), arrs)
        assert io.injected.get(op) == 1
        io.disarm()
        after_state = _state(tier)
        # nothing visible, the tails (padding included) given back, live untouched; a
        # segment the batch created is gone or empty
        assert after_state[0] == before[0] and after_state[1] == before[1]
        assert after_state[3] == before[3]
        for sid, (length, live) in after_state[2].items():
            assert (length, live) == before[2].get(sid, (0, 0)), sid
        assert not any(tier.contains(k) for k in keys)
        check_invariants(tier)
        # the same batch goes through now, laid out aligned and exact
        assert tier.store(frame_metas(keys, arrs), arrs)
        want = first | dict(zip(keys, arrs, strict=True))
        check_invariants(tier)
        expect_reads(tier, want)
        assert tier.check().clean
        rows = _rows_of(tier)
    finally:
        tier.close()
    assert audit_directory(tmp_path).clean
    _scan_matches_rows(tmp_path, rows)
    tier = _open(tmp_path, 64 * MiB, 5 * MiB)
    try:
        assert tier.stats.recovery_dropped == 0
        check_invariants(tier)
        expect_reads(tier, want)
    finally:
        tier.close()


def test_a_failed_compaction_copy_after_padding_rolls_back(tmp_path: Path) -> None:
    """Compaction writes padding then the frame it copies: a failure at the frame
    (after the padding went out) leaves every row at home and readable."""
    io = FaultyIO()
    room = frame_room(ALIGNED_FROM)
    tier = _open(tmp_path, 5 * room, 2 * room, io)
    try:
        want = store_frames(tier, "a", [ALIGNED_FROM, ALIGNED_FROM])
        want |= store_frames(tier, "b", [ALIGNED_FROM, ALIGNED_FROM], seed=10)
        doomed = list(want)[1]
        tier.delete(doomed)
        del want[doomed]
        io.arm("pwritev", errno.EIO, after=1, path="seg-*.kvs")  # padding ok, frame fails
        arrs = [frame_payload(70, ALIGNED_FROM), frame_payload(71, ALIGNED_FROM)]
        keys = [frame_key("c", 0), frame_key("c", 1)]
        with pytest.raises(OSError):
            tier.store(frame_metas(keys, arrs), arrs)
        io.disarm()
        assert not any(tier.contains(k) for k in keys)
        expect_reads(tier, want)
        assert tier.check().clean
        with tier._table.lock:
            for seg in tier._table.segments.values():
                assert seg.live >= 0
        assert tier.used_bytes <= tier.capacity_bytes
    finally:
        tier.close()


def test_a_store_written_back_to_back_reopens_compacts_and_empties(
    tmp_path: Path, back_to_back: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = frame_room(ALIGNED_FROM)
    old_sizes = [ALIGNED_FROM, ALIGNED_FROM + 4096, 4096, ALIGNED_FROM, ALIGNED_FROM - 1]
    old_sizes += [ALIGNED_FROM, 9 * MiB, ALIGNED_FROM]
    tier = _open(tmp_path, 64 * MiB, 7 * MiB)
    try:
        want = store_frames(tier, "old", old_sizes)
        old_rows = _rows_of(tier)
    finally:
        tier.close()
    # really back to back: a large frame right after another's end, payload unaligned
    assert any(
        nbytes >= ALIGNED_FROM and (off + HEADER_BYTES) % PAYLOAD_ALIGN
        for _, off, nbytes in old_rows.values()
    )
    monkeypatch.undo()  # the code of the change from here on
    old_used = sum(p.stat().st_size for p in (tmp_path / "disk" / "segments").iterdir())
    live = sum(frame_room(n) for n in old_sizes)
    assert live > old_used  # old frames count padding they do not have
    # a capacity the old store fits in by its bytes, not by frame_room
    capacity = old_used + frame_room(ALIGNED_FROM) + 64 * 1024
    assert capacity < live + room
    tier = _open(tmp_path, capacity, 7 * MiB)
    try:
        assert tier.stats.recovery_dropped == 0
        assert _rows_of(tier) == old_rows
        with tier._table.lock:
            for seg in tier._table.segments.values():
                assert seg.live >= 0
        assert tier.check().clean
        expect_reads(tier, want)
        # a new large frame fits by the bytes the disk really holds
        want |= store_frames(tier, "new", [ALIGNED_FROM], seed=40)
        _invariants_tolerating_old(tier)
        # delete frames of the old segments, then store under pressure: compaction
        # copies old frames, now with padding, and nothing is lost
        keys = list(want)
        for k in (keys[0], keys[2], keys[4]):
            tier.delete(k)
            del want[k]
        stored = False
        for attempt in range(3):
            arr = frame_payload(60 + attempt, ALIGNED_FROM)
            key = frame_key("pressure", attempt)
            if tier.store(frame_metas([key], [arr]), [arr]):
                want[key] = arr
                stored = True
            _invariants_tolerating_old(tier)
        assert stored
        assert tier.stats.compaction_bytes_written > 0  # old frames were copied
        expect_reads(tier, want)
        assert tier.check().clean
    finally:
        tier.close()
    assert audit_directory(tmp_path).clean
    tier = _open(tmp_path, capacity, 7 * MiB)
    try:
        expect_reads(tier, want)
        tier.delete_batch(list(want))
        check_invariants(tier)
        assert tier.live_bytes == 0 and tier.segment_count == 1
    finally:
        tier.close()
    assert list((tmp_path / "disk" / "segments").iterdir()) == []


def _invariants_tolerating_old(tier: DiskTier) -> None:
    """:func:`_invariants` less the alignment of large payloads (old frames keep their
    offsets until compaction moves them)."""
    table = tier._table
    with table.lock:
        room: dict[int, int] = {}
        for row in table.rows.values():
            seg = table.segments[row.seg]
            assert not seg.doomed
            assert row.off + frame_len(row.nbytes) <= seg.length
            room[row.seg] = room.get(row.seg, 0) + frame_room(row.nbytes)
        for sid, seg in table.segments.items():
            assert seg.live == room.get(sid, 0) >= 0
            if seg is not table.active and seg.live == 0 and sid not in table.held:
                assert seg.doomed
        assert table.reserved == 0
    assert tier.used_bytes <= tier.capacity_bytes


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_churn_of_large_and_small_frames_keeps_the_accounting(
    tmp_path: Path, seed: int
) -> None:
    """Stores, deletes and reads of sizes around the threshold on a tight disk, with
    compaction: after every step the accounting holds; a refusal only when the batch
    does not fit by the bytes the segments hold after compaction; then reopened and
    emptied, every sealed segment unlinked."""
    rng = random.Random(seed)
    sizes = [4096, ALIGNED_FROM - 4096, ALIGNED_FROM - 1, ALIGNED_FROM, ALIGNED_FROM + 1]
    sizes += [ALIGNED_FROM + 12_345, 3 * MiB]
    tier = _open(tmp_path, 16 * MiB, 4 * MiB + 4096)
    want: dict[ChunkKey, np.ndarray] = {}
    n = 0
    try:
        for _ in range(60):
            op = rng.random()
            if op < 0.65:
                keys, arrs = [], []
                for _ in range(rng.randint(1, 3)):
                    keys.append(frame_key("churn", n))
                    arrs.append(frame_payload(n, rng.choice(sizes)))
                    n += 1
                if tier.store(frame_metas(keys, arrs), arrs):
                    want |= dict(zip(keys, arrs, strict=True))
                else:
                    need = sum(frame_room(a.nbytes) for a in arrs)
                    assert tier.used_bytes + need > tier.capacity_bytes
            elif want:
                for k in rng.sample(list(want), min(len(want), rng.randint(1, 3))):
                    tier.delete(k)
                    del want[k]
            check_invariants(tier)
        expect_reads(tier, want)
        assert tier.check().clean
        assert tier.stats.compaction_bytes_written > 0  # the pressure was real
    finally:
        tier.close()
    tier = _open(tmp_path, 16 * MiB, 4 * MiB + 4096)
    try:
        check_invariants(tier)
        tier.delete_batch(list(want))
        check_invariants(tier)
        assert tier.segment_count == 1
    finally:
        tier.close()


def test_garbage_in_the_active_segment_sealed_by_compaction_still_takes_a_fitting_batch(
    tmp_path: Path,
) -> None:
    """Two large frames per segment (R = frame_room of 2 MiB). Segments 1 and 2 hold a
    live frame and a deleted one each; the active segment 3 holds only a deleted frame.
    Live 2R, used 5R = capacity. A batch of 3R fits the live budget (2R + 3R <= 5R), so
    compaction must make room: it copies segment 1's frame into segment 3 (behind its
    garbage), then segment 2's, which does not fit segment 3 any more: segment 3 is
    sealed, with R of garbage, and segment 4 made active. Used is then 3R, and 3R + 3R
    > 5R: the batch was refused, though compacting segment 3 would have made it fit (the
    next call did). kvlife/tiers/disk/compaction.py, Compactor.make_room chose its
    candidates once, before the copies, and its active-segment pass looked only at the
    segment active after them; it now chooses again after each segment."""
    room = frame_room(ALIGNED_FROM)
    capacity = 5 * room
    tier = _open(tmp_path, capacity, 5 * MiB)  # 2R fits a segment, 3R does not
    try:
        a = store_frames(tier, "a", [ALIGNED_FROM, ALIGNED_FROM])  # segment 1
        b = store_frames(tier, "b", [ALIGNED_FROM, ALIGNED_FROM], seed=10)  # segment 2
        c = store_frames(tier, "c", [ALIGNED_FROM], seed=20)  # segment 3, active
        assert tier.segment_count == 3 and tier.used_bytes == capacity
        garbage = [list(a)[1], list(b)[1], *c]
        tier.delete_batch(garbage)
        want = {k: v for k, v in (a | b).items() if k not in garbage}
        check_invariants(tier)
        assert tier.live_bytes == 2 * room
        keys = [frame_key("batch", i) for i in range(3)]
        arrs = [frame_payload(30 + i, ALIGNED_FROM) for i in range(3)]
        need = 3 * room
        assert tier.live_bytes + need <= capacity  # fits the live budget
        first = tier.store(frame_metas(keys, arrs), arrs)
        check_invariants(tier)
        expect_reads(tier, want)
        assert first, (
            "a batch within the live budget was refused: "
            f"live {tier.live_bytes} + need {need} <= capacity {capacity}, used now "
            f"{tier.used_bytes}, segments (id, length, live) "
            f"{[(s.id, s.length, s.live) for s in tier._table.segments.values()]}"
        )
    finally:
        tier.close()


# ---------------------------------------------------------------------------- the store


def _big_identity(tokens_per_chunk: int) -> ModelIdentity:
    layout = KVLayout(
        num_layers=4,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        tokens_per_chunk=tokens_per_chunk,
    )
    return ModelIdentity(
        model_id=f"padding-{tokens_per_chunk}",
        weights_digest="w0",
        tokenizer_digest="t0",
        layout=layout,
    )


def _prompt(identity: ModelIdentity, seed: int, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    lay = identity.layout
    rng = np.random.default_rng(seed)
    ntok = chunks * lay.tokens_per_chunk
    tokens = rng.integers(0, 50_000, ntok)
    kv = rng.standard_normal(
        (lay.num_layers, 2, lay.num_kv_heads, ntok, lay.head_dim), dtype=np.float32
    ).astype(np.float16)
    return tokens, kv


def test_store_with_chunks_around_2_mib_evicts_reopens_and_serves_exact(tmp_path: Path) -> None:
    # 4096 bytes a token: 511 tokens are 2 MiB - 4 KiB (back to back), 513 are
    # 2 MiB + 4 KiB (padded), 512 exactly 2 MiB
    idents = [_big_identity(t) for t in (511, 512, 513)]
    assert idents[1].layout.chunk_nbytes == ALIGNED_FROM
    path = tmp_path / "store"
    disk_bytes = 12 * frame_room(ALIGNED_FROM + 4096)

    def open_store() -> KVStore:
        return KVStore.open(path, dram_bytes=0, disk_bytes=disk_bytes, segment_bytes=5 * MiB)

    prompts: list[tuple[ModelIdentity, np.ndarray, np.ndarray]] = []
    store = open_store()
    try:
        for i in range(9):  # 18 chunks of ~2 MiB on a disk of 12: evictions
            ident = idents[i % 3]
            tokens, kv = _prompt(ident, i, 2)
            store.put_prompt(ident, PUBLIC, tokens, kv)
            prompts.append((ident, tokens, kv))
        disk = store.tier("disk")
        assert isinstance(disk, DiskTier)
        check_invariants(disk)
        sizes = {nbytes for _, _, nbytes in _rows_of(disk).values()}
        assert sizes == {ALIGNED_FROM - 4096, ALIGNED_FROM, ALIGNED_FROM + 4096}
        served = _check_prompts(store, prompts)
        assert 8 <= served < 18  # the newest prompts at least; older ones evicted
        assert disk.check().clean
    finally:
        store.close()
    assert audit_directory(path).clean
    store = open_store()
    try:
        disk = store.tier("disk")
        assert isinstance(disk, DiskTier)
        check_invariants(disk)
        assert _check_prompts(store, prompts) == served
    finally:
        store.close()


def _check_prompts(
    store: KVStore, prompts: list[tuple[ModelIdentity, np.ndarray, np.ndarray]]
) -> int:
    """Load every prompt's hits (into new arrays and into caller buffers); each loaded
    chunk equals its slice of the KV put. Returns the chunks served."""
    served = 0
    for ident, tokens, kv in prompts:
        n = ident.layout.tokens_per_chunk
        hit = store.lookup(ident, PUBLIC, tokens)
        if not hit.hits:
            continue
        res = store.load(hit)
        assert res.loaded == len(hit.hits) and not res.corrupt and not res.read_errors
        for c, arr in enumerate(res.arrays):
            assert np.array_equal(np.asarray(arr), kv[:, :, :, c * n : (c + 1) * n, :])
        outs = [np.empty_like(np.asarray(a)) for a in res.arrays]
        res2 = store.load(store.lookup(ident, PUBLIC, tokens), outs)
        assert res2.loaded == len(outs)
        for c, out in enumerate(outs):
            assert np.array_equal(out, kv[:, :, :, c * n : (c + 1) * n, :])
        served += res.loaded
    return served


# ---------------------------------------------------------------------------- a kill


CRASH_SIZES = [ALIGNED_FROM, 4096, ALIGNED_FROM + 4096, ALIGNED_FROM - 1, 3 * MiB + 5]
"""What the crash child writes, in turn: large frames behind padding between small ones."""


def _crash_payload(i: int) -> np.ndarray:
    return frame_payload(1000 + i, CRASH_SIZES[i % len(CRASH_SIZES)])


def crash_workload(store: Path, log: AckLog, args: list[str]) -> None:
    """The crash child: batches of two frames of the sizes above on a tight disk
    (frames deleted to make room, so compaction copies large frames), one line per
    acknowledged store and delete. Runs until killed."""
    first = int(args[0])
    tier = _open(store, 40 * MiB, 5 * MiB)
    log.line("ready")
    alive = [i for i in range(first) if tier.contains(frame_key("crash", i))]
    i = first
    while True:
        batch = [i, i + 1]
        arrs = [_crash_payload(j) for j in batch]
        keys = [frame_key("crash", j) for j in batch]
        while not tier.store(frame_metas(keys, arrs), arrs):
            victims = alive[:2]
            tier.delete_batch([frame_key("crash", j) for j in victims])
            del alive[:2]
            log.ack("del " + " ".join(map(str, victims)))
        alive += batch
        log.ack(f"put {i} {i + 1}")
        i += 2


def test_a_kill_while_writing_large_frames_recovers_what_was_committed(tmp_path: Path) -> None:
    rng = random.Random(11)
    store = tmp_path / "store"
    first = 0
    put: set[int] = set()
    deleted: set[int] = set()
    for round_ in range(2):
        log = tmp_path / f"log{round_}"
        child = crash.start_child(
            f"{__name__}:crash_workload", store, log, [str(first)], pythonpath=[REPO_ROOT]
        )
        try:
            child.wait_until(lambda lines: any(ln.kind == "ready" for ln in lines))
            time.sleep(0.4 + rng.random() * 0.8)
        finally:
            child.kill()
        assert child.killed_by_signal()
        for line in read_log(log):
            if line.kind == "put":
                put.update(map(int, line.args))
            elif line.kind == "del":
                deleted.update(map(int, line.args))
        first = max(put | deleted | {first - 2}) + 4  # past anything the kill cut short
        tier = _open(store, 40 * MiB, 5 * MiB)
        try:
            assert tier.stats.recovery_dropped == 0
            # not capacity: a kill mid-compaction leaves the copies it made before
            # retiring their source in the files (compaction copies first, as before the
            # change); the next store compacts them away (below)
            check_invariants(tier, capacity=False)
            assert tier.check().clean
            # acknowledged and not deleted: there, exact; deleted: gone
            # (but for the delete the kill may have cut short: the two oldest alive)
            alive = sorted(put - deleted)
            missing = [i for i in alive if not tier.contains(frame_key("crash", i))]
            assert missing == alive[: len(missing)] and len(missing) <= 2, missing
            deleted.update(missing)
            kept = {frame_key("crash", i): _crash_payload(i) for i in put - deleted}
            expect_reads(tier, kept)
            assert not any(tier.contains(frame_key("crash", i)) for i in deleted)
            # anything else served is a frame the workload wrote, exact
            names = {frame_key("crash", i): i for i in range(first)}
            others = [k for k in tier.replica_keys() if k not in kept]
            assert all(k in names for k in others)
            expect_reads(tier, {k: _crash_payload(names[k]) for k in others})
            # a store after recovery: within capacity again, accounting intact
            arrs = [_crash_payload(first - 4), _crash_payload(first - 3)]
            extra = [frame_key("after", round_), frame_key("after2", round_)]
            oldest = sorted(put - deleted)
            while not tier.store(frame_metas(extra, arrs), arrs):  # full: make room as the child
                victims, oldest = oldest[:2], oldest[2:]
                assert victims, "an empty tier refused two frames"
                tier.delete_batch([frame_key("crash", i) for i in victims])
                deleted.update(victims)
            check_invariants(tier)
            tier.delete_batch(extra)
            check_invariants(tier)
        finally:
            tier.close()
    assert put and deleted  # the kills fell among stores, deletes and compaction
    assert audit_directory(store).clean
