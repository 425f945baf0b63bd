"""Red-team checks of the vLLM worker's load path (``start`` / ``wait_layer`` /
``load_errors``) against a real embedded store and vLLM 0.32-shaped CPU caches: no layer
is released to the forward before it is written, whatever the layer and group counts; a
chunk gone, evicted (its memory reused) or changed before the worker reads it is never
served; a step's requests with interleaved blocks (one at the end of the cache) keep each
other's blocks intact when one of them fails part-way; a copy that raises never leaves
the forward waiting."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import torch

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, ModelIdentity, prompt_chunk_keys
from kvlife.engines.vllm import worker as worker_mod
from kvlife.engines.vllm.identity import identity_for
from kvlife.engines.vllm.meta import LoadSpec, StepPlan
from kvlife.engines.vllm.paged import PagedLayer
from kvlife.engines.vllm.paged import write_chunk as real_write_chunk
from kvlife.engines.vllm.worker import WorkerSide
from kvlife.faults.fileio import FaultyIO
from kvlife.store import KVStore
from tests.engines.vllm_fakes import facts

HEADS, DIM, BS, CHUNK, BLOCKS = 2, 8, 4, 8, 24
SENTINEL = -7.0
WAIT_S = 10.0


def _identity(layers: int) -> ModelIdentity:
    engine = facts(1, layers=layers, heads=HEADS, head_dim=DIM, block=BS)
    return identity_for(engine, tp_rank=0, tokens_per_chunk=CHUNK)


def _caches(layers: int, *, stacked: bool) -> list[torch.Tensor]:
    """vLLM 0.32's CPU cache (one allocation, layer-outermost) or one tensor a layer."""
    per = BLOCKS * HEADS * BS * 2 * DIM
    if not stacked:
        return [torch.full((BLOCKS, HEADS, BS, 2 * DIM), SENTINEL) for _ in range(layers)]
    raw = torch.full((layers * per,), SENTINEL)
    return [raw[i * per : (i + 1) * per].view(BLOCKS, HEADS, BS, 2 * DIM) for i in range(layers)]


def _block(cache: torch.Tensor, b: int) -> np.ndarray:
    """Block ``b`` as ``(2, heads, block_size, head_dim)``, as the CPU backend splits it."""
    k, v = cache.view(BLOCKS, HEADS, 2 * BS, -1).chunk(2, dim=2)
    return np.stack([k[b].numpy(), v[b].numpy()])


def _names(layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def _prompt(
    store: KVStore, ident: ModelIdentity, seed: int, chunks: int
) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(10, 900, chunks * CHUNK + 1)]
    layers = ident.layout.num_layers
    kv = rng.standard_normal((layers, 2, HEADS, chunks * CHUNK, DIM)).astype(np.float32)
    store.put_prompt(ident, PUBLIC, tokens, kv)
    store.drain()
    return tokens, kv


