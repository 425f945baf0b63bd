"""Attacks on the served set-up trims of issue 28 (commit 37bb6ca): fewer allocations
before a served load's first read and in a put's staging.

What is attacked, each against the store's promises (never wrong bytes, never a loss
that is not counted, bad input a typed error, never a hang):

- ``LoadHandle``'s one condition per load (an Event per chunk before): many threads in
  ``chunk(i)``, ``completed()`` and ``wait()`` while reads finish in a random order, and
  while the store closes under a held read (a lost notify is a waiter still blocked
  after a bounded join);
- the disk tier's per-thread header buffer (``native_reads.headers``): runs nested
  from inside ``take`` callbacks several levels deep, on several threads at once, runs
  whose ``take`` raises (the buffer must not stay marked busy), runs longer than
  ``KEPT_HEADERS``;
- ``Arena.alloc_many`` against a model (disjoint extents, offsets that are
  ``offset_of`` of their views, each freed when its view dies, a batch short only when
  the arena is out of room), from several threads at once, on a sparse arena whose
  filesystem cannot allocate ahead, and with a shape its bytes do not fill;
- ``kvlife.native.spans.c_address`` (behind ``Arena.offset_of``) against
  ``ndarray.ctypes.data`` on odd arrays, by the extension and by numpy;
- a real ``kvlife serve`` whose arena is nearly full: concurrent clients' grant loads of
  disk hits (``alloc_many`` returning fewer extents than asked) and staged puts whose
  budgets are tight (``_stage`` charging one by one) serve exact bytes or counted
  misses, and every lease goes back.

Every wait is bounded (``WAIT``): a hang is a failure, never a stuck run. It found two
faults in ``alloc_many``, mended since: on a filesystem that cannot allocate ahead, every
extent after a batch's first was refused as unbacked (the check that the arena still
has its descriptor was made once per batch, before the first extent turned it off); and
a shape the bytes do not fill left the batch's other extents allocated with no view to
free them."""

from __future__ import annotations

import errno
import gc
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvlife.core.errors import KVLifeError, StoreClosedError
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.native import frames
from kvlife.native.spans import c_address
from kvlife.store import KVStore
from kvlife.tiers import shm
from kvlife.tiers.base import ReadResult
from kvlife.tiers.buffers import ALIGN, aligned_empty, round_up
from kvlife.tiers.disk import DiskTier, native_reads
from kvlife.tiers.disk.fileio import FileIO
from kvlife.tiers.shm import Arena
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc, quiet
from tests.test_native_frames import _note, _stored, _tier

N = TINY.tokens_per_chunk
WAIT = 10.0


def _chunk(kv: np.ndarray, i: int) -> np.ndarray:
    return np.ascontiguousarray(kv[:, :, :, i * N : (i + 1) * N, :])


def _join_all(threads: Sequence[threading.Thread]) -> None:
    deadline = time.monotonic() + WAIT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still blocked (a lost notify?): {alive}"


# ------------------------------------------------------------------ LoadHandle waits


