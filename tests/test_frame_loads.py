"""Loads of disk frames read by the extension without pins (issue 28,
:mod:`kvlife.store.frame_loads`): what a server's loads into shared buffers and arena
extents use. Held against a real embedded store's disk tier and real segment files:

- the chunks counted are exactly the stored bytes, counted once (the tier's ``loaded``,
  ``frame_loads``, one LOAD each in the ledger, one ``loads`` per call);
- a damaged frame (payload or header) is a miss there, counted and retired by the
  store's own load, and nothing after it is handed out;
- a chunk invalidated after the load started, or after its frame verified, is not
  counted (the publication re-checks), as a pinned load's publication would not;
- hits served from DRAM, and buffers the run cannot fill, take the store's own load;
- a store that promotes disk hits has the chunks counted promoted after (pinned until);
- a hypothesis property over per-chunk states (on disk, in DRAM, damaged, invalidated
  before or during the load) checks the result against a model.
"""

from __future__ import annotations

import copy
import errno
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.events import MemorySink
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.core.lifecycle import Move
from kvlife.faults.damage import flip, scan_frames
from kvlife.faults.fileio import FaultyIO
from kvlife.native import frames as native
from kvlife.results import LookupResult
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.conftest import budget

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

PAGE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_chunk=16)
"""Chunks of one page (4096 bytes): O_DIRECT reads whole aligned pages."""
N = PAGE.tokens_per_chunk
CHUNKS = 4
IDENT = ModelIdentity("pagey", "w0", "t0", PAGE)


def _kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, CHUNKS * N)
    shape = (PAGE.num_layers, 2, PAGE.num_kv_heads, CHUNKS * N, PAGE.head_dim)
    return tokens, rng.standard_normal(shape).astype(np.float16)


def _chunks(kv: np.ndarray) -> list[bytes]:
    return [
        np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :]).tobytes() for i in range(CHUNKS)
    ]


def _open(
    path: Path,
    promote: bool = False,
    sink: MemorySink | None = None,
    fileio: FileIO | None = None,
) -> KVStore:
    return KVStore.open(
        path,
        dram_bytes=1 << 22,
        disk_bytes=1 << 24,
        segment_bytes=1 << 20,
        promote_on_hit=promote,
        write_through=True,
        sink=sink,
        fileio=fileio,
    )


def _on_disk(store: KVStore, seed: int) -> tuple[np.ndarray, list[bytes]]:
    """A prompt of CHUNKS chunks put, flushed and evicted from DRAM: disk hits only."""
    tokens, kv = _kv(seed)
    store.put_prompt(IDENT, PUBLIC, tokens, kv)
    store.flush()
    store.evict("dram", 1 << 40)
    return tokens, _chunks(kv)


def _outs(n: int = CHUNKS) -> list[np.ndarray]:
    return [
        aligned_empty(PAGE.chunk_nbytes).view(np.float16).reshape(PAGE.chunk_shape)
        for _ in range(n)
    ]


def _lookup(store: KVStore, tokens: np.ndarray) -> LookupResult:
    lk = store.lookup(IDENT, PUBLIC, tokens)
    assert len(lk.hits) == CHUNKS
    return lk


def _bytes(outs: list[np.ndarray]) -> list[bytes]:
    return [o.tobytes() for o in outs]


def test_disk_hits_load_exact_and_are_counted_once(tmp_path: Path) -> None:
    sink = MemorySink()
    store = _open(tmp_path / "s", sink=sink)
    try:
        tokens, stored = _on_disk(store, 1)
        lk = _lookup(store, tokens)
        assert lk.tiers() == {"disk": CHUNKS}
        before = copy.deepcopy(store.counters)  # the live counters otherwise
        outs = _outs()
        handle = store.load_frames(lk, outs, request_id="r1")
        assert handle is not None and len(handle) == CHUNKS
        got = [handle.chunk(i) for i in range(CHUNKS)]
        assert all(g is o for g, o in zip(got, outs, strict=True))
        assert not handle.done()  # verified, not yet published
        res = handle.wait()
        assert handle.done()
        assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}
        assert res.representations == {"exact": CHUNKS}
        assert _bytes(outs) == stored
        assert handle.wait() is res  # once
        after = store.counters
        assert after.loads == before.loads + 1
        assert after.frame_loads == before.frame_loads + CHUNKS
        assert after.tier("disk").loaded == before.tier("disk").loaded + CHUNKS
        assert after.bytes_loaded == before.bytes_loaded + CHUNKS * PAGE.chunk_nbytes
        loads = [e for e in sink.take() if e.kind == Move.LOAD.value and e.request_id == "r1"]
        assert sorted(e.key for e in loads) == sorted(h.key.hex() for h in lk.hits)
        assert {e.tier for e in loads} == {"disk"}
    finally:
        store.close()


