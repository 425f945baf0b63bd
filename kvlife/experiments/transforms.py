"""``kvlife experiment transforms``: what each KV transform does to a real model's output.

SmolLM2-135M-Instruct reads windows of text that ships on every Debian machine (the
licence texts in ``/usr/share/common-licenses``, one window per distinct file first).
Each window is ``stored`` prefix tokens whose KV goes through a transform, ``scored``
tokens whose next-token distributions are compared, and one more target token. Per window:

1. the exact prefill of the prefix gives its KV (float32, as the model computes it) and,
   for the sparse rows, the attention of its last ``obs`` queries (SnapKV's observation
   window) as their importance input;
2. each row encodes that KV (float32, or float16 as a serving system would hold it),
   decodes it, injects it as the cache and prefills the scored tokens (batched rows);
   the exact float32 row is the reference, run the same way;
3. per scored position: KL(reference || row) of the next-token distribution, top-1
   agreement, the target token's log-likelihood (perplexity); then ``greedy`` tokens are
   generated from the end of the window, agreement counted position by position;
4. sparse rows: recall, the share of the reference's attention mass (scored tokens'
   queries on the prefix, all layers and heads) that falls on the tokens they kept.

A row whose decoded KV is bit-identical to another row's (lossless) is not run again: its
metrics are that row's, and ``bit_exact`` says why. Bits per element are measured on the
encoded frames (payload, descriptor and frame header).

Chunk sizes: a store keeps KV in chunks of its layout's ``tokens_per_chunk`` (64 in the
vLLM connector and the demo), each encoded on its own, told its absolute start (the
quantisers keep sinks only at the sequence start). The rows above encode the whole prefix
as one chunk; every quantiser row is repeated with the prefix cut into chunks of each of
``chunk_sizes`` tokens (labelled ``@64``, ``@256``), and the tuned rows once more with
sinks at every chunk (what version-2 frames held). Each row reports bits per element over
the whole prefix and for a chunk not at the sequence start (what most of a long
sequence's chunks cost).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvlife.report import format_table
from kvlife.transforms import make_transform
from kvlife.transforms.base import EncodedPayload, Param
from kvlife.transforms.quant import INT2_TUNED, INT4_TUNED
from kvlife.transforms.sparse import SparseTransform, snapkv_importance

LICENSES = Path("/usr/share/common-licenses")
TARGETS = {
    "near_lossless": {"max_kl": 0.005, "min_top1": 0.97, "max_abs_dppl": 0.01, "max_bits": 4.5},
    "two_bit": {"max_kl": 0.05},
}
"""Issue 12's targets: a near-lossless tier and a 2-bit tier."""


@dataclass(frozen=True)
class RowSpec:
    """One representation of the prefix KV under test."""

    label: str
    transform: str
    params: dict[str, Param] = field(default_factory=dict)
    dtype: str = "float16"
    """dtype of the KV handed to the transform (float32: as computed)."""
    importance: str = ""
    """Sparse rows: ``snapkv`` (attention of the observation window) or ``knorm``."""
    tier: str = ""
    """``near_lossless`` or ``two_bit``: the row tuned for that target."""
    chunk_tokens: int = 0
    """Tokens per chunk the prefix is cut into, each encoded on its own (0: one chunk)."""
    sinks_per_chunk: bool = False
    """Every chunk encoded as if it started the sequence (sinks at every chunk, as in
    version-2 frames)."""


