"""Red team of layer-group storage in the transformers engine (:mod:`kvlife.engines.hf_layers`):
malformed chunks given to ``put_groups``, a disk fault in the commit of group 1 after
group 0 committed, an invalidation between the loads of two groups of one prefill (and
the prompt stored again in between), an invalidation while group 1 is in flight in a
layered forward, a caller that changes the arrays a prefill handed out while their
promotion is pending, and a group object beside a vLLM pipeline-stage object of the
same model. Never a chunk served with one group missing or another prompt's layers;
every failure a typed error or a counted miss, recomputed to the full prefill's
output."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlife.core.errors import LayoutMismatch, StorageFullError  # noqa: E402
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity  # noqa: E402
from kvlife.core.identity import prompt_chunk_keys as chunk_keys  # noqa: E402
from kvlife.engines.hf import HFEngine  # noqa: E402
from kvlife.engines.hf_layers import group_identities, lookup_groups, put_groups  # noqa: E402
from kvlife.engines.hf_plan import PlannedEngine  # noqa: E402
from kvlife.engines.models import LoadedModel, tiny_llama  # noqa: E402
from kvlife.faults.fileio import FaultyIO  # noqa: E402
from kvlife.faults.throttle import ThrottledTier  # noqa: E402
from kvlife.store import KVStore  # noqa: E402
from tests.engines.plans import fixed, seeded_model, throttled_store  # noqa: E402

TPC = 32
LAYERS = 4
LAY = KVLayout(LAYERS, 2, 8, "float16", 16)
IDENT = ModelIdentity(model_id="m", weights_digest="w", tokenizer_digest="t", layout=LAY)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama(seed=7, layers=LAYERS)


def _full_logits(tiny: LoadedModel, ids: list[int]) -> Any:
    return HFEngine.for_model(tiny, None, tokens_per_chunk=TPC).prefill(ids, PUBLIC).logits


def _diff(logits: Any, full: Any, cached: int) -> float:
    return float((logits - full[cached:]).abs().max())


def _chunk(layers: int, fill: float = 1.0) -> np.ndarray:
    return np.full((layers, 2, 2, 16, 8), fill, np.float16)


@pytest.mark.parametrize(
    "shapes",
    [
        pytest.param((4, 6), id="a-later-chunk-with-extra-layers"),
        pytest.param((4, 5), id="a-later-chunk-with-one-extra-layer"),
        pytest.param((4, 3), id="a-later-chunk-short-of-a-layer"),
        pytest.param((1,), id="fewer-layers-than-groups"),
        pytest.param((6, 6), id="every-chunk-with-extra-layers"),
    ],
)
def test_a_chunk_that_does_not_hold_every_groups_layers_is_refused_whole(
    tmp_path: Path, shapes: tuple[int, ...]
) -> None:
    """The whole-chunk put refuses a chunk of the wrong layer count; the groups' put
    must too (it used to cut a chunk of more layers to the groups' and store it), and
    leave no group of the put visible."""
    groups = group_identities(IDENT, 2)
    ids = list(range(16 * len(shapes)))
    chunks = [_chunk(n) for n in shapes]
    with KVStore.open(tmp_path / "s", dram_bytes=64 << 20, disk_bytes=64 << 20) as store:
        with pytest.raises(LayoutMismatch, match="layers"):
            store.put_prompt(IDENT, PUBLIC, ids, chunks)
        with pytest.raises(LayoutMismatch, match="layers"):
            put_groups(store, groups, PUBLIC, ids, chunks, start=0, request_id="")
        assert [len(f.hits) for f in lookup_groups(store, groups, PUBLIC, ids, 0)] == [0, 0]
        assert not store.indexed_keys()
        assert store.info().objects_by_state.get("tentative", 0) == 0


def test_a_fault_in_the_commit_of_group_1_never_serves_group_0_alone(tmp_path: Path) -> None:
    """Group 0 commits, the disk fails group 1's write: the put raises the typed error,
    group 1 is aborted, group 0's objects (valid KV of its identity) stay but no chunk is
    usable; once the fault clears the same put stores group 1 and every chunk loads."""
    groups = group_identities(IDENT, 2)
    io = FaultyIO()
    ids = list(range(3 * 16))
    chunks = [_chunk(LAYERS, float(i + 1)) for i in range(3)]
    with KVStore.open(tmp_path / "s", dram_bytes=0, disk_bytes=64 << 20, fileio=io) as store:
        warm = [_chunk(LAYERS, 9.0)] * 3
        before = io.calls.get("pwritev", 0)
        put_groups(store, groups, PUBLIC, list(range(1000, 1048)), warm, start=0, request_id="")
        per_group = (io.calls.get("pwritev", 0) - before) // 2
        assert per_group >= 1
        io.arm("pwritev", errno.ENOSPC, after=per_group)
        with pytest.raises(StorageFullError):
            put_groups(store, groups, PUBLIC, ids, chunks, start=0, request_id="")
        found = lookup_groups(store, groups, PUBLIC, ids, 0)
        assert [len(f.hits) for f in found] == [0, 0], "a chunk with group 1 missing"
        assert len(store.lookup(groups[0], PUBLIC, ids).hits) == 3  # group 0 committed
        assert len(store.lookup(groups[1], PUBLIC, ids).hits) == 0
        assert store.info().objects_by_state.get("tentative", 0) == 0
        io.disarm()
        assert put_groups(store, groups, PUBLIC, ids, chunks, start=0, request_id="") == 3
        found = lookup_groups(store, groups, PUBLIC, ids, 0)
        out = np.zeros((LAYERS, 2, 2, 3 * 16, 8), np.float16)
        for g, (f, first) in enumerate(zip(found, (0, 2), strict=True)):
            views = [out[first : first + 2, :, :, i * 16 : (i + 1) * 16] for i in range(3)]
            assert store.load(f, views).loaded == 3, f"group {g}"
        for i in range(3):
            assert np.array_equal(out[:, :, :, i * 16 : (i + 1) * 16], chunks[i])


@pytest.mark.parametrize(
    "again", [False, True], ids=["invalidated", "invalidated-and-stored-again"]
)
def test_an_invalidation_between_two_groups_loads_is_never_served_half(
    tiny: LoadedModel, tmp_path: Path, again: bool
) -> None:
    """The engine's own prefill loads group 0, then group 1. Between them the prompt is
    invalidated (and, second case, stored again by another request): group 1 is a miss
    and the prefill recomputes, or group 1 is the new object, whose bytes are the old
    ones (a key names the bytes); either way the output is a full prefill's."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 512, 6 * TPC + 5).tolist()
    full = _full_logits(tiny, ids)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        eng.generate(ids, PUBLIC, max_new_tokens=1)
        other = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        real = store.load
        calls: list[int] = []

        def load(lookup: Any, outs: Any = None, **kw: Any) -> Any:
            res = real(lookup, outs, **kw)
            calls.append(res.loaded)
            if len(calls) == 1:  # group 0 landed: the prompt goes, maybe comes back
                assert store.invalidate(namespace=PUBLIC) == 12
                if again:  # another request computes and stores the prompt again
                    other.generate(ids, PUBLIC, max_new_tokens=1)
                    assert len(store.indexed_keys()) == 12
            return res

        store.load = load  # type: ignore[method-assign]
        try:
            pre = eng.prefill(ids, PUBLIC)
        finally:
            store.load = real  # type: ignore[method-assign]
        assert calls[0] == 6
        cached = pre.cached_tokens
        if again:
            assert cached in (0, 6 * TPC)
        else:
            assert cached == 0 and len(pre.loaded_chunks) == 0
        assert _diff(pre.logits, full, cached) <= 1e-4


def test_an_invalidation_while_group_1_is_in_flight_abandons_the_layered_forward(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group 0 lands; group 1's reads are held in the device until the prompt is
    invalidated (once group 0 landed): group 1's chunks vanish under their reads, the
    forward that used group 0 is abandoned and the prompt recomputed (counted).

    Group 1 is held by a gate, not left to trickle through a throttle: timed, its reads
    could all finish before the invalidation on a busy machine (CI saw it once)."""
    rng = np.random.default_rng(12)
    ids = rng.integers(0, 512, 6 * TPC + 9).tolist()
    full = _full_logits(tiny, ids)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        eng.generate(ids, PUBLIC, max_new_tokens=1)
        tier = store.tier("disk")
        assert isinstance(tier, ThrottledTier)
        group_bytes = 6 * eng.identity.layout.chunk_nbytes // 2
        planned = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"))
        keys0 = chunk_keys(eng.group_identities[0], PUBLIC, ids[: 6 * TPC])
        keys1 = set(chunk_keys(eng.group_identities[1], PUBLIC, ids[: 6 * TPC]))
        gate = threading.Event()
        held: list[int] = []

        def gated(read: Any) -> Any:
            def call(keys: Any, outs: Any = None) -> Any:
                if keys1.intersection(keys):
                    held.append(len(keys))
                    assert gate.wait(30.0), "group 1's reads were never released"
                return read(keys, outs)

            return call

        monkeypatch.setattr(tier, "read_batch", gated(tier.read_batch))
        monkeypatch.setattr(tier, "read_verified", gated(tier.read_verified))
        done = threading.Event()
        gone: list[int] = []

        def invalidate_when_group_0_landed() -> None:
            # group 0 landed: its chunks' loads were published; group 1 is held (both
            # waited for: on a busy machine group 0 could land before group 1's reads
            # were issued, and an invalidation then left them nothing to read)
            try:
                while not done.is_set():
                    if store.counters.bytes_loaded >= group_bytes and held:
                        gone.append(store.invalidate(namespace=PUBLIC))
                        return
                    done.wait(0.005)
            finally:
                gate.set()

        t = threading.Thread(target=invalidate_when_group_0_landed)
        t.start()
        try:
            _, res = planned.generate(ids, PUBLIC, max_new_tokens=1, policy=fixed(0, 6))
        finally:
            done.set()
            gate.set()
            t.join()
        assert gone == [12] and held
        assert keys0[0] not in store.indexed_keys()
        cached = res.prefill.cached_tokens
        assert res.layered and res.loaded == 0 and cached == 0
        assert planned.counters.abandoned == 1 and planned.counters.misses == 1
        assert _diff(res.prefill.logits, full, cached) <= 1e-4
        assert planned.settle(30.0)


def test_changing_what_a_prefill_handed_out_changes_nothing_stored(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The loaded chunks are views of the engine's landing buffer and the promotion of
    disk hits into DRAM is pending when the prefill returns: a caller that scribbles on
    the chunks and the cache at once must not reach the promoted replicas."""
    rng = np.random.default_rng(13)
    ids = rng.integers(0, 512, 4 * TPC + 3).tolist()
    full = _full_logits(tiny, ids)
    path = tmp_path / "s"
    with KVStore.open(path, dram_bytes=0, disk_bytes=64 << 20) as store:
        HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2).generate(
            ids, PUBLIC, max_new_tokens=1
        )
    with KVStore.open(path, dram_bytes=64 << 20, disk_bytes=64 << 20) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        pre = eng.prefill(ids, PUBLIC)
        assert pre.cached_tokens == 4 * TPC and pre.tiers == {"disk": 4}
        assert len(pre.loaded_chunks) == 4
        for arr in pre.loaded_chunks:
            arr[...] = 7  # at once, while the promotions may still run
        for layer in pre.cache.layers:
            layer.keys.zero_()
        store.drain()
        assert store.counters.promotions >= 8
        again = eng.prefill(ids, PUBLIC)
        assert again.cached_tokens == 4 * TPC
        assert again.tiers == {"dram": 4}, "served from the promoted replicas"
        assert _diff(again.logits, full, again.cached_tokens) <= 1e-4
        assert store.check().clean


def test_a_forward_that_fails_while_groups_load_leaves_no_read_in_the_next_buffer(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A planned prefill's forward fails (an out-of-memory, an interrupt) while its
    group loads are still reading into the engine's landing buffer. The next prefill
    must not land its chunks in that buffer: a read of the failed request that ends
    there later overwrites verified chunks of the next one with another prompt's KV.
    Here the failed request's first read is held in the disk's seam until the next
    prefill has loaded its group 0."""
    rng = np.random.default_rng(14)
    ids_a = rng.integers(0, 512, 4 * TPC + 3).tolist()
    ids_b = rng.integers(0, 512, 4 * TPC + 3).tolist()
    full_b = _full_logits(tiny, ids_b)
    io = FaultyIO()
    with KVStore.open(
        tmp_path / "s", dram_bytes=0, disk_bytes=64 << 20, fileio=io, promote_on_hit=False
    ) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        eng.generate(ids_a, PUBLIC, max_new_tokens=1)
        eng.generate(ids_b, PUBLIC, max_new_tokens=1)
        planned = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"))
        stall = io.stall("preadv", timeout_s=30.0)  # A's first read: group 0, chunk 0
        real_suffix = eng._prefill_suffix

        def failing(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("simulated: the forward ran out of memory")

        eng._prefill_suffix = failing  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="simulated"):
            planned.prefill(ids_a, PUBLIC, policy=fixed(0, 4))
        eng._prefill_suffix = real_suffix  # type: ignore[method-assign]
        assert stall.wait_entered(10.0)
        real_load = store.load
        calls: list[int] = []

        def load(lookup: Any, outs: Any = None, **kw: Any) -> Any:
            res = real_load(lookup, outs, **kw)
            calls.append(res.loaded)
            if len(calls) == 1:  # B's group 0 landed: A's held read ends now
                stall.release()
                time.sleep(0.5)
            return res

        store.load = load  # type: ignore[method-assign]
        try:
            pre = eng.prefill(ids_b, PUBLIC)
        finally:
            store.load = real_load  # type: ignore[method-assign]
            stall.release()
        assert calls == [4, 4] and pre.cached_tokens == 4 * TPC
        assert _diff(pre.logits, full_b, pre.cached_tokens) <= 1e-4, "A's KV in B's prefix"
        assert not stall.timed_out


def test_a_layer_group_never_shares_a_key_with_a_vllm_pipeline_stage(tiny: LoadedModel) -> None:
    """A group of the transformers engine has the identity fields of a pipeline stage;
    a vLLM stage of the same model (same digests, same layers) differs by its engine
    digest, which the transformers engine leaves empty: the keys never meet."""
    from kvlife.engines.vllm.identity import EngineFacts, identity_for

    eng = HFEngine.for_model(tiny, None, tokens_per_chunk=TPC, layer_groups=2)
    ident = eng.identity
    lay = ident.layout
    assert ident.engine_digest == ""
    facts = EngineFacts(
        model=ident.model_id,
        revision="",
        weights_digest=ident.weights_digest,
        tokenizer_digest=ident.tokenizer_digest,
        position_digest=ident.position_encoding_digest,
        num_layers=lay.num_layers,
        total_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        kv_dtype=lay.dtype,
        compute_dtype=lay.dtype,
        block_size=16,
        tp_size=1,
        pp_size=2,
        engine_version="x",
        stage_layers=((0, 2), (2, 4)),
    )
    ids = list(range(2 * TPC))
    for g, group in enumerate(eng.group_identities):
        stage = identity_for(facts, tp_rank=0, tokens_per_chunk=TPC, pp_rank=g)
        assert stage.layout == group.layout, "the same layers, the same fields"
        assert stage.digest != group.digest
        assert not set(chunk_keys(stage, PUBLIC, ids)) & set(chunk_keys(group, PUBLIC, ids))


def test_group_views_take_direct_reads_in_aligned_runs(tmp_path: Path) -> None:
    """A group's landing views are strided slices of the engine's buffer (its layers of
    each chunk's positions); with runs of whole 4 KiB pages a disk read lands in them
    directly, piece by piece: every group's bytes where they belong, none elsewhere."""
    from kvlife.engines.hf_layers import group_views, layer_groups
    from kvlife.tiers.buffers import aligned_empty, aligned_runs

    lay = KVLayout(LAYERS, 2, 64, "float32", 16)  # a head's 16 tokens: 4 KiB
    ident = ModelIdentity(model_id="m", weights_digest="w", tokenizer_digest="t", layout=lay)
    groups = group_identities(ident, 2)
    rng = np.random.default_rng(15)
    chunks = [rng.standard_normal(lay.chunk_shape).astype(np.float32) for _ in range(3)]
    ids = list(range(3 * 16))
    with KVStore.open(tmp_path / "s", dram_bytes=0, disk_bytes=64 << 20) as store:
        assert put_groups(store, groups, PUBLIC, ids, chunks, start=0, request_id="") == 3
        buf = aligned_empty(LAYERS * 2 * 2 * 48 * 64 * 4).view(np.float32)
        buf = buf.reshape(LAYERS, 2, 2, 48, 64)
        buf[...] = np.nan
        views = group_views(buf, layer_groups(LAYERS, 2), 3, 16)
        assert all(aligned_runs(v) for vs in views for v in vs), "direct reads possible"
        for found, vs in zip(lookup_groups(store, groups, PUBLIC, ids, 0), views, strict=True):
            assert store.load(found, vs).loaded == 3
        for i in range(3):
            assert np.array_equal(buf[:, :, :, i * 16 : (i + 1) * 16], chunks[i])
