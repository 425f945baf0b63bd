"""The transition table is enforced on every call and errors name object, state and move."""

from __future__ import annotations

import copy
import itertools
import pickle
from enum import Enum

import pytest

from kvlife.core.errors import IllegalTransition
from kvlife.core.events import JsonlSink, LifecycleEvent, MemorySink, read_jsonl
from kvlife.core.identity import NamespaceKind
from kvlife.core.lifecycle import (
    REPLICA_MOVE_STATES,
    TRANSITIONS,
    Move,
    ObjectState,
    check_move,
)
from kvlife.core.objects import ReplicaState

S = ObjectState
STATES: list[ObjectState | None] = [None, *ObjectState]

EXPECTED_OBJECT_MOVES = {
    (None, Move.PUT): S.TENTATIVE,
    (S.TENTATIVE, Move.COMMIT): S.COMMITTED,
    (S.TENTATIVE, Move.ABORT): S.DELETED,
    (S.COMMITTED, Move.INDEX): S.INDEXED,
    (S.COMMITTED, Move.INVALIDATE): S.INVALIDATED,
    (S.INDEXED, Move.INVALIDATE): S.INVALIDATED,
    (S.INDEXED, Move.CORRUPT): S.INVALIDATED,
    (S.INVALIDATED, Move.DELETE): S.DELETED,
    (None, Move.RECOVER): S.COMMITTED,
}


def test_table_is_the_designed_one() -> None:
    assert TRANSITIONS == EXPECTED_OBJECT_MOVES


@pytest.mark.parametrize("state, move", list(itertools.product(STATES, list(Move))))
def test_every_pair_is_allowed_or_raises(state: ObjectState | None, move: Move) -> None:
    obj = "abc123"
    if move in REPLICA_MOVE_STATES:
        if state in REPLICA_MOVE_STATES[move]:
            assert check_move(obj, state, move) is state
            return
    elif (state, move) in EXPECTED_OBJECT_MOVES:
        assert check_move(obj, state, move) is EXPECTED_OBJECT_MOVES[(state, move)]
        return
    with pytest.raises(IllegalTransition) as info:
        check_move(obj, state, move)
    err = info.value
    assert err.obj == obj and err.move == move.value
    assert err.state == ("ABSENT" if state is None else state.name)
    assert obj in str(err) and move.value in str(err) and err.state in str(err)


@pytest.mark.parametrize("state, move", [(None, Move.INDEX), (S.DELETED, Move.LOAD)])
def test_a_refused_move_of_a_key_names_it_in_hex(state: ObjectState | None, move: Move) -> None:
    """The ledger passes the key's bytes; only a refused move writes them out."""
    key = bytes(range(32))
    with pytest.raises(IllegalTransition) as info:
        check_move(key, state, move)
    assert info.value.obj == key.hex() and key.hex() in str(info.value)


@pytest.mark.parametrize("enum_type", [ObjectState, Move, ReplicaState, NamespaceKind])
def test_identity_hashed_enums_key_maps_as_their_members(enum_type: type[Enum]) -> None:
    """Members hashed by identity are still one key each, equal only to themselves, and
    come back from a pickle or a copy as the very member (so as the same key)."""
    members = list(enum_type)
    keyed = {m: i for i, m in enumerate(members)}
    assert len(keyed) == len(members) == len(set(members))
    for i, m in enumerate(members):
        assert keyed[enum_type(m.value)] == i
        assert keyed[pickle.loads(pickle.dumps(m))] == i
        assert keyed[copy.deepcopy(m)] == i
        assert m not in {m.value, m.name}  # not equal to its value or name
        assert hash(m) == hash(copy.copy(m))


def test_only_indexed_objects_can_be_loaded() -> None:
    for state in STATES:
        if state is S.INDEXED:
            check_move("k", state, Move.LOAD)
        else:
            with pytest.raises(IllegalTransition):
                check_move("k", state, Move.LOAD)


def test_jsonl_sink_round_trips(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "events.jsonl"  # type: ignore[operator]
    sink = JsonlSink(path)
    events = [
        LifecycleEvent(1.5, 1, "put", "ab", "tentative", nbytes=10, namespace="public"),
        LifecycleEvent(2.5, 2, "offload", "ab", "indexed", tier="dram", dst_tier="disk"),
    ]
    for e in events:
        sink.emit(e)
    sink.close()
    assert read_jsonl(path) == events
    mem = MemorySink()
    mem.emit(events[0])
    assert mem.take() == [events[0]]
    assert mem.take() == []
