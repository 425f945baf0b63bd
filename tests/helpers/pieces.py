"""Small pieces for the tests of a run's last frame read in pieces (``read_split`` in
``kvlife/native/_frames.c``): the extension's default piece is 2 MiB (frames of up to
4 MiB read whole, :data:`kvlife.native.frames.DEFAULT_PIECE`); these tests reach every
piece edge of the same code with frames of a few hundred KiB. A module that imports
:func:`small_pieces` runs each of its tests with them (an autouse fixture)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvlife.native import frames as native

PIECE = 256 << 10
"""The smallest piece in these tests."""
SPLIT = 2 * PIECE
"""A run's last frame larger than this is read in pieces here."""


@pytest.fixture(autouse=True)
def small_pieces() -> Iterator[None]:
    """Runs started in the test read a last frame larger than :data:`SPLIT` in pieces of
    at least :data:`PIECE`; the default again after it."""
    if not native.available():
        yield
        return
    previous = native.set_piece(PIECE)
    try:
        yield
    finally:
        native.set_piece(previous)
