"""Object size: what the chunk size costs and saves, and which size the planner would pick.

``kvlife experiment object-size --json F --plot F.png`` sweeps the chunk size (tokens per
stored object, 16 to 1,024) on the disk tier of an embedded :class:`~kvlife.store.KVStore`
(a disk-only chain, no promotion) with SmolLM2-135M-sized KV (23,040 bytes per token in
fp16; ``--quick``: a tiny layout and a short prompt). Per size it measures:

- **load throughput**: bytes per second of a verified ``load`` of one prompt's chunks
  (8,192 tokens by default; best of ``repeats``), the arrays checked bit for bit once;
- **lookup cost** per prompt (median of ``repeats`` lookups of the stored prompt);
- **metadata bytes per token**: what the store keeps per chunk besides the KV itself:
  the disk catalog's growth (SQLite database and WAL after a flush), each frame's header
  and padding (:func:`kvlife.tiers.disk.frame.frame_room` less the payload: the most a
  frame takes, the zeros that align a large payload included), and the
  resident bookkeeping of the process (``tracemalloc``'s growth over the put, the KV
  arrays themselves allocated before it started), both over the put of a second prompt
  so that buffers the tier keeps after its first writes are not counted;
- **hit loss** on the Mooncake conversation trace (512-token blocks) from coarser
  chunks, by replay (:func:`trace_hit_ratio`; the rule is in its docstring). Chunks finer
  than the trace's 512-token block cannot be derived from it: their hit ratio is
  reported as that of 512 (a lower bound: finer chunks can only hit more).

:func:`choose_sizes` then asks the planner's cost model (:mod:`kvlife.planner.cost`) per
tier for the size that minimises predicted load time per token plus the lookup overhead
per token, among the sizes whose hit loss is within ``max_hit_loss`` (within ``TIE`` of the
least predicted time, the finest such size): the measured disk
(a :class:`~kvlife.planner.cost.TierCost` calibrated per size from a one-chunk and a
whole-prompt load, so per-chunk costs are in its slope) and the field tiers of the
crossover experiment (their documented bandwidth and latency, one request per chunk with
``FIELD_DEPTH`` in flight). The figures come from a shared machine: indicative only.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, ChunkKey, KVLayout, ModelIdentity
from kvlife.core.objects import TierName
from kvlife.planner import CostModel, PrefillProfile
from kvlife.results import ChunkHit

TRACE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")
TRACE_BLOCK = 512
"""Tokens per block of the Mooncake trace's ``hash_ids``."""
FIELD_DEPTH = 8
"""Chunk reads in flight on a field tier: each chunk is one request whose latency is paid
once per ``FIELD_DEPTH`` chunks."""
TIE = 0.01
"""Predicted times within this fraction of the best are a tie (the finest size wins)."""
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16")
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")


@dataclass(frozen=True, slots=True)
class ObjectSizeConfig:
    """What the experiment sweeps."""

    sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    """Tokens per chunk."""
    prompt_tokens: int = 8192
    """Tokens of the prompt stored, looked up and loaded at each size."""
    layout: str = "smollm2"
    """``smollm2`` (23,040 B of KV per token) or ``tiny`` (128 B, for tests)."""
    repeats: int = 3
    trace: str = str(TRACE)
    """The Mooncake trace (JSONL with ``input_length`` and ``hash_ids``); '' skips replay."""
    trace_requests: int = 0
    """Requests of the trace replayed (0: all)."""
    max_hit_loss: float = 0.02
    """Largest hit loss (fraction of the 512-token hit ratio) a chosen size may cost."""
    seed: int = 0


def _identity(cfg: ObjectSizeConfig, size: int) -> ModelIdentity:
    shape = SMOLLM2 if cfg.layout == "smollm2" else TINY
    layout = KVLayout(tokens_per_chunk=size, **shape)  # type: ignore[arg-type]
    return ModelIdentity(
        model_id=f"object-size ({cfg.layout} layout, synthetic KV)",
        weights_digest="object-size-v1",
        tokenizer_digest="object-size-tok-v1",
        layout=layout,
    )


