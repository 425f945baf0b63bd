"""The names tenants use (principals, organisations, request ids): checked before
anything is keyed or stored.

The server joins a principal's name and a request id into one namespace name
(``alice/r1``), so a name must not hold the separator: else principal ``a`` naming
request ``b/x`` would name ``a/b/x``, the namespace of principal ``a/b``'s request ``x``. Control
characters, whitespace and the namespace separators ``:`` and ``/`` are refused, and
so are ``.`` and ``..`` (names may become file names: per-principal arena files).
"""

from __future__ import annotations

import re

from kvlife.core.errors import InvalidArgument

MAX_NAME = 128
"""Longest name (characters)."""

NAME_PATTERN = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{{0,{MAX_NAME - 1}}}")
"""What a name may be: ASCII letters, digits and ``_ . @ + = -``, starting with a letter,
digit or ``_`` (no path or option look-alikes)."""

REQUEST_SEPARATOR = "/"
"""Joins a principal's name and a request id into a request namespace's name."""


def check_name(what: str, name: object) -> str:
    """``name`` if it is a valid tenant name, else InvalidArgument naming ``what`` and
    what was wrong (the name itself is shown escaped and cut: it may be hostile)."""
    if not isinstance(name, str):
        raise InvalidArgument(f"{what} must be a str, got {type(name).__name__}")
    if NAME_PATTERN.fullmatch(name) is None:
        shown = ascii(name[:64])
        raise InvalidArgument(
            f"{what} {shown} is not a valid name: 1..{MAX_NAME} of ASCII letters, digits "
            "and _ . @ + = -, starting with a letter, digit or _ (no separators, "
            "whitespace or control characters)"
        )
    return name