@pytest.mark.parametrize("part", ["payload", "header"])
@pytest.mark.parametrize("at", [0, 2])
def test_a_damaged_frame_is_a_counted_miss_with_nothing_after_it(
    tmp_path: Path, part: str, at: int
) -> None:
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 2)
        lk = _lookup(store, tokens)
        frame = {f.key: f for f in scan_frames(tmp_path / "s")}[lk.hits[at].key]
        flip(frame.segment, frame.offset + (HEADER_BYTES + 64 if part == "payload" else 40), 1)
        before = copy.deepcopy(store.counters)  # the live counters otherwise
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        assert [handle.chunk(i) is not None for i in range(CHUNKS)] == [
            i < at for i in range(CHUNKS)
        ]
        res = handle.wait()
        assert res.loaded == at
        assert res.corrupt == [lk.hits[at].key]
        assert _bytes(outs[:at]) == stored[:at]
        after = store.counters
        assert after.corrupt == before.corrupt + 1
        assert after.frame_loads == before.frame_loads + at
        assert after.loads == before.loads + 1  # one call, however its chunks were read
        # retired: the next lookup ends before it
        assert len(store.lookup(IDENT, PUBLIC, tokens).hits) == at
    finally:
        store.close()


@pytest.mark.parametrize("when", ["started", "verified"])
def test_a_chunk_invalidated_during_the_load_is_not_counted(tmp_path: Path, when: str) -> None:
    """Chunks 2 and 3 invalidated after the load started (or after every frame of it
    verified and was handed to the caller): the result counts chunks 0 and 1 only, the
    others vanished, as a pinned load's publication counts them."""
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 3)
        lk = _lookup(store, tokens)
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        if when == "verified":
            assert all(handle.chunk(i) is not None for i in range(CHUNKS))
        assert store.invalidate(prefix=lk.hits[2].key) == 2
        res = handle.wait()
        # the first chunk gone ends the result, as in a pinned load's publication
        assert res.loaded == 2 and res.vanished == 1
        assert _bytes(outs[:2]) == stored[:2]
        assert store.counters.frame_loads == 2
    finally:
        store.close()


def test_dram_hits_and_unfillable_buffers_take_the_store_load(tmp_path: Path) -> None:
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 4)
        lk = _lookup(store, tokens)
        # a None buffer in the middle: frames before it, the rest into new memory
        outs: list[np.ndarray | None] = list(_outs())
        outs[2] = None
        handle = store.load_frames(lk, outs)
        assert handle is not None
        # not read from a frame: waits for the whole load, the store reads it
        got = handle.chunk(2)
        assert handle.done() and got is not None and got.tobytes() == stored[2]
        res = handle.wait()
        assert res.loaded == CHUNKS
        assert [a.tobytes() for a in res.arrays] == stored
        assert res.arrays[0] is outs[0] and res.arrays[2] is not None
        assert store.counters.frame_loads == 2
        # buffers not whole aligned pages: not this way at all
        odd = [np.empty(PAGE.chunk_shape, np.float16)[()] for _ in range(CHUNKS)]
        if all(o.ctypes.data % 4096 for o in odd):
            assert store.load_frames(lk, odd) is None
        # DRAM hits first: not this way (the store's load serves them from DRAM)
        t2, kv2 = _kv(5)
        store.put_prompt(IDENT, PUBLIC, t2, kv2)
        lk2 = store.lookup(IDENT, PUBLIC, t2)
        assert lk2.tiers() == {"dram": CHUNKS}
        assert store.load_frames(lk2, _outs()) is None
    finally:
        store.close()


