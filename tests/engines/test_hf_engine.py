"""The transformers engine with kvlife: exact reuse on a tiny random Llama (SmolLM2 in
the slow tier), identity from the model, and clear errors for what cannot be served."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind  # noqa: E402
from kvlife.engines.errors import (  # noqa: E402
    ContextTooLong,
    IdentityMismatch,
    UnsupportedModel,
)
from kvlife.engines.hf import HFEngine  # noqa: E402
from kvlife.engines.identity import AdapterSpec, model_identity  # noqa: E402
from kvlife.engines.models import LoadedModel, tiny_llama  # noqa: E402
from kvlife.store import KVStore  # noqa: E402

TPC = 32


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama(seed=3)


def _store(path: Path, dram: int = 8 << 20) -> KVStore:
    return KVStore.open(path, dram_bytes=dram, disk_bytes=256 << 20)


def _exactness(loaded: LoadedModel, path: Path, tpc: int, prompt_len: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    with _store(path, dram=2 << 20) as store:  # small DRAM: some chunks come from disk
        eng = HFEngine.for_model(loaded, store, tokens_per_chunk=tpc)
        base = HFEngine.for_model(loaded, None, tokens_per_chunk=tpc)
        first = rng.integers(0, vocab, prompt_len).tolist()
        turn1 = eng.generate(first, PUBLIC, max_new_tokens=40, stop_at_eos=False)
        assert turn1.cached_tokens == 0 and turn1.stored_chunks >= prompt_len // tpc
        second = first + turn1.output_ids + rng.integers(0, vocab, 37).tolist()
        cached = eng.prefill(second, PUBLIC)
        full = base.prefill(second, PUBLIC)
        assert cached.cached_tokens >= (prompt_len // tpc) * tpc
        diff = float((cached.logits - full.logits[cached.cached_tokens :]).abs().max())
        assert diff <= 1e-4, f"suffix logits differ by {diff}"
        with_kv = eng.generate(second, PUBLIC, max_new_tokens=64, stop_at_eos=False)
        without = base.generate(second, PUBLIC, max_new_tokens=64, stop_at_eos=False)
        assert with_kv.cached_tokens > 0
        assert with_kv.output_ids == without.output_ids


def test_injected_prefix_gives_the_logits_and_tokens_of_a_full_prefill(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    _exactness(tiny, tmp_path, TPC, 300, 512)


@pytest.mark.slow
def test_smollm2_exactness(tmp_path: Path) -> None:
    from kvlife.engines.models import load_smollm2

    _exactness(load_smollm2(), tmp_path, 256, 700, 49152)


def test_chunks_come_back_from_the_tier_they_were_demoted_to(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    with _store(tmp_path, dram=64 << 10) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC)
        ids = rng.integers(0, 512, 10 * TPC + 5).tolist()
        eng.generate(ids, PUBLIC, max_new_tokens=2)
        again = eng.generate(ids, PUBLIC, max_new_tokens=2)
        assert again.cached_tokens == 10 * TPC
        assert again.tiers.get("disk", 0) > 0 and sum(again.tiers.values()) == 10


def test_identity_comes_from_the_model(tiny: LoadedModel) -> None:
    ident = model_identity(tiny.model, None, tokens_per_chunk=TPC)
    assert ident.layout.num_layers == 3 and ident.layout.num_kv_heads == 2
    assert ident.layout.head_dim == 16 and ident.layout.dtype == "float32"
    other = copy.deepcopy(tiny.model)
    with torch.no_grad():
        other.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-3
    assert model_identity(other, None, tokens_per_chunk=TPC).weights_digest != ident.weights_digest
    assert model_identity(copy.deepcopy(tiny.model), None, tokens_per_chunk=TPC) == ident
    lora = model_identity(tiny.model, None, tokens_per_chunk=TPC, adapter=AdapterSpec("a", "d"))
    assert lora.digest != ident.digest
    other_rope = tiny_llama(seed=3, rope_theta=50000.0)
    assert (
        model_identity(other_rope.model, None, tokens_per_chunk=TPC).position_encoding_digest
        != ident.position_encoding_digest
    )


def test_namespaces_and_positions_do_not_share(tiny: LoadedModel, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 512, 4 * TPC + 1).tolist()
    with _store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC)
        eng.generate(ids, Namespace(NamespaceKind.USER, "a"), max_new_tokens=1)
        assert eng.prefill(ids, Namespace(NamespaceKind.USER, "b")).cached_tokens == 0
        assert eng.prefill(ids, Namespace(NamespaceKind.USER, "a")).cached_tokens == 4 * TPC
        assert eng.prefill(ids, Namespace(NamespaceKind.USER, "a"), start=7).cached_tokens == 0


class _NoCacheModel(torch.nn.Module):  # type: ignore[name-defined,misc]
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            hidden_size=8,
            vocab_size=10,
            max_position_embeddings=64,
        )

    def forward(self, **kwargs: Any) -> Any:
        return SimpleNamespace(logits=torch.zeros(1, 1, 10))


def test_bad_models_and_requests_get_clear_errors(tiny: LoadedModel, tmp_path: Path) -> None:
    bare = _NoCacheModel()
    ident = model_identity(bare, None, tokens_per_chunk=TPC)
    with pytest.raises(UnsupportedModel, match="DynamicCache"):
        HFEngine(bare, None, ident)
    with pytest.raises(UnsupportedModel, match="not Llama-style"):
        model_identity(SimpleNamespace(config=SimpleNamespace()), None)
    with _store(tmp_path) as store:
        eng = HFEngine.for_model(tiny, store, tokens_per_chunk=TPC)
        with pytest.raises(ContextTooLong, match="4096"):
            eng.generate(list(range(100)) * 41, PUBLIC, max_new_tokens=8)
        with pytest.raises(ContextTooLong, match="empty"):
            eng.prefill([], PUBLIC)
        other = tiny_llama(seed=4, layers=2)
        wrong = model_identity(other.model, None, tokens_per_chunk=TPC)
        with pytest.raises(IdentityMismatch, match="layers"):
            HFEngine(tiny.model, store, wrong)
        assert store.counters.chunks_stored == 0
