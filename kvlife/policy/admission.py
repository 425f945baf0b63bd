"""Admission filters for the KV-aware policies: which new blocks are admitted warm.

A store must place every block it is asked to store (the engine's put has no "bypass"),
so "not admitted" means *admitted cold*: the block goes to the eviction end of its
policy and is the next victim unless it is touched first. A filter sees each new block
with its structural class (:mod:`kvlife.policy.reuse`) and learns from what the policy
reports (hits, inserts, evictions).

- :class:`PredictorAdmission`: admit when the online reuse predictor says the block's
  class will be reused (position and conversation structure).
- :class:`Doorkeeper`: TinyLFU's doorkeeper: admit a block only if it was seen before
  (an exact bounded set of recent inserts, cleared when it outgrows a multiple of the
  resident count), so first sightings go cold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable

from kvlife.policy.reuse import ReusePredictor


class Admission(ABC):
    """Decides whether a new block is admitted warm."""

    name: str

    @abstractmethod
    def admit(self, key: Hashable, cls: int) -> bool:
        """Admit the new block ``key`` of structural class ``cls`` warm?"""

    def on_insert(self, key: Hashable) -> None:
        """A block was inserted (after :meth:`admit` decided)."""

    def on_hit(self, cls: int) -> None:
        """A block of class ``cls`` was touched for the first time since its insert."""

    def on_evict(self, key: Hashable, cls: int, resident: int) -> None:
        """A block left without a touch since its insert."""


class PredictorAdmission(Admission):
    """Admit the classes the reuse predictor expects to be reused."""

    name = "predictor"

    def __init__(self, predictor: ReusePredictor) -> None:
        self.predictor = predictor

    def admit(self, key: Hashable, cls: int) -> bool:
        return self.predictor.predict(cls)

    def on_insert(self, key: Hashable) -> None:
        self.predictor.on_insert(key)

    def on_hit(self, cls: int) -> None:
        self.predictor.on_hit(cls)

    def on_evict(self, key: Hashable, cls: int, resident: int) -> None:
        self.predictor.on_evict(key, cls, resident)


class Doorkeeper(Admission):
    """Admit a block only on its second sighting within the doorkeeper's memory."""

    name = "doorkeeper"

    def __init__(self, factor: float = 4.0) -> None:
        self.factor = factor
        self._seen: set[Hashable] = set()
        self._resident = 0

    def admit(self, key: Hashable, cls: int) -> bool:
        return key in self._seen

    def on_insert(self, key: Hashable) -> None:
        seen = self._seen
        seen.add(key)
        if len(seen) > max(64, self.factor * self._resident):
            seen.clear()  # the doorkeeper's reset: its memory is a window of inserts

    def on_evict(self, key: Hashable, cls: int, resident: int) -> None:
        self._resident = resident