class GateIO(FileIO):
    """Buffered reads; once armed, every read waits (bounded) until the test lets it
    through (``entered``: the gates of reads waiting now)."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.armed = False
        self.lock = threading.Lock()
        self.entered: list[threading.Event] = []
        self.released = 0

    def preadv(self, fd: int, buffers: Sequence[np.ndarray], offset: int) -> int:
        if self.armed:
            gate = threading.Event()
            with self.lock:
                self.entered.append(gate)
            if not gate.wait(WAIT * 3):
                raise OSError(errno.EIO, "test gate was never opened")
        return super().preadv(fd, buffers, offset)

    def open_one(self, rng: random.Random) -> bool:
        """Let one waiting read (a random one) through; False if none waits."""
        with self.lock:
            if not self.entered:
                return False
            gate = self.entered.pop(rng.randrange(len(self.entered)))
            self.released += 1
        gate.set()
        return True


def _disk_only(path: Path, io: FileIO) -> KVStore:
    return KVStore.open(
        path, dram_bytes=0, disk_bytes=1 << 24, segment_bytes=1 << 20, fileio=io, io_threads=4
    )


@pytest.mark.parametrize("depth", [None, 1, 3])
def test_many_waiters_see_each_chunk_exactly_once_its_prefix_finished(
    tmp_path: Path, identity: ModelIdentity, depth: int | None
) -> None:
    """Reads finish in a random order (each held until the test opens it) while eight
    threads wait on random chunks (with and without a timeout), one polls
    ``completed()`` and one ``wait()``: ``completed()`` never goes back, a chunk it
    counted is ready at once (``chunk(c - 1, timeout=0)``), every waiter gets its own
    chunk's exact bytes (the caller's out), and nobody is left blocked."""
    rng = random.Random(depth or 0)
    io = GateIO()
    n = 7
    tokens, kv = prompt_kv(700, n * N)
    with _disk_only(tmp_path, io) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        store.flush()
        hit = store.lookup(identity, PUBLIC, tokens)
        assert len(hit.hits) == n
        io.armed = True
        outs = [np.empty_like(_chunk(kv, i)) for i in range(n)]
        handle = store.load_async(hit, outs, depth=depth)
        got: dict[str, object] = {}
        errors: list[BaseException] = []
        seen: list[int] = []
        stop = threading.Event()

        def waiter(k: int) -> None:
            i = k % n
            try:
                got[f"w{k}"] = (i, handle.chunk(i, timeout=None if k % 2 else WAIT * 2))
            except BaseException as exc:  # reported below
                errors.append(exc)

        def poller() -> None:
            try:
                while not stop.is_set():
                    c = handle.completed()
                    assert not seen or c >= seen[-1], (seen[-1], c)
                    seen.append(c)
                    if c:
                        arr = handle.chunk(c - 1, timeout=0)
                        assert arr is outs[c - 1]
                    if c == n:
                        return
            except BaseException as exc:  # reported below
                errors.append(exc)

        def finisher() -> None:
            try:
                got["result"] = handle.wait(timeout=WAIT * 2)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=waiter, args=(k,), name=f"w{k}") for k in range(8)]
        threads += [threading.Thread(target=poller, name="poller")]
        threads += [threading.Thread(target=finisher, name="finisher")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT
        while not handle.done():
            assert time.monotonic() < deadline, "the load never finished"
            if not io.open_one(rng):
                time.sleep(0.001)
        stop.set()
        _join_all(threads)
        assert not errors, errors
        for k in range(8):
            pair = got[f"w{k}"]
            assert isinstance(pair, tuple)
            i, arr = pair
            assert arr is outs[i] and np.array_equal(arr, _chunk(kv, i))
        res = got["result"]
        assert res.loaded == n  # type: ignore[attr-defined]
        assert handle.completed() == n
        assert io.released >= n


def test_store_closing_under_a_held_read_wakes_every_waiter(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Chunk 2's read is held, waiters without a timeout block on every chunk, and the
    store closes: once the read is let go every waiter returns (no lost notify), chunks
    0-1 are their exact bytes, any later chunk handed out is exact too, the rest None;
    ``wait()`` returns or raises StoreClosedError, and ``completed()`` agrees."""
    io = GateIO()
    n = 6
    tokens, kv = prompt_kv(701, n * N)
    store = _disk_only(tmp_path, io)
    try:
        store.put_prompt(identity, PUBLIC, tokens, kv)
        store.flush()
        hit = store.lookup(identity, PUBLIC, tokens)
        outs = [np.empty_like(_chunk(kv, i)) for i in range(n)]
        io.armed = True
        handle = store.load_async(hit, outs, depth=1)
        rng = random.Random(1)
        deadline = time.monotonic() + WAIT
        while handle.completed() < 2:  # chunks 0 and 1 read, 2 waits at its gate
            assert time.monotonic() < deadline
            if not io.open_one(rng):
                time.sleep(0.001)
        while not io.entered:
            assert time.monotonic() < deadline, "chunk 2's read never started"
            time.sleep(0.001)
        got: dict[int, np.ndarray | None] = {}
        waiters = [
            threading.Thread(target=lambda i=i: got.__setitem__(i, handle.chunk(i)), name=f"c{i}")
            for i in range(n)
        ]
        for w in waiters:
            w.start()
        closer = threading.Thread(target=store.close, name="close")
        closer.start()
        time.sleep(0.05)  # not a speed claim: lets close() start before the read ends
        while closer.is_alive() or not handle.done():
            assert time.monotonic() < deadline + WAIT, "close or the load never finished"
            if not io.open_one(rng):
                time.sleep(0.001)
        _join_all([*waiters, closer])
        for i in range(n):
            arr = got[i]
            if i < 2:
                assert arr is outs[i]
            if arr is not None:
                assert arr is outs[i] and np.array_equal(arr, _chunk(kv, i)), i
        leading = next((i for i in range(n) if got[i] is None), n)
        assert all(got[i] is None for i in range(leading, n)), "a chunk after a miss"
        assert handle.completed() == n  # every chunk finished: read or a miss
        try:
            res = handle.wait(timeout=WAIT)
            assert res.loaded == leading
        except StoreClosedError:
            pass
    finally:
        io.armed = False
        store.close()


