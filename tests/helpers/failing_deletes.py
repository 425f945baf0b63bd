"""A disk tier whose physical deletes fail (the catalog write raising EIO), for the
tests of kvlife/store/deletes.py: the failure injected where the tier's writer takes
its deletes, the store itself real."""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence

from kvlife.core.identity import ChunkKey
from kvlife.store import KVStore
from tests.helpers.workload import disk_of


def fail_deletes(
    store: KVStore,
    times: int,
    *,
    armed: Callable[[], bool] = lambda: True,
    exc: BaseException | None = None,
) -> list[int]:
    """Make the next ``times`` deletes of ``store``'s disk tier made while ``armed()``
    holds raise ``exc`` (OSError EIO unless given); returns the list of the key counts
    of the deletes that failed, filled as they fail."""
    disk = disk_of(store)
    real = disk.delete_forgetting
    failed: list[int] = []

    def delete(keys: Sequence[ChunkKey], forget: Sequence[bytes]) -> list[int]:
        if armed() and len(failed) < times:
            failed.append(len(keys))
            raise exc if exc is not None else OSError(errno.EIO, "catalog write failed (injected)")
        return real(keys, forget)

    disk.delete_forgetting = delete  # type: ignore[method-assign]
    return failed
