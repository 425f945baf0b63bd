"""``stream_copy`` (a served put's copy into the arena, kvlife/native/copies.py) gives
``np.copyto``'s bytes and errors, streamed or not; ``copy_sealed`` the same bytes and
their seal."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvlife.native import frames
from kvlife.native.copies import STREAM_BYTES, copy_sealed, sealing, stream_copy
from kvlife.tiers.base import seal_of

needs_native = pytest.mark.skipif(not frames.available(), reason="no C extension built")


def _misaligned(
    n: int, dtype: str, dst_at: int, src_at: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``n`` random items of ``dtype`` at byte ``src_at`` of a buffer, a destination for
    them at byte ``dst_at`` of another filled with 0xA5 (64 bytes of guard in all), that
    whole buffer, and what it must hold after a correct copy."""
    item = np.dtype(dtype).itemsize
    rng = np.random.default_rng(seed)
    src_mem = rng.integers(0, 256, n * item + 64, dtype=np.uint8)
    src = src_mem[src_at : src_at + n * item].view(dtype)
    dst_mem = np.full(n * item + 64, 0xA5, np.uint8)
    dst = dst_mem[dst_at : dst_at + n * item].view(dtype)
    want = dst_mem.copy()
    want[dst_at : dst_at + n * item] = src_mem[src_at : src_at + n * item]
    return src, dst, dst_mem, want


@settings(max_examples=60, deadline=None)
@given(
    nbytes=st.sampled_from([0, 1, 15, 63, 64, 65, 4095, STREAM_BYTES - 1, STREAM_BYTES])
    | st.integers(STREAM_BYTES, 3 * STREAM_BYTES + 77),
    dst_at=st.integers(0, 31),
    src_at=st.integers(0, 31),
    dtype=st.sampled_from(["u1", "<f2", "<f4"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_copy_is_copyto_s_at_any_size_and_alignment(
    nbytes: int, dst_at: int, src_at: int, dtype: str, seed: int
) -> None:
    """Every size around the streaming threshold and the 16-byte and 64-byte steps of
    the streaming loop, at every misalignment of either side: the bytes copyto gives,
    and nothing written past the destination's ends."""
    src, dst, dst_mem, want = _misaligned(
        nbytes // np.dtype(dtype).itemsize, dtype, dst_at, src_at, seed
    )
    stream_copy(dst, src)
    assert np.array_equal(dst_mem, want)


@needs_native
def test_large_copies_are_streamed_and_small_ones_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces from STREAM_BYTES up go to the extension; smaller ones, arrays that are
    not C-contiguous and differing shapes go to np.copyto (with its broadcasting)."""
    module = frames.native_module()
    calls: list[int] = []

    class Counting:
        def stream_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
            calls.append(dst.nbytes)
            assert module is not None
            module.stream_copy(dst, src)

    monkeypatch.setattr(frames, "native_module", lambda: Counting())
    big = np.arange(STREAM_BYTES, dtype=np.uint8)
    out = np.zeros_like(big)
    stream_copy(out, big)
    assert calls == [STREAM_BYTES] and np.array_equal(out, big)
    stream_copy(out[:100], big[:100])
    strided = np.zeros((2, STREAM_BYTES), np.uint8)[:, ::2]
    stream_copy(strided, np.ones((2, STREAM_BYTES // 2), np.uint8))
    row = np.arange(STREAM_BYTES, dtype=np.uint8)
    grid = np.zeros((2, STREAM_BYTES), np.uint8)
    stream_copy(grid, row)  # broadcast, as np.copyto does
    assert calls == [STREAM_BYTES]
    assert (strided == 1).all() and (grid == row).all()


@needs_native
def test_overlapping_buffers_copy_as_copyto_does() -> None:
    """A source and destination that share bytes: the result np.copyto gives (the
    extension moves them, it does not stream them)."""
    mem = np.arange(4 * STREAM_BYTES, dtype=np.uint8)
    want = mem.copy()
    np.copyto(want[100 : 100 + 2 * STREAM_BYTES], want[: 2 * STREAM_BYTES].copy())
    stream_copy(mem[100 : 100 + 2 * STREAM_BYTES], mem[: 2 * STREAM_BYTES])
    assert np.array_equal(mem, want)


def test_errors_are_copyto_s() -> None:
    """A read-only destination or shapes that do not broadcast: np.copyto's ValueError,
    before any byte moved."""
    src = np.ones(STREAM_BYTES, np.uint8)
    ro = np.zeros(STREAM_BYTES, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        stream_copy(ro, src)
    assert not ro.any()
    dst = np.zeros(STREAM_BYTES + 1, np.uint8)
    with pytest.raises(ValueError):
        stream_copy(dst, src)
    assert not dst.any()


@needs_native
def test_the_extension_refuses_buffers_of_two_lengths() -> None:
    module = frames.native_module()
    assert module is not None
    dst = np.zeros(STREAM_BYTES, np.uint8)
    with pytest.raises(ValueError, match="stream_copy"):
        module.stream_copy(dst, np.ones(STREAM_BYTES - 1, np.uint8))
    assert not dst.any()


def test_a_source_that_is_not_an_array_is_copyto_s() -> None:
    """A list, a scalar or a bytes-backed memoryview as the source: what np.copyto
    makes of it, bytes or error (the extension takes arrays only)."""
    sources: list[object] = [
        [7] * STREAM_BYTES,
        3,
        np.uint8(5),
        memoryview(bytes(range(256)) * (STREAM_BYTES // 256)),
    ]
    for src in sources:
        want = np.zeros(STREAM_BYTES, np.uint8)
        got = np.zeros(STREAM_BYTES, np.uint8)
        try:
            np.copyto(want, src)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            with pytest.raises(type(exc)):
                stream_copy(got, src)  # type: ignore[arg-type]
        else:
            stream_copy(got, src)  # type: ignore[arg-type]
        assert np.array_equal(got, want), type(src)


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 4),
    tokens=st.integers(1, 96),
    head_dim=st.sampled_from([8, 64, 128]),
    dtype=st.sampled_from(["u1", "<f2", "<f4"]),
    cut=st.data(),
)
def test_a_chunk_cut_from_one_kv_tensor_is_streamed_exactly(
    layers: int, heads: int, tokens: int, head_dim: int, dtype: str, cut: st.DataObject
) -> None:
    """A chunk that is a slice of the whole prompt's KV tensor ([layers, 2, heads, T,
    head_dim] cut along T, as put_prompt cuts one tensor): strided, each (layer, k or v,
    head) a contiguous run. The extension streams it when every run is at least
    STREAM_RUN bytes (it says False otherwise, and np.copyto does it); the bytes are
    np.copyto's either way."""
    total = tokens + cut.draw(st.integers(0, 40))
    start = cut.draw(st.integers(0, total - tokens))
    rng = np.random.default_rng(tokens * 7919 + head_dim)
    kv = rng.integers(0, 256, (layers, 2, heads, total, head_dim * np.dtype(dtype).itemsize), "u1")
    whole = kv.view(dtype)
    chunk = whole[:, :, :, start : start + tokens]
    dst = np.zeros(chunk.shape, dtype)
    module = frames.native_module()
    assert module is not None
    run = tokens * head_dim * np.dtype(dtype).itemsize
    streamed = module.stream_copy(dst, chunk)
    assert streamed is (
        run >= frames.STREAM_RUN or (total == tokens and dst.nbytes >= frames.STREAM_RUN)
    )
    if not streamed:
        assert not dst.any()
        stream_copy(dst, chunk)
    # as bytes: random bytes are NaNs as floats
    assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(chunk).view(np.uint8))


