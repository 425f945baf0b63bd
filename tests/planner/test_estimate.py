"""The planner's robust running estimate: it converges to a steady rate, one outlier in
a few moves it by little, and a lasting change of rate is followed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.planner.cost import PrefillProfile, PrefillSample, TierCost
from kvlife.planner.estimate import RobustEstimate

rates = st.floats(min_value=1e-10, max_value=1e-6)


@settings(max_examples=60, deadline=None)
@given(rates, st.lists(st.floats(min_value=0.9, max_value=1.1), min_size=30, max_size=60))
def test_it_converges_to_a_steady_rate(true: float, noise: list[float]) -> None:
    est = RobustEstimate()
    for f in noise:
        est.observe(true * f)
    assert est.value is not None
    assert abs(est.value / true - 1) <= 0.1 + 1e-9  # within the noise band


@settings(max_examples=60, deadline=None)
@given(
    rates,
    st.lists(st.booleans(), min_size=40, max_size=80),
    st.floats(min_value=10, max_value=1e4),
)
def test_sparse_outliers_move_it_by_a_bounded_share(
    true: float, spikes: list[bool], factor: float
) -> None:
    """Outliers (a sample ``factor`` times slower) at most one in four: the estimate
    stays within the guard's reach of the truth, never anywhere near the spike."""
    est = RobustEstimate(true)
    since = 3
    for spike in spikes:
        bad = spike and since >= 3
        est.observe(true * factor if bad else true)
        since = 0 if bad else since + 1
        assert est.value is not None
        # a clamped spike lifts it by at most alpha * (guard - 1) of the truth, and three
        # good samples take back 1 - (1 - alpha)^3 of the excess before the next spike
        a, g = est.alpha, est.guard
        assert est.value <= true * (1 + a * (g - 1) / (1 - (1 - a) ** 3)) * 1.0001


@settings(max_examples=40, deadline=None)
@given(rates, st.floats(min_value=0.01, max_value=100).filter(lambda f: abs(f - 1) > 0.2))
def test_a_lasting_change_is_followed(before: float, change: float) -> None:
    est = RobustEstimate()
    for _ in range(20):
        est.observe(before)
    for _ in range(40):
        est.observe(before * change)
    assert est.value is not None
    assert abs(est.value / (before * change) - 1) <= 0.05


def test_bad_settings_and_samples_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        RobustEstimate(alpha=0)
    with pytest.raises(InvalidArgument):
        RobustEstimate(guard=0.5)
    with pytest.raises(InvalidArgument):
        RobustEstimate().observe(-1.0)


def test_a_tier_calibrates_its_latency_and_time_per_byte() -> None:
    tier = TierCost("disk")
    tier.calibrate((1 << 20, 0.01 + 1e-3), (16 << 20, 0.01 + 16e-3))
    assert tier.latency_s == pytest.approx(0.01, rel=1e-6)
    assert tier.seconds(8 << 20) == pytest.approx(0.01 + 8e-3, rel=1e-6)
    assert TierCost("never-seen").seconds(1) == float("inf")


@settings(max_examples=30, deadline=None)
@given(
    st.floats(min_value=1e-4, max_value=1e-2),
    st.floats(min_value=1e-6, max_value=1e-3),
    st.floats(min_value=1e-10, max_value=1e-7),
    st.sampled_from([0.0, 1e-6, 1e-4]),
)
def test_a_prefill_profile_fits_its_own_model(c0: float, c1: float, c2: float, c3: float) -> None:
    """With the per-cached-token term (``c3 * start``), a short prefill after a long
    prefix (the rest after a load) is predicted too."""
    truth = PrefillProfile(c0, c1, c2, c3=c3)
    points = [(0, 64), (0, 256), (0, 1024), (512, 256), (2048, 256), (4096, 128), (2048, 16)]
    samples = [PrefillSample(s, n, truth.seconds(s, n)) for s, n in points]
    fit = PrefillProfile.fit(samples, cached_term=True)
    for s, n in [*points, (8000, 256), (0, 8192), (1024, 16), (8000, 16)]:
        assert fit.seconds(s, n) == pytest.approx(truth.seconds(s, n), rel=1e-3)


def test_the_model_learns_the_engines_speed_of_the_day() -> None:
    from kvlife.planner.cost import CostModel

    points = [(0, 64), (0, 256), (0, 1024), (256, 256), (1024, 256)]
    truth = PrefillProfile(0.01, 1e-3, 1e-7)
    samples = tuple(PrefillSample(s, n, truth.seconds(s, n)) for s, n in points)
    model = CostModel(PrefillProfile.fit(samples), 64)
    assert model.compute_seconds(0, 512) == pytest.approx(truth.seconds(0, 512), rel=1e-3)
    for _ in range(6):  # the cores are shared today: everything takes 2x
        for s, n in [*points, (512, 16), (0, 512)]:
            model.observe_prefill(s, n, 2 * truth.seconds(s, n))
    got = model.compute_seconds(512, 256) / truth.seconds(512, 256)
    assert got == pytest.approx(2.0, rel=1e-3)  # refitted to what the engine timed


@settings(max_examples=60, deadline=None)
@given(
    st.integers(3, 9),
    st.lists(st.sampled_from([1.0, 100.0, 1e4]), min_size=3, max_size=3),
    st.integers(0, 2**32 - 1),
)
def test_the_profile_fit_is_scipys_nnls(rows: int, scales: list[float], seed: int) -> None:
    """The numpy-only NNLS the profile is fitted with (the vLLM interpreter has no scipy)
    reaches scipy's residual on any small problem."""
    import numpy as np

    nnls = pytest.importorskip("scipy.optimize").nnls
    from kvlife.planner.cost import _nnls

    rng = np.random.default_rng(seed)
    a = rng.random((rows, 3)) * np.array(scales)
    b = rng.normal(size=rows) + rng.random() * 3
    ours = _nnls(a, b)
    assert (ours >= 0).all()
    theirs, _ = nnls(a, b)
    slack = 1e-9 * float(np.linalg.norm(b))
    assert np.linalg.norm(a @ ours - b) <= np.linalg.norm(a @ theirs - b) + slack
