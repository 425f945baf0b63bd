"""The planner's cost model: what a load, a decode and a prefill will take.

- :class:`TierCost`: a tier's load time, ``latency + bytes * seconds_per_byte``; the time
  per byte is a :class:`~kvlife.planner.estimate.RobustEstimate` seeded from a short
  calibration (:meth:`TierCost.calibrate`) and learnt from every load an engine observes
  (:meth:`CostModel.observe_load`).
- decode: a hit's own ``decode_seconds`` (the store's measured decode speed of its
  transform); where that is 0 for a framed replica, a per-transform time per byte learnt
  from observed decodes.
- :class:`PrefillProfile`: the engine's prefill time for ``length`` tokens after
  ``start`` cached ones, ``c0 + c1 * length + c2 * length * (start + length / 2)
  + c3 * start``: a fixed cost, the per-token work (projections, MLP), attention, whose
  cost per new token grows with its position, and a cost per cached token per call
  (short prefills after a long prefix take longer than attention accounts for on
  transformers' ``DynamicCache``, which concatenates the cached KV on every append).
  Fitted by non-negative least squares from a few timed prefills of the engine itself
  (:meth:`PrefillProfile.fit`), kept as JSON so a restart reads it instead of measuring
  again; refitted to the latest prefills the engine timed
  (:meth:`CostModel.observe_prefill`), so it follows the engine's speed of the day.
- the join of a computed front to loaded chunks (a split): a learnt time per position
  (:meth:`CostModel.join_seconds`, :meth:`CostModel.observe_join`).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.planner.estimate import RobustEstimate
from kvlife.results import ChunkHit


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One timed prefill."""

    start: int
    """Tokens already in the cache."""
    length: int
    """Tokens prefilled."""
    seconds: float


