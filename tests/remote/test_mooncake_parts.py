"""The Mooncake tier's pure parts, without a master: how a read batch is split into
fetch groups and destinations, and the queue of removals waiting out a read lease."""

from __future__ import annotations

import itertools
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.tiers.mooncake.tier import GROUP_BYTES, GROUP_MIN, _destinations, _Doomed, _schedule


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1 << 24), max_size=300))
def test_fetch_groups_cover_the_batch_in_order_each_about_a_group_of_bytes(
    sizes: list[int],
) -> None:
    groups = _schedule(sizes)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert all(groups) or not sizes  # only an empty batch has an empty group
    total = sum(sizes)
    if len(sizes) < 2 or total < 2 * GROUP_MIN:
        assert len(groups) == 1
        return
    target = max(GROUP_MIN, min(GROUP_BYTES, total // 2))
    for g, after in itertools.pairwise(groups):
        held = sum(sizes[i] for i in g)
        if len(g) > 1:  # a group over its target is one payload that alone is over it
            assert held <= target
        assert held + sizes[after[0]] > target  # a group ends only where the next would not fit
    assert len(groups) >= 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.sampled_from(["none", "fits", "strided", "small"])),
        max_size=12,
    )
)
def test_destinations_use_a_fitting_out_in_place_and_give_every_payload_its_own_bytes(
    spec: list[tuple[int, str]],
) -> None:
    sizes = [4 * n for n, _ in spec]  # float32 payloads of n elements
    outs: list[np.ndarray | None] = []
    for n, kind in spec:
        if kind == "fits":
            outs.append(np.empty(n, np.float32))
        elif kind == "strided":
            outs.append(np.empty(2 * n, np.float32)[::2])
        elif kind == "small":
            outs.append(np.empty(max(0, n - 1), np.float32))
        else:
            outs.append(None)
    dests, regions = _destinations(sizes, outs)
    assert [d.nbytes for d in dests] == sizes
    for d, out, (_, kind) in zip(dests, outs, spec, strict=True):
        assert d.dtype == np.uint8 and d.flags.c_contiguous
        if kind == "fits":
            assert out is not None and d.ctypes.data == out.ctypes.data
    spans = sorted((d.ctypes.data, d.ctypes.data + d.nbytes) for d in dests)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
    for d in dests:  # every destination lies in a region that would be registered
        assert any(
            r.ctypes.data <= d.ctypes.data and d.ctypes.data + d.nbytes <= r.ctypes.data + r.nbytes
            for r in regions
        )


def test_doomed_removals_wait_for_the_lease_then_retry_a_few_times_then_are_abandoned() -> None:
    doomed = _Doomed(lease_s=0.05)
    doomed.add(["a", "b"])
    assert doomed.due() == {} and doomed.pending() == 2  # not before the lease lapsed
    time.sleep(0.06)
    due = doomed.due()
    assert due == {"a": 1, "b": 1} and doomed.pending() == 0
    doomed.retry(due, failed=["b"])  # a removed, b refused again
    c = doomed.counters()
    assert c["removals_reaped"] == 1 and c["removals_pending"] == 1
    for _ in range(_Doomed.MAX_TRIES):
        due = doomed.due(everything=True)
        if not due:
            break
        doomed.retry(due, failed=list(due))
    c = doomed.counters()
    assert c["removals_pending"] == 0 and c["removals_abandoned"] == 1
    assert c["removals_deferred"] == 2  # first deferrals only, not retries