ROWS: list[RowSpec] = [
    RowSpec("exact fp32", "exact", dtype="float32"),
    RowSpec("lossless zstd fp32", "lossless", dtype="float32"),
    RowSpec("exact fp16", "exact"),
    RowSpec("lossless zstd fp16", "lossless"),
    RowSpec("lossless lz4 fp16", "lossless", {"codec": "lz4"}),
    RowSpec("int8", "int8"),
    RowSpec("int4 g32", "int4"),
    RowSpec(
        "int4 tuned",
        "int4",
        INT4_TUNED,
        tier="near_lossless",
    ),
    RowSpec(
        "int4 kg64 sym-v",
        "int4",
        {"key_group": 64, "value_group": 64, "value_sym": True, "sink_tokens": 4},
    ),
    RowSpec("int4/int2 K/V g32", "int4", {"value_bits": 2}),
    RowSpec("int2 KIVI g32", "int2"),
    RowSpec("int2 + 4 sinks", "int2", {"sink_tokens": 4}),
    RowSpec("int2 + Kitty 25%", "int2", {"key_hi_fraction": 0.25}),
    RowSpec("int2 keys per token", "int2", {"key_axis": "token"}),
    RowSpec("int2 tuned", "int2", INT2_TUNED, tier="two_bit"),
    RowSpec("int2 tuned, v-groups 16", "int2", {**INT2_TUNED, "value_group": 16}),
    RowSpec("sparse 50% snapkv", "sparse", {"keep_ratio": 0.5}, importance="snapkv"),
    RowSpec("sparse 25% snapkv", "sparse", {"keep_ratio": 0.25}, importance="snapkv"),
    RowSpec("sparse 25% knorm", "sparse", {"keep_ratio": 0.25}, importance="knorm"),
    RowSpec("sparse 12.5% snapkv", "sparse", {"keep_ratio": 0.125}, importance="snapkv"),
]
REFERENCE = ROWS[0].label
CHUNK_SIZES = (64, 256)
"""Chunk sizes the quantiser rows are repeated at (besides the whole prefix)."""
PER_CHUNK_SINKS = ("int4 tuned", "int2 tuned")
"""Rows also run with sinks at every chunk (the version-2 behaviour)."""


def chunked_rows(
    chunk_sizes: Sequence[int], stored: int, rows: Sequence[RowSpec] = ROWS
) -> list[RowSpec]:
    """The quantiser rows of ``rows`` again at each chunk size below ``stored``
    (``label @size``), and :data:`PER_CHUNK_SINKS` with sinks at every chunk."""
    out: list[RowSpec] = []
    for size in sorted(set(chunk_sizes)):
        if not 0 < size < stored:
            continue
        for r in rows:
            if r.transform not in ("int8", "int4", "int2"):
                continue
            out.append(replace(r, label=f"{r.label} @{size}", tier="", chunk_tokens=size))
            if r.label in PER_CHUNK_SINKS:
                out.append(
                    replace(
                        r,
                        label=f"{r.label}, sinks per chunk @{size}",
                        tier="",
                        chunk_tokens=size,
                        sinks_per_chunk=True,
                    )
                )
    return out


@dataclass(frozen=True)
class Window:
    """A run of token ids from one licence file."""

    source: str
    start: int
    """Offset in the file's tokens."""
    ids: tuple[int, ...]


def license_windows(tokenizer: Any, count: int, length: int, root: Path = LICENSES) -> list[Window]:
    """``count`` windows of ``length`` tokens: the first window of each distinct licence
    text (sorted by name; duplicates such as GPL and GPL-3 once), then second windows."""
    texts: dict[str, str] = {}
    seen: set[str] = set()
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            texts[path.name] = text
    tokens = {name: [int(t) for t in tokenizer(text)["input_ids"]] for name, text in texts.items()}
    windows: list[Window] = []
    k = 0
    while len(windows) < count:
        round_k = [
            Window(name, k * length, tuple(ids[k * length : (k + 1) * length]))
            for name, ids in tokens.items()
            if len(ids) >= (k + 1) * length
        ]
        if not round_k:
            raise SystemExit(f"only {len(windows)} windows of {length} tokens under {root}")
        windows += round_k[: count - len(windows)]
        k += 1
    return windows


@dataclass
class Encoded:
    """One row's prefix KV after encode and decode, ready to inject."""

    spec: RowSpec
    kv: NDArray[np.float32]
    """(L, 2, H, T or kept, D) float32."""
    bits_per_element: float
    """Over every chunk of the prefix."""
    bits_later: float
    """Of a chunk not at the sequence start (the first chunk's KV encoded at start
    ``chunk_tokens``)."""
    ratio: float
    exactness: str
    encode_s: float
    decode_s: float
    digest: str
    kept: NDArray[np.bool_] | None = None
    """Sparse: (L, H, T) kept mask."""


