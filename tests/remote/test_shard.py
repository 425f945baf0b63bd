"""``--shard I/N`` (tests/remote/shard.py), which the Mooncake runners split their inner
pytest with: the shards of a selection run every selected test exactly once (the other
tests deselected, as ``-k`` reports its own), and a bad value is a usage error naming it.
The hook is called as pytest calls it, on a list of stand-in items."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.remote.shard import parse_shard, pytest_collection_modifyitems


def _shard(option: str | None, items: list[Any]) -> tuple[list[Any], list[Any]]:
    """What the hook keeps of ``items`` and what it reports deselected."""
    deselected: list[Any] = []
    config = SimpleNamespace(
        getoption=lambda name: option,
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
    )
    kept = list(items)
    pytest_collection_modifyitems(config, kept)  # type: ignore[arg-type]
    return kept, deselected


def test_the_shards_of_a_selection_run_each_selected_test_once() -> None:
    items = [object() for _ in range(11)]
    shards = [_shard(f"{i}/3", items) for i in range(3)]
    assert [len(kept) for kept, _ in shards] == [4, 4, 3]
    assert sorted(id(t) for kept, _ in shards for t in kept) == sorted(map(id, items))
    for kept, deselected in shards:
        assert {id(t) for t in deselected} == {id(t) for t in items} - {id(t) for t in kept}
    assert _shard(None, items) == (items, [])  # no --shard: everything runs


@pytest.mark.parametrize("bad", ["3/3", "-1/3", "a/b", "1", "1/2/3"])
def test_a_bad_shard_is_a_usage_error_naming_it(bad: str) -> None:
    with pytest.raises(pytest.UsageError, match=repr(bad).replace("/", ".")):
        parse_shard(bad)
