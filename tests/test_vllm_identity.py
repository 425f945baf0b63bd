"""The identity kvlife gives a vLLM engine's KV (no vLLM needed): file digests cached by
a fingerprint a copied checkpoint cannot fake (path, size, mtime, inode, ctime, sampled
bytes), the tensor-parallel shard, the pipeline stage, LoRA adapters, block size, dtype
and the request's cache_salt all change the key; the chunk size must be whole blocks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from kvlife.core.identity import PUBLIC, NamespaceKind, prompt_chunk_keys
from kvlife.engines import identity as eid
from kvlife.engines.errors import UnsupportedModel
from kvlife.engines.vllm import identity as vid


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLIFE_CACHE", str(tmp_path / "cache"))


def _facts(**kw: object) -> vid.EngineFacts:
    base = vid.EngineFacts(
        model="/models/m",
        revision="",
        weights_digest="w",
        tokenizer_digest="t",
        position_digest="rope",
        num_layers=4,
        total_kv_heads=8,
        head_dim=64,
        kv_dtype="bfloat16",
        compute_dtype="bfloat16",
        block_size=16,
        tp_size=1,
        engine_version="0.32.0",
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def _key(ident: object, salt: str | None = None) -> bytes:
    policy = vid.NamespacePolicy(PUBLIC)
    keys = prompt_chunk_keys(ident, policy.namespace(salt), list(range(64)))  # type: ignore[arg-type]
    return bytes(keys[0])


def test_weight_digest_is_cached_per_file_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m"
    model.mkdir()
    w = model / "model.safetensors"
    w.write_bytes(b"a" * 1000)
    index_file = tmp_path / "cache" / "file-digests.json"
    d1 = vid.weights_digest_of_dir(model)
    assert not index_file.exists(), "a file written just now is racy: hashed, not cached"
    monkeypatch.setattr(eid, "RACY_NS", 0)
    assert vid.weights_digest_of_dir(model) == d1
    index = json.loads(index_file.read_text())
    assert len(index) == 1 and next(iter(index)).startswith(str(w.resolve()))
    # same bytes with a new mtime: a new entry, the same digest
    os.utime(w, ns=(1, 1))
    assert vid.weights_digest_of_dir(model) == d1
    assert len(json.loads(index_file.read_text())) == 2
    w.write_bytes(b"a" * 999 + b"b")  # one byte changed: another model version
    assert vid.weights_digest_of_dir(model) != d1
    (model / "extra.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModel, match="no weight files"):
        vid.weights_digest_of_dir(tmp_path / "cache")


def _copy_keeping_mtime(src: Path, dst: Path, *, rename: bool) -> None:
    """Put ``src``'s bytes at ``dst`` with ``dst``'s old mtime, as ``cp -p`` of a
    checkpoint with a fixed mtime does (in place), or ``rsync -a`` (a temporary file
    renamed over it: a new inode)."""
    st = dst.stat()
    if rename:
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copyfile(src, tmp)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, dst)
    else:
        shutil.copyfile(src, dst)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("rename", [False, True])
@pytest.mark.parametrize("settled", [False, True])
def test_a_same_size_checkpoint_copied_with_its_mtime_preserved_gets_a_new_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rename: bool, settled: bool
) -> None:
    """Another checkpoint of the same size, copied over the weights file keeping its
    mtime: the cached digest of the old one must not be served for it (its KV would be
    keyed as the old weights'). ``settled``: the file is not racy, so the fingerprint's
    inode, ctime and sampled bytes are what catch it."""
    if settled:
        monkeypatch.setattr(eid, "RACY_NS", 0)
    model = tmp_path / "m"
    model.mkdir()
    w = model / "model.safetensors"
    w.write_bytes(bytes(range(256)) * 64)
    os.utime(w, ns=(1_600_000_000 * 10**9, 1_600_000_000 * 10**9))
    d1 = vid.weights_digest_of_dir(model)
    other = tmp_path / "other.safetensors"
    other.write_bytes(bytes(range(255, -1, -1)) * 64)  # same size, other weights
    _copy_keeping_mtime(other, w, rename=rename)
    assert w.stat().st_size == other.stat().st_size
    d2 = vid.weights_digest_of_dir(model)
    assert d2 != d1
    assert vid.weights_digest_of_dir(model) == d2
    monkeypatch.setenv("KVLIFE_CACHE", str(tmp_path / "fresh-cache"))
    assert vid.weights_digest_of_dir(model) == d2, "d2 is the new bytes' digest"


def test_a_rewrite_the_sample_misses_is_caught_by_ctime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eid, "RACY_NS", 0)
    model = tmp_path / "m"
    model.mkdir()
    w = model / "model.safetensors"
    w.write_bytes(b"\0" * (1 << 20))
    d1 = vid.weights_digest_of_dir(model)
    time.sleep(0.05)  # past the filesystem's timestamp tick
    st = w.stat()
    with w.open("r+b") as f:  # one byte between two sampled blocks, in place
        f.seek(5000)
        f.write(b"\1")
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_ino == st.st_ino and w.stat().st_mtime_ns == st.st_mtime_ns
    assert vid.weights_digest_of_dir(model) != d1


def test_the_transformers_weights_cache_tells_a_copied_checkpoint_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(eid, "RACY_NS", 0)
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"a" * 4096)
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 4)
    assert eid.cached_weights_digest(first, w) == eid.weights_digest(first)
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"b" * 4096)
    time.sleep(0.05)
    _copy_keeping_mtime(other, w, rename=False)
    torch.manual_seed(1)
    second = torch.nn.Linear(4, 4)  # the model loaded from the copied file
    assert eid.cached_weights_digest(second, w) == eid.weights_digest(second)


def test_tokenizer_digest_covers_the_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"v": 1}')
    d1 = vid.tokenizer_digest_of_dir(tmp_path, 100)
    (tmp_path / "chat_template.jinja").write_text("{{ x }}")
    assert vid.tokenizer_digest_of_dir(tmp_path, 100) != d1
    assert vid.tokenizer_digest_of_dir(None, 100) != vid.tokenizer_digest_of_dir(None, 101)


def test_every_engine_fact_changes_the_key() -> None:
    base = vid.identity_for(_facts(), tp_rank=0, tokens_per_chunk=64)
    k = _key(base)
    changes = {
        "model": "/models/other",
        "revision": "abc",
        "weights_digest": "w2",
        "tokenizer_digest": "t2",
        "position_digest": "rope2",
        "num_layers": 5,
        "total_kv_heads": 4,
        "head_dim": 128,
        "kv_dtype": "float16",
        "compute_dtype": "float32",
        "block_size": 32,
        "tp_size": 2,
        "engine_version": "0.33.0",
    }
    for name, value in changes.items():
        other = vid.identity_for(_facts(**{name: value}), tp_rank=0, tokens_per_chunk=64)
        assert _key(other) != k, name


def test_tensor_parallel_shards_never_share_keys() -> None:
    facts = _facts(tp_size=4)
    shards = [vid.identity_for(facts, tp_rank=r, tokens_per_chunk=64) for r in range(4)]
    assert [(s.layout.kv_head_start, s.layout.num_kv_heads) for s in shards] == [
        (0, 2),
        (2, 2),
        (4, 2),
        (6, 2),
    ]
    assert len({_key(s) for s in shards}) == 4
    unsharded = vid.identity_for(_facts(), tp_rank=0, tokens_per_chunk=64)
    assert _key(unsharded) not in {_key(s) for s in shards}
    # fewer KV heads than ranks: heads are replicated, each rank still its own key
    assert vid.shard_heads(2, 4, 3) == (1, 1)
    with pytest.raises(UnsupportedModel, match="split evenly"):
        vid.shard_heads(6, 4, 0)


def test_lora_adapter_and_cache_salt_isolate(tmp_path: Path) -> None:
    base = vid.identity_for(_facts(), tp_rank=0, tokens_per_chunk=64)
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_model.safetensors").write_bytes(b"lora-weights")
    (lora / "adapter_config.json").write_text('{"r": 8}')
    a1 = vid.adapter_spec("sql", 1, str(lora))
    assert a1.adapter_id == "sql#1"
    keys = {
        _key(base),
        _key(vid.with_adapter(base, a1)),
        _key(vid.with_adapter(base, vid.adapter_spec("sql", 2, str(lora)))),
    }
    (lora / "adapter_model.safetensors").write_bytes(b"lora-weights-v2")
    keys.add(_key(vid.with_adapter(base, vid.adapter_spec("sql", 1, str(lora)))))
    assert len(keys) == 4, "adapter name, id and weights each change the key"
    assert vid.with_adapter(base, None) is base
    salts = {_key(base, None), _key(base, "tenant-a"), _key(base, "tenant-b")}
    assert len(salts) == 3
    policy = vid.NamespacePolicy(PUBLIC, NamespaceKind.USER)
    assert policy.namespace("bob").kind is NamespaceKind.USER
    with pytest.raises(UnsupportedModel, match="not a directory"):
        vid.adapter_spec("x", 1, str(tmp_path / "missing"))


def test_chunks_must_be_whole_blocks() -> None:
    with pytest.raises(UnsupportedModel, match="whole number of vLLM blocks"):
        vid.identity_for(_facts(block_size=32), tp_rank=0, tokens_per_chunk=48)


def test_pipeline_stages_never_share_keys() -> None:
    """With PP=2 each stage computes the KV of its own layers: stage 1's chunk of a
    prompt must never answer stage 0's lookup (or be 'present' for its put), even when
    both stages hold the same number of layers."""
    facts = _facts(num_layers=32, tp_size=2, pp_size=2, stage_layers=((0, 16), (16, 32)))
    assert facts.ranks == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ids = {
        (pp, tp): vid.identity_for(facts, tp_rank=tp, pp_rank=pp, tokens_per_chunk=64)
        for pp, tp in facts.ranks
    }
    assert [(i.layout.num_layers, i.layout.first_layer) for i in ids.values()] == [
        (16, 0),
        (16, 0),
        (16, 16),
        (16, 16),
    ]
    keys = {_key(i) for i in ids.values()}
    assert len(keys) == 4
    # nor is a stage the unpipelined model of its layer count
    flat = vid.identity_for(_facts(num_layers=16, tp_size=2), tp_rank=0, tokens_per_chunk=64)
    assert _key(flat) not in keys
    uneven = _facts(num_layers=5, pp_size=2, stage_layers=((0, 3), (3, 5)))
    assert (
        vid.identity_for(uneven, tp_rank=0, pp_rank=1, tokens_per_chunk=64).layout.num_layers == 2
    )
    with pytest.raises(UnsupportedModel, match="pipeline stage 2"):
        vid.identity_for(facts, tp_rank=0, pp_rank=2, tokens_per_chunk=64)
    with pytest.raises(UnsupportedModel, match="stage layer ranges"):
        vid.identity_for(_facts(pp_size=2), tp_rank=0, pp_rank=0, tokens_per_chunk=64)