@needs_native
def test_axes_of_length_one_merge_into_the_run_whatever_their_stride() -> None:
    """A length-1 axis adds no element, so its stride (numpy keeps odd ones on arrays
    that are not C-contiguous) does not cut the contiguous run: 4 x 512 bytes across
    two such axes are one run of 2 KiB, streamed."""
    base = np.arange(3 * 9000 + 4096, dtype=np.uint64).view(np.uint8)
    src = np.lib.stride_tricks.as_strided(
        base[200:], (3, 1, 4, 1, 512), (9000, -77, 512, 3, 1), writeable=False
    )
    dst = np.zeros(src.shape, np.uint8)
    module = frames.native_module()
    assert module is not None
    assert module.stream_copy(dst, src) is True
    assert np.array_equal(dst, src)


@settings(max_examples=60, deadline=None)
@given(
    nbytes=st.sampled_from([1, 63, STREAM_BYTES - 1, STREAM_BYTES, 32 << 10])
    | st.integers(STREAM_BYTES, 5 * STREAM_BYTES + 77),
    dst_at=st.integers(0, 31),
    src_at=st.integers(0, 31),
    dtype=st.sampled_from(["u1", "<f2", "<f4"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_sealed_copy_is_copyto_s_bytes_and_their_xxh3_128(
    nbytes: int, dst_at: int, src_at: int, dtype: str, seed: int
) -> None:
    """``copy_sealed`` gives ``np.copyto``'s bytes and the seal a tier would take of
    them (``seal_of``: xxh3-128 of the bytes in C order) at every size around the
    streaming threshold and the 32 KiB hashing blocks, at every misalignment, hashed as
    it copies where the extension is built and after the copy where not."""
    n = max(1, nbytes // np.dtype(dtype).itemsize)
    src, dst, dst_mem, want = _misaligned(n, dtype, dst_at, src_at, seed)
    seal = copy_sealed(dst, src)
    assert np.array_equal(dst_mem, want), "the bytes copyto gives, nothing past the ends"
    assert seal == seal_of(np.ascontiguousarray(src)) == seal_of(dst)


@needs_native
def test_a_sealed_copy_of_a_strided_chunk_seals_its_c_order_bytes() -> None:
    """A chunk cut from one KV tensor (runs of one head's tokens, strided between): the
    extension hashes run by run, in C order, the same digest as the chunk made
    contiguous; and where it refuses (runs under 1 KiB) the fallback seals the same."""
    rng = np.random.default_rng(7)
    kv = rng.integers(0, 1 << 15, (4, 2, 4, 512, 64), dtype=np.uint16).view(np.float16)
    for chunk in (kv[:, :, :, 128:256], kv[:, :, :, 3:4], kv[::-1, :, ::-1, 256:384]):
        dst = np.empty(chunk.shape, chunk.dtype)
        seal = copy_sealed(dst, chunk)
        assert np.array_equal(dst.view(np.uint16), chunk.view(np.uint16))
        assert seal == seal_of(np.ascontiguousarray(chunk))
    assert sealing(), "the extension is built: puts are sealed by the client"


def test_without_the_extension_puts_are_not_sealed_by_the_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No extension: ``sealing()`` says so (a served put then tells the server what it
    wrote) and ``copy_sealed`` still gives the bytes and their seal."""
    monkeypatch.setattr(frames, "native_module", lambda: None)
    sealing.cache_clear()
    try:
        assert not sealing()
        src = np.arange(STREAM_BYTES, dtype=np.uint8)
        dst = np.zeros_like(src)
        assert copy_sealed(dst, src) == seal_of(src) and np.array_equal(dst, src)
    finally:
        sealing.cache_clear()
