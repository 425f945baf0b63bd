"""Robust running estimates for the planner's cost model.

A load timed on a shared machine is sometimes many times slower than the device (a
scheduler hiccup, another process's burst), and a device's speed can change for good (a
throttle set, a queue that builds up). :class:`RobustEstimate` follows the second and
ignores the first: each sample is clamped to within ``guard`` times the (low) median of
the last ``window`` raw samples (before there are three: of the estimate) before it
enters an exponentially weighted average. One outlier moves the estimate by at most
``alpha * (guard - 1)`` of it; a lasting change shifts the median within half a window,
and the estimate follows.
"""

from __future__ import annotations

import statistics
from collections import deque

from kvlife.core.errors import InvalidArgument


class RobustEstimate:
    """An EWMA of positive samples, each clamped to ``[median / guard, median * guard]``
    of the recent raw samples (the median guard)."""

    def __init__(
        self,
        initial: float | None = None,
        *,
        alpha: float = 0.3,
        window: int = 9,
        guard: float = 3.0,
    ) -> None:
        if not 0 < alpha <= 1:
            raise InvalidArgument(f"alpha must be in (0, 1], got {alpha}")
        if window < 1:
            raise InvalidArgument(f"window must be >= 1, got {window}")
        if not guard >= 1:
            raise InvalidArgument(f"guard must be >= 1, got {guard}")
        if initial is not None and not initial >= 0:
            raise InvalidArgument(f"initial estimate must be >= 0, got {initial}")
        self.alpha = alpha
        self.guard = guard
        self._recent: deque[float] = deque(maxlen=window)
        self._value = initial
        self.samples = 0
        """Samples observed (seeds excluded)."""

    @property
    def value(self) -> float | None:
        """The estimate (None before any seed or sample)."""
        return self._value

    def seed(self, value: float) -> None:
        """Set the estimate from a calibration (the sample window starts over)."""
        if not value >= 0:
            raise InvalidArgument(f"seed must be >= 0, got {value}")
        self._value = float(value)
        self._recent.clear()

    def observe(self, sample: float) -> float:
        """Take one sample (>= 0); returns the new estimate."""
        if not sample >= 0:
            raise InvalidArgument(f"sample must be >= 0, got {sample}")
        x = float(sample)
        self._recent.append(x)
        self.samples += 1
        # the guard's reference: the median of recent samples, or, before there are
        # enough of them, the estimate itself (a seed or the first sample)
        ref = statistics.median_low(self._recent) if len(self._recent) >= 3 else self._value
        if ref is not None:
            x = min(max(x, ref / self.guard), ref * self.guard)
        if self._value is None:
            self._value = x
        else:
            self._value += self.alpha * (x - self._value)
        return self._value
