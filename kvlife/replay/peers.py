"""Other people's policies on the sweep's own block sequence: libCacheSim and vLLM.

Both are references that ``kvlife sweep`` draws beside kvlife's policies, never runtime
dependencies: libCacheSim (PyPI ``libcachesim``, the reference C implementations of the
caching literature) is imported lazily here only; vLLM's offloading manager runs in the
interpreter that has vLLM (:func:`kvlife.interpreters.vllm_python`) as a child process
(:mod:`kvlife.bench.vllm_offload_runner`), so its numbers are what vLLM's installed code
decides. A peer that is not installed is skipped with a note saying why.

libCacheSim sees the touches one by one (requests in arrival order, blocks in prompt
order, every block size 1), as the issue's table measured; vLLM's manager sees requests
(lookups, loads of the prefix, then a store offer of the whole prompt).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlife.core.errors import KVLifeError
from kvlife.trace.model import Trace

LIBCACHESIM = ("LRU", "ARC", "S3FIFO")
VLLM_RUNS = (("lru", 1), ("arc", 1), ("lru", 2), ("arc", 2))
"""vLLM cache policy and ``store_threshold`` pairs (1: store on first offer)."""


def _caps(trace: Trace, shares: Sequence[float]) -> list[int]:
    unique = trace.n_unique_blocks()
    return [max(1, int(unique * s)) for s in shares]


def libcachesim_curves(
    trace: Trace, shares: Sequence[float], algos: Sequence[str] = LIBCACHESIM
) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Block hit ratio of each libCacheSim algorithm at each capacity, and a note (empty,
    or why there is nothing)."""
    try:
        import libcachesim as lcs  # type: ignore[import-untyped]
    except ImportError as e:
        return {}, f"libCacheSim not importable ({e})"
    blocks = trace.blocks.tolist()
    touches = len(blocks)
    out: dict[str, list[dict[str, Any]]] = {}
    for algo in algos:
        pts = []
        for share, cap in zip(shares, _caps(trace, shares), strict=True):
            cache = getattr(lcs, algo)(cache_size=cap)
            req = lcs.Request()
            req.obj_size = 1
            get = cache.get
            hits = 0
            for b in blocks:
                req.obj_id = b
                hits += get(req)
            pts.append({"share": share, "capacity_blocks": cap,
                        "block_hit_ratio": hits / touches if touches else 0.0})  # fmt: skip
        out[f"libcachesim-{algo.lower()}"] = pts
    return out, ""


def vllm_offload_curves(
    trace: Trace, shares: Sequence[float], runs: Sequence[tuple[str, int]] = VLLM_RUNS
) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Block hit ratio of vLLM's CPU offloading manager (each cache policy and
    store_threshold of ``runs``) at each capacity, and a note (empty, or why not)."""
    from kvlife.interpreters import ROOT, vllm_python

    try:
        python = vllm_python()
    except KVLifeError as e:
        return {}, str(e)
    offs = trace.offsets.tolist()
    blocks = trace.blocks.tolist()
    caps = _caps(trace, shares)
    spec = {
        "requests": [blocks[offs[r] : offs[r + 1]] for r in range(trace.n_requests)],
        "block_tokens": trace.block_tokens,
        "runs": [
            {"name": _name(pol, th), "policy": pol, "store_threshold": th, "capacity": cap,
             "share": share}
            for pol, th in runs
            for share, cap in zip(shares, caps, strict=True)
        ],
    }  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="kvlife-vllm-offload-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        proc = subprocess.run(
            [python, "-m", "kvlife.bench.vllm_offload_runner", str(spec_path), str(out_path)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            return {}, f"vLLM offloading runner failed: {proc.stderr.strip()[-2000:]}"
        result = json.loads(out_path.read_text(encoding="utf-8"))
    out: dict[str, list[dict[str, Any]]] = {}
    for run in result["runs"]:
        out.setdefault(run["name"], []).append(
            {
                "share": run["share"],
                "capacity_blocks": run["capacity"],
                "block_hit_ratio": run["hits"] / run["touches"] if run["touches"] else 0.0,
                "prefix_hit_ratio": (
                    run["prefix_hits"] / run["touches"] if run["touches"] else 0.0
                ),
                "stores_skipped": run["stores_skipped"],
                "vllm_version": result["vllm_version"],
            }
        )
    return out, ""


def _name(policy: str, threshold: int) -> str:
    return f"vllm-{policy}" + (f"-store{threshold}" if threshold > 1 else "")
