"""The DRAM tiers' seal. The memory tier's fused copy-and-seal
(:func:`kvlife.tiers.memory.copy_sealed`): the copy holds the source's bytes and its
seal is the one-shot xxh3-128 of them (:func:`~kvlife.tiers.base.seal_of`), whatever
the shape, dtype, strides and block size (the seal becomes a disk frame's checksum
unchanged, so it must be byte-identical). The meta a DRAM tier records with a seal
(:func:`~kvlife.tiers.base.sealed_meta`) loses nothing else of the writer's."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlife.core.identity import ChunkKey
from kvlife.tiers.base import ReplicaMeta, dtype_name, seal_of, sealed_meta
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.memory import SEAL_BLOCK, copy_sealed


@st.composite
def sources(draw: st.DrawFn) -> np.ndarray:
    """An array of 1-5 axes, contiguous or a strided cut of a larger one (a chunk cut
    out of a KV tensor along its token axis, a step, a reversed axis)."""
    dtype = draw(st.sampled_from([np.uint8, np.float16, np.float32, np.int64]))
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=5))
    base_shape = [n + draw(st.integers(0, 3)) for n in shape]
    seed = draw(st.integers(0, 2**32 - 1))
    base = np.random.default_rng(seed).integers(0, 256, int(np.prod(base_shape)) * 8, np.uint8)
    base = base.view(dtype)[: int(np.prod(base_shape))].reshape(base_shape)
    cut = tuple(
        slice(None, None, -1) if draw(st.booleans()) and draw(st.booleans()) else slice(0, n)
        for n in shape
    )
    arr = base[cut][tuple(slice(0, n) for n in shape)]
    if draw(st.booleans()):
        arr = np.ascontiguousarray(arr)
    return arr


@given(arr=sources(), block=st.integers(1, 512))
def test_the_fused_seal_is_the_one_shot_seal_of_the_bytes_copied(
    arr: np.ndarray, block: int
) -> None:
    raw = aligned_empty(arr.nbytes)
    seal = copy_sealed(raw, arr, block)
    want = np.ascontiguousarray(arr)
    assert np.array_equal(raw, want.reshape(-1).view(np.uint8))  # bits: NaNs too
    assert seal == seal_of(want) == seal_of(raw)


def test_a_chunk_with_rows_larger_than_a_block_is_copied_and_sealed_whole() -> None:
    """A 16 MiB chunk of a KV layout (8 layers x 2 x 8 heads x 1024 tokens x 64 dims
    fp16, cut from a longer prompt) has rows of 2 MiB, larger than a block: the copy
    and the seal still cover every byte."""
    kv = np.random.default_rng(1).integers(0, 1 << 15, (8, 2, 8, 2048, 64), np.uint16)
    chunk = kv[:, :, :, 1024:].view(np.float16)
    assert chunk[0].nbytes > SEAL_BLOCK
    raw = aligned_empty(chunk.nbytes)
    assert copy_sealed(raw, chunk) == seal_of(np.ascontiguousarray(chunk))
    assert np.array_equal(raw.view(np.uint16).reshape(chunk.shape), kv[:, :, :, 1024:])


def test_a_sealed_meta_keeps_every_field_but_the_seal_links_and_verification() -> None:
    """:func:`sealed_meta` builds the meta a DRAM tier records field by field (cheaper
    than ``dataclasses.replace``): every field of ReplicaMeta, including any added
    later, is carried over, except those it is meant to set."""
    meta = ReplicaMeta(
        ChunkKey(bytes(range(32))),
        "float16",
        (2, 3),
        "fp8",
        b"info",
        b"c" * 16,
        b"form",
        True,
        ((b"a" * 32, b"b" * 32),),
        born=b"born",
    )
    got = sealed_meta(meta, b"s" * 16)
    assert (got.checksum, got.links, got.verify_checksum) == (b"s" * 16, (), False)
    for f in fields(ReplicaMeta):
        if f.name not in {"checksum", "links", "verify_checksum"}:
            assert getattr(got, f.name) == getattr(meta, f.name), f.name
    assert got == replace(meta, checksum=b"s" * 16, links=(), verify_checksum=False)


def test_dtype_name_is_numpys_name() -> None:
    for dt in (np.float16, np.float32, np.uint8, np.int64, ">f4"):
        assert dtype_name(np.dtype(dt)) == np.dtype(dt).name


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("cut", ["contiguous", "token slice"])
def test_a_chunk_larger_than_a_block_seals_the_same_either_way(
    native: bool, cut: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk larger than a block is copied and sealed by the extension (each block
    hashed, then streamed) where it can, else block by block in Python: the same bytes
    and the same seal, the one-shot xxh3-128 of the chunk's C-order bytes."""
    from kvlife.native.copies import sealing
    from kvlife.tiers import memory

    if native and not sealing():
        pytest.skip("the native extension's sealed copy is not available")
    if not native:
        monkeypatch.setattr(memory, "native_sealing", lambda: False)
    kv = np.random.default_rng(7).integers(0, 1 << 15, (4, 2, 4, 512, 64), np.uint16)
    chunk = kv if cut == "contiguous" else kv[:, :, :, 128:384]
    assert chunk.nbytes > SEAL_BLOCK
    raw = aligned_empty(chunk.nbytes)
    assert copy_sealed(raw, chunk) == seal_of(np.ascontiguousarray(chunk))
    assert np.array_equal(raw.view(np.uint16).reshape(chunk.shape), chunk)
