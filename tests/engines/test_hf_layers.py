"""Layer-by-layer injection on the transformers engine: chunks stored as G layer-group
objects, each with its own identity and checksum; a planned load issues group 0 first
and the forward of the rest starts when it landed. Outputs equal a full prefill for
G in {1, 2, 4}, load-only and split; a chunk is usable only when every group is; a
group that is missing, corrupt on the disk or late after the forward started makes
the engine abandon that forward and recompute (counted), never mix."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlife.core.errors import InvalidArgument  # noqa: E402
from kvlife.core.identity import PUBLIC  # noqa: E402
from kvlife.core.identity import prompt_chunk_keys as chunk_keys  # noqa: E402
from kvlife.engines.hf import HFEngine  # noqa: E402
from kvlife.engines.hf_layers import group_identities, layer_groups  # noqa: E402
from kvlife.engines.hf_plan import PlannedEngine  # noqa: E402
from kvlife.engines.models import LoadedModel, tiny_llama  # noqa: E402
from kvlife.faults.damage import flip, scan_frames  # noqa: E402
from kvlife.faults.throttle import ThrottledTier  # noqa: E402
from tests.engines.plans import fixed, seeded_model, throttled_store  # noqa: E402

TPC = 32
LAYERS = 4


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama(seed=7, layers=LAYERS)


def _want(tiny: LoadedModel, ids: list[int], new: int) -> tuple[list[int], Any]:
    base = HFEngine.for_model(tiny, None, tokens_per_chunk=TPC)
    full = base.prefill(ids, PUBLIC)
    out, _, _ = base.decode(full, len(ids), new, stop_at_eos=False)
    return out, full.logits


def _exact(done_logits: Any, full: Any, cached: int) -> float:
    return float((done_logits - full[cached:]).abs().max())


def test_layer_groups_have_their_own_identities(tiny: LoadedModel) -> None:
    eng = HFEngine.for_model(tiny, None, tokens_per_chunk=TPC)
    ident = eng.identity
    assert layer_groups(4, 1) == ((0, 4),)
    assert layer_groups(4, 4) == ((0, 1), (1, 1), (2, 1), (3, 1))
    assert layer_groups(5, 2) == ((0, 3), (3, 2))
    assert group_identities(ident, 1) == (ident,)  # one group: the whole-chunk keys
    ids = list(range(2 * TPC))
    seen = {tuple(chunk_keys(ident, PUBLIC, ids))}
    for groups in (2, 4):
        parts = group_identities(ident, groups)
        for g, (part, (first, n)) in enumerate(zip(parts, layer_groups(4, groups), strict=True)):
            lay = part.layout
            assert (lay.num_layers, lay.first_layer, lay.pp_rank, lay.pp_size) == (
                n,
                first,
                g,
                groups,
            )
            keys = tuple(chunk_keys(part, PUBLIC, ids))
            assert keys not in seen, "a layer group shares a key with another object"
            seen.add(keys)
    for bad in (0, 5, True):
        with pytest.raises(InvalidArgument, match="layer groups"):
            HFEngine.for_model(tiny, None, tokens_per_chunk=TPC, layer_groups=bad)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_layered_plans_give_the_output_of_a_full_prefill(
    tiny: LoadedModel, tmp_path: Path, groups: int
) -> None:
    rng = np.random.default_rng(groups)
    ids = rng.integers(0, 512, 8 * TPC + 11).tolist()
    want, full = _want(tiny, ids, 16)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=groups)
        eng.generate(ids[: 8 * TPC + 3], PUBLIC, max_new_tokens=1)  # stores 8 chunks
        assert len(store.indexed_keys()) == 8 * groups  # one object per chunk and group
        # the engine's own (unplanned) prefill serves every group too
        pre = eng.prefill(ids, PUBLIC)
        assert pre.cached_tokens == 8 * TPC
        assert _exact(pre.logits, full, pre.cached_tokens) <= 1e-4
        planned = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"))
        assert planned.model.layer_groups == groups
        # load-only, a shorter load, the Cake split (front computed while back loads)
        for front, stop in [(0, 8), (0, 5), (3, 8), (1, 6), (0, 0)]:
            out, done = planned.generate(ids, PUBLIC, max_new_tokens=16, policy=fixed(front, stop))
            assert done.loaded == stop - front and done.fallback == 0
            assert done.layered == (groups > 1 and stop > front)
            assert done.plan.groups == groups
            pre = done.prefill
            assert pre.cached_tokens == stop * TPC
            diff = _exact(pre.logits, full, pre.cached_tokens)
            assert diff <= 1e-4, f"G={groups} plan {front, stop}: logits differ by {diff}"
            assert out == want, f"G={groups} plan {front, stop}"
        assert planned.counters.abandoned == 0 and planned.counters.misses == 0
        # the same groups waited for whole before the rest's forward (no overlap)
        waiting = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"), layered=False)
        assert waiting.model.layer_groups == 1
        out, done = waiting.generate(ids, PUBLIC, max_new_tokens=16, policy=fixed(2, 8))
        assert not done.layered and done.loaded == 6 and out == want


def test_a_chunk_is_usable_only_when_every_group_is(tiny: LoadedModel, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 512, 8 * TPC + 5).tolist()
    want, full = _want(tiny, ids, 12)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        eng.generate(ids, PUBLIC, max_new_tokens=1)
        # group 1 loses chunks 5.. (an invalidation of its chain); group 0 keeps all 8
        keys1 = chunk_keys(eng.group_identities[1], PUBLIC, ids[: 8 * TPC])
        assert store.invalidate(prefix=keys1[5]) == 3
        assert len(store.lookup(eng.group_identities[0], PUBLIC, ids).hits) == 8
        pre = eng.prefill(ids, PUBLIC)
        assert pre.cached_tokens == 5 * TPC
        assert _exact(pre.logits, full, 5 * TPC) <= 1e-4
        planned = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"))
        out, done = planned.generate(ids, PUBLIC, max_new_tokens=12)
        assert done.plan.hits == 5 and out == want


def test_a_corrupt_group_after_the_forward_started_is_recomputed(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 512, 8 * TPC + 7).tolist()
    want, full = _want(tiny, ids, 12)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        eng.generate(ids, PUBLIC, max_new_tokens=1)
    # a real file on the disk tier: flip bytes of group 1's chunk 3
    key = chunk_keys(eng.group_identities[1], PUBLIC, ids[: 8 * TPC])[3]
    frame = next(f for f in scan_frames(tmp_path) if f.key == key)
    flip(frame.segment, frame.payload_offset + 100, 4)
    with throttled_store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        planned = PlannedEngine(eng, seeded_model(TPC), deadline_factor=float("inf"))
        out, done = planned.generate(ids, PUBLIC, max_new_tokens=12, policy=fixed(0, 8))
        cached = done.prefill.cached_tokens
        assert _exact(done.prefill.logits, full, cached) <= 1e-4
        assert out == want
        # layers 0-1 (group 0) ran on the loaded prefix before layer 2 found its group
        # short: that forward is abandoned, the prompt recomputed on the 3 chunks whole
        assert done.layered and done.abandoned_layer == 2
        assert done.loaded == 3 and done.fallback == 5 and cached == 3 * TPC
        assert planned.counters.abandoned == 1 and planned.counters.misses == 1
        assert store.counters.corrupt == 1 and key not in store.indexed_keys()
        assert planned.settle(10.0)


def test_a_group_late_after_the_forward_started_is_recomputed(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """Group 0 lands within the deadline, group 1 trickles in far past it: the forward
    that started on group 0 is abandoned at group 1 and those chunks are recomputed,
    the outputs exact. Group 0 lands in time only if the machine gives its loads a
    fraction of the 0.6 s slack: a machine so busy that it does not (the suite with
    three workers beside a busy loop, on two vCPUs) gets three fresh stores, each run
    held to exact outputs and a complete fallback."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 512, 8 * TPC + 9).tolist()
    want, full = _want(tiny, ids, 12)
    for attempt in range(3):
        if _late_group_run(tiny, tmp_path / f"try{attempt}", ids, want, full):
            return
    raise AssertionError("three runs and group 0 never landed within its 0.6 s slack")