# ------------------------------------------------------------------ native header room


@pytest.fixture
def native_tier(tmp_path: Path) -> Iterator[DiskTier]:
    if not frames.available():
        pytest.skip("the native extension is not built")
    tier = _tier(tmp_path / "t", io_depth=3)
    try:
        yield tier
    finally:
        tier.close()


def _run(tier: DiskTier, keys: list[ChunkKey], take: Callable[[int, ReadResult], bool]) -> int:
    """One native run of ``keys`` into new memory (as tests/test_native_frames.py)."""
    table = tier._table
    reader = tier._reader
    rows = [table.row(k) for k in keys]
    with table.lock:
        pinned = table.pin_rows(rows)
    try:
        return native_reads.read_frames(
            rows,
            [pinned[r.seg] for r in rows],
            [None] * len(rows),
            [None] * len(rows),
            [aligned_empty(round_up(r.nbytes)) for r in rows],
            reader._staging,
            2,
            [],
            reader._where,
            take,
        )
    finally:
        with table.lock:
            table.unpin(pinned.values())


def test_runs_nested_several_levels_on_several_threads_read_exact_bytes(
    native_tier: DiskTier,
) -> None:
    """Six threads each run nested reads (a ``take`` that starts another run, up to
    three levels deep, at a random frame; some runs longer than ``KEPT_HEADERS``): every
    frame of every level is handed out whole and exact, and each thread ends with its
    buffer free (not marked busy) and reused by its next run."""
    sets = [_stored(native_tier, [4096, 8192, 4096, 12288, 4096, 8192], seed=s) for s in range(4)]
    sets.append(_stored(native_tier, [4096] * (native_reads.KEPT_HEADERS + 2), seed=9))
    errors: list[BaseException] = []

    def level(rng: random.Random, depth: int) -> None:
        keys, want = sets[rng.randrange(len(sets))]
        nest_at = rng.randrange(len(keys)) if depth < 3 else -1
        got: list[ReadResult] = []

        def take(i: int, res: ReadResult) -> bool:
            got.append(res)
            if i == nest_at:
                level(rng, depth + 1)
            return True

        assert _run(native_tier, keys, take) == len(keys)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(g, w), (depth, g)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(12):
                level(rng, 0)
            assert not getattr(native_reads._local, "busy", False)
            kept = native_reads._local.headers
            assert _run(native_tier, sets[0][0], lambda _i, _r: True) == len(sets[0][0])
            assert native_reads._local.headers is kept
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), name=f"n{s}") for s in range(6)]
    for t in threads:
        t.start()
    _join_all(threads)
    assert not errors, errors


def test_a_take_that_raises_leaves_the_threads_header_room_usable(
    native_tier: DiskTier,
) -> None:
    """A ``take`` raising (at the outer level, or inside a nested run) ends its run with
    the error; the thread's buffer is not left marked busy (its next runs reuse it) and
    the next runs, nested or not, read exact bytes."""
    keys, want = _stored(native_tier, [4096, 8192, 4096, 4096], seed=21)
    other, other_want = _stored(native_tier, [8192, 4096, 4096], seed=22)

    class Boom(Exception):
        pass

    def raise_at(k: int) -> Callable[[int, ReadResult], bool]:
        def take(i: int, _res: ReadResult) -> bool:
            if i == k:
                raise Boom(f"frame {i}")
            return True

        return take

    assert _run(native_tier, keys, lambda _i, _r: True) == len(keys)
    kept = native_reads._local.headers
    with pytest.raises(Boom):
        _run(native_tier, keys, raise_at(2))
    assert not native_reads._local.busy

    def nested_raises(i: int, _res: ReadResult) -> bool:
        if i == 1:
            _run(native_tier, other, raise_at(0))
        return True

    with pytest.raises(Boom):
        _run(native_tier, keys, nested_raises)
    assert not native_reads._local.busy
    got: list[ReadResult] = []
    inner: list[ReadResult] = []

    def take(i: int, res: ReadResult) -> bool:
        got.append(res)
        if i == 0:
            _run(native_tier, other, lambda _i, r: _note(inner, r))
        return True

    assert _run(native_tier, keys, take) == len(keys)
    assert native_reads._local.headers is kept
    for g_list, w_list in ((got, want), (inner, other_want)):
        assert len(g_list) == len(w_list)
        for g, w in zip(g_list, w_list, strict=True):
            assert isinstance(g, np.ndarray) and np.array_equal(g, w)


