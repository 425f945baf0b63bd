"""Where a Redis tier (or the global index) connects: one server or a Redis Cluster,
with the timeouts that turn a dead or stalled server into a typed miss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvlife.core.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    """A Redis server (``url``) or cluster (``cluster``: seed ``host:port`` list)."""

    url: str = ""
    """``redis://127.0.0.1:6379/0`` for one server."""
    cluster: tuple[str, ...] = ()
    """Seed nodes of a Redis Cluster (``127.0.0.1:7000`` ...)."""
    socket_timeout_s: float = 2.0
    """A reply not complete within this is a failure (stalled server, black hole)."""
    connect_timeout_s: float = 1.0
    max_connections: int = 32

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.cluster):
            raise InvalidArgument("a Redis endpoint needs exactly one of url= and cluster=")
        for node in self.cluster:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument(f"cluster node {node!r} is not host:port")
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise InvalidArgument("Redis timeouts must be > 0")

    @classmethod
    def parse(cls, text: str, socket_timeout_s: float = 2.0) -> RedisEndpoint:
        """``redis://host:port/db`` or ``cluster://h1:p1,h2:p2``."""
        if text.startswith("cluster://"):
            nodes = tuple(n for n in text[len("cluster://") :].split(",") if n)
            return cls(cluster=nodes, socket_timeout_s=socket_timeout_s)
        if text.startswith(("redis://", "unix://")):
            return cls(url=text, socket_timeout_s=socket_timeout_s)
        raise InvalidArgument(f"Redis endpoint {text!r}: use redis://... or cluster://...")

    def connect(self) -> Any:
        """A client (no retries of its own: the tier's health decides when to retry)."""
        common: dict[str, Any] = {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.url:
            pool = redis.ConnectionPool.from_url(
                self.url, max_connections=self.max_connections, **common
            )
            return redis.Redis(connection_pool=pool)
        nodes = []
        for node in self.cluster:
            host, _, port = node.rpartition(":")
            nodes.append(ClusterNode(host, int(port)))  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, max_connections=self.max_connections, **common)
