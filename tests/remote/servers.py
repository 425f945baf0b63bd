"""Session-scoped real servers for the remote-tier tests (a pytest plugin named in
tests/conftest.py): one redis-server and a three-master Redis Cluster on 127.0.0.1
ports, started once per session and stopped by PID."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlife.tiers.redis.server import RedisClusterServers, RedisServer


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not installed: `make test` installs it as root "
            "(apt-get install redis-server libibverbs1)"
        )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    _need_redis()
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def index_ns() -> str:
    """A fresh index namespace: each test sees an empty shared tier."""
    return "t" + uuid.uuid4().hex[:12]


def scratch(tmp_path: Path) -> Path:
    return tmp_path
