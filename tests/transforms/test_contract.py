"""One round-trip contract suite run against every registered transform (and variants)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlife.core.errors import InvalidArgument, KVLifeError, LayoutMismatch
from kvlife.transforms import (
    EncodedPayload,
    Exactness,
    TransformDescriptor,
    TransformError,
    UnknownTransform,
    decode,
    decode_frame,
    make_transform,
    register_transform,
    transform_names,
)
from kvlife.transforms.base import Param
from kvlife.transforms.quant_kernels import F16_TO_F32

VARIANTS: list[tuple[str, dict[str, Param]]] = [(name, {}) for name in transform_names()] + [
    ("lossless", {"codec": "lz4"}),
    ("lossless", {"shuffle": False}),
    ("int8", {"key_group": 4, "value_group": 3}),
    ("int4", {"sink_tokens": 2, "window_tokens": 3}),
    ("int2", {"key_group": 5, "value_group": 0}),
    ("int2", {"key_hi_fraction": 0.25, "sink_tokens": 1, "window_tokens": 2}),
    ("int4", {"value_bits": 2, "key_group": 7}),
    ("int2", {"key_axis": "token", "key_group": 5, "sink_tokens": 1}),
    ("int8", {"key_axis": "token"}),
    ("int4", {"value_sym": True, "value_group": 5, "sink_tokens": 1}),
    ("int2", {"value_sym": True, "key_hi_fraction": 0.25, "key_hi_bits": 8}),
    ("sparse", {"keep_ratio": 0.25, "sink_tokens": 1, "window_tokens": 2}),
    ("sparse", {"keep_ratio": 1.0, "sink_tokens": 0, "window_tokens": 0}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for n, p in VARIANTS]

chunk_shapes = st.tuples(
    st.integers(1, 2), st.just(2), st.integers(1, 3), st.integers(0, 40), st.integers(1, 17)
)
dtypes: st.SearchStrategy[np.dtype[Any]] = st.sampled_from(
    [np.dtype(np.float16), np.dtype(np.float32)]
)


@st.composite
def chunks(draw: st.DrawFn) -> np.ndarray:
    shape = draw(chunk_shapes)
    dtype = draw(dtypes)
    base = draw(
        arrays(dtype, shape, elements=st.floats(-100, 100, width=16 if dtype.itemsize == 2 else 32))
    )
    return base


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def test_registry_lists_the_builtins() -> None:
    assert {"exact", "lossless", "int8", "int4", "int2"} <= set(transform_names())


def test_duplicate_name_is_refused() -> None:
    cls = type(make_transform("exact"))
    with pytest.raises(InvalidArgument):
        register_transform(cls)


def test_unknown_name_is_unknown_transform() -> None:
    with pytest.raises(UnknownTransform):
        make_transform("no-such-transform")


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=chunks())
def test_round_trip(name: str, params: dict[str, Param], x: np.ndarray) -> None:
    t = make_transform(name, params)
    enc = t.encode(x)
    out = np.full_like(x, np.nan)
    used = decode_frame(enc.to_frame(), out)
    assert used.name == name
    assert len(enc.payload) <= t.payload_nbytes(x.shape, x.dtype)
    if t.exactness in (Exactness.EXACT, Exactness.LOSSLESS):
        assert t.error_bound is None
        assert _bits_equal(out, x)
    else:
        bound = t.element_bounds(x)
        assert bound is not None and t.error_bound is not None
        err = np.abs(out.astype(np.float64) - x.astype(np.float64))
        assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
def test_descriptor_round_trip_and_bits(name: str, params: dict[str, Param]) -> None:
    t = make_transform(name, params)
    x = _kv((2, 2, 2, 64, 16), np.float16)
    enc = t.encode(x)
    d = enc.descriptor
    assert TransformDescriptor.from_bytes(d.to_bytes()) == d
    assert d.name == name and d.shape == x.shape and d.dtype == "float16"
    assert type(make_transform(name, d.param_map)) is type(t)
    # a priori bits/element: exact for fixed-rate transforms, an upper bound for compressors
    assert enc.bits_per_element <= t.bits_per_element(x.shape, x.dtype) + 1e-9
    if t.exactness is not Exactness.LOSSLESS:
        assert enc.bits_per_element == pytest.approx(t.bits_per_element(x.shape, x.dtype), abs=0.01)


def _kv(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    rng = np.random.default_rng(7)
    # KV-like: smooth along tokens, with a few outlier key channels
    x = np.cumsum(rng.standard_normal(shape), axis=3) * 0.1
    x[:, 0, :, :, ::5] *= 8
    return x.astype(dtype)


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
def test_unknown_version_and_name_are_unknown_transform(
    name: str, params: dict[str, Param]
) -> None:
    t = make_transform(name, params)
    x = _kv((1, 2, 2, 8, 4), np.float16)
    enc = t.encode(x)
    out = np.empty_like(x)
    d = enc.descriptor
    for bad in (
        TransformDescriptor(
            d.name, d.version + 1, d.dtype, d.shape, d.params, d.payload_nbytes, d.payload_xxh3
        ),
        TransformDescriptor(
            "future-" + d.name,
            d.version,
            d.dtype,
            d.shape,
            d.params,
            d.payload_nbytes,
            d.payload_xxh3,
        ),
    ):
        with pytest.raises(UnknownTransform):
            decode_frame(EncodedPayload(bad, enc.payload).to_frame(), out)


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_damaged_frame_is_typed_error(
    name: str, params: dict[str, Param], data: st.DataObject
) -> None:
    t = make_transform(name, params)
    x = _kv((1, 2, 2, 12, 8), np.float32)
    frame = bytearray(t.encode(x).to_frame())
    if data.draw(st.booleans(), label="truncate"):
        cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
        damaged = bytes(frame[:cut])
    else:
        i = data.draw(st.integers(0, len(frame) - 1), label="index")
        frame[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        damaged = bytes(frame)
    out = np.zeros_like(x)
    # a flipped bit is caught by the frame header, the descriptor checks or the payload's
    # xxh3; any error must be a typed kvlife error (the store turns it into a miss)
    try:
        decode_frame(damaged, out)
    except (TransformError, LayoutMismatch):
        return
    except KVLifeError as exc:  # pragma: no cover - reported with its type
        pytest.fail(f"untyped damage error {type(exc).__name__}: {exc}")
    pytest.fail("a damaged frame decoded without an error")


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=IDS)
def test_wrong_buffer_is_typed_error(name: str, params: dict[str, Param]) -> None:
    t = make_transform(name, params)
    x = _kv((1, 2, 2, 8, 4), np.float16)
    enc = t.encode(x)
    for out in (np.empty((1, 2, 2, 8, 5), np.float16), np.empty(x.shape, np.float32)):
        with pytest.raises(LayoutMismatch):
            decode(enc, out)
    with pytest.raises(InvalidArgument):
        decode(enc, np.empty((1, 2, 2, 8, 8), np.float16)[..., ::2])


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_quantisers_refuse_non_chunks(name: str) -> None:
    t = make_transform(name)
    with pytest.raises(LayoutMismatch):
        t.encode(np.zeros((2, 3, 4), np.float16))
    with pytest.raises(LayoutMismatch):
        t.encode(np.zeros((1, 2, 1, 4, 4), np.int32))
    bad = np.zeros((1, 2, 1, 4, 4), np.float32)
    bad[0, 0, 0, 0, 0] = np.inf
    with pytest.raises(LayoutMismatch):
        t.encode(bad)


def test_bad_params_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        make_transform("int4", {"key_group": -1})
    with pytest.raises(InvalidArgument):
        make_transform("lossless", {"codec": "brotli"})
    with pytest.raises(InvalidArgument):
        make_transform("int8", {"nonsense": 1})


def test_sinks_and_window_are_exact() -> None:
    x = _kv((2, 2, 2, 40, 8), np.float16)
    t = make_transform("int2", {"sink_tokens": 4, "window_tokens": 8})
    out = np.empty_like(x)
    decode(t.encode(x), out)
    assert _bits_equal(out[:, :, :, :4], x[:, :, :, :4])
    assert _bits_equal(out[:, :, :, -8:], x[:, :, :, -8:])


def test_kitty_keeps_the_widest_key_channels_sharper() -> None:
    x = _kv((1, 2, 1, 64, 20), np.float32)
    plain, kitty = make_transform("int2"), make_transform("int2", {"key_hi_fraction": 0.25})
    e_plain, e_kitty = np.empty_like(x), np.empty_like(x)
    decode(plain.encode(x), e_plain)
    decode(kitty.encode(x), e_kitty)

    def err(y: np.ndarray) -> float:
        return float(np.abs(y[:, 0] - x[:, 0]).mean())

    assert err(e_kitty) < err(e_plain)
    assert kitty.bits_per_element(x.shape, x.dtype) > plain.bits_per_element(x.shape, x.dtype)


def test_f16_bit_conversion_matches_numpy() -> None:
    from kvlife.transforms.quant_kernels import f32_to_f16_bits

    rng = np.random.default_rng(1)
    finite = F16_TO_F32[np.isfinite(F16_TO_F32)]
    finite = np.sort(finite)
    vals = np.concatenate(
        [
            (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000)).astype(np.float32),
            finite,  # every float16 value, and midpoints between neighbours
            ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32),
            np.array([7e4, -7e4, 65519.0, 65520.0, 1e-8, 2.0**-25, 3 * 2.0**-26], np.float32),
        ]
    )
    vals = vals[np.isfinite(vals)].astype(np.float32)
    scratch = np.empty(1, np.float32)
    bits = scratch.view(np.uint32)
    conv = cast(Any, f32_to_f16_bits)
    got = np.array([conv(float(v), scratch, bits) for v in vals], np.uint16)
    with np.errstate(over="ignore"):
        want = vals.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name", ["exact", "lossless"])
def test_bfloat16_as_uint16_view_is_bit_exact(name: str) -> None:
    # numpy has no bfloat16: engines hand such KV over as its uint16 bits
    bf16 = (_kv((2, 2, 2, 64, 16), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    out = np.empty_like(bf16)
    decode(make_transform(name).encode(bf16), out)
    assert np.array_equal(out, bf16)


def test_measured_kl_only_for_measured_parameters() -> None:
    from kvlife.transforms.quant import INT4_TUNED, MEASURED_KL, QuantTransform

    for entry in MEASURED_KL:
        t = make_transform(entry.name, entry.params)
        assert isinstance(t, QuantTransform)
        version = 2 if entry.sinks_per_chunk else 3
        assert t.measured_kl_at(None, version) == max(entry.kl.values())
        if not entry.sinks_per_chunk:
            assert t.measured_kl == max(entry.kl.values())
    other = make_transform("int4", {"key_group": 17})
    assert isinstance(other, QuantTransform) and other.measured_kl is None
    # the tuned near-lossless setting: KL <= 0.005 at <= 4.5 bits (512-token chunks)
    tuned = make_transform("int4", INT4_TUNED)
    assert isinstance(tuned, QuantTransform)
    assert tuned.bits_per_element((30, 2, 3, 512, 64), "float16") <= 4.5
    assert tuned.measured_kl is not None and tuned.measured_kl <= 0.005
