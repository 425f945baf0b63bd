"""``kvlife bench io``'s lookup: the time of :meth:`~kvlife.store.KVStore.lookup` of a
128-chunk prompt held in DRAM, BLAKE3 chunk keys included, and its ratio to the keys
alone (timed in turn with it, iteration by iteration)."""

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


def once(fn: Callable[[], object]) -> float:
    """Microseconds one call of ``fn`` takes."""
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


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
        for i in range(iters + min(10, iters)):  # interleaved: noise hits both alike
            lk = once(lambda: store.lookup(identity, PUBLIC, tokens))
            k = once(lambda: prompt_chunk_keys(identity, PUBLIC, tokens))
            if i >= min(10, iters):  # the first ones warm up
                look.append(lk)
                keys.append(k)
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
        "vs_keys": _median([lk / k for lk, k in zip(look, keys, strict=True)]),
        "tokens_as_list_median_us": _median(look_list),
    }
