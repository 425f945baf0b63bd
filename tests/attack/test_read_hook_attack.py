"""Red team, issue 28 seam 1: the thread-local read hook of pipelined disk loads.

A hook set for one read must never fire for another read (a later one in the same
pool thread, or one in another thread), must fire at most once, and must not outlive
its ``with`` block whether the read signalled, raised, or never signalled."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvlife.tiers.base import device_read_returned, when_read_returns


def test_unfired_hook_does_not_leak_to_a_later_read_in_the_same_pool_thread() -> None:
    fired: list[str] = []
    with ThreadPoolExecutor(max_workers=1) as pool:

        def first() -> None:  # a tier that never signals: the hook stays unfired
            with when_read_returns(lambda: fired.append("first")):
                pass

        def second() -> None:  # a later read in the same thread, no hook of its own
            device_read_returned()

        pool.submit(first).result()
        pool.submit(second).result()
    assert fired == []


def test_hook_fires_once_even_when_the_tier_signals_twice() -> None:
    fired: list[int] = []
    with when_read_returns(lambda: fired.append(1)):
        device_read_returned()
        device_read_returned()
    assert fired == [1]


def test_hook_is_per_thread() -> None:
    fired: list[str] = []
    with when_read_returns(lambda: fired.append("main")):
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(device_read_returned).result()
        assert fired == []
        device_read_returned()
    assert fired == ["main"]


def test_read_that_raises_leaves_no_hook_behind() -> None:
    fired: list[str] = []
    with pytest.raises(OSError), when_read_returns(lambda: fired.append("x")):
        raise OSError("preadv failed before the hook")
    device_read_returned()
    assert fired == []


def test_nested_hooks_restore_the_outer_one() -> None:
    fired: list[str] = []
    with when_read_returns(lambda: fired.append("outer")):
        with when_read_returns(lambda: fired.append("inner")):
            device_read_returned()
        device_read_returned()
    device_read_returned()
    assert fired == ["inner", "outer"]


def test_hook_that_reads_again_does_not_fire_itself_recursively() -> None:
    fired: list[str] = []

    def hook() -> None:
        fired.append("hook")
        device_read_returned()  # the next read submitted from the hook, same thread

    with when_read_returns(hook):
        device_read_returned()
    assert fired == ["hook"]