def _forward(w: WorkerSide, layers: int, check: Callable[[int], None] | None = None) -> None:
    """vLLM's forward: ``wait_for_layer_load`` of every layer in order, in a thread, so a
    wait that never ends fails the test instead of hanging it."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            for layer, name in enumerate(_names(layers)):
                w.wait_layer(name)
                if check is not None:
                    check(layer)
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), "the forward waited for a layer that was never released"
    if failure:
        raise failure[0]


def _assert_loaded(
    caches: list[torch.Tensor], kv: np.ndarray, blocks: list[int], *, skip: int = 0
) -> None:
    for layer, cache in enumerate(caches):
        for j, b in enumerate(blocks):
            if j < skip:
                continue
            want = kv[layer, :, :, j * BS : (j + 1) * BS]
            assert np.array_equal(_block(cache, b), want), (layer, j, b)


def _untouched(caches: list[torch.Tensor], blocks: list[int]) -> bool:
    return all((_block(c, b) == SENTINEL).all() for c in caches for b in blocks)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = KVStore.open(tmp_path / "store", dram_bytes=64 << 20, disk_bytes=64 << 20)
    yield s
    s.close()


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize(("layers", "groups"), [(1, 6), (2, 6), (7, 3), (7, 6), (5, 10), (6, 1)])
def test_held_no_layer_is_released_before_it_is_written(
    store: KVStore, layers: int, groups: int, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every copy into layers ``[lo, hi)`` finds the events of layers ``lo`` on still
    unset, and once layer ``l``'s wait returns its blocks hold the chunk's bytes: first
    and last layer, a layer count the group count does not divide, one layer, more groups
    than layers, the stacked and the per-layer copy."""
    monkeypatch.setattr(worker_mod, "LOAD_GROUPS", groups)
    ident = _identity(layers)
    tokens, kv = _prompt(store, ident, layers * 100 + groups, 2)
    caches = _caches(layers, stacked=stacked)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    assert (w._stack is not None) == (stacked or layers == 1)
    early: list[tuple[int, int]] = []

    def released_from(lo: int) -> None:
        events = w._events
        assert events is not None
        early.extend((lo, i) for i in range(lo, layers) if events[i].is_set())

    real_chunk, real_rows = real_write_chunk, PagedLayer.write_rows

    def write_chunk(stack: np.ndarray, ids: Any, chunk: Any, skip: int) -> None:
        assert w._stack is not None
        stride = w._stack.strides[0]  # 0 for one layer
        released_from((stack.ctypes.data - w._stack.ctypes.data) // stride if stride else 0)
        real_chunk(stack, ids, chunk, skip)

    def write_rows(self: Any, ids: Any, rows: Any) -> None:
        released_from(w.layers.index(self))
        real_rows(self, ids, rows)

    monkeypatch.setattr(worker_mod, "write_chunk", write_chunk)
    monkeypatch.setattr(PagedLayer, "write_rows", write_rows)
    blocks = [BLOCKS - 1, 3, 0, 11]  # the last block of the cache, then any order
    w.start(StepPlan(loads=[LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)], step=1))

    def check(layer: int) -> None:
        _assert_loaded([caches[layer]], kv[layer : layer + 1], blocks)

    _forward(w, layers, check)
    assert early == []
    # the last layer's wait joined the copy: vLLM may reuse the blocks once the step ends
    assert w._loader is not None and w._loader.done()
    assert w.load_errors() == set()
    w.close()


def test_held_a_chunk_invalidated_before_the_workers_read_is_recomputed(
    store: KVStore,
) -> None:
    """The scheduler found three chunks; the second is invalidated before ``start``:
    the first is loaded, the second and third are load errors (counted), never written."""
    layers = 3
    ident = _identity(layers)
    tokens, kv = _prompt(store, ident, 1, 3)
    keys = prompt_chunk_keys(ident, PUBLIC, tokens)
    assert store.invalidate(prefix=keys[1]) >= 1
    caches = _caches(layers, stacked=True)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    blocks = [5, 1, 9, 2, 7, 4]
    w.start(StepPlan(loads=[LoadSpec("r", tokens, blocks, 0, 3 * CHUNK, PUBLIC, None)], step=1))
    _forward(w, layers)
    assert w.load_errors() == set(blocks[2:])
    assert w.counters.blocks_failed == 4
    _assert_loaded(caches, kv, blocks[:2])
    assert _untouched(caches, blocks[2:])
    w.close()


