"""Command-line counts of the benchmarks (rounds, repetitions): a whole number in a
range, or argparse's own error naming the flag (exit 2), never a median of nothing."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def count_arg(flag: str, most: int) -> Callable[[str], int]:
    """An argparse ``type`` for ``flag``: a whole number from 1 to ``most``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, not {text!r}") from None
        if not 1 <= n <= most:
            raise argparse.ArgumentTypeError(f"{flag} must be 1 to {most}, not {n}")
        return n

    return parse
