"""The one-pass lookup (issue 28) answers hit for hit what the general path answers:
every chunk through ``StoreCore.serving`` and a new hit record, for every mix of replica
states, representations, prompt offsets and Accepts, and again on a second lookup (the
hit records kept on the replicas are reused only while they still say the same)."""

from __future__ import annotations

from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvlife.core.identity import PUBLIC, ROOT_PARENT, ChunkKey, ModelIdentity
from kvlife.core.lifecycle import ObjectState
from kvlife.core.objects import EXACT, ObjectRecord, Replica, ReplicaState, Representation, TierName
from kvlife.results import ChunkHit
from kvlife.store import KVStore
from kvlife.store.core import StoreCore
from kvlife.store.reads import _hit
from kvlife.transforms.base import Exactness
from kvlife.transforms.contract import Accept
from tests.conftest import TINY, prompt_kv, tiny_identity

N = TINY.tokens_per_chunk
CHUNKS = 6
FORMS = (
    EXACT,
    Representation("exact", 1, (), False),  # equal to EXACT, not the same object
    Representation("lossless", 1, (), True),
    Representation("nosuch", 1, (), True),  # a transform this reader does not know
)
R = ReplicaState
STATES = (R.READY, R.READY, R.EVICTING, R.EVICTING, R.LEAVING, R.WRITING, None)
"""Every state, the readable ones more often (None: no replica in that tier)."""
Fields = tuple[Replica, ReplicaState, Representation, int]
"""A replica's state, representation and size before an example changed them."""
ACCEPTS = (Accept.EXACT, Accept.LOSSLESS, Accept(Exactness.LOSSY))


def general_path(
    core: StoreCore, keys: list[ChunkKey], start: int, accept: Accept
) -> tuple[list[ChunkHit], str]:
    """The lookup as it was before the one-pass loop: the reference."""
    hits: list[ChunkHit] = []
    for i, key in enumerate(keys):
        rec = core.index.get(key)
        if rec is None or rec.state is not ObjectState.INDEXED:
            break
        got = core.serving(rec, accept)
        if got.tier is None or got.replica is None:
            return hits, got.refused
        hits.append(_hit(i, key, start + i * N, got, rec, core.decode_rates))
    return hits, ""


@pytest.fixture(scope="module")
def store_and_keys(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[KVStore, ModelIdentity, np.ndarray, list[ChunkKey]]]:
    """A store whose chunks each have a DRAM and a disk replica (write-through)."""
    identity = tiny_identity()
    tokens, kv = prompt_kv(3, CHUNKS * N)
    path = tmp_path_factory.mktemp("lookup-pass")
    with KVStore.open(path, dram_bytes=1 << 22, disk_bytes=1 << 24, write_through=True) as store:
        keys = store.put_prompt(identity, PUBLIC, tokens, kv).keys
        store.flush()
        yield store, identity, tokens, keys


chunk_states = st.tuples(
    st.sampled_from(STATES), st.sampled_from(STATES), st.sampled_from(range(len(FORMS)))
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    states=st.lists(chunk_states, min_size=CHUNKS, max_size=CHUNKS),
    offset=st.integers(0, CHUNKS - 1),
    accept=st.sampled_from(ACCEPTS),
    grow=st.booleans(),
)
def test_one_pass_lookup_answers_as_the_general_path(
    store_and_keys: tuple[KVStore, ModelIdentity, np.ndarray, list[ChunkKey]],
    states: list[tuple[ReplicaState | None, ReplicaState | None, int]],
    offset: int,
    accept: Accept,
    grow: bool,
) -> None:
    store, identity, tokens, keys = store_and_keys
    core: StoreCore = store._reader.core
    saved: list[
        tuple[
            ObjectRecord,
            dict[TierName, Replica],
            list[tuple[Replica, ReplicaState, Representation, int]],
        ]
    ] = []
    with core.lock:
        for key, (dram, disk, form) in zip(keys, states, strict=True):
            rec = core.index.get(key)
            assert rec is not None
            saved.append(
                (
                    rec,
                    dict(rec.replicas),
                    [(r, r.state, r.transform, r.nbytes) for r in rec.replicas.values()],
                )
            )
            for tier, state in ((TierName("dram"), dram), (TierName("disk"), disk)):
                rep = rec.replicas.get(tier) or saved[-1][1].get(tier)
                if state is None:
                    rec.replicas.pop(tier, None)
                    continue
                assert rep is not None
                rec.replicas[tier] = rep
                rep.state = state
                rep.transform = FORMS[form] if tier == "disk" else rep.transform
    try:
        start = offset * N
        for round_ in range(2):  # the second lookup reuses the hit records of the first
            got = store.lookup(
                identity,
                PUBLIC,
                tokens[start:],
                start=start,
                parent=keys[offset - 1] if offset else ROOT_PARENT,
                accept=accept,
            )
            with core.lock:
                want, refusal = general_path(core, keys[offset:], start, accept)
            assert got.hits == want
            assert got.refusal == refusal and got.refused == int(bool(refusal))
            if grow and round_ == 0:  # a replica whose size changed: its old hit is stale
                with core.lock:
                    for rec, _, _ in saved:
                        for rep in rec.replicas.values():
                            rep.nbytes += 1
    finally:
        with core.lock:
            for rec, replicas, fields in saved:
                rec.replicas.clear()
                rec.replicas.update(replicas)
                for rep, state, was, nbytes in fields:
                    rep.state, rep.transform, rep.nbytes = state, was, nbytes
                    rep.noted = False
