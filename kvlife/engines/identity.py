"""Model identity from the model itself: config, weights, tokenizer, adapter.

A hand-typed model name is never trusted alone. The weights digest is BLAKE3 over every
parameter and buffer (name, dtype, shape, bytes) in name order, computed once per
process for a model object and cached on disk per weights file under its
:func:`file_fingerprint` (path, size, mtime, inode, ctime and a sample of its bytes, so
a same-size checkpoint copied over it with its mtime preserved is hashed again); the
tokenizer digest covers its full serialised form and special tokens; the position
encoding digest covers the RoPE parameters and context length; an adapter contributes
its id and the digest of its weights.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgpack
import numpy as np

from kvlife.core.identity import KVLayout, ModelIdentity
from kvlife.engines.errors import UnsupportedModel


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter (LoRA-style) applied on top of the base weights."""

    adapter_id: str
    """Name of the adapter."""
    digest: str
    """BLAKE3 of the adapter's weights."""


def cache_dir() -> Path:
    """kvlife's per-user cache directory (``$KVLIFE_CACHE`` or ``~/.cache/kvlife``)."""
    root = os.environ.get("KVLIFE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvlife"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


RACY_NS = 2_000_000_000
"""A file whose status changed less than this long ago is hashed but its digest not
cached: a change within the same timestamp tick would leave size, mtime and ctime as
they were (git's "racily clean" entries)."""
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 4096


def file_fingerprint(path: Path) -> str | None:
    """The key a digest of ``path`` is cached under: resolved path, size, mtime, inode,
    ctime (which no copy tool can set: ``cp -p``, ``rsync -a`` and images with fixed
    mtimes preserve mtime only) and BLAKE3 of 16 blocks of 4 KiB spread over the file.
    None while the file is racy (changed in the last :data:`RACY_NS`): do not cache."""
    st = path.stat()
    if time.time_ns() - st.st_ctime_ns < RACY_NS:
        return None
    h = blake3.blake3()
    span = max(0, st.st_size - SAMPLE_BYTES)
    with path.open("rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(span * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return (
        f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
        f"|{h.hexdigest()[:32]}"
    )


def cached_digest(index_name: str, path: Path, compute: Callable[[], str]) -> str:
    """``compute()``, cached in the user cache file ``index_name`` under the
    :func:`file_fingerprint` of ``path`` (not cached while the file is racy)."""
    entry = file_fingerprint(path)
    index_path = cache_dir() / index_name
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    got = index.get(entry) if entry is not None else None
    if isinstance(got, str):
        return got
    digest = compute()
    if entry is None:
        return digest
    try:  # re-read: another process (vLLM's scheduler or a worker) may have added entries
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    index[entry] = digest
    tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index))
    tmp.replace(index_path)
    return digest


def tensors_digest(named: list[tuple[str, Any]]) -> str:
    """BLAKE3 over (name, dtype, shape, bytes) of torch tensors, in name order."""
    import torch

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name, t in sorted(named, key=lambda x: x[0]):
        t = t.detach().cpu().contiguous()
        h.update(msgpack.packb([name, str(t.dtype), list(t.shape)]))
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 and t.numel() else t
        h.update(np.ascontiguousarray(raw.numpy()).data)
    return h.hexdigest()


def weights_digest(model: Any) -> str:
    """Digest of a model's parameters and buffers, computed from the tensors themselves
    (never cached on the object: a perturbed copy must not inherit its parent's)."""
    return tensors_digest(list(model.state_dict().items()))


def cached_weights_digest(model: Any, weights_file: Path) -> str:
    """:func:`weights_digest` of a model loaded unchanged from ``weights_file``, cached
    in the user cache under the file's :func:`file_fingerprint`."""
    return cached_digest("weights-digests.json", weights_file, lambda: weights_digest(model))


def tokenizer_digest(tokenizer: Any | None, vocab_size: int) -> str:
    """Digest of a Hugging Face tokenizer; without one, of the id space (the engine is
    then fed token ids directly and the ids mean whatever the embedding says)."""
    if tokenizer is None:
        return blake3.blake3(f"token-ids-only:vocab={vocab_size}".encode()).hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        serial = backend.to_str()
    else:
        serial = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps(
        {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}, sort_keys=True
    )
    return blake3.blake3((serial + "\0" + special).encode()).hexdigest()


def llama_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a Llama-style config."""
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    except (AttributeError, TypeError, ValueError) as exc:
        raise UnsupportedModel(
            f"model config {type(config).__name__} is not Llama-style "
            f"(needs num_hidden_layers, num_attention_heads, hidden_size): {exc}"
        ) from exc
    return layers, kv_heads, head_dim


def position_digest(config: Any) -> str:
    rope = getattr(config, "rope_parameters", None) or {
        "rope_theta": getattr(config, "rope_theta", None),
        "rope_scaling": getattr(config, "rope_scaling", None),
    }
    data = {
        "model_type": getattr(config, "model_type", ""),
        "rope": rope,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
    }
    return blake3.blake3(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(
    model: Any,
    tokenizer: Any | None = None,
    *,
    tokens_per_chunk: int = 256,
    adapter: AdapterSpec | None = None,
    model_id: str | None = None,
    kv_dtype: str | None = None,
    digest_of_weights: str | None = None,
) -> ModelIdentity:
    """The identity of ``model`` as it will compute KV (dtype from its parameters).

    ``digest_of_weights`` is for loaders that computed :func:`weights_digest` of this
    very model before (see :func:`cached_weights_digest`)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModel(f"{type(model).__name__} has no config; not a transformers model")
    layers, kv_heads, head_dim = llama_shape(config)
    dtype = kv_dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    layout = KVLayout(layers, kv_heads, head_dim, dtype, tokens_per_chunk)
    name = model_id or str(getattr(config, "name_or_path", "") or type(model).__name__)
    return ModelIdentity(
        model_id=name,
        weights_digest=digest_of_weights or weights_digest(model),
        tokenizer_digest=tokenizer_digest(tokenizer, int(getattr(config, "vocab_size", 0))),
        layout=layout,
        position_encoding_digest=position_digest(config),
        adapter_id=adapter.adapter_id if adapter else "",
        adapter_digest=adapter.digest if adapter else "",
    )