# ------------------------------------------------------------------ Arena.alloc_many


_names = itertools.count()


def _arena(tmp: Path, pages: int, **kw: Any) -> Arena:
    return Arena(tmp / f"arena-{next(_names)}", pages * ALIGN, **kw)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 3 * ALIGN), st.integers(0, 7)),
            st.tuples(st.just("drop"), st.integers(0, 1000), st.just(0)),
        ),
        max_size=20,
    )
)
def test_alloc_many_matches_a_model_of_the_arena(
    tmp_path: Path, ops: list[tuple[str, int, int]]
) -> None:
    """Batches and drops in any order on a 24-page arena: each batch is at most
    ``count`` extents, each at its own aligned offset (``offset_of`` its view), a new
    generation, disjoint from every live extent; a batch comes back short only when a
    further extent of that size does not fit either; every live extent keeps the bytes
    written to it; counts and used bytes are those of the live extents."""
    arena = _arena(tmp_path, 24)
    try:
        _model_ops(arena, ops)  # its views die with its frame
        gc.collect()
        assert arena.extents == 0 and arena.used_bytes == 0
    finally:
        arena.unlink()


def _model_ops(arena: Arena, ops: list[tuple[str, int, int]]) -> None:
    live: list[tuple[np.ndarray, int, int, int]] = []  # view, offset, size, mark
    gens: set[int] = set()
    for op, a, b in ops:
        if op == "drop":
            if live:
                live.pop(a % len(live))
            continue
        # in a frame of its own: no loop variable here keeps a dropped view alive
        short = _model_alloc(arena, live, gens, a, b)
        if short:
            assert arena.alloc_many(a, np.uint8, (a,), 1) == [], "short batch, room left"
        _model_check(arena, live)


def _model_alloc(
    arena: Arena, live: list[tuple[np.ndarray, int, int, int]], gens: set[int], a: int, b: int
) -> bool:
    """One batch of ``b`` extents of ``a`` bytes, checked and added to ``live``; whether
    it came back short."""
    made = arena.alloc_many(a, np.uint8, (a,), b)
    assert len(made) <= b
    for view, off in made:
        assert off % ALIGN == 0 and arena.offset_of(view) == off
        assert view.shape == (a,) and view.flags.writeable
        gen = arena.generation(off)
        assert gen and gen not in gens
        gens.add(gen)
        for _, o, s, _ in live:
            assert off + round_up(a) <= o or o + s <= off, "extents overlap"
        mark = len(gens) % 251 + 1
        view[:] = mark
        live.append((view, off, round_up(a), mark))
    return len(made) < b


def _model_check(arena: Arena, live: list[tuple[np.ndarray, int, int, int]]) -> None:
    for view, _, _, mark in live:
        assert int(view.min()) == mark == int(view.max()), "an extent was overwritten"
    assert arena.extents == len(live)
    assert arena.used_bytes == sum(s for _, _, s, _ in live)


def test_alloc_many_from_several_threads_hands_out_disjoint_extents(tmp_path: Path) -> None:
    """Eight threads batch and drop extents on one arena at once: no two live extents
    ever overlap (each thread's marks survive the others' writes), and all are given
    back when the views die."""
    arena = _arena(tmp_path, 64)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[np.ndarray, int]] = []
        try:
            for _ in range(300):
                if held and rng.random() < 0.5:
                    held.pop(rng.randrange(len(held)))
                    continue
                size = rng.randrange(1, 2 * ALIGN)
                for view, off in arena.alloc_many(size, np.uint8, (size,), rng.randrange(1, 4)):
                    assert arena.offset_of(view) == off
                    mark = rng.randrange(1, 256)
                    view[:] = mark
                    held.append((view, mark))
                for view, mark in held:
                    assert int(view.min()) == mark == int(view.max()), "overlapping extents"
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), name=f"a{s}") for s in range(8)]
    for t in threads:
        t.start()
    _join_all(threads)
    assert not errors, errors
    gc.collect()
    try:
        assert arena.extents == 0 and arena.used_bytes == 0
    finally:
        arena.unlink()


