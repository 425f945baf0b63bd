"""A disk segment emptied while it was the active one is reclaimed once it is sealed
(it used to stay forever: ``kvlife check`` of the closed store listed it as an orphan and
the next open moved it to ``quarantine/``), and never before the frames a batch placed
in it are published."""

from __future__ import annotations

from pathlib import Path

import blake3
import numpy as np

from kvlife.core.identity import PUBLIC, ChunkKey, ModelIdentity
from kvlife.store import KVStore
from kvlife.tiers.base import ReplicaMeta
from kvlife.tiers.disk import DiskTier, DiskTierConfig
from kvlife.tiers.disk.audit import audit_directory
from tests.conftest import TINY, prompt_kv

N = TINY.tokens_per_chunk
SEGMENT = 16 << 10
"""Two 8 KiB frames (a 4 KiB header page and a payload of at most 4 KiB) per segment."""


def segment_names(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "segments").glob("seg-*.kvs"))


def test_segment_emptied_while_active_is_reclaimed_when_sealed(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    opts: dict[str, object] = {"dram_bytes": 0, "disk_bytes": 1 << 20, "segment_bytes": SEGMENT}
    with KVStore.open(tmp_path, **opts) as store:  # type: ignore[arg-type]
        for seed in range(3):  # A and B fill segment 1 and are deleted; C seals it
            tokens, kv = prompt_kv(seed, N)
            put = store.put_prompt(identity, PUBLIC, tokens, kv)
            if seed < 2:
                assert store.invalidate(prefix=put.keys[0]) == 1
        assert store.check().clean
        disk = store.tier("disk").details()
        assert disk["segments"] == 1 and disk["segments_reclaimed"] == 1
        assert segment_names(tmp_path / "disk") == ["seg-00000002.kvs"]
        last = prompt_kv(2, N)[0]
    report = audit_directory(tmp_path)
    assert report.clean and not report.orphan_segments, report
    with KVStore.open(tmp_path, **opts) as store:  # type: ignore[arg-type]
        assert store.check().clean
        quarantine = tmp_path / "disk" / "quarantine"
        assert not quarantine.exists() or not list(quarantine.iterdir())
        assert store.load(store.lookup(identity, PUBLIC, last)).loaded == 1


def _key(i: int) -> ChunkKey:
    return ChunkKey(blake3.blake3(b"reclaim%d" % i).digest())


def _payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(1024).astype(np.float16)  # 2 KiB


def _store(tier: DiskTier, ids: list[int]) -> None:
    arrs = [_payload(i) for i in ids]
    metas = [
        ReplicaMeta(_key(i), "float16", a.shape, "exact", b"")
        for i, a in zip(ids, arrs, strict=True)
    ]
    assert tier.store(metas, arrs)


def test_a_batch_spanning_the_seal_keeps_its_frames_in_the_emptied_segment(
    tmp_path: Path,
) -> None:
    """The emptied active segment takes the first frame of a batch whose second frame
    seals it: it holds a live frame again once the batch is published, and is kept."""
    tier = DiskTier(tmp_path, DiskTierConfig(1 << 20, segment_bytes=SEGMENT, direct_io=False))
    try:
        _store(tier, [0])
        tier.delete(_key(0))  # the active segment is empty, half full of garbage
        _store(tier, [1, 2])  # 1 lands in it, 2 seals it and starts the next
        assert tier.segment_count == 2
        for i in (1, 2):
            assert np.array_equal(tier.read(_key(i)), _payload(i))
        tier.delete(_key(1))  # now it is sealed and empty: gone at once
        assert tier.segment_count == 1
        assert np.array_equal(tier.read(_key(2)), _payload(2))
        assert tier.check().clean
    finally:
        tier.close()
    assert segment_names(tmp_path) == ["seg-00000002.kvs"]
