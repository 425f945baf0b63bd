"""A deterministic KV workload, shared by the crash child and the tests that check it.

Its layout, prompts and payloads are the fault campaign's
(:mod:`kvlife.experiments.campaign.workload`), under an identity and namespaces of its own.

Every prompt is a pure function of ``(seed, prompt number)`` and every chunk's KV bytes a
pure function of its chunk key, so a parent process can recompute exactly what a killed
child may have written and compare every served byte with it. Prompts share prefixes
(a few "system prompts" per seed), so the same key is put by several prompts, and spread
over several namespaces, so that invalidating a namespace removes a known set of keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlife.core.events import EventSink
from kvlife.core.identity import (
    PUBLIC,
    ROOT_PARENT,
    ChunkKey,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)
from kvlife.experiments.campaign.payload import payload
from kvlife.experiments.campaign.workload import LAYOUT as LAYOUT
from kvlife.experiments.campaign.workload import prompt_tokens
from kvlife.results import LoadResult, PutResult
from kvlife.store import KVStore
from kvlife.tiers.disk import DiskTier

KiB = 1 << 10
MiB = 1 << 20

IDENTITY = ModelIdentity(
    model_id="crash-test-model",
    weights_digest="0f" * 16,
    tokenizer_digest="1e" * 16,
    layout=LAYOUT,
)

USERS = tuple(Namespace(NamespaceKind.USER, f"u{i}") for i in range(3))
"""Namespaces the churn workload invalidates now and then."""

NAMESPACES: tuple[Namespace, ...] = (PUBLIC, *USERS, Namespace(NamespaceKind.ORGANISATION, "acme"))


@dataclass(frozen=True, slots=True)
class StoreShape:
    """Tier sizes of one workload (what ``KVStore.open`` is given)."""

    dram_bytes: int
    disk_bytes: int
    segment_bytes: int
    invalidate_prob: float
    """Chance that a namespace is invalidated after a put."""

    def open(self, path: Path, sink: EventSink | None = None) -> KVStore:
        return KVStore.open(
            path,
            dram_bytes=self.dram_bytes,
            disk_bytes=self.disk_bytes,
            segment_bytes=self.segment_bytes,
            write_through=True,
            sink=sink,
        )


SHAPES: dict[str, StoreShape] = {
    # Disk holds ~190 frames in 32-frame segments: a few dozen puts fill it, after which
    # every put evicts, deleted frames leave garbage and segments get compacted.
    "churn": StoreShape(
        dram_bytes=32 * LAYOUT.chunk_nbytes,
        disk_bytes=1536 * KiB,
        segment_bytes=256 * KiB,
        invalidate_prob=0.08,
    ),
    # Disk far larger than anything a round writes, no invalidation: every acknowledged
    # prompt must survive a kill in full.
    "durable": StoreShape(
        dram_bytes=32 * LAYOUT.chunk_nbytes,
        disk_bytes=512 * MiB,
        segment_bytes=1 * MiB,
        invalidate_prob=0.0,
    ),
}


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of the workload."""

    number: int
    namespace: Namespace
    tokens: np.ndarray
    """uint32 token ids; a trailing partial chunk is included (and never stored)."""
    keys: tuple[ChunkKey, ...]
    """Keys of its full chunks."""


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Enough to look up one chunk on its own (its tokens, position and parent)."""

    key: ChunkKey
    namespace: Namespace
    tokens: np.ndarray
    start: int
    parent: ChunkKey


def make_prompt(seed: int, number: int, namespace: Namespace | None = None) -> Prompt:
    """Prompt ``number`` of the workload ``seed``: a shared prefix, then its own tokens
    (drawn as the fault campaign's are: :func:`~kvlife.experiments.campaign.workload.
    prompt_tokens`). ``namespace`` overrides the namespace the workload would pick."""
    i, tokens = prompt_tokens(seed, number, len(NAMESPACES))
    ns = NAMESPACES[i] if namespace is None else namespace
    keys = tuple(prompt_chunk_keys(IDENTITY, ns, tokens))
    return Prompt(number, ns, tokens, keys)


def invalidation_after(seed: int, number: int, prob: float) -> Namespace | None:
    """The namespace the churn workload invalidates right after putting ``number``."""
    if prob <= 0.0:
        return None
    rng = np.random.default_rng([seed, number, 7])
    if rng.random() >= prob:
        return None
    return USERS[int(rng.integers(len(USERS)))]


def kv_for_key(key: bytes) -> np.ndarray:
    """The KV bytes of a chunk: random float16 bit patterns seeded by its key (the fault
    campaign's payload, :func:`~kvlife.experiments.campaign.payload.payload`)."""
    return payload(key)


def chunk_refs(prompt: Prompt) -> list[ChunkRef]:
    n = LAYOUT.tokens_per_chunk
    refs: list[ChunkRef] = []
    parent = ROOT_PARENT
    for i, key in enumerate(prompt.keys):
        refs.append(
            ChunkRef(key, prompt.namespace, prompt.tokens[i * n : (i + 1) * n], i * n, parent)
        )
        parent = key
    return refs


def put(store: KVStore, prompt: Prompt) -> PutResult:
    """Store a prompt's KV (every full chunk) with the workload's identity."""
    kv = [kv_for_key(k) for k in prompt.keys]
    return store.put_prompt(IDENTITY, prompt.namespace, prompt.tokens, kv)


def load_prompt(store: KVStore, prompt: Prompt) -> LoadResult:
    return store.get(IDENTITY, prompt.namespace, prompt.tokens)


def load_chunk(store: KVStore, ref: ChunkRef) -> LoadResult:
    """Look up and load exactly one chunk, whatever became of the chunks before it."""
    found = store.lookup(IDENTITY, ref.namespace, ref.tokens, start=ref.start, parent=ref.parent)
    return store.load(found)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact equality (float16 NaN patterns compare as the bits they are)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_served_correctly(result: LoadResult, keys: Sequence[ChunkKey]) -> None:
    """Every array a load handed out equals the expected KV of the key it stands for."""
    assert result.loaded == len(result.arrays)
    for i, arr in enumerate(result.arrays):
        assert same_bytes(arr, kv_for_key(keys[i])), f"wrong bytes served for chunk {i}"


def disk_of(store: KVStore) -> DiskTier:
    """The store's disk tier (the tests' default chain has one, named ``disk``)."""
    tier = store.tier("disk")
    assert isinstance(tier, DiskTier)
    return tier
