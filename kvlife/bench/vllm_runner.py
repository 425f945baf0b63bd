"""Run requests through one vLLM engine in this process and write what happened as JSON.

A benchmark driver, so it lives with the benchmarks: it uses the engine package
(:mod:`kvlife.engines.vllm`) and the demo's chat workload (:mod:`kvlife.apps.chat`),
and nothing below it imports it.

``python -m kvlife.bench.vllm_runner SPEC.json OUT.json`` starts one engine (vLLM in
one process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so an embedded kvlife store is
shared by the scheduler- and worker-side connectors), serves the spec's requests one at
a time, greedy, and writes per request the output token ids, TTFT and cached tokens,
plus the connector's and the store's counters, the worker's timings (where a load's and a
save's time goes) and, for the same bytes as the run's loads, the time of a memcpy in
this process (:func:`memcpy_reference`: cold, as the loads find their bytes, and warm).
Tests, ``kvlife demo --engine vllm`` and ``kvlife bench vllm`` run each engine as such a
child process, so an engine restart is a real new process and every engine's memory is
returned when it exits. :func:`request_row`, :func:`worker_tiers` and
:func:`connector_counters` are what :mod:`kvlife.bench.vllm_trace_runner` records too.

Spec keys: ``model`` (directory), ``dtype``, ``block_size``, ``prefix_caching``,
``kv_cache_mib``, ``max_model_len``, ``max_num_batched_tokens`` (tokens per step: a
longer prompt is prefilled over several steps), ``multiprocess`` (vLLM's default separate
engine-core and worker processes; counters then stay in those processes),
``tensor_parallel_size`` (a worker process per rank, so the store must be served:
``kvlife.socket``; the worker counters stay in them), ``kvlife``
(``kv_connector_extra_config``, or null for no connector), and either ``requests``
(``[{"tokens": [...], "max_tokens": n, "cache_salt": s}]``) or ``chat``
(``{"max_new_tokens": n, "turns": t, "users": u}``: the demo's chat workload).
``reset_before``: indexes of requests before which the run calls
``llm.reset_prefix_cache(reset_connector=True)`` (vLLM's prefix-cache reset, passed on to
the connector); what each returned is recorded as ``resets``. Before each, the puts of
the requests served so far are waited for (in one engine process), so that what a reset
takes is what those requests stored: vLLM does not wait for them, and a reset that
overtakes a put's write-through copy leaves that copy unmade (the object it was for is
gone), which a test of each chunk's lifecycle would see as a copy missing.
``imports``: modules imported before the engine starts (``kvlife.faults.throttle``
registers the ``throttled-disk`` tier kind a ``kvlife.config`` may name).
``prefill_profile``: ``{"out": PATH, "points": [[start, length], ...], "repeats": n}``:
before the requests, the engine's prefill profile is measured
(:func:`kvlife.engines.vllm.profile.measure_prefill`) and saved to ``PATH`` (what a
``[planner] prefill_profile`` names); recorded as ``prefill_profile``.
``expect_failure``: a request that raises (e.g. the connector's ``kvlife.fail_layer``
test hook) ends the run instead of the process: the error is recorded as ``error`` and
the store is closed as usual.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _engine(spec: dict[str, Any]) -> Any:
    # one process unless the spec says otherwise (then the store must be served:
    # kvlife.socket, since the scheduler and the worker are other processes)
    multi = bool(spec.get("multiprocess", False))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multi else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.get("kvlife") is not None:
        from vllm.config import KVTransferConfig

        from kvlife.engines.vllm import CONNECTOR, CONNECTOR_MODULE

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kvlife"],
        )
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if int(spec.get("tensor_parallel_size", 1)) > 1:
        # worker processes of their own: the store must be served (kvlife.socket)
        kwargs["tensor_parallel_size"] = int(spec["tensor_parallel_size"])
    if spec.get("enable_lora"):
        kwargs |= {"enable_lora": True, "max_lora_rank": int(spec.get("max_lora_rank", 8))}
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=int(spec.get("block_size", 32)),
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        max_model_len=int(spec.get("max_model_len", 2048)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_mib", 256)) << 20,
        enforce_eager=True,
        disable_log_stats=False,
        skip_tokenizer_init=bool(spec.get("skip_tokenizer_init", False)),
        seed=0,
        **kwargs,
    )


def worker_tiers() -> dict[str, int]:
    """Chunks the worker-side connector of this process loaded so far, per tier."""
    from kvlife.engines.vllm.connector import live_connectors

    for conn in live_connectors():
        if conn.worker is not None:
            return dict(conn.worker.counters.tiers)
    return {}


PATH_TIMINGS = ("lookup_s", "wait_s", "gather_s", "stage_s")
"""The worker's timings spent in the engine's own thread, on the step's path (the
loader's copy, ``load_s``, runs beside the forward; the stager's work after the step)."""


def worker_timings() -> dict[str, float]:
    """The worker-side connector's timings of this process so far (``WorkerTimings``)."""
    from dataclasses import asdict

    from kvlife.engines.vllm.connector import live_connectors

    for conn in live_connectors():
        if conn.worker is not None:
            return {k: float(v) for k, v in asdict(conn.worker.timings).items()}
    return {}


