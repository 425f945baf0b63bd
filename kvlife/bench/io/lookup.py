"""``kvlife bench io``'s lookup: the time of :meth:`~kvlife.store.KVStore.lookup` of a
128-chunk prompt held in DRAM, BLAKE3 chunk keys included, and its ratio to the keys
alone (timed in turn with it, iteration by iteration), in wall-clock time and in the
thread's CPU time (on a shared machine the CPU time leaves out the time the thread
waited for a core; both are reported)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvlife.bench.io.config import LOOKUP_CHUNKS, IOBenchConfig, MiB
from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity, prompt_chunk_keys
from kvlife.store import KVStore


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def once(fn: Callable[[], object]) -> tuple[float, float]:
    """Microseconds one call of ``fn`` takes: wall-clock, and CPU time of this thread."""
    c0 = time.thread_time_ns()
    t0 = time.perf_counter_ns()
    fn()
    t1 = time.perf_counter_ns()
    return (t1 - t0) / 1e3, (time.thread_time_ns() - c0) / 1e3


def _paired(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the ratios, iteration by iteration (noise hits both alike); the ratio
    of the sums where no denominator measured above zero (a coarse clock)."""
    pairs = [a / b for a, b in zip(num, den, strict=True) if b > 0]
    return _median(pairs) if pairs else sum(num) / max(sum(den), 1e-9)


def bench_lookup(cfg: IOBenchConfig, workdir: Path) -> dict[str, float | int]:
    """Median time of ``KVStore.lookup`` for a 128-chunk prompt held in DRAM."""
    tpc = cfg.lookup_tokens_per_chunk
    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_chunk=tpc
    )
    identity = ModelIdentity("bench-model", "bench-weights", "bench-tokenizer", layout)
    ntok = LOOKUP_CHUNKS * tpc
    tokens = np.random.default_rng(7).integers(0, 128_000, size=ntok, dtype=np.int32)
    token_list = tokens.tolist()
    kv = np.zeros((2, 2, 2, ntok, 16), dtype=np.float16)
    dram = 2 * LOOKUP_CHUNKS * layout.chunk_nbytes + MiB
    with KVStore.open(workdir / "lookup-store", dram_bytes=dram, disk_bytes=0) as store:
        put = store.put_prompt(identity, PUBLIC, tokens, kv)
        if put.stored != LOOKUP_CHUNKS:
            raise RuntimeError(f"lookup store kept {put.stored} of {LOOKUP_CHUNKS} chunks")

        def timed(fn: Callable[[], object], iters: int) -> list[float]:
            for _ in range(min(10, iters)):
                fn()
            out = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                fn()
                out.append((time.perf_counter_ns() - t0) / 1e3)
            return out

        hit = store.lookup(identity, PUBLIC, tokens)
        if len(hit.hits) != LOOKUP_CHUNKS:
            raise RuntimeError(f"lookup found {len(hit.hits)} of {LOOKUP_CHUNKS} chunks")
        iters = cfg.lookup_iters
        look: list[float] = []
        keys: list[float] = []
        look_cpu: list[float] = []
        keys_cpu: list[float] = []
        for i in range(iters + min(10, iters)):  # interleaved: noise hits both alike
            lk, lk_cpu = once(lambda: store.lookup(identity, PUBLIC, tokens))
            k, k_cpu = once(lambda: prompt_chunk_keys(identity, PUBLIC, tokens))
            if i >= min(10, iters):  # the first ones warm up
                look.append(lk)
                keys.append(k)
                look_cpu.append(lk_cpu)
                keys_cpu.append(k_cpu)
        look_list = timed(lambda: store.lookup(identity, PUBLIC, token_list), max(iters // 3, 1))
    return {
        "chunks": LOOKUP_CHUNKS,
        "tokens_per_chunk": tpc,
        "iterations": iters,
        "median_us": _median(look),
        "p90_us": float(np.percentile(look, 90)),
        "min_us": min(look),
        "key_computation_median_us": _median(keys),
        # paired per iteration: what the lookup adds to its keys, whatever the machine
        "vs_keys": _paired(look, keys),
        # the same in this thread's CPU time (the clock ticks at the scheduler's
        # resolution on some kernels: a ratio of zero-tick keys is left out)
        "cpu_median_us": _median(look_cpu),
        "key_computation_cpu_median_us": _median(keys_cpu),
        "vs_keys_cpu": _paired(look_cpu, keys_cpu),
        "tokens_as_list_median_us": _median(look_list),
    }
