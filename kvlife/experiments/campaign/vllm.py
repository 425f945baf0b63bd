"""Faults under a real vLLM (the CPU build in ``.venv-vllm``), through kvlife's connector.

Every engine is a child process (:mod:`kvlife.bench.vllm_runner`) on a small random Llama
(two layers, weights scaled up so greedy picks are not ties), requests of token ids. The
oracle here is vLLM itself: an engine without kvlife gives the reference outputs, and an
engine that loads from a store a fault went through must give the same tokens.

- ``forward-fails``: an engine whose forward raises at layer 1 of its first step with
  saves (the connector's ``kvlife.fail_layer`` hook, as an out-of-memory would), then a
  fresh engine on the same store: it must load nothing of the failed step and output
  the reference tokens.
- ``engine-killed``: an engine (write-through) SIGKILLed 0-3 s after its first save
  reached the disk tier (in its steps), then a fresh engine on the same store: same outputs as the
  reference, whatever it loaded. Recovery time: the fresh engine's whole run, its start
  included.

- ``tp-rank-load-fails``: two tensor-parallel ranks (two worker processes, each with
  its kvlife connector, sharing a store ``kvlife serve`` serves). An engine stores the
  prompts (its outputs are the TP=2 reference); the server stops and every frame of
  rank 1's shard gets one payload byte flipped (rank 0's, named by the run's keys, stay
  whole); a fresh TP=2 engine on the restarted server looks the prompts up: rank 0's
  loads succeed, rank 1's fail verification, and rank 1 reports the blocks through
  ``get_block_ids_with_load_errors``. vLLM's own aggregation of the workers' outputs
  (``KVOutputAggregator``) unions the ranks' invalid blocks and its scheduler recomputes
  them for every rank (``kv_load_failure_policy="recompute"``): no rank may use what
  rank 0 loaded while rank 1's half is missing. Detected: the scheduler's "Recovered
  from KV load failure" line (its requests and tokens are counted: ``recomputed``, in
  chunks); the outputs must equal the reference's. vLLM's CPU build binds each worker
  to its own cores (``VLLM_CPU_OMP_THREADS_BIND``, set from this process's CPUs).

In these rows ``served_chunks`` counts requests compared with the reference,
``wrong_chunks`` the requests whose output differed and ``wrong_bytes`` their differing
tokens (the engine's output is what a wrong chunk would corrupt).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvlife.experiments.campaign.served import Server
from kvlife.experiments.campaign.tally import Campaign, KindTally
from kvlife.faults import damage

CHUNK = 64
NEW = 8
MODEL_CODE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=2048, tie_word_embeddings=True)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(torch.float32)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(4.0)
model.save_pretrained(sys.argv[1])
"""


def _spec(model: Path, store: Path | None, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "block_size": 32,
        "dtype": "float32",
        "kv_cache_mib": 64,
        "max_model_len": 1024,
        "requests": [{"tokens": p, "max_tokens": NEW, "cache_salt": None} for p in prompts],
        "kvlife": None,
    }
    if store is not None:
        spec["kvlife"] = {
            "kvlife.path": str(store),
            "kvlife.chunk_tokens": CHUNK,
            "kvlife.dram_mib": 64,
            "kvlife.disk_mib": 256,
        }
    return spec | kw


def _start(
    python: str, spec: dict[str, Any], work: Path, name: str, log: bool = False
) -> subprocess.Popen[str]:
    """Start an engine child; ``log``: its stdout (where vLLM logs) joins its stderr."""
    (work / f"{name}.spec.json").write_text(json.dumps(spec))
    cmd = [python, "-m", "kvlife.bench.vllm_runner"]
    cmd += [str(work / f"{name}.spec.json"), str(work / f"{name}.out.json")]
    env = dict(os.environ)
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(tp))
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE if log else subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log else subprocess.PIPE,
        text=True,
        env=env,
    )