def test_held_a_replica_evicted_and_its_memory_reused_before_the_copy(
    store: KVStore,
) -> None:
    """A DRAM hit is read in ``start`` as the replica itself; the copy runs later. The
    replica evicted meanwhile and its memory offered to a new put of the same size must
    not change what is copied: the worker's reference keeps the memory from reuse."""
    layers = 3
    ident = _identity(layers)
    tokens, kv = _prompt(store, ident, 2, 2)
    caches = _caches(layers, stacked=True)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    gate = threading.Event()
    w._pool.submit(gate.wait, WAIT_S)  # the loader queues behind this
    blocks = [8, 0, BLOCKS - 1, 13]
    w.start(StepPlan(loads=[LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)], step=1))
    assert store.invalidate(prefix=prompt_chunk_keys(ident, PUBLIC, tokens)[0]) == 2
    store.evict("dram", 1 << 30)
    for seed in range(3, 9):  # same-sized chunks: recycled buffers if any were freed
        _prompt(store, ident, seed, 2)
    gate.set()
    _forward(w, layers)
    assert w.load_errors() == set()
    _assert_loaded(caches, kv, blocks)
    w.close()


def _dram_replica(store: KVStore, key: bytes) -> np.ndarray:
    """The writable memory under a DRAM replica (what a stray write would hit)."""
    held = store.tier("dram")._held[key]  # type: ignore[attr-defined]
    raw = held.raw
    assert raw is not None
    return raw.view(np.float32)  # type: ignore[no-any-return]


def test_held_a_dram_replica_changed_in_memory_is_caught_when_verified(tmp_path: Path) -> None:
    """With ``verify_dram_on_load`` a replica whose bytes changed since it was sealed is
    a load error from it on (recomputed, counted), never copied into the paged cache."""
    store = KVStore.open(
        tmp_path / "store", dram_bytes=64 << 20, disk_bytes=64 << 20, verify_dram_on_load=True
    )
    try:
        layers = 3
        ident = _identity(layers)
        tokens, kv = _prompt(store, ident, 3, 2)
        key = prompt_chunk_keys(ident, PUBLIC, tokens)[1]
        _dram_replica(store, key)[5] += 1.0
        caches = _caches(layers, stacked=True)
        w = WorkerSide(store, ident, block_size=BS)
        w.register(_names(layers), caches, "halves")
        blocks = [6, 2, 19, 1]
        spec = LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)
        w.start(StepPlan(loads=[spec], step=1))
        _forward(w, layers)
        assert w.load_errors() == set(blocks[2:])
        _assert_loaded(caches, kv, blocks[:2])
        assert _untouched(caches, blocks[2:])
        w.close()
    finally:
        store.close()


