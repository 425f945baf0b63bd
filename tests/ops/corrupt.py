"""A served store with one payload flipped on disk: what the ops tests start a server on
to see a corruption caught (counted by the metrics, logged as one line)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.faults.damage import flip, scan_frames
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ServerProc

N = TINY.tokens_per_chunk


def store_with_a_flipped_payload(path: Path) -> tuple[ModelIdentity, np.ndarray, list[ChunkKey]]:
    """Three chunks put through a write-through server at ``path``, the server stopped,
    then five bytes of chunk 1's payload flipped in its segment file: the identity, the
    prompt's tokens and its chunks' keys."""
    ident = tiny_identity()
    tokens, kv = prompt_kv(6, 3 * N)
    first = ServerProc(path, extra=("--write-through",)).start()
    try:
        store = first.client()
        keys = store.put_prompt(ident, PUBLIC, tokens, kv).keys
        store.close()
    finally:
        assert first.stop() == 0
    frame = next(f for f in scan_frames(path) if f.key == keys[1])
    flip(frame.segment, frame.payload_offset + 37, 5)  # the payload of chunk 1
    first.log.unlink()
    return ident, tokens, list(keys)
