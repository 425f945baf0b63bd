"""KV transforms: exact, lossless and quantised representations of a KV chunk.

:mod:`kvlife.transforms.base` defines the interface and the verified descriptor;
:mod:`kvlife.transforms.registry` finds transforms by name (built-ins are imported on first
use, so importing this package does not compile numba kernels).
"""

from kvlife.transforms.base import (
    EncodedPayload,
    ErrorBound,
    Exactness,
    Transform,
    TransformDescriptor,
    TransformError,
    UnknownTransform,
)
from kvlife.transforms.contract import Accept, Contract, contract_for
from kvlife.transforms.registry import (
    decode,
    decode_frame,
    make_transform,
    register_transform,
    transform_names,
)

__all__ = [
    "Accept",
    "Contract",
    "EncodedPayload",
    "ErrorBound",
    "Exactness",
    "Transform",
    "TransformDescriptor",
    "TransformError",
    "UnknownTransform",
    "contract_for",
    "decode",
    "decode_frame",
    "make_transform",
    "register_transform",
    "transform_names",
]
