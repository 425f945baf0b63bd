"""What the attack modules that put through a real ``kvlife serve`` share: one server
per module, a client per test, and model identities no other test of the module
uses (so keys never collide between tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import count
from typing import Any

import pytest

from kvlife.client import RemoteStore
from kvlife.core.identity import KVLayout, ModelIdentity
from tests.server.conftest import ServerProc


def served(tag: str, *, dram: int, staging: int, disk: int = 64 << 20) -> tuple[Any, Any]:
    """``(server, remote)`` fixtures for a test module to bind under those two names:
    a ``kvlife serve`` started once for the module with these budgets (ServerProc's),
    stopped by PID after it, and a client of it per test, closed after."""

    @pytest.fixture(scope="module")
    def server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
        path = tmp_path_factory.mktemp(tag) / "srv"
        srv = ServerProc(path, dram=dram, disk=disk, staging=staging).start()
        try:
            yield srv
        finally:
            srv.stop()

    @pytest.fixture
    def remote_fixture(request: pytest.FixtureRequest) -> Iterator[RemoteStore]:
        store = request.getfixturevalue("server").client()
        try:
            yield store
        finally:
            store.close()

    return server_fixture, remote_fixture


def identities(tag: str) -> Callable[[KVLayout], ModelIdentity]:
    """A maker of identities of ``layout``, each a model no other call named."""
    numbers = count()

    def identity(layout: KVLayout) -> ModelIdentity:
        return ModelIdentity(
            layout=layout,
            model_id=f"{tag}-{next(numbers)}",
            weights_digest="w",
            tokenizer_digest="t",
        )

    return identity