def _late_group_run(
    tiny: LoadedModel, path: Path, ids: list[int], want: list[int], full: Any
) -> bool:
    """One run of the test above; whether group 0 landed in time (then every check of
    the test was made)."""
    with throttled_store(path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC, layer_groups=2)
        eng.generate(ids, PUBLIC, max_new_tokens=1)
        tier = store.tier("disk")
        assert isinstance(tier, ThrottledTier)
        group_bytes = 8 * eng.identity.layout.chunk_nbytes // 2  # 8 chunks of 2 of 4 layers
        chunk = group_bytes // 8
        # group 0 passes in the burst (with two and a half chunks to spare, should reads
        # of group 1 be charged first: with half a chunk, reads of group 1 charged before
        # group 0's last made it late in 3 of 17 runs on a busy machine); group 1 then
        # trickles at ~0.2 s a chunk (5.5 chunks past the burst: 1.1 s) while the model,
        # seeded for a fast disk, plans for microseconds: its deadline is the 0.6 s slack
        tier.set_limits(chunk / 0.2, burst_bytes=group_bytes + 5 * chunk // 2)
        planned = PlannedEngine(eng, seeded_model(TPC, 1e-10), deadline_slack_s=0.6)
        out, done = planned.generate(ids, PUBLIC, max_new_tokens=12, policy=fixed(0, 8))
        cached = done.prefill.cached_tokens
        assert _exact(done.prefill.logits, full, cached) <= 1e-4
        assert out == want
        assert done.loaded + done.fallback == 8
        assert cached == done.loaded * TPC
        # group 1 (layers 2-3) is always late; group 0 (layers 0-1) too on a busy machine
        assert done.abandoned_layer in (0, 2), done.abandoned_layer
        if done.abandoned_layer == 0:  # all of it recomputed, exact
            assert planned.settle(30.0)
            return False
        assert done.layered, "group 0 should land, group 1 not"
        assert planned.counters.timeouts == 1 and planned.counters.abandoned == 1
        assert done.loaded < 8
        # the abandoned loads end on their own; then every group lands in time
        assert planned.settle(30.0)
        tier.set_limits(0.0)
        deadline = time.monotonic() + 5
        out2, again = planned.generate(ids, PUBLIC, max_new_tokens=12, policy=fixed(0, 8))
        assert again.loaded == 8 and again.abandoned_layer == -1 and out2 == want
        assert time.monotonic() < deadline
        return True


def test_the_layered_crossover_variant_writes_its_json_and_plot(tmp_path: Path) -> None:
    from kvlife.cli import main

    out, png = tmp_path / "x.json", tmp_path / "x.png"
    argv = ["experiment", "crossover", "--layered", "--quick", "--model", "tiny"]
    argv += ["--repeats", "1", "--groups", "2", "--no-progress", "--json", str(out)]
    assert main([*argv, "--plot", str(png)]) == 0 and png.stat().st_size > 0
    got = json.loads(out.read_text())
    assert got["groups"] == 2 and [p["bandwidth_mb_s"] for p in got["points"]] == [10.0, 100.0]
    for p in got["points"]:
        for name in ("whole", "layered", "compute"):
            assert p[name] > 0 and p[f"{name}_predicted"] > 0
        whole, layered = p["whole_runs"][0], p["layered_runs"][0]
        assert not whole["layered"] and whole["groups"] == 1 and whole["loaded"] == 4
        assert layered["layered"] and layered["groups"] == 2 and layered["loaded"] == 4
