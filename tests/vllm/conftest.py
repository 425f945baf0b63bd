"""Tests that need vLLM (and SGLang's HiCache interface) run in the vLLM virtualenv
(``.venv-vllm``, made by ``make test``); under an interpreter without vLLM this folder is
not collected (the main suite runs without it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

    class _NeedsVLLM(pytest.Module):
        """A test file named on the command line (collect_ignore_glob spares those)
        under an interpreter without vLLM: skipped, with the reason, not an import
        error."""

        def collect(self) -> list[pytest.Item]:
            pytest.skip("needs vLLM: run it with .venv-vllm/bin/python (make test-vllm)")

    def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
        return _NeedsVLLM.from_parent(parent, path=module_path)


ROOT = Path(__file__).resolve().parents[2]


def tiny_llama_dir(path: Path, *, seed: int = 0) -> Path:
    """A random-weight Llama (2 layers, hidden 256, 4 heads, 2 KV heads of 64) saved as
    a transformers directory vLLM can load (no tokenizer: prompts are token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # larger weights: logits far apart, greedy picks are not ties
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    return path


def lora_dir(path: Path, *, seed: int, rank: int = 8) -> Path:
    """A PEFT-format LoRA adapter (q_proj and v_proj of every layer) for
    :func:`tiny_llama_dir`'s model, random weights large enough to change the output."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, out in (("q_proj", 256), ("v_proj", 128)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 256, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def tiny_spec(
    model: Path, requests: list[dict[str, Any]], kvlife: dict[str, Any] | None, **extra: Any
) -> dict[str, Any]:
    """An engine spec for :func:`run_engine`: the tiny model in float32, 32-token blocks,
    64 MiB of paged cache, ``requests`` and the connector's extra config (None: no
    connector); ``extra`` adds or overrides keys."""
    return {
        "model": str(model),
        "skip_tokenizer_init": True,
        "block_size": 32,
        "dtype": "float32",
        "kv_cache_mib": 64,
        "max_model_len": 1024,
        "requests": requests,
        "kvlife": kvlife,
    } | extra


def run_engine(spec: dict[str, Any], work: Path, name: str, timeout: float = 420) -> dict[str, Any]:
    """Run one engine as a child process (kvlife.bench.vllm_runner); its result."""
    spec_path = work / f"{name}.spec.json"
    out_path = work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "kvlife.bench.vllm_runner", str(spec_path), str(out_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"engine {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
