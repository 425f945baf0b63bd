"""Live mode: replay a trace against a real :class:`~kvlife.store.KVStore`.

Each request does what an engine does: ``lookup`` the prompt, ``load`` the hits (read,
checksummed on disk, verified here against the expected payload), then ``put_prompt``
its full blocks. Tokens are synthesised per block from the block id (two u32 tokens per
block: the id's low and high halves), so the store's prefix-chained keys share exactly
what the trace's prefix-chained ids share. A block's KV payload is a pure function of its
id, so every loaded chunk is checked bit for bit. Capacities are given in blocks, as in
:class:`~kvlife.replay.cache.CacheSim`, and must give the same hit counts for the same
policy (tested).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import KVLifeError
from kvlife.core.events import EventSink
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.replay.cache import DISK, DRAM
from kvlife.store import KVStore
from kvlife.tiers.registry import footprint
from kvlife.trace.model import Trace

TOKENS_PER_BLOCK = 2


class WrongKVServed(KVLifeError):
    """A loaded chunk's bytes differ from the payload stored for that block."""


def live_layout(block_bytes: int = 256) -> KVLayout:
    """A one-layer fp16 layout whose chunk (one trace block) is ``block_bytes`` bytes."""
    per_dim = 2 * TOKENS_PER_BLOCK * 2  # K and V, tokens, fp16
    if block_bytes < per_dim or block_bytes % per_dim:
        raise KVLifeError(f"block_bytes must be a positive multiple of {per_dim}")
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=block_bytes // per_dim,
        dtype="float16",
        tokens_per_chunk=TOKENS_PER_BLOCK,
    )


@dataclass(slots=True)
class LiveRun:
    """Per-request counts from the real store (same meaning as in ``CacheRun``)."""

    prefix_dram: NDArray[np.int64]
    prefix_disk: NDArray[np.int64]
    present: NDArray[np.int64]
    new: NDArray[np.int64]
    dropped: NDArray[np.int64]
    seconds: float
    """Wall-clock time of the replay."""
    bytes_loaded: int
    counters: dict[str, int]


def run_live(
    trace: Trace,
    policy: str,
    dram_blocks: int,
    disk_blocks: int = 0,
    *,
    block_bytes: int = 256,
    segment_frames: int | None = None,
    path: str | Path | None = None,
    sink: EventSink | None = None,
    progress: Callable[[int], None] | None = None,
) -> LiveRun:
    """Replay ``trace`` through a fresh store under ``path`` (a temp dir by default)."""
    layout = live_layout(block_bytes)
    model = ModelIdentity(
        model_id="replay", weights_digest="w", tokenizer_digest="t", layout=layout
    )
    ns = Namespace(NamespaceKind.PUBLIC, "")
    nbytes = layout.chunk_nbytes
    disk_bytes = 0
    if disk_blocks:
        # the disk budget counts frames (header + padded payload), garbage included
        disk_bytes = disk_blocks * footprint("disk", nbytes)
    # Small segments keep garbage (deleted frames awaiting reclaim, which count against
    # the disk budget) small, so the disk holds as many blocks as the simulator's tier.
    frames = segment_frames or max(4, min(128, disk_blocks // 64))
    segment_bytes = frames * footprint("disk", nbytes)
    with tempfile.TemporaryDirectory(prefix="kvlife-live-") as tmp:
        root = Path(path) if path is not None else Path(tmp)
        store = KVStore.open(
            root / "store",
            dram_bytes=dram_blocks * nbytes,
            disk_bytes=disk_bytes,
            policy=policy,
            sink=sink,
            segment_bytes=segment_bytes,
        )
        try:
            return _replay(trace, store, model, ns, layout, progress)
        finally:
            store.close(flush=False)


def _payload(ids: list[int], layout: KVLayout) -> np.ndarray:
    """KV for blocks ``ids``: block ``i``'s values are ``id mod 2048`` (exact in fp16)."""
    vals = (np.asarray(ids, dtype=np.int64) % 2048).astype(np.float16)
    n = layout.tokens_per_chunk
    kv = np.empty((1, 2, 1, n * len(ids), layout.head_dim), dtype=np.float16)
    kv[...] = np.repeat(vals, n)[None, None, None, :, None]
    return kv


def _replay(
    trace: Trace,
    store: KVStore,
    model: ModelIdentity,
    ns: Namespace,
    layout: KVLayout,
    progress: Callable[[int], None] | None,
) -> LiveRun:
    n = trace.n_requests
    out = {k: np.zeros(n, np.int64) for k in ("pd", "pk", "pr", "nw", "dr")}
    blocks = trace.blocks.tolist()
    offs = trace.offsets.tolist()
    loaded_bytes = 0
    t0 = time.perf_counter()
    for r in range(n):
        ids = blocks[offs[r] : offs[r + 1]]
        if not ids:
            continue
        tokens = np.empty(2 * len(ids), dtype=np.int64)
        arr = np.asarray(ids, dtype=np.int64)
        tokens[0::2] = arr & 0xFFFFFFFF
        tokens[1::2] = (arr >> 32) & 0xFFFFFFFF
        hit = store.lookup(model, ns, tokens)
        out["pd"][r] = sum(1 for h in hit.hits if h.tier == DRAM)
        out["pk"][r] = sum(1 for h in hit.hits if h.tier == DISK)
        if hit.hits:
            loaded = store.load(hit, request_id=str(r))
            if loaded.loaded != len(hit.hits):
                raise WrongKVServed(f"request {r}: {loaded.loaded} of {len(hit.hits)} loaded")
            want = _payload(ids[: len(hit.hits)], layout)
            got = np.concatenate([a for a in loaded.arrays], axis=3)
            if not np.array_equal(got, want):
                raise WrongKVServed(f"request {r}: a loaded chunk holds another block's KV")
            loaded_bytes += got.nbytes
            # promotion runs in the background; wait for it so that the run is sequential,
            # as the simulation is (the next put must see the promoted chunks)
            store.drain()
        put = store.put_prompt(model, ns, tokens, _payload(ids, layout), request_id=str(r))
        out["pr"][r] = put.already_present
        out["nw"][r] = put.stored
        out["dr"][r] = put.dropped
        if progress is not None and r & 255 == 255:
            progress(256)
    return LiveRun(
        prefix_dram=out["pd"],
        prefix_disk=out["pk"],
        present=out["pr"],
        new=out["nw"],
        dropped=out["dr"],
        seconds=time.perf_counter() - t0,
        bytes_loaded=loaded_bytes,
        counters=store.counters.as_dict(),
    )
