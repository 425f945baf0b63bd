"""Chunk keys: every identity field changes the key; keys are stable across processes."""

from __future__ import annotations

import array
import dataclasses
import json
import os
import struct
import subprocess
import sys
from typing import Any

import blake3
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import (
    DTYPE_ITEMSIZE,
    PUBLIC,
    ROOT_PARENT,
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    chunk_key,
    prompt_chunk_keys,
)

text = st.text(min_size=1, max_size=12)
pos = st.integers(min_value=1, max_value=64)


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    tp_size = draw(st.integers(min_value=1, max_value=8))
    pp_size = draw(st.integers(min_value=1, max_value=4))
    return KVLayout(
        num_layers=draw(pos),
        num_kv_heads=draw(pos),
        head_dim=draw(pos),
        dtype=draw(st.sampled_from(sorted(DTYPE_ITEMSIZE))),
        tokens_per_chunk=draw(st.integers(min_value=1, max_value=8)),
        tp_rank=draw(st.integers(min_value=0, max_value=tp_size - 1)),
        tp_size=tp_size,
        kv_head_start=draw(st.integers(min_value=0, max_value=64)),
        pp_rank=draw(st.integers(min_value=0, max_value=pp_size - 1)),
        pp_size=pp_size,
        first_layer=draw(st.integers(min_value=0, max_value=64)),
    )


@st.composite
def identities(draw: st.DrawFn) -> ModelIdentity:
    adapter = draw(st.booleans())
    return ModelIdentity(
        model_id=draw(text),
        weights_digest=draw(text),
        tokenizer_digest=draw(text),
        layout=draw(layouts()),
        engine_digest=draw(st.text(max_size=8)),
        position_encoding_digest=draw(st.text(max_size=8)),
        adapter_id=draw(text) if adapter else "",
        adapter_digest=draw(text) if adapter else "",
    )


namespaces = st.one_of(
    st.just(PUBLIC),
    st.builds(
        Namespace,
        st.sampled_from([NamespaceKind.ORGANISATION, NamespaceKind.USER, NamespaceKind.REQUEST]),
        text,
    ),
)


def _different(value: str) -> str:
    return value + "x"


IDENTITY_FIELDS = [
    "model_id",
    "weights_digest",
    "tokenizer_digest",
    "position_encoding_digest",
    "engine_digest",
]
LAYOUT_FIELDS = [
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "tokens_per_chunk",
    "kv_head_start",
    "first_layer",
]


def _key(ident: ModelIdentity, ns: Namespace, tokens: list[int], start: int = 0) -> ChunkKey:
    return chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, tokens)


@settings(max_examples=60, deadline=None)
@given(identities(), namespaces, st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=32))
def test_every_identity_field_changes_the_key(
    ident: ModelIdentity, ns: Namespace, tokens: list[int]
) -> None:
    base = _key(ident, ns, tokens)
    assert _key(ident, ns, tokens) == base
    for name in IDENTITY_FIELDS:
        changed: dict[str, Any] = {name: _different(getattr(ident, name))}
        other = dataclasses.replace(ident, **changed)
        assert _key(other, ns, tokens) != base, name
    for name in LAYOUT_FIELDS:
        lay = dataclasses.replace(ident.layout, **{name: getattr(ident.layout, name) + 1})
        assert _key(dataclasses.replace(ident, layout=lay), ns, tokens) != base, name
    # the tensor-parallel shard: another rank, another world size (rank kept valid)
    lay = ident.layout
    other_rank = (lay.tp_rank + 1) % lay.tp_size if lay.tp_size > 1 else None
    if other_rank is not None:
        shard = dataclasses.replace(lay, tp_rank=other_rank)
        assert _key(dataclasses.replace(ident, layout=shard), ns, tokens) != base, "tp_rank"
    wider = dataclasses.replace(lay, tp_size=lay.tp_size + 1)
    assert _key(dataclasses.replace(ident, layout=wider), ns, tokens) != base, "tp_size"
    # the pipeline stage: another stage, another stage count (stage kept valid)
    if lay.pp_size > 1:
        stage = dataclasses.replace(lay, pp_rank=(lay.pp_rank + 1) % lay.pp_size)
        assert _key(dataclasses.replace(ident, layout=stage), ns, tokens) != base, "pp_rank"
    deeper = dataclasses.replace(lay, pp_size=lay.pp_size + 1)
    assert _key(dataclasses.replace(ident, layout=deeper), ns, tokens) != base, "pp_size"
    other_dtype = next(d for d in sorted(DTYPE_ITEMSIZE) if d != ident.layout.dtype)
    lay = dataclasses.replace(ident.layout, dtype=other_dtype)
    assert _key(dataclasses.replace(ident, layout=lay), ns, tokens) != base, "dtype"
    if ident.adapter_id:
        for name in ("adapter_id", "adapter_digest"):
            other = dataclasses.replace(ident, **{name: getattr(ident, name) + "x"})
            assert _key(other, ns, tokens) != base, name
        bare = dataclasses.replace(ident, adapter_id="", adapter_digest="")
        assert _key(bare, ns, tokens) != base, "adapter removed"
    else:
        with_adapter = dataclasses.replace(ident, adapter_id="lora", adapter_digest="d")
        assert _key(with_adapter, ns, tokens) != base, "adapter added"


