"""Moving a segment's KV to another position: re-apply RoPE to its keys.

Llama-style models (SmolLM2 included) rotate each key of head dimension ``d`` by the
angles ``p * inv_freq`` at position ``p`` (pairs ``(i, i + d/2)``, transformers'
``rotate_half`` convention; ``inv_freq = rope_theta ** (-2i/d)``, after any static
scaling). Rotations compose, ``R(p + delta) = R(delta) R(p)``, so a key computed at
``p`` is moved to ``p + delta`` by multiplying it by ``R(delta)``; values carry no
position and stay as they are. For a segment whose tokens attend only to each other
the moved KV is the KV computed at the new position (to float rounding): attention
scores depend on relative positions only. What the move cannot restore is attention to
tokens that were not there when the KV was computed (:mod:`kvlife.upstream.blend`).

The angles here are computed in float64 from the model's own ``inv_freq`` buffer, so the
move adds less rounding than the model's float32 cos/sin do at large positions.
"""

from __future__ import annotations

from typing import Any

from kvlife.engines.errors import UnsupportedModel

_SHIFTABLE = ("default", "linear", "llama3", "yarn", "longrope")
"""RoPE types whose angles are ``position * inv_freq`` with a fixed ``inv_freq``
(dynamic NTK recomputes ``inv_freq`` from the sequence length: a shift is not a rotation)."""


def rope_inv_freq(model: Any) -> Any:
    """The model's RoPE inverse frequencies (a float tensor of ``head_dim / 2``);
    UnsupportedModel where a position shift is not a pure rotation."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if rotary is None or inv_freq is None:
        raise UnsupportedModel(f"{type(model).__name__} has no model.rotary_emb.inv_freq")
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in _SHIFTABLE:
        raise UnsupportedModel(f"RoPE type {rope_type!r}: a position shift is not a rotation")
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        # cos/sin carry a magnitude factor: keys hold it once, a second rotation would
        # apply it again
        raise UnsupportedModel(f"RoPE type {rope_type!r} scales cos/sin; not re-rotated here")
    return inv_freq


def rotate_keys(keys: Any, delta: int, inv_freq: Any) -> Any:
    """``keys`` (any leading shape, last axis ``head_dim``) moved by ``delta`` positions
    (negative: towards the start). Returns a new tensor of the keys' dtype."""
    import torch

    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"delta must be an int, got {delta!r}")
    if delta == 0:
        return keys.clone()
    ang = float(delta) * inv_freq.to(torch.float64)
    emb = torch.cat((ang, ang))
    cos, sin = emb.cos(), emb.sin()
    k = keys.to(torch.float64)
    half = k.shape[-1] // 2
    rotated_half = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)


def move_kv(kv: Any, delta: int, inv_freq: Any) -> Any:
    """A segment's KV ``(layers, 2, kv_heads, T, head_dim)`` moved by ``delta``
    positions: keys re-rotated, values unchanged (a new tensor)."""
    out = kv.clone()
    out[:, 0] = rotate_keys(kv[:, 0], delta, inv_freq)
    return out
