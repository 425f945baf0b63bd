"""The sparse transform: which tokens it keeps, both decode forms, importance inputs, and
that it is never exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument, LayoutMismatch
from kvlife.transforms import Exactness, TransformError, decode, decode_frame, make_transform
from kvlife.transforms.base import EncodedPayload
from kvlife.transforms.sparse import (
    SparseTransform,
    keep_count,
    knorm_importance,
    snapkv_importance,
)


def _kv(shape: tuple[int, ...], seed: int = 0, dtype: type[np.generic] = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _sparse(**params: float | int | str) -> SparseTransform:
    t = make_transform("sparse", params)
    assert isinstance(t, SparseTransform)
    return t


def test_sparse_is_its_own_exactness_class() -> None:
    t = make_transform("sparse")
    assert t.exactness is Exactness.SPARSE
    assert t.exactness not in (Exactness.EXACT, Exactness.LOSSLESS, Exactness.LOSSY)
    assert t.error_bound is not None
    # even keeping every token it stays a sparse replica (the class is the transform's)
    assert make_transform("sparse", {"keep_ratio": 1.0}).exactness is Exactness.SPARSE


def test_keep_count() -> None:
    assert keep_count(100, 0.25, 4, 8) == 25
    assert keep_count(100, 0.05, 4, 8) == 12  # sinks and window always kept
    assert keep_count(10, 0.5, 8, 8) == 10
    assert keep_count(0, 0.5, 4, 8) == 0
    assert keep_count(64, 0.125, 0, 0) == 8


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 2),
    H=st.integers(1, 3),
    T=st.integers(0, 50),
    D=st.integers(1, 9),
    ratio=st.floats(0.01, 1.0),
    sinks=st.integers(0, 5),
    window=st.integers(0, 5),
    f16=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_given_importance_keeps_the_top_k_sinks_and_window(
    L: int,
    H: int,
    T: int,
    D: int,
    ratio: float,
    sinks: int,
    window: int,
    f16: bool,
    seed: int,
) -> None:
    x = _kv((L, 2, H, T, D), seed, np.float16 if f16 else np.float32)
    rng = np.random.default_rng(seed + 1)
    imp = rng.permutation(L * H * T).reshape(L, H, T).astype(np.float32)  # distinct scores
    t = _sparse(keep_ratio=ratio, sink_tokens=sinks, window_tokens=window)
    enc = t.encode(x, importance=imp)
    assert enc.descriptor.param_map["score"] == "given"
    k = keep_count(T, ratio, sinks, window)
    reader = make_transform("sparse", enc.descriptor.param_map)
    assert isinstance(reader, SparseTransform)
    mask = reader.kept_mask(enc)
    assert (mask.sum(axis=2) == k).all()
    S, R = min(sinks, T), min(window, T - min(sinks, T))
    assert mask[:, :, :S].all() and mask[:, :, T - R :].all()
    # every kept free token scores at least as high as every dropped one
    free = np.ones(T, bool)
    free[:S] = False
    free[T - R :] = False
    for li in range(L):
        for h in range(H):
            kept = imp[li, h][mask[li, h] & free]
            dropped = imp[li, h][~mask[li, h]]
            if kept.size and dropped.size:
                assert kept.min() > dropped.max()
    # full form: kept tokens bit-exact, dropped ones zero
    full = np.full_like(x, np.nan)
    decode_frame(enc.to_frame(), full)
    m5 = np.broadcast_to(mask[:, None, :, :, None], x.shape)
    assert np.array_equal(full[m5].view(np.uint8), x[m5].view(np.uint8))
    assert (full[~m5] == 0).all()
    # compact form: the kept tokens in position order, and their positions
    compact = np.empty((L, 2, H, k, D), x.dtype)
    pos = reader.decode_kept(enc, compact)
    assert pos.shape == (L, H, k)
    assert (np.diff(pos, axis=2) > 0).all()
    want = np.take_along_axis(x, np.broadcast_to(pos[:, None, :, :, None], compact.shape), 3)
    assert np.array_equal(compact, want)


def test_knorm_fallback_keeps_the_lowest_norm_keys() -> None:
    x = _kv((1, 2, 1, 40, 8), 3)
    x[0, 0, 0, 10] *= 0.01  # tiny key norm: kept by the proxy
    x[0, 0, 0, 20] *= 100.0  # huge key norm: dropped
    t = _sparse(keep_ratio=0.25, sink_tokens=0, window_tokens=0)
    enc = t.encode(x)
    assert enc.descriptor.param_map["score"] == "knorm"
    mask = t.kept_mask(enc)
    assert mask[0, 0, 10] and not mask[0, 0, 20]
    imp = knorm_importance(x)
    assert imp.shape == (1, 1, 40) and imp[0, 0, 10] == imp.max()


def test_snapkv_importance_groups_query_heads_and_pools() -> None:
    att = np.zeros((1, 4, 2, 10), np.float32)  # 4 query heads over 2 KV heads
    att[0, 1, :, 3] = 1.0  # query head 1 -> KV head 0
    att[0, 2, 0, 7] = 1.0  # query head 2 -> KV head 1
    imp = snapkv_importance(att, kv_heads=2, pool=3)
    assert imp.shape == (1, 2, 10)
    assert imp[0, 0, 3] == 2.0 and imp[0, 0, 2] == 2.0 and imp[0, 0, 4] == 2.0  # pooled
    assert imp[0, 0, 7] == 0.0 and imp[0, 1, 7] == 1.0
    with pytest.raises(InvalidArgument):
        snapkv_importance(att, kv_heads=3)


def test_bad_importance_and_inputs_are_refused() -> None:
    x = _kv((1, 2, 2, 16, 4))
    t = _sparse()
    with pytest.raises(LayoutMismatch):
        t.encode(x, importance=np.zeros((1, 2, 15), np.float32))
    with pytest.raises(LayoutMismatch):
        t.encode(x, importance=np.full((1, 2, 16), np.nan, np.float32))
    with pytest.raises(InvalidArgument):
        _sparse(score="given").encode(x)
    with pytest.raises(InvalidArgument):
        t.encode(x.view(np.uint32)[..., :2].astype(np.uint16))  # bf16 bits need importance
    with pytest.raises(LayoutMismatch):
        t.encode(np.zeros((2, 16, 4), np.float32))
    for bad in ({"keep_ratio": 0.0}, {"keep_ratio": 1.5}, {"score": "h2o"}, {"sink_tokens": -1}):
        with pytest.raises(InvalidArgument):
            make_transform("sparse", bad)


def test_compact_buffer_must_match() -> None:
    x = _kv((1, 2, 2, 16, 4))
    t = _sparse(keep_ratio=0.5, sink_tokens=1, window_tokens=1)
    enc = t.encode(x)
    with pytest.raises(LayoutMismatch):
        t.decode_kept(enc, np.empty((1, 2, 2, 7, 4), np.float32))
    with pytest.raises(LayoutMismatch):
        t.decode_kept(enc, np.empty((1, 2, 2, 8, 4), np.float16))


def _forge(enc: EncodedPayload, payload: np.ndarray) -> EncodedPayload:
    """Re-sign a modified payload, so only the transform's own checks can catch it."""
    import xxhash

    from kvlife.transforms import TransformDescriptor

    d = enc.descriptor
    desc = TransformDescriptor(
        d.name,
        d.version,
        d.dtype,
        d.shape,
        d.params,
        payload.size,
        xxhash.xxh3_64_intdigest(payload.data),
    )
    return EncodedPayload(desc, payload)


def test_forged_positions_are_refused_not_gathered() -> None:
    # a correctly checksummed payload whose position table is wrong (a writer bug, not
    # disk damage) must still not scatter KV to the wrong tokens
    x = _kv((1, 2, 1, 16, 4))
    t = _sparse(keep_ratio=0.5, sink_tokens=0, window_tokens=0)
    enc = t.encode(x)
    out = np.empty_like(x)
    for value in (16, 0):  # outside the chunk; a repeat (not ascending)
        p = enc.payload_view().copy()
        p[2:4] = np.array([value], np.uint16).view(np.uint8)
        with pytest.raises(TransformError):
            decode(_forge(enc, p), out)
