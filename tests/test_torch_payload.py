"""Torch tensors go in and come out bit-exact, bfloat16 included (skipped without torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.core.errors import LayoutMismatch
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.core.payload import to_torch
from kvlife.store import KVStore

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_torch_kv_round_trips_bit_exact(tmp_path: Path, dtype: str) -> None:
    layout = KVLayout(2, 2, 8, dtype, 16)
    ident = ModelIdentity("m", "w", "t", layout)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 2, 40, 8, generator=gen).to(getattr(torch, dtype))
    tokens = list(range(40))
    with KVStore.open(tmp_path, dram_bytes=4 * layout.chunk_nbytes, disk_bytes=1 << 22) as store:
        assert store.put_prompt(ident, PUBLIC, tokens, kv).stored == 2
        store.evict("dram", 1 * layout.chunk_nbytes)  # one chunk comes back from disk
        loaded = store.get(ident, PUBLIC, tokens)
        assert loaded.loaded == 2 and set(loaded.tiers) == {"dram", "disk"}
        for i, arr in enumerate(loaded.arrays):
            t = to_torch(arr, dtype)
            assert t.dtype == getattr(torch, dtype)
            assert torch.equal(t, kv[:, :, :, i * 16 : (i + 1) * 16])
        with pytest.raises(LayoutMismatch, match="dtype"):
            store.put_prompt(ident, PUBLIC, tokens, kv.to(torch.float64))
