"""``wild``: the workload-aware eviction of the production study, over KV classes.

Wang et al., "KVCache Cache in the Wild: Characterizing and Optimizing KVCache Cache at a
Large Cloud Provider" (USENIX ATC'25) found that, within one request category, the reuse
of KV blocks over time follows an exponential distribution, and evicted the block with
the least probability of being reused within its category's lifespan given how long it
has gone unused, tail blocks of a prompt before head blocks. They report up to 23.9%
more hits than their baselines on Alibaba Bailian's traces. Reimplemented here from the
paper's description (their code is not public), on the categories a KV store sees:
the structural classes of :mod:`kvlife.policy.reuse` (the trace has no request type),
with the same per-class LRU queues, prefix-tree rules and age clock as
:mod:`kvlife.policy.kvhd` (age: blocks inserted since the last touch). Only the model
differs: kvhd learns a non-parametric hit density per age bucket (LHD); this policy fits
each class's reuse as the paper does:

- ``p``: the class's reuse probability (blocks hit before their eviction, over blocks
  that left the class by a hit or an eviction);
- ``lam``: the exponential rate of its reuse times, 1 / the mean age at a hit;
- ``life``: its lifespan, :data:`LIFE_MEANS` mean reuse times (past it a reuse is rare).

A block of that class unused for ``t`` is reused within the lifespan with probability
``p (e^{-lam t} - e^{-lam life}) / (1 - p + p e^{-lam t})`` (0 past the lifespan); the
victim is the unprotected leaf with the least, the older first on a tie. The paper's
second key (the block's offset, tail first) is what the prefix tree already enforces:
only leaves (tails) are candidates. The fits are refreshed every
:data:`kvhd.RECOMPUTE_EVERY` evictions from counts decayed as kvhd's histograms (a put's
touch of a block its own lookup just touched is no reuse); until the first refresh, the
oldest goes first (LRU).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Sequence
from typing import TypeVar

from kvlife.policy.base import register_policy
from kvlife.policy.kvhd import DECAY, HitDensityPolicy
from kvlife.policy.reuse import N_CLASSES

K = TypeVar("K", bound=Hashable)

LIFE_MEANS = 3.0
"""A class's lifespan in its mean reuse times (95% of an exponential's reuses fall within
it). The hit ratio depends on it: docs/replay.md gives 1.5 to 4 and none"""


class WorkloadAwarePolicy(HitDensityPolicy[K]):
    """Least probability of reuse within the class's lifespan (module docstring)."""

    name = "wild"

    def __init__(self) -> None:
        super().__init__()
        self._p = [0.0] * N_CLASSES
        self._lam = [0.0] * N_CLASSES
        self._life = [0.0] * N_CLASSES
        self._n_hits = [0.0] * N_CLASSES
        """Per class: blocks touched again (at an age above 0), decayed."""
        self._n_ends = [0.0] * N_CLASSES
        """Per class: blocks evicted untouched, decayed."""
        self._sum_age = [0.0] * N_CLASSES
        """Per class: the sum of those touches' ages, decayed."""
        self._before = -1
        """In a put: the clock before its inserts."""

    def _rank(self, cls: int, age: int) -> float:
        return self.reuse_probability(cls, age)

    def reuse_probability(self, cls: int, age: int) -> float:
        """The fitted probability that a block of class ``cls`` unused for ``age`` blocks
        is touched again within the class's lifespan."""
        p, lam, life = self._p[cls], self._lam[cls], self._life[cls]
        if p <= 0.0 or age >= life:
            return 0.0
        # the docstring's formula times e^{lam t}: no 0/0 when p is 1 and e^{-lam t}
        # underflows
        within = 1.0 - math.exp(-lam * (life - age)) if life < math.inf else 1.0
        return p * within / ((1.0 - p) * math.exp(min(lam * age, 700.0)) + p)

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        self._before = self._clock  # kvhd counts the put's inserts before its touches
        try:
            super().record_in_order(keys, new)
        finally:
            self._before = -1

    def _hit(self, key: K) -> None:
        cls = self._kc[key]
        age = (self._before if self._before >= 0 else self._clock) - self._cq[cls][key]
        if age > 0:  # 0: a put touching what its own lookup just touched, not a reuse
            self._n_hits[cls] += 1.0
            self._sum_age[cls] += age
        super()._hit(key)

    def _drop(self, key: K) -> None:
        cls = self._kc[key]
        self._n_ends[cls] += 1.0
        super()._drop(key)

    def _recompute(self) -> None:
        """The fits from the counts since the last (decayed as kvhd's histograms)."""
        for cls in range(N_CLASSES):
            n_hits, n_all = self._n_hits[cls], self._n_hits[cls] + self._n_ends[cls]
            if n_hits <= 0.0:
                self._p[cls] = self._lam[cls] = self._life[cls] = 0.0
            else:
                mean_age = max(self._sum_age[cls] / n_hits, 1.0)
                self._p[cls] = n_hits / n_all
                self._lam[cls] = 1.0 / mean_age
                self._life[cls] = LIFE_MEANS * mean_age
            self._n_hits[cls] *= DECAY
            self._n_ends[cls] *= DECAY
            self._sum_age[cls] *= DECAY
        super()._recompute()

    def fits(self) -> dict[int, tuple[float, float, float]]:
        """Per class: the fitted reuse probability, rate (per block inserted) and
        lifespan (blocks inserted), for reports."""
        return {c: (self._p[c], self._lam[c], self._life[c]) for c in range(N_CLASSES)}


register_policy("wild", WorkloadAwarePolicy)
