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

In these rows ``served_chunks`` counts requests compared with the reference,
``wrong_chunks`` the requests whose output differed and ``wrong_bytes`` their differing
tokens (the engine's output is what a wrong chunk would corrupt).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvlife.experiments.campaign.tally import Campaign, KindTally

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


def _start(python: str, spec: dict[str, Any], work: Path, name: str) -> subprocess.Popen[str]:
    (work / f"{name}.spec.json").write_text(json.dumps(spec))
    cmd = [python, "-m", "kvlife.bench.vllm_runner"]
    cmd += [str(work / f"{name}.spec.json"), str(work / f"{name}.out.json")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _run(python: str, spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    proc = _start(python, spec, work, name)
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed: {err[-2000:]}")
    out: dict[str, Any] = json.loads((work / f"{name}.out.json").read_text())
    return out


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


def _tally_outputs(t: KindTally, run: dict[str, Any], want: list[list[int]]) -> None:
    """A fresh engine's outputs against the reference: a differing request is a wrong
    answer (counted as a wrong chunk, its differing tokens as wrong bytes)."""
    for got, exp in zip((r["output_ids"] for r in run["requests"]), want, strict=True):
        t.served_chunks += 1
        diff = sum(a != b for a, b in zip(got, exp, strict=False)) + abs(len(got) - len(exp))
        if diff:
            t.wrong_chunks += 1
            t.wrong_bytes += diff
    hits = sum(r["cached_tokens"] for r in run["requests"]) // CHUNK
    t.recomputed += max(0, len(want) * 4 - hits)


if __name__ == "__main__":  # pragma: no cover - a manual check
    c = Campaign(0, False)
    run(Path(sys.argv[1]), 0, 1, c)
    print(json.dumps([t.to_json() for t in c.tallies.values()], indent=1))
