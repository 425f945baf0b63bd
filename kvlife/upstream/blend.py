"""Selective recompute over reused segment KV (the CacheBlend, EuroSys'25, algorithm).

A prompt is assembled from segments whose KV was computed elsewhere (another position,
another context) and moved into place by :mod:`kvlife.upstream.rope`. That KV misses the
attention of each segment's tokens to the segments now before it. CacheBlend restores
most of it by recomputing a small set of tokens: the layers before ``check_layer`` are
computed for every token (cheap: one layer of thirty for SmolLM2); at ``check_layer``
the fresh keys and values of every token are compared with the reused ones and the
``ratio`` of reused tokens that deviate most (squared L2 of K and V over heads, the
"high-KV-deviation" tokens) are kept for recompute with every token not covered by a
reused segment; from there on only those tokens run through the layers, their fresh KV
written over the reused KV in place and their queries attending to the whole blended
cache. The last token is always recomputed (its logits are the first output).

An exact prefix (KV the store served for the prompt's first tokens) can be given too: it
is taken as it is, and only the tokens after it are computed or selected, so segment
reuse only ever replaces recompute, never exact reuse.

The forward is written out for Llama-style decoder layers with the model's own modules
(norms, projections, rotary embedding, MLP) so only the selected rows run; with every
token selected it is the model's ordinary prefill (a test holds it to the model's
logits). The result is lossy: :mod:`kvlife.upstream.segments` gives it a contract and
serves it only where a lookup's ``Accept`` takes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlife.core.errors import InvalidArgument
from kvlife.engines.errors import UnsupportedModel

DEFAULT_RATIO = 0.15
"""Share of reused tokens recomputed (CacheBlend's default)."""
DEFAULT_CHECK_LAYER = 1
"""Layer at which deviations are measured: the first whose inputs carry attention."""


@dataclass(frozen=True, slots=True)
class ReusedSpan:
    """KV reused for the tokens ``[start, start + T)`` of a prompt, already moved to
    those positions: a tensor ``(layers, 2, kv_heads, T, head_dim)``."""

    start: int
    kv: Any


@dataclass(slots=True)
class Blended:
    """The outcome of one blended prefill."""

    logits: Any
    """Logits of the last prompt position, shape ``[1, vocab]``."""
    cache: Any
    """A ``DynamicCache`` holding the blended KV of every prompt token."""
    recomputed: list[int]
    """Positions run through every layer (not covered by reuse, or selected)."""
    reused_tokens: int
    """Tokens covered by reused KV (the exact prefix included)."""
    exact_tokens: int
    """Tokens of the exact prefix taken as given."""
    compute_fraction: float
    """Token-layers computed over those of a full prefill."""


def compute_kv(model: Any, ids: Sequence[int], start: int = 0) -> Any:
    """KV ``(layers, 2, kv_heads, T, head_dim)`` of ``ids`` alone at positions
    ``start..`` (the model's own forward), as a float tensor."""
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([list(ids)], dtype=torch.long),
            position_ids=torch.arange(start, start + len(ids))[None],
            use_cache=True,
        )
    return torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]) for layer in out.cache.layers]
    )