@dataclass
class Acc:
    """Per-row sums over windows."""

    kl: float = 0.0
    top1: int = 0
    nll: float = 0.0
    positions: int = 0
    greedy_agree: int = 0
    greedy_total: int = 0
    first_divergence: list[int] = field(default_factory=list)
    recall_kept: float = 0.0
    recall_total: float = 0.0
    bits: list[float] = field(default_factory=list)
    bits_later: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    encode_s: float = 0.0
    decode_s: float = 0.0
    bit_exact_of: str = ""


def encode_row(
    spec: RowSpec, kv32: NDArray[np.float32], importance: NDArray[np.float32]
) -> Encoded:
    """Encode and decode ``kv32`` as ``spec`` says (float16 rows cast first), chunk by
    chunk when ``spec.chunk_tokens`` is set, each chunk told its absolute start."""
    src = kv32 if spec.dtype == "float32" else kv32.astype(np.float16)
    T = src.shape[3]
    size = spec.chunk_tokens or max(T, 1)
    parts = []
    encode_s = decode_s = 0.0
    nbytes = 0
    kept_parts: list[NDArray[np.bool_]] = []
    for c0 in range(0, max(T, 1), size):
        chunk = np.ascontiguousarray(src[:, :, :, c0 : c0 + size])
        start = 0 if spec.sinks_per_chunk else c0
        imp = importance[:, :, c0 : c0 + size]
        out, kept, enc, t_enc, t_dec = _round_trip(spec, chunk, imp, start)
        parts.append(out)
        if kept is not None:
            kept_parts.append(kept)
        nbytes += enc.nbytes
        encode_s += t_enc
        decode_s += t_dec
    # a chunk not at the sequence start: the first chunk's KV encoded at start `size`
    later = make_transform(spec.transform, spec.params)
    first = np.ascontiguousarray(src[:, :, :, :size])
    bits_later = (
        later.encode(first, start=0 if spec.sinks_per_chunk else size).bits_per_element
        if not isinstance(later, SparseTransform)
        else 8.0 * nbytes / max(src.size, 1)
    )
    out_all = np.concatenate(parts, axis=3)
    return Encoded(
        spec,
        np.ascontiguousarray(out_all, dtype=np.float32),
        8.0 * nbytes / max(src.size, 1),
        bits_later,
        src.nbytes / nbytes,
        _exactness(spec),
        encode_s,
        decode_s,
        hashlib.sha256(out_all.tobytes()).hexdigest(),
        np.concatenate(kept_parts, axis=2) if kept_parts else None,
    )


def _exactness(spec: RowSpec) -> str:
    return make_transform(spec.transform, spec.params).exactness.value


def _round_trip(
    spec: RowSpec, src: NDArray[Any], importance: NDArray[np.float32], start: int
) -> tuple[NDArray[Any], NDArray[np.bool_] | None, EncodedPayload, float, float]:
    """One chunk encoded at ``start`` and decoded: (decoded, kept mask, encoded, encode
    seconds, decode seconds)."""
    t = make_transform(spec.transform, spec.params)
    t0 = time.perf_counter()
    enc: EncodedPayload
    if isinstance(t, SparseTransform) and spec.importance == "snapkv":
        enc = t.encode(src, importance=importance, start=start)
    else:
        enc = t.encode(src, start=start)
    t1 = time.perf_counter()
    kept = None
    # the reader's transform comes from the descriptor (a sparse encode may record score=given)
    t = make_transform(enc.descriptor.name, enc.descriptor.param_map)
    if isinstance(t, SparseTransform):
        L, _, H, _, D = src.shape
        out = np.empty((L, 2, H, t.kept(src.shape), D), src.dtype)
        t.decode_kept(enc, out)
        kept = t.kept_mask(enc)
    else:
        out = np.empty_like(src)
        t.decode(enc, out)
    return out, kept, enc, t1 - t0, time.perf_counter() - t1


