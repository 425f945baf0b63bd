"""Planned prefills on the transformers engine: every plan (compute-only, load-only,
split at each point, a shorter load) gives the logits and tokens of a full prefill; a
load that runs past its deadline falls back to recompute for the rest, counted, and the
output is still exact; the engine's prefill profile is measured and cached."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlife.core.identity import PUBLIC  # noqa: E402
from kvlife.engines.hf import HFEngine  # noqa: E402
from kvlife.engines.hf_plan import (  # noqa: E402
    PlannedEngine,
    measure_prefill,
    prefill_profile,
)
from kvlife.engines.models import LoadedModel, tiny_llama  # noqa: E402
from kvlife.faults.throttle import MB, ThrottledTier  # noqa: E402
from kvlife.planner import choose  # noqa: E402
from tests.engines.plans import fixed, seeded_model, throttled_store  # noqa: E402

TPC = 32


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama(seed=5)


def test_every_plan_gives_the_output_of_a_full_prefill(tiny: LoadedModel, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, 8 * TPC + 11).tolist()
    base = HFEngine.for_model(tiny, None, tokens_per_chunk=TPC)
    full = base.prefill(ids, PUBLIC)
    want, _, _ = base.decode(full, len(ids), 24, stop_at_eos=False)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC)
        eng.generate(ids[: 8 * TPC + 3], PUBLIC, max_new_tokens=1)  # stores 8 chunks
        # exactness, not timing: no deadline (a busy machine must not turn loads into
        # fallbacks here; the deadline has its own test)
        planned = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"))
        for front, stop in [(0, 0), (0, 8), (0, 5), (1, 8), (4, 8), (7, 8), (2, 6), (3, 3)]:
            out, done = planned.generate(ids, PUBLIC, max_new_tokens=24, policy=fixed(front, stop))
            plan = done.plan
            assert (plan.front, plan.stop) == ((front, stop) if front != stop else (0, 0))
            assert done.loaded == plan.stop - plan.front and done.fallback == 0
            pre = done.prefill
            assert pre.cached_tokens == plan.stop * TPC
            diff = float((pre.logits - full.logits[pre.cached_tokens :]).abs().max())
            assert diff <= 1e-4, f"plan {front, stop}: suffix logits differ by {diff}"
            assert out == want, f"plan {front, stop}"
        # the planner's own choice, with what it learnt from those loads
        out, done = planned.generate(ids, PUBLIC, max_new_tokens=24, policy=choose)
        assert out == want
        assert planned.counters.chunks_loaded > 0 and planned.counters.fallback_chunks == 0
        assert planned.model.tier("disk").per_byte.samples >= 6


def test_a_load_past_its_deadline_falls_back_to_recompute(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 512, 8 * TPC + 5).tolist()
    base = HFEngine.for_model(tiny, None, tokens_per_chunk=TPC)
    want = base.generate(ids, PUBLIC, max_new_tokens=16, stop_at_eos=False).output_ids
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC)
        eng.generate(ids, PUBLIC, max_new_tokens=1)
        tier = store.tier("disk")
        assert isinstance(tier, ThrottledTier)
        # a chunk of the tiny model is 24 KiB: at 0.2 MB/s each takes ~0.12 s, while the
        # model (seeded for a fast disk) plans for microseconds
        tier.set_limits(0.2 * MB)
        planned = PlannedEngine(eng, seeded_model(TPC, 1e-10), deadline_slack_s=0.2)
        out, done = planned.generate(ids, PUBLIC, max_new_tokens=16, policy=fixed(0, 8))
        assert done.fallback > 0 and done.loaded + done.fallback == 8
        assert planned.counters.timeouts == 1 and planned.counters.fallback_chunks == done.fallback
        assert done.prefill.cached_tokens == done.loaded * TPC
        assert out == want
        # the abandoned load still owns its buffer (the next prefill lands elsewhere) and
        # the tier's I/O threads until it ends
        deadline = time.monotonic() + 10
        while tier.counters.reads < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        tier.set_limits(0.0)
        out2, again = planned.generate(ids, PUBLIC, max_new_tokens=16, policy=fixed(0, 8))
        assert again.loaded == 8 and out2 == want


def test_the_prefill_profile_is_measured_and_cached(tiny: LoadedModel, tmp_path: Path) -> None:
    eng = HFEngine.for_model(tiny, None, tokens_per_chunk=TPC)
    prof = measure_prefill(eng, [(0, 32), (0, 128), (0, 256), (256, 64)], repeats=1)
    assert prof.seconds(0, 256) > 0 and prof.seconds(1024, 64) >= prof.seconds(0, 64)
    path = tmp_path / "profile.json"
    first = prefill_profile(eng, cache=path)
    assert path.exists()
    assert prefill_profile(eng, cache=path) == first  # read back, not measured again
