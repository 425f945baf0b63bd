"""Eviction policy interface, kept free of I/O so the live store and the simulator share it.

A policy only orders keys. The store tells it what was inserted, touched and removed,
and asks :meth:`EvictionPolicy.evict` for victims. ``evict`` is atomic: it either
returns exactly ``n`` victims (and forgets them) or returns None and changes nothing.
Placement takes victims one at a time, :meth:`EvictionPolicy.evict_up_to` ``n`` of them
in one call (the same choices as ``n`` calls of ``evict(1)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Container, Hashable, Iterable, Sequence
from itertools import islice
from typing import Generic, TypeVar

from kvlife.core.errors import InvalidArgument

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Orders resident keys for eviction."""

    name: str

    @abstractmethod
    def insert(self, key: K) -> None:
        """A key became resident (inserting a resident key counts as a touch)."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """A resident key was used."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """A key left for another reason (deleted, invalidated); unknown keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        """Choose and forget ``n`` victims not in ``protected``; None (no change) if impossible."""

    def evict_up_to(self, n: int, protected: Collection[K] = ()) -> list[K]:
        """Up to ``n`` victims, exactly as ``n`` calls of ``evict(1, protected)`` would
        choose and forget them, stopping at the first that finds none (so the result is
        shorter than ``n`` only when no unprotected key is left). Placement takes its
        victims this way; a policy may override it with a faster equivalent."""
        if n < 0:
            raise InvalidArgument(f"cannot evict a negative number of keys ({n})")
        victims: list[K] = []
        evict = self.evict
        for _ in range(n):
            got = evict(1, protected)
            if not got:
                break
            victims.append(got[0])
        return victims

    def touch_all(self, keys: Iterable[K]) -> None:
        """``touch`` each of ``keys``, in order. Placement touches a lookup's hits this
        way; a policy may override it with a faster equivalent."""
        touch = self.touch
        for key in keys:
            touch(key)

    def record_in_order(self, keys: Sequence[K], new: Collection[K]) -> None:
        """A put's chunks in prompt order: ``insert`` each key in ``new`` (those of ``keys``
        that are not residents, each in ``keys``), ``touch`` each other (each a resident
        already). A policy may override it with a faster equivalent (same state after the
        call as the calls one by one), or, as a :class:`LearnsFromPrompts` policy, learn
        from the prompt as a whole."""
        insert, touch = self.insert, self.touch
        for key in keys:
            if key in new:
                insert(key)
            else:
                touch(key)

    def record_tail(self, keys: Sequence[K], head: int) -> None:
        """``record_in_order(keys, new)`` for the usual put, whose new keys are its tail:
        ``keys[:head]`` are residents and ``keys[head:]`` the new keys, none resident,
        all distinct (placement knows this from the lookup, so the policy need not
        check it). A policy may override it with a faster equivalent."""
        self.record_in_order(keys, dict.fromkeys(islice(keys, head, None)))

    @property
    def members(self) -> Container[object]:
        """The resident keys as a container: ``key in policy.members`` is ``key in
        policy``. A policy that keeps its residents in one dict returns that dict (the
        same object for the policy's life), so placement and the simulator test
        membership with a C call, and need no map of their own beside it."""
        return self

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class SupportsClassHints(ABC, Generic[K]):
    """Capability: the policy accepts an object class (a small integer) with an insert.

    The class is a hint from whoever knows the workload (the replay engine passes the
    request category and the block's position bucket); a plain :meth:`EvictionPolicy.insert`
    means class 0.
    """

    @abstractmethod
    def insert_classed(self, key: K, cls: int) -> None:
        """Like :meth:`EvictionPolicy.insert`, with the object's class."""


class LearnsFromPrompts:
    """Marker: the policy's :meth:`EvictionPolicy.record_in_order` uses the put as a whole
    (the prompt's order gives the prefix tree, the new keys the turn's structure), so it
    is *not* the calls one by one; its bare ``insert``/``touch`` still work without it
    (:mod:`kvlife.policy.prefixtree`, :mod:`kvlife.policy.kvhd`)."""


_REGISTRY: dict[str, Callable[[], EvictionPolicy[object]]] = {}


def register_policy(name: str, factory: Callable[[], EvictionPolicy[object]]) -> None:
    """Register a policy factory by name (a duplicate name is an error)."""
    if name in _REGISTRY:
        raise InvalidArgument(f"eviction policy {name!r} is already registered")
    _REGISTRY[name] = factory


def make_policy(name: str) -> EvictionPolicy[object]:
    """A new policy instance by registered name."""
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; known: {sorted(_REGISTRY)}")
    return factory()


def policy_names() -> list[str]:
    """Registered policy names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


BUILTIN_POLICIES = ("lru", "lfu", "s3fifo", "arc", "lifespan")
"""Built-in policies (one module each in :mod:`kvlife.policy`), imported on first use."""

KV_POLICY_MODULES = ("prefixtree", "kvhd", "wild")
"""Modules of the KV-aware policies (:class:`LearnsFromPrompts`; several names each)."""


def _load_builtins() -> None:
    import importlib

    for name in BUILTIN_POLICIES + KV_POLICY_MODULES:
        importlib.import_module(f"kvlife.policy.{name}")
