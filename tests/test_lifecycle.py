"""The transition table is enforced on every call and errors name object, state and move."""

from __future__ import annotations

import itertools

import pytest

from kvlife.core.errors import IllegalTransition
from kvlife.core.events import JsonlSink, LifecycleEvent, MemorySink, read_jsonl
from kvlife.core.lifecycle import (
    REPLICA_MOVE_STATES,
    TRANSITIONS,
    Move,
    ObjectState,
    check_move,
)

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
