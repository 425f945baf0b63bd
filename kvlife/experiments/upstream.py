"""What local invalidation saves when upstream sources change, with correct outputs.

``kvlife experiment upstream --json F --plot F.png``: SmolLM2-135M (transformers on this
CPU) serves the three workloads of :mod:`kvlife.upstream.workloads` (RAG with re-ranked
documents, an agent loop that appends tool outputs and rewrites one, edits in the
middle of a prompt), each request's prompt declared with the
:class:`~kvlife.upstream.builder.PromptBuilder`, four ways:

- ``full``: every token prefilled (the reference);
- ``prefix``: Stream2LLM's longest-common-prefix invalidation: the previous request's KV
  is kept up to the first token whose source or text changed, the rest recomputed;
- ``depgraph``: a :class:`~kvlife.store.KVStore` whose chunk keys hash the sources each
  chunk depends on (:mod:`kvlife.upstream.sourced`); a new version of a source
  invalidates, by source, every chunk that depended on an older one; each request
  reuses its longest stored chunk run (from any earlier request) exactly;
- ``segment``: the store's exact prefix as ``depgraph`` has it, then segment replicas
  (:mod:`kvlife.upstream.segments`) moved to their new position and blended with
  CacheBlend's selective recompute (:mod:`kvlife.upstream.blend`), served because the
  lookup accepts ``segment-blend``; only the KV before the first blended token (exact)
  goes back to the store.

Per strategy: tokens recomputed (through every layer), TTFT, correctness against
``full`` (exact strategies: the greedy output is asserted identical and the largest
logit difference reported; ``segment``: KL(full || segment) of the first token's
distribution, top-1 and greedy agreement) and stale KV served, counted by
:class:`~kvlife.upstream.oracle.StaleOracle` from each request's own provenance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.core.sources import Source
from kvlife.results import LookupResult
from kvlife.transforms.contract import Accept
from kvlife.upstream import sourced
from kvlife.upstream.blend import DEFAULT_RATIO, SegmentBlender
from kvlife.upstream.builder import BuiltPrompt, PromptBuilder
from kvlife.upstream.oracle import Provenance, StaleOracle
from kvlife.upstream.segments import SEGMENT_BLEND, SegmentCache, reused_spans
from kvlife.upstream.workloads import WORKLOADS, Request, WorkloadConfig

STRATEGIES = ("full", "prefix", "depgraph", "segment")
EXACT_STRATEGIES = ("prefix", "depgraph")


class OutputMismatch(KVLifeError):
    """An exact strategy's output differs from the full recompute's: wrong KV was reused."""


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """What the experiment runs."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    model: str = "smollm2"
    """``smollm2`` or ``tiny`` (a random tiny Llama with a word-hash tokenizer, for tests)."""
    tokens_per_chunk: int = 16
    """The store's chunk size (depgraph reuses whole chunks only)."""
    ratio: float = DEFAULT_RATIO
    """Share of reused tokens the segment strategy recomputes."""
    new_tokens: int = 8
    """Greedy tokens generated per request (the outputs compared)."""
    threads: int = 1
    """torch threads (one: the cores of a shared machine are busy)."""


@dataclass(slots=True)
class Outcome:
    """One request served one way."""

    ids: list[int]
    logits: Any
    ttft_s: float
    recomputed: int
    compute_fraction: float


# ---------------------------------------------------------------------------- model


@dataclass(slots=True)
class Model:
    model: Any
    identity: ModelIdentity
    tokenize: Callable[[str], Sequence[int]]
    eos: set[int]