def test_a_batch_on_a_sparse_arena_that_cannot_allocate_ahead_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without ``fallocate`` (``allocate_pages`` False: pages fault in as
    before, as ``Arena.alloc`` one by one always did): a batch of eight extents of an
    empty 256-page arena is eight extents, none counted unbacked."""
    arena = _arena(tmp_path, 256, populate_pages=False)
    monkeypatch.setattr(shm, "allocate_pages", lambda fd, size, offset=0: False)
    try:
        made = arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 8)
        stats = arena.stats()
        assert (len(made), stats["arena_unbacked"]) == (8, 0), stats
    finally:
        arena.unlink()


def test_the_sparse_batch_gives_back_what_it_did_not_hand_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same filesystem: whatever a batch hands out, every extent it allocated and
    did not hand out is free again (no room lost), and extents handed out are exactly
    the arena's live ones."""
    arena = _arena(tmp_path, 256, populate_pages=False)
    monkeypatch.setattr(shm, "allocate_pages", lambda fd, size, offset=0: False)
    try:
        made = arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 8)
        assert arena.extents == len(made) and arena.used_bytes == len(made) * ALIGN
        again = arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 8)
        assert len(again) == 8
        offs = [o for _, o in made + again]
        assert len(set(offs)) == len(offs)
        del made, again
        gc.collect()
        assert arena.extents == 0
    finally:
        arena.unlink()


def test_a_batch_with_a_bad_shape_loses_no_extent(tmp_path: Path) -> None:
    """A shape that does not fill ``nbytes`` is refused (numpy's ValueError) and leaves
    the arena as it was."""
    arena = _arena(tmp_path, 16)
    try:
        with pytest.raises(ValueError, match="reshape"):
            arena.alloc_many(ALIGN, np.uint8, (ALIGN - 1,), 4)
        gc.collect()
        assert arena.extents == 0 and arena.used_bytes == 0, arena.stats()
    finally:
        arena.unlink()


def test_alloc_many_of_zero_or_fewer_makes_nothing(tmp_path: Path) -> None:
    arena = _arena(tmp_path, 4)
    try:
        assert arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 0) == []
        assert arena.alloc_many(ALIGN, np.uint8, (ALIGN,), -3) == []
        assert arena.extents == 0
        assert len(arena.alloc_many(ALIGN, np.uint8, (ALIGN,), 99)) == 4  # as many as fit
        gc.collect()
        assert arena.extents == 0  # the views died: every extent back
    finally:
        arena.unlink()


# ------------------------------------------------------------------ c_address / offset_of


def _both(arr: np.ndarray) -> list[int | None]:
    """c_address by the extension, then by numpy."""
    out = [c_address(arr)]
    with mock.patch.object(frames, "native_module", lambda: None):
        out.append(c_address(arr))
    return out


def _want(arr: np.ndarray) -> int | None:
    return int(arr.ctypes.data) if arr.flags.c_contiguous else None


@settings(max_examples=200, deadline=None)
@given(
    base=hnp.arrays(
        st.sampled_from(["u1", "<f2", ">i4", "<c16", "?", "u1,<f8", "<M8[s]"]),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    ),
    data=st.data(),
)
def test_c_address_is_ctypes_data_for_any_view(base: np.ndarray, data: st.DataObject) -> None:
    """Any slice (steps of either sign), transpose or read-only view of arrays of odd
    dtypes, 0-d and empty ones included: the address of a C-contiguous one, None for
    any other, the same by either path."""
    arr = base
    if arr.ndim:
        index = tuple(data.draw(st.slices(n)) for n in arr.shape)
        arr = arr[index]
    if data.draw(st.booleans()):
        arr = arr.T
    if data.draw(st.booleans()):
        arr = arr.view()
        arr.flags.writeable = False
    assert _both(arr) == [_want(arr)] * 2


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda: np.array(3.0, np.float32),
        lambda: np.zeros((0, 5))[::-1],
        lambda: np.zeros((1, 4))[::-1],
        lambda: np.arange(6)[::-1][:1],
        lambda: np.broadcast_to(np.arange(3), (4, 3)),
        lambda: np.broadcast_to(np.arange(1), (1, 1)),
        lambda: np.zeros(4, dtype="M8[s]"),
        lambda: np.array([object(), 1], dtype=object),
        lambda: np.asmatrix(np.ones((2, 2))),
        lambda: np.zeros(7, dtype=np.uint8)[1:].view(np.uint8),
        lambda: np.frombuffer(b"abcdef", dtype=np.uint8),
    ],
    ids=[
        "0-d",
        "empty-reversed",
        "size1-dim-reversed",
        "size1-negative-stride",
        "broadcast",
        "broadcast-size1",
        "datetime",
        "object",
        "matrix",
        "offset-view",
        "bytes-read-only",
    ],
)
def test_c_address_on_odd_arrays(make: Callable[[], np.ndarray]) -> None:
    arr = make()
    assert _both(arr) == [_want(arr)] * 2


