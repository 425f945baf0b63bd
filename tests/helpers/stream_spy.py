"""A count of the bytes the native extension's ``stream_copy`` copied in this process
(tests of the streaming copies out of an arena or a replica: the served load's client,
the DRAM tiers)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from kvlife.native import frames as native


def count_streamed(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[int]:
    """From now on, the byte count of each ``stream_copy`` that ``module`` (the checked
    extension, :func:`kvlife.native.frames.native_module`) streamed, in order; the calls
    it refused (their bytes copied by ``np.copyto``) are not counted."""
    seen: list[int] = []
    real = module.stream_copy

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(module, name)

        def stream_copy(self, dst: np.ndarray, src: np.ndarray) -> bool:
            done = bool(real(dst, src))
            if done:
                seen.append(np.asarray(dst).nbytes)
            return done

    monkeypatch.setattr(native, "native_module", lambda: Counting())
    return seen
