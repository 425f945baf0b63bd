"""Serve a trace's requests through one vLLM engine in this process; write what happened.

The child process of ``kvlife bench vllm-trace`` (:mod:`kvlife.bench.vllm_trace`), run
with the interpreter that has vLLM: ``python -m kvlife.bench.vllm_trace_runner SPEC.json
OUT.json``. Unlike :mod:`kvlife.bench.vllm_runner` (kvlife's connector or none), the
engine's KV layer is any vLLM connector the spec names, so the peers run under the same
engine, model and requests as kvlife:

- ``connector``: null (vLLM's own prefix cache only), or ``{"name", "module" (null for a
  connector vLLM ships), "extra"}`` (``kv_connector_extra_config``);
- ``model``, ``dtype``, ``block_size``, ``kv_cache_mib`` (vLLM's own block pool: small, so
  that it evicts as a loaded deployment's does), ``max_model_len``, ``prefix_caching``;
- ``requests``: ``[{"tokens": [...], "max_tokens": n}]``, served one at a time (closed
  loop, concurrency 1), greedy, ``ignore_eos`` so each request decodes the trace's
  (scaled) output length.

Per request it writes the output ids, TTFT, time per output token, vLLM's
``num_cached_tokens`` (its prefix cache and the connector together) and, for kvlife's
connector, the chunks each kvlife tier served; then kvlife's counters and timings.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvlife.bench.vllm_runner import connector_counters, request_row, worker_tiers


def _engine(spec: dict[str, Any]) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    conn = spec.get("connector")
    if conn is not None:
        from vllm.config import KVTransferConfig

        extra: dict[str, Any] = {
            "kv_connector": conn["name"],
            "kv_role": "kv_both",
            "kv_connector_extra_config": conn.get("extra", {}),
        }
        if conn.get("module"):
            extra["kv_connector_module_path"] = conn["module"]
        if conn.get("load_failure_policy"):
            extra["kv_load_failure_policy"] = conn["load_failure_policy"]
        kwargs["kv_transfer_config"] = KVTransferConfig(**extra)
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=int(spec.get("block_size", 32)),
        enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        max_model_len=int(spec.get("max_model_len", 2048)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_mib", 64)) << 20,
        enforce_eager=True,
        disable_log_stats=False,  # the request's metrics carry its TTFT
        skip_tokenizer_init=True,
        seed=0,
        **kwargs,
    )


def _serve(llm: Any, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    before = worker_tiers()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
    return request_row(out, len(tokens), time.perf_counter() - t0, before)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live Python thread of this process by name
    (Linux ``/proc/self/task/TID/stat``), and ``other`` for the rest of the process
    (threads that ended, native ones such as OpenMP's): where the connector's
    background threads (the stager, the store's put thread) take the engine's cores."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(stat: Path) -> float:
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick

    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.native_id is not None:
            out[t.name] = out.get(t.name, 0.0) + cpu(Path(f"/proc/self/task/{t.native_id}/stat"))
    total = cpu(Path("/proc/self/stat"))
    out["other"] = max(0.0, total - sum(out.values()))
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm = _engine(spec)
    start_s = time.perf_counter() - t0
    rows = [_serve(llm, list(r["tokens"]), int(r["max_tokens"])) for r in spec["requests"]]
    conn = spec.get("connector")
    is_kvlife = conn is not None and str(conn.get("module") or "").startswith("kvlife")
    counters = connector_counters() if is_kvlife else {}
    cpu = thread_cpu()
    if is_kvlife:
        from kvlife.engines.vllm.stores import close_all

        close_all()
    return {
        "engine_start_s": start_s,
        "requests": rows,
        "counters": counters,
        "threads_cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvlife.bench.vllm_trace_runner SPEC.json OUT.json", file=sys.stderr)
        return 2
    result = run(json.loads(Path(args[0]).read_text()))
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
