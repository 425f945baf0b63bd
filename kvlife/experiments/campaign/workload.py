"""The campaign's workload: prompts that share prefixes, and payloads that are a pure
function of their chunk key (so any process can tell what a served chunk must hold).

A chunk is 2 KiB of float16 KV (two layers, two KV heads, head dim 8, 16 tokens), so a
disk frame is one header page plus one payload page and thousands of injections fit in
a minute. :func:`identity` takes the weights digest, so a model upgrade is a new
identity and every key changes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlife.core.identity import (
    PUBLIC,
    ROOT_PARENT,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)
from kvlife.experiments.campaign.payload import CHUNK_SHAPE, payload

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=16)
"""2 KiB of KV per chunk (:data:`~kvlife.experiments.campaign.payload.CHUNK_SHAPE`)."""
if LAYOUT.chunk_shape != CHUNK_SHAPE:  # payload.py computes bytes without kvlife's types
    raise RuntimeError(f"campaign layout {LAYOUT.chunk_shape} != payload shape {CHUNK_SHAPE}")

WEIGHTS_V1 = "a1" * 16
WEIGHTS_V2 = "b2" * 16
"""Weights digests before and after a model upgrade."""

VOCAB = 32_000
PREFIXES = 4
"""Shared system prompts per seed."""
PREFIX_CHUNKS = 2

NAMESPACES: tuple[Namespace, ...] = (
    PUBLIC,
    *(Namespace(NamespaceKind.USER, f"u{i}") for i in range(3)),
)


def identity(weights_digest: str = WEIGHTS_V1) -> ModelIdentity:
    """The campaign model's identity with the given weights digest."""
    return ModelIdentity(
        model_id="kvlife-fault-campaign",
        weights_digest=weights_digest,
        tokenizer_digest="1e" * 16,
        layout=LAYOUT,
    )


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of the workload: its tokens and the keys of its full chunks."""

    number: int
    namespace: Namespace
    tokens: np.ndarray
    keys: tuple[ChunkKey, ...]
    weights_digest: str

    def kv(self) -> list[np.ndarray]:
        """The KV of every full chunk (what a put hands the store)."""
        return [payload(k) for k in self.keys]

    def chunk(self, i: int) -> tuple[np.ndarray, int, ChunkKey]:
        """Tokens, start position and parent key of chunk ``i`` (to look it up alone)."""
        n = LAYOUT.tokens_per_chunk
        parent = ROOT_PARENT if i == 0 else self.keys[i - 1]
        return self.tokens[i * n : (i + 1) * n], i * n, parent


def prefix_tokens(seed: int, prefix_id: int) -> np.ndarray:
    """The tokens of shared prefix (system prompt) ``prefix_id`` of workload ``seed``."""
    rng = np.random.default_rng([seed, 1 << 40, prefix_id])
    return rng.integers(0, VOCAB, size=PREFIX_CHUNKS * LAYOUT.tokens_per_chunk, dtype=np.uint32)


def prompt_tokens(
    seed: int, number: int, namespaces: int, *, shared_prefix: bool = True
) -> tuple[int, np.ndarray]:
    """The draw behind prompt ``number`` of workload ``seed``: the index of its namespace
    (of ``namespaces``) and its tokens, a shared prefix (unless ``shared_prefix`` is
    False) then 1-3 chunks and a partial chunk of its own. The crash tests' workload
    (``tests/helpers/workload.py``) draws its prompts here too."""
    rng = np.random.default_rng([seed, number])
    ns = int(rng.integers(namespaces))
    n = LAYOUT.tokens_per_chunk
    parts = []
    if shared_prefix:
        parts.append(prefix_tokens(seed, int(rng.integers(PREFIXES))))
    own = int(rng.integers(1, 4)) * n + int(rng.integers(0, n))
    parts.append(rng.integers(0, VOCAB, size=own, dtype=np.uint32))
    return ns, np.concatenate(parts)


def make_prompt(
    seed: int,
    number: int,
    *,
    namespace: Namespace | None = None,
    weights_digest: str = WEIGHTS_V1,
    shared_prefix: bool = True,
) -> Prompt:
    """Prompt ``number`` of workload ``seed`` (:func:`prompt_tokens`), in ``namespace``
    when given (else the one the workload draws)."""
    i, tokens = prompt_tokens(seed, number, len(NAMESPACES), shared_prefix=shared_prefix)
    ns = NAMESPACES[i] if namespace is None else namespace
    keys = tuple(prompt_chunk_keys(identity(weights_digest), ns, tokens))
    return Prompt(number, ns, tokens, keys, weights_digest)
