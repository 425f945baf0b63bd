"""Model identity of a vLLM engine, from what the engine is configured with.

Nothing here trusts a model name alone. The weights digest is BLAKE3 over the weight
files (name, size, bytes), cached per file under its fingerprint (path, size, mtime,
inode, ctime, a sample of its bytes: ``kvlife.engines.identity.file_fingerprint``) in
kvlife's user cache, so a large model is hashed once, not per engine start, and a
same-size checkpoint copied over it with its mtime preserved is hashed again; the tokenizer digest
covers the tokenizer files; the position encoding digest the RoPE configuration and
context length; the engine digest vLLM's version, the attention block size and the
compute dtype; the layout carries the tensor-parallel shard (rank, world size, the KV
heads it holds) and the pipeline stage (stage, stage count, the layers it holds), so no
two shards or stages ever share a key. A request adds its LoRA adapter (name, id and a
digest of the adapter files) and its ``cache_salt`` as namespace.

The functions take plain values so they are testable without vLLM;
:func:`facts_from_vllm_config` is the one place that reads a ``VllmConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import blake3
import msgpack

from kvlife.core.identity import DTYPE_ITEMSIZE, KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.engines.errors import UnsupportedModel
from kvlife.engines.identity import (
    AdapterSpec,
    cached_digest,
    position_digest,
    tokenizer_digest,
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files of a model directory that hold weights."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)
"""Files of a model directory that define its tokenizer and chat template."""
_DIGEST_INDEX = "file-digests.json"


def _file_digest(path: Path) -> str:
    """BLAKE3 of one file, cached under its fingerprint."""

    def compute() -> str:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update_mmap(str(path))
        return str(h.hexdigest())

    return cached_digest(_DIGEST_INDEX, path, compute)


def files_digest(files: list[Path]) -> str:
    """BLAKE3 over (name, size, file digest) of ``files`` in name order."""
    h = blake3.blake3()
    for path in sorted(files, key=lambda p: p.name):
        h.update(msgpack.packb([path.name, path.stat().st_size, _file_digest(path)]))
    return h.hexdigest()


def weights_digest_of_dir(model_dir: Path) -> str:
    """Digest of every weight file directly in ``model_dir``."""
    files = [p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    if not files:
        raise UnsupportedModel(
            f"{model_dir} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}): kvlife "
            "needs a local model directory to digest the weights"
        )
    return files_digest(files)


def tokenizer_digest_of_dir(tokenizer_dir: Path | None, vocab_size: int) -> str:
    """Digest of the tokenizer files; without any (``skip_tokenizer_init``), of the id
    space, as the transformers adapter does for a tokenizer-less model."""
    files = [] if tokenizer_dir is None else [tokenizer_dir / n for n in TOKENIZER_FILES]
    present = [p for p in files if p.is_file()]
    if not present:
        return tokenizer_digest(None, vocab_size)
    return files_digest(present)


def adapter_spec(name: str, int_id: int, path: str) -> AdapterSpec:
    """A LoRA adapter as vLLM names it (``LoRARequest``: name, int id, path), with the
    digest of its files (weights and config)."""
    root = Path(path)
    files = [p for p in root.iterdir() if p.is_file()] if root.is_dir() else []
    if not files:
        raise UnsupportedModel(f"LoRA adapter {name!r}: {path!r} is not a directory of files")
    return AdapterSpec(adapter_id=f"{name}#{int_id}", digest=files_digest(files))


def shard_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, heads held) of rank ``tp_rank`` as vLLM splits them: evenly when
    there are at least as many heads as ranks, else each rank holds one replicated head."""
    if not 0 <= tp_rank < tp_size:
        raise UnsupportedModel(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise UnsupportedModel(
                f"{total_kv_heads} KV heads do not split evenly over {tp_size} ranks"
            )
        per = total_kv_heads // tp_size
        return tp_rank * per, per
    return tp_rank * total_kv_heads // tp_size, 1


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What of a vLLM engine's configuration decides the KV it computes."""

    model: str
    """Model name or path as vLLM was given it."""
    revision: str
    """Model revision ("" for a local directory)."""
    weights_digest: str
    tokenizer_digest: str
    position_digest: str
    num_layers: int
    """Layers of the whole model that hold KV (all pipeline stages together)."""
    total_kv_heads: int
    head_dim: int
    kv_dtype: str
    """Element type of the KV cache, one of kvlife's dtypes."""
    compute_dtype: str
    """The model's dtype (it changes the KV bits even for the same cache dtype)."""
    block_size: int
    """vLLM's KV block size in tokens."""
    tp_size: int
    engine_version: str
    pp_size: int = 1
    """Pipeline-parallel stages."""
    stage_layers: tuple[tuple[int, int], ...] = ()
    """Per stage, its layers ``[first, end)`` as vLLM splits them (empty: one stage
    holding every layer)."""

    def stage(self, pp_rank: int) -> tuple[int, int]:
        """Layers ``[first, end)`` of pipeline stage ``pp_rank``."""
        if not 0 <= pp_rank < self.pp_size:
            raise UnsupportedModel(f"pipeline stage {pp_rank} is not in [0, {self.pp_size})")
        stages = self.stage_layers or ((0, self.num_layers),)
        if len(stages) != self.pp_size:
            raise UnsupportedModel(
                f"{len(stages)} stage layer ranges for {self.pp_size} pipeline stages"
            )
        first, end = stages[pp_rank]
        if not 0 <= first < end <= self.num_layers:
            raise UnsupportedModel(
                f"pipeline stage {pp_rank} holds layers [{first}, {end}) of {self.num_layers}"
            )
        return first, end

    @property
    def ranks(self) -> list[tuple[int, int]]:
        """Every (pipeline stage, tensor-parallel rank) of the engine, in global rank
        order (vLLM's layout: stage-major)."""
        return [(pp, tp) for pp in range(self.pp_size) for tp in range(self.tp_size)]

    @property
    def model_id(self) -> str:
        return f"{self.model}@{self.revision}" if self.revision else self.model

    @property
    def engine_digest(self) -> str:
        return blake3.blake3(
            msgpack.packb(
                ["vllm", self.engine_version, self.block_size, self.compute_dtype, self.kv_dtype]
            )
        ).hexdigest()


def identity_for(
    facts: EngineFacts,
    *,
    tp_rank: int,
    tokens_per_chunk: int,
    pp_rank: int = 0,
    adapter: AdapterSpec | None = None,
) -> ModelIdentity:
    """The identity of the KV that rank ``tp_rank`` of pipeline stage ``pp_rank``
    computes (its shard of the heads, its stage's layers)."""
    if tokens_per_chunk % facts.block_size:
        raise UnsupportedModel(
            f"kvlife chunks must be a whole number of vLLM blocks: {tokens_per_chunk} tokens "
            f"per chunk is not a multiple of block size {facts.block_size}"
        )
    start, count = shard_heads(facts.total_kv_heads, facts.tp_size, tp_rank)
    first_layer, end_layer = facts.stage(pp_rank)
    layout = KVLayout(
        end_layer - first_layer,
        count,
        facts.head_dim,
        facts.kv_dtype,
        tokens_per_chunk,
        tp_rank=tp_rank,
        tp_size=facts.tp_size,
        kv_head_start=start,
        pp_rank=pp_rank,
        pp_size=facts.pp_size,
        first_layer=first_layer,
    )
    return ModelIdentity(
        model_id=facts.model_id,
        weights_digest=facts.weights_digest,
        tokenizer_digest=facts.tokenizer_digest,
        layout=layout,
        position_encoding_digest=facts.position_digest,
        adapter_id=adapter.adapter_id if adapter else "",
        adapter_digest=adapter.digest if adapter else "",
        engine_digest=facts.engine_digest,
    )


def with_adapter(identity: ModelIdentity, adapter: AdapterSpec | None) -> ModelIdentity:
    """``identity`` for a request that runs ``adapter`` (None: the base model)."""
    if adapter is None:
        return identity
    return replace(identity, adapter_id=adapter.adapter_id, adapter_digest=adapter.digest)


@dataclass(frozen=True, slots=True)
class NamespacePolicy:
    """How a request's ``cache_salt`` becomes its kvlife namespace."""

    default: Namespace
    """Namespace of requests without a salt."""
    salt_kind: NamespaceKind = NamespaceKind.ORGANISATION
    """Kind of the namespace named by a salt (the salt is its name)."""

    def namespace(self, cache_salt: str | None) -> Namespace:
        if not cache_salt:
            return self.default
        return Namespace(self.salt_kind, cache_salt)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
    name = aliases.get(name, name)
    if name == "fp8_e4m3":
        name = "float8_e4m3fn"
    if name == "fp8_e5m2":
        name = "float8_e5m2"
    if name not in DTYPE_ITEMSIZE:
        raise UnsupportedModel(f"KV dtype {dtype!r} is not one kvlife stores ({DTYPE_ITEMSIZE})")
    return name


def facts_from_vllm_config(vllm_config: Any) -> EngineFacts:
    """Read :class:`EngineFacts` from a ``vllm.config.VllmConfig``."""
    import vllm
    from vllm.distributed.utils import get_pp_indices

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    model_dir = Path(mc.model)
    if not model_dir.is_dir():
        raise UnsupportedModel(
            f"model {mc.model!r} is not a local directory: kvlife digests the weight files "
            "(download the model first and pass its directory)"
        )
    hf_config = mc.hf_config
    tok = None if mc.skip_tokenizer_init else Path(mc.tokenizer or mc.model)
    compute = _dtype_name(mc.dtype)
    kv = compute if cc.cache_dtype in ("auto", None) else _dtype_name(cc.cache_dtype)
    # every stage's layers, whichever process reads this (the scheduler keys lookups by
    # all of them; a worker by its own); get_num_layers(pc) would give one stage's count
    total_layers = int(mc.get_total_num_hidden_layers())
    pp_size = int(pc.pipeline_parallel_size)
    stages = tuple(
        (int(a), int(b))
        for a, b in (get_pp_indices(total_layers, r, pp_size) for r in range(pp_size))
    )
    return EngineFacts(
        model=str(mc.model),
        revision=str(mc.revision or ""),
        weights_digest=weights_digest_of_dir(model_dir),
        tokenizer_digest=tokenizer_digest_of_dir(
            tok if tok is not None and tok.is_dir() else None,
            int(getattr(hf_config, "vocab_size", 0) or 0),
        ),
        position_digest=position_digest(hf_config),
        num_layers=total_layers,
        total_kv_heads=int(mc.get_total_num_kv_heads()),
        head_dim=int(mc.get_head_size()),
        kv_dtype=kv,
        compute_dtype=compute,
        block_size=int(cc.block_size),
        tp_size=int(pc.tensor_parallel_size),
        engine_version=str(vllm.__version__),
        pp_size=pp_size,
        stage_layers=stages,
    )
