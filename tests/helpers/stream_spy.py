"""A count of the bytes the native extension's streaming copies moved in this process
(tests of the streaming copies out of an arena or a replica: the served load's client,
the DRAM tiers; and of the disk tier's copies through its aligned staging buffers)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from kvlife.native import frames as native

Mangle = Callable[[np.ndarray], None]
"""What a spy does to a destination after the extension's ``copy_sealed`` filled it."""


def count_native(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, after_sealed: Mangle | None = None
) -> dict[str, list[int]]:
    """From now on, the byte count of each ``stream_copy`` and each ``copy_sealed`` that
    ``module`` (the checked extension, :func:`kvlife.native.frames.native_module`) made,
    in order, by name; the calls it refused (their bytes copied by ``np.copyto``) are not
    counted. ``after_sealed``: run on each destination ``copy_sealed`` filled, after its
    seal was taken (a caller's bytes changing between a block's hash and its copy)."""
    seen: dict[str, list[int]] = {"stream_copy": [], "copy_sealed": []}
    stream, sealed = module.stream_copy, module.copy_sealed

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(module, name)

        def stream_copy(self, dst: np.ndarray, src: np.ndarray) -> bool:
            done = bool(stream(dst, src))
            if done:
                seen["stream_copy"].append(np.asarray(dst).nbytes)
            return done

        def copy_sealed(self, dst: np.ndarray, src: np.ndarray) -> object:
            seal = sealed(dst, src)
            if seal is not None:
                seen["copy_sealed"].append(np.asarray(dst).nbytes)
                if after_sealed is not None:
                    after_sealed(dst)
            return seal

    monkeypatch.setattr(native, "native_module", lambda: Counting())
    return seen


def count_streamed(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[int]:
    """The ``stream_copy`` counts of :func:`count_native`."""
    return count_native(monkeypatch, module)["stream_copy"]
