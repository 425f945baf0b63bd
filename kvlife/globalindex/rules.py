"""Global invalidation rules: by namespace, adapter, weights digest, key prefix,
upstream source (name and version range) and model (with one weights version kept),
criteria intersecting, each recorded in the index under a fresh epoch of the index's
incarnation, and validated when written. A rule no host can read (written by another
writer, damaged) is an ``everything`` rule: it covers every object older than it.

The stored body is five fields for the criteria of format v1; a rule with a source or
a model appends a sixth (a map of them), which a host of format v1 cannot read and so
applies as an ``everything`` rule: more misses, never a stale hit."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import Namespace
from kvlife.core.objects import EpochStamp, ObjectInfo
from kvlife.core.sources import MAX_VERSION, Source

_EXTENSION = {"source", "versions", "model", "keep_weights"}
"""Keys of a rule's sixth field this host reads."""


@dataclass(frozen=True, slots=True)
class InvalidationRule:
    """One invalidation: objects created before it (their :class:`EpochStamp` is older
    than ``incarnation``:``epoch``) that match every given criterion are never served
    again by any host."""

    epoch: int
    """Index epoch the rule was recorded under (objects with a lower epoch are hit)."""
    namespace: str | None = None
    """``str(Namespace)`` of a tenant's erasure request (``organisation:acme``)."""
    adapter_id: str | None = None
    """A revoked adapter."""
    weights_digest: str | None = None
    """A retired model version."""
    prefix: bytes | None = None
    """A chunk key: that chunk and every chunk chained after it."""
    reason: str = ""
    incarnation: str = ""
    """The index incarnation the epoch counts in."""
    everything: bool = False
    """A rule that could not be read: it covers every object older than it."""
    source: str | None = None
    """An upstream source's name: objects that depend on it at a version in
    ``versions`` (and, on each host's index, every object chained after them)."""
    versions: tuple[int, int] | None = None
    """``[lo, hi)`` of the source's versions (None: every version)."""
    model: str | None = None
    """A model (``ModelIdentity.model_id``)."""
    keep_weights_digest: str | None = None
    """With ``model``: the weights version kept; every other one of the model is hit."""

    def __post_init__(self) -> None:
        if type(self.epoch) is not int or self.epoch < 1:
            raise InvalidArgument(f"rule epoch must be an int >= 1, got {self.epoch!r}")
        if self.everything:
            return
        if (
            self.namespace is None
            and self.adapter_id is None
            and self.weights_digest is None
            and self.prefix is None
            and self.source is None
            and self.model is None
        ):
            raise InvalidArgument("an invalidation rule needs at least one criterion")
        if self.source is not None:
            if not isinstance(self.source, str):
                raise InvalidArgument(f"rule source must be text, got {self.source!r:.80}")
            Source(self.source)  # a source name's own checks
        if self.versions is not None:
            v = self.versions
            if (
                not isinstance(v, tuple)
                or len(v) != 2
                or not all(type(x) is int for x in v)
                or not 0 <= v[0] < v[1] <= MAX_VERSION
                or self.source is None
            ):
                raise InvalidArgument(f"rule versions must be a [lo, hi) of a source, got {v!r}")
        if self.keep_weights_digest is not None and self.model is None:
            raise InvalidArgument("a rule keeping one weights version needs a model")
        if self.namespace is not None:
            if not isinstance(self.namespace, str):
                raise InvalidArgument(f"rule namespace must be text, got {self.namespace!r:.80}")
            try:
                ok = str(Namespace.parse(self.namespace)) == self.namespace
            except InvalidArgument:
                ok = False
            if not ok:
                raise InvalidArgument(
                    f"rule namespace {self.namespace!r:.80} is not a namespace "
                    "(kind:name, e.g. organisation:acme, or public)"
                )
        for name in (
            "adapter_id",
            "weights_digest",
            "reason",
            "incarnation",
            "model",
            "keep_weights_digest",
        ):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise InvalidArgument(f"rule {name} must be text, got {type(v).__name__}")
        if self.prefix is not None and (
            not isinstance(self.prefix, bytes) or len(self.prefix) != 32
        ):
            raise InvalidArgument(f"prefix must be a 32-byte chunk key, got {self.prefix!r:.80}")

    def covers_born(self, born: EpochStamp) -> bool:
        """Whether an object created under ``born`` may predate the rule."""
        return born.before(self.incarnation, self.epoch)

    def matches(self, key: bytes, info: ObjectInfo, lineage: tuple[bytes, ...] = ()) -> bool:
        """Whether the rule's criteria cover an object (``lineage``: keys of the chunks
        before it in the run being looked up, for the prefix criterion)."""
        if self.everything:
            return True
        if self.namespace is not None and info.namespace != self.namespace:
            return False
        if self.adapter_id is not None and info.adapter_id != self.adapter_id:
            return False
        if self.weights_digest is not None and info.weights_digest != self.weights_digest:
            return False
        if self.model is not None and info.model_id != self.model:
            return False
        if self.keep_weights_digest is not None and info.weights_digest == self.keep_weights_digest:
            return False
        if self.source is not None:
            lo, hi = self.versions or (0, MAX_VERSION)
            name = self.source
            if not any(s.name == name and lo <= s.version < hi for s in info.sources):
                return False
        if self.prefix is not None:
            p = self.prefix
            if key != p and bytes(info.parent) != p and p not in lineage:
                return False
        return True

    def _extension(self) -> dict[str, object]:
        ext: dict[str, object] = {}
        if self.source is not None:
            ext["source"] = self.source
            if self.versions is not None:
                lo, hi = self.versions
                # a msgpack int holds at most 2**64 - 1: the open end is written nil
                ext["versions"] = [lo, None if hi == MAX_VERSION else hi]
        if self.model is not None:
            ext["model"] = self.model
        if self.keep_weights_digest is not None:
            ext["keep_weights"] = self.keep_weights_digest
        return ext

    def body(self) -> bytes:
        """The stored form (the epoch and incarnation are the index's)."""
        fields: list[object] = [
            self.namespace,
            self.adapter_id,
            self.weights_digest,
            self.prefix,
            self.reason,
        ]
        ext = self._extension()
        if ext:
            fields.append(ext)
        return bytes(msgpack.packb(fields))

    @classmethod
    def from_body(cls, epoch: int, incarnation: str, blob: bytes | None) -> InvalidationRule:
        """A stored rule; one that cannot be read or does not validate is an
        ``everything`` rule (its reason says why)."""
        try:
            if blob is None:
                raise ValueError("no rule recorded under this epoch")
            fields = msgpack.unpackb(blob)
            if not isinstance(fields, list) or len(fields) not in (5, 6):
                raise ValueError("not a five- or six-field rule")
            ns, adapter, weights, prefix, reason = fields[:5]
            ext = fields[5] if len(fields) == 6 else {}
            if len(fields) == 6 and (not isinstance(ext, dict) or not ext or set(ext) - _EXTENSION):
                raise ValueError(f"rule extension {ext!r:.80} is not one this host reads")
            versions = ext.get("versions")
            if isinstance(versions, list) and len(versions) == 2 and versions[1] is None:
                versions = [versions[0], MAX_VERSION]
            return cls(
                epoch,
                ns,
                adapter,
                weights,
                prefix,
                reason,
                incarnation,
                source=ext.get("source"),
                versions=tuple(versions) if isinstance(versions, list) else versions,
                model=ext.get("model"),
                keep_weights_digest=ext.get("keep_weights"),
            )
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            return cls(
                epoch,
                reason=f"unreadable rule: {exc}"[:200],
                incarnation=incarnation,
                everything=True,
            )


@dataclass(frozen=True, slots=True)
class RuleSync:
    """What a host must apply to its local index after reading the index: the rules it
    has not applied yet, and whether the index is new to it."""

    incarnation: str
    """The index incarnation read."""
    epoch: int
    """Its epoch: every rule up to it is in ``rules`` or was applied before."""
    fresh: bool
    """This host has not applied this incarnation yet (first read, or the index lost
    its state): objects created under any other incarnation are covered."""
    rules: tuple[InvalidationRule, ...] = ()
    """Rules not applied yet, oldest first."""