@settings(max_examples=60, deadline=None)
@given(
    identities(),
    namespaces,
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=32),
    st.integers(0, 2**40),
    st.data(),
)
def test_namespace_position_parent_tokens_and_extras_change_the_key(
    ident: ModelIdentity, ns: Namespace, tokens: list[int], start: int, data: st.DataObject
) -> None:
    base = chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, tokens)
    other_ns = data.draw(namespaces.filter(lambda n: n != ns))
    assert chunk_key(ident.digest, other_ns.salt, ROOT_PARENT, start, tokens) != base
    assert chunk_key(ident.digest, ns.salt, ROOT_PARENT, start + 1, tokens) != base
    parent = ChunkKey(bytes(range(32)))
    assert chunk_key(ident.digest, ns.salt, parent, start, tokens) != base
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % 2**32
    assert chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, changed) != base
    assert chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, tokens[:-1]) != base
    assert chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, tokens, [b"img"]) != base
    assert chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, tokens, [b"im", b"g"]) != (
        chunk_key(ident.digest, ns.salt, ROOT_PARENT, start, tokens, [b"img"])
    )


def test_prompt_keys_are_prefix_chained(identity: ModelIdentity) -> None:
    tokens = list(range(100))
    keys = prompt_chunk_keys(identity, PUBLIC, tokens)
    assert len(keys) == 100 // identity.layout.tokens_per_chunk
    n = identity.layout.tokens_per_chunk
    parent = ROOT_PARENT
    for i, key in enumerate(keys):
        assert key == chunk_key(
            identity.digest, PUBLIC.salt, parent, i * n, tokens[i * n : (i + 1) * n]
        )
        parent = key
    # a shared prefix shares keys; a difference in chunk 2 changes chunk 2 and everything after
    other = tokens[:]
    other[2 * n + 3] += 1
    keys2 = prompt_chunk_keys(identity, PUBLIC, other)
    assert keys2[:2] == keys[:2]
    assert all(a != b for a, b in zip(keys2[2:], keys[2:], strict=True))


_SCRIPT = """
import json, sys
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.core.identity import prompt_chunk_keys
lay = KVLayout(30, 3, 64, "float16", 256)
ident = ModelIdentity("m", "w", "t", lay, "rope", "lora", "ld")
ns = Namespace(NamespaceKind.USER, "alice")
keys = prompt_chunk_keys(ident, ns, list(range(1000)), start=7, extra_keys=[b"x"])
print(json.dumps([k.hex() for k in keys]))
"""


