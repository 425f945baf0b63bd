"""Three upstream-change workloads that ship with kvlife: RAG with re-ranked documents, an
agent loop that appends tool outputs and rewrites one, and edits in the middle of a prompt.

Each workload is a sequence of requests; each request is the list of its segments in
prompt order, as ``(kind, source, text)`` (the application's view, before
tokenisation). A source whose version goes up between requests is an upstream update
(a re-fetched document, a re-run tool, an edited paragraph). The texts are paragraphs
of the licence texts every Debian machine has in ``/usr/share/common-licenses``, or, where
those are missing, deterministic generated words, so the workloads need no download.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvlife.core.sources import Source
from kvlife.upstream.builder import SegmentKind

LICENSES = Path("/usr/share/common-licenses")
_FILES = ("Apache-2.0", "GPL-3", "MPL-2.0", "LGPL-2.1", "Artistic", "GPL-2", "BSD")

SegmentSpec = tuple[SegmentKind, Source, str]
Request = list[SegmentSpec]

SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Answer from the material below "
    "and say which part you used.<|im_end|>\n<|im_start|>user\n"
)
CUE = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Sizes of the generated workloads."""

    requests: int = 6
    """Requests per workload."""
    docs: int = 4
    """Documents per RAG prompt (the pool has one more); tool outputs per agent run
    grow to this; paragraphs of the edited prompt."""
    words: int = 60
    """Words per document, tool output or paragraph."""
    seed: int = 0


def paragraphs(count: int, words: int, seed: int = 0) -> list[str]:
    """``count`` distinct passages of ``words`` words: licence paragraphs where there
    are enough of them, generated text otherwise."""
    found: list[str] = []
    for name in _FILES:
        path = LICENSES / name
        if not path.is_file():
            continue
        for block in path.read_text(errors="replace").split("\n\n"):
            ws = block.split()
            if len(ws) >= words:
                found.append(" ".join(ws[:words]))
    rng = random.Random(seed)
    if len(found) >= count:
        rng.shuffle(found)
        return found[:count]
    vocab = ["the", "a", "of", "to", "licence", "work", "source", "code", "copy", "may"]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(count)]


def _edited(text: str, rng: random.Random) -> str:
    """``text`` with a sentence changed in its middle (an upstream update)."""
    ws = text.split()
    mid = len(ws) // 2
    return " ".join([*ws[:mid], "(updated", f"{rng.randrange(1000)}:", "see", "notice)", *ws[mid:]])


def rag(cfg: WorkloadConfig) -> list[Request]:
    """A query stream over a pool of ``docs + 1`` documents: each request retrieves
    ``docs`` of them in a re-ranked order; half-way the first document is updated."""
    rng = random.Random(cfg.seed)
    pool = paragraphs(cfg.docs + 1 + cfg.requests, cfg.words, cfg.seed)
    docs = {f"doc{i}": [pool[i]] for i in range(cfg.docs + 1)}
    questions = pool[cfg.docs + 1 :]
    out: list[Request] = []
    for r in range(cfg.requests):
        if r == cfg.requests // 2:
            docs["doc0"].append(_edited(docs["doc0"][0], rng))
        names = sorted(docs)
        rng.shuffle(names)
        chosen = names[: cfg.docs]
        if "doc0" not in chosen:  # keep the updated document in play
            chosen[-1] = "doc0"
        req: Request = [(SegmentKind.SYSTEM, Source("system"), SYSTEM)]
        for name in chosen:
            v = len(docs[name]) - 1
            req.append((SegmentKind.DOCUMENT, Source(name, v), f"[{name}] {docs[name][v]}\n"))
        q = " ".join(questions[r].split()[:12])
        ask = f"Question: what does this say: {q}?{CUE}"
        req.append((SegmentKind.QUERY, Source("query", r), ask))
        out.append(req)
    return out


def agent(cfg: WorkloadConfig) -> list[Request]:
    """An agent run: each step appends a tool output; one step re-runs the first tool,
    whose output is rewritten in place (a new version) before the run goes on."""
    rng = random.Random(cfg.seed + 1)
    pool = paragraphs(cfg.requests + 2, cfg.words, cfg.seed + 1)
    task = f"Task: summarise the obligations in these files. {pool[0]}\n"
    tools: list[tuple[Source, str]] = []
    out: list[Request] = []
    rewrite_at = max(2, cfg.requests // 2)
    for r in range(cfg.requests):
        if r == rewrite_at and tools:
            src, text = tools[0]
            tools[0] = (Source(src.name, src.version + 1), _edited(text, rng))
        else:
            tools.append((Source(f"tool{len(tools)}", 0), pool[1 + len(tools)]))
        req: Request = [
            (SegmentKind.SYSTEM, Source("system"), SYSTEM),
            (SegmentKind.USER, Source("task"), task),
        ]
        for src, text in tools:
            req.append((SegmentKind.TOOL, src, f"<tool {src.name}> {text}\n"))
        req.append((SegmentKind.QUERY, Source("cue"), f"Next step?{CUE}"))
        out.append(req)
    return out


def edits(cfg: WorkloadConfig) -> list[Request]:
    """One long prompt whose middle paragraphs the user edits, one edit per request
    (the first request is the original)."""
    rng = random.Random(cfg.seed + 2)
    paras = paragraphs(cfg.docs + 2, cfg.words, cfg.seed + 2)
    body = [[p] for p in paras[: cfg.docs]]
    question = " ".join(paras[cfg.docs].split()[:12])
    out: list[Request] = []
    for r in range(cfg.requests):
        if r:
            j = 1 + (r - 1) % max(1, cfg.docs - 2)  # never the first or the last
            body[j].append(_edited(body[j][-1], rng))
        req: Request = [(SegmentKind.SYSTEM, Source("system"), SYSTEM)]
        for j, versions in enumerate(body):
            src = Source(f"para{j}", len(versions) - 1)
            req.append((SegmentKind.USER, src, versions[-1] + "\n"))
        req.append((SegmentKind.QUERY, Source("question"), f"Question: {question}?{CUE}"))
        out.append(req)
    return out


WORKLOADS = {"rag": rag, "agent": agent, "edits": edits}
