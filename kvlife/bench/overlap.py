"""``kvlife bench async``: an engine that works on chunk i while chunks after it load.

One prompt of C chunks lives on the disk tier. The consumer spends a fixed CPU cost per
chunk (a numpy kernel that releases the GIL, calibrated to about one chunk's load time).
Measured, each as the median of a few repetitions in one run:

- ``load``: the synchronous load alone; ``compute``: the C compute steps alone;
- ``sync``: ``load()`` then every compute step (no overlap: about load + compute);
- ``async``: ``load_async()``, then for each chunk ``handle.chunk(i)`` and its compute.

Target (issue 8): async wall time <= 1.1 x max(load, compute). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
from kvlife.report import format_table
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty

MiB = 1 << 20
TARGET = 1.1


def _median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_overlap_bench(
    *, tokens_per_chunk: int = 128, chunks: int = 16, reps: int = 5, directory: Path | None = None
) -> dict[str, object]:
    parent = directory if directory is not None else Path.cwd()
    work = Path(tempfile.mkdtemp(prefix=".kvlife-bench-async-", dir=parent))
    layout = KVLayout(8, 8, 64, "float16", tokens_per_chunk)
    ident = ModelIdentity("bench", "w", "t", layout)
    rng = np.random.default_rng(0)
    n = chunks * tokens_per_chunk
    tokens = rng.integers(0, 50_000, n, dtype=np.int64)
    kv = rng.standard_normal((8, 2, 8, n, 64), dtype=np.float32).astype(np.float16)
    bufs = [
        aligned_empty(layout.chunk_nbytes).view(np.float16).reshape(layout.chunk_shape)
        for _ in range(chunks)
    ]
    try:
        with KVStore.open(work, dram_bytes=0, disk_bytes=8 << 30) as store:
            store.put_prompt(ident, PUBLIC, tokens, kv)
            hit = store.lookup(ident, PUBLIC, tokens)

            def load() -> object:
                res = store.load(hit, bufs)
                assert res.loaded == chunks
                return res

            load()  # warm
            t_load = _median_time(load, reps)
            # One GIL-releasing kernel per chunk, sized to about one chunk's load time, as
            # an engine's per-chunk work is a few large kernels (attention, matmuls).
            per_chunk = t_load / chunks
            size = 1 << 16
            probe = np.random.default_rng(1).random(size)
            t_probe = _median_time(lambda: np.sqrt(probe).sum(), 20)
            size = max(1 << 10, int(size * per_chunk / max(t_probe, 1e-9)))
            work_arr = np.random.default_rng(1).random(size)
            scratch = np.empty_like(work_arr)

            def compute(_: object) -> None:
                np.sqrt(work_arr, out=scratch)

            def compute_all() -> None:
                for i in range(chunks):
                    compute(i)

            t_compute = _median_time(compute_all, reps)

            def sync() -> None:
                res = store.load(hit, bufs)
                for a in res.arrays:
                    compute(a)

            def overlapped() -> None:
                handle = store.load_async(hit, bufs)
                for i in range(chunks):
                    arr = handle.chunk(i)
                    assert arr is not None
                    compute(arr)
                assert handle.wait().loaded == chunks

            t_sync = _median_time(sync, reps)
            t_async = _median_time(overlapped, reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bound = max(t_load, t_compute)
    return {
        "benchmark": "async",
        "chunk_bytes": layout.chunk_nbytes,
        "chunks": chunks,
        "reps": reps,
        "seconds": {"load": t_load, "compute": t_compute, "sync": t_sync, "async": t_async},
        "async_vs_max": t_async / bound,
        "sync_vs_sum": t_sync / (t_load + t_compute),
        "target_async_vs_max": TARGET,
    }


def format_report(r: dict[str, object]) -> str:
    s = r["seconds"]
    assert isinstance(s, dict)
    rows = [[k, f"{v * 1e3:.1f}"] for k, v in s.items()]
    text = format_table(["phase", "ms (median)"], rows)
    return text + (
        f"\nasync / max(load, compute) = {r['async_vs_max']:.2f} (target <= {TARGET}); "
        f"sync / (load + compute) = {r['sync_vs_sum']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench async", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--dir", type=Path)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    args = p.parse_args(argv)
    kw: dict[str, object] = {"chunks": args.chunks, "directory": args.dir}
    if args.quick:
        kw.update(tokens_per_chunk=8, chunks=4, reps=2)
    result = run_overlap_bench(**kw)  # type: ignore[arg-type]
    print(format_report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