def test_keys_equal_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(proc.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 3
    assert len(set(outputs[0])) == 3


def test_key_follows_the_documented_encoding() -> None:
    """Recompute a key from the byte layout in the identity module's docstring: a silent
    change of the canonical encoding would orphan every stored chunk."""
    lay = KVLayout(30, 3, 64, "float16", 256)
    ident = ModelIdentity("m", "w", "t", lay, "rope", "lora", "ld")
    ns = Namespace(NamespaceKind.ORGANISATION, "acme")
    parent = ChunkKey(bytes(range(32)))
    tokens = np.arange(256) * 7
    extras = [b"img-digest", b""]
    ident_digest = blake3.blake3(
        msgpack.packb(
            ["kvlife.identity.v1", "m", "w", "t", "rope", "lora", "ld", [30, 3, 64, "float16", 256]]
        )
    ).digest()
    salt = blake3.blake3(msgpack.packb(["kvlife.namespace.v1", "organisation", "acme"])).digest()
    encoded = (
        b"kvlife.chunk.v1\0"
        + ident_digest
        + salt
        + bytes(parent)
        + struct.pack("<Q", 1234)
        + struct.pack("<I", 256)
        + tokens.astype("<u4").tobytes()
        + struct.pack("<I", 2)
        + struct.pack("<I", 10)
        + b"img-digest"
        + struct.pack("<I", 0)
    )
    assert ident.digest == ident_digest
    assert ns.salt == salt
    key = chunk_key(ident.digest, ns.salt, parent, 1234, tokens, extras)
    assert key == blake3.blake3(encoded).digest()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"dtype": "float64"}, "dtype"),
        ({"tokens_per_chunk": 0}, "tokens_per_chunk"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"kv_head_start": -1}, "kv_head_start"),
        ({"pp_size": 0}, "pp_size"),
        ({"pp_rank": 2, "pp_size": 2}, "pp_rank"),
        ({"pp_rank": -1}, "pp_rank"),
        ({"first_layer": -1}, "first_layer"),
    ],
)
def test_bad_layouts_are_rejected(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float16",
        "tokens_per_chunk": 4,
    }
    base.update(kwargs)
    with pytest.raises(InvalidArgument, match=match):
        KVLayout(**base)  # type: ignore[arg-type]


def test_bad_identity_and_tokens_are_rejected(identity: ModelIdentity) -> None:
    with pytest.raises(InvalidArgument, match="weights_digest"):
        dataclasses.replace(identity, weights_digest="")
    with pytest.raises(InvalidArgument, match="adapter"):
        dataclasses.replace(identity, adapter_id="lora")
    with pytest.raises(InvalidArgument, match="name"):
        Namespace(NamespaceKind.USER, "")
    with pytest.raises(InvalidArgument, match="empty name"):
        Namespace(NamespaceKind.PUBLIC, "bob")
    with pytest.raises(InvalidArgument, match="token ids"):
        prompt_chunk_keys(identity, PUBLIC, [-1] * 16)
    with pytest.raises(InvalidArgument, match="one-dimensional"):
        prompt_chunk_keys(identity, PUBLIC, np.zeros((2, 16), dtype=np.int64))
    with pytest.raises(InvalidArgument, match="start"):
        prompt_chunk_keys(identity, PUBLIC, list(range(16)), start=-1)
    assert Namespace.parse(str(Namespace(NamespaceKind.USER, "a:b"))) == Namespace(
        NamespaceKind.USER, "a:b"
    )


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"start": 1.5}, "start"),
        ({"start": True}, "start"),
        ({"start": -1}, "start"),
        ({"extra_keys": ["img"]}, "extra_keys[0]"),
        ({"extra_keys": b"img"}, "extra_keys"),
        ({"parent": "00" * 32}, "parent"),
        ({"parent": b"short"}, "parent"),
        ({"namespace": "user:alice"}, "namespace"),
        ({"identity": "m"}, "identity"),
    ],
)
def test_prompt_keys_reject_wrong_argument_types_by_name(
    kwargs: dict[str, Any], names: str
) -> None:
    lay = KVLayout(2, 2, 8, "float16", 4)
    args: dict[str, Any] = {"identity": ModelIdentity("m", "w", "t", lay), "namespace": PUBLIC}
    args |= {k: v for k, v in kwargs.items() if k in args}
    rest = {k: v for k, v in kwargs.items() if k not in ("identity", "namespace")}
    with pytest.raises(InvalidArgument, match=names.replace("[", r"\[").replace("]", r"\]")):
        prompt_chunk_keys(args["identity"], args["namespace"], list(range(8)), **rest)


def test_prompt_keys_accept_numpy_integer_start() -> None:
    lay = KVLayout(2, 2, 8, "float16", 4)
    ident = ModelIdentity("m", "w", "t", lay)
    tokens = list(range(8))
    assert prompt_chunk_keys(ident, PUBLIC, tokens, start=np.int64(4)) == prompt_chunk_keys(
        ident, PUBLIC, tokens, start=4
    )


