"""A pytest plugin (``-p tests.remote.shard``) adding ``--shard I/N``: of the tests left
after ``-k`` and ``-m``, run only every N-th, starting at the I-th (0-based).

The Mooncake runners (tests/remote/test_mooncake.py) start their inner pytest as N such
shards side by side, each in its own private network namespace with its own master,
metadata server and Redis: the inner tests mostly wait (a Mooncake client's close
joins threads that sleep a second, holding the GIL), so shards in parallel run the same
tests in a fraction of the wall time. Every test runs in exactly one shard."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only every N-th selected test, starting at the I-th (0-based)",
    )


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` as ``(I, N)``; a typed usage error naming the value otherwise."""
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard wants I/N (two integers), got {text!r}") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard {text!r}: I must be in 0..N-1")
    return i, n


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    option = config.getoption("--shard")
    if option is None:
        return
    i, n = parse_shard(str(option))
    keep = items[i::n]
    kept = {id(item) for item in keep}
    dropped = [item for item in items if id(item) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
