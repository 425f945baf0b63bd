"""A forward that fails part-way under a real vLLM (CPU build): the connector's
``kvlife.fail_layer`` test hook raises inside the forward at layer 1 of the first step
with saves (after layer 0 was saved, before layer 1 was), as an out-of-memory would.
Nothing of that step may be stored; a fresh engine on the same store must produce the
outputs of vLLM without kvlife. Three engine processes: R (no kvlife), H (the failing
one), I (fresh, on H's store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import run_engine
from tests.vllm.test_connector_e2e import CHUNK, P1, _ids, _req, _spec


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-faults")
    store = work / "store"
    out: dict[str, Any] = {}
    out["R"] = run_engine(_spec(tiny_model, None, [_req(P1)]), work, "R")
    faulty = _spec(tiny_model, store, [_req(P1), _req(P1)], expect_failure=True)
    faulty["kvlife"]["kvlife.fail_layer"] = "save:1"
    out["H"] = run_engine(faulty, work, "H")
    out["I"] = run_engine(_spec(tiny_model, store, [_req(P1), _req(P1)]), work, "I")
    return out


def test_a_forward_that_failed_at_a_layer_left_nothing_a_fresh_engine_would_load(
    runs: dict[str, Any],
) -> None:
    h = runs["H"]
    assert "InjectedForwardError" in h["error"] and h["requests"] == []
    assert h["counters"]["worker"]["saves_incomplete"] == 1
    assert h["counters"]["worker"]["saves"] == 0
    i = runs["I"]
    assert i["requests"][0]["cached_tokens"] == 0, "a chunk of the failed step was stored"
    assert _ids(i, 0) == _ids(runs["R"], 0)
    # the fresh engine stores its own, reuses them, and the output is still vLLM's
    assert i["requests"][1]["cached_tokens"] == 4 * CHUNK
    assert _ids(i, 1) == _ids(runs["R"], 0)
