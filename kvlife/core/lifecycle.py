"""The object lifecycle: one enum of states, one transition table, checked on every call.

::

    TENTATIVE --commit--> COMMITTED --index--> INDEXED --invalidate--> INVALIDATED
    INVALIDATED --delete--> DELETED
    TENTATIVE --abort--> DELETED              (failed write, rollback)
    INDEXED  --corrupt--> INVALIDATED         (checksum mismatch found on read)
    COMMITTED --invalidate--> INVALIDATED     (invalidated before it was published)

Replica moves (allocate, write, seal, offload, load, evict, recover, transform, refuse) do not
change the object's state but are legal only in the states listed in
:data:`REPLICA_MOVE_STATES`. :func:`check_move` is the single gate; an illegal move raises
:class:`~kvlife.core.errors.IllegalTransition` naming the object, its state and the move.
Only INDEXED objects may be served.
"""

from __future__ import annotations

from kvlife.core.enums import IdentityHashedEnum
from kvlife.core.errors import IllegalTransition


class ObjectState(IdentityHashedEnum):
    """States of a logical KV object."""

    TENTATIVE = "tentative"
    COMMITTED = "committed"
    INDEXED = "indexed"
    INVALIDATED = "invalidated"
    DELETED = "deleted"


class Move(IdentityHashedEnum):
    """Every lifecycle move, object moves and replica moves alike."""

    # object moves
    PUT = "put"
    COMMIT = "commit"
    ABORT = "abort"
    INDEX = "index"
    INVALIDATE = "invalidate"
    CORRUPT = "corrupt"
    DELETE = "delete"
    # replica moves
    ALLOCATE = "allocate"
    WRITE = "write"
    SEAL = "seal"
    OFFLOAD = "offload"
    TRANSFORM = "transform"
    LOAD = "load"
    EVICT = "evict"
    RECOVER = "recover"
    REFUSE = "refuse"
    """A replica was not served: its transform or version is unknown to this reader."""


S = ObjectState

TRANSITIONS: dict[tuple[ObjectState | None, Move], ObjectState] = {
    (None, Move.PUT): S.TENTATIVE,
    (S.TENTATIVE, Move.COMMIT): S.COMMITTED,
    (S.TENTATIVE, Move.ABORT): S.DELETED,
    (S.COMMITTED, Move.INDEX): S.INDEXED,
    (S.COMMITTED, Move.INVALIDATE): S.INVALIDATED,
    (S.INDEXED, Move.INVALIDATE): S.INVALIDATED,
    (S.INDEXED, Move.CORRUPT): S.INVALIDATED,
    (S.INVALIDATED, Move.DELETE): S.DELETED,
    # an object found committed and verified after a restart is re-published
    (None, Move.RECOVER): S.COMMITTED,
}
"""Object moves: (state before, move) -> state after. ``None`` is "does not exist yet"."""

REPLICA_MOVE_STATES: dict[Move, frozenset[ObjectState]] = {
    Move.ALLOCATE: frozenset({S.TENTATIVE, S.INDEXED}),
    Move.WRITE: frozenset({S.TENTATIVE, S.INDEXED}),
    Move.SEAL: frozenset({S.TENTATIVE, S.INDEXED}),
    Move.OFFLOAD: frozenset({S.INDEXED}),
    Move.TRANSFORM: frozenset({S.INDEXED}),
    Move.LOAD: frozenset({S.INDEXED}),
    Move.EVICT: frozenset({S.TENTATIVE, S.COMMITTED, S.INDEXED, S.INVALIDATED}),
    Move.REFUSE: frozenset({S.INDEXED}),
}
"""Replica moves and the object states in which each is legal (the state is unchanged)."""

SERVABLE = S.INDEXED


def is_object_move(move: Move) -> bool:
    return move not in REPLICA_MOVE_STATES


def check_move(obj: str | bytes, state: ObjectState | None, move: Move) -> ObjectState | None:
    """Return the state after ``move``; raise IllegalTransition if the table forbids it.

    ``obj`` names the object in that error: a name, or its key (bytes, written in hex
    only when the move is refused: the ledger checks every move of every request).
    ``state`` None means the object does not exist (only PUT and RECOVER are legal then).
    Replica moves return the state unchanged.
    """
    allowed = REPLICA_MOVE_STATES.get(move)
    if allowed is not None:
        if state is None or state not in allowed:
            raise _illegal(obj, state, move)
        return state
    after = TRANSITIONS.get((state, move))
    if after is None:
        raise _illegal(obj, state, move)
    return after


def _illegal(obj: str | bytes, state: ObjectState | None, move: Move) -> IllegalTransition:
    return IllegalTransition(obj.hex() if isinstance(obj, bytes) else obj, _name(state), move.value)


def _name(state: ObjectState | None) -> str:
    return "ABSENT" if state is None else state.name
