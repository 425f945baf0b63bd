"""``HOST:PORT`` as ``kvlife serve --metrics`` and the configuration file's ``[server]
metrics`` take it, parsed without the ops extra (prometheus-client), so that ``kvlife
config check`` can check an address on a machine without it."""

from __future__ import annotations

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
