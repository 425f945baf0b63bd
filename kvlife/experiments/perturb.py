"""Perturbations of a serving setting, each of which changes the KV a model computes:
other weights, a LoRA-style adapter, another tokenizer's id mapping, another start
position, another KV dtype, another tenant. Each yields a model (possibly the original),
an identity, a namespace and a start position."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3

from kvlife.core.identity import ModelIdentity, Namespace, NamespaceKind
from kvlife.engines.identity import AdapterSpec, model_identity, tensors_digest


@dataclass
class Setting:
    """Everything that decides the KV of a request."""

    name: str
    model: Any
    identity: ModelIdentity
    namespace: Namespace
    start: int = 0
    note: str = ""


def add_weight_noise(model: Any, scale: float, seed: int) -> Any:
    """A copy whose every weight matrix moved by ``scale`` of its own std (a stand-in for
    a further-trained checkpoint)."""
    import torch

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.std() * scale)
    return other


def attach_lora(model: Any, rank: int, scale: float, seed: int) -> tuple[Any, AdapterSpec]:
    """A copy with low-rank deltas on every q and v projection (forward hooks, base
    weights untouched), and the adapter's id and digest."""
    import torch

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    weights: list[tuple[str, Any]] = []
    for i, layer in enumerate(other.model.layers):
        for name in ("q_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            a = torch.randn(proj.in_features, rank, generator=gen) / proj.in_features**0.5
            b = torch.randn(rank, proj.out_features, generator=gen) * scale
            weights += [(f"{i}.{name}.A", a), (f"{i}.{name}.B", b)]

            def hook(mod: Any, inputs: Any, out: Any, a: Any = a, b: Any = b) -> Any:
                return out + (inputs[0] @ a.to(out.dtype)) @ b.to(out.dtype)

            proj.register_forward_hook(hook)
    return other, AdapterSpec(f"lora-r{rank}-seed{seed}", tensors_digest(weights))


def remap_vocab(model: Any, seed: int) -> Any:
    """A copy whose token ids mean other tokens: embedding (and tied output) rows
    permuted, as a model trained with another tokenizer's id mapping would be."""
    import torch

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    emb = other.get_input_embeddings()
    perm = torch.randperm(emb.weight.shape[0], generator=gen)
    with torch.no_grad():
        emb.weight.copy_(emb.weight[perm])
        out = other.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != emb.weight.data_ptr():
            out.weight.copy_(out.weight[perm])
    return other


def settings(
    base: Setting, tokenizer: Any | None, tokens_per_chunk: int, *, position_offset: int
) -> list[Callable[[], Setting]]:
    """Builders for every perturbed setting (built lazily: some copy the model)."""
    import torch

    tpc = tokens_per_chunk

    def ident(model: Any, **kw: Any) -> ModelIdentity:
        return model_identity(
            model, tokenizer, tokens_per_chunk=tpc, model_id=base.identity.model_id, **kw
        )

    def same() -> Setting:
        return Setting("same setting (control)", base.model, base.identity, base.namespace)

    def weights() -> Setting:
        m = add_weight_noise(base.model, 0.02, seed=1)
        return Setting(
            "other weights",
            m,
            ident(m),
            base.namespace,
            note="every matrix + 2% of its std (a further-trained copy)",
        )

    def adapter() -> Setting:
        m, spec = attach_lora(base.model, rank=8, scale=0.05, seed=2)
        return Setting(
            "LoRA adapter",
            m,
            ident(m, adapter=spec, digest_of_weights=base.identity.weights_digest),
            base.namespace,
            note="rank-8 deltas on q and v projections",
        )

    def tok() -> Setting:
        m = remap_vocab(base.model, seed=3)
        other_tok = blake3.blake3(f"remapped:{base.identity.tokenizer_digest}".encode()).hexdigest()
        identity = dataclasses.replace(ident(m), tokenizer_digest=other_tok)
        return Setting(
            "other tokenizer",
            m,
            identity,
            base.namespace,
            note="same ids, other tokens (vocabulary remapped with the embeddings)",
        )

    def position() -> Setting:
        return Setting(
            "other start position",
            base.model,
            base.identity,
            base.namespace,
            start=position_offset,
            note=f"the same tokens at position {position_offset}",
        )

    def dtype() -> Setting:
        m = copy.deepcopy(base.model).to(torch.bfloat16)
        return Setting(
            "other KV dtype",
            m,
            ident(m),
            base.namespace,
            note="model and KV in bfloat16 (stored KV is float32)",
        )

    def tenant() -> Setting:
        return Setting(
            "other tenant",
            base.model,
            base.identity,
            Namespace(NamespaceKind.ORGANISATION, "other-tenant"),
            note="another organisation's namespace",
        )

    return [same, weights, adapter, tok, position, dtype, tenant]
