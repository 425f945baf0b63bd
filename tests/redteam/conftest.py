"""The red team's tests use the server tests' ``server`` and ``remote`` fixtures (one
``kvlife serve`` per test, stopped by PID, and a client of it)."""

from tests.server.conftest import remote, server

__all__ = ["remote", "server"]