def test_unsharded_layout_and_empty_engine_digest_keep_the_v1_identity() -> None:
    """TP shard fields and the engine digest are appended only when set, so identities
    (and stored keys) of format v1 are unchanged; a rank-0 shard of a TP=2 layout is a
    different identity from the unsharded model even with the same head count."""
    lay = KVLayout(30, 3, 64, "float16", 256)
    ident = ModelIdentity("m", "w", "t", lay, "rope")
    v1 = blake3.blake3(
        msgpack.packb(
            ["kvlife.identity.v1", "m", "w", "t", "rope", "", "", [30, 3, 64, "float16", 256]]
        )
    ).digest()
    assert ident.digest == v1
    shard = KVLayout(30, 3, 64, "float16", 256, tp_rank=0, tp_size=2, kv_head_start=0)
    sharded = dataclasses.replace(ident, layout=shard)
    assert (
        sharded.digest
        == blake3.blake3(
            msgpack.packb(
                [
                    "kvlife.identity.v1",
                    "m",
                    "w",
                    "t",
                    "rope",
                    "",
                    "",
                    [30, 3, 64, "float16", 256, "tp", 0, 2, 0],
                ]
            )
        ).digest()
    )
    engine = dataclasses.replace(ident, engine_digest="vllm")
    assert len({ident.digest, sharded.digest, engine.digest}) == 3


def test_pipeline_stage_fields_follow_the_documented_encoding() -> None:
    """A pipeline stage appends ``"pp"``, stage, stage count and first layer after the
    tensor-parallel fields (rebuilt here independently); stage 0 of a 2-stage split is
    not the unpipelined model, and two stages of equal layer count never share a key."""

    def digest(layout: list[object]) -> bytes:
        fields = ["kvlife.identity.v1", "m", "w", "t", "rope", "", "", layout]
        return blake3.blake3(msgpack.packb(fields)).digest()

    def ident(**kw: int) -> ModelIdentity:
        return ModelIdentity("m", "w", "t", KVLayout(15, 3, 64, "float16", 256, **kw), "rope")

    stage1 = ident(pp_rank=1, pp_size=2, first_layer=15)
    assert stage1.digest == digest([15, 3, 64, "float16", 256, "pp", 1, 2, 15])
    both = ident(tp_rank=1, tp_size=2, kv_head_start=3, pp_rank=1, pp_size=2, first_layer=15)
    assert both.digest == digest([15, 3, 64, "float16", 256, "tp", 1, 2, 3, "pp", 1, 2, 15])
    stage0 = ident(pp_rank=0, pp_size=2, first_layer=0)
    assert len({ident().digest, stage0.digest, stage1.digest}) == 3


