"""The stale-KV oracle: an independent count of reused KV that was wrong for its request.

Every strategy that reuses KV tells the oracle, per reused token, the provenance the KV
was computed from (which source at which version, which token id, and for exact reuse
the whole provenance before it). The oracle compares that against the request's own
:meth:`~kvlife.upstream.builder.BuiltPrompt.provenance`, computed from the prompt and
nothing else, so a cache keyed wrongly (a source without its version, a position
ignored) is caught here, not trusted.

Two rules, one per kind of reuse:

- **exact prefix reuse** of tokens ``[0, n)``: the KV is valid only if it was computed
  for exactly the same provenance ``[0, n)`` (attention read every earlier token);
- **segment reuse** of one segment's tokens: the KV must come from the same source at
  the same version with the same token ids (its cross-attention is approximated by
  design, which the quality figures measure; a stale version is never approximated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlife.core.sources import Source

Provenance = Sequence[tuple[Source, int]]


@dataclass(slots=True)
class StaleOracle:
    """Counts reused tokens and the stale ones among them."""

    reused_tokens: int = 0
    stale_tokens: int = 0
    events: list[str] = field(default_factory=list)
    """One line per stale reuse found (what and where)."""

    def prefix_reused(self, request: Provenance, computed_for: Provenance, tokens: int) -> None:
        """``tokens`` leading tokens of ``request`` were served KV computed for a prompt
        whose provenance was ``computed_for``."""
        if tokens <= 0:
            return
        self.reused_tokens += tokens
        if len(computed_for) < tokens or len(request) < tokens:
            self.stale_tokens += tokens
            self.events.append(f"prefix of {tokens} reused from a prompt of {len(computed_for)}")
            return
        for i in range(tokens):
            if request[i] != computed_for[i]:
                self.stale_tokens += tokens - i
                want, got = request[i], computed_for[i]
                self.events.append(
                    f"prefix reuse of {tokens} tokens: token {i} is {want[0]}:{want[1]}, "
                    f"the KV was computed for {got[0]}:{got[1]}"
                )
                return

    def segment_reused(self, request: Provenance, start: int, computed_for: Provenance) -> None:
        """The tokens ``[start, start + len(computed_for))`` of ``request`` were served a
        segment's KV computed for ``computed_for`` (at whatever position)."""
        n = len(computed_for)
        self.reused_tokens += n
        got = list(request[start : start + n])
        if got != list(computed_for):
            bad = sum(1 for a, b in zip(got, computed_for, strict=False) if a != b)
            bad += n - len(got)
            self.stale_tokens += bad
            self.events.append(f"segment reuse at {start}: {bad} of {n} tokens stale")
