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

Parity rows (``parity-K+M``, :mod:`kvlife.transforms.parity`, pyeclib ``isa_l_rs_vand``):
encode splits the chunk into K data and M parity fragments; decode gives the chunk back
from K fragments with data fragment 0 lost (a real reconstruction, not the systematic
copy). Their bits per element count every fragment (the redundancy), so the ratio is
below 1. ``parity_files`` times the segment-file path the store uses at close and open
(:func:`~kvlife.transforms.parity.protect_files` over K files of 16 MiB, fsync included,
then :func:`~kvlife.transforms.parity.rebuild_files` of one deleted file), in GB/s of
protected (or rebuilt) file bytes, page cache warm.

Chunks are encoded as a chunk not at the sequence start (``start`` = its tokens), as
most of a long sequence's chunks are: the quantisers keep sink tokens only in the chunk
holding the sequence's first tokens. ``bits_by_chunk`` gives, for each quantiser and
SmolLM2-135M's chunk shape ``(30, 2, 3, tokens, 64)`` at 64, 256 and 512 tokens, the
bits per element of real encoded frames (payload, descriptor, frame header) for the
chunk at the sequence start and for a later one.

Target (issue 12): >= 1 GB/s encode and decode for int8/int4 and lossless. Sparse rows
use the fallback importance proxy (key norms; no engine attention in a benchmark). A
benchmark, not a test.
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
from numpy.typing import NDArray