def request_row(
    out: Any,
    prompt_tokens: int,
    wall: float,
    tiers_before: dict[str, int],
    timings_before: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What a benchmark records of one request vLLM served (``out``, its
    ``RequestOutput``; ``wall``, the ``generate`` call's time; ``tiers_before``,
    :func:`worker_tiers` before it): output ids, TTFT (vLLM's own metric, else the wall
    time), time per output token after the first, vLLM's ``num_cached_tokens`` (its
    prefix cache and the connector together) and the chunks each kvlife tier served;
    given ``timings_before`` (:func:`worker_timings`), ``connector_s``: the connector's
    time in the engine's thread during the request (:data:`PATH_TIMINGS`, over all its
    steps) and its loads' ``load_s``."""
    after = worker_tiers()
    m = out.metrics
    ttft = float(m.first_token_latency) if m is not None and m.first_token_latency else wall
    ids = list(out.outputs[0].token_ids)
    spent: dict[str, float] = {}
    if timings_before is not None:
        now = worker_timings()
        spent = {
            k: now[k] - timings_before.get(k, 0.0) for k in (*PATH_TIMINGS, "load_s") if k in now
        }
        if spent:
            spent["path_s"] = sum(spent[k] for k in PATH_TIMINGS)
    return {
        "connector_s": spent,
        "prompt_tokens": prompt_tokens,
        "output_ids": ids,
        "ttft_s": ttft,
        "wall_s": wall,
        "tpot_s": (wall - ttft) / (len(ids) - 1) if len(ids) > 1 else None,
        "cached_tokens": int(out.num_cached_tokens or 0),
        "kvlife_chunks": {
            t: n - tiers_before.get(t, 0) for t, n in after.items() if n - tiers_before.get(t, 0)
        },
    }


def _serve(
    llm: Any, tokens: list[int], max_tokens: int, salt: str | None, lora: Any = None
) -> dict[str, Any]:
    from vllm import SamplingParams

    prompt: dict[str, Any] = {"prompt_token_ids": tokens}
    if salt:
        prompt["cache_salt"] = salt
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    before = worker_tiers()
    timings = worker_timings()
    t0 = time.perf_counter()
    lora_request = None
    if lora:
        from vllm.lora.request import LoRARequest

        lora_request = LoRARequest(lora["name"], int(lora["id"]), lora["path"])
    out = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora_request)[0]
    return request_row(out, len(tokens), time.perf_counter() - t0, before, timings)


def _chat(llm: Any, max_new_tokens: int, turns: int, users: int) -> list[dict[str, Any]]:
    from kvlife.apps.chat import ChatEncoder, load_workload

    work = load_workload()
    tok = llm.get_tokenizer()
    enc = ChatEncoder(tok, int(llm.llm_engine.model_config.hf_config.vocab_size))
    people = work["users"][:users]
    rounds = min(turns, max(len(u["turns"]) for u in people))
    order = [
        (u["name"], t, u["turns"][t]) for t in range(rounds) for u in people if t < len(u["turns"])
    ]
    history: dict[str, list[tuple[str, str]]] = {}
    rows = []
    for user, t, question in order:
        hist = history.setdefault(user, [])
        ids = enc.chat(work["system"], hist, question)
        row = _serve(llm, ids, max_new_tokens, None)
        answer = enc.decode(row["output_ids"])
        hist.append((question, answer))
        rows.append(row | {"user": user, "turn": t + 1, "answer": answer})
    return rows


def _keys(spec: dict[str, Any]) -> list[list[str]]:
    """The kvlife keys (hex) of each request's full chunks, rank 0, base model."""
    from kvlife.core.identity import prompt_chunk_keys
    from kvlife.engines.vllm.connector import live_connectors

    for conn in live_connectors():
        if conn.scheduler is not None:
            ident = conn.scheduler.identities[0]
            out = []
            for r in spec.get("requests", []):
                ns = conn.namespaces.namespace(r.get("cache_salt"))
                out.append([k.hex() for k in prompt_chunk_keys(ident, ns, list(r["tokens"]))])
            return out
    return []


def _settle_puts() -> None:
    """Wait for the committed puts of this process's connectors (none with
    ``multiprocess``: their workers are in other processes)."""
    from kvlife.engines.vllm.connector import live_connectors

    for conn in live_connectors():
        if conn.worker is not None:
            conn.worker.drain()


