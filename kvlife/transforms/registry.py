"""Transforms by name, with built-ins imported on first use and duplicates refused.

The reader side lives here too: :func:`decode` resolves a payload's descriptor to the
transform that wrote it, so a name or version this reader lacks is an
:class:`~kvlife.transforms.base.UnknownTransform` (a miss) rather than a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument
from kvlife.transforms.base import (
    EncodedPayload,
    Param,
    Transform,
    TransformError,
    UnknownTransform,
)

_REGISTRY: dict[str, type[Transform]] = {}

BUILTIN_TRANSFORMS = {
    "exact": "kvlife.transforms.exact",
    "lossless": "kvlife.transforms.lossless",
    "int8": "kvlife.transforms.quant",
    "int4": "kvlife.transforms.quant",
    "int2": "kvlife.transforms.quant",
    "sparse": "kvlife.transforms.sparse",
}
"""Built-in transform names and the module that registers each."""


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Register a transform class under its ``name`` (a duplicate name is an error)."""
    if cls.name in _REGISTRY:
        raise InvalidArgument(f"transform {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    for module in sorted(set(BUILTIN_TRANSFORMS.values())):
        importlib.import_module(module)


def transform_names() -> list[str]:
    """Registered transform names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def transform_class(name: str) -> type[Transform]:
    """The class registered as ``name`` (UnknownTransform if none)."""
    _load_builtins()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise UnknownTransform(f"unknown transform {name!r}; known: {sorted(_REGISTRY)}")
    return cls


def make_transform(name: str, params: Mapping[str, Param] | None = None) -> Transform:
    """A transform instance by name; ``params`` override its defaults."""
    try:
        return transform_class(name).from_params(params or {})
    except TransformError as exc:
        if isinstance(exc, UnknownTransform):
            raise
        raise InvalidArgument(str(exc)) from exc


def decode(encoded: EncodedPayload, out: NDArray[np.generic]) -> Transform:
    """Decode with the transform the descriptor names; returns that transform."""
    d = encoded.descriptor
    cls = transform_class(d.name)
    if not cls.reads(d.version):
        raise UnknownTransform(
            f"transform {d.name!r} version {d.version} is not known (have {cls.version})"
        )
    transform = cls.from_params(d.param_map)
    transform.decode(encoded, out)
    return transform


def decode_frame(frame: bytes | memoryview, out: NDArray[np.generic]) -> Transform:
    """Decode a frame from :meth:`EncodedPayload.to_frame` into ``out``."""
    return decode(EncodedPayload.from_frame(frame), out)