class SegmentBlender:
    """CacheBlend-style prefill of a Llama-style transformers model."""

    def __init__(
        self,
        model: Any,
        *,
        ratio: float = DEFAULT_RATIO,
        check_layer: int = DEFAULT_CHECK_LAYER,
    ) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise InvalidArgument(f"recompute ratio must be in [0, 1], got {ratio}")
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(model, "lm_head"):
            raise UnsupportedModel(f"{type(model).__name__} is not a Llama-style causal LM")
        if not 0 <= check_layer < len(layers):
            raise InvalidArgument(f"check_layer {check_layer} outside 0..{len(layers) - 1}")
        self.model = model
        self.ratio = ratio
        self.check_layer = check_layer
        self.config = model.config

    def prefill(
        self, ids: Sequence[int], reused: Sequence[ReusedSpan] = (), exact: Any | None = None
    ) -> Blended:
        """Prefill ``ids`` at positions ``0..`` reusing ``reused`` (disjoint spans).

        ``exact``: the exact KV ``(layers, 2, kv_heads, P, head_dim)`` of the first ``P``
        tokens (a prefix the store served): taken as it is, never recomputed nor
        selected, and the reused spans must start at or after ``P``."""
        import torch
        from transformers import DynamicCache
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        n = len(ids)
        if n == 0:
            raise InvalidArgument("empty prompt: nothing to prefill")
        inner = self.model.model
        layers = inner.layers
        nl = len(layers)
        p = 0 if exact is None else int(exact.shape[3])
        if not 0 <= p < n:
            raise InvalidArgument(f"an exact prefix of {p} tokens leaves none of {n} to prefill")
        covered = torch.zeros(n, dtype=torch.bool)
        for r in reused:
            t = int(r.kv.shape[3])
            if r.start < p or r.start + t > n or bool(covered[r.start : r.start + t].any()):
                raise InvalidArgument(f"reused span [{r.start}, {r.start + t}) overlaps/overruns")
            if int(r.kv.shape[0]) != nl:
                raise InvalidArgument(f"reused KV has {r.kv.shape[0]} layers, the model {nl}")
            covered[r.start : r.start + t] = True
        pos = torch.arange(n)
        with torch.no_grad():
            h = inner.embed_tokens(torch.tensor([list(ids[p:])], dtype=torch.long))
            cos, sin = inner.rotary_emb(h, pos[None])
            attn0 = layers[0].self_attn
            kvh = self.config.num_key_value_heads
            shape = (1, kvh, n, attn0.head_dim)
            keys = [torch.zeros(shape, dtype=h.dtype) for _ in range(nl)]
            values = [torch.zeros(shape, dtype=h.dtype) for _ in range(nl)]
            for r in reused:
                sl = slice(r.start, r.start + int(r.kv.shape[3]))
                for li in range(nl):
                    keys[li][0, :, sl] = r.kv[li, 0].to(h.dtype)
                    values[li][0, :, sl] = r.kv[li, 1].to(h.dtype)
            if exact is not None:
                for li in range(nl):
                    keys[li][0, :, :p] = exact[li, 0].to(h.dtype)
                    values[li][0, :, :p] = exact[li, 1].to(h.dtype)
            sel = pos[p:]
            token_layers = 0
            for li, layer in enumerate(layers):
                attn = layer.self_attn
                if li == self.check_layer and bool(covered.any()):
                    sel = self._select(layer, h, cos, sin, keys[li], values[li], covered, p)
                    h = h[:, sel - p]  # rows of h are positions p.. until here
                token_layers += len(sel)
                x = layer.input_layernorm(h)
                hs = (1, len(sel), -1, attn.head_dim)
                q = attn.q_proj(x).view(hs).transpose(1, 2)
                k = attn.k_proj(x).view(hs).transpose(1, 2)
                v = attn.v_proj(x).view(hs).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos[:, sel], sin[:, sel])
                keys[li][:, :, sel] = k
                values[li][:, :, sel] = v
                groups = attn.num_key_value_groups
                kk = keys[li].repeat_interleave(groups, dim=1)
                vv = values[li].repeat_interleave(groups, dim=1)
                mask = pos[None, :] <= sel[:, None]  # causal by position, not by row
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, kk, vv, attn_mask=mask, scale=attn.scaling
                )
                h = h + attn.o_proj(out.transpose(1, 2).reshape(1, len(sel), -1))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            logits = self.model.lm_head(inner.norm(h[:, -1:]))[0]
        cache = DynamicCache(config=self.config)
        for li in range(nl):
            cache.update(keys[li], values[li], li)
        return Blended(
            logits=logits,
            cache=cache,
            recomputed=[int(i) for i in sel],
            reused_tokens=int(covered.sum()) + p,
            exact_tokens=p,
            compute_fraction=token_layers / (nl * n),
        )

    def _select(
        self,
        layer: Any,
        h: Any,
        cos: Any,
        sin: Any,
        k_old: Any,
        v_old: Any,
        covered: Any,
        p: int,
    ) -> Any:
        """Positions to recompute from this layer on: every token from ``p`` not covered,
        the last token, and the ``ratio`` of covered tokens whose fresh KV here deviates
        most (``h`` holds the rows of positions ``p..``)."""
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = layer.self_attn
        rows = h.shape[1]
        x = layer.input_layernorm(h)
        hs = (1, rows, -1, attn.head_dim)
        k = attn.k_proj(x).view(hs).transpose(1, 2)
        v = attn.v_proj(x).view(hs).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos[:, p:], sin[:, p:])
        dk = ((k - k_old[:, :, p:]) ** 2).sum(dim=(0, 1, 3))
        dev = dk + ((v - v_old[:, :, p:]) ** 2).sum(dim=(0, 1, 3))
        mine = covered[p:]
        keep = ~mine
        keep[rows - 1] = True
        idx = torch.nonzero(mine).flatten()
        budget = math.ceil(self.ratio * len(idx))
        if budget:
            top = idx[torch.topk(dev[idx], min(budget, len(idx))).indices]
            keep[top] = True
        return torch.nonzero(keep).flatten() + p
