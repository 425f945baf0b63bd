"""A Redis pipeline whose replies are lost: the connection cut after the commands were
sent (they ran) or before (nothing ran), as a real cut leaves a writer that cannot tell
which."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis


class ReplyLost:
    """A pipeline whose ``execute`` runs its commands (or, ``runs=False``, sends
    nothing) and then fails as a connection cut before the replies does."""

    def __init__(self, pipe: Any, runs: bool) -> None:
        self._pipe = pipe
        self._runs = runs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        if self._runs:
            self._pipe.execute(*args, **kwargs)
        raise redis.exceptions.ConnectionError("connection cut before the replies (test)")


def losing(real: Callable[..., Any], nth: int, runs: bool) -> Callable[..., Any]:
    """A ``client.pipeline`` whose ``nth`` pipeline (1: the next) loses its replies."""
    calls = [0]

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real(*args, **kwargs)
        calls[0] += 1
        return ReplyLost(pipe, runs) if calls[0] == nth else pipe

    return pipeline
