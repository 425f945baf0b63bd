"""What vLLM's scheduler-side connector tells the worker-side connectors each step
(pickled across processes by vLLM: plain dataclasses of plain values)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlife.core.identity import Namespace
from kvlife.engines.identity import AdapterSpec


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[first_token, end_token)`` of a request from kvlife into its blocks."""

    req_id: str
    tokens: list[int]
    """Token ids ``[0, end_token)`` (the keys chain from the first chunk)."""
    block_ids: list[int]
    """The request's vLLM blocks covering ``[0, end_token)``."""
    first_token: int
    """Block-aligned: tokens before it are already in the paged cache (vLLM's own prefix
    cache); only blocks from here on are written."""
    end_token: int
    """Chunk-aligned end of the kvlife hit."""
    namespace: Namespace
    adapter: AdapterSpec | None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save chunks ``[first_chunk, end_chunk)`` of a request, complete after this step."""

    req_id: str
    tokens: list[int]
    """Token ids ``[0, end_chunk * tokens_per_chunk)``."""
    block_ids: list[int]
    """The request's vLLM blocks covering those tokens."""
    first_chunk: int
    end_chunk: int
    namespace: Namespace
    adapter: AdapterSpec | None


@dataclass(slots=True)
class StepPlan:
    """One step's loads and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