from kvlife.report import format_table
from kvlife.transforms import decode, make_transform
from kvlife.transforms.base import Param
from kvlife.transforms.parity import ParityCode, ParityError, protect_files, rebuild_files
from kvlife.transforms.quant import INT2_TUNED, INT4_TUNED

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
    ("int2-kitty25-sink4", "int2", INT2_TUNED),
    ("int4-tuned", "int4", INT4_TUNED),
    ("sparse-50-knorm", "sparse", {"keep_ratio": 0.5}),
    ("sparse-25-knorm", "sparse", {"keep_ratio": 0.25}),
]
BITS_TOKENS = (64, 256, 512)
"""Chunk sizes of ``bits_by_chunk`` (64: the vLLM connector's and the demo's)."""
SMOLLM2_CHUNK = (30, 2, 3, 0, 64)
"""SmolLM2-135M's chunk shape, tokens left open."""
PARITY_CONFIGS: list[tuple[str, int, int]] = [("parity-4+2", 4, 2), ("parity-8+3", 8, 3)]
"""(label, k, m) of the erasure-coding rows."""


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
            start = shape[3]  # a chunk not at the sequence start
            for label, name, params in CONFIGS:
                t = make_transform(name, params)
                enc = t.encode(x, start=start)
                t_enc = _median_s(lambda: t.encode(x, start=start), reps)  # noqa: B023
                t_dec = _median_s(lambda: decode(enc, out), reps)  # noqa: B023
                points.append(
                    {
                        "chunk": size,
                        "shape": list(shape),
                        "start": start,
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
            points += _parity_points(size, shape, kind, x, t_copy, reps)
    return {
        "benchmark": "transforms",
        "dtype": dtype,
        "reps": reps,
        "target_gbps": TARGET_GBPS,
        "points": points,
        "bits_by_chunk": bits_by_chunk(BITS_TOKENS[:1] if quick else BITS_TOKENS, dtype),
        "parity_files": _parity_files(64 << 10 if quick else 16 << 20, reps),
    }


def bits_by_chunk(tokens: tuple[int, ...], dtype: str = "float16") -> list[dict[str, object]]:
    """Bits per element of real quantiser frames of SmolLM2's chunk shape (kv-like data),
    for the chunk at the sequence start (which holds the sinks) and a later one."""
    out: list[dict[str, object]] = []
    for n in tokens:
        shape = (*SMOLLM2_CHUNK[:3], n, SMOLLM2_CHUNK[4])
        x = make_data("kv-like", shape, dtype=dtype)
        for label, name, params in CONFIGS:
            if name not in ("int8", "int4", "int2"):
                continue
            t = make_transform(name, params)
            first, later = t.encode(x, start=0), t.encode(x, start=n)
            out.append(
                {
                    "transform": label,
                    "name": name,
                    "params": params,
                    "chunk_tokens": n,
                    "shape": list(shape),
                    "bits_first": first.bits_per_element,
                    "bits_later": later.bits_per_element,
                }
            )
    return out


def _parity_files(file_bytes: int, reps: int) -> list[dict[str, object]]:
    """Protect K files and rebuild one of them, as the store does with segment files."""
    out: list[dict[str, object]] = []
    root = Path(tempfile.mkdtemp(prefix="kvlife-bench-parity-"))
    try:
        rng = np.random.default_rng(1)
        for label, k, m in PARITY_CONFIGS:
            data = root / label / "seg"
            data.mkdir(parents=True)
            files = []
            for i in range(k):
                f = data / f"seg-{i + 1:08d}.kvs"
                f.write_bytes(rng.bytes(file_bytes))
                files.append(f)
            want = files[0].read_bytes()
            t_protect, t_rebuild = [], []
            try:
                for r in range(max(reps, 1)):
                    pdir = root / label / f"par{r}"
                    t0 = time.perf_counter()
                    group = protect_files(files, pdir, "g", k=k, m=m)
                    t_protect.append(time.perf_counter() - t0)
                    files[0].unlink()
                    t0 = time.perf_counter()
                    rebuild_files(group, data, pdir, [files[0].name])
                    t_rebuild.append(time.perf_counter() - t0)
                    if files[0].read_bytes() != want:
                        raise ParityError(f"{label}: a rebuilt file differs")
            except ParityError as exc:
                if "pyeclib" in str(exc):
                    return out
                raise
            out.append(
                {
                    "transform": label,
                    "k": k,
                    "m": m,
                    "file_bytes": file_bytes,
                    "protect_gbps": k * file_bytes / 1e9 / statistics.median(t_protect),
                    "rebuild_gbps": file_bytes / 1e9 / statistics.median(t_rebuild),
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _parity_points(
    size: str,
    shape: tuple[int, ...],
    kind: str,
    x: NDArray[np.float16],
    t_copy: float,
    reps: int,
) -> list[dict[str, object]]:
    gb = x.nbytes / 1e9
    data = x.tobytes()
    out: list[dict[str, object]] = []
    for label, k, m in PARITY_CONFIGS:
        try:
            code = ParityCode(k, m)
        except ParityError:  # pyeclib not installed: no parity rows
            return out
        frags = code.encode(data)
        survivors = frags[1 : k + 1]  # data fragment 0 lost
        if code.decode(survivors) != data:
            raise ParityError(f"{label}: decode did not give the chunk back")
        t_enc = _median_s(lambda: code.encode(data), reps)  # noqa: B023
        t_dec = _median_s(lambda: code.decode(survivors), reps)  # noqa: B023
        stored = sum(len(f) for f in frags)
        out.append(
            {
                "chunk": size,
                "shape": list(shape),
                "data": kind,
                "transform": label,
                "name": "parity",
                "params": {"k": k, "m": m},
                "exactness": "exact",
                "encode_gbps": gb / t_enc,
                "decode_gbps": gb / t_dec,
                "memcpy_gbps": gb / t_copy,
                "bits_per_element": 8.0 * stored / x.size,
                "ratio": x.nbytes / stored,
            }
        )
    return out


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
    bits = result["bits_by_chunk"]
    assert isinstance(bits, list)
    if bits:
        sizes = sorted({int(b["chunk_tokens"]) for b in bits})
        labels = list(dict.fromkeys(str(b["transform"]) for b in bits))
        got = {(str(b["transform"]), int(b["chunk_tokens"])): b for b in bits}
        print()
        print(
            format_table(
                ["bits/el (SmolLM2 chunk)"] + [f"{n} tok first / later" for n in sizes],
                [
                    [label]
                    + [
                        f"{got[label, n]['bits_first']:.2f} / {got[label, n]['bits_later']:.2f}"
                        for n in sizes
                    ]
                    for label in labels
                ],
            )
        )
    files = result["parity_files"]
    assert isinstance(files, list)
    if files:
        print()
        print(
            format_table(
                ["parity files", "file MiB", "protect GB/s", "rebuild GB/s"],
                [
                    [
                        str(f["transform"]),
                        f"{f['file_bytes'] / (1 << 20):.2f}",
                        f"{f['protect_gbps']:.2f}",
                        f"{f['rebuild_gbps']:.2f}",
                    ]
                    for f in files
                ],
            )
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