def _dir_bytes(path: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def measure_size(cfg: ObjectSizeConfig, size: int, tmp: Path) -> dict[str, Any]:
    """Store, look up and load one prompt in chunks of ``size`` tokens on a fresh
    disk-only store; returns the measurements of that size."""
    from kvlife.store import KVStore, StoreConfig, TierSpec
    from kvlife.tiers.disk.frame import frame_room

    identity = _identity(cfg, size)
    lay = identity.layout
    n = cfg.prompt_tokens - cfg.prompt_tokens % size
    chunks = n // size
    if chunks < 2:
        raise InvalidArgument(f"prompt of {cfg.prompt_tokens} tokens holds < 2 chunks of {size}")
    rng = np.random.default_rng(cfg.seed + size)
    tokens = rng.integers(0, 49_152, n).tolist()
    shape = (lay.num_layers, 2, lay.num_kv_heads, n, lay.head_dim)
    kv = rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.float16)
    payload = lay.chunk_nbytes
    spec = TierSpec("disk", "disk", n * lay.bytes_per_token * 3 + (256 << 20))
    where = tmp / f"store-{size}"
    store = KVStore(where, StoreConfig(tiers=(spec,), promote_on_hit=False))
    try:
        # a first prompt, untraced, so buffers the tier keeps for its writes exist before
        # the traced put: what grows over the second is per-chunk bookkeeping
        warm = rng.integers(0, 49_152, n).tolist()
        store.put_prompt(identity, PUBLIC, warm, kv)
        store.flush()
        catalog0 = _dir_bytes(where, "catalog.sqlite*")
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        put = store.put_prompt(identity, PUBLIC, tokens, kv)
        put_s = time.perf_counter() - t0
        store.flush()
        gc.collect()
        resident = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        catalog = _dir_bytes(where, "catalog.sqlite*") - catalog0
        lookups = []
        found = None
        for _ in range(max(cfg.repeats, 3)):
            t0 = time.perf_counter()
            found = store.lookup(identity, PUBLIC, tokens)
            lookups.append(time.perf_counter() - t0)
        assert found is not None
        if len(found.hits) != chunks:
            raise RuntimeError(f"size {size}: {len(found.hits)} of {chunks} chunks found")
        loads, one = [], []
        for r in range(cfg.repeats):
            t0 = time.perf_counter()
            got = store.load(found)
            loads.append(time.perf_counter() - t0)
            if got.loaded != chunks:
                raise RuntimeError(f"size {size}: loaded {got.loaded} of {chunks} chunks")
            if r == 0:  # the store verified each chunk; check the bytes once more
                for i, arr in enumerate(got.arrays):
                    want = kv[:, :, :, i * size : (i + 1) * size, :]
                    if not np.array_equal(arr.view(np.uint16), want.view(np.uint16)):
                        raise RuntimeError(f"size {size}: chunk {i} differs from what was put")
            del got
            t0 = time.perf_counter()
            store.load(found.sub(0, 1))
            one.append(time.perf_counter() - t0)
        stored = sum(h.stored_nbytes for h in found.hits)
        direct = bool(getattr(store.tier("disk"), "direct_io", False))
    finally:
        store.close(flush=False)
    load_s = min(loads)
    framing = frame_room(payload) - payload
    return {
        "tokens_per_chunk": size,
        "chunks": chunks,
        "prompt_tokens": n,
        "chunk_payload_bytes": payload,
        "stored_bytes": stored,
        "put_stored": put.stored,
        "put_s": put_s,
        "direct_io": direct,
        "load_s": load_s,
        "load_one_chunk_s": min(one),
        "load_bytes_per_s": n * lay.bytes_per_token / load_s,
        "lookup_s": statistics.median(lookups),
        "lookup_s_per_chunk": statistics.median(lookups) / chunks,
        "metadata": {
            "catalog_bytes_per_token": catalog / n,
            "frame_overhead_bytes_per_token": framing / size,
            "resident_bytes_per_token": resident / n,
            "total_bytes_per_token": (catalog + framing * chunks + resident) / n,
            "kv_bytes_per_token": lay.bytes_per_token,
        },
    }