def test_c_address_of_a_memmap(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.write_bytes(bytes(64))
    m = np.memmap(path, dtype=np.uint16, mode="r+", offset=8, shape=(4, 6))
    assert _both(m) == [_want(m)] * 2
    assert _both(m[:, ::2]) == [None, None]
    assert _both(m[1:3]) == [_want(m[1:3])] * 2
    del m


def test_offset_of_views_inside_and_outside_the_arena(tmp_path: Path) -> None:
    """A contiguous slice inside an extent: its own offset; a transposed or strided
    view of one: None; an array elsewhere in memory, or an empty slice at the arena's
    very end: inside the bounds rule, never an offset past the arena."""
    arena = _arena(tmp_path, 4)
    try:
        (view, off), (last, last_off) = arena.alloc_many(2 * ALIGN, np.uint8, (2 * ALIGN,), 2)
        assert arena.offset_of(view[100:300]) == off + 100
        sq = view.reshape(64, 128)
        assert arena.offset_of(sq.T) is None
        assert arena.offset_of(sq[:, ::2]) is None
        assert arena.offset_of(sq[3]) == off + 3 * 128
        assert arena.offset_of(np.zeros(16, np.uint8)) is None
        end = last[last.nbytes :]
        # numpy leaves an empty slice's pointer where the view starts: that, as before
        assert arena.offset_of(end) == end.ctypes.data - arena._base
        assert arena.offset_of(last.view(np.float64)) == last_off
    finally:
        arena.unlink()


# ------------------------------------------------------------------ a real server


def test_a_full_arena_under_concurrent_served_loads_and_puts_serves_exact_bytes(
    tmp_path: Path,
) -> None:
    """A server whose arena holds a handful of chunks (8 KiB DRAM, 24 KiB staging),
    eight prompts on disk, and six clients loading and putting at once: grant loads get
    fewer extents than disk hits (``alloc_many`` short), staged puts are charged one by
    one or refused. Every chunk handed out is its exact bytes, a load is a leading run
    of its chunks, every refusal is typed, the server logs no internal error, and once
    the clients are gone only the last client's staged extents hold anything."""
    srv = ServerProc(tmp_path / "store", dram=8 << 10, staging=24 << 10).start()
    try:
        main = srv.client()
        ident = tiny_identity()
        prompts = [prompt_kv(800 + s, 4 * N) for s in range(8)]
        for t, kv in prompts:
            main.put_prompt(ident, PUBLIC, t, kv)
        main.flush()
        loaded: list[int] = []
        bad: list[object] = []

        def worker(w: int) -> None:
            client = srv.client()
            rng = random.Random(w)
            try:
                for it in range(25):
                    try:
                        if rng.random() < 0.3:
                            t, kv = prompt_kv(2000 + 100 * w + it, 4 * N)
                            client.put_prompt(ident, PUBLIC, t, kv)
                            continue
                        t, kv = prompts[rng.randrange(len(prompts))]
                        got = client.load(client.lookup(ident, PUBLIC, t))
                        loaded.append(got.loaded)
                        assert len(got.arrays) == got.loaded
                        for i, a in enumerate(got.arrays):
                            if not np.array_equal(a.view(np.uint16), _chunk(kv, i).view(np.uint16)):
                                bad.append(("wrong bytes", w, it, i))
                    except KVLifeError:
                        pass  # typed: a budget or the arena's room
            except BaseException as exc:  # reported below
                bad.append(exc)
            finally:
                client.close()

        clients = [threading.Thread(target=worker, args=(w,), name=f"c{w}") for w in range(6)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        for c in clients:
            c.join(max(0.0, deadline - time.monotonic()))
        assert not any(c.is_alive() for c in clients), "a served call hung"
        assert not bad, bad
        assert loaded, "no load got through"
        state = quiet(main)
        assert state["internal_errors"] == 0 and state["unreplied_errors"] == 0
        assert state["puts"] == 0 and state["loads"] == 0 and state["held_grant_bytes"] == 0
        staged = int(state["staged"])
        assert state["held_staged_bytes"] == state["held_put_bytes"] == staged * ALIGN
        assert state["arena_used_bytes"] == state["shm_used_bytes"] + staged * ALIGN
        main.close()
    finally:
        srv.stop()
    assert "Traceback" not in srv.log.read_text()