def _features(start: int, length: int) -> tuple[float, float, float, float]:
    return (1.0, float(length), float(length) * (start + length / 2.0), float(start))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0`` for a few columns: the best least-squares
    solution over every subset of free columns that comes out non-negative (exact, and
    numpy only: the vLLM interpreter, where the connector fits too, has no scipy)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(b @ b)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(n)
        full[cols] = x
        r = a @ full - b
        res = float(r @ r)
        if res < best_res:
            best, best_res = full, res
    return best


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    """Prefill seconds of an engine as ``c0 + c1*L + c2*L*(start + L/2) + c3*start``."""

    c0: float
    """Fixed seconds per prefill call."""
    c1: float
    """Seconds per token (position-independent work)."""
    c2: float
    """Seconds per token per position attended (attention)."""
    engine: str = ""
    """What was measured (model, threads), to tell a cached profile from another's."""
    samples: tuple[PrefillSample, ...] = ()
    """The measurements the profile was fitted to."""
    c3: float = 0.0
    """Seconds per cached token per call (measured: a 16-token prefill after 2,048
    cached tokens took 3.2x one after 256 on the HF engine; its ``DynamicCache``
    concatenates the cached KV on every append). 0 where the engine's cache is paged
    (vLLM) or the profile was fitted without the term."""
    cached_term: bool = False
    """Whether fits (and refits) of this engine's profile include ``c3``."""

    def __post_init__(self) -> None:
        for name in ("c0", "c1", "c2", "c3"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"prefill profile {name} must be >= 0")

    def seconds(self, start: int, length: int) -> float:
        """Predicted time to prefill ``length`` tokens after ``start`` cached ones."""
        if length <= 0:
            return 0.0
        f = _features(start, length)
        return self.c0 * f[0] + self.c1 * f[1] + self.c2 * f[2] + self.c3 * f[3]

    @classmethod
    def fit(
        cls, samples: Sequence[PrefillSample], engine: str = "", *, cached_term: bool = False
    ) -> PrefillProfile:
        """Non-negative least squares on relative error (each sample weighted by
        1/seconds, so short prefills count as much as long ones); ``c3`` only with
        ``cached_term`` (and samples at two or more starts to tell it from the rest)."""
        if len(samples) < 3:
            raise InvalidArgument(f"a prefill profile needs >= 3 samples, got {len(samples)}")
        use_c3 = cached_term and len({s.start for s in samples}) >= 2
        a = np.array([_features(s.start, s.length)[: 4 if use_c3 else 3] for s in samples])
        b = np.array([s.seconds for s in samples])
        if not (b > 0).all():
            raise InvalidArgument("prefill samples must have positive times")
        w = 1.0 / b
        coef = _nnls(a * w[:, None], b * w)
        return cls(
            float(coef[0]),
            float(coef[1]),
            float(coef[2]),
            engine,
            tuple(samples),
            c3=float(coef[3]) if use_c3 else 0.0,
            cached_term=cached_term,
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> PrefillProfile:
        try:
            raw = json.loads(path.read_text())
            samples = tuple(PrefillSample(**s) for s in raw.pop("samples"))
            return cls(**raw, samples=samples)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise InvalidArgument(f"{path} is not a prefill profile: {exc}") from exc


@dataclass(slots=True)
class TierCost:
    """A tier's load time: ``latency_s + nbytes * seconds_per_byte`` (learnt)."""

    name: str
    latency_s: float = 0.0
    """Fixed seconds per load (the first byte)."""
    per_byte: RobustEstimate = field(default_factory=RobustEstimate)
    """Seconds per byte."""

    def seconds(self, nbytes: int) -> float:
        """Predicted time to load ``nbytes`` (unknown speed: infinite, never chosen)."""
        spb = self.per_byte.value
        if spb is None:
            return float("inf")
        return self.latency_s + nbytes * spb

    def calibrate(self, small: tuple[int, float], large: tuple[int, float]) -> None:
        """Seed from two timed loads (bytes, seconds) of different sizes: the slope is the
        time per byte, the intercept the latency."""
        (b1, t1), (b2, t2) = small, large
        if b2 <= b1 or t1 < 0 or t2 < 0:
            raise InvalidArgument(
                f"calibration needs two loads of growing size, got {small}, {large}"
            )
        spb = max((t2 - t1) / (b2 - b1), t2 / b2 / 4)
        self.per_byte.seed(spb)
        self.latency_s = max(0.0, t2 - b2 * spb)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` that took ``seconds`` end to end."""
        if nbytes <= 0 or seconds < 0:
            return
        self.per_byte.observe(max(seconds - self.latency_s, 0.0) / nbytes)


def layered_seconds(front_s: float, load_s: float, rest_s: float, groups: int) -> float:
    """Time until the prefill after a load ends when it runs layer by layer: the load's
    ``groups`` layer groups land one after another (group ``g`` at ``(g + 1) * load_s /
    groups``), the prefill starts once the front is computed (``front_s``) and runs a
    group's layers (``rest_s / groups``) once that group landed and the group before it
    was computed. With no front it is ``max(load, rest) + min(load, rest) / groups``: a
    two-stage pipeline; with one group ``max(front, load) + rest``."""
    if groups < 1:
        raise InvalidArgument(f"layer groups must be >= 1, got {groups}")
    done = front_s
    for g in range(groups):
        done = max(done, load_s * (g + 1) / groups) + rest_s / groups
    return done


@dataclass(slots=True)
class CostModel:
    """What loads, decodes and prefills cost on this engine and these tiers."""

    prefill: PrefillProfile
    """The engine's prefill profile in use: the start-up one, refitted as prefills are
    observed."""
    tokens_per_chunk: int
    tiers: dict[str, TierCost] = field(default_factory=dict)
    decode_per_byte: dict[str, RobustEstimate] = field(default_factory=dict)
    """Seconds per decoded byte, by transform (for hits that carry no estimate)."""
    observed: deque[PrefillSample] = field(default_factory=lambda: deque(maxlen=32))
    """The latest prefills the engine timed; the profile is refitted to these (with the
    start-up samples while there are fewer than eight), so it follows the engine's speed
    of the day (another process on the cores) and the cost of the calls it makes."""
    join_per_token: RobustEstimate = field(default_factory=RobustEstimate)
    """Seconds per position to join a computed front to loaded chunks (learnt)."""
    layer_groups: int = 1
    """Layer groups the engine's chunks are stored as and loaded by, layer by layer
    (:mod:`kvlife.engines.hf_layers`): with more than one, the prefill after the load
    starts when the first group landed (:func:`layered_seconds`)."""
    startup: tuple[PrefillSample, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.startup = self.prefill.samples
        if not isinstance(self.layer_groups, int) or self.layer_groups < 1:
            raise InvalidArgument(f"layer_groups must be an int >= 1, got {self.layer_groups!r}")

    def tier(self, name: str) -> TierCost:
        got = self.tiers.get(name)
        if got is None:
            got = self.tiers[name] = TierCost(name)
        return got

    def decode_seconds(self, hit: ChunkHit) -> float:
        """The decode time of a hit's replica (0 for the engine's own bytes)."""
        if hit.decode_nbytes <= 0:
            return 0.0
        if hit.decode_seconds > 0:
            return hit.decode_seconds
        est = self.decode_per_byte.get(hit.transform)
        v = est.value if est is not None else None
        return hit.decode_nbytes * v if v is not None else 0.0

    def chunk_load_seconds(self, hit: ChunkHit) -> float:
        """Transfer plus decode time of one hit, the tier's latency excluded."""
        cost = self.tier(hit.tier)
        spb = cost.per_byte.value
        if spb is None:
            return float("inf")
        return hit.stored_nbytes * spb + self.decode_seconds(hit)

    def load_seconds(self, hits: Sequence[ChunkHit]) -> float:
        """Predicted time to load ``hits`` in one load (each tier's latency once; tiers
        are read one after another, a conservative bound)."""
        if not hits:
            return 0.0
        lat = sum(self.tier(t).latency_s for t in {h.tier for h in hits})
        return lat + sum(self.chunk_load_seconds(h) for h in hits)

    def compute_seconds(self, start_token: int, tokens: int) -> float:
        return self.prefill.seconds(start_token, tokens)

    def join_seconds(self, front_tokens: int, loaded_tokens: int) -> float:
        """Joining a computed front of ``front_tokens`` to ``loaded_tokens`` loaded
        positions: one copy of both into a new contiguous cache, at the learnt time per
        token (0 until a join was observed; nothing to join when either is empty: loaded
        chunks alone are injected as views). Not the profile's ``c3``: fitted online to
        noisy prefills it swung from 0 to 0.7 ms a token in one run, where joins took
        0.02-0.03 ms a token of CPU (docs/planner.md)."""
        if not front_tokens or not loaded_tokens:
            return 0.0
        return (self.join_per_token.value or 0.0) * (front_tokens + loaded_tokens)

    def observe_join(self, tokens: int, seconds: float) -> None:
        """A join of ``tokens`` positions that took ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self.join_per_token.observe(seconds / tokens)

    def observe_prefill(self, start_token: int, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` after ``start_token`` that took ``seconds``: the
        profile is refitted (relative least squares, so one slow call moves it by its
        share of the window only)."""
        if tokens <= 0 or not seconds > 0:
            return
        self.observed.append(PrefillSample(start_token, tokens, seconds))
        # the start-up samples seed the fit until the engine timed enough of its own
        samples = [*self.observed] if len(self.observed) >= 8 else [*self.startup, *self.observed]
        if len(samples) >= 3:
            self.prefill = PrefillProfile.fit(
                samples, self.prefill.engine, cached_term=self.prefill.cached_term
            )

    def observe_load(self, hits: Sequence[ChunkHit], seconds: float) -> None:
        """Learn from a load of ``hits`` (of one tier) that took ``seconds``; the
        decode time the hits predicted is taken off first."""
        tiers = {h.tier for h in hits}
        if len(tiers) != 1:
            return  # a load across tiers does not say which was slow
        nbytes = sum(h.stored_nbytes for h in hits)
        decode = sum(self.decode_seconds(h) for h in hits)
        self.tier(next(iter(tiers))).observe(nbytes, max(seconds - decode, 0.0))

    def observe_decode(self, transform: str, nbytes: int, seconds: float) -> None:
        est = self.decode_per_byte.setdefault(transform, RobustEstimate())
        if nbytes > 0 and seconds >= 0:
            est.observe(seconds / nbytes)
