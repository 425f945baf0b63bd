"""``HOST:PORT`` as ``kvlife serve --metrics`` and the configuration file's ``[server]
metrics`` take it, parsed without the ops extra (prometheus-client), so that ``kvlife
config check`` can check an address on a machine without it."""

from __future__ import annotations

import socket

from kvlife.core.errors import InvalidArgument


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (loopback when no host) -> (host, port);
    InvalidArgument naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise InvalidArgument(f"--metrics {text!r}: {port!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise InvalidArgument(f"--metrics {text!r}: port {number} is not in 0..65535")
    return host, number


def check_bindable(host: str, port: int) -> None:
    """InvalidArgument unless a listening socket can be bound at ``host:port`` now (the
    host resolves, the port is free), as the metrics server binds it: checked before
    the server makes its store, so that an address it cannot serve on leaves nothing
    behind (another process may still take the port before the server binds it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # as http.server does: a port left in TIME_WAIT is bindable
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except OSError as exc:
        raise InvalidArgument(f"cannot serve metrics on {host}:{port}: {exc}") from None
