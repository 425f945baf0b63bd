"""Per-request plans and the chooser.

A lookup found ``h`` usable hits of a prompt of ``n`` tokens (the engine prefills at
least the last token, so ``h * tokens_per_chunk < n``). A plan names two chunk indices
``0 <= front <= stop <= h``:

- chunks ``[0, front)`` are recomputed from the start of the prompt (the front),
- chunks ``[front, stop)`` are loaded (exact, or loaded and decoded where the replica is
  a transform's frame) while the front computes, in the store's I/O threads,
- everything from ``stop * tpc`` to ``n`` is prefilled once both are done.

Its predicted time to first token is ``max(C(0, front), L(front, stop)) + J + C(stop, n)``
(``J``: joining a computed front to the loaded chunks, :meth:`CostModel.join_seconds`);
where the engine loads layer by layer in ``G`` groups (``CostModel.layer_groups``) the
join and the rest run group by group behind the load
(:func:`~kvlife.planner.cost.layered_seconds`; with no front
``max(L, J + C) + min(L, J + C) / G``):
the Cake split (Jin et al., "Compute Or Load KV Cache? Why Not Both?", ICML 2025) with a
free end: with ``front = 0`` it is load-only (``stop = h``) or a shorter load, with
``front = stop = 0`` compute-only. :func:`choose` picks the plan of least predicted time
over every ``(front, stop)``; :func:`load_only`, :func:`compute_only` and
:func:`split_only` are the fixed policies it is compared with. :func:`tokens_to_load` is
the seam for an engine that cannot compute a front while loading (vLLM's connector):
the best plan with ``front = 0``, as a token count, the engine's own cached prefix free.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvlife.core.errors import InvalidArgument
from kvlife.planner.cost import CostModel, layered_seconds
from kvlife.results import ChunkHit


class ChunkAction(enum.Enum):
    """What the engine does for one hit chunk."""

    LOAD_EXACT = "load"
    """Load the engine's own bytes."""
    LOAD_DECODE = "load+decode"
    """Load a transform's frame and decode it."""
    RECOMPUTE = "recompute"
    """Prefill it (the front, or with the rest of the prompt)."""


class PlanKind(enum.Enum):
    COMPUTE = "compute"
    """No chunk is loaded."""
    LOAD = "load"
    """A prefix of the hits is loaded, nothing computed beside it."""
    SPLIT = "split"
    """The front is computed while the chunks behind it load."""


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """The plan for one hit chunk."""

    index: int
    action: ChunkAction
    tier: str
    """Where the hit is (loads read from there)."""
    predicted_s: float
    """Predicted load (+ decode) time of the chunk; 0 for a recomputed one."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How one request's prompt is made ready: the typed result an engine executes."""

    front: int
    """Chunks ``[0, front)`` are computed while ``[front, stop)`` load: the split point."""
    stop: int
    """End of the loaded chunks; the prompt from ``stop * tokens_per_chunk`` is prefilled."""
    hits: int
    """Usable hits the plan was made for."""
    prompt_tokens: int
    tokens_per_chunk: int
    front_s: float
    """Predicted compute time of the front."""
    load_s: float
    """Predicted load time of ``[front, stop)``."""
    rest_s: float
    """Predicted prefill time from ``stop`` to the end of the prompt."""
    chunks: tuple[ChunkPlan, ...] = ()
    """One per usable hit, in order."""
    join_s: float = 0.0
    """Predicted time to join the computed front to the loaded chunks (split plans)."""
    groups: int = 1
    """Layer groups the loaded chunks land in, one after another; the prefill of the
    rest runs each group's layers as soon as that group landed (1: after the whole load)."""

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise InvalidArgument(f"plan needs groups >= 1, got {self.groups}")
        if not 0 <= self.front <= self.stop <= self.hits:
            raise InvalidArgument(
                f"plan needs 0 <= front <= stop <= hits, got {self.front}, {self.stop}, {self.hits}"
            )
        if self.hits * self.tokens_per_chunk >= self.prompt_tokens:
            raise InvalidArgument(
                f"{self.hits} hits of {self.tokens_per_chunk} tokens leave nothing to prefill "
                f"of a {self.prompt_tokens}-token prompt"
            )

    @property
    def kind(self) -> PlanKind:
        if self.front == self.stop:
            return PlanKind.COMPUTE
        return PlanKind.LOAD if self.front == 0 else PlanKind.SPLIT

    @property
    def predicted_s(self) -> float:
        """Predicted time to first token (lookup excluded): with layered loading the
        join and the rest's prefill run group by group behind the load
        (:func:`~kvlife.planner.cost.layered_seconds`)."""
        if self.groups > 1 and self.loaded:
            return layered_seconds(
                self.front_s, self.load_s, self.join_s + self.rest_s, self.groups
            )
        return max(self.front_s, self.load_s) + self.join_s + self.rest_s

    @property
    def loaded(self) -> int:
        """Chunks the plan loads."""
        return self.stop - self.front

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "front": self.front,
            "stop": self.stop,
            "hits": self.hits,
            "predicted_s": self.predicted_s,
            "front_s": self.front_s,
            "load_s": self.load_s,
            "join_s": self.join_s,
            "rest_s": self.rest_s,
            "groups": self.groups,
        }


