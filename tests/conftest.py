"""Shared fixtures: a tiny KV layout and model identity, deterministic KV payloads."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvlife.core.identity import KVLayout, ModelIdentity

# session-scoped Redis servers for remote tiers; the vLLM virtualenv (tests/vllm) has no
# redis-py and runs no remote test
pytest_plugins = (
    ["tests.remote.servers", "tests.remote.mooncake_env"]
    if importlib.util.find_spec("redis") is not None
    else []
)

TINY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=16)


def tiny_identity(**changes: str) -> ModelIdentity:
    fields = {"model_id": "tiny", "weights_digest": "w0", "tokenizer_digest": "t0"}
    fields.update(changes)
    return ModelIdentity(layout=TINY, **fields)


def prompt_kv(seed: int, ntokens: int, layout: KVLayout = TINY) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (tokens, kv) for a prompt: KV shaped (layers, 2, heads, T, dim)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, ntokens)
    kv = rng.standard_normal(
        (layout.num_layers, 2, layout.num_kv_heads, ntokens, layout.head_dim)
    ).astype(np.float16)
    return tokens, kv


@pytest.fixture
def identity() -> ModelIdentity:
    return tiny_identity()
