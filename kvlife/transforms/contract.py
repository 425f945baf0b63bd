"""What a lookup accepts (:class:`Accept`) and what a replica's transform guarantees
(:class:`Contract`): the correctness contract enforced at every store lookup.

``Accept.EXACT`` (the default of every lookup) takes only the engine's own bytes;
``Accept.LOSSLESS`` also takes replicas that decode bit-exact; ``Accept.lossy(...)`` also
takes lossy ones within its limits (a declared :class:`ErrorBound`, a measured mean KL, a
set of transform names). A replica that does not meet the lookup's ``Accept`` is not a hit.

A measured KL depends on the chunk size (key groups and outlier channels are chosen per
chunk), so a replica's contract takes the figure for its own chunk size, read from its
frame's descriptor (:func:`contract_of_replica`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from kvlife.core.errors import InvalidArgument
from kvlife.transforms.base import (
    DESCRIPTOR_FORMAT,
    ErrorBound,
    Exactness,
    Param,
    UnknownTransform,
)
from kvlife.transforms.registry import transform_class

_RANK = {Exactness.EXACT: 0, Exactness.LOSSLESS: 1, Exactness.LOSSY: 2}


@dataclass(frozen=True, slots=True)
class Contract:
    """What a replica of one transform (name, version, parameters) guarantees."""

    name: str
    version: int
    exactness: Exactness
    bound: ErrorBound | None
    """The declared element-wise bound of a lossy transform (None otherwise)."""
    measured_kl: float | None
    """Mean KL against exact KV measured on the reference model (0 for exact and
    lossless; None: not measured), for chunks of ``chunk_tokens`` tokens."""
    chunk_tokens: int | None = None
    """Chunk size the measured KL holds for (None: not known, the worst over the chunk
    sizes measured)."""


EXACT_CONTRACT = Contract("exact", 1, Exactness.EXACT, None, 0.0)


@functools.lru_cache(maxsize=256)
def contract_for(
    name: str,
    version: int,
    params: tuple[tuple[str, Param], ...],
    chunk_tokens: int | None = None,
) -> Contract:
    """The contract of a transform as this reader knows it, for replicas of chunks of
    ``chunk_tokens`` tokens (None: unknown; the measured KL is then the worst over the
    chunk sizes measured); UnknownTransform when the name or the version is not known
    here (the store makes that a miss)."""
    if name == "exact" and not params:
        return EXACT_CONTRACT
    cls = transform_class(name)
    if not cls.reads(version):
        raise UnknownTransform(
            f"transform {name!r} version {version} is not known (this reader has {cls.version})"
        )
    t = cls.from_params(dict(params))
    exact_values = t.exactness in (Exactness.EXACT, Exactness.LOSSLESS)
    kl = 0.0 if exact_values else t.measured_kl_at(chunk_tokens, version)
    return Contract(name, version, t.exactness, t.error_bound, kl, chunk_tokens)


def chunk_tokens_of(descriptor: bytes) -> int | None:
    """Tokens of the chunk a frame's descriptor describes (axis 3 of ``(layers, 2,
    kv_heads, tokens, head_dim)``); None when the descriptor is empty, unreadable or of
    another shape. Read straight from the msgpack list: a lookup asks it of every lossy
    replica it considers, and a damaged descriptor is caught when the frame is decoded."""
    if not descriptor:
        return None
    try:
        obj = msgpack.unpackb(descriptor, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
        return None
    if not (isinstance(obj, list) and len(obj) == 8 and obj[0] == DESCRIPTOR_FORMAT):
        return None
    shape = obj[4]
    if not (isinstance(shape, list) and len(shape) == 5 and type(shape[3]) is int):
        return None
    tokens: int = shape[3]
    return tokens


def contract_of_replica(
    name: str, version: int, params: tuple[tuple[str, Param], ...], descriptor: bytes
) -> Contract:
    """:func:`contract_for` a replica whose frame descriptor is ``descriptor``: its
    measured KL is the figure for the replica's own chunk size (the store's layout)."""
    return contract_for(name, version, params, chunk_tokens_of(descriptor))


@dataclass(frozen=True, slots=True)
class Accept:
    """The weakest representation a lookup takes, and the limits on lossy ones."""

    exactness: Exactness = Exactness.EXACT
    """EXACT: the engine's own bytes only; LOSSLESS: also bit-exact decodes; LOSSY: also
    lossy replicas within the limits below."""
    max_bound: ErrorBound | None = None
    """Lossy replicas must declare a bound no looser than this, factor by factor."""
    max_kl: float | None = None
    """Lossy replicas must have a measured mean KL <= this (unmeasured ones are refused)."""
    transforms: frozenset[str] | None = None
    """Lossy replicas must be of one of these transforms (None: any)."""

    EXACT: ClassVar[Accept]
    LOSSLESS: ClassVar[Accept]

    def __post_init__(self) -> None:
        if not isinstance(self.exactness, Exactness):
            raise InvalidArgument(f"Accept.exactness must be an Exactness, got {self.exactness!r}")
        if self.exactness not in _RANK:
            raise InvalidArgument(
                f"no Accept takes {self.exactness.value!r} replicas; "
                f"accept one of {[e.value for e in _RANK]}"
            )
        limited = self.max_bound is not None or self.max_kl is not None or self.transforms
        if limited and self.exactness is not Exactness.LOSSY:
            raise InvalidArgument("Accept limits on lossy replicas need exactness LOSSY")
        if self.max_kl is not None and not self.max_kl >= 0:
            raise InvalidArgument(f"Accept.max_kl must be >= 0, got {self.max_kl}")

    @classmethod
    def lossy(
        cls,
        *,
        max_kl: float | None = None,
        max_bound: ErrorBound | None = None,
        transforms: Iterable[str] | None = None,
    ) -> Accept:
        """Exact, lossless, and lossy replicas within the given limits (none: any
        lossy replica with a declared contract)."""
        names = frozenset(transforms) if transforms is not None else None
        return cls(Exactness.LOSSY, max_bound, max_kl, names)

    def refusal(self, contract: Contract) -> str:
        """Empty when ``contract`` meets this Accept, else why not."""
        # a class this module does not rank (a later one) is taken by no Accept
        if _RANK.get(contract.exactness, len(_RANK)) > _RANK[self.exactness]:
            return f"{contract.name} is {contract.exactness.value}, the lookup accepts {self.label}"
        if contract.exactness is not Exactness.LOSSY:
            return ""
        if self.transforms is not None and contract.name not in self.transforms:
            return f"{contract.name} is not among the accepted transforms {sorted(self.transforms)}"
        if self.max_bound is not None:
            b, m = contract.bound, self.max_bound
            if b is None or (
                b.range_factor > m.range_factor
                or b.magnitude_factor > m.magnitude_factor
                or b.absolute > m.absolute
            ):
                return f"{contract.name}'s declared bound {b} is looser than {m}"
        if self.max_kl is not None:
            kl = contract.measured_kl
            if kl is None:
                return f"{contract.name} has no measured KL (the lookup bounds KL)"
            if kl > self.max_kl:
                at = (
                    f"at {contract.chunk_tokens}-token chunks"
                    if contract.chunk_tokens is not None
                    else "(worst over chunk sizes)"
                )
                return f"{contract.name}'s measured KL {kl} {at} exceeds {self.max_kl}"
        return ""

    @property
    def label(self) -> str:
        """Short description for reasons and reports."""
        if self.exactness is not Exactness.LOSSY:
            return str(self.exactness.value)
        parts = []
        if self.transforms is not None:
            parts.append("/".join(sorted(self.transforms)))
        if self.max_kl is not None:
            parts.append(f"kl<={self.max_kl:g}")
        if self.max_bound is not None:
            parts.append(f"range<={self.max_bound.range_factor:g}")
        return "lossy" + (f"({', '.join(parts)})" if parts else "")


Accept.EXACT = Accept()
Accept.LOSSLESS = Accept(Exactness.LOSSLESS)
