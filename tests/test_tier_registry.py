"""The tier registry: kinds by name, built from a TierSpec, and each kind's footprint
known before a tier of it exists (what a budget sized in replicas needs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.tiers.registry import TierContext, build_tier, footprint
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
