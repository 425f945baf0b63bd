"""``kvlife demo``: SmolLM2 serving a multi-turn chat, with and without kvlife.

The built-in workload (``kvlife/data/chat_workload.json``) has one shared system prompt
and several users with several turns each; every turn's prompt is the system prompt,
the user's history (questions and the model's answers) and the new question. The same
turns run twice, round-robin across users: once with no KV reuse, once with kvlife
(DRAM + disk tiers, DRAM small enough that chunks are demoted to disk). Per turn it
prints TTFT with and without, the tokens served from each tier, and whether the greedy
outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvlife.core.events import EventSink, JsonlSink
from kvlife.core.identity import Namespace, NamespaceKind
from kvlife.report import format_table

MiB = 1 << 20


@dataclass
class TurnRow:
    user: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    from_dram: int
    from_disk: int
    ttft_without_s: float
    ttft_with_s: float
    same_output: bool
    answer: str

    @property
    def speedup(self) -> float:
        return self.ttft_without_s / self.ttft_with_s if self.ttft_with_s > 0 else 0.0


def load_workload() -> dict[str, Any]:
    text = resources.files("kvlife").joinpath("data/chat_workload.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


class ChatEncoder:
    """Text -> token ids with the model's chat template, or bytes for tokenizer-less
    test models."""

    def __init__(self, tokenizer: Any | None, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab

    def chat(self, system: str, history: list[tuple[str, str]], question: str) -> list[int]:
        if self.tokenizer is None:
            text = system + "".join(q + a for q, a in history) + question
            return [b % self.vocab for b in text.encode()]
        messages = [{"role": "system", "content": system}]
        for q, a in history:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def run_chat(
    loaded: Any,
    *,
    store_dir: Path | None,
    dram_bytes: int,
    disk_bytes: int,
    max_new_tokens: int,
    tokens_per_chunk: int,
    progress: bool = True,
    sink: EventSink | None = None,
) -> tuple[list[TurnRow], dict[str, Any]]:
    """Run the workload without and with kvlife; return per-turn rows and store info
    (the store's lifecycle events go to ``sink``, for ``kvlife report --events``)."""
    from kvlife.engines.hf import HFEngine
    from kvlife.store import KVStore

    work = load_workload()
    enc = ChatEncoder(loaded.tokenizer, int(loaded.model.config.vocab_size))
    ns = Namespace(NamespaceKind.ORGANISATION, "northwind")
    rounds = max(len(u["turns"]) for u in work["users"])
    order = [  # round-robin: every user's turn t before anyone's turn t + 1
        (u["name"], t, u["turns"][t])
        for t in range(rounds)
        for u in work["users"]
        if t < len(u["turns"])
    ]
    outputs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    tmp = None
    if store_dir is None:
        tmp = tempfile.mkdtemp(prefix="kvlife-demo-", dir=".")
        store_dir = Path(tmp)
    info: dict[str, Any] = {}
    try:
        with tqdm(
            total=2 * len(order), desc="demo turns", unit="turn", disable=not progress, leave=False
        ) as bar:
            for mode in ("without", "with"):
                store = (
                    KVStore.open(store_dir, dram_bytes=dram_bytes, disk_bytes=disk_bytes, sink=sink)
                    if mode == "with"
                    else None
                )
                engine = HFEngine.for_model(loaded, store, tokens_per_chunk=tokens_per_chunk)
                history: dict[str, list[tuple[str, str]]] = {}
                for user, t, question in order:
                    hist = history.setdefault(user, [])
                    ids = enc.chat(work["system"], hist, question)
                    turn = engine.generate(
                        ids, ns, max_new_tokens=max_new_tokens, request_id=f"{user}#{t}"
                    )
                    answer = enc.decode(turn.output_ids)
                    hist.append((question, answer))
                    outputs[mode].append(
                        {
                            "user": user,
                            "turn": t,
                            "ids": len(ids),
                            "turn_result": turn,
                            "answer": answer,
                            "output_ids": turn.output_ids,
                        }
                    )
                    bar.update()
                if store is not None:
                    info = store.info().to_json()
                    store.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for a, b in zip(outputs["without"], outputs["with"], strict=True):
        ta, tb = a["turn_result"], b["turn_result"]
        rows.append(
            TurnRow(
                user=a["user"],
                turn=a["turn"] + 1,
                prompt_tokens=b["ids"],
                cached_tokens=tb.cached_tokens,
                from_dram=tb.tiers.get("dram", 0) * tokens_per_chunk,
                from_disk=tb.tiers.get("disk", 0) * tokens_per_chunk,
                ttft_without_s=ta.ttft_s,
                ttft_with_s=tb.ttft_s,
                same_output=a["output_ids"] == b["output_ids"],
                answer=b["answer"],
            )
        )
    return rows, info


def run_demo(args: argparse.Namespace) -> int:
    from kvlife.engines.models import load_smollm2

    t0 = time.perf_counter()
    print("loading SmolLM2-135M-Instruct (first run converts the GGUF, ~30 s) ...", flush=True)
    loaded = load_smollm2()
    load_s = time.perf_counter() - t0
    sink = JsonlSink(args.events) if args.events else None
    try:
        rows, info = run_chat(
            loaded,
            store_dir=Path(args.dir) if args.dir else None,
            dram_bytes=args.dram_mib * MiB,
            disk_bytes=args.disk_mib * MiB,
            max_new_tokens=args.max_new_tokens,
            tokens_per_chunk=args.chunk_tokens,
            sink=sink,
        )
    finally:
        if sink is not None:
            sink.close()
    headers = [
        "user",
        "turn",
        "prompt tok",
        "cached",
        "DRAM",
        "disk",
        "TTFT without",
        "TTFT with",
        "speedup",
        "same output",
    ]
    table = [
        [
            r.user,
            str(r.turn),
            str(r.prompt_tokens),
            str(r.cached_tokens),
            str(r.from_dram),
            str(r.from_disk),
            f"{r.ttft_without_s * 1e3:.0f} ms",
            f"{r.ttft_with_s * 1e3:.0f} ms",
            f"{r.speedup:.2f}x",
            "yes" if r.same_output else "NO",
        ]
        for r in rows
    ]
    print(
        f"kvlife demo: {loaded.model_id}, {len(rows)} turns, greedy, "
        f"{args.max_new_tokens} new tokens per turn"
    )
    print(format_table(headers, table))
    same = sum(r.same_output for r in rows)
    hit_rows = [r for r in rows if r.cached_tokens]
    hit_speedup = (
        sum(r.ttft_without_s for r in hit_rows) / max(sum(r.ttft_with_s for r in hit_rows), 1e-9)
        if hit_rows
        else 0.0
    )
    total_without = sum(r.ttft_without_s for r in rows)
    total_with = sum(r.ttft_with_s for r in rows)
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    c = info.get("counters", {})
    summary = [
        ["turns with identical greedy output", f"{same} of {len(rows)}"],
        ["prompt tokens served from kvlife", f"{cached} of {prompt} ({cached / prompt:.0%})"],
        [
            "  from DRAM / from disk",
            f"{sum(r.from_dram for r in rows)} / {sum(r.from_disk for r in rows)}",
        ],
        ["total TTFT without / with kvlife", f"{total_without:.2f} s / {total_with:.2f} s"],
        ["TTFT speedup on turns with a hit", f"{hit_speedup:.2f}x" if hit_rows else "-"],
        [
            "chunks stored / demoted / promoted",
            f"{c.get('chunks_stored', 0)} / {c.get('demotions', 0)} / {c.get('promotions', 0)}",
        ],
        ["corrupt replicas caught", str(c.get("corrupt", 0))],
        ["model load", f"{load_s:.1f} s"],
    ]
    print()
    print(format_table(["summary", ""], summary))
    print()
    if same == len(rows):
        print("greedy outputs with and without kvlife are identical on every turn")
    else:
        print(f"WARNING: {len(rows) - same} turn(s) produced different output with kvlife")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": loaded.model_id,
                    "turns": [asdict(r) | {"speedup": r.speedup} for r in rows],
                    "identical_outputs": same == len(rows),
                    "store": info,
                    "total_ttft_without_s": total_without,
                    "total_ttft_with_s": total_with,
                },
                indent=2,
            )
        )
    return 0 if same == len(rows) else 1
