"""The tier registry: kinds by name, each with its typed options and its footprint.

A TierSpec's options, typed or as (name, value) pairs, map onto the kind's options class;
an unknown name, a value of the wrong type, a missing or out-of-range one is refused with
a TierOptionError naming the kind, the tier and the option. A kind's footprint is known
before a tier of it exists (what a budget sized in replicas needs)."""

from __future__ import annotations

import pickle
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.tiers.base import Tier
from kvlife.tiers.kinds import DiskOptions, MemoryOptions, MooncakeOptions, RedisOptions, ShmOptions
from kvlife.tiers.options import TierOptionError, TierOptions
from kvlife.tiers.registry import (
    TierContext,
    TierKind,
    build_tier,
    footprint,
    register_tier_kind,
)
from kvlife.tiers.spec import TierSpec

CAP = 1 << 20


def _spec(kind: str, tmp: Path) -> TierSpec:
    if kind == "shm":
        return TierSpec(
            "shm", "dram", CAP, options=(("arena_path", str(tmp / "arena")), ("staging_bytes", 0))
        )
    return TierSpec(kind, kind, CAP)


@pytest.mark.parametrize("kind", ["memory", "disk", "shm"])
def test_a_kinds_footprint_is_what_its_tiers_answer(kind: str, tmp_path: Path) -> None:
    tier = build_tier(_spec(kind, tmp_path), TierContext(tmp_path))
    try:

        @settings(max_examples=50, deadline=None)
        @given(st.integers(min_value=0, max_value=1 << 26))
        def same(nbytes: int) -> None:
            assert footprint(kind, nbytes) == tier.footprint(nbytes)
            assert footprint(kind, nbytes) >= nbytes

        same()
    finally:
        tier.close()


def test_an_unknown_kind_is_named() -> None:
    with pytest.raises(InvalidArgument, match="'tape'"):
        footprint("tape", 1)


# ---------------------------------------------------------------------------- options

KINDS: dict[str, type[TierOptions]] = {
    "memory": MemoryOptions,
    "shm": ShmOptions,
    "disk": DiskOptions,
    "redis": RedisOptions,
    "mooncake": MooncakeOptions,
}

_INDEX = {
    "index_namespace": st.text("abcxyz019-_", min_size=1, max_size=12),
    "buckets": st.integers(1, 4096),
    "host": st.text("abc-1", max_size=8),
    "lease_ttl_ms": st.integers(10, 10**7),
    "socket_timeout_s": st.floats(0.001, 60) | st.integers(1, 60),
}
REQUIRED: dict[str, dict[str, st.SearchStrategy[object]]] = {
    "memory": {},
    "shm": {},
    "disk": {},
    "redis": {},
    "mooncake": {
        "master": st.just("127.0.0.1:50051"),
        "metadata": st.just("http://127.0.0.1:8080/metadata"),
        "index": st.sampled_from(["redis://127.0.0.1:6379/0", "cluster://127.0.0.1:7000"]),
    },
}
OPTIONAL: dict[str, dict[str, st.SearchStrategy[object]]] = {
    "memory": {},
    "shm": {
        "arena_path": st.none() | st.text("/abc", min_size=1, max_size=10),
        "staging_bytes": st.integers(0, 1 << 40),
    },
    "disk": {
        "segment_bytes": st.integers(1, 1 << 16).map(lambda n: n * 4096),
        "direct_io": st.none() | st.booleans(),
        "verify_on_open": st.sampled_from(["none", "header", "full"]),
        "io_depth": st.integers(1, 64),
        "read_pool_bytes": st.integers(0, 1 << 40),
    },
    "redis": _INDEX,
    "mooncake": {
        **_INDEX,
        "local_hostname": st.just("10.0.0.1"),
        "segment_bytes": st.integers(0, 1 << 40),
        "buffer_bytes": st.integers(1, 1 << 40),
        "read_lease_s": st.floats(0.01, 100) | st.integers(1, 100),
        "register_buffers": st.none() | st.booleans(),
        "read_group_bytes": st.integers(0, 1 << 40),
    },
}