def make_plan(
    model: CostModel, hits: Sequence[ChunkHit], prompt_tokens: int, front: int, stop: int
) -> Plan:
    """The plan ``(front, stop)`` for ``hits`` with its predicted times."""
    tpc = model.tokens_per_chunk
    h = len(hits)
    if front == stop:
        front = stop = 0  # nothing loaded: one prefill of the whole prompt
    chunks = []
    for i, hit in enumerate(hits):
        if front <= i < stop:
            action = ChunkAction.LOAD_DECODE if hit.decode_nbytes > 0 else ChunkAction.LOAD_EXACT
            chunks.append(ChunkPlan(i, action, hit.tier, model.chunk_load_seconds(hit)))
        else:
            chunks.append(ChunkPlan(i, ChunkAction.RECOMPUTE, hit.tier, 0.0))
    return Plan(
        front=front,
        stop=stop,
        hits=h,
        prompt_tokens=prompt_tokens,
        tokens_per_chunk=tpc,
        front_s=model.compute_seconds(0, front * tpc),
        load_s=model.load_seconds(hits[front:stop]),
        rest_s=model.compute_seconds(stop * tpc, prompt_tokens - stop * tpc),
        chunks=tuple(chunks),
        join_s=model.join_seconds(front * tpc, (stop - front) * tpc),
        groups=model.layer_groups,
    )


def usable_hits(hits: Sequence[ChunkHit], prompt_tokens: int, tpc: int) -> int:
    """Hits a prefill can use: at least the prompt's last token is computed."""
    return max(0, min(len(hits), (prompt_tokens - 1) // tpc))


def candidates(model: CostModel, hits: Sequence[ChunkHit], prompt_tokens: int) -> Iterator[Plan]:
    """Every plan for the usable hits: compute-only, then each ``(front, stop)`` that
    loads at least one chunk."""
    h = usable_hits(hits, prompt_tokens, model.tokens_per_chunk)
    use = list(hits[:h])
    yield make_plan(model, use, prompt_tokens, 0, 0)
    for stop in range(1, h + 1):
        for front in range(stop):
            yield make_plan(model, use, prompt_tokens, front, stop)


def _best(plans: Iterator[Plan]) -> Plan:
    best: Plan | None = None
    for p in plans:
        # ties go to the plan found first: compute-only, then fewer loaded chunks
        if best is None or p.predicted_s < best.predicted_s:
            best = p
    assert best is not None  # compute-only is always a candidate
    return best


def choose(model: CostModel, hits: Sequence[ChunkHit], prompt_tokens: int) -> Plan:
    """The plan of least predicted time to first token. Hits on a tier whose speed the
    model does not know yet are loaded (load-only): that load is how it learns, and
    loading is what a store without a planner does."""
    h = usable_hits(hits, prompt_tokens, model.tokens_per_chunk)
    if any(model.tier(hit.tier).per_byte.value is None for hit in hits[:h]):
        return load_only(model, hits, prompt_tokens)
    return _best(candidates(model, hits, prompt_tokens))


def compute_only(model: CostModel, hits: Sequence[ChunkHit], prompt_tokens: int) -> Plan:
    """Ignore the hits: prefill the whole prompt."""
    h = usable_hits(hits, prompt_tokens, model.tokens_per_chunk)
    return make_plan(model, list(hits[:h]), prompt_tokens, 0, 0)


def load_only(model: CostModel, hits: Sequence[ChunkHit], prompt_tokens: int) -> Plan:
    """Load every usable hit, then prefill the rest ("a hit is loaded")."""
    h = usable_hits(hits, prompt_tokens, model.tokens_per_chunk)
    return make_plan(model, list(hits[:h]), prompt_tokens, 0, h)


def split_only(model: CostModel, hits: Sequence[ChunkHit], prompt_tokens: int) -> Plan:
    """The Cake split: every usable hit is either computed from the front or loaded
    from the back (``stop = hits``), split where the two meet (least predicted time)."""
    h = usable_hits(hits, prompt_tokens, model.tokens_per_chunk)
    use = list(hits[:h])
    if h < 2:  # no chunk to split at: load what there is
        return make_plan(model, use, prompt_tokens, 0, h)
    return _best(make_plan(model, use, prompt_tokens, s, h) for s in range(1, h))


def tokens_to_load(
    hits: Sequence[ChunkHit], model: CostModel, prompt_tokens: int, computed_tokens: int = 0
) -> int:
    """Where an engine that can only load a prefix (no front computed beside the load)
    should stop loading, in tokens from the prompt's start: the end of the load of least
    predicted time to first token. ``computed_tokens`` the engine holds already (its own
    prefix cache) cost nothing; the answer is never below them (``computed_tokens``:
    load nothing, prefill the rest)."""
    tpc = model.tokens_per_chunk
    h = usable_hits(hits, prompt_tokens, tpc)
    first = min(computed_tokens // tpc, h)  # hits wholly in the engine's cache
    best_end = computed_tokens
    best = model.compute_seconds(computed_tokens, prompt_tokens - computed_tokens)
    for stop in range(first + 1, h + 1):
        end = stop * tpc
        if end <= computed_tokens:
            continue
        t = model.load_seconds(hits[first:stop]) + model.compute_seconds(end, prompt_tokens - end)
        if t < best:
            best, best_end = t, end
    return best_end
