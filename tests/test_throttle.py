"""The throttling tier wrapper (kvlife.faults.throttle): a throttled disk tier in a real
store's chain takes at least the time its bandwidth implies to serve a load, returns the
bytes that were put, and keeps the disk tier's capability interfaces."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.faults.throttle import MB, ThrottledDiskOptions, ThrottledTier, TokenBucket
from kvlife.store import KVStore, StoreConfig, TierSpec
from kvlife.tiers.base import KeepsEdges, SupportsAudit, SupportsBatchDelete
from kvlife.tiers.options import TierOptionError

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", tokens_per_chunk=64)
IDENTITY = ModelIdentity(
    model_id="throttle-test", weights_digest="0f" * 16, tokenizer_digest="1e" * 16, layout=LAYOUT
)
CHUNK_BYTES = 4 * 2 * 4 * 64 * 64 * 4  # 512 KiB


def _store(path: Path, mb_s: float) -> KVStore:
    spec = TierSpec(
        "throttled-disk",
        "disk",
        256 << 20,
        options=ThrottledDiskOptions(read_mb_s=mb_s, segment_bytes=64 << 20, direct_io=False),
    )
    return KVStore(path, StoreConfig(tiers=(spec,), promote_on_hit=False))


def _chunks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (4, 2, 4, 64, 64)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def test_a_throttled_disk_load_takes_the_time_its_bandwidth_implies(tmp_path: Path) -> None:
    n, mb_s = 6, 4.0
    chunks = _chunks(n, 1)
    tokens = list(range(n * 64))
    with _store(tmp_path, mb_s) as store:
        tier = store.tier("disk")
        assert isinstance(tier, ThrottledTier)
        # the wrapper is the disk tier in every capability the store tests for
        assert isinstance(tier, SupportsBatchDelete | SupportsAudit | KeepsEdges)
        assert isinstance(tier, SupportsAudit) and isinstance(tier, KeepsEdges)
        store.put_prompt(IDENTITY, PUBLIC, tokens, chunks)
        store.flush()
        hits = store.lookup(IDENTITY, PUBLIC, tokens)
        assert len(hits.hits) == n and {h.tier for h in hits.hits} == {"disk"}
        t0 = time.monotonic()
        got = store.load_async(hits).wait()
        took = time.monotonic() - t0
        assert got.loaded == n
        for a, b in zip(got.arrays, chunks, strict=True):
            assert np.array_equal(a, b)  # bytes unchanged
        # 3 MiB at 4 MB/s: 0.79 s; the same load unthrottled takes milliseconds
        bound = n * CHUNK_BYTES / (mb_s * MB)
        assert took >= 0.95 * bound, f"load took {took:.3f} s, the throttle implies {bound:.3f}"
        assert tier.counters.bytes_read == n * CHUNK_BYTES
        assert store.check().clean
        # the limit changes while the store is open: unlimited now
        tier.set_limits(0.0)
        t0 = time.monotonic()
        again = store.load(store.lookup(IDENTITY, PUBLIC, tokens))
        assert again.loaded == n and time.monotonic() - t0 < bound


def test_the_token_bucket_shares_its_rate_between_readers() -> None:
    bucket = TokenBucket(10 * MB, 0)
    t0 = time.monotonic()
    for _ in range(4):
        bucket.take(MB // 2)
    assert time.monotonic() - t0 >= 0.95 * 0.2


def test_bad_throttle_settings_are_named() -> None:
    with pytest.raises(TierOptionError, match="read_mb_s"):
        ThrottledDiskOptions(read_mb_s=-1.0)
    with pytest.raises(TierOptionError, match="read_latency_ms"):
        ThrottledDiskOptions(read_latency_ms=-1.0)
    with pytest.raises(InvalidArgument):
        TokenBucket(-1.0, 0)
