"""The identity kvlife gives a vLLM engine's KV (no vLLM needed): file digests cached by
(path, size, mtime), the tensor-parallel shard, LoRA adapters, block size, dtype and the
request's cache_salt all change the key; the chunk size must be whole blocks."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvlife.core.identity import PUBLIC, NamespaceKind, prompt_chunk_keys
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


def test_weight_digest_is_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    w = model / "model.safetensors"
    w.write_bytes(b"a" * 1000)
    d1 = vid.weights_digest_of_dir(model)
    index = json.loads((tmp_path / "cache" / "file-digests.json").read_text())
    assert len(index) == 1 and next(iter(index)).startswith(str(w.resolve()))
    # same bytes rewritten with a new mtime: a new entry, the same digest
    os.utime(w, ns=(1, 1))
    assert vid.weights_digest_of_dir(model) == d1
    assert len(json.loads((tmp_path / "cache" / "file-digests.json").read_text())) == 2
    w.write_bytes(b"a" * 999 + b"b")  # one byte changed: another model version
    assert vid.weights_digest_of_dir(model) != d1
    (model / "extra.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModel, match="no weight files"):
        vid.weights_digest_of_dir(tmp_path / "cache")


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
