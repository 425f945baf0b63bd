"""``kvlife bench vllm-trace --quick``: a slice of the Mooncake conversation trace through a
real vLLM per KV layer. Checks that it runs, its JSON's shape, that kvlife's greedy outputs
equal those of vLLM without a KV layer request by request, and that kvlife serves part of
a trace that has reuse. (Speed is the benchmark's to measure, not the test's.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvlife.bench.vllm_trace import DEFAULT_TRACE, QUICK, block_tokens, load_slice, main

pytestmark = pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="needs ../shared/traces")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-trace")
    out = work / "r.json"
    main(["--quick", "--json", str(out), "--dir", str(work)])
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def test_shared_trace_blocks_are_shared_tokens() -> None:
    reqs = load_slice(DEFAULT_TRACE, QUICK.slice)
    bt = QUICK.slice.block_tokens
    assert reqs[0]["blocks"][0] == reqs[1]["blocks"][0]  # the system prompt block
    assert reqs[0]["tokens"][:bt] == reqs[1]["tokens"][:bt] == block_tokens(0, bt)
    assert all(len(r["tokens"]) <= QUICK.slice.max_blocks * bt for r in reqs)
    assert len({r["conversation"] for r in reqs}) == QUICK.slice.conversations


def test_json_shape(result: dict[str, Any]) -> None:
    assert result["requests"] > 0 and result["prompt_tokens"] > 0
    assert {"memcpy_gbps", "raw_read_gbps", "python_loop_mips"} <= set(result["machine"])
    assert set(QUICK.configs) <= set(result["configs"])
    for name, c in result["configs"].items():
        if not c["ran"]:
            assert c["error"]
            continue
        assert set(c["ttft_s"]) == {"p50", "p90", "p99"} and set(c["tpot_s"]) == {"p50", "p99"}
        assert c["ttft_s"]["p50"] <= c["ttft_s"]["p90"] <= c["ttft_s"]["p99"]
        assert 0.0 <= c["hit_ratio"] <= 1.0 and 0.0 <= c["kvlife_hit_ratio"] <= c["hit_ratio"]
        assert isinstance(c["ttft_saved_vs_vllm"], float)
        assert len(c["ttft_by_request_s"]) == result["requests"]
        assert "MainThread" in c["threads_cpu_s"]
        if name.startswith("kvlife"):  # the stager thread's CPU is its own figure
            assert c["counters"]["timings"]["stager_cpu_s"] >= 0.0


def test_kvlife_outputs_equal_no_kv_layer_and_kvlife_serves_reuse(
    result: dict[str, Any],
) -> None:
    assert result["reusable_ratio"] > 0
    for name in ("kvlife dram", "kvlife dram+disk", "kvlife serve"):
        c = result["configs"][name]
        assert c["ran"] and c["identical_outputs"], (name, c["different_requests"])
        assert c["kvlife_hit_ratio"] > 0, name


def test_an_unknown_config_is_refused(tmp_path: Path) -> None:
    from kvlife.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="nope"):
        main(["--quick", "--configs", "vllm,nope", "--dir", str(tmp_path)])
