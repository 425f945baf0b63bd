"""``kvlife bench transforms``: encode/decode speed, bits per element and ratio of each transform.

For fp16 (or, with ``--dtype float32``, fp32) KV chunks of 2 MiB and 16 MiB (fp16 sizes),
shaped ``(layers, 2, kv_heads, tokens, head_dim)``,
and two kinds of data, each transform's encode and decode (into a preallocated buffer,
payload verification included) is timed as the median of a few repetitions, next to a
numpy memcpy of the same chunk in the same run. Speeds are GB/s of the uncompressed chunk.

Data: ``normal`` is i.i.d. standard normal (the worst case for a compressor: its low
mantissa bytes are random); ``kv-like`` is smooth along tokens (a random walk, as
neighbouring tokens' keys and values are correlated) with a few outlier key channels,
a stand-in until real model KV is measured (issue 12's quality experiment).

Target (issue 12): >= 1 GB/s encode and decode for int8/int4 and lossless. Sparse rows
use the fallback importance proxy (key norms; no engine attention in a benchmark). A
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kvlife.report import format_table
from kvlife.transforms import decode, make_transform
from kvlife.transforms.base import Param

TARGET_GBPS = 1.0
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "2MiB": (8, 2, 8, 128, 64),
    "16MiB": (16, 2, 8, 512, 64),
}
QUICK_SHAPES: dict[str, tuple[int, int, int, int, int]] = {"tiny": (2, 2, 2, 32, 16)}
CONFIGS: list[tuple[str, str, dict[str, Param]]] = [
    ("exact", "exact", {}),
    ("lossless-zstd1", "lossless", {"codec": "zstd", "level": 1}),
    ("lossless-lz4", "lossless", {"codec": "lz4"}),
    ("int8", "int8", {}),
    ("int4-g32", "int4", {}),
    ("int2-g32", "int2", {}),
    ("int2-kitty25-sink4", "int2", {"key_hi_fraction": 0.25, "sink_tokens": 4}),
    (
        "int4-tuned",
        "int4",
        {
            "key_group": 128,
            "value_group": 64,
            "value_sym": True,
            "sink_tokens": 4,
            "key_hi_fraction": 0.0625,
            "key_hi_bits": 8,
        },
    ),
    ("sparse-50-knorm", "sparse", {"keep_ratio": 0.5}),
    ("sparse-25-knorm", "sparse", {"keep_ratio": 0.25}),
]


def make_data(
    kind: str, shape: tuple[int, ...], seed: int = 0, dtype: str = "float16"
) -> NDArray[np.floating]:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    x = np.cumsum(rng.standard_normal(shape, dtype=np.float32), axis=3) * 0.05
    x[:, 0, :, :, ::8] *= 6.0  # outlier key channels, as seen in real models' keys
    return x.astype(dtype)


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm (numba compile, page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_transforms_bench(
    *, quick: bool = False, reps: int = 5, dtype: str = "float16"
) -> dict[str, object]:
    shapes = QUICK_SHAPES if quick else SHAPES
    reps = 1 if quick else reps
    points: list[dict[str, object]] = []
    for size, shape in shapes.items():
        for kind in ("normal", "kv-like"):
            x = make_data(kind, shape, dtype=dtype)
            out = np.empty_like(x)
            gb = x.nbytes / 1e9
            t_copy = _median_s(lambda: np.copyto(out, x), reps)  # noqa: B023
            for label, name, params in CONFIGS:
                t = make_transform(name, params)
                enc = t.encode(x)
                t_enc = _median_s(lambda: t.encode(x), reps)  # noqa: B023
                t_dec = _median_s(lambda: decode(enc, out), reps)  # noqa: B023
                points.append(
                    {
                        "chunk": size,
                        "shape": list(shape),
                        "data": kind,
                        "transform": label,
                        "name": name,
                        "params": params,
                        "exactness": t.exactness.value,
                        "encode_gbps": gb / t_enc,
                        "decode_gbps": gb / t_dec,
                        "memcpy_gbps": gb / t_copy,
                        "bits_per_element": enc.bits_per_element,
                        "ratio": x.nbytes / enc.nbytes,
                    }
                )
    return {
        "benchmark": "transforms",
        "dtype": dtype,
        "reps": reps,
        "target_gbps": TARGET_GBPS,
        "points": points,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvlife bench transforms", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--quick", action="store_true", help="one tiny chunk, one repetition (tests)")
    p.add_argument("--dtype", choices=["float16", "float32"], default="float16", help="KV dtype")
    args = p.parse_args(argv)
    result = run_transforms_bench(quick=args.quick, reps=args.reps, dtype=args.dtype)
    rows = []
    points = result["points"]
    assert isinstance(points, list)
    for pt in points:
        rows.append(
            [
                str(pt["chunk"]),
                str(pt["data"]),
                str(pt["transform"]),
                f"{pt['encode_gbps']:.2f}",
                f"{pt['decode_gbps']:.2f}",
                f"{pt['memcpy_gbps']:.1f}",
                f"{pt['bits_per_element']:.2f}",
                f"{pt['ratio']:.2f}",
            ]
        )
    headers = [
        "chunk",
        "data",
        "transform",
        "enc GB/s",
        "dec GB/s",
        "memcpy GB/s",
        "bits/el",
        "ratio",
    ]
    print(format_table(headers, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
