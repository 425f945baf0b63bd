"""``kvlife bench ttft``: time to first token with a cached prefix, against the ideal.

For prefixes of 512, 1024, 2048 and 4096 tokens (plus a short suffix), in one run:

- full prefill: TTFT with no reuse;
- DRAM hit and disk hit: TTFT when the prefix is served by kvlife from that tier
  (lookup, verified load, injection into the model's cache, suffix prefill, argmax);
- the ideal for each tier: the suffix prefill time (the model forward on the suffix
  with the prefix already in its cache, measured inside the hit runs) plus the prefix's
  bytes at the tier's limit measured in the same run the way ``kvlife bench io`` measures
  it: numpy memcpy for DRAM, raw O_DIRECT reads of chunk-sized objects for disk.

Target: hit TTFT <= 1.2x ideal for prefixes of 1024 tokens and more. Medians of
``--repeat`` runs; the JSON holds every sample.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvlife.bench.limits import memcpy, raw_read, raw_write
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.report import format_table
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.fileio import probe_direct_io

TARGET = 1.2
TARGET_MIN_PREFIX = 1024
MiB = 1 << 20


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _limits(workdir: Path, nbytes: int, chunk_bytes: int, repeat: int) -> dict[str, float]:
    """memcpy and raw O_DIRECT read bandwidth (bytes/s) for ``nbytes`` in chunk pieces."""
    n = max(1, nbytes // chunk_bytes)
    src = [aligned_empty(chunk_bytes) for _ in range(n)]
    for i, s in enumerate(src):
        s[:] = i % 251
    dst = [aligned_empty(chunk_bytes) for _ in range(n)]
    direct = probe_direct_io(workdir)
    path = workdir / "raw-ttft.bin"
    raw_write(path, src, direct)
    copies, reads = [], []
    for _ in range(repeat):
        copies.append(memcpy(dst, src))
        reads.append(raw_read(path, dst, direct))
    path.unlink()
    total = n * chunk_bytes
    return {
        "memcpy_Bps": total / _median(copies),
        "raw_read_Bps": total / _median(reads),
        "direct_io": float(direct),
    }


def run_ttft_bench(
    *,
    prefixes: list[int],
    suffix: int,
    repeat: int,
    tiny: bool,
    workdir: Path,
    progress: bool = True,
) -> dict[str, Any]:
    from kvlife.engines.hf import HFEngine
    from kvlife.engines.models import load_smollm2, tiny_llama
    from kvlife.store import KVStore

    loaded = tiny_llama(seed=0, max_positions=8192) if tiny else load_smollm2()
    tpc = 32 if tiny else 256
    vocab = int(loaded.model.config.vocab_size)
    ns = Namespace(NamespaceKind.ORGANISATION, "bench")
    base = HFEngine.for_model(loaded, None, tokens_per_chunk=tpc)
    lay = base.identity.layout
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    dram_store = KVStore.open(workdir / "dram", dram_bytes=4 << 30, disk_bytes=0)
    disk_store = KVStore.open(workdir / "disk", dram_bytes=0, disk_bytes=8 << 30)
    engines = {
        "dram": HFEngine.for_model(loaded, dram_store, tokens_per_chunk=tpc),
        "disk": HFEngine.for_model(loaded, disk_store, tokens_per_chunk=tpc),
    }
    base.generate(rng.integers(0, vocab, 64).tolist(), ns, max_new_tokens=1)  # warm-up
    steps = len(prefixes) * repeat * 3
    with tqdm(
        total=steps,
        desc="bench ttft",
        unit="run",
        disable=not progress,
        leave=False,
        file=sys.stderr,
    ) as bar:
        for plen in prefixes:
            plen = plen // tpc * tpc
            ids = rng.integers(0, vocab, plen + suffix).tolist()
            nbytes = plen * lay.bytes_per_token
            limits = _limits(workdir, nbytes, lay.chunk_nbytes, repeat)
            row: dict[str, Any] = {
                "prefix_tokens": plen,
                "suffix_tokens": suffix,
                "prefix_bytes": nbytes,
                "limits": limits,
                "samples": {},
            }
            full = []
            for _ in range(repeat):
                full.append(base.generate(ids, ns, max_new_tokens=1).ttft_s)
                bar.update()
            row["samples"]["full_prefill_s"] = full
            for tier, eng in engines.items():
                eng.generate(ids[:plen], ns, max_new_tokens=1)  # stores the prefix chunks
                hits, suffix_s = [], []
                for _ in range(repeat):
                    turn = eng.generate(ids, ns, max_new_tokens=1, store_output=False)
                    if turn.cached_tokens != plen or set(turn.tiers) != {tier}:
                        raise RuntimeError(
                            f"{tier} run served {turn.cached_tokens} tokens from {turn.tiers}, "
                            f"expected {plen} from {tier}"
                        )
                    hits.append(turn.ttft_s)
                    suffix_s.append(turn.prefill_s)
                    bar.update()
                bw = limits["memcpy_Bps"] if tier == "dram" else limits["raw_read_Bps"]
                ideal = _median(suffix_s) + nbytes / bw
                row["samples"][f"{tier}_hit_s"] = hits
                row["samples"][f"{tier}_suffix_prefill_s"] = suffix_s
                row[f"{tier}_hit_ttft_s"] = _median(hits)
                row[f"{tier}_ideal_s"] = ideal
                row[f"{tier}_vs_ideal"] = _median(hits) / ideal
            row["full_prefill_ttft_s"] = _median(full)
            rows.append(row)
    dram_store.close()
    disk_store.close()
    targets = [
        {
            "prefix_tokens": r["prefix_tokens"],
            "tier": t,
            "ratio": r[f"{t}_vs_ideal"],
            "target": TARGET,
            "met": r[f"{t}_vs_ideal"] <= TARGET,
        }
        for r in rows
        if r["prefix_tokens"] >= TARGET_MIN_PREFIX
        for t in ("dram", "disk")
    ]
    return {
        "model": loaded.model_id,
        "tokens_per_chunk": tpc,
        "bytes_per_token": lay.bytes_per_token,
        "repeat": repeat,
        "rows": rows,
        "targets": targets,
    }


def format_report(result: dict[str, Any]) -> str:
    headers = [
        "prefix",
        "full prefill",
        "DRAM hit",
        "DRAM ideal",
        "x ideal",
        "disk hit",
        "disk ideal",
        "x ideal",
        "speedup (disk)",
    ]
    table = []
    for r in result["rows"]:
        table.append(
            [
                str(r["prefix_tokens"]),
                f"{r['full_prefill_ttft_s'] * 1e3:.0f} ms",
                f"{r['dram_hit_ttft_s'] * 1e3:.1f} ms",
                f"{r['dram_ideal_s'] * 1e3:.1f} ms",
                f"{r['dram_vs_ideal']:.2f}",
                f"{r['disk_hit_ttft_s'] * 1e3:.1f} ms",
                f"{r['disk_ideal_s'] * 1e3:.1f} ms",
                f"{r['disk_vs_ideal']:.2f}",
                f"{r['full_prefill_ttft_s'] / r['disk_hit_ttft_s']:.1f}x",
            ]
        )
    met = [t for t in result["targets"] if t["met"]]
    lines = [
        f"{result['model']}: {result['bytes_per_token']} B of KV per token, "
        f"{result['tokens_per_chunk']}-token chunks, median of {result['repeat']}",
        format_table(headers, table),
        f"target hit TTFT <= {TARGET}x ideal for prefixes >= {TARGET_MIN_PREFIX}: "
        f"{len(met)} of {len(result['targets'])} met",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife bench ttft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument(
        "--prefixes",
        default="512,1024,2048,4096",
        help="cached prefix lengths in tokens (comma separated)",
    )
    parser.add_argument("--suffix", type=int, default=64, help="uncached tokens after the prefix")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (for tests)"
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: under .)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    prefixes = [int(x) for x in args.prefixes.split(",") if x]
    workdir = Path(tempfile.mkdtemp(prefix=".kvlife-bench-ttft-", dir=args.dir or "."))
    try:
        result = run_ttft_bench(
            prefixes=prefixes,
            suffix=args.suffix,
            repeat=args.repeat,
            tiny=args.tiny,
            workdir=workdir,
            progress=not args.no_progress,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["generated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
