"""Built-in, seeded synthetic workloads: chat, RAG, agent loops and long reasoning.

Every request carries a tenant label and a category. Prompts are token sequences, and
block ids are prefix-chained exactly as an engine would key them: a block's id is
interned from (parent block id, the block's tokens), so two prompts share a block iff
they share every token up to the end of it.

- **chat**: a tenant's system prompt, then turns; each turn's prompt is the whole
  history (previous prompts and replies) plus a new user message; the user reads the
  reply for an exponential gap (mean ``chat_gap_s``) before the next turn.
- **rag**: system prompt, ``rag_docs_per_request`` documents drawn from the tenant's
  corpus by Zipf popularity and put in a random order (order matters for prefix reuse),
  then a question.
- **agent**: system prompt and task, then steps that each append a tool call and a tool
  output, a few seconds apart.
- **reasoning**: a short prompt and a long output (thousands of tokens), then a
  follow-up turn whose prompt includes that output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.trace.model import Trace, TraceBuilder

CATEGORIES = ("chat", "rag", "agent", "reasoning")


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """Parameters of the synthetic mix (all times in seconds)."""

    seed: int = 0
    """Seed of every random choice."""
    sessions: int = 400
    """Sessions (conversations, RAG users, agent runs, reasoning tasks)."""
    duration_s: float = 1800.0
    """Session start times are uniform in ``[0, duration_s)``."""
    tenants: int = 4
    """Tenants; each has its own system prompt and document corpus."""
    mix: tuple[float, float, float, float] = (0.4, 0.3, 0.2, 0.1)
    """Weights of chat, rag, agent, reasoning sessions."""
    block_tokens: int = 256
    """Tokens per block."""
    system_tokens: int = 1024
    """System prompt length of each tenant."""
    chat_turns: tuple[int, int] = (2, 8)
    """Turns per chat, uniform in [lo, hi]."""
    chat_gap_s: float = 30.0
    """Mean reading gap between turns (exponential)."""
    rag_docs: int = 64
    """Documents in each tenant's corpus."""
    rag_doc_tokens: int = 1024
    """Tokens per document."""
    rag_docs_per_request: int = 3
    """Documents retrieved per request."""
    rag_requests: tuple[int, int] = (1, 6)
    """Requests per RAG session."""
    agent_steps: tuple[int, int] = (3, 12)
    """Steps per agent run."""
    reasoning_output: tuple[int, int] = (2000, 16000)
    """Output tokens of a reasoning request."""

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.tenants < 1 or self.block_tokens < 1:
            raise InvalidArgument("sessions >= 0, tenants >= 1 and block_tokens >= 1 required")
        if len(self.mix) != 4 or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise InvalidArgument(f"mix needs 4 weights >= 0 with a positive sum, got {self.mix}")


class _Chainer:
    """Interns (parent id, block tokens) into prefix-chained block ids."""

    def __init__(self, block_tokens: int) -> None:
        self.n = block_tokens
        self.ids: dict[tuple[int, bytes], int] = {}

    def blocks(self, tokens: np.ndarray) -> list[int]:
        n = self.n
        out: list[int] = []
        parent = -1
        for i in range(len(tokens) // n):
            key = (parent, tokens[i * n : (i + 1) * n].tobytes())
            parent = self.ids.setdefault(key, len(self.ids))
            out.append(parent)
        return out


def synthetic_trace(config: SyntheticConfig | None = None) -> Trace:
    """The seeded mix of :data:`CATEGORIES` as one trace, sorted by arrival."""
    cfg = config or SyntheticConfig()
    rng = np.random.default_rng(cfg.seed)
    chain = _Chainer(cfg.block_tokens)
    b = TraceBuilder(f"synthetic(seed={cfg.seed})", cfg.block_tokens)
    next_token = [1]

    def fresh(n: int) -> np.ndarray:
        """``n`` tokens never seen before (unique content)."""
        start = next_token[0]
        next_token[0] += n
        return np.arange(start, start + n, dtype=np.int64)

    systems = [fresh(cfg.system_tokens) for _ in range(cfg.tenants)]
    corpora = [[fresh(cfg.rag_doc_tokens) for _ in range(cfg.rag_docs)] for _ in systems]
    zipf = 1.0 / np.arange(1, cfg.rag_docs + 1) ** 1.1
    zipf /= zipf.sum()
    weights = np.asarray(cfg.mix, dtype=np.float64) / sum(cfg.mix)

    def emit(t: float, tenant: int, cat: str, prompt: np.ndarray, out: int) -> None:
        b.add(t, len(prompt), out, chain.blocks(prompt), f"tenant-{tenant}", cat)

    for _ in range(cfg.sessions):
        t = float(rng.uniform(0, cfg.duration_s))
        tenant = int(rng.integers(cfg.tenants))
        cat = CATEGORIES[int(rng.choice(4, p=weights))]
        sys_prompt = systems[tenant]
        if cat == "chat":
            history = sys_prompt
            for _turn in range(int(rng.integers(cfg.chat_turns[0], cfg.chat_turns[1] + 1))):
                prompt = np.concatenate([history, fresh(int(rng.integers(20, 400)))])
                out = int(rng.integers(50, 800))
                emit(t, tenant, cat, prompt, out)
                history = np.concatenate([prompt, fresh(out)])
                t += float(rng.exponential(cfg.chat_gap_s)) + 1.0
        elif cat == "rag":
            for _q in range(int(rng.integers(cfg.rag_requests[0], cfg.rag_requests[1] + 1))):
                k = cfg.rag_docs_per_request
                docs = rng.choice(cfg.rag_docs, size=k, replace=False, p=zipf)
                parts = [sys_prompt, *(corpora[tenant][int(d)] for d in docs)]
                prompt = np.concatenate([*parts, fresh(int(rng.integers(20, 200)))])
                emit(t, tenant, cat, prompt, int(rng.integers(50, 500)))
                t += float(rng.exponential(20.0)) + 1.0
        elif cat == "agent":
            history = np.concatenate([sys_prompt, fresh(int(rng.integers(200, 1000)))])
            for _s in range(int(rng.integers(cfg.agent_steps[0], cfg.agent_steps[1] + 1))):
                out = int(rng.integers(30, 300))
                emit(t, tenant, cat, history, out)
                tool = fresh(int(rng.integers(100, 3000)))
                history = np.concatenate([history, fresh(out), tool])
                t += float(rng.uniform(1.0, 5.0))
        else:
            prompt = np.concatenate([sys_prompt, fresh(int(rng.integers(100, 1500)))])
            lo, hi = cfg.reasoning_output
            out = int(rng.integers(lo, hi + 1))
            emit(t, tenant, cat, prompt, out)
            t += float(rng.exponential(60.0)) + out * 0.02
            follow = np.concatenate([prompt, fresh(out), fresh(int(rng.integers(20, 200)))])
            emit(t, tenant, cat, follow, int(rng.integers(lo, hi + 1)) // 4)
    return b.build(sort=True)
