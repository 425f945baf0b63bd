"""The oracle: every chunk a store serves is compared, byte for byte, with the payload
its key must hold (:func:`~kvlife.experiments.campaign.payload.payload`).

A served chunk is *right* when its bytes equal the key's payload, *wrong* otherwise
(the count of differing bytes is what the campaign reports: it must be 0 for kvlife).
The oracle does not trust the store's own verification; a read path that hands out
damaged bytes is caught here whether or not the store noticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvlife.experiments.campaign.payload import payload


@dataclass(slots=True)
class Verdict:
    """What the oracle found in one batch of served chunks."""

    served: int = 0
    """Chunks compared."""
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    """Bytes that differ from the keys' payloads, over all wrong chunks."""
    wrong_keys: list[bytes] | None = None


def wrong_bytes(key: bytes, served: np.ndarray | bytes) -> int:
    """How many bytes of ``served`` differ from ``key``'s payload (a length mismatch
    counts every byte missing or extra)."""
    want = payload(key).view(np.uint8).reshape(-1)
    got = np.frombuffer(
        served if isinstance(served, bytes) else np.ascontiguousarray(served).tobytes(),
        dtype=np.uint8,
    )
    n = min(len(want), len(got))
    return int(np.count_nonzero(want[:n] != got[:n])) + abs(len(want) - len(got))


def check(keys: Sequence[bytes], served: Sequence[np.ndarray | bytes]) -> Verdict:
    """Compare ``served[i]`` with the payload of ``keys[i]`` for every served chunk."""
    if len(served) > len(keys):
        raise ValueError(f"{len(served)} chunks served for {len(keys)} keys")
    v = Verdict(served=len(served))
    for key, arr in zip(keys, served, strict=False):
        bad = wrong_bytes(key, arr)
        if bad:
            v.wrong_chunks += 1
            v.wrong_bytes += bad
            v.wrong_keys = [*(v.wrong_keys or []), bytes(key)]
    return v
