"""The payload of a chunk key (the oracle's truth), with nothing but numpy imported, so
a process of another virtual environment (LMCache's) computes the very same bytes."""

from __future__ import annotations

import numpy as np

CHUNK_SHAPE = (2, 2, 2, 16, 8)
"""(layers, K and V, KV heads, tokens, head dim) of a campaign chunk: 2 KiB of float16."""
CHUNK_BYTES = 2 * int(np.prod(CHUNK_SHAPE))


def payload(key: bytes) -> np.ndarray:
    """The KV of a chunk: random float16 bit patterns seeded by its key."""
    rng = np.random.default_rng(int.from_bytes(bytes(key)[:16], "little"))
    return rng.integers(0, 1 << 16, size=CHUNK_SHAPE, dtype=np.uint16).view(np.float16)
