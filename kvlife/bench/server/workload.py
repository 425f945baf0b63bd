"""The chunks ``kvlife bench server`` moves: layouts by chunk size, prompts of random
fp16 bits, aligned prefaulted buffers, and a point's medians and ratios."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.tiers.buffers import aligned_empty, prefault


def chunk_layout(chunk_bytes: int) -> KVLayout:
    """8 layers x 8 KV heads x 64 dims x fp16: 16 KiB per token."""
    return KVLayout(8, 8, 64, "float16", max(1, chunk_bytes // (16 << 10)))


def bench_identity(layout: KVLayout, tag: str = "") -> ModelIdentity:
    return ModelIdentity(f"bench{tag}", "w", "t", layout)


NS = Namespace(NamespaceKind.USER, "bench")


def prompt(layout: KVLayout, n: int, seed: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, n * layout.tokens_per_chunk).tolist()
    shape = (
        layout.num_layers,
        2,
        layout.num_kv_heads,
        n * layout.tokens_per_chunk,
        layout.head_dim,
    )
    kv = rng.integers(0, 1 << 15, shape, dtype=np.uint16).view(np.float16)
    return tokens, kv


def split_chunks(kv: np.ndarray, layout: KVLayout, n: int) -> list[np.ndarray]:
    t = layout.tokens_per_chunk
    return [np.ascontiguousarray(kv[:, :, :, i * t : (i + 1) * t]) for i in range(n)]


def out_buffers(layout: KVLayout, n: int) -> list[np.ndarray]:
    outs = []
    for _ in range(n):
        buf = aligned_empty(layout.chunk_nbytes)
        prefault(buf)
        outs.append(buf.view(np.float16).reshape(layout.chunk_shape))
    return outs


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes in 4096-aligned, prefaulted memory (what O_DIRECT needs)."""
    buf = aligned_empty(a.nbytes)
    buf[:] = a.reshape(-1).view(np.uint8)
    return buf


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal (random fp16 bits include NaNs)."""
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def point(
    layout: KVLayout,
    n: int,
    served: list[float],
    limit: list[float],
    *,
    raw: bool,
    **others: list[float],
) -> dict[str, Any]:
    """A load or put point: medians of the served calls and of the limit, their ratio,
    and ``<name>gbps`` and ``ratio_<name>`` of each other series of the same bytes."""
    total = n * layout.chunk_nbytes
    s_gbps = gbps(total, float(np.median(served)))
    l_gbps = gbps(total, float(np.median(limit)))
    out: dict[str, Any] = {
        "chunk_bytes": layout.chunk_nbytes,
        "chunks_per_call": n,
        "server_gbps": s_gbps,
        ("raw_gbps" if raw else "memcpy_gbps"): l_gbps,
        "ratio": s_gbps / l_gbps,
    }
    for name, xs in others.items():
        out[f"{name}_gbps"] = gbps(total, float(np.median(xs)))
        out[f"ratio_{name}"] = out[f"{name}_gbps"] / l_gbps
    return out
