"""Request traces as flat arrays, parsed once and replayed many times.

A :class:`Trace` holds ``n`` requests in arrival order. Prompt blocks are one flat
``int64`` array with CSR offsets (request ``i``'s blocks are
``blocks[offsets[i]:offsets[i + 1]]``), so a replay loop walks plain integers instead of
per-request Python objects. Block ids are *prefix-chained*: two blocks with the same id
hold the same tokens after the same prefix, so the same id anywhere means reusable KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import InvalidArgument

I64 = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order, with prefix-chained block ids and labels."""

    name: str
    """Where the trace came from (file name or synthetic generator and seed)."""
    block_tokens: int
    """Tokens per block (512 for Mooncake, 16 for bailian)."""
    timestamps: NDArray[np.float64]
    """Arrival of each request, seconds from the trace start, non-decreasing."""
    input_tokens: I64
    """Prompt length of each request (tokens)."""
    output_tokens: I64
    """Generated tokens of each request."""
    offsets: I64
    """CSR offsets into :attr:`blocks`, length ``n + 1``."""
    blocks: I64
    """Prefix-chained block ids of every prompt, concatenated."""
    tenants: NDArray[np.int32]
    """Tenant of each request, an index into :attr:`tenant_names`."""
    tenant_names: tuple[str, ...] = ("default",)
    """Tenant labels."""
    categories: NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    """Workload category of each request (index into :attr:`category_names`); empty: 0."""
    category_names: tuple[str, ...] = ("default",)
    """Category labels (chat, rag, agent, reasoning, ...)."""
    reuse_info: bool = True
    """False when the source has no prefix information (Azure): every block is unique."""

    def __post_init__(self) -> None:
        n = self.timestamps.shape[0]
        if self.block_tokens < 1:
            raise InvalidArgument(f"block_tokens must be >= 1, got {self.block_tokens}")
        for name in ("input_tokens", "output_tokens", "tenants"):
            if getattr(self, name).shape[0] != n:
                raise InvalidArgument(f"trace {self.name}: {name} has the wrong length")
        if self.offsets.shape[0] != n + 1 or int(self.offsets[-1]) != self.blocks.shape[0]:
            raise InvalidArgument(f"trace {self.name}: offsets do not match blocks")
        if self.categories.shape[0] == 0:
            object.__setattr__(self, "categories", np.zeros(n, np.int32))
        elif self.categories.shape[0] != n:
            raise InvalidArgument(f"trace {self.name}: categories has the wrong length")
        if n > 1 and bool(np.any(np.diff(self.timestamps) < 0)):
            raise InvalidArgument(f"trace {self.name}: timestamps are not in arrival order")

    @property
    def n_requests(self) -> int:
        return int(self.timestamps.shape[0])

    @property
    def n_touches(self) -> int:
        """Block touches: the number of prompt blocks over all requests."""
        return int(self.blocks.shape[0])

    def n_unique_blocks(self) -> int:
        return int(np.unique(self.blocks).shape[0])

    def request_blocks(self, i: int) -> I64:
        return self.blocks[self.offsets[i] : self.offsets[i + 1]]

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        n = min(n, self.n_requests)
        end = int(self.offsets[n])
        return Trace(
            name=f"{self.name}[:{n}]",
            block_tokens=self.block_tokens,
            timestamps=self.timestamps[:n],
            input_tokens=self.input_tokens[:n],
            output_tokens=self.output_tokens[:n],
            offsets=self.offsets[: n + 1],
            blocks=self.blocks[:end],
            tenants=self.tenants[:n],
            tenant_names=self.tenant_names,
            categories=self.categories[:n],
            category_names=self.category_names,
            reuse_info=self.reuse_info,
        )


class TraceBuilder:
    """Accumulates requests and builds a :class:`Trace` (used by importers and generators)."""

    def __init__(self, name: str, block_tokens: int) -> None:
        self.name = name
        self.block_tokens = block_tokens
        self._t: list[float] = []
        self._inp: list[int] = []
        self._out: list[int] = []
        self._off: list[int] = [0]
        self._blocks: list[int] = []
        self._ten: list[int] = []
        self._cat: list[int] = []
        self._tenant_ix: dict[str, int] = {}
        self._cat_ix: dict[str, int] = {}

    def add(
        self,
        t: float,
        input_tokens: int,
        output_tokens: int,
        blocks: list[int],
        tenant: str = "default",
        category: str = "default",
    ) -> None:
        self._t.append(t)
        self._inp.append(input_tokens)
        self._out.append(output_tokens)
        self._blocks.extend(blocks)
        self._off.append(len(self._blocks))
        self._ten.append(self._tenant_ix.setdefault(tenant, len(self._tenant_ix)))
        self._cat.append(self._cat_ix.setdefault(category, len(self._cat_ix)))

    def __len__(self) -> int:
        return len(self._t)

    def build(self, *, sort: bool = False, reuse_info: bool = True) -> Trace:
        """The trace; with ``sort``, requests are stably sorted by arrival time."""
        t = np.asarray(self._t, dtype=np.float64)
        inp = np.asarray(self._inp, dtype=np.int64)
        out = np.asarray(self._out, dtype=np.int64)
        off = np.asarray(self._off, dtype=np.int64)
        blocks = np.asarray(self._blocks, dtype=np.int64)
        ten = np.asarray(self._ten, dtype=np.int32)
        cat = np.asarray(self._cat, dtype=np.int32)
        if sort and t.size > 1:
            order = np.argsort(t, kind="stable")
            lens = np.diff(off)[order]
            parts = [blocks[off[i] : off[i + 1]] for i in order]
            blocks = np.concatenate(parts) if parts else blocks
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            t, inp, out, ten, cat = t[order], inp[order], out[order], ten[order], cat[order]
        return Trace(
            name=self.name,
            block_tokens=self.block_tokens,
            timestamps=t,
            input_tokens=inp,
            output_tokens=out,
            offsets=off,
            blocks=blocks,
            tenants=ten,
            tenant_names=tuple(self._tenant_ix) or ("default",),
            categories=cat,
            category_names=tuple(self._cat_ix) or ("default",),
            reuse_info=reuse_info,
        )