def _load(cfg: UpstreamConfig) -> Model:
    import torch

    from kvlife.engines.identity import model_identity
    from kvlife.engines.models import load_smollm2, tiny_llama

    torch.set_num_threads(cfg.threads)
    loaded = load_smollm2() if cfg.model == "smollm2" else tiny_llama(layers=4)
    identity = model_identity(
        loaded.model,
        loaded.tokenizer,
        tokens_per_chunk=cfg.tokens_per_chunk,
        model_id=loaded.model_id,
        digest_of_weights=loaded.weights_digest,
    )
    tok = loaded.tokenizer
    if tok is not None:

        def tokenize(text: str) -> list[int]:
            return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]

    else:
        vocab = int(loaded.model.config.vocab_size)

        def tokenize(text: str) -> list[int]:
            return [zlib.crc32(w.encode()) % vocab for w in text.split()]

    eos = getattr(loaded.model.config, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return Model(loaded.model, identity, tokenize, eos_ids)


def _cache_of(m: Model, kv: Any) -> Any:
    """A DynamicCache holding ``kv`` ``(layers, 2, heads, T, dim)``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=m.model.config)
    for li in range(kv.shape[0]):
        cache.update(kv[li, 0][None].clone(), kv[li, 1][None].clone(), li)
    return cache


def _kv_of(cache: Any, upto: int) -> Any:
    import torch

    return torch.stack(
        [torch.stack([la.keys[0, :, :upto], la.values[0, :, :upto]]) for la in cache.layers]
    )


def _prefill(m: Model, ids: Sequence[int], reuse: Any | None) -> tuple[Any, Any, int]:
    """Prefill ``ids`` after the exact KV ``reuse`` of its first tokens (None: none):
    (last logits [1, vocab], cache, tokens prefilled)."""
    import torch

    cached = 0 if reuse is None else int(reuse.shape[3])
    cache = None if reuse is None else _cache_of(m, reuse)
    n = len(ids)
    with torch.no_grad():
        out = m.model(
            input_ids=torch.tensor([list(ids[cached:])], dtype=torch.long),
            cache=cache,
            position_ids=torch.arange(cached, n)[None],
            use_cache=True,
        )
    return out.logits[0, -1:], out.cache, n - cached


def _decode(m: Model, logits: Any, cache: Any, position: int, count: int) -> list[int]:
    import torch

    token = int(torch.argmax(logits[-1]))
    out = [token]
    with torch.no_grad():
        while len(out) < count and token not in m.eos:
            o = m.model(
                input_ids=torch.tensor([[token]]),
                cache=cache,
                position_ids=torch.tensor([[position]]),
                use_cache=True,
            )
            cache = o.cache
            token = int(torch.argmax(o.logits[0, -1]))
            out.append(token)
            position += 1
    return out


# ---------------------------------------------------------------------------- strategies


class Strategy(ABC):
    """One way of serving a request stream; keeps its own reuse state."""

    name = ""
    unit = ""
    """What :attr:`invalidated` counts."""

    def __init__(self, m: Model, cfg: UpstreamConfig, oracle: StaleOracle) -> None:
        self.m, self.cfg, self.oracle = m, cfg, oracle
        self.invalidated = 0

    @abstractmethod
    def serve(self, prompt: BuiltPrompt, superseded: Sequence[Source]) -> Outcome:
        """Serve one request; ``superseded``: sources whose version went up with it."""

    def close(self) -> None:
        return None


class Full(Strategy):
    name = "full"

    def serve(self, prompt: BuiltPrompt, superseded: Sequence[Source]) -> Outcome:
        t0 = time.perf_counter()
        logits, cache, done = _prefill(self.m, prompt.tokens, None)
        ttft = time.perf_counter() - t0
        ids = _decode(self.m, logits, cache, len(prompt.tokens), self.cfg.new_tokens)
        return Outcome(ids, logits, ttft, done, 1.0)


class Prefix(Strategy):
    """Stream2LLM: keep the previous request's KV up to the first changed token."""

    name = "prefix"
    unit = "tokens"

    def __init__(self, m: Model, cfg: UpstreamConfig, oracle: StaleOracle) -> None:
        super().__init__(m, cfg, oracle)
        self.prev: tuple[BuiltPrompt, Any] | None = None

    def serve(self, prompt: BuiltPrompt, superseded: Sequence[Source]) -> Outcome:
        n = len(prompt.tokens)
        t0 = time.perf_counter()
        reuse = None
        if self.prev is not None:
            old, kv = self.prev
            keep = min(prompt.first_change(old), n - 1)
            if keep < len(old.tokens):
                self.invalidated += len(old.tokens) - keep
            if keep:
                reuse = kv[:, :, :, :keep]
                self.oracle.prefix_reused(prompt.provenance(), old.provenance(), keep)
        logits, cache, done = _prefill(self.m, prompt.tokens, reuse)
        ttft = time.perf_counter() - t0
        self.prev = (prompt, _kv_of(cache, n))
        ids = _decode(self.m, logits, cache, n, self.cfg.new_tokens)
        return Outcome(ids, logits, ttft, done, done / n)


class DepGraph(Strategy):
    """The store with source-keyed chunks and invalidation by source."""

    name = "depgraph"
    unit = "chunks"

    def __init__(self, m: Model, cfg: UpstreamConfig, oracle: StaleOracle) -> None:
        super().__init__(m, cfg, oracle)
        from kvlife.store import KVStore, MiB

        self.tmp = tempfile.TemporaryDirectory(prefix="kvlife-upstream-")
        self.store = KVStore.open(self.tmp.name, dram_bytes=512 * MiB, disk_bytes=2048 * MiB)
        self.made_for: dict[ChunkKey, Provenance] = {}
        """Oracle side-table: the provenance each stored chunk's KV was computed for."""

    def serve(self, prompt: BuiltPrompt, superseded: Sequence[Source]) -> Outcome:
        n = len(prompt.tokens)
        t0 = time.perf_counter()
        self._supersede(superseded)
        reuse = self._exact_prefix(prompt)
        logits, cache, done = _prefill(self.m, prompt.tokens, reuse)
        ttft = time.perf_counter() - t0
        self._store(prompt, _kv_of(cache, n).numpy(), n)
        ids = _decode(self.m, logits, cache, n, self.cfg.new_tokens)
        return Outcome(ids, logits, ttft, done, done / n)

    def _supersede(self, superseded: Sequence[Source]) -> None:
        for src in superseded:
            self.invalidated += sourced.supersede(self.store, src)

    def _exact_prefix(self, prompt: BuiltPrompt) -> Any | None:
        """The stored exact KV of the prompt's longest chunk run (leaving at least one
        token to prefill), or None."""
        import torch

        n, tpc = len(prompt.tokens), self.cfg.tokens_per_chunk
        hits = sourced.lookup(self.store, self.m.identity, PUBLIC, prompt)
        usable = min(len(hits.hits), (n - 1) // tpc)
        if not usable:
            return None
        res = self.store.load(LookupResult(hits.hits[:usable], hits.chunks_total, tpc, hits.accept))
        if not res.loaded:
            return None
        last = hits.hits[res.loaded - 1].key
        self.oracle.prefix_reused(prompt.provenance(), self.made_for[last], res.loaded * tpc)
        return torch.cat([torch.from_numpy(np.array(a)) for a in res.arrays], dim=3)

    def _store(self, prompt: BuiltPrompt, kv: Any, upto: int) -> None:
        """Put the chunks of the prompt's first ``upto`` tokens (whose KV is exact)."""
        tpc = self.cfg.tokens_per_chunk
        if upto < tpc:
            return
        sourced.put(self.store, self.m.identity, PUBLIC, prompt, kv[:, :, :, :upto], upto=upto)
        from kvlife.core.identity import prompt_chunk_keys

        keys = prompt_chunk_keys(
            self.m.identity, PUBLIC, list(prompt.tokens[:upto]), sources=prompt.spans
        )
        prov = prompt.provenance()
        for i, key in enumerate(keys):
            self.made_for.setdefault(key, prov[: (i + 1) * tpc])

    def close(self) -> None:
        self.store.close(flush=False)
        self.tmp.cleanup()


class SegmentReuse(DepGraph):
    """The exact prefix from the store, then segment replicas moved into place and
    blended (lossy, accepted explicitly) for the rest."""

    name = "segment"
    unit = "chunks+segments"
    accept = Accept.lossy(transforms=[SEGMENT_BLEND])

    def __init__(self, m: Model, cfg: UpstreamConfig, oracle: StaleOracle) -> None:
        super().__init__(m, cfg, oracle)
        from kvlife.upstream.rope import rope_inv_freq

        self.cache = SegmentCache(m.identity, ratio=cfg.ratio)
        self.blender = SegmentBlender(m.model, ratio=cfg.ratio)
        self.inv_freq = rope_inv_freq(m.model)

    def serve(self, prompt: BuiltPrompt, superseded: Sequence[Source]) -> Outcome:
        from kvlife.upstream.blend import ReusedSpan

        n = len(prompt.tokens)
        t0 = time.perf_counter()
        self._supersede(superseded)
        for src in superseded:
            self.invalidated += self.cache.invalidate(src.name, before_version=src.version)
        exact = self._exact_prefix(prompt)
        p = 0 if exact is None else int(exact.shape[3])
        found = self.cache.lookup(PUBLIC, prompt, self.accept)
        hits = [h for h in found.hits if h.span.end > p]  # the rest is in the exact prefix
        prov = prompt.provenance()
        spans: list[ReusedSpan] = []
        for hit, r in zip(hits, reused_spans(hits, self.inv_freq), strict=True):
            cut = max(0, p - r.start)  # a segment the exact prefix ends inside
            self.oracle.segment_reused(prov, r.start + cut, hit.replica.provenance[cut:])
            spans.append(ReusedSpan(r.start + cut, r.kv[:, :, :, cut:]))
        out = self.blender.prefill(prompt.tokens, spans, exact)
        ttft = time.perf_counter() - t0
        kv = _kv_of(out.cache, n)
        fresh = set(out.recomputed)
        blended = [i for r in spans for i in range(r.start, r.start + int(r.kv.shape[3]))]
        approx = min((i for i in blended if i not in fresh), default=n)
        # only the KV before the first blended token is exact: only that goes to the store
        self._store(prompt, kv.numpy(), approx)
        hit_spans = {h.span for h in hits}
        for seg, span in zip(prompt.segments, prompt.spans, strict=True):
            if span.start >= p and span not in hit_spans:  # recomputed here: keep it
                self.cache.put(PUBLIC, seg, span.start, kv[:, :, :, span.start : span.end].numpy())
        ids = _decode(self.m, out.logits, out.cache, n, self.cfg.new_tokens)
        return Outcome(ids, out.logits, ttft, len(out.recomputed), out.compute_fraction)


_CLASSES: dict[str, type[Strategy]] = {
    "full": Full,
    "prefix": Prefix,
    "depgraph": DepGraph,
    "segment": SegmentReuse,
}


# ---------------------------------------------------------------------------- run


def check_identical(strategy: str, request: int, ref: Sequence[int], got: Sequence[int]) -> None:
    """The assertion every exact strategy passes: its greedy output is the reference's."""
    if list(ref) != list(got):
        raise OutputMismatch(
            f"{strategy}: request {request} generated {list(got)}, full recompute {list(ref)}"
        )


def _kl(ref: Any, got: Any) -> float:
    import torch

    lp = torch.log_softmax(ref[-1].double(), -1)
    lq = torch.log_softmax(got[-1].double(), -1)
    return max(0.0, float((lp.exp() * (lp - lq)).sum()))


def _prompts(m: Model, requests: list[Request]) -> list[tuple[BuiltPrompt, list[Source]]]:
    """Each request built, with the sources whose version went up since earlier ones."""
    seen: dict[str, int] = {}
    out: list[tuple[BuiltPrompt, list[Source]]] = []
    for req in requests:
        b = PromptBuilder(m.tokenize)
        newer: list[Source] = []
        for kind, src, text in req:
            b.add(kind, src, text)
            if src.name in seen and src.version > seen[src.name]:
                newer.append(src)
            seen[src.name] = max(src.version, seen.get(src.name, 0))
        out.append((b.build(), newer))
    return out


def run_workload(m: Model, cfg: UpstreamConfig, name: str) -> dict[str, Any]:
    prompts = _prompts(m, WORKLOADS[name](cfg.workload))
    rows: dict[str, dict[str, Any]] = {}
    ref: list[Outcome] = []
    for sname in STRATEGIES:
        oracle = StaleOracle()
        strat = _CLASSES[sname](m, cfg, oracle)
        outs: list[Outcome] = []
        try:
            for prompt, newer in prompts:
                outs.append(strat.serve(prompt, newer))
        finally:
            strat.close()
        if sname == "full":
            ref = outs
        row: dict[str, Any] = {
            "tokens_total": sum(len(p.tokens) for p, _ in prompts),
            "tokens_recomputed": sum(o.recomputed for o in outs),
            "compute_fraction": float(np.mean([o.compute_fraction for o in outs])),
            "ttft_s": float(np.mean([o.ttft_s for o in outs])),
            "ttft_s_per_request": [o.ttft_s for o in outs],
            "reused_tokens": oracle.reused_tokens,
            "stale_tokens": oracle.stale_tokens,
            "stale_events": oracle.events,
            "invalidated": strat.invalidated,
            "invalidated_unit": strat.unit,
        }
        if sname in EXACT_STRATEGIES or sname == "full":
            for i, (a, b) in enumerate(zip(ref, outs, strict=True)):
                check_identical(sname, i, a.ids, b.ids)
            row["outputs_identical"] = True
            pairs = zip(ref, outs, strict=True)
            diffs = [float((a.logits[-1] - b.logits[-1]).abs().max()) for a, b in pairs]
            row["max_logit_diff"] = float(max(diffs))
        else:
            kls = [_kl(a.logits, b.logits) for a, b in zip(ref, outs, strict=True)]
            agree = [_common(a.ids, b.ids) for a, b in zip(ref, outs, strict=True)]
            row["kl_mean"] = float(np.mean(kls))
            row["kl_max"] = float(np.max(kls))
            row["kl_per_request"] = kls
            row["top1_agree"] = float(
                np.mean([a.ids[0] == b.ids[0] for a, b in zip(ref, outs, strict=True)])
            )
            lens = [len(a.ids) for a in ref]
            row["greedy_agree"] = float(np.mean([c == k for c, k in zip(agree, lens, strict=True)]))
            row["greedy_prefix"] = float(np.mean([c / k for c, k in zip(agree, lens, strict=True)]))
        rows[sname] = row
    return {
        "requests": len(prompts),
        "prompt_tokens": [len(p.tokens) for p, _ in prompts],
        "superseded": [[str(s) for s in newer] for _, newer in prompts],
        "strategies": rows,
    }


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(cfg: UpstreamConfig, progress: bool = True) -> dict[str, Any]:
    m = _load(cfg)
    _prefill(m, m.tokenize("warm up the kernels " * 8), None)
    workloads: dict[str, Any] = {}
    for name in WORKLOADS:
        t0 = time.perf_counter()
        workloads[name] = run_workload(m, cfg, name)
        if progress:
            print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    summary: dict[str, dict[str, float]] = {}
    for s in STRATEGIES:
        rows = [w["strategies"][s] for w in workloads.values()]
        total = sum(r["tokens_total"] for r in rows)
        summary[s] = {
            "tokens_recomputed": sum(r["tokens_recomputed"] for r in rows),
            "recomputed_share": sum(r["tokens_recomputed"] for r in rows) / max(total, 1),
            "ttft_s": float(np.mean([r["ttft_s"] for r in rows])),
            "stale_tokens": sum(r["stale_tokens"] for r in rows),
        }
        if s == "segment":
            summary[s]["kl_mean"] = float(np.mean([r["kl_mean"] for r in rows]))
            summary[s]["top1_agree"] = float(np.mean([r["top1_agree"] for r in rows]))
            summary[s]["greedy_agree"] = float(np.mean([r["greedy_agree"] for r in rows]))
    return {
        "experiment": "upstream",
        "model": m.identity.model_id,
        "config": asdict(cfg),
        "workloads": workloads,
        "summary": summary,
    }


# ---------------------------------------------------------------------------- output


def table(result: dict[str, Any]) -> str:
    """The result as a Markdown table (what README and docs show)."""
    lines = [
        "| workload | strategy | recomputed tokens | TTFT ms | stale | quality vs full |",
        "|---|---|---|---|---|---|",
    ]
    for w, data in result["workloads"].items():
        for s, r in data["strategies"].items():
            share = r["tokens_recomputed"] / max(r["tokens_total"], 1)
            if "kl_mean" in r:
                q = (
                    f"KL {r['kl_mean']:.3f}, top-1 {r['top1_agree']:.0%}, "
                    f"greedy {r['greedy_agree']:.0%}"
                )
            else:
                q = "identical (asserted)"
            lines.append(
                f"| {w} | {s} | {r['tokens_recomputed']} ({share:.0%}) | "
                f"{1000 * r['ttft_s']:.0f} | {r['stale_tokens']} | {q} |"
            )
    return "\n".join(lines)


def plot_png(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(STRATEGIES)
    for k, s in enumerate(STRATEGIES):
        xs = [i + (k - (len(STRATEGIES) - 1) / 2) * width for i in range(len(names))]
        rows = [result["workloads"][w]["strategies"][s] for w in names]
        share = [r["tokens_recomputed"] / max(r["tokens_total"], 1) for r in rows]
        axes[0].bar(xs, share, width, label=s)
        axes[1].bar(xs, [1000 * r["ttft_s"] for r in rows], width, label=s)
    for ax, title in zip(axes, ("tokens recomputed (share)", "mean TTFT (ms)"), strict=True):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"upstream changes, {result['model'].split(' ')[0]} (shared CPU)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment upstream",
        description="tokens recomputed, TTFT, correctness and stale KV of full recompute, "
        "prefix invalidation, dependency-graph invalidation and segment reuse",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write a PNG of recompute share and TTFT")
    parser.add_argument("--quick", action="store_true", help="small workloads (for tests)")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--requests", type=int, default=None, help="requests per workload")
    parser.add_argument("--ratio", type=float, default=DEFAULT_RATIO, help="segment recompute")
    parser.add_argument("--tokens-per-chunk", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    wl = WorkloadConfig(requests=3, docs=2, words=24) if args.quick else WorkloadConfig()
    if args.requests is not None:
        wl = WorkloadConfig(requests=args.requests, docs=wl.docs, words=wl.words, seed=wl.seed)
    cfg = UpstreamConfig(
        workload=wl,
        model=args.model,
        tokens_per_chunk=args.tokens_per_chunk,
        ratio=args.ratio,
        new_tokens=4 if args.quick else 8,
        threads=args.threads,
    )
    result = run(cfg, progress=not args.no_progress)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(table(result))
    if args.plot:
        plot_png(result, Path(args.plot))
    return 0 if all(math.isfinite(v["ttft_s"]) for v in result["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