class Runner:
    """Batched forward passes of one model over injected prefix caches."""

    def __init__(self, model: Any) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.config = model.config
        self.attn = model.config._attn_implementation

    def _cache(self, kvs: Sequence[NDArray[np.float32]], room: int = 0) -> Any:
        """A cache holding ``kvs`` (one batch row each): static with ``room`` more
        positions (in-place appends: a dynamic cache copies itself on every decode step),
        dynamic when ``room`` is 0."""
        from transformers import DynamicCache, StaticCache

        torch = self.torch
        T = kvs[0].shape[3]
        cache = (
            StaticCache(config=self.config, max_cache_len=T + room)
            if room
            else DynamicCache(config=self.config)
        )
        stacked = np.stack(kvs)  # (B, L, 2, H, T, D)
        for layer in range(stacked.shape[1]):
            k = torch.from_numpy(np.ascontiguousarray(stacked[:, layer, 0]))
            v = torch.from_numpy(np.ascontiguousarray(stacked[:, layer, 1]))
            cache.update(k, v, layer)
        return cache

    def prefix(self, ids: Sequence[int], obs: int) -> tuple[NDArray[np.float32], NDArray[Any]]:
        """KV ``(L, 2, H, T, D)`` of the prefix and the attention ``(L, qh, obs, T)`` of its
        last ``obs`` queries (eager attention for this pass only)."""
        torch = self.torch
        self.model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                out = self.model(
                    input_ids=torch.tensor([list(ids)]), use_cache=True, output_attentions=True
                )
        finally:
            self.model.set_attn_implementation(self.attn)
        kv = torch.stack(
            [torch.stack([layer.keys[0], layer.values[0]]) for layer in out.cache.layers]
        )
        att = torch.stack([a[0, :, -obs:, :] for a in out.attentions])
        return kv.numpy().astype(np.float32), att.numpy()

    def attention_mass(self, kv: NDArray[np.float32], ids: Sequence[int]) -> NDArray[np.float64]:
        """Attention mass ``(L, H, T)`` the queries of ``ids`` put on each prefix token
        (summed over queries and the query heads of each KV head), exact prefix."""
        torch = self.torch
        T = kv.shape[3]
        H = kv.shape[2]
        self.model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                out = self.model(
                    input_ids=torch.tensor([list(ids)]),
                    cache=self._cache([kv]),
                    position_ids=torch.arange(T, T + len(ids))[None],
                    cache_position=torch.arange(T, T + len(ids)),
                    use_cache=True,
                    output_attentions=True,
                )
        finally:
            self.model.set_attn_implementation(self.attn)
        mass = torch.stack([a[0, :, :, :T].sum(dim=1) for a in out.attentions])  # (L, qh, T)
        m: NDArray[np.float64] = mass.double().numpy()
        grouped: NDArray[np.float64] = m.reshape(m.shape[0], H, m.shape[1] // H, T).sum(axis=2)
        return grouped

    def score(
        self, kvs: Sequence[NDArray[np.float32]], ids: Sequence[int], start: int, greedy: int
    ) -> tuple[Any, NDArray[np.int64]]:
        """Logits ``(B, len(ids), V)`` after each injected cache, and ``greedy`` tokens
        generated after the window ``(B, greedy)``."""
        torch = self.torch
        B = len(kvs)
        n = len(ids)
        cached = kvs[0].shape[3]
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([list(ids)] * B),
                cache=self._cache(kvs, room=n + greedy),
                position_ids=torch.arange(start, start + n)[None].expand(B, -1),
                cache_position=torch.arange(cached, cached + n),
                use_cache=True,
            )
            logits = out.logits
            cache = out.cache
            token = logits[:, -1].argmax(-1)
            gen = [token]
            for step in range(greedy - 1):
                o = self.model(
                    input_ids=token[:, None],
                    cache=cache,
                    position_ids=torch.full((B, 1), start + n + step),
                    cache_position=torch.tensor([cached + n + step]),
                    use_cache=True,
                )
                cache = o.cache
                token = o.logits[:, -1].argmax(-1)
                gen.append(token)
        return logits, torch.stack(gen, dim=1).numpy()


class _Reference:
    """The reference row's next-token distributions, against which a row is measured."""

    def __init__(self, logits: Any, targets: Any) -> None:
        import torch

        self.torch = torch
        self.logp = torch.log_softmax(logits.float(), dim=-1)
        self.p = self.logp.exp()
        self.top = self.logp.argmax(-1)
        self.targets = targets

    def measure(
        self, logits: Any, gen: NDArray[np.int64]
    ) -> tuple[float, int, float, NDArray[np.int64]]:
        """(sum of KL(reference || row), top-1 matches, target NLL sum, greedy tokens)."""
        logp = self.torch.log_softmax(logits.float(), dim=-1)
        return (
            float((self.p * (self.logp - logp)).sum()),
            int((logp.argmax(-1) == self.top).sum()),
            -float(logp.gather(-1, self.targets[:, None]).sum()),
            gen,
        )