def cpu_bind(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers: this process's CPUs split
    into ``ranks`` groups (vLLM's CPU build refuses to bind two workers to one NUMA
    node by itself)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    groups = [cpus[i * per : (i + 1) * per] or cpus[-1:] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def _run(python: str, spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    out, _ = _run_logged(python, spec, work, name)
    return out


def _run_logged(
    python: str, spec: dict[str, Any], work: Path, name: str
) -> tuple[dict[str, Any], str]:
    """Run an engine to its end: its JSON and its output (vLLM's log)."""
    proc = _start(python, spec, work, name, log=True)
    err, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed: {err[-2000:]}")
    out: dict[str, Any] = json.loads((work / f"{name}.out.json").read_text())
    return out, err


def run(root: Path, seed: int, n: int, campaign: Campaign) -> None:
    """``n`` injections of each vLLM kind (each costs two or three engine starts)."""
    try:
        from kvlife.interpreters import vllm_python

        python = vllm_python()
    except Exception as exc:  # no vLLM here: the part is skipped, and says why
        campaign.skipped.append(f"vllm: {exc}")
        return
    root.mkdir(parents=True, exist_ok=True)
    model = root / "tiny-llama"
    subprocess.run([python, "-c", MODEL_CODE, str(model)], check=True, capture_output=True)
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 1000) for _ in range(4 * CHUNK + 7)] for _ in range(3)]
    ref = _run(python, _spec(model, None, prompts), root, "reference")
    want = [r["output_ids"] for r in ref["requests"]]
    for i in range(n):
        # a forward that fails part-way
        t = campaign.tally("forward-fails", "vllm")
        store = root / f"ff-{i}"
        bad = _spec(model, store, prompts[:1], expect_failure=True)
        bad["kvlife"]["kvlife.fail_layer"] = "save:1"
        h = _run(python, bad, root, f"ff-{i}-fail")
        t.injections += 1
        if "InjectedForwardError" in str(h.get("error", "")):
            t.detections += 1
        started = time.perf_counter()
        fresh = _run(python, _spec(model, store, prompts), root, f"ff-{i}-fresh")
        t.recovery_s.append(time.perf_counter() - started)
        _tally_outputs(t, fresh, want)
        if fresh["requests"][0]["cached_tokens"]:
            t.stale_served += 1
            t.note("a chunk of the failed step was loaded by a fresh engine")
        # an engine killed mid-step
        t = campaign.tally("engine-killed", "vllm")
        store = root / f"ek-{i}"
        # write-through, so what it saved before the kill is durable and a fresh engine
        # has something to load (write-back would hold it in the dead process's DRAM)
        victim_spec = _spec(model, store, prompts * 2)
        victim_spec["kvlife"]["kvlife.write_through"] = True
        victim = _start(python, victim_spec, root, f"ek-{i}-victim")
        # kill it in its steps: once its first save reached the disk tier, 0-3 s later
        deadline = time.monotonic() + 300
        segments = store / "disk" / "segments"
        while victim.poll() is None and time.monotonic() < deadline:
            if segments.exists() and any(f.stat().st_size for f in segments.glob("seg-*.kvs")):
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 3.0))
        if victim.poll() is None:
            os.kill(victim.pid, signal.SIGKILL)
            t.sigkills += 1
        victim.wait()
        t.injections += 1
        started = time.perf_counter()
        fresh = _run(python, _spec(model, store, prompts), root, f"ek-{i}-fresh")
        t.recovery_s.append(time.perf_counter() - started)
        t.detections += 1
        _tally_outputs(t, fresh, want)
        # one tensor-parallel rank's load failing
        tp_rank_load_fails(
            python, model, root, prompts, campaign.tally("tp-rank-load-fails", "vllm"), f"tp-{i}"
        )


RECOVERED = re.compile(
    r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)"
)
"""vLLM's scheduler line for blocks a worker reported as failed loads (recomputed)."""


def tp_rank_load_fails(
    python: str, model: Path, root: Path, prompts: list[list[int]], t: KindTally, name: str
) -> tuple[int, int] | None:
    """One injection of ``tp-rank-load-fails`` (see the module doc). Returns the
    requests vLLM's scheduler rescheduled and the tokens it recomputed (None when there
    was nothing of rank 1 alone to damage)."""
    work = root / name
    work.mkdir(parents=True)

    def served(spec_name: str) -> tuple[dict[str, Any], str]:
        server = Server(work)
        server.start()
        try:
            spec = _spec(model, None, prompts, tensor_parallel_size=2)
            spec["kvlife"] = {"kvlife.socket": str(server.socket), "kvlife.chunk_tokens": CHUNK}
            return _run_logged(python, spec, work, spec_name)
        finally:
            server.stop()

    first, _ = served("writer")
    want = [r["output_ids"] for r in first["requests"]]
    rank0 = {bytes.fromhex(k) for keys in first["keys"] for k in keys}
    victims = [f for f in damage.scan_frames(work / "store") if bytes(f.key) not in rank0]
    if not victims or len(victims) == len(damage.scan_frames(work / "store")):
        t.note(f"no frame of rank 1 alone to damage ({len(victims)} found)")
        return None
    for f in victims:  # rank 1's shard: every frame fails verification
        damage.flip(f.segment, f.payload_offset + f.payload_len // 3, 1)
    t.injections += 1
    started = time.perf_counter()
    fresh, log = served("fresh")
    t.recovery_s.append(time.perf_counter() - started)
    recovered = RECOVERED.findall(log)
    requests = sum(int(n) for n, _ in recovered)
    tokens = sum(int(k) for _, k in recovered)
    if recovered:
        t.detections += 1
        t.lost_explained += len(victims)
    else:
        t.note("no KV load failure reported by vLLM's scheduler")
    t.note(f"{requests} request(s) rescheduled, {tokens} tokens recomputed")
    _tally_outputs(t, fresh, want, recomputed=-(-tokens // CHUNK))
    return requests, tokens


def _tally_outputs(
    t: KindTally, run: dict[str, Any], want: list[list[int]], recomputed: int | None = None
) -> None:
    """A fresh engine's outputs against the reference: a differing request is a wrong
    answer (counted as a wrong chunk, its differing tokens as wrong bytes). Recomputed
    chunks: ``recomputed`` when the caller knows, else the prompts' chunks not loaded."""
    for got, exp in zip((r["output_ids"] for r in run["requests"]), want, strict=True):
        t.served_chunks += 1
        diff = sum(a != b for a, b in zip(got, exp, strict=False)) + abs(len(got) - len(exp))
        if diff:
            t.wrong_chunks += 1
            t.wrong_bytes += diff
    if recomputed is not None:
        t.recomputed += recomputed
        return
    hits = sum(r["cached_tokens"] for r in run["requests"]) // CHUNK
    t.recomputed += max(0, len(want) * 4 - hits)


if __name__ == "__main__":  # pragma: no cover - a manual check
    c = Campaign(0, False)
    run(Path(sys.argv[1]), 0, 1, c)
    print(json.dumps([t.to_json() for t in c.tallies.values()], indent=1))
