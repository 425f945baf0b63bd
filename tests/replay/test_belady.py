"""Belady's offline optimum (the sweep's headroom reference): equal to an exhaustive
search on tiny sequences, and never below any registered online policy replayed through
the placement engine on the same requests and capacity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.policy.base import policy_names
from kvlife.replay.belady import belady_hits, brute_force_hits, next_use
from kvlife.replay.cache import CacheSim
from kvlife.replay.cli import sweep_main
from kvlife.trace.model import Trace, TraceBuilder


def trace_of(requests: list[list[int]]) -> Trace:
    tb = TraceBuilder("hand", 16)
    for i, req in enumerate(requests):
        tb.add(float(i), 16 * len(req), 1, req)
    return tb.build()


def test_next_use_by_hand() -> None:
    assert next_use([1, 2, 1, 3, 2, 1]).tolist() == [2, 4, 5, 6, 6, 6]
    assert next_use([]).tolist() == []


def test_belady_by_hand() -> None:
    # capacity 2: keep 1 and 2 for their reuse, bypass 3 (next used after both)
    assert belady_hits([1, 2, 3, 1, 2, 3], 2) == 2
    assert belady_hits([1, 2, 3, 1, 2, 3], 3) == 3
    assert belady_hits([1, 1, 1], 0) == 0
    assert belady_hits([1, 2, 1, 2], 1) == 1
    # LRU gets none of these reuses with 2 slots: Belady keeps the farthest-free pair
    assert belady_hits([1, 2, 3, 1, 2, 3, 1, 2, 3], 2) == 4


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=0, max_size=11),
    st.integers(0, 3),
)
def test_belady_equals_the_brute_force_optimum(seq: list[int], cap: int) -> None:
    assert belady_hits(seq, cap) == brute_force_hits(seq, cap)


requests_st = st.lists(
    st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), min_size=1, max_size=25
)


@settings(max_examples=40, deadline=None)
@given(requests_st, st.integers(1, 8))
def test_belady_bounds_every_online_policy(requests: list[list[int]], cap: int) -> None:
    trace = trace_of(requests)
    best = belady_hits(trace.blocks, cap)
    for name in policy_names():
        run = CacheSim(name, cap).run(trace)
        assert int(run.present.sum()) <= best, name


def test_sweep_prints_belady_and_the_infinite_cache(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    from pathlib import Path

    out, page = Path(str(tmp_path)) / "sweep.json", Path(str(tmp_path)) / "sweep.html"
    rc = sweep_main(
        [
            "--max-requests",
            "300",
            "--policies",
            "lru",
            "--shares",
            "0.05,0.3",
            "--json",
            str(out),
            "--no-peers",
            "--report",
            str(page),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "belady" in text and "infinite cache" in text
    assert "data:image/png;base64," in page.read_text()  # the plot draws the references
    sw = json.loads(out.read_text())
    bel = sw["references"]["belady"]
    assert [p["share"] for p in bel] == [0.05, 0.3]
    for b, p in zip(bel, sw["curves"]["lru"], strict=True):
        assert p["block_hit_ratio"] <= b["block_hit_ratio"] <= sw["ideal_hit_ratio"] + 1e-12
