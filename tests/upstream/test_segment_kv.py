"""Position-independent segment KV on the real SmolLM2: moving a segment re-rotates its
keys exactly, the blended prefill is the model's own prefill when every token is
recomputed and recomputes only the bounded set otherwise, and a segment replica (lossy)
is never served to a lookup that accepts only exact or lossless KV."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvlife.core.identity import PUBLIC, Namespace
from kvlife.core.sources import Source
from kvlife.transforms.contract import Accept
from kvlife.upstream.builder import PromptBuilder
from kvlife.upstream.segments import SEGMENT_BLEND, SegmentCache
from tests.conftest import TINY, tiny_identity

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlife.engines.models import LoadedModel, load_smollm2  # noqa: E402
from kvlife.upstream.blend import ReusedSpan, SegmentBlender, compute_kv  # noqa: E402
from kvlife.upstream.rope import move_kv, rope_inv_freq  # noqa: E402

TEXT = (
    "Licensed under the Apache License, Version 2.0 (the License); you may not use this "
    "file except in compliance with the License. You may obtain a copy of the License at "
    "the address below. Unless required by applicable law or agreed to in writing, "
    "software distributed under the License is distributed on an AS IS BASIS."
)


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    torch.set_num_threads(1)
    return load_smollm2()


def _ids(smol: LoadedModel, text: str) -> list[int]:
    assert smol.tokenizer is not None
    return [int(t) for t in smol.tokenizer(text, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize(("at", "to"), [(0, 300), (37, 1000), (500, 11)])
def test_a_moved_segment_is_the_kv_computed_at_the_new_position(
    smol: LoadedModel, at: int, to: int
) -> None:
    seg = _ids(smol, TEXT)[:48]
    inv = rope_inv_freq(smol.model)
    there = compute_kv(smol.model, seg, to)
    moved = move_kv(compute_kv(smol.model, seg, at), to - at, inv)
    scale = float(there.abs().max())
    # float32 rounding of the model's own cos/sin at both positions: ~1e-4 of the scale
    assert float((moved - there).abs().max()) < 2e-5 * scale + 1e-4
    # the check can fail: keys left where they were, or turned the wrong way, are far off
    unmoved = compute_kv(smol.model, seg, at)
    assert float((unmoved[:, 0] - there[:, 0]).abs().max()) > 0.05 * scale
    wrong_way = move_kv(unmoved, at - to, inv)
    assert float((wrong_way[:, 0] - there[:, 0]).abs().max()) > 0.05 * scale
    # values carry no position: equal as they are
    assert float((unmoved[:, 1] - there[:, 1]).abs().max()) < 2e-5 * scale + 1e-4


def test_blending_with_every_token_recomputed_is_the_models_prefill(smol: LoadedModel) -> None:
    ids = _ids(smol, TEXT)
    inv = rope_inv_freq(smol.model)
    with torch.no_grad():
        ref = smol.model(input_ids=torch.tensor([ids])).logits[0, -1]
    seg = ReusedSpan(10, move_kv(compute_kv(smol.model, ids[10:40], 0), 10, inv))
    for reused in ([], [seg]):
        got = SegmentBlender(smol.model, ratio=1.0).prefill(ids, reused)
        assert got.recomputed == list(range(len(ids)))
        assert float((got.logits[0] - ref).abs().max()) < 1e-3
        assert got.compute_fraction == 1.0


def test_blending_recomputes_the_bounded_set(smol: LoadedModel) -> None:
    ids = _ids(smol, TEXT)
    inv = rope_inv_freq(smol.model)
    a, b = 5, 45
    seg = ReusedSpan(a, move_kv(compute_kv(smol.model, ids[a:b], 0), a, inv))
    got = SegmentBlender(smol.model, ratio=0.15).prefill(ids, [seg])
    covered = b - a
    uncovered = set(range(len(ids))) - set(range(a, b))
    chosen = set(got.recomputed) - uncovered
    assert uncovered <= set(got.recomputed)
    assert len(chosen) == math.ceil(0.15 * covered) and chosen <= set(range(a, b))
    assert got.reused_tokens == covered and got.compute_fraction < 1.0
    assert int(got.cache.get_seq_length()) == len(ids)


def test_an_exact_prefix_is_taken_as_given_and_never_recomputed(smol: LoadedModel) -> None:
    ids = _ids(smol, TEXT)
    inv = rope_inv_freq(smol.model)
    with torch.no_grad():
        ref = smol.model(input_ids=torch.tensor([ids])).logits[0, -1]
    prefix = compute_kv(smol.model, ids[:16], 0)
    seg = ReusedSpan(20, move_kv(compute_kv(smol.model, ids[20:50], 0), 20, inv))
    exact = SegmentBlender(smol.model, ratio=1.0).prefill(ids, [seg], prefix)
    assert exact.recomputed == list(range(16, len(ids)))
    assert float((exact.logits[0] - ref).abs().max()) < 1e-3
    got = SegmentBlender(smol.model, ratio=0.15).prefill(ids, [seg], prefix)
    assert min(got.recomputed) == 16 and got.exact_tokens == 16
    assert len(set(got.recomputed) & set(range(20, 50))) == math.ceil(0.15 * 30)
    assert got.reused_tokens == 16 + 30


def test_a_lossy_segment_replica_is_never_served_to_an_exact_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvlife.upstream.segments as segments

    cache = SegmentCache(tiny_identity(), ratio=0.15)
    prompt = PromptBuilder().system([1, 2, 3]).document("d@1", [4, 5, 6, 7]).build()
    kv = np.ones((TINY.num_layers, 2, TINY.num_kv_heads, 4, TINY.head_dim), np.float32)
    cache.put(PUBLIC, prompt.segments[1], 3, kv)
    for exact in (Accept.EXACT, Accept.LOSSLESS):
        got = cache.lookup(PUBLIC, prompt, exact)
        assert got.hits == [] and "lossy" in got.refused
    assert [h.span.start for h in cache.lookup(PUBLIC, prompt, Accept.lossy()).hits] == [3]
    assert cache.lookup(PUBLIC, prompt, Accept.lossy(transforms=["int8"])).hits == []
    assert cache.lookup(PUBLIC, prompt, Accept.lossy(transforms=[SEGMENT_BLEND])).hits
    # a KL bound: refused while unmeasured or above it, served within it
    monkeypatch.setattr(segments, "MEASURED_KL", {})
    assert "no measured KL" in cache.lookup(PUBLIC, prompt, Accept.lossy(max_kl=1.0)).refused
    monkeypatch.setattr(segments, "MEASURED_KL", {0.15: 0.05})
    assert cache.lookup(PUBLIC, prompt, Accept.lossy(max_kl=0.01)).hits == []
    assert cache.lookup(PUBLIC, prompt, Accept.lossy(max_kl=0.1)).hits
    # another version, other text or another namespace is not the segment
    moved = PromptBuilder().document("d@2", [4, 5, 6, 7]).build()
    assert cache.lookup(PUBLIC, moved, Accept.lossy()).hits == []
    edited = PromptBuilder().document("d@1", [4, 5, 6, 8]).build()
    assert cache.lookup(PUBLIC, edited, Accept.lossy()).hits == []
    other = Namespace.parse("user:bob")
    assert cache.lookup(other, prompt, Accept.lossy()).hits == []
    # invalidation by source and version
    assert cache.invalidate("d", before_version=1) == 0
    assert cache.invalidate("d", before_version=2) == 1
    assert cache.lookup(PUBLIC, prompt, Accept.lossy()).hits == []
    assert Source("d", 1) not in {r.source for r in cache._replicas.values()}
