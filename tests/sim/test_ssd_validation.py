"""The SSD model against Desnoyers' closed form for greedy GC under uniform random writes."""

from __future__ import annotations

import itertools
import math

import pytest

from kvlife.sim.validation import (
    VALIDATION_OPS,
    greedy_waf_closed_form,
    measure_uniform_waf,
)


def test_closed_form_cross_check_point() -> None:
    # Published cross-check: OP 0.3 gives WAF about 2.36.
    assert greedy_waf_closed_form(0.3) == pytest.approx(2.36, abs=0.01)


def test_closed_form_falls_with_over_provisioning() -> None:
    wafs = [greedy_waf_closed_form(op) for op in (0.05, 0.07, 0.2, 0.5, 1.0, 3.0)]
    assert all(a > b for a, b in itertools.pairwise(wafs))
    assert all(w > 1.0 for w in wafs)
    # Large over-provisioning approaches WAF 1.
    assert greedy_waf_closed_form(20.0) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("op", [*VALIDATION_OPS, 0.3])
def test_small_device_matches_closed_form_within_5pct(op: float) -> None:
    # 1024 blocks of 256 pages: large blocks as the closed form assumes, few enough pages
    # (about 250k) to run in about a second. Fill, 3 capacities of warm-up, 3 measured.
    row = measure_uniform_waf(
        op, n_blocks=1024, pages_per_block=256, warmup_capacities=3, measure_capacities=3
    )
    assert math.isfinite(row.simulated_waf)
    assert abs(row.error_pct) <= 5.0, row
    assert row.host_page_writes == int(3 * row.logical_pages)


def test_small_blocks_deviate_from_the_large_block_limit() -> None:
    # The closed form is a large-block limit: with 8-page blocks greedy GC does visibly
    # better than it predicts. (Shows the validation can fail, i.e. it measures something.)
    row = measure_uniform_waf(
        0.07, n_blocks=4096, pages_per_block=8, warmup_capacities=3, measure_capacities=2
    )
    assert row.error_pct < -5.0


@pytest.mark.slow
@pytest.mark.parametrize("op", [*VALIDATION_OPS, 0.3])
def test_large_device_matches_closed_form_within_3pct(op: float) -> None:
    row = measure_uniform_waf(
        op, n_blocks=4096, pages_per_block=256, warmup_capacities=4, measure_capacities=4
    )
    assert abs(row.error_pct) <= 3.0, row