@st.composite
def valid_options(draw: st.DrawFn, kind: str) -> dict[str, object]:
    given = draw(st.fixed_dictionaries(REQUIRED[kind], optional=OPTIONAL[kind]))
    if kind == "redis":  # exactly one of url and cluster
        where = draw(st.sampled_from(["url", "cluster"]))
        seeds = st.sampled_from(["127.0.0.1:7000,127.0.0.1:7001", "cluster://h:1"])
        urls = st.sampled_from(["redis://127.0.0.1:6379/0", "unix:///tmp/r.sock"])
        given[where] = draw(urls if where == "url" else seeds)
    return given


kinds = st.sampled_from(sorted(KINDS))


@settings(max_examples=150, deadline=None)
@given(st.data(), kinds)
def test_pairs_map_onto_the_kinds_typed_options(data: st.DataObject, kind: str) -> None:
    given = data.draw(valid_options(kind))
    pairs = data.draw(st.permutations(list(given.items())))
    typed = KINDS[kind](**given)
    from_pairs = TierSpec(kind, "t1", CAP, options=tuple(pairs))
    assert from_pairs.config == typed
    assert from_pairs == TierSpec(kind, "t1", CAP, options=typed)
    hints = typing.get_type_hints(KINDS[kind])
    for name, value in given.items():
        assert getattr(from_pairs.config, name) == value
        if hints[name] is float:  # an int given for a float option is kept as a float
            assert type(getattr(from_pairs.config, name)) is float


names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=16)


@settings(max_examples=100, deadline=None)
@given(st.data(), kinds, names, names)
def test_an_unknown_option_is_refused_by_name(
    data: st.DataObject, kind: str, unknown: str, tier: str
) -> None:
    assume(unknown not in {f.name for f in fields(KINDS[kind])})
    pairs = [*data.draw(valid_options(kind)).items(), (unknown, 1)]
    with pytest.raises(TierOptionError) as err:
        TierSpec(kind, tier, CAP, options=tuple(pairs))
    assert (err.value.kind, err.value.tier, err.value.field) == (kind, tier, unknown)
    assert repr(tier) in str(err.value) and unknown in str(err.value)
    assert isinstance(err.value, InvalidArgument)


_WRONG: dict[object, list[object]] = {
    int: ["7", 1.5, True, None, b"x", [1]],
    float: ["7", True, None, b"x", [1.0]],
    bool: [1, 0, "yes", None],
    str: [1, b"x", None, True],
    "literal": ["HEADER", "fast", 1, None],
}


def _wrong_values(hint: object) -> list[object]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return _WRONG["literal"]
    if args:  # X | None: a value of neither
        return [v for v in _WRONG[args[0]] if v is not None]
    return _WRONG[hint]


typed_fields = [(kind, f.name) for kind, cls in sorted(KINDS.items()) for f in fields(cls)]


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(typed_fields), names)
def test_a_value_of_the_wrong_type_is_refused_by_name(
    data: st.DataObject, kind_field: tuple[str, str], tier: str
) -> None:
    kind, name = kind_field
    hint = typing.get_type_hints(KINDS[kind])[name]
    bad = data.draw(st.sampled_from(_wrong_values(hint)))
    given = data.draw(valid_options(kind)) | {name: bad}
    if kind == "redis" and name in ("url", "cluster"):
        given.pop("cluster" if name == "url" else "url", None)
    with pytest.raises(TierOptionError) as err:
        TierSpec(kind, tier, CAP, options=tuple(given.items()))
    assert (err.value.kind, err.value.tier, err.value.field) == (kind, tier, name)
    with pytest.raises(TierOptionError) as typed_err:
        KINDS[kind](**given)
    assert (typed_err.value.kind, typed_err.value.field) == (kind, name)


