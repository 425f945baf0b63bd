"""The invalidation rules a host holds, filed by a criterion each one needs, so that a
record is checked against the rules that could cover it, not against every rule newer
than it (issue 28: rules are never dropped, and a record of an old epoch was checked
against every one after it: 20-30 ms a 128-chunk remote lookup with 1,000 rules of
other tenants, 200-300 ms with 10,000).

A rule covers an object only if every criterion it gives matches, so a rule filed under
one of its criteria (its prefix, else its namespace, weights, adapter, model or source,
the most selective first) can only cover objects that name that value; a rule with none
of these (``everything``) is filed under every object. :meth:`RuleIndex.covering` looks
in the buckets of the values the object names, at the rules newer than the object, and
matches each with :meth:`InvalidationRule.matches`, as a scan of every rule would.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from kvlife.core.objects import ObjectInfo
from kvlife.globalindex.rules import InvalidationRule

_EVERY = ("*", "")
"""The bucket of rules with no criterion to file them under (``everything``)."""


@dataclass(slots=True)
class _Bucket:
    """Rules of one filing value, in epoch order."""

    epochs: list[int] = field(default_factory=list)
    rules: list[InvalidationRule] = field(default_factory=list)

    def add(self, rule: InvalidationRule) -> None:
        at = bisect_right(self.epochs, rule.epoch)  # rules mostly come in order: an append
        self.epochs.insert(at, rule.epoch)
        self.rules.insert(at, rule)

    def remove(self, rule: InvalidationRule) -> None:
        at = bisect_right(self.epochs, rule.epoch) - 1
        while at >= 0 and self.epochs[at] == rule.epoch:
            if self.rules[at] is rule:
                del self.epochs[at], self.rules[at]
                return
            at -= 1

    def newer(self, epoch: int) -> list[InvalidationRule]:
        return self.rules[bisect_right(self.epochs, epoch) :]


def _filed_under(rule: InvalidationRule) -> tuple[str, str] | bytes:
    """The value a rule is filed under: its prefix (a chunk key), else the first
    criterion it gives of namespace, weights, adapter, model and source."""
    if rule.everything:
        return _EVERY
    if rule.prefix is not None:
        return bytes(rule.prefix)
    for kind, value in (
        ("ns", rule.namespace),
        ("wd", rule.weights_digest),
        ("ad", rule.adapter_id),
        ("model", rule.model),
        ("src", rule.source),
    ):
        if value is not None:
            return (kind, value)
    return _EVERY  # a rule always gives one of the above (its own checks); never filed away


class RuleIndex:
    """Rules by epoch, and filed by criterion for :meth:`covering`. Not thread-safe:
    its owner (:class:`~kvlife.globalindex.index.GlobalIndex`) holds its lock."""

    def __init__(self) -> None:
        self._by_epoch: dict[int, InvalidationRule] = {}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._prefixes: dict[bytes, _Bucket] = {}
        self.top = 0
        """The newest epoch held (0: none)."""

    def __len__(self) -> int:
        return len(self._by_epoch)

    def __contains__(self, epoch: int) -> bool:
        return epoch in self._by_epoch

    def __getitem__(self, epoch: int) -> InvalidationRule:
        return self._by_epoch[epoch]

    def clear(self) -> None:
        self._by_epoch.clear()
        self._buckets.clear()
        self._prefixes.clear()
        self.top = 0

    def add(self, rule: InvalidationRule) -> None:
        """Hold ``rule`` (in place of one held for its epoch)."""
        old = self._by_epoch.get(rule.epoch)
        if old is not None:
            self._bucket(old).remove(old)
        self._by_epoch[rule.epoch] = rule
        self._bucket(rule).add(rule)
        self.top = max(self.top, rule.epoch)

    def _bucket(self, rule: InvalidationRule) -> _Bucket:
        at = _filed_under(rule)
        if isinstance(at, bytes):
            return self._prefixes.setdefault(at, _Bucket())
        return self._buckets.setdefault(at, _Bucket())

    def covering(
        self, epoch: int, key: bytes, info: ObjectInfo, lineage: tuple[bytes, ...]
    ) -> InvalidationRule | None:
        """A rule newer than ``epoch`` that covers the object ``key`` of ``info``
        (``lineage``: the keys before it in the run looked up), or None."""
        epoch = max(0, epoch)
        if epoch >= self.top:
            return None
        for bucket in self._candidates(key, info, lineage):
            for rule in bucket.newer(epoch):
                if rule.matches(key, info, lineage):
                    return rule
        return None

    def _candidates(
        self, key: bytes, info: ObjectInfo, lineage: tuple[bytes, ...]
    ) -> list[_Bucket]:
        """The buckets of the values the object names (each once)."""
        get = self._buckets.get
        kinds = [
            _EVERY,
            ("ns", info.namespace),
            ("wd", info.weights_digest),
            ("ad", info.adapter_id),
            ("model", info.model_id),
            *{("src", s.name) for s in info.sources},
        ]
        out = [b for b in map(get, kinds) if b is not None]
        prefixes = self._prefixes
        if prefixes:
            parent = bytes(info.parent)
            if len(prefixes) <= len(lineage) + 2:  # each prefix looked for in the run
                out += [b for p, b in prefixes.items() if p in (key, parent) or p in lineage]
            else:  # each key of the run looked up among the prefixes
                named = map(prefixes.get, (key, parent, *lineage))
                out += {id(b): b for b in named if b is not None}.values()
        return out