def run_transforms_experiment(
    *,
    windows: int = 6,
    stored: int = 512,
    scored: int = 256,
    greedy: int = 64,
    obs: int = 32,
    batch: int = 16,
    rows: Sequence[RowSpec] | None = None,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    progress: bool = True,
) -> dict[str, Any]:
    import torch

    from kvlife.engines.models import load_smollm2

    if rows is None:
        rows = [*ROWS, *chunked_rows(chunk_sizes, stored)]
    t_start = time.perf_counter()
    loaded = load_smollm2()
    runner = Runner(loaded.model)
    wins = license_windows(loaded.tokenizer, windows, stored + scored + 1)
    acc = {r.label: Acc() for r in rows}
    kv_shape: list[int] = []
    for w_i, win in enumerate(wins):
        ids = list(win.ids)
        prefix, rest = ids[:stored], ids[stored : stored + scored]
        targets = torch.tensor(ids[stored + 1 : stored + scored + 1])
        kv, att = runner.prefix(prefix, obs)
        kv_shape = list(kv.shape)
        importance = snapkv_importance(att, kv.shape[2])
        encoded = [encode_row(r, kv, importance) for r in rows]
        mass = None
        if any(e.kept is not None for e in encoded):
            mass = runner.attention_mass(kv, rest)
        # rows with bit-identical decoded KV are run once
        first_of: dict[str, str] = {}
        to_run: list[Encoded] = []
        for e in encoded:
            a = acc[e.spec.label]
            a.bits.append(e.bits_per_element)
            a.bits_later.append(e.bits_later)
            a.ratio.append(e.ratio)
            a.encode_s += e.encode_s
            a.decode_s += e.decode_s
            if e.kept is not None and mass is not None:
                a.recall_kept += float((mass * e.kept).sum())
                a.recall_total += float(mass.sum())
            key = f"{e.digest}:{e.kv.shape}"
            if key in first_of:
                a.bit_exact_of = first_of[key]
            else:
                first_of[key] = e.spec.label
                to_run.append(e)
        # the reference first, then every other row against it, batch by batch (rows of
        # one cache length share a batch: the greedy steps cost little more for more rows)
        ref = next(e for e in to_run if e.spec.label == REFERENCE)
        ref_logits, ref_gen = runner.score([ref.kv], rest, stored, greedy)
        reference = _Reference(ref_logits[0], targets)
        results: dict[str, tuple[float, int, float, NDArray[np.int64]]] = {}
        results[REFERENCE] = reference.measure(ref_logits[0], ref_gen[0])
        by_len: dict[int, list[Encoded]] = {}
        for e in to_run:
            if e is not ref:
                by_len.setdefault(e.kv.shape[3], []).append(e)
        for group in by_len.values():
            for i in range(0, len(group), batch):
                part = group[i : i + batch]
                logits, gen = runner.score([e.kv for e in part], rest, stored, greedy)
                for j, e in enumerate(part):
                    results[e.spec.label] = reference.measure(logits[j], gen[j])
                del logits
        for spec in rows:
            a = acc[spec.label]
            kl, top1, nll, gen = results[a.bit_exact_of or spec.label]
            a.kl += kl
            a.top1 += top1
            a.nll += nll
            a.positions += len(rest)
            same = gen == ref_gen[0]
            a.greedy_agree += int(same.sum())
            a.greedy_total += len(gen)
            a.first_divergence.append(int(np.argmin(same)) if not same.all() else len(gen))
        if progress:
            print(
                f"window {w_i + 1}/{len(wins)} ({win.source}@{win.start}): "
                f"{time.perf_counter() - t_start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return _summary(
        rows,
        acc,
        {
            "model": loaded.model_id,
            "kv_shape": kv_shape,
            "stored_tokens": stored,
            "chunk_sizes": sorted({r.chunk_tokens or stored for r in rows}),
            "scored_tokens": scored,
            "greedy_tokens": greedy,
            "observation_queries": obs,
            "windows": [{"source": w.source, "start": w.start} for w in wins],
            "torch_threads": int(torch.get_num_threads()),
            "elapsed_s": time.perf_counter() - t_start,
        },
    )