# ---------------------------------------------------------------------- trace replay


def trace_hit_ratio(requests: Sequence[tuple[int, Sequence[int]]], blocks_per_chunk: int) -> float:
    """Hit ratio (hit tokens / input tokens) of an unbounded prefix cache whose objects
    are chunks of ``blocks_per_chunk`` trace blocks, replaying ``(input_length,
    hash_ids)`` in order.

    The rule: a request stores every *full* chunk of its prompt (chunk ``j`` covers blocks
    ``[j*k, (j+1)*k)`` and is stored only if the prompt has all ``(j+1)*k*512`` tokens; a
    trailing partial chunk never is, as kvlife stores only full chunks). A chunk is named
    by its whole prefix of block hashes, so a chunk of k blocks hits only if all its k
    blocks are reusable (and every chunk before it hits: prefix reuse); the request's hit
    tokens are its leading run of hit chunks times the chunk's tokens. Capacity is
    unbounded: the loss measured is the granularity's alone.
    """
    if blocks_per_chunk < 1:
        raise InvalidArgument(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    k = blocks_per_chunk
    tokens = k * TRACE_BLOCK
    stored: set[tuple[int, ...]] = set()
    hit = total = 0
    for length, ids in requests:
        total += length
        full = min(length // tokens, len(ids) // k)
        keys = [tuple(ids[: (j + 1) * k]) for j in range(full)]
        run = 0
        for key in keys:
            if key not in stored:
                break
            run += 1
        hit += run * tokens
        stored.update(keys)
    return hit / max(total, 1)


def read_trace(path: Path, limit: int = 0) -> list[tuple[int, list[int]]]:
    out = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            out.append((int(rec["input_length"]), [int(x) for x in rec["hash_ids"]]))
            if limit and len(out) >= limit:
                break
    return out


def hit_loss(cfg: ObjectSizeConfig) -> dict[str, Any]:
    """Per size, the trace's hit ratio and its loss against 512-token chunks."""
    if not cfg.trace or not Path(cfg.trace).exists():
        return {"trace": cfg.trace, "available": False, "sizes": {}}
    reqs = read_trace(Path(cfg.trace), cfg.trace_requests)
    base = trace_hit_ratio(reqs, 1)
    sizes: dict[str, Any] = {}
    for size in cfg.sizes:
        if size % TRACE_BLOCK == 0:
            ratio = trace_hit_ratio(reqs, size // TRACE_BLOCK)
            derived = True
        else:
            ratio, derived = base, False  # finer than a block: not derivable
        sizes[str(size)] = {
            "hit_ratio": ratio,
            "hit_loss": 1.0 - ratio / base if base > 0 else 0.0,
            "derived": derived,
        }
    return {
        "trace": cfg.trace,
        "available": True,
        "requests": len(reqs),
        "block_tokens": TRACE_BLOCK,
        "finer_than_block": "not derivable from the trace: reported as 512's (a lower bound)",
        "hit_ratio_512": base,
        "sizes": sizes,
    }


# ---------------------------------------------------------------------- the choice


def _hits(chunks: int, nbytes: int, tier: str) -> list[ChunkHit]:
    return [
        ChunkHit(
            index=i,
            key=ChunkKey(i.to_bytes(32, "big")),
            start=i,
            tier=TierName(tier),
            stored_nbytes=nbytes,
        )
        for i in range(chunks)
    ]


def choose_sizes(
    rows: Sequence[dict[str, Any]],
    loss: dict[str, Any],
    max_hit_loss: float,
    kv_bytes_per_token: int,
) -> dict[str, Any]:
    """Per tier, the predicted seconds per token of each size (load + lookup) and the
    size the planner's cost model would choose among those within ``max_hit_loss``."""
    from kvlife.experiments.crossover import FIELD_TIERS, PCIE5_X16

    flat = PrefillProfile(0.0, 0.0, 0.0)  # no prefill in this choice: loads only
    allowed = {
        r["tokens_per_chunk"]
        for r in rows
        if loss["sizes"].get(str(r["tokens_per_chunk"]), {}).get("hit_loss", 0.0) <= max_hit_loss
    }
    out: dict[str, Any] = {}

    def pick(name: str, per_token: dict[int, float], note: str) -> None:
        ok = {s: v for s, v in per_token.items() if s in allowed}
        best = min(ok.values(), default=0.0)
        # within TIE of the best the finest size wins: finer chunks can only hit more,
        # and a difference that small is the noise of a shared machine's lookups
        near = [s for s, v in ok.items() if v <= best * (1 + TIE)]
        out[name] = {
            "seconds_per_token": {str(s): v for s, v in per_token.items()},
            "best_seconds_per_token": best,
            "chosen": min(near) if near else None,
            "model": note,
        }

    disk: dict[int, float] = {}
    for r in rows:
        model = CostModel(flat, r["tokens_per_chunk"])
        cost = model.tier("disk")
        per_chunk = r["stored_bytes"] // r["chunks"]
        cost.calibrate((per_chunk, r["load_one_chunk_s"]), (r["stored_bytes"], r["load_s"]))
        hits = _hits(r["chunks"], per_chunk, "disk")
        disk[r["tokens_per_chunk"]] = (model.load_seconds(hits) + r["lookup_s"]) / r[
            "prompt_tokens"
        ]
    pick("disk (measured)", disk, "TierCost calibrated per size from a 1-chunk and a full load")
    for tier in FIELD_TIERS:
        per: dict[int, float] = {}
        for r in rows:
            size = r["tokens_per_chunk"]
            model = CostModel(flat, size)
            cost = model.tier("field")
            cost.latency_s = tier.latency_s
            cost.per_byte.seed(1.0 / min(tier.bytes_per_s, PCIE5_X16))
            framing = r["stored_bytes"] // r["chunks"] - r["chunk_payload_bytes"]
            per_chunk = size * kv_bytes_per_token + framing
            hits = _hits(r["chunks"], per_chunk, "field")
            waves = -(-r["chunks"] // FIELD_DEPTH)
            seconds = model.load_seconds(hits) + (waves - 1) * tier.latency_s + r["lookup_s"]
            per[size] = seconds / r["prompt_tokens"]
        pick(
            tier.name,
            per,
            f"{tier.source}; latency {tier.latency_s * 1e6:.0f} us per {FIELD_DEPTH} chunks",
        )
    return {"max_hit_loss": max_hit_loss, "allowed_sizes": sorted(allowed), "tiers": out}


def run(cfg: ObjectSizeConfig, progress: bool = True) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvlife-objsize-") as tmp:
        for size in cfg.sizes:
            row = measure_size(cfg, size, Path(tmp))
            rows.append(row)
            if progress:
                print(
                    f"{size:5d} tokens/chunk: load {row['load_bytes_per_s'] / 1e6:8.1f} MB/s, "
                    f"lookup {row['lookup_s'] * 1e3:7.2f} ms/prompt, metadata "
                    f"{row['metadata']['total_bytes_per_token']:7.1f} B/token",
                    file=sys.stderr,
                    flush=True,
                )
    loss = hit_loss(cfg)
    kvb = 2 * 32 * 8 * 128 * 2  # Llama-3-8B in bf16, as the crossover's field table
    return {
        "config": asdict(cfg),
        "kv_bytes_per_token": _identity(cfg, cfg.sizes[0]).layout.bytes_per_token,
        "rows": rows,
        "hit_loss": loss,
        "choice": choose_sizes(rows, loss, cfg.max_hit_loss, kvb),
        "note": "measured on a shared machine: indicative figures",
    }


def table(result: dict[str, Any]) -> str:
    loss = result["hit_loss"]["sizes"]
    lines = [
        "| tokens/chunk | load MB/s | lookup ms/prompt | metadata B/token (catalog + frame"
        " + resident) | trace hit ratio | hit loss |",
        "|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        s = str(r["tokens_per_chunk"])
        m = r["metadata"]
        h = loss.get(s)
        hr = f"{h['hit_ratio']:.4f}" + ("" if h["derived"] else " (=512)") if h else "n/a"
        hl = f"{h['hit_loss'] * 100:.2f}%" if h and h["derived"] else "n/a"
        lines.append(
            f"| {s} | {r['load_bytes_per_s'] / 1e6:.0f} | {r['lookup_s'] * 1e3:.2f} | "
            f"{m['total_bytes_per_token']:.1f} ({m['catalog_bytes_per_token']:.1f} + "
            f"{m['frame_overhead_bytes_per_token']:.1f} + {m['resident_bytes_per_token']:.1f})"
            f" | {hr} | {hl} |"
        )
    lines.append("")
    lines.append("| tier | chosen tokens/chunk |")
    lines.append("|---|---:|")
    for name, t in result["choice"]["tiers"].items():
        lines.append(f"| {name} | {t['chosen']} |")
    return "\n".join(lines)


def plot_png(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["tokens_per_chunk"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    axes[0].plot(xs, [r["load_bytes_per_s"] / 1e6 for r in rows], "o-")
    axes[0].set_ylabel("verified load MB/s (disk)")
    axes[1].plot(xs, [r["lookup_s"] * 1e3 for r in rows], "s-")
    axes[1].set_ylabel("lookup ms per prompt")
    for key, style in (
        ("catalog_bytes_per_token", "o-"),
        ("frame_overhead_bytes_per_token", "s-"),
        ("resident_bytes_per_token", "^-"),
        ("total_bytes_per_token", "k:"),
    ):
        axes[2].plot(xs, [max(r["metadata"][key], 1e-3) for r in rows], style, label=key[:-16])
    axes[2].set_yscale("log")
    axes[2].set_ylabel("metadata bytes per token")
    axes[2].legend(fontsize=7)
    loss = result["hit_loss"]["sizes"]
    lx = [r["tokens_per_chunk"] for r in rows if loss.get(str(r["tokens_per_chunk"]))]
    axes[3].plot(lx, [loss[str(s)]["hit_ratio"] for s in lx], "o-")
    axes[3].set_ylabel("Mooncake trace hit ratio (<512: =512)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per chunk")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"object size, {result['config']['layout']} layout (shared machine: indicative)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment object-size",
        description="Chunk size against load throughput, lookup cost, metadata bytes and "
        "the Mooncake trace's hit loss, on the disk tier; the size the planner would choose.",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write a PNG of the four measures")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny layout, a 2,048-token prompt, the first 2,000 requests of the trace",
    )
    parser.add_argument("--sizes", default=None, help="comma-separated tokens per chunk")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", default=str(TRACE), help="Mooncake JSONL trace ('' skips)")
    parser.add_argument("--max-hit-loss", type=float, default=0.02)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = ObjectSizeConfig(repeats=args.repeats, trace=args.trace, max_hit_loss=args.max_hit_loss)
    if args.quick:
        cfg = replace(cfg, layout="tiny", prompt_tokens=2048, repeats=2, trace_requests=2000)
    if args.sizes:
        cfg = replace(cfg, sizes=tuple(int(x) for x in args.sizes.split(",")))
    if args.prompt_tokens:
        cfg = replace(cfg, prompt_tokens=args.prompt_tokens)
    result = run(cfg, progress=not args.no_progress)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    if args.plot:
        plot_png(result, Path(args.plot))
    print(table(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
