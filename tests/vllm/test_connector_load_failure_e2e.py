"""A load whose copy into the paged cache fails, under a real vLLM (CPU build): the
connector's ``kvlife.fail_layer = "copy:1"`` test hook raises in the worker's loader
thread while it writes the second of the tiny model's two layers, as a bug in the
scatter would, the first layer already written. The step must go on: every block of the
load is reported through ``get_block_ids_with_load_errors`` (none was written whole),
vLLM recomputes them, and the output is the one the engine gave the same prompt
before. One engine process: the first request stores the prompt, the second loads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import run_engine
from tests.vllm.test_connector_e2e import CHUNK, P1, _ids, _req, _spec


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-load-failure")
    spec = _spec(tiny_model, work / "store", [_req(P1), _req(P1)])
    spec["kvlife"]["kvlife.fail_layer"] = "copy:1"
    return run_engine(spec, work, "L")


def test_a_copy_that_raises_in_the_loader_is_recomputed_not_fatal(run: dict[str, Any]) -> None:
    assert "error" not in run or not run["error"]
    assert len(run["requests"]) == 2
    worker = run["counters"]["worker"]
    assert worker["load_failures"] == {"copy": 1}
    # the prompt's stored chunks (all but the last token's: 4 of 5), every block of them
    assert worker["blocks_failed"] == 4 * CHUNK // 32
    assert worker["tokens_loaded"] == 0
    # vLLM recomputed them: the same greedy output as the first time
    assert _ids(run, 1) == _ids(run, 0)
