"""Hugging Face transformers engine with kvlife as its prefix-KV store.

Per request: look up the longest stored chunk-aligned prefix, load it (verified) straight
into one buffer laid out per layer, inject it into a ``DynamicCache``, prefill only the
rest, decode greedily, then store the new full chunks of prompt and generated turn.
Works for Llama-style models (any config with layers, attention heads and KV heads whose
forward returns a ``DynamicCache``); the identity comes from the model itself
(:func:`kvlife.engines.identity.model_identity`).

At least one prompt token is always prefilled (the logits of the last prompt position
give the first output token), so a prompt that ends exactly on a chunk boundary reuses
all but its last chunk. One engine serves one request at a time.

With ``layer_groups=G`` each chunk is stored as G layer-group objects
(:mod:`kvlife.engines.hf_layers`) and served only when every group of it loads and
verifies; the planned engine (:mod:`kvlife.engines.hf_plan`) then starts the forward
while later groups still load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlife.core.identity import ModelIdentity, Namespace
from kvlife.core.payload import cast_kv, numpy_dtype, to_torch
from kvlife.engines.errors import ContextTooLong, IdentityMismatch, UnsupportedModel
from kvlife.engines.hf_layers import (
    group_identities,
    group_views,
    layer_groups,
    lookup_groups,
    put_groups,
)
from kvlife.engines.identity import AdapterSpec, llama_shape, model_identity
from kvlife.engines.models import LoadedModel
from kvlife.results import LookupResult
from kvlife.store import KVStore
from kvlife.tiers.buffers import aligned_empty


@dataclass(slots=True)
class Prefill:
    """The state after the prompt: a cache ready for decoding and the last logits."""

    cache: Any
    logits: Any
    """Logits of every prefilled (suffix) position, shape [suffix, vocab]."""
    cached_tokens: int
    tiers: dict[str, int]
    corrupt: int
    lookup_s: float
    load_s: float
    prefill_s: float
    loaded_chunks: list[np.ndarray] = field(default_factory=list)
    """The chunks served from the store (views of the engine's landing buffer: valid
    until the engine's next prefill)."""


@dataclass(slots=True)
class Turn:
    """One request served: output and where its prompt's KV came from."""

    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    corrupt: int
    ttft_s: float
    """Request start to first output token (lookup, load, inject, prefill, argmax)."""
    decode_s: float
    """Time for the remaining output tokens."""
    store_s: float
    stored_chunks: int
    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        n = len(self.output_ids) - 1
        return self.decode_s / n if n > 0 else 0.0


class HFEngine:
    """Greedy generation for a transformers causal LM with kvlife-backed prefix reuse."""

    def __init__(
        self,
        model: Any,
        store: KVStore | None,
        identity: ModelIdentity,
        *,
        tokenizer: Any | None = None,
        layer_groups: int = 1,
    ) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.store = store
        self.identity = identity
        self.tokenizer = tokenizer
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedModel(f"{type(model).__name__} is not a transformers model")
        self.config = config
        layers, kv_heads, head_dim = llama_shape(config)
        lay = identity.layout
        got = (layers, kv_heads, head_dim)
        want = (lay.num_layers, lay.num_kv_heads, lay.head_dim)
        if got != want:
            raise IdentityMismatch(
                f"identity {identity.model_id!r} describes KV of (layers, kv_heads, head_dim) "
                f"= {want}, the model computes {got}"
            )
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        if dtype != lay.dtype:
            raise IdentityMismatch(f"identity says KV dtype {lay.dtype}, the model runs {dtype}")
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.group_identities = group_identities(identity, layer_groups)
        """One identity per layer group a chunk is stored as (:mod:`kvlife.engines.hf_layers`;
        one group: the identity itself, each chunk one object)."""
        self._buffer: np.ndarray | None = None
        self._probe_cache()

    @classmethod
    def for_model(
        cls,
        loaded: LoadedModel,
        store: KVStore | None,
        *,
        tokens_per_chunk: int = 256,
        adapter: AdapterSpec | None = None,
        layer_groups: int = 1,
    ) -> HFEngine:
        identity = model_identity(
            loaded.model,
            loaded.tokenizer,
            tokens_per_chunk=tokens_per_chunk,
            adapter=adapter,
            model_id=loaded.model_id,
            digest_of_weights=loaded.weights_digest,
        )
        return cls(
            loaded.model, store, identity, tokenizer=loaded.tokenizer, layer_groups=layer_groups
        )

    @property
    def layer_groups(self) -> int:
        """Layer groups each chunk is stored as (and loaded by)."""
        return len(self.group_identities)

    def group_spans(self) -> tuple[tuple[int, int], ...]:
        """``(first layer, layers)`` of each layer group."""
        return layer_groups(self.identity.layout.num_layers, self.layer_groups)

    def _probe_cache(self) -> None:
        """Refuse models whose forward does not hand back a per-layer KV cache."""
        torch = self.torch
        try:
            with torch.no_grad():
                out = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long), use_cache=True)
            cache = out.cache
            layer0 = cache.layers[0]
            shape = tuple(layer0.keys.shape)
        except (AttributeError, TypeError, IndexError, RuntimeError) as exc:
            raise UnsupportedModel(
                f"{type(self.model).__name__} does not return a DynamicCache with per-layer "
                f"keys/values from forward(use_cache=True): {exc}"
            ) from exc
        lay = self.identity.layout
        if len(cache.layers) != lay.num_layers or shape != (1, lay.num_kv_heads, 1, lay.head_dim):
            raise UnsupportedModel(
                f"{type(self.model).__name__}'s cache has {len(cache.layers)} layers of keys "
                f"shaped {shape}; expected {lay.num_layers} layers of "
                f"(1, {lay.num_kv_heads}, 1, {lay.head_dim})"
            )

    # ------------------------------------------------------------------ prefill

    def _check_length(self, ids: Sequence[int], start: int, new_tokens: int) -> None:
        if not ids:
            raise ContextTooLong("empty prompt: nothing to prefill")
        end = start + len(ids) + new_tokens
        if end > self.max_positions:
            raise ContextTooLong(
                f"prompt of {len(ids)} tokens at position {start} plus {new_tokens} new tokens "
                f"needs {end} positions; the model has {self.max_positions}"
            )

    def prefill(
        self, ids: Sequence[int], namespace: Namespace, *, start: int = 0, request_id: str = ""
    ) -> Prefill:
        """Reuse the stored prefix of ``ids`` and prefill the rest."""
        self._check_length(ids, start, 0)
        lay = self.identity.layout
        n, tpc = len(ids), lay.tokens_per_chunk
        t0 = time.perf_counter()
        found: tuple[LookupResult, ...] = (LookupResult([], 0, tpc),)
        if self.store is not None:
            found = lookup_groups(self.store, self.group_identities, namespace, ids, start)
        usable = min(len(found[0].hits), (n - 1) // tpc)
        t1 = time.perf_counter()
        loaded_chunks: list[np.ndarray] = []
        tiers: dict[str, int] = {}
        corrupt = 0
        if usable and self.store is not None:
            shape = (lay.num_layers, 2, lay.num_kv_heads, usable * tpc, lay.head_dim)
            buf = self._kv_buffer(shape)
            outs = [buf[:, :, :, i * tpc : (i + 1) * tpc, :] for i in range(usable)]
            views = group_views(buf, self.group_spans(), usable, tpc)
            loaded = usable
            for group, group_outs in zip(found, views, strict=True):
                # a chunk is served only when every layer group of it loaded and verified
                res = self.store.load(
                    group.sub(0, loaded), group_outs[:loaded], request_id=request_id
                )
                if not tiers:  # chunks per tier: the first group's objects say it
                    tiers = dict(res.tiers)
                corrupt += len(res.corrupt)
                loaded = res.loaded
                if not loaded:
                    break
            loaded_chunks = outs[:loaded]
            cache = self._inject(buf, loaded * tpc)
        else:
            cache = self._new_cache()
        t2 = time.perf_counter()
        pre = self._prefill_suffix(ids, cache, start)
        pre.tiers, pre.corrupt, pre.loaded_chunks = tiers, corrupt, loaded_chunks
        pre.lookup_s, pre.load_s = t1 - t0, t2 - t1
        return pre

    def _kv_buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        """The engine's reusable, aligned landing buffer for loaded KV, viewed as
        ``shape``: aligned, so each chunk's disk read lands in it directly (vectored
        O_DIRECT); reused, so a request does not pay page faults for a fresh buffer.
        Arrays handed out from it (``Prefill.loaded_chunks``) are valid until the next
        prefill of this engine."""
        dtype = numpy_dtype(self.identity.layout.dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buf = self._buffer
        if buf is None or buf.nbytes < nbytes:
            have = 0 if buf is None else buf.nbytes
            buf = self._buffer = aligned_empty(max(nbytes, have * 3 // 2))  # grow geometrically
        return buf[:nbytes].view(dtype).reshape(shape)

    def prefill_with_chunks(
        self, ids: Sequence[int], chunks: Sequence[np.ndarray], *, start: int = 0
    ) -> Prefill:
        """Prefill ``ids`` reusing the given KV chunks for its leading tokens, whatever
        their origin (no store involved): for experiments that serve KV another way.
        Float chunks of another dtype are converted by value, as a connector would."""
        self._check_length(ids, start, 0)
        lay = self.identity.layout
        tpc = lay.tokens_per_chunk
        usable = min(len(chunks), (len(ids) - 1) // tpc)
        if not usable:
            return self._prefill_suffix(ids, self._new_cache(), start)
        parts = [cast_kv(np.asarray(c), lay.dtype) for c in chunks[:usable]]
        buf = self._kv_buffer((*parts[0].shape[:3], usable * tpc, parts[0].shape[4]))
        np.concatenate(parts, axis=3, out=buf)
        return self._prefill_suffix(ids, self._inject(buf, usable * tpc), start)

    def _inject(self, buf: np.ndarray, tokens: int) -> Any:
        """A cache holding the first ``tokens`` positions of ``buf`` (layers, 2, heads,
        T, dim), as views (no copy)."""
        lay = self.identity.layout
        cache = self._new_cache()
        if tokens:
            for layer in range(lay.num_layers):
                k = to_torch(buf[layer, 0, :, :tokens], lay.dtype)[None]
                v = to_torch(buf[layer, 1, :, :tokens], lay.dtype)[None]
                cache.update(k, v, layer)
        return cache

    def _prefill_suffix(self, ids: Sequence[int], cache: Any, start: int) -> Prefill:
        torch = self.torch
        cached = int(cache.get_seq_length())
        n = len(ids)
        t0 = time.perf_counter()
        suffix = torch.tensor([list(ids[cached:])], dtype=torch.long)
        with torch.no_grad():
            out = self.model(
                input_ids=suffix,
                cache=cache,
                position_ids=torch.arange(start + cached, start + n)[None],
                cache_position=torch.arange(cached, n),
                use_cache=True,
            )
        return Prefill(
            cache=out.cache,
            logits=out.logits[0],
            cached_tokens=cached,
            tiers={},
            corrupt=0,
            lookup_s=0.0,
            load_s=0.0,
            prefill_s=time.perf_counter() - t0,
        )

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        ids: Sequence[int],
        namespace: Namespace,
        *,
        max_new_tokens: int = 32,
        start: int = 0,
        stop_at_eos: bool = True,
        store_output: bool = True,
        request_id: str = "",
    ) -> Turn:
        """Greedy decoding of ``max_new_tokens`` after ``ids``; stores new full chunks."""
        if max_new_tokens < 1:
            raise ContextTooLong(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self._check_length(ids, start, max_new_tokens)
        t0 = time.perf_counter()
        pre = self.prefill(ids, namespace, start=start, request_id=request_id)
        out_ids, cache, first_at = self.decode(pre, start + len(ids), max_new_tokens, stop_at_eos)
        t2 = time.perf_counter()
        stored = 0
        if store_output and self.store is not None:
            stored = self._store(list(ids) + out_ids, cache, pre, namespace, start, request_id)
        t3 = time.perf_counter()
        return Turn(
            output_ids=out_ids,
            prompt_tokens=len(ids),
            cached_tokens=pre.cached_tokens,
            tiers=pre.tiers,
            corrupt=pre.corrupt,
            ttft_s=first_at - t0,
            decode_s=t2 - first_at,
            store_s=t3 - t2,
            stored_chunks=stored,
            lookup_s=pre.lookup_s,
            load_s=pre.load_s,
            prefill_s=pre.prefill_s,
        )

    def decode(
        self, pre: Prefill, position: int, max_new_tokens: int, stop_at_eos: bool = True
    ) -> tuple[list[int], Any, float]:
        """Greedy tokens after a prefill: (token ids, final cache, time the first token
        was chosen). ``position`` is the absolute position of the first new token."""
        torch = self.torch
        token = int(torch.argmax(pre.logits[-1]))
        first_at = time.perf_counter()
        out_ids = [token]
        eos = getattr(self.config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        cache = pre.cache
        offset = position - int(cache.get_seq_length())  # start of the request
        with torch.no_grad():
            while len(out_ids) < max_new_tokens and not (stop_at_eos and token in eos_ids):
                out = self.model(
                    input_ids=torch.tensor([[token]], dtype=torch.long),
                    cache=cache,
                    position_ids=torch.tensor([[position]]),
                    cache_position=torch.tensor([position - offset]),
                    use_cache=True,
                )
                cache = out.cache
                token = int(torch.argmax(out.logits[0, -1]))
                out_ids.append(token)
                position += 1
        return out_ids, cache, first_at

    def _store(
        self,
        all_ids: list[int],
        cache: Any,
        pre: Prefill,
        namespace: Namespace,
        start: int,
        request_id: str,
    ) -> int:
        """Put every full chunk whose KV the cache holds (prompt and generated turn)."""
        assert self.store is not None
        lay = self.identity.layout
        tpc = lay.tokens_per_chunk
        kv_len = int(cache.get_seq_length())
        nfull = kv_len // tpc
        if nfull == 0:
            return 0
        torch = self.torch
        chunks: list[np.ndarray] = list(pre.loaded_chunks[:nfull])
        first_new = len(chunks)
        if first_new < nfull:
            lo, hi = first_new * tpc, nfull * tpc
            stacked = torch.stack(
                [
                    torch.stack([layer.keys[0, :, lo:hi], layer.values[0, :, lo:hi]])
                    for layer in cache.layers
                ]
            )  # (layers, 2, kv_heads, tokens, head_dim)
            arr = _as_numpy(stacked, lay.dtype)
            chunks += [arr[:, :, :, i * tpc : (i + 1) * tpc, :] for i in range(nfull - first_new)]
        if self.layer_groups > 1:
            return put_groups(
                self.store,
                self.group_identities,
                namespace,
                all_ids[: nfull * tpc],
                chunks,
                start=start,
                request_id=request_id,
            )
        res = self.store.put_prompt(
            self.identity,
            namespace,
            all_ids[: nfull * tpc],
            chunks,
            start=start,
            request_id=request_id,
        )
        return res.stored

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (the tokenizer's template, generation prompt appended)."""
        if self.tokenizer is None:
            raise UnsupportedModel("this engine has no tokenizer; pass token ids")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def _as_numpy(tensor: Any, kv_dtype: str) -> np.ndarray:
    import torch

    t = tensor.detach().contiguous()
    if kv_dtype == "bfloat16":
        return np.asarray(t.view(torch.int16).numpy()).view(np.uint16)
    return np.asarray(t.numpy())
