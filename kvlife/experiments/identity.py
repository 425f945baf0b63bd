"""``kvlife experiment identity``: which identity fields prevent wrong KV reuse, and what
does wrong reuse cost?

For each perturbation of the serving setting (other weights, a LoRA-style adapter,
another tokenizer's id mapping, the same tokens at another start position, another KV
dtype, another tenant, and a no-change control), KV is stored under the original
setting and then looked up under the perturbed one through (a) kvlife and (b) a
token-hash-only key (parent hash + token ids). Per row and store: chunks served, wrong
chunks (served KV differs from what the perturbed setting computes itself, relative max
difference above ``--tolerance``), and the damage: max |logit difference| over the
suffix against the perturbed setting's own full prefill, and greedy agreement over 32
tokens. Tenant rows also count cross-tenant hits: identical KV, but served across an
isolation boundary (the prefix-timing channel of CVE-2025-46570).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.experiments.baseline import TokenHashStore
from kvlife.experiments.perturb import Setting, settings
from kvlife.report import format_table

GREEDY_TOKENS = 32


@dataclass
class Outcome:
    """What one store served for one perturbed request, and what it did."""

    chunks_served: int
    wrong_chunks: int
    max_rel_kv_diff: float
    max_logit_diff: float
    greedy_agreement: int
    """Positions (of GREEDY_TOKENS) where the greedy tokens equal the perturbed setting's
    own; GREEDY_TOKENS when nothing was served."""
    first_divergence: int
    cross_tenant_hits: int = 0


@dataclass
class Row:
    perturbation: str
    note: str
    kvlife: Outcome
    token_hash: Outcome


def _kv_chunks(cache: Any, tokens: int, tpc: int) -> list[np.ndarray]:
    """The first ``tokens`` positions of a cache as float32 chunk arrays."""
    import torch

    stacked = torch.stack(
        [
            torch.stack([layer.keys[0, :, :tokens], layer.values[0, :, :tokens]])
            for layer in cache.layers
        ]
    ).to(torch.float32)
    arr = stacked.numpy()
    return [arr[:, :, :, i * tpc : (i + 1) * tpc, :] for i in range(tokens // tpc)]


def _outcome(
    engine: Any,
    setting: Setting,
    ids: list[int],
    served: list[np.ndarray],
    reference: dict[str, Any],
    tolerance: float,
    cross_tenant: bool,
) -> Outcome:
    if not served:
        return Outcome(0, 0, 0.0, 0.0, GREEDY_TOKENS, GREEDY_TOKENS)
    ref_chunks = reference["chunks"]
    diffs = []
    for got, ref in zip(served, ref_chunks, strict=False):
        scale = float(np.abs(ref).max()) or 1.0
        diffs.append(float(np.abs(got.astype(np.float32) - ref).max()) / scale)
    wrong = sum(d > tolerance for d in diffs)
    pre = engine.prefill_with_chunks(ids, served, start=setting.start)
    ref_logits = reference["logits"][pre.cached_tokens :]
    logit_diff = float((pre.logits.float() - ref_logits.float()).abs().max())
    tokens, _, _ = engine.decode(pre, setting.start + len(ids), GREEDY_TOKENS, stop_at_eos=False)
    ref_tokens = reference["greedy"]
    agree = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
    first = next(
        (i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b),
        GREEDY_TOKENS,
    )
    return Outcome(
        len(served),
        wrong,
        max(diffs),
        logit_diff,
        agree,
        first,
        cross_tenant_hits=len(served) if cross_tenant else 0,
    )


def run_identity_experiment(
    *, tiny: bool, workdir: Path, tolerance: float = 1e-3, progress: bool = True
) -> dict[str, Any]:
    from kvlife.engines.hf import HFEngine
    from kvlife.engines.models import load_smollm2, tiny_llama
    from kvlife.store import KVStore

    loaded = tiny_llama(seed=0) if tiny else load_smollm2()
    tpc = 16 if tiny else 64
    prefix_chunks = 8
    vocab = int(loaded.model.config.vocab_size)
    rng = np.random.default_rng(0)
    if loaded.tokenizer is not None:
        from kvlife.apps.chat import load_workload

        text = load_workload()["system"]
        prefix = [int(t) for t in loaded.tokenizer(text)["input_ids"]][: prefix_chunks * tpc]
        suffix = [
            int(t) for t in loaded.tokenizer(" Which tent is best for two people?")["input_ids"]
        ]
    else:
        prefix = rng.integers(0, vocab, prefix_chunks * tpc).tolist()
        suffix = rng.integers(0, vocab, 12).tolist()
    ids = prefix + suffix
    namespace = Namespace(NamespaceKind.ORGANISATION, "tenant-a")
    original = HFEngine.for_model(loaded, None, tokens_per_chunk=tpc)
    base = Setting("original", loaded.model, original.identity, namespace)
    store = KVStore.open(workdir, dram_bytes=1 << 30, disk_bytes=0)
    baseline = TokenHashStore(tpc)
    writer = HFEngine(loaded.model, store, original.identity, tokenizer=loaded.tokenizer)
    writer.generate(prefix, namespace, max_new_tokens=1)  # stores the prefix's chunks
    stored = writer.prefill(ids, namespace)
    baseline.put(prefix, stored.loaded_chunks)
    rows: list[Row] = []
    builders = settings(base, loaded.tokenizer, tpc, position_offset=3 * tpc + 5)
    for build in tqdm(
        builders,
        desc="identity experiment",
        unit="setting",
        leave=False,
        disable=not progress,
        file=sys.stderr,
    ):
        s = build()
        plain = HFEngine(s.model, None, s.identity, tokenizer=loaded.tokenizer)
        full = plain.prefill(ids, s.namespace, start=s.start)
        greedy, _, _ = plain.decode(full, s.start + len(ids), GREEDY_TOKENS, stop_at_eos=False)
        reference = {
            "logits": full.logits,
            "greedy": greedy,
            "chunks": _kv_chunks(full.cache, len(prefix), tpc),
        }
        served_kvlife = (
            HFEngine(s.model, store, s.identity)
            .prefill(ids, s.namespace, start=s.start)
            .loaded_chunks
        )
        cross = s.namespace != namespace
        rows.append(
            Row(
                s.name,
                s.note,
                _outcome(
                    plain, s, ids, [np.array(c) for c in served_kvlife], reference, tolerance, cross
                ),
                _outcome(plain, s, ids, baseline.lookup(ids), reference, tolerance, cross),
            )
        )
    store.close()
    return {
        "model": loaded.model_id,
        "tokens_per_chunk": tpc,
        "prefix_tokens": len(prefix),
        "suffix_tokens": len(suffix),
        "tolerance": tolerance,
        "greedy_tokens": GREEDY_TOKENS,
        "rows": [asdict(r) for r in rows],
    }


def format_report(result: dict[str, Any]) -> str:
    headers = [
        "perturbation",
        "store",
        "chunks served",
        "wrong",
        "rel KV diff",
        "max logit diff",
        f"greedy agree /{GREEDY_TOKENS}",
        "cross-tenant",
    ]
    table = []
    for r in result["rows"]:
        for store in ("kvlife", "token_hash"):
            o = r[store]
            table.append(
                [
                    r["perturbation"] if store == "kvlife" else "",
                    store.replace("_", "-"),
                    str(o["chunks_served"]),
                    str(o["wrong_chunks"]),
                    f"{o['max_rel_kv_diff']:.2g}" if o["chunks_served"] else "-",
                    f"{o['max_logit_diff']:.3g}" if o["chunks_served"] else "-",
                    str(o["greedy_agreement"]),
                    str(o["cross_tenant_hits"]),
                ]
            )
    wrong_kvlife = sum(r["kvlife"]["wrong_chunks"] for r in result["rows"])
    wrong_base = sum(r["token_hash"]["wrong_chunks"] for r in result["rows"])
    return "\n".join(
        [
            f"{result['model']}: {result['prefix_tokens']}-token stored prefix in "
            f"{result['tokens_per_chunk']}-token chunks, {result['suffix_tokens']}-token suffix",
            format_table(headers, table),
            f"wrong chunks served: kvlife {wrong_kvlife}, token-hash baseline {wrong_base}",
        ]
    )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["perturbation"].replace(" (control)", "\n(control)") for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for off, store, colour in ((-0.2, "kvlife", "tab:green"), (0.2, "token_hash", "tab:red")):
        ax1.bar(
            x + off,
            [r[store]["wrong_chunks"] for r in rows],
            0.4,
            label=store.replace("_", "-"),
            color=colour,
        )
        served = [r[store]["chunks_served"] > 0 for r in rows]
        heights = [
            max(r[store]["max_logit_diff"], 1e-7) if hit else 0.0
            for r, hit in zip(rows, served, strict=True)
        ]
        ax2.bar(x + off, heights, 0.4, label=store.replace("_", "-"), color=colour)
        for xi, hit in zip(x + off, served, strict=True):
            if not hit:  # a miss: nothing served, nothing damaged
                ax2.text(xi, 2e-7, "miss", ha="center", va="bottom", fontsize=7, rotation=90)
    ax1.set_ylabel("wrong chunks served")
    ax1.legend()
    ax1.set_title(f"Wrong KV reuse under perturbed settings ({result['model'].split(' ')[0]})")
    ax2.set_yscale("log")
    ax2.set_ylim(1e-7, 1e3)
    ax2.set_ylabel("max |logit diff| vs own prefill")
    ax2.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment identity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write a bar chart (PNG) to this file")
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama (for tests)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="relative KV difference above which a served chunk is wrong",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix=".kvlife-identity-", dir="."))
    try:
        result = run_identity_experiment(
            tiny=args.tiny, workdir=workdir, tolerance=args.tolerance, progress=not args.no_progress
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))
    return 0
