"""The token-hash-only prefix store that common engines use, as the experiment's baseline.

A chunk's key is a hash of its parent's key and its token ids, nothing else (the scheme
of vLLM's prefix cache and of LMCache's default chunk keys). Whatever model, adapter,
tokenizer, position, dtype or tenant computed a chunk, the same token ids find it.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import numpy as np

from kvlife.core.identity import token_bytes


class TokenHashStore:
    """Chunks of KV keyed by (parent hash, token ids) only."""

    def __init__(self, tokens_per_chunk: int) -> None:
        self.tokens_per_chunk = tokens_per_chunk
        self._chunks: dict[bytes, np.ndarray] = {}

    def _keys(self, ids: Sequence[int]) -> list[bytes]:
        n = self.tokens_per_chunk
        parent = b""
        keys = []
        for i in range(len(ids) // n):
            parent = blake3.blake3(parent + token_bytes(list(ids[i * n : (i + 1) * n]))).digest()
            keys.append(parent)
        return keys

    def put(self, ids: Sequence[int], chunks: Sequence[np.ndarray]) -> None:
        for key, chunk in zip(self._keys(ids), chunks, strict=False):
            self._chunks[key] = np.array(chunk, copy=True)

    def lookup(self, ids: Sequence[int]) -> list[np.ndarray]:
        out = []
        for key in self._keys(ids):
            chunk = self._chunks.get(key)
            if chunk is None:
                break
            out.append(chunk)
        return out