def _summary(rows: Sequence[RowSpec], acc: dict[str, Acc], meta: dict[str, Any]) -> dict[str, Any]:
    ref_ppl = math.exp(acc[REFERENCE].nll / acc[REFERENCE].positions)
    out_rows = []
    for spec in rows:
        a = acc[spec.label]
        ppl = math.exp(a.nll / a.positions)
        row: dict[str, Any] = {
            **asdict(spec),
            "chunk_tokens": spec.chunk_tokens or meta["stored_tokens"],
            "exactness": _exactness(spec),
            "bits_per_element": float(np.mean(a.bits)),
            "bits_per_element_later": float(np.mean(a.bits_later)),
            "ratio": float(np.mean(a.ratio)),
            "byte_saving": 1.0 - 1.0 / float(np.mean(a.ratio)),
            "bit_exact_of": a.bit_exact_of or None,
            "mean_kl": a.kl / a.positions,
            "top1": a.top1 / a.positions,
            "ppl": ppl,
            "dppl": ppl / ref_ppl - 1.0,
            "greedy_agreement": a.greedy_agree / a.greedy_total,
            "first_divergence_mean": float(np.mean(a.first_divergence)),
            "recall": a.recall_kept / a.recall_total if a.recall_total else None,
            "encode_ms": 1e3 * a.encode_s / len(a.bits),
            "decode_ms": 1e3 * a.decode_s / len(a.bits),
        }
        row["meets"] = _meets(row)
        out_rows.append(row)
    return {
        "experiment": "transforms",
        **meta,
        "reference": REFERENCE,
        "reference_ppl": ref_ppl,
        "targets": TARGETS,
        "rows": out_rows,
    }


def _meets(row: dict[str, Any]) -> dict[str, bool]:
    nl = TARGETS["near_lossless"]
    return {
        "near_lossless": bool(
            row["mean_kl"] <= nl["max_kl"]
            and row["top1"] >= nl["min_top1"]
            and abs(row["dppl"]) <= nl["max_abs_dppl"]
            and row["bits_per_element"] <= nl["max_bits"]
        ),
        "two_bit": bool(row["mean_kl"] <= TARGETS["two_bit"]["max_kl"]),
    }


def _in_tier(row: dict[str, Any], tier: str) -> bool:
    """Near-lossless: any lossy row; 2-bit: rows whose base codes are 2 bits."""
    if tier == "two_bit":
        return bool(row["transform"] == "int2")
    return bool(row["exactness"] in ("lossy", "lossy-sparse"))


