"""The exact transform: the payload is the array's bytes (the identity, for uniformity)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import LayoutMismatch
from kvlife.transforms.base import Exactness, Param, Transform, TransformDescriptor, TransformError
from kvlife.transforms.registry import register_transform


@register_transform
class ExactTransform(Transform):
    """Stores the raw bytes; decode is one copy."""

    name = "exact"
    version = 1
    exactness = Exactness.EXACT

    def params(self) -> Mapping[str, Param]:
        return {}

    @classmethod
    def from_params(cls, params: Mapping[str, Param]) -> Self:
        if params:
            raise TransformError(f"exact takes no parameters, got {sorted(params)}")
        return cls()

    def check_input(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> None:
        if dtype.hasobject:
            raise LayoutMismatch("exact cannot store object arrays")

    def payload_nbytes(self, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> int:
        return int(np.prod(shape)) * dtype.itemsize

    def _encode(self, array: NDArray[np.generic]) -> NDArray[np.uint8]:
        return array.reshape(-1).view(np.uint8).copy()

    def _decode(
        self, payload: NDArray[np.uint8], desc: TransformDescriptor, out: NDArray[np.generic]
    ) -> None:
        if payload.size != out.nbytes:
            raise TransformError(
                f"exact payload has {payload.size} bytes for a {out.nbytes}-byte buffer"
            )
        np.copyto(out.reshape(-1).view(np.uint8), payload)