def test_a_store_that_promotes_has_the_loaded_chunks_promoted(tmp_path: Path) -> None:
    """The chunks a frame load counted are promoted into DRAM after it (each disk
    replica pinned until the promotion read it); a chunk invalidated before the
    publication is neither counted nor promoted."""
    store = _open(tmp_path / "s", promote=True)
    try:
        tokens, stored = _on_disk(store, 6)
        lk = _lookup(store, tokens)
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        assert all(handle.chunk(i) is not None for i in range(CHUNKS))
        assert store.invalidate(prefix=lk.hits[3].key) == 1
        res = handle.wait()
        assert res.loaded == 3 and _bytes(outs[:3]) == stored[:3]
        store.drain()
        assert store.counters.promotions == 3
        assert store.lookup(IDENT, PUBLIC, tokens).tiers() == {"dram": 3}
        again = _outs(3)
        res = store.load(store.lookup(IDENT, PUBLIC, tokens), again)
        assert res.loaded == 3 and _bytes(again[:3]) == stored[:3]
        audit = store.check()
        assert audit.problems == [] and audit.ok == audit.rows > 0
    finally:
        store.close()


def test_bad_buffers_are_refused_before_a_read(tmp_path: Path) -> None:
    store = _open(tmp_path / "s")
    try:
        tokens, _ = _on_disk(store, 7)
        lk = _lookup(store, tokens)
        one = _outs()
        for outs, why in (
            (one[:2], "output buffers for"),
            ([one[0], one[1], one[0], one[3]], "share memory"),
        ):
            for o in one:
                o[...] = 7
            with pytest.raises(Exception, match=why):
                store.load_frames(lk, outs)
            assert all((o == 7).all() for o in one)
    finally:
        store.close()


STATES = ("disk", "damaged", "gone_before", "gone_during")


@settings(max_examples=budget(25, 150), deadline=None)
@given(
    st.lists(st.sampled_from(STATES), min_size=CHUNKS, max_size=CHUNKS),
    st.integers(0, CHUNKS),
    st.integers(0, CHUNKS + 1),
)
def test_the_result_is_the_models_for_any_mix_of_chunk_states(
    states: list[str], in_dram: int, steps: int
) -> None:
    """Each chunk's frame intact or damaged, the chunk invalidated before the load
    started or after ``steps`` chunks were checked (an invalidation takes that chunk and
    every chunk after it), and the last ``in_dram`` chunks still in DRAM too. The model:
    the load counts the chunks before the first that is invalidated or damaged and not
    in DRAM (DRAM serves it), each with its stored bytes; a damaged first miss is
    reported corrupt and counted."""
    with tempfile.TemporaryDirectory() as d:
        store = _open(Path(d) / "s")
        try:
            tokens, kv = _kv(8)
            stored = _chunks(kv)
            store.put_prompt(IDENT, PUBLIC, tokens, kv)
            store.flush()
            store.evict("dram", (CHUNKS - in_dram) * PAGE.chunk_nbytes)
            lk = _lookup(store, tokens)
            first_dram = CHUNKS - in_dram
            assert lk.tiers() == {t: n for t, n in (("disk", first_dram), ("dram", in_dram)) if n}
            keys = [h.key for h in lk.hits]
            frames = {f.key: f for f in scan_frames(Path(d) / "s")}
            for i, state in enumerate(states):
                if state == "damaged":
                    f = frames[keys[i]]
                    flip(f.segment, f.offset + HEADER_BYTES + 8, 1)
            gone = [i for i, s in enumerate(states) if s.startswith("gone")]
            if "gone_before" in states:
                store.invalidate(prefix=keys[states.index("gone_before")])
            before = copy.deepcopy(store.counters)  # the live counters otherwise
            outs = _outs()
            handle = store.load_frames(lk, outs)
            assert (handle is None) == (first_dram == 0 or states[0] == "gone_before")
            if handle is None:
                if "gone_during" in states:
                    store.invalidate(prefix=keys[states.index("gone_during")])
                res = store.load(lk, outs)
            else:
                for i in range(min(steps, CHUNKS)):
                    handle.chunk(i)
                # a chunk not read from a frame waited for the whole load: published
                published = handle.done()
                if "gone_during" in states:
                    store.invalidate(prefix=keys[states.index("gone_during")])
                    if published:
                        gone = [i for i, s in enumerate(states) if s == "gone_before"]
                res = handle.wait()
            bad = [
                i for i, s in enumerate(states) if i in gone or (s == "damaged" and i < first_dram)
            ]
            want = bad[0] if bad else CHUNKS
            assert res.loaded == want, (states, in_dram, res)
            assert [a.tobytes() for a in res.arrays] == stored[:want]
            damaged = bad and bad[0] not in gone
            assert res.corrupt == ([keys[want]] if damaged else [])
            after = store.counters
            assert after.loads == before.loads + 1
            assert after.corrupt == before.corrupt + (1 if damaged else 0)
            assert after.frame_loads - before.frame_loads <= min(want, first_dram)
        finally:
            store.close()