def format_report(result: dict[str, Any]) -> str:
    headers = [
        "row",
        "chunk",
        "exactness",
        "bits/el",
        "later",
        "saving",
        "mean KL",
        "top-1",
        "dPPL",
        f"greedy /{result['greedy_tokens']}",
        "recall",
        "enc ms",
        "dec ms",
    ]
    table = []
    for r in result["rows"]:
        table.append(
            [
                r["label"] + (" *" if r["bit_exact_of"] else ""),
                str(r["chunk_tokens"]),
                r["exactness"],
                f"{r['bits_per_element']:.2f}",
                f"{r['bits_per_element_later']:.2f}",
                f"{100 * r['byte_saving']:.1f}%",
                f"{r['mean_kl']:.4f}",
                f"{100 * r['top1']:.1f}%",
                f"{100 * r['dppl']:+.2f}%",
                f"{100 * r['greedy_agreement']:.1f}%",
                "-" if r["recall"] is None else f"{100 * r['recall']:.1f}%",
                f"{r['encode_ms']:.1f}",
                f"{r['decode_ms']:.1f}",
            ]
        )
    lines = [
        f"{result['model']}: {len(result['windows'])} windows of {result['stored_tokens']} "
        f"stored + {result['scored_tokens']} scored tokens (KV {result['kv_shape']}), "
        f"reference {result['reference']} (PPL {result['reference_ppl']:.3f})",
        format_table(headers, table),
        "* decoded KV bit-identical to an earlier row: that row's metrics; chunk: tokens per "
        "chunk; bits/el over the prefix, later: a chunk not at the sequence start",
    ]
    for tier, target in result["targets"].items():
        ok = [r["label"] for r in result["rows"] if r["meets"][tier] and _in_tier(r, tier)]
        tuned = [r for r in result["rows"] if r["tier"] == tier]
        verdict = ", ".join(
            f"{r['label']}: {'met' if r['meets'][tier] else 'MISSED'}" for r in tuned
        )
        lines.append(f"target {tier} {target}: {verdict}; rows meeting it: {ok or 'none'}")
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"exact": "black", "lossless": "tab:blue", "lossy": "tab:orange"}
    colours["lossy-sparse"] = "tab:purple"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    whole = result["stored_tokens"]
    for r in result["rows"]:
        # rows at smaller chunks: only the tuned ones (the rest would bury the figure)
        chunked = r["chunk_tokens"] != whole
        base = r["label"].split(" @")[0].removesuffix(", sinks per chunk")
        if chunked and base not in PER_CHUNK_SINKS:
            continue
        c = colours.get(r["exactness"], "grey")
        kl = max(r["mean_kl"], 1e-6)
        ax1.scatter(r["bits_per_element"], kl, color=c, s=30, marker="x" if chunked else "o")
        ax1.annotate(
            r["label"],
            (r["bits_per_element"], kl),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
        ax2.scatter(
            r["bits_per_element"], 100 * r["top1"], color=c, s=30, marker="x" if chunked else "o"
        )
        ax2.annotate(
            r["label"],
            (r["bits_per_element"], 100 * r["top1"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    t = result["targets"]
    ax1.axhline(
        t["near_lossless"]["max_kl"],
        color="tab:green",
        ls="--",
        lw=0.8,
        label="near-lossless KL target",
    )
    ax1.axhline(t["two_bit"]["max_kl"], color="tab:red", ls="--", lw=0.8, label="2-bit KL target")
    ax1.axvline(t["near_lossless"]["max_bits"], color="tab:green", ls=":", lw=0.8)
    ax1.set_yscale("log")
    ax1.set_xlabel("bits per element (metadata included)")
    ax1.set_ylabel("mean KL vs exact prefill (1e-6 floor)")
    ax1.legend(fontsize=7)
    ax2.axhline(100 * t["near_lossless"]["min_top1"], color="tab:green", ls="--", lw=0.8)
    ax2.set_xlabel("bits per element (metadata included)")
    ax2.set_ylabel("top-1 agreement (%)")
    model = result["model"].split(" ")[0]
    fig.suptitle(
        f"KV transforms on {model}: {len(result['windows'])} windows of "
        f"{result['stored_tokens']} stored + {result['scored_tokens']} scored tokens\n"
        "(x: the tuned rows at smaller chunks; bits per element over the whole prefix)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment transforms",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write a scatter plot (PNG) to this file")
    parser.add_argument("--windows", type=int, default=6, help="licence-text windows")
    parser.add_argument(
        "--stored", type=int, default=512, help="prefix tokens through the transform"
    )
    parser.add_argument(
        "--scored", type=int, default=256, help="tokens whose predictions are compared"
    )
    parser.add_argument("--greedy", type=int, default=64, help="greedy tokens generated after")
    parser.add_argument("--batch", type=int, default=16, help="rows per batched forward pass")
    parser.add_argument(
        "--chunks",
        default=",".join(str(c) for c in CHUNK_SIZES),
        help="chunk sizes (tokens, comma-separated) the quantiser rows are repeated at",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one window of 64 + 32 tokens, 8 greedy, chunks of 32 (tests)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.stored, args.scored, args.greedy = 1, 64, 32, 8
        args.chunks = "32"
    try:
        chunk_sizes = [int(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--chunks must be comma-separated integers, got {args.chunks!r}")
    result = run_transforms_experiment(
        windows=args.windows,
        stored=args.stored,
        scored=args.scored,
        greedy=args.greedy,
        obs=min(32, args.stored // 2),
        batch=args.batch,
        chunk_sizes=chunk_sizes,
        progress=not args.no_progress,
    )
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        plot(result, Path(args.plot))
    return 0