TOKEN_DTYPES = ("<i4", "<u4", ">u4", ">i4", "<i8", "<u8", "<u2", "<i2", "u1")


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**15 - 1), max_size=40),
    dtype=st.sampled_from(TOKEN_DTYPES),
    strided=st.booleans(),
    start=st.integers(0, 64),
)
def test_prompt_keys_of_any_token_array_equal_the_keys_of_its_ids(
    ids: list[int], dtype: str, strided: bool, start: int
) -> None:
    """Keys hashed from a view of an int32/uint32 array's memory (no copy) or from a
    copy of any other array equal those of the same ids as a list, chunk by chunk as
    ``chunk_key`` encodes them (issue 28: the lookup no longer copies the tokens)."""
    ident = ModelIdentity("m", "w", "t", KVLayout(1, 1, 1, "float16", 4))
    ids = [i % 255 for i in ids] if dtype == "u1" else ids
    arr = np.array(ids, dtype=dtype)
    if strided:  # not contiguous: every other id of an array twice as long
        wide = np.zeros(2 * len(ids), dtype=dtype)
        wide[::2] = ids
        arr = wide[::2]
    keys = prompt_chunk_keys(ident, PUBLIC, arr, start=start)
    assert keys == prompt_chunk_keys(ident, PUBLIC, ids, start=start)
    parent, want = ROOT_PARENT, []
    for i in range(len(ids) // 4):
        parent = chunk_key(ident.digest, PUBLIC.salt, parent, start + 4 * i, ids[4 * i : 4 * i + 4])
        want.append(parent)
    assert keys == want


@pytest.mark.parametrize("dtype", ["<i4", "<i8", "<i2", ">i4"])
def test_negative_token_ids_are_rejected_whatever_the_dtype(dtype: str) -> None:
    ident = ModelIdentity("m", "w", "t", KVLayout(1, 1, 1, "float16", 4))
    arr = np.array([1, 2, -3, 4], dtype=dtype)
    with pytest.raises(InvalidArgument, match="token ids"):
        prompt_chunk_keys(ident, PUBLIC, arr)
    with pytest.raises(InvalidArgument, match="token ids"):
        prompt_chunk_keys(ident, PUBLIC, np.array([2**32], dtype="<i8"))


BOUNDARY_IDS = [0, 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]


def _containers(ids: list[int]) -> dict[str, Any]:
    """The same ids in every form a caller may hand over (each holds all of them)."""
    u4 = np.array(ids, "<u4")
    wide = np.zeros(3 * len(ids), "<u4")
    wide[::3] = ids
    raw = np.zeros(4 * len(ids) + 1, np.uint8)
    unaligned = raw[1:].view("<u4")  # a view at an odd address, contiguous
    unaligned[:] = ids
    readonly = u4.copy()
    readonly.flags.writeable = False
    forms: dict[str, Any] = {
        "list": list(ids),
        "tuple": tuple(ids),
        "array.array": array.array("I", ids),
        "memoryview": memoryview(u4.data),
        "<u4": u4,
        ">u4": u4.astype(">u4"),
        "<i8": u4.astype("<i8"),
        ">i8": u4.astype(">i8"),
        "<u8": u4.astype("<u8"),
        "strided": wide[::3],
        "reversed twice": u4[::-1].copy()[::-1],
        "unaligned": unaligned,
        "readonly": readonly,
        "numpy ints in a list": [np.uint64(i) for i in ids],
    }
    return forms  # a torch tensor goes through np.asarray alike (not imported: 3 s)


def test_held_the_same_ids_in_any_container_give_the_same_keys() -> None:
    """Ids at the edges of every dtype (2**31 and up: negative as int32, so only an
    unsigned or 8-byte array holds them), in lists, tuples, buffers, byte orders,
    strides, an unaligned or read-only view: the keys of the list, every time."""
    ident = ModelIdentity("m", "w", "t", KVLayout(1, 1, 1, "float16", 4))
    want = prompt_chunk_keys(ident, PUBLIC, BOUNDARY_IDS)
    assert len(want) == 2
    for name, tokens in _containers(BOUNDARY_IDS).items():
        assert prompt_chunk_keys(ident, PUBLIC, tokens) == want, name
    small = [0, 1, 127, 5]  # every integer dtype holds these
    want = prompt_chunk_keys(ident, PUBLIC, small)
    for dtype in ("i1", "u1", "<i2", ">i2", "<u2", ">u2", "<i4", ">i4", "<u4", ">u4", "<i8"):
        assert prompt_chunk_keys(ident, PUBLIC, np.array(small, dtype)) == want, dtype
    # one id more: another prompt, other keys (no id aliases another through a dtype)
    assert prompt_chunk_keys(ident, PUBLIC, [0, 1, 127, 6]) != want


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([1, 2, -1, 4], "<i4"),  # as u32: 2**32 - 1, another id: refused
        np.array([1, 2, -1, 4], ">i4"),
        np.array([1, 2, -128, 4], "i1"),
        np.array([1, 2, -1, 4], "<i2"),
        np.array([1, 2, -(2**63), 4], "<i8"),
        np.array([1, 2, 2**32, 4], "<u8"),
        np.array([1, 2, 2**64 - 1, 4], ">u8"),
        np.array([1, 2, 3, 4], "f4"),
        np.array([True, True, False, True]),
        np.array([1, 2, 3, 4], object),
        np.array([1, 2, 3, 4], "m8[s]"),
        np.array(5, "<u4"),  # 0-d
        np.zeros((2, 4), "<u4"),  # 2-d
        np.array([1, 2, -1, 4], "<i4")[::2],  # strided, the -1 kept
        b"\x01\x00\x00\x00" * 4,  # bytes are no sequence of ids here
        [1, 2, 2**32, 4],
        [1, 2, -1, 4],
        [1.0, 2.0, 3.0, 4.0],
        [[1, 2], [3, 4]],
    ],
    ids=lambda t: f"{type(t).__name__}-{getattr(t, 'dtype', '')}-{getattr(t, 'shape', '')}",
)
def test_held_token_ids_no_key_can_encode_are_refused_typed(tokens: Any) -> None:
    ident = ModelIdentity("m", "w", "t", KVLayout(1, 1, 1, "float16", 4))
    with pytest.raises(InvalidArgument, match="token ids"):
        prompt_chunk_keys(ident, PUBLIC, tokens)
