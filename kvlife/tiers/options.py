"""Typed options of a tier kind: the base class, its error and the map from name/value pairs.

Each kind of tier has one frozen dataclass of options (:mod:`kvlife.tiers.kinds`), every
field with a docstring and a type; :class:`TierOptions` checks each value against its
field's type and then the kind's invariants (:meth:`TierOptions.check`) as the object is
made, so a spec that names a tier can only hold options that tier can be built with.
:func:`options_from_pairs` maps the ``(("name", value), ...)`` form of a
:class:`~kvlife.tiers.spec.TierSpec` onto the class, naming an unknown option, a missing
one or one of the wrong type. Every such error is a :class:`TierOptionError` that names
the kind, the tier (where known) and the option.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar

from kvlife.core.errors import InvalidArgument


class TierOptionError(InvalidArgument):
    """A tier option that is unknown, missing, of the wrong type or out of range."""

    def __init__(self, kind: str, field: str, problem: str, tier: str = "") -> None:
        self.kind = kind
        """The tier kind (``disk``, ``redis``, ...)."""
        self.field = field
        """The option."""
        self.problem = problem
        self.tier = tier
        """The tier's name in its chain (empty where the options were made on their own)."""
        where = f"{kind} tier {tier!r}" if tier else f"{kind} tier"
        super().__init__(f"{where}: option {field}: {problem}")

    def for_tier(self, tier: str) -> TierOptionError:
        """The same error, naming the tier."""
        return TierOptionError(self.kind, self.field, self.problem, tier)

    def __reduce__(self) -> tuple[type[TierOptionError], tuple[str, str, str, str]]:
        return (TierOptionError, (self.kind, self.field, self.problem, self.tier))


@dataclass(frozen=True, slots=True, kw_only=True)
class TierOptions:
    """Options of one kind of tier. Subclasses are frozen keyword-only dataclasses whose
    fields are ``int``, ``float``, ``bool``, ``str``, a ``Literal`` of strings, or one of
    those or ``None``; they state their invariants in :meth:`check`."""

    kind: ClassVar[str] = ""
    """The tier kind these options belong to (for error messages)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            ok, coerced = conforms(value, hints[f.name])
            if not ok:
                raise TierOptionError(
                    self.kind, f.name, f"must be {describe(hints[f.name])}, got {value!r}"
                )
            if coerced is not value:  # an int given for a float field
                object.__setattr__(self, f.name, coerced)
        self.check()

    def check(self) -> None:
        """The kind's invariants; raise :meth:`bad` naming the field."""

    def bad(self, field: str, problem: str) -> TierOptionError:
        """The error to raise for ``field``."""
        return TierOptionError(self.kind, field, problem)


Opts = TypeVar("Opts", bound=TierOptions)


def options_from_pairs(cls: type[Opts], tier: str, pairs: Sequence[tuple[str, object]]) -> Opts:
    """``cls`` made from ``pairs`` of option name and value, for the tier called ``tier``:
    every name must be a field of ``cls``, given once; every field without a default must
    be given."""
    names = {f.name for f in fields(cls)}
    given: dict[str, object] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TierOptionError(cls.kind, "?", f"options are (name, value) pairs, got {pair!r}")
        name, value = pair
        if name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise TierOptionError(cls.kind, name, f"unknown option (known: {known})", tier)
        if name in given:
            raise TierOptionError(cls.kind, name, "given twice", tier)
        given[name] = value
    for f in fields(cls):
        if f.name not in given and f.default is MISSING and f.default_factory is MISSING:
            raise TierOptionError(cls.kind, f.name, "required", tier)
    try:
        return cls(**given)
    except TierOptionError as exc:
        raise exc.for_tier(tier) from None


def conforms(value: object, hint: Any) -> tuple[bool, object]:
    """Whether ``value`` has type ``hint``, and the value to keep (a float for an int)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(hint):
            ok, coerced = conforms(value, member)
            if ok:
                return True, coerced
        return False, value
    if origin is Literal:
        return value in typing.get_args(hint) and isinstance(value, str), value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False, value
        return True, float(value)
    if hint is str:
        return isinstance(value, str), value
    raise TypeError(f"tier options cannot hold a field of type {hint!r}")


def describe(hint: Any, *, optional: bool = True) -> str:
    """``hint`` in words for an error message (``optional=False``: leave out a union's
    None, for readers where an absent key is the None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if optional or m is not type(None)]
        return " or ".join(describe(m) for m in members)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return {bool: "a bool", int: "an int", float: "a number", str: "a string"}.get(hint, repr(hint))