def connector_counters() -> dict[str, Any]:
    """The connectors' counters of this process (worker, store, scheduler) and the
    worker's timings; the worker's committed puts drained first."""
    from dataclasses import asdict

    from kvlife.engines.vllm.connector import live_connectors

    out: dict[str, Any] = {}
    for conn in live_connectors():
        if conn.worker is not None:
            out["worker"] = asdict(conn.worker.counters)
            out["timings"] = asdict(conn.worker.timings)
            conn.worker.drain()
            out["store"] = conn.lease.store.counters.as_dict()
        if conn.scheduler is not None:
            out["scheduler"] = asdict(conn.scheduler.counters)
    return out


FLUSH_BYTES = 768 << 20
"""Streamed through the caches before each cold copy: well over this host's last-level
cache (its L3 reports 300 MiB, shared with other guests)."""


def memcpy_reference(timings: dict[str, Any], rounds: int = 5) -> dict[str, Any]:
    """memcpy of the bytes the connector loaded, in this process right after the run,
    each step's bytes (the run's mean) copied between two host arrays once per load step,
    the fastest of ``rounds``: ``s`` with source and destination evicted from the caches
    before each step's copy, as the connector's are (the replica was written a turn
    earlier, the blocks are the paged cache's, and every forward in between streamed
    the model's weights through the caches): the ``connector_load_vs_memcpy`` figure's
    reference; ``warm_s`` with both arrays copied again and again (cache-resident up to
    the last-level cache's size: not the state a load finds its bytes in)."""
    import numpy as np

    steps = int(timings.get("load_steps", 0))
    total = int(timings.get("load_bytes", 0))
    if not steps or not total:
        return {"bytes": 0, "s": 0.0, "warm_s": 0.0}
    src = np.ones(total // steps, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both arrays paged in before timing
    flush = np.ones(FLUSH_BYTES, np.uint8)
    cold = warm = float("inf")
    for _ in range(rounds):
        took = 0.0
        for _ in range(steps):
            flush[:: 1 << 12] += 1  # written too: dirty lines of src/dst are written back
            flush.sum(dtype=np.uint64)
            t0 = time.perf_counter()
            np.copyto(dst, src)
            took += time.perf_counter() - t0
        cold = min(cold, took)
        t0 = time.perf_counter()
        for _ in range(steps):
            np.copyto(dst, src)
        warm = min(warm, time.perf_counter() - t0)
    return {"bytes": src.nbytes * steps, "s": cold, "warm_s": warm}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    error = ""
    resets: list[bool] = []
    for module in spec.get("imports", ()):
        importlib.import_module(str(module))
    t0 = time.perf_counter()
    llm = _engine(spec)
    start_s = time.perf_counter() - t0
    profile: dict[str, Any] = {}
    if spec.get("prefill_profile"):
        from dataclasses import asdict

        from kvlife.engines.vllm.profile import POINTS, measure_prefill

        want = spec["prefill_profile"]
        points = [tuple(p) for p in want.get("points", POINTS)]
        fitted = measure_prefill(llm, points, repeats=int(want.get("repeats", 2)))
        fitted.save(Path(want["out"]))
        profile = asdict(fitted)
    if "chat" in spec:
        chat = spec["chat"]
        rows = _chat(
            llm,
            int(chat.get("max_new_tokens", 32)),
            int(chat.get("turns", 1 << 30)),
            int(chat.get("users", 1 << 30)),
        )
    else:
        rows = []
        reset_before = set(spec.get("reset_before", ()))
        for i, r in enumerate(spec["requests"]):
            if i in reset_before:
                _settle_puts()
                resets.append(bool(llm.reset_prefix_cache(reset_connector=True)))
            args = (list(r["tokens"]), int(r.get("max_tokens", 16)), r.get("cache_salt"))
            try:
                rows.append(_serve(llm, *args, r.get("lora")))
            except Exception as exc:
                if not spec.get("expect_failure"):
                    raise
                error = f"{type(exc).__name__}: {exc}"
                break
    counters = connector_counters() if spec.get("kvlife") is not None else {}
    memcpy = memcpy_reference(counters.get("timings", {}))
    keys = _keys(spec) if spec.get("kvlife") is not None else []
    if spec.get("kvlife") is not None and not spec.get("multiprocess", False):
        from kvlife.engines.vllm.stores import close_all

        close_all()
    return {
        "engine_start_s": start_s,
        "prefill_profile": profile,
        "requests": rows,
        "counters": counters,
        "memcpy": memcpy,
        "keys": keys,
        "resets": resets,
        "error": error,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvlife.bench.vllm_runner SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    result = run(spec)
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
