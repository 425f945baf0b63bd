"""Parity: k-of-n erasure coding (pyeclib, ISA-L) of chunks and of the disk tier's segment
files. Real files are deleted, truncated or damaged and rebuilt bit-exact."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.store import KVStore
from kvlife.transforms.parity import (
    ParityCode,
    ParityError,
    ParityGroup,
    UnknownParityFormat,
    member_status,
    protect_files,
    read_group,
    rebuild_files,
)
from tests.conftest import TINY, prompt_kv

pytest.importorskip("pyeclib")

N = TINY.tokens_per_chunk


@settings(max_examples=25, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=20_000),
    k=st.integers(1, 6),
    m=st.integers(1, 3),
    seed=st.integers(0, 1 << 30),
)
def test_any_k_fragments_give_the_data_back(data: bytes, k: int, m: int, seed: int) -> None:
    code = ParityCode(k, m)
    frags = code.encode(data)
    assert len(frags) == k + m
    keep = np.random.default_rng(seed).permutation(k + m)[:k]
    assert code.decode([frags[i] for i in keep]) == data
    lost = sorted(set(range(k + m)) - set(int(i) for i in keep))[:m]
    rebuilt = code.reconstruct([frags[i] for i in keep], lost)
    assert rebuilt == [frags[i] for i in lost]


def test_too_few_fragments_is_a_typed_error() -> None:
    code = ParityCode(4, 2)
    frags = code.encode(b"x" * 5000)
    with pytest.raises(ParityError):
        code.decode(frags[:3])
    with pytest.raises(InvalidArgument):
        ParityCode(0, 2)


def _files(d: Path, sizes: list[int], seed: int) -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {}
    for i, size in enumerate(sizes):
        data = rng.bytes(size)
        (d / f"seg-{i + 1:08d}.kvs").write_bytes(data)
        out[f"seg-{i + 1:08d}.kvs"] = data
    return out


@pytest.mark.parametrize("lose", [[0], [3], [1, 2], [0, 3]])
def test_deleted_files_are_rebuilt_bit_exact(tmp_path: Path, lose: list[int]) -> None:
    data, pdir = tmp_path / "seg", tmp_path / "par"
    orig = _files(data, [300_000, 70_000, 4096, 123_457], 1)
    names = sorted(orig)
    group = protect_files([data / n for n in names], pdir, "g", k=4, m=2, stripe_bytes=65536)
    assert read_group(pdir / "g.kvpar") == group
    for i in lose:
        (data / names[i]).unlink()
    lost = [names[i] for i in lose]
    assert member_status(group, data) == dict.fromkeys(lost, "absent")
    rebuild_files(group, data, pdir, lost)
    assert {n: (data / n).read_bytes() for n in names} == orig
    assert member_status(group, data, full=True) == {n: "changed" for n in lost}  # new inodes


def test_three_losses_of_a_2_parity_group_are_refused(tmp_path: Path) -> None:
    data, pdir = tmp_path / "seg", tmp_path / "par"
    orig = _files(data, [10_000] * 4, 2)
    names = sorted(orig)
    group = protect_files([data / n for n in names], pdir, "g", k=4, m=2, stripe_bytes=4096)
    for n in names[:2]:
        (data / n).unlink()
    (pdir / group.parity[0].name).unlink()
    with pytest.raises(ParityError, match="only 2 can be rebuilt"):
        rebuild_files(group, data, pdir, names[:2])
    assert not any(p.name.endswith(".rebuild") for p in data.iterdir()), "a partial file left"


def test_a_damaged_survivor_never_yields_a_wrong_file(tmp_path: Path) -> None:
    """A survivor whose bytes changed without a trace (same size, stamp forged) makes
    the rebuilt file fail its checksum: refused, nothing written."""
    data, pdir = tmp_path / "seg", tmp_path / "par"
    orig = _files(data, [20_000] * 3, 3)
    names = sorted(orig)
    group = protect_files([data / n for n in names], pdir, "g", k=3, m=1, stripe_bytes=4096)
    st_before = os.stat(data / names[1])
    with (data / names[1]).open("r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff\xee")
    os.utime(data / names[1], ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
    (data / names[0]).unlink()
    with pytest.raises(ParityError, match="do not match their checksums"):
        rebuild_files(group, data, pdir, [names[0]])
    assert not (data / names[0]).exists()


def test_damaged_or_unknown_manifest_is_typed(tmp_path: Path) -> None:
    data, pdir = tmp_path / "seg", tmp_path / "par"
    orig = _files(data, [5000, 6000], 4)
    group = protect_files([data / n for n in sorted(orig)], pdir, "g", k=2, m=1)
    blob = bytearray(group.encode())
    for at in (0, 5, 20, len(blob) - 1):
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(ParityError):
            ParityGroup.decode(bytes(bad))
    import msgpack
    import xxhash

    body = msgpack.packb([99, "isa_l_rs_vand"])
    head = b"KVPM" + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    with pytest.raises(UnknownParityFormat):
        ParityGroup.decode(head + body)


def _open(path: Path) -> KVStore:
    return KVStore.open(
        path,
        dram_bytes=0,
        disk_bytes=1 << 24,
        segment_bytes=16 << 10,
        segment_parity=(3, 2),
    )


def test_store_rebuilds_a_deleted_segment_file_at_open(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """The real thing: a store closes (its segments get parity), a whole segment file is
    deleted, the next open rebuilds it and every chunk loads bit-exact."""
    tokens, kv = prompt_kv(21, 24 * N)
    with _open(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    segdir = tmp_path / "disk" / "segments"
    segs = sorted(p for p in segdir.iterdir() if p.stat().st_size > 0)
    assert len(segs) >= 4, "the test needs several segment files"
    manifests = list((tmp_path / "disk" / "parity").glob("*.kvpar"))
    assert len(manifests) == -(-len(segs) // 3)
    victims = [segs[1], segs[2]]  # two of one group: m = 2
    before = {v.name: v.read_bytes() for v in victims}
    for v in victims:
        v.unlink()
    with _open(tmp_path) as store:
        assert store.counters.segments_rebuilt == 2
        assert sorted(store.parity_repair.rebuilt) == sorted(f"disk/{v.name}" for v in victims)
        assert {v.name: v.read_bytes() for v in victims} == before
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert res.loaded == len(keys)
        for i, arr in enumerate(res.arrays):
            assert np.array_equal(arr, kv[:, :, :, i * N : (i + 1) * N])
        assert store.check().clean


def test_without_parity_a_deleted_segment_is_lost(tmp_path: Path, identity: ModelIdentity) -> None:
    """The same loss without parity: the chunks in that file are gone (a peer check that
    the rebuild above is what saved them)."""
    tokens, kv = prompt_kv(22, 24 * N)
    cfg = {"dram_bytes": 0, "disk_bytes": 1 << 24, "segment_bytes": 16 << 10}
    with KVStore.open(tmp_path, **cfg) as store:  # type: ignore[arg-type]
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    segs = sorted(p for p in (tmp_path / "disk" / "segments").iterdir() if p.stat().st_size)
    segs[1].unlink()
    with KVStore.open(tmp_path, **cfg) as store:  # type: ignore[arg-type]
        assert store.load(store.lookup(identity, PUBLIC, tokens)).loaded < len(keys)


def test_groups_follow_segments_that_go(tmp_path: Path, identity: ModelIdentity) -> None:
    """Invalidation empties segments (their files go); the next close drops the groups
    that named them and protects the survivors anew; a later loss is still rebuilt."""
    tokens, kv = prompt_kv(23, 24 * N)
    with _open(tmp_path) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
    with _open(tmp_path) as store:
        store.invalidate(prefix=keys[12])  # the second half of the prompt
    pdir = tmp_path / "disk" / "parity"
    segs = sorted(p for p in (tmp_path / "disk" / "segments").iterdir() if p.stat().st_size)
    groups = [read_group(m) for m in pdir.glob("*.kvpar")]
    protected = {x.name for g in groups for x in g.members}
    assert {p.name for p in segs} <= protected
    assert all(not member_status(g, tmp_path / "disk" / "segments") for g in groups)
    segs[0].unlink()
    with _open(tmp_path) as store:
        assert store.counters.segments_rebuilt == 1
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert res.loaded == 12


def test_a_damaged_manifest_is_replaced_at_the_next_close(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """A manifest that no longer verifies protects nothing: the next close drops it and
    its parity files (and leftovers of a killed pass) and protects its segments anew."""
    tokens, kv = prompt_kv(24, 12 * N)
    with _open(tmp_path) as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    pdir = tmp_path / "disk" / "parity"
    victim = sorted(pdir.glob("*.kvpar"))[0]
    old_parity = {p.name for p in pdir.glob(victim.name[: -len(".kvpar")] + ".p*.kvp")}
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    victim.write_bytes(bytes(blob))
    (pdir / "g-orphan.p0.kvp").write_bytes(b"left by a killed pass")
    (tmp_path / "disk" / "segments" / ".seg-00000001.kvs.rebuild").write_bytes(b"partial")
    with _open(tmp_path) as store:
        assert store.parity_repair.unusable, "the damaged manifest was not reported"
    names = {p.name for p in pdir.iterdir()}
    assert victim.name not in names and not (old_parity & names)
    assert "g-orphan.p0.kvp" not in names
    assert not (tmp_path / "disk" / "segments" / ".seg-00000001.kvs.rebuild").exists()
    segs = sorted(p for p in (tmp_path / "disk" / "segments").iterdir() if p.stat().st_size)
    protected = {x.name for m in pdir.glob("*.kvpar") for x in read_group(m).members}
    assert {p.name for p in segs} <= protected
    segs[0].unlink()
    with _open(tmp_path) as store:
        assert store.counters.segments_rebuilt == 1
        assert store.load(store.lookup(identity, PUBLIC, tokens)).loaded == 12


def test_full_verify_rebuilds_a_segment_decayed_in_place(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """Bytes of a sealed segment change without a trace (same size, inode and mtime):
    a header-checking open would find the frame corrupt at a load; with
    verify_on_open="full" the open hashes every protected segment first and rebuilds it."""
    tokens, kv = prompt_kv(25, 12 * N)

    def opened(verify: str) -> KVStore:
        return KVStore.open(
            tmp_path,
            dram_bytes=0,
            disk_bytes=1 << 24,
            segment_bytes=16 << 10,
            segment_parity=(3, 2),
            verify_on_open=verify,
        )

    with opened("header") as store:
        store.put_prompt(identity, PUBLIC, tokens, kv)
    seg = sorted(p for p in (tmp_path / "disk" / "segments").iterdir() if p.stat().st_size)[1]
    before = seg.read_bytes()
    st = os.stat(seg)
    with seg.open("r+b") as fh:
        fh.seek(len(before) // 2)
        fh.write(bytes(b ^ 0xFF for b in before[len(before) // 2 : len(before) // 2 + 8]))
    os.utime(seg, ns=(st.st_atime_ns, st.st_mtime_ns))
    with opened("full") as store:
        assert store.counters.segments_rebuilt == 1
        assert seg.read_bytes() == before
        res = store.load(store.lookup(identity, PUBLIC, tokens))
        assert res.loaded == 12 and not res.corrupt
