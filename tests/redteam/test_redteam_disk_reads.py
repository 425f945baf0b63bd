"""Red team of the disk read path (:mod:`kvlife.tiers.disk.reader`): frames moved by
compaction after their rows' headers were cached and then damaged in the header, many
threads loading (each with its own header buffer, two reads in flight per call) while a
stray writer flips and restores frames under them, and a segment cut short under an
open store. A load answers the bytes that were put or a counted miss, never other
bytes; the damage reaches only the chunks it touched."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv

N = TINY.tokens_per_chunk
FRAME = 8 << 10
"""A TINY chunk's frame: a 4 KiB header page and its 2 KiB payload padded to 4 KiB."""
DTYPE_AT = 8 + 2 + 2 + 8 + 32 + 16
"""Offset of the dtype field in a frame header (magic, version, flags, length, key,
checksum before it)."""


def _put_one(store: KVStore, ident: ModelIdentity, seed: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, kv = prompt_kv(seed, N)
    res = store.put_prompt(ident, PUBLIC, tokens, kv)
    assert res.stored == 1
    return tokens, kv


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def _frame_of(path: Path, key: ChunkKey) -> tuple[Path, int]:
    frames = [f for f in scan_frames(path) if f.key == key]
    assert len(frames) == 1, f"{len(frames)} frames of the key"
    return frames[0].segment, frames[0].offset


@pytest.mark.parametrize("direct", [False, None], ids=["buffered", "detected"])
def test_frames_moved_by_compaction_are_checked_against_their_new_rows(
    tmp_path: Path, identity: ModelIdentity, direct: bool | None
) -> None:
    """B's frames are read (their rows' headers made and cached), compaction moves them
    (A deleted around them, a put that needs room), then a moved frame's header is
    damaged on the disk: that chunk is a counted miss, the others load exact."""
    opts: dict[str, object] = {
        "dram_bytes": 0,
        "disk_bytes": 12 * FRAME,
        "segment_bytes": 4 * FRAME,
        "direct_io": direct,
    }
    with KVStore.open(tmp_path, **opts) as store:  # type: ignore[arg-type]
        a_keys, b = [], []
        for i in range(4):  # a, b, a, b...: every segment half A
            tokens, _ = _put_one(store, identity, 100 + i)
            a_keys.append(store.lookup(identity, PUBLIC, tokens).hits[0].key)
            b.append(_put_one(store, identity, 200 + i))
        for tokens, kv in b:  # the rows' headers are made and cached here
            got = store.load(store.lookup(identity, PUBLIC, tokens))
            assert got.loaded == 1 and _same(got.arrays[0], kv)
        b_keys = [store.lookup(identity, PUBLIC, t).hits[0].key for t, _ in b]
        before = {k: _frame_of(tmp_path, k) for k in b_keys}
        for k in a_keys:
            assert store.invalidate(prefix=k) == 1
        c_tokens, c_kv = prompt_kv(300, 6 * N)  # 8 frames used, 4 of them garbage
        assert store.put_prompt(identity, PUBLIC, c_tokens, c_kv).stored == 6
        live = {f.key: (f.segment, f.offset) for f in scan_frames(tmp_path)}
        moved = [k for k in b_keys if live.get(k) != before[k]]
        assert moved, "compaction moved none of B's frames"
        for tokens, kv in b:
            got = store.load(store.lookup(identity, PUBLIC, tokens))
            assert got.loaded == 1 and _same(got.arrays[0], kv)
        victim = moved[0]
        seg, off = _frame_of(tmp_path, victim)
        flip(seg, off + DTYPE_AT, 1)  # "float16" -> another dtype, header checksum off
        corrupt = store.counters.corrupt
        for (tokens, kv), key in zip(b, b_keys, strict=True):
            got = store.load(store.lookup(identity, PUBLIC, tokens))
            if key == victim:
                assert got.loaded == 0 and got.corrupt == [victim]
            else:
                assert got.loaded == 1 and _same(got.arrays[0], kv)
        assert store.counters.corrupt == corrupt + 1
        got = store.load(store.lookup(identity, PUBLIC, c_tokens))
        assert got.loaded == 6
        for i, arr in enumerate(got.arrays):
            assert _same(arr, c_kv[:, :, :, i * N : (i + 1) * N])


def test_threads_loading_while_a_stray_writer_flips_frames_get_put_bytes_or_misses(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Eight threads load (into buffers of their own and into new arrays, batches of
    several chunks: helpers and per-thread header buffers in play) while a stray writer
    flips a header byte of one frame and payload bytes of another and puts them back,
    over and over. Every chunk a load returns is the chunk that was put; only the two
    damaged objects are ever found corrupt."""
    with KVStore.open(tmp_path, dram_bytes=0, disk_bytes=64 << 20, promote_on_hit=False) as st:
        tokens, kv = prompt_kv(400, 16 * N)
        assert st.put_prompt(identity, PUBLIC, tokens, kv).stored == 16
        want = [kv[:, :, :, i * N : (i + 1) * N] for i in range(16)]
        keys = [h.key for h in st.lookup(identity, PUBLIC, tokens).hits]
        victims = {keys[11]: DTYPE_AT, keys[14]: FRAME // 2 + 100}
        places = [(*_frame_of(tmp_path, k), at) for k, at in victims.items()]
        stop = threading.Event()
        wrong: list[str] = []

        def stray() -> None:
            while not stop.is_set():
                for seg, off, at in places:
                    flip(seg, off + at, 2)
                stop.wait(0.002)
                for seg, off, at in places:
                    flip(seg, off + at, 2)  # back as it was
                stop.wait(0.002)

        def reader(t: int) -> None:
            rng = np.random.default_rng(t)
            while not stop.is_set():
                lo = int(rng.integers(0, 12))
                hi = int(rng.integers(lo + 1, 17))
                look = st.lookup(identity, PUBLIC, tokens[: hi * N])
                outs = None
                if t % 2:
                    outs = [np.empty_like(w) for w in want[: len(look.hits)]]
                got = st.load(look, outs)
                for i, arr in enumerate(got.arrays):
                    if not _same(arr, want[i]):
                        wrong.append(f"thread {t}: chunk {i} is not the chunk put")
                for k in got.corrupt:
                    if k not in victims:
                        wrong.append(f"thread {t}: chunk {keys.index(k)} found corrupt")

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(8)]
        writer = threading.Thread(target=stray)
        writer.start()
        for th in threads:
            th.start()
        stop.wait(1.0)
        stop.set()
        for th in [*threads, writer]:
            th.join(30)
        assert not wrong, wrong[:5]
        hits = st.lookup(identity, PUBLIC, tokens).hits
        assert 11 <= len(hits) <= 16
        # (each load that met a damaged frame counted it; only the victims were retired)
        indexed = set(st.indexed_keys())
        assert not set(keys[:11]) - indexed
        assert set(keys) - indexed <= set(victims)
        got = st.load(st.lookup(identity, PUBLIC, tokens[: 11 * N]))
        assert got.loaded == 11 and all(
            _same(a, w) for a, w in zip(got.arrays, want[:11], strict=True)
        )


def test_a_segment_cut_short_under_an_open_store_is_a_counted_miss(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A stray truncate cuts the last frame's payload while the store is open: its read
    comes back short, a typed miss (counted), and the frames before it load exact."""
    with KVStore.open(tmp_path, dram_bytes=0, disk_bytes=64 << 20) as store:
        tokens, kv = prompt_kv(500, 4 * N)
        assert store.put_prompt(identity, PUBLIC, tokens, kv).stored == 4
        keys = [h.key for h in store.lookup(identity, PUBLIC, tokens).hits]
        seg, off = _frame_of(tmp_path, keys[3])
        os.truncate(seg, off + 4096 + 1000)  # into chunk 3's payload
        corrupt = store.counters.corrupt
        got = store.load(store.lookup(identity, PUBLIC, tokens))
        assert got.loaded == 3 and got.corrupt == [keys[3]]
        for i, arr in enumerate(got.arrays):
            assert _same(arr, kv[:, :, :, i * N : (i + 1) * N])
        assert store.counters.corrupt == corrupt + 1
        assert len(store.lookup(identity, PUBLIC, tokens).hits) == 3