def test_held_two_requests_interleaved_one_failing_part_way(store: KVStore) -> None:
    """Two requests of one step with interleaved blocks, one block at the end of the
    cache: A's third chunk is gone (its blocks load errors, never written), A's first two
    chunks and all of B's land, B's blocks untouched by A's failure."""
    layers = 4
    ident = _identity(layers)
    ta, kva = _prompt(store, ident, 10, 3)
    tb, kvb = _prompt(store, ident, 11, 2)
    store.invalidate(prefix=prompt_chunk_keys(ident, PUBLIC, ta)[2])
    caches = _caches(layers, stacked=True)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    a_blocks = [BLOCKS - 1, 4, 10, 2, 15, 7]
    b_blocks = [3, 12, 0, 9]  # B's first block is vLLM's own (prefix cache)
    plan = StepPlan(
        loads=[
            LoadSpec("a", ta, a_blocks, 0, 3 * CHUNK, PUBLIC, None),
            LoadSpec("b", tb, b_blocks, BS, 2 * CHUNK, PUBLIC, None),
        ],
        step=1,
    )
    w.start(plan)
    _forward(w, layers)
    assert w.load_errors() == set(a_blocks[4:])
    _assert_loaded(caches, kva, a_blocks[:4])
    assert _untouched(caches, a_blocks[4:])
    _assert_loaded(caches, kvb, b_blocks, skip=1)
    assert _untouched(caches, b_blocks[:1])
    w.close()


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize(
    ("fail_at", "loaded"),
    [(1, 0), (3, 0), (5, 0), (6, 1)],
    ids=["first-copy", "second-group", "last-group", "last-copy"],
)
def test_a_copy_that_raises_is_load_errors_and_the_step_goes_on(
    store: KVStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stacked: bool,
    fail_at: int,
    loaded: int,
) -> None:
    """A copy into the paged cache raising (a bug in the scatter) at copy ``fail_at`` of
    the step (three groups of layers, two chunks a group; the per-layer path: a layer
    per copy) never fails the step: every later layer is released, the forward runs to
    its end, and every chunk not written whole into every layer (the one whose copy
    began and failed included) is a load error, counted with its reason and logged
    once; only the chunks written whole (``loaded``, in the stacked path) are not."""
    monkeypatch.setattr(worker_mod, "LOAD_GROUPS", 3)
    layers = 6
    ident = _identity(layers)
    tokens, kv = _prompt(store, ident, 20, 2)
    caches = _caches(layers, stacked=stacked)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    calls = [0]

    def count() -> None:
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("copy failed")

    def write_chunk(stack: np.ndarray, ids: Any, chunk: Any, skip: int) -> None:
        count()
        real_write_chunk(stack, ids, chunk, skip)

    real_rows = PagedLayer.write_rows

    def write_rows(self: Any, ids: Any, rows: Any) -> None:
        count()
        real_rows(self, ids, rows)

    monkeypatch.setattr(worker_mod, "write_chunk", write_chunk)
    monkeypatch.setattr(PagedLayer, "write_rows", write_rows)
    blocks = [4, 9, 1, BLOCKS - 1]
    w.start(StepPlan(loads=[LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)], step=1))
    reached: list[int] = []
    with caplog.at_level("WARNING", logger="kvlife.vllm"):
        _forward(w, layers, reached.append)  # no exception: the step goes on
    assert reached == list(range(layers))
    good = 2 * loaded if stacked else 0
    assert w.load_errors() == set(blocks[good:])
    _assert_loaded(caches, kv, blocks[:good])
    assert w.counters.load_failures == {"copy": 1}
    assert w.counters.blocks_failed == len(blocks) - good
    assert w.counters.tokens_loaded == good * BS
    logged = [r for r in caplog.records if "copy failed" in r.getMessage()]
    assert len(logged) == 1 and "r" in logged[0].getMessage()
    # the next step's loads run as usual
    w.start(StepPlan(loads=[LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)], step=2))
    _forward(w, layers)
    assert w.load_errors() == set()
    _assert_loaded(caches, kv, blocks)
    w.close()


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 7),
    groups=st.integers(1, 6),
    chunks=st.integers(1, 3),
    first_block=st.integers(0, 1),
    stacked=st.booleans(),
    fail_at=st.integers(1, 24),
)
def test_wherever_a_copy_raises_no_block_reported_loaded_is_partial(
    tmp_path_factory: pytest.TempPathFactory,
    layers: int,
    groups: int,
    chunks: int,
    first_block: int,
    stacked: bool,
    fail_at: int,
) -> None:
    """Whatever the layer and group counts, the chunks of the step, the blocks vLLM's
    own cache holds and the copy (of either path) that raises: the reported blocks are
    a suffix of the load from a chunk boundary, every block not reported holds its
    chunk's bytes in every layer, and the failure is counted once (or no copy raised,
    nothing is reported and all is loaded)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_mod, "LOAD_GROUPS", groups)
        store = KVStore.open(
            tmp_path_factory.mktemp("s") / "store", dram_bytes=16 << 20, disk_bytes=16 << 20
        )
        try:
            ident = _identity(layers)
            tokens, kv = _prompt(store, ident, 7 * layers + chunks, chunks)
            caches = _caches(layers, stacked=stacked)
            w = WorkerSide(store, ident, block_size=BS)
            w.register(_names(layers), caches, "halves")
            calls = [0]
            real_rows = PagedLayer.write_rows

            def count() -> None:
                calls[0] += 1
                if calls[0] == fail_at:
                    raise RuntimeError("copy failed")

            def write_chunk(stack: np.ndarray, ids: Any, chunk: Any, skip: int) -> None:
                count()
                real_write_chunk(stack, ids, chunk, skip)

            def write_rows(self: Any, ids: Any, rows: Any) -> None:
                count()
                real_rows(self, ids, rows)

            mp.setattr(worker_mod, "write_chunk", write_chunk)
            mp.setattr(PagedLayer, "write_rows", write_rows)
            per = CHUNK // BS
            blocks = [(5 * j + 3) % BLOCKS for j in range(chunks * per)]
            spec = LoadSpec("r", tokens, blocks, first_block * BS, chunks * CHUNK, PUBLIC, None)
            w.start(StepPlan(loads=[spec], step=1))
            _forward(w, layers)
            bad = w.load_errors()
            loaded = blocks[first_block:]
            if bad:
                assert w.counters.load_failures == {"copy": 1}
                cut = blocks.index(min(bad, key=blocks.index))
                assert cut % per == 0 or cut == first_block  # a chunk's first written block
                assert bad == set(blocks[cut:])
                loaded = blocks[first_block:cut]
            else:
                assert w.counters.load_failures == {}
            for layer, cache in enumerate(caches):
                for b in loaded:
                    j = blocks.index(b)
                    want = kv[layer, :, :, j * BS : (j + 1) * BS]
                    assert np.array_equal(_block(cache, b), want), (layer, j)
            assert w.counters.tokens_loaded == len(loaded) * BS
            w.close()
        finally:
            store.close()


@pytest.fixture
def unpromoted(tmp_path: Path) -> Iterator[KVStore]:
    """A store that does not promote a chunk read from disk: each load of it reads it
    from disk again (with the store's I/O pool)."""
    s = KVStore.open(
        tmp_path / "unpromoted", dram_bytes=64 << 20, disk_bytes=64 << 20, promote_on_hit=False
    )
    yield s
    s.close()


def test_a_store_that_raises_a_non_kvlife_error_is_load_errors(
    unpromoted: KVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the store raises (here a bug's ``RuntimeError``, not a kvlife error),
    in the worker's lookup or in a read part-way, the affected chunks are load errors,
    counted by reason; the other request of the step loads whole."""
    store = unpromoted
    layers = 3
    ident = _identity(layers)
    ta, _ = _prompt(store, ident, 40, 2)
    tb, kvb = _prompt(store, ident, 41, 2)
    store.flush()
    store.evict("dram", 1 << 30)  # read with load_async: a handle the loader waits on
    caches = _caches(layers, stacked=True)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    real_lookup = store.lookup

    def lookup(identity: Any, namespace: Any, tokens: Any, **kw: Any) -> Any:
        if list(tokens) == ta:
            raise RuntimeError("lookup bug")
        return real_lookup(identity, namespace, tokens, **kw)

    monkeypatch.setattr(store, "lookup", lookup)
    a_blocks, b_blocks = [0, 5, 10, 15], [1, 6, 11, BLOCKS - 1]
    plan = StepPlan(
        loads=[
            LoadSpec("a", ta, a_blocks, 0, 2 * CHUNK, PUBLIC, None),
            LoadSpec("b", tb, b_blocks, 0, 2 * CHUNK, PUBLIC, None),
        ],
        step=1,
    )
    w.start(plan)
    _forward(w, layers)
    assert w.load_errors() == set(a_blocks)
    assert _untouched(caches, a_blocks)
    _assert_loaded(caches, kvb, b_blocks)
    assert w.counters.load_failures == {"lookup": 1}
    monkeypatch.undo()

    real_load = store.load_async

    def load_async(hit: Any, *a: Any, **kw: Any) -> Any:
        handle = real_load(hit, *a, **kw)
        real_chunk = handle.chunk

        def chunk(i: int, timeout: float | None = None) -> Any:
            if i == 1:
                raise RuntimeError("read bug")
            return real_chunk(i, timeout)

        monkeypatch.setattr(handle, "chunk", chunk)  # the store's own handle, failing
        return handle

    monkeypatch.setattr(store, "load_async", load_async)
    caches = _caches(layers, stacked=True)
    w2 = WorkerSide(store, ident, block_size=BS)
    w2.register(_names(layers), caches, "halves")
    w2.start(StepPlan(loads=[LoadSpec("b", tb, b_blocks, 0, 2 * CHUNK, PUBLIC, None)], step=1))
    _forward(w2, layers)
    assert w2.load_errors() == set(b_blocks[2:])
    _assert_loaded(caches, kvb, b_blocks[:2])
    assert _untouched(caches, b_blocks[2:])
    assert w2.counters.load_failures == {"read": 1}
    w2.close()
    w.close()


def test_a_load_spec_with_too_few_blocks_is_a_typed_error_and_load_errors(
    store: KVStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A LoadSpec naming fewer blocks than its tokens need is refused where the worker
    receives it (an InvalidArgument naming the request, the tokens and the block
    count), not by a shape error deep in the copy: the blocks it does name from its
    first token on are load errors (vLLM recomputes from there), nothing is written,
    and the step's other load lands whole."""
    layers = 3
    ident = _identity(layers)
    ta, _ = _prompt(store, ident, 50, 2)
    tb, kvb = _prompt(store, ident, 51, 2)
    short = LoadSpec("short-req", ta, [2, 7, 12], BS, 2 * CHUNK, PUBLIC, None)
    caches = _caches(layers, stacked=True)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    b_blocks = [3, 8, 13, BLOCKS - 1]
    plan = StepPlan(loads=[short, LoadSpec("b", tb, b_blocks, 0, 2 * CHUNK, PUBLIC, None)], step=1)
    with caplog.at_level("WARNING", logger="kvlife.vllm"):
        w.start(plan)
        _forward(w, layers)
    assert w.load_errors() == {7, 12}
    assert _untouched(caches, [2, 7, 12])
    _assert_loaded(caches, kvb, b_blocks)
    assert w.counters.load_failures == {"spec": 1}
    assert any("short-req" in r.getMessage() for r in caplog.records)
    # its saves in the step are not staged either: what it computed attended to garbage
    assert "short-req" in w._failed
    w.close()
    with pytest.raises(InvalidArgument, match=r"short-req.*16 tokens.*3 block ids.*needs 4"):
        short.check(BS, CHUNK)


def test_a_load_spec_naming_no_block_of_its_load_fails_the_step(store: KVStore) -> None:
    """A spec whose block ids stop before its first token to load names no block vLLM
    could be told to recompute: reporting nothing would let vLLM use unwritten blocks
    as computed, so the step fails with the typed error instead."""
    layers = 3
    ident = _identity(layers)
    tokens, _ = _prompt(store, ident, 52, 2)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), _caches(layers, stacked=True), "halves")
    with pytest.raises(InvalidArgument, match="no-blocks"):
        w.start(
            StepPlan(loads=[LoadSpec("no-blocks", tokens, [], 0, 2 * CHUNK, PUBLIC, None)], step=1)
        )
    w.close()


@pytest.mark.parametrize("stacked", [True, False])
def test_a_failed_step_returns_from_wait_for_save_only_after_its_copy(
    store: KVStore, stacked: bool
) -> None:
    """The forward raises before the load finished (an out-of-memory at layer 0): vLLM
    calls ``wait_for_save`` in its ``finally``, then reuses the step's blocks. No write
    of the step's loads may land in the paged cache after ``wait_for_save`` returned."""
    layers = 3
    ident = _identity(layers)
    tokens, _ = _prompt(store, ident, 60, 2)
    caches = _caches(layers, stacked=stacked)
    w = WorkerSide(store, ident, block_size=BS)
    w.register(_names(layers), caches, "halves")
    gate = threading.Event()
    w._pool.submit(gate.wait, WAIT_S)  # the loader queues behind this
    blocks = [6, 2, 19, 1]
    plan = StepPlan(loads=[LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)], step=1)
    w.start(plan)
    timer = threading.Timer(0.3, gate.set)  # the loader runs while wait_for_save waits
    timer.start()
    try:
        raise MemoryError("out of memory at layer 0")
    except MemoryError:
        w.submit(plan)  # vLLM's finally: an exception is propagating
    after = [c.clone() for c in caches]
    timer.join()
    w.close()  # every thread of the worker done
    assert all(torch.equal(a, c) for a, c in zip(after, caches, strict=True)), (
        "the failed step's copy wrote into the paged cache after wait_for_save returned"
    )