@pytest.mark.parametrize(
    ("kind", "pairs", "field"),
    [
        ("disk", (("segment_bytes", 1000),), "segment_bytes"),
        ("disk", (("io_depth", 0),), "io_depth"),
        ("disk", (("read_pool_bytes", -1),), "read_pool_bytes"),
        ("shm", (("staging_bytes", -1),), "staging_bytes"),
        ("shm", (("arena_path", ""),), "arena_path"),
        ("redis", (), "url"),
        ("redis", (("url", "redis://h:1/0"), ("cluster", "h:1")), "url"),
        ("redis", (("url", "http://h:1"),), "url"),
        ("redis", (("url", "redis://h:1/0"), ("buckets", 0)), "buckets"),
        ("redis", (("url", "redis://h:1/0"), ("index_namespace", "a:b")), "index_namespace"),
        ("redis", (("url", "redis://h:1/0"), ("lease_ttl_ms", 5)), "lease_ttl_ms"),
        ("redis", (("url", "redis://h:1/0"), ("socket_timeout_s", 0)), "socket_timeout_s"),
        ("mooncake", (("metadata", "http://m"), ("index", "redis://r")), "master"),
        (
            "mooncake",
            (("master", "m:1"), ("metadata", "ftp://m"), ("index", "redis://r")),
            "metadata",
        ),
        ("mooncake", (("master", "m:1"), ("metadata", "http://m"), ("index", "r:1")), "index"),
        (
            "mooncake",
            (
                ("master", "m:1"),
                ("metadata", "http://m"),
                ("index", "redis://r"),
                ("read_group_bytes", -1),
            ),
            "read_group_bytes",
        ),
        ("memory", (("segment_bytes", 4096),), "segment_bytes"),
        ("disk", (("segment_bytes", 4096), ("segment_bytes", 8192)), "segment_bytes"),
    ],
)
def test_an_option_out_of_range_missing_or_repeated_is_refused_by_name(
    kind: str, pairs: tuple[tuple[str, object], ...], field: str
) -> None:
    with pytest.raises(TierOptionError) as err:
        TierSpec(kind, "t9", CAP, options=pairs)
    assert (err.value.kind, err.value.tier, err.value.field) == (kind, "t9", field)


def test_options_of_another_kind_or_not_pairs_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"disk tier 'd'.*DiskOptions.*MemoryOptions"):
        TierSpec("disk", "d", CAP, options=MemoryOptions())
    with pytest.raises(InvalidArgument, match=r"disk tier 'd'.*pairs"):
        TierSpec("disk", "d", CAP, options={"segment_bytes": 4096})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="unknown tier kind 'tape'"):
        TierSpec("tape", "t", CAP)


def test_a_shm_tier_without_its_arena_is_refused_at_build(tmp_path: Path) -> None:
    spec = TierSpec("shm", "dram", CAP)
    with pytest.raises(TierOptionError) as err:
        build_tier(spec, TierContext(tmp_path))
    assert (err.value.tier, err.value.field) == ("dram", "arena_path")


def test_the_error_survives_pickling() -> None:
    err = TierOptionError("disk", "io_depth", "must be >= 1, got 0", "disk")
    back = pickle.loads(pickle.dumps(err))
    assert (back.kind, back.field, back.tier, str(back)) == ("disk", "io_depth", "disk", str(err))


def test_a_registered_kind_is_built_from_its_own_options(tmp_path: Path) -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class TapeOptions(TierOptions):
        kind: ClassVar[str] = "tape-test"
        reels: int = 1

        def check(self) -> None:
            if self.reels < 1:
                raise self.bad("reels", "must be >= 1")

    seen: list[TapeOptions] = []

    def build(spec: TierSpec, o: TapeOptions, ctx: TierContext) -> Tier:
        seen.append(o)
        from kvlife.tiers.memory import MemoryTier

        return MemoryTier(spec.capacity_bytes, spec.name)

    register_tier_kind(TierKind("tape-test", TapeOptions, build))
    with pytest.raises(InvalidArgument, match="already registered"):
        register_tier_kind(TierKind("tape-test", TapeOptions, build))
    build_tier(TierSpec("tape-test", "t", CAP, options=(("reels", 3),)), TierContext(tmp_path))
    assert seen == [TapeOptions(reels=3)]
    with pytest.raises(TierOptionError, match=r"'t'.*reels"):
        TierSpec("tape-test", "t", CAP, options=(("reels", 0),))