def test_chunk_after_wait_says_what_the_result_holds(tmp_path: Path) -> None:
    """A chunk handed out by ``chunk`` and then invalidated before the publication is a
    miss in the result, and ``chunk`` says so once the load is published."""
    store = _open(tmp_path / "s")
    try:
        tokens, stored = _on_disk(store, 11)
        lk = _lookup(store, tokens)
        outs = _outs()
        handle = store.load_frames(lk, outs)
        assert handle is not None
        assert handle.chunk(3) is outs[3]
        store.invalidate(prefix=lk.hits[1].key)
        res = handle.wait()
        assert res.loaded == 1 and _bytes(outs[:1]) == stored[:1]
        assert handle.chunk(0) is outs[0]
        assert [handle.chunk(i) for i in range(1, CHUNKS)] == [None, None, None]
        with pytest.raises(InvalidArgument):
            handle.chunk(CHUNKS)
    finally:
        store.close()


def test_an_embedded_load_into_aligned_buffers_reads_its_frames(tmp_path: Path) -> None:
    """``KVStore.load`` into buffers O_DIRECT can fill takes the frame path: the stored
    bytes in the caller's buffers, counted once (``frame_loads``, the tier's ``loaded``,
    one LOAD each with the request's id, one ``loads``), and the extension's run closed
    when it returns (no descriptor left open)."""
    sink = MemorySink()
    store = _open(tmp_path / "s", sink=sink)
    try:
        tokens, stored = _on_disk(store, 21)
        lk = _lookup(store, tokens)
        before = copy.deepcopy(store.counters)
        fds = len(os.listdir("/proc/self/fd"))
        sink.take()
        outs = _outs()
        res = store.load(lk, outs, request_id="e1")
        assert res.loaded == CHUNKS and res.tiers == {"disk": CHUNKS}
        assert all(a is o for a, o in zip(res.arrays, outs, strict=True))
        assert _bytes(outs) == stored
        after = store.counters
        assert after.frame_loads - before.frame_loads == CHUNKS
        assert after.tier("disk").loaded - before.tier("disk").loaded == CHUNKS
        assert after.loads - before.loads == 1
        loads = [e for e in sink.take() if e.kind == Move.LOAD.value]
        assert [e.request_id for e in loads] == ["e1"] * CHUNKS
        assert len(os.listdir("/proc/self/fd")) == fds
        # buffers the run cannot fill (off a page): the store's own load, same bytes
        shifted = [
            aligned_empty(PAGE.chunk_nbytes + 16)[16:].view(np.float16).reshape(PAGE.chunk_shape)
            for _ in range(CHUNKS)
        ]
        res = store.load(lk, shifted)
        assert res.loaded == CHUNKS and _bytes(shifted) == stored
        assert store.counters.frame_loads == after.frame_loads
    finally:
        store.close()


@pytest.mark.parametrize("how", ["frames", "load"])
def test_a_store_whose_fileio_reads_another_way_is_never_read_around(
    tmp_path: Path, how: str
) -> None:
    """A disk tier whose FileIO is not the plain one (a test's or the fault campaign's
    faults, a stall) is read through it: no frame load goes around it, and an injected
    read error is a counted miss of the store's load, not bytes read natively."""
    io = FaultyIO()
    store = _open(tmp_path / "s", fileio=io)
    try:
        tokens, stored = _on_disk(store, 22)
        lk = _lookup(store, tokens)
        if how == "frames":
            assert store.load_frames(lk, _outs()) is None
            res = store.load(lk, outs := _outs())
            assert res.loaded == CHUNKS and _bytes(outs) == stored
            assert io.calls.get("preadv", 0) >= 1  # read through the seam
        else:
            io.arm("preadv", errno.EIO)
            res = store.load(lk, _outs())
            assert res.loaded == 0 and res.read_errors == 1
            assert io.injected.get("preadv", 0) >= 1
        assert store.counters.frame_loads == 0
    finally:
        store.close()