def test_a_dram_replica_changed_after_the_workers_read_is_not_served(
    tmp_path: Path,
) -> None:
    """With ``verify_dram_on_load``, a DRAM hit is verified when ``start`` reads it, but
    copied later (a group of layers at a time, in the loader thread). A replica whose
    bytes change in between must not pass as loaded: its chunk and every later one are
    load errors (recomputed), the request's earlier chunks loaded."""
    store = KVStore.open(
        tmp_path / "store", dram_bytes=64 << 20, disk_bytes=64 << 20, verify_dram_on_load=True
    )
    try:
        layers = 3
        ident = _identity(layers)
        tokens, kv = _prompt(store, ident, 4, 2)
        key = prompt_chunk_keys(ident, PUBLIC, tokens)[1]
        caches = _caches(layers, stacked=True)
        w = WorkerSide(store, ident, block_size=BS)
        w.register(_names(layers), caches, "halves")
        gate = threading.Event()
        w._pool.submit(gate.wait, WAIT_S)  # the loader queues behind this
        blocks = [6, 2, 19, 1]
        spec = LoadSpec("r", tokens, blocks, 0, 2 * CHUNK, PUBLIC, None)
        w.start(StepPlan(loads=[spec], step=1))
        _dram_replica(store, key)[5] += 1.0  # after start's verified read, before the copy
        gate.set()
        _forward(w, layers)
        assert w.load_errors() == set(blocks[2:])
        assert w.counters.chunks_changed == 1
        _assert_loaded(caches, kv, blocks[:2])
        w.close()
    finally:
        store.close()


