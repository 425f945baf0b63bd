"""What vLLM's scheduler-side connector tells the worker-side connectors each step, and
what the workers tell it back (pickled across processes by vLLM: plain dataclasses of
plain values).

The save protocol these carry: a step's saves are gathered during its forward and
*staged* (``prepare_put``: TENTATIVE, invisible) by every worker at the end of the step;
each worker reports the step in a :class:`StepReport` (its rank, and the requests whose
saves must not be kept: a failed load, a layer not gathered); vLLM merges the reports of
all ranks and hands them to the scheduler, which sends a :class:`SaveVerdict` with a
later step's plan: commit the staged puts, or abort them. So a save becomes visible only
when every rank finished the step and reported success for its request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlife.core.errors import InvalidArgument
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
    deadline_s: float | None = None
    """Seconds after the worker starts the step's loads by which the chunks must have
    arrived (the planner's predicted load time with slack, or ``kvlife.load_timeout_ms``);
    those that have not are abandoned and recomputed by vLLM. None: wait."""

    def check(self, block_size: int, tokens_per_chunk: int) -> None:
        """Raise :class:`InvalidArgument` naming the request when this spec cannot be
        loaded as it says: a first token not on a block boundary or past the end, an
        end not on a chunk boundary, fewer token ids or block ids than ``[0,
        end_token)`` needs. Checked where a worker receives the spec, so a bad one is a
        refused load (its blocks recomputed), never a shape error deep in the copy."""
        need = -(-self.end_token // block_size)
        if not 0 <= self.first_token <= self.end_token:
            why = f"loads tokens [{self.first_token}, {self.end_token})"
        elif self.first_token % block_size or self.end_token % tokens_per_chunk:
            why = (
                f"loads tokens [{self.first_token}, {self.end_token}), not from a "
                f"{block_size}-token block to a {tokens_per_chunk}-token chunk boundary"
            )
        elif len(self.tokens) < self.end_token:
            why = f"has {len(self.tokens)} token ids for {self.end_token} tokens"
        elif len(self.block_ids) < need:
            why = (
                f"has {self.end_token} tokens and {len(self.block_ids)} block ids; "
                f"loading them in {block_size}-token blocks needs {need}"
            )
        else:
            return
        raise InvalidArgument(f"load spec of request {self.req_id!r} {why}")


@dataclass(frozen=True, slots=True)
class LoadSample:
    """A load a worker timed, for the scheduler's cost model: ``nbytes`` of one tier in
    ``seconds`` (a load abandoned at its deadline reports the chunks it had plus the one
    it waited for, over the time it waited: an upper bound of the tier's speed)."""

    tier: str
    nbytes: int
    seconds: float


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

    def check(self, block_size: int, tokens_per_chunk: int) -> None:
        """Raise :class:`InvalidArgument` naming the request when this spec cannot be
        saved as it says: a chunk range that is empty or reversed, fewer token ids or
        block ids than ``[0, end_chunk * tokens_per_chunk)`` needs (checked where a
        worker receives the spec: a refused save, never a shape error in the stager)."""
        end = self.end_chunk * tokens_per_chunk
        need = end // block_size
        if not 0 <= self.first_chunk < self.end_chunk:
            why = f"saves chunks [{self.first_chunk}, {self.end_chunk})"
        elif len(self.tokens) < end:
            why = f"has {len(self.tokens)} token ids for {end} tokens"
        elif len(self.block_ids) < need:
            why = (
                f"has {end} tokens and {len(self.block_ids)} block ids; saving them "
                f"from {block_size}-token blocks needs {need}"
            )
        else:
            return
        raise InvalidArgument(f"save spec of request {self.req_id!r} {why}")


@dataclass(frozen=True, slots=True)
class SaveVerdict:
    """The scheduler's decision on the puts the workers staged in step ``step``."""

    step: int
    commit: bool
    """Commit the step's staged puts (False: abort every one of them)."""
    aborted: tuple[str, ...] = ()
    """Requests whose staged puts are aborted even when ``commit`` (some rank failed
    them)."""

    def keeps(self, req_id: str) -> bool:
        return self.commit and req_id not in self.aborted


@dataclass(slots=True)
class StepPlan:
    """One step's loads and saves, and the verdicts on earlier steps' saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step: int = 0
    """The scheduler's sequence number of this step (from 1)."""
    verdicts: list[SaveVerdict] = field(default_factory=list)


@dataclass(slots=True)
class StepReport:
    """Workers' reports on steps that had saves, merged over ranks."""

    ranks: dict[int, set[int]] = field(default_factory=dict)
    """Per step: the global ranks that finished it and reported."""
    failed: dict[int, set[str]] = field(default_factory=dict)
    """Per step: requests whose saves some rank failed (a load that did not complete,
    so KV after it was computed on garbage; a layer not gathered)."""
    loads: list[LoadSample] = field(default_factory=list)
    """Loads the workers timed (every step's, saves or not)."""

    def add(self, step: int, rank: int, failed: set[str]) -> None:
        self.ranks.setdefault(step, set()).add(rank)
        self.failed.setdefault(step, set()).update(failed)

    def merge(self, other: StepReport) -> StepReport:
        """This report and ``other``'s, combined (neither is changed)."""
        out = StepReport(
            {s: set(r) for s, r in self.ranks.items()},
            {s: set(f) for s, f in self.failed.items()},
        )
        for step, ranks in other.ranks.items():
            out.ranks.setdefault(step, set()).update(ranks)
        for step, failed in other.failed.items():
            out.failed.setdefault(step, set()).update(failed)
        out.loads = [*self.loads, *other.loads]
        return out

    def __bool__(self) -> bool:
        return bool(self.ranks) or bool(self.loads)