def test_held_a_disk_read_failing_part_way_fails_only_that_request_from_there(
    tmp_path: Path,
) -> None:
    """A's chunks come from disk, the second read on fails with EIO; B's from DRAM in the
    same step, blocks interleaved with A's. A's chunks before the failed read land, the
    failed one on are load errors and never written; B lands whole."""
    io = FaultyIO()
    store = KVStore.open(tmp_path / "store", dram_bytes=64 << 20, disk_bytes=64 << 20, fileio=io)
    try:
        layers = 3
        ident = _identity(layers)
        ta, kva = _prompt(store, ident, 30, 3)
        store.flush()
        store.evict("dram", 1 << 30)
        tb, kvb = _prompt(store, ident, 31, 2)
        caches = _caches(layers, stacked=True)
        w = WorkerSide(store, ident, block_size=BS)
        w.register(_names(layers), caches, "halves")
        a_blocks = [2, 14, 5, BLOCKS - 1, 0, 8]
        b_blocks = [3, 15, 6, 9]
        io.arm("preadv", errno.EIO, after=1)
        plan = StepPlan(
            loads=[
                LoadSpec("a", ta, a_blocks, 0, 3 * CHUNK, PUBLIC, None),
                LoadSpec("b", tb, b_blocks, 0, 2 * CHUNK, PUBLIC, None),
            ],
            step=1,
        )
        w.start(plan)
        _forward(w, layers)
        io.disarm()
        assert io.injected.get("preadv", 0) >= 1
        bad = w.load_errors()
        n = next(j for j in range(0, 6, 2) if a_blocks[j] in bad)  # A's first chunk failed
        assert bad == set(a_blocks[n:])
        _assert_loaded(caches, kva, a_blocks[:n])
        assert _untouched(caches, a_blocks[n:])
        _assert_loaded(caches, kvb, b_blocks)
        w.close()
    finally:
        store.close()
