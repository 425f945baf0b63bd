"""Invalidation, local and global, through one function.

A :class:`Scope` selects objects by model version, adapter, namespace, key prefix,
upstream source (the chunks that depend on it at some versions, and every chunk chained
after them) or model (with every weights version but one kept), criteria intersecting,
or every object; a global rule's scope covers only objects whose
KV was created before the rule (their :class:`~kvlife.core.objects.EpochStamp` is older
than the rule's epoch), and the reset of an index that lost its state covers every
object created under another incarnation. :func:`apply_scopes` takes every object of
the local index a scope covers out of service at once, under the index lock:
TENTATIVE objects of puts in flight included, so such a put's ``commit_put`` stores
nothing of them. Until :func:`invalidate` returns, its scope stays registered with
the store (``StoreCore.invalidating``) and the new chunks of a put prepared meanwhile
are taken out of service as they are made (:func:`covered_at_birth`): the rule is
applied before the invalidation waits for its turn to delete, and a put prepared in
that wait would otherwise return before it did and be stored. An invalidation
therefore applies to every put prepared before it returned, whether that put commits
before or after; a put prepared after it is not covered.

:func:`invalidate` (``KVStore.invalidate``) invalidates locally on a store without a
shared tier; on a store with one it records a global rule first (every host applies
it at its next lookup, :mod:`kvlife.store.shared`) and applies that rule here. Either
way the replicas are deleted in the plan order of the sequencer and the call returns
once the deletes are durable, so an invalidation survives a crash the moment it
returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlife.core.errors import IndexUnreachable, InvalidArgument, RemoteTierError, StorePathError
from kvlife.core.identity import ROOT_PARENT, ChunkKey, Namespace
from kvlife.core.lifecycle import Move, ObjectState
from kvlife.core.objects import ObjectInfo, ObjectRecord, PromptRef, TierName
from kvlife.core.sources import MAX_VERSION, Source
from kvlife.globalindex.rules import InvalidationRule
from kvlife.store.api import Criteria
from kvlife.store.core import StoreCore
from kvlife.store.deletes import delete_or_keep
from kvlife.tiers.base import SharedTier

LIVE = (ObjectState.INDEXED, ObjectState.COMMITTED, ObjectState.TENTATIVE)
"""States an invalidation takes out of service (TENTATIVE: a put in flight)."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Which objects of the local index one invalidation covers."""

    weights_digest: str | None = None
    adapter_id: str | None = None
    namespace: str | None = None
    """``str(Namespace)``."""
    prefix: ChunkKey | None = None
    """That chunk and every chunk chained after it, present or not in between."""
    everything: bool = False
    """Every object (a rule no host could read; an index reset)."""
    before: tuple[str, int] | None = None
    """A global rule's (incarnation, epoch): only objects created before it."""
    outside: str | None = None
    """An index reset: only objects created under another incarnation than this."""
    reason: str = ""
    source: str | None = None
    """An upstream source's name: the objects that depend on it at a version in
    ``versions``, and every object chained after one of them."""
    versions: tuple[int, int] = (0, MAX_VERSION)
    """``[lo, hi)``: the versions of ``source`` covered."""
    model: str | None = None
    """``ModelIdentity.model_id``."""
    keep_weights: str | None = None
    """With ``model``: the weights version that stays (every other one is covered)."""

    @classmethod
    def of_rule(cls, rule: InvalidationRule) -> Scope:
        return cls(
            weights_digest=rule.weights_digest,
            adapter_id=rule.adapter_id,
            namespace=rule.namespace,
            prefix=ChunkKey(rule.prefix) if rule.prefix is not None else None,
            everything=rule.everything,
            before=(rule.incarnation, rule.epoch),
            reason=f"rule {rule.epoch}" + (f" ({rule.reason})" if rule.reason else ""),
            source=rule.source,
            versions=rule.versions or (0, MAX_VERSION),
            model=rule.model,
            keep_weights=rule.keep_weights_digest,
        )

    def criteria(self) -> list[str]:
        names = [
            name
            for name, v in (
                ("weights", self.weights_digest),
                ("adapter", self.adapter_id),
                ("namespace", self.namespace),
                ("prefix", self.prefix),
                ("source", self.source),
                ("model", self.model),
                ("other-weights", self.keep_weights),
            )
            if v is not None
        ]
        return names or ["everything"]

    def covers_born(self, rec: ObjectRecord) -> bool:
        if self.outside is not None:
            return rec.born.incarnation != self.outside
        if self.before is not None:
            return rec.born.before(*self.before)
        return True

    def depends(self, info: ObjectInfo) -> bool:
        """Whether an object of ``info`` depends on this scope's source itself."""
        name = self.source
        lo, hi = self.versions
        return any(s.name == name and lo <= s.version < hi for s in info.sources)


def covers(core: StoreCore, scope: Scope, rec: ObjectRecord) -> bool:
    """Whether ``scope`` covers ``rec`` (under the lock; ``rec`` is in the index): its
    criteria, by the record's own fields and, for a prefix or a source, its chain of
    parents as the index knows it (a prefix: through absent chunks, the index keeps
    their edges while a chunk chained after them is indexed; a source: by the records
    on the chain, an absent one's sources are not known here)."""
    info = rec.info
    if scope.weights_digest is not None and info.weights_digest != scope.weights_digest:
        return False
    if scope.adapter_id is not None and info.adapter_id != scope.adapter_id:
        return False
    if scope.namespace is not None and info.namespace != scope.namespace:
        return False
    if scope.model is not None and info.model_id != scope.model:
        return False
    if scope.keep_weights is not None and info.weights_digest == scope.keep_weights:
        return False
    if scope.source is not None and not _chain_depends(core, scope, rec):
        return False
    if scope.prefix is None:
        return True
    root = bytes(scope.prefix)
    key: bytes | None = bytes(rec.key)
    seen: set[bytes] = set()
    while key is not None and key != root and key not in seen:
        seen.add(key)
        got = core.index.get(ChunkKey(key))
        key = bytes(got.info.parent) if got is not None else core.index.kept_edge(ChunkKey(key))
        if key == ROOT_PARENT:
            key = None
    return key == root


def _chain_depends(core: StoreCore, scope: Scope, rec: ObjectRecord) -> bool:
    """``rec`` or an object chained before it depends on the scope's source."""
    got: ObjectRecord | None = rec
    seen: set[bytes] = set()
    while got is not None and got.key not in seen:
        if scope.depends(got.info):
            return True
        seen.add(got.key)
        parent = got.info.parent
        if bytes(parent) == ROOT_PARENT:
            return False
        got = core.index.get(parent)
    return False


def record_sources(core: StoreCore, prompt: PromptRef, chunks: int) -> list[tuple[Source, ...]]:
    """The sources each of a prompt's first ``chunks`` chunks keeps in its record (under
    the lock): those it depends on by the prompt's spans and those the chunk before the
    prompt (``parent``) keeps, as this host's index knows it. A continuation put with
    ``parent=`` and no spans depends on its parent's sources: its published record
    names them, so another host's probe of the shared tier, which sees one record at a
    time, refuses it by a rule on them; a host that does not know the parent expects
    a record without them and misses (never adopts KV chained after invalidated KV)."""
    deps = prompt.chunk_sources(chunks)
    if bytes(prompt.parent) == ROOT_PARENT:
        return deps
    parent = core.index.get(prompt.parent)
    if parent is None or not parent.info.sources:
        return deps
    inherited = set(parent.info.sources)
    return [tuple(sorted(inherited.union(d))) for d in deps]


def covered_at_birth(core: StoreCore, recs: list[ObjectRecord]) -> None:
    """New TENTATIVE objects of a put prepared while an invalidation is under way (under
    the lock, once they are in the index): those its scope covers are taken out of
    service at once, so the put stores nothing of them (counted as aborted)."""
    for rec in recs:
        for scope in core.invalidating:
            if covers(core, scope, rec):
                core.counters.aborted += 1
                why = "invalidated:" + "+".join(scope.criteria()) + " (under way at prepare)"
                core.retire(rec, Move.INVALIDATE, why)
                break


def raced_a_rule(core: StoreCore, recs: list[ObjectRecord]) -> None:
    """New TENTATIVE objects of a put whose creation stamp was read before a lookup read
    (and may have applied) new global rules: a rule applied before they existed never
    saw them, yet may cover their KV (created before it). The window is a lookup's sync
    between the stamp and the index lock; they are taken out of service, counted as
    aborted, and the KV is put again later."""
    for rec in recs:
        if rec.state is ObjectState.TENTATIVE:
            core.counters.aborted += 1
            core.retire(rec, Move.INVALIDATE, "invalidated: global rules read while prepared")


def orphaned(core: StoreCore, parent: ChunkKey, recs: list[ObjectRecord]) -> int:
    """New TENTATIVE objects of a put that continues an earlier put of the same KV (a
    served ``put_prompt`` in pieces, :mod:`kvlife.client.puts`) after the chunk
    ``parent`` (under the lock): if that chunk is no longer live, something (an
    invalidation, most likely) took it out of service after its piece was stored, and
    this piece's KV, computed before, is taken out of service too (counted as aborted):
    an invalidation covers the whole put a caller prepared before it returned, not only
    its first pieces. A chunk evicted from every tier counts as gone too (a miss, never
    stale KV). Returns how many were taken out."""
    rec = core.index.get(parent)
    if rec is not None and rec.state in LIVE:
        return 0
    count = 0
    for r in recs:
        if r.state is ObjectState.TENTATIVE:
            core.counters.aborted += 1
            core.retire(r, Move.INVALIDATE, "invalidated: the piece it continues is gone")
            count += 1
    return count


def select(core: StoreCore, scope: Scope) -> list[ObjectRecord]:
    """The live objects ``scope`` covers (under the lock)."""
    index = core.index
    sets: list[set[ChunkKey]] = []
    if scope.weights_digest is not None:
        sets.append(index.by_weights(scope.weights_digest))
    if scope.adapter_id is not None:
        sets.append(index.by_adapter(scope.adapter_id))
    if scope.namespace is not None:
        sets.append(index.by_namespace(scope.namespace))
    if scope.prefix is not None:
        sets.append(set(index.subtree([scope.prefix])))
    if scope.model is not None:
        models = index.by_model(scope.model)
        if scope.keep_weights is not None:
            models -= index.by_weights(scope.keep_weights)
        sets.append(models)
    if scope.source is not None:
        roots: list[ChunkKey] = []
        for key in index.by_source(scope.source):
            rec = index.get(key)
            if rec is not None and scope.depends(rec.info):
                roots.append(key)
        sets.append(set(index.subtree(roots)))
    if scope.everything or not sets:
        keys: set[ChunkKey] = {r.key for r in index}
        sets.append(keys)
    out: list[ObjectRecord] = []
    for key in set.intersection(*sets):
        rec = index.get(key)
        if rec is not None and rec.state in LIVE and scope.covers_born(rec):
            out.append(rec)
    return out


def apply_scopes(
    core: StoreCore, scopes: list[Scope]
) -> tuple[int, list[tuple[TierName, ChunkKey]]]:
    """Take every live object the scopes cover out of service (under the lock; puts in
    flight included). Returns how many, and the replicas to delete physically."""
    doomed: list[tuple[TierName, ChunkKey]] = []
    count = 0
    for scope in scopes:
        why = "invalidated:" + "+".join(scope.criteria())
        if scope.reason:
            why += f" ({scope.reason})"
        for rec in select(core, scope):
            if rec.state is ObjectState.TENTATIVE:
                core.counters.aborted += 1  # its put stores nothing of it
            for tier, rep in rec.replicas.items():
                if rep.counted or rep.readable:
                    core.counters.tier(tier).invalidated_bytes += rep.nbytes
            doomed += core.retire(rec, Move.INVALIDATE, why)
            count += 1
    core.counters.invalidated += count
    return count, doomed


def invalidate(core: StoreCore, criteria: Criteria) -> int:
    """``KVStore.invalidate`` (:class:`~kvlife.store.api.Criteria` checked here, each
    wrong one an InvalidArgument naming it): see the module docstring."""
    core.check_open()
    c = criteria
    if all(
        v is None
        for v in (c.weights_digest, c.adapter_id, c.namespace, c.prefix, c.source, c.model)
    ):
        raise InvalidArgument("invalidate needs at least one criterion")
    _check(c.weights_digest, str, "weights_digest")
    _check(c.adapter_id, str, "adapter_id")
    _check(c.namespace, Namespace, "namespace")
    _check(c.model, str, "model")
    _check(c.keep_weights_digest, str, "keep_weights_digest")
    _check(c.source, str, "source")
    if c.keep_weights_digest is not None and c.model is None:
        raise InvalidArgument("keep_weights_digest needs a model (whose other versions go)")
    prefix = c.prefix
    if prefix is not None and (not isinstance(prefix, bytes) or len(prefix) != 32):
        raise InvalidArgument(f"prefix must be a 32-byte chunk key, got {prefix!r:.80}")
    versions = c.versions if c.versions is not None else (0, MAX_VERSION)
    lo, hi = versions
    if c.source is not None and not 0 <= lo < hi <= MAX_VERSION:
        raise InvalidArgument(f"source versions [{lo}, {hi}) is not a range in [0, 2**64]")
    ns = str(c.namespace) if c.namespace is not None else None
    key = ChunkKey(prefix) if prefix is not None else None
    scope = Scope(
        c.weights_digest,
        c.adapter_id,
        ns,
        key,
        source=c.source,
        versions=versions,
        model=c.model,
        keep_weights=c.keep_weights_digest,
    )
    shared = _shared(core)
    failed: RemoteTierError | None = None
    if shared is not None:
        try:
            rule = shared.record_invalidation(
                namespace=ns,
                adapter_id=c.adapter_id,
                weights_digest=c.weights_digest,
                prefix=key,
                source=c.source,
                versions=versions if c.source is not None else None,
                model=c.model,
                keep_weights_digest=c.keep_weights_digest,
            )
            scope = Scope.of_rule(rule)
        except RemoteTierError as exc:  # applied here all the same, then raised
            failed = exc
    with core.lock:
        core.check_open()  # before anything is retired: a closed store gives no ticket
        count, doomed = apply_scopes(core, [scope])
        ticket = core.seq.take()
        # until this returns, puts prepared meanwhile are covered as they are made
        core.invalidating.append(scope)
    try:
        with core.seq.turn(ticket):
            left = delete_or_keep(core, doomed)
    finally:
        with core.lock:
            core.invalidating.remove(scope)
    if left is not None:
        raise StorePathError(
            f"invalidation applied in this process ({count} objects), but deleting their "
            f"replicas failed: {left}. The close retries; until then the next open of "
            f"{core.path} would find them again"
            + ("" if failed is None else f"; the global index could not record it: {failed}")
        ) from left
    if failed is not None:
        raise IndexUnreachable(
            f"invalidation applied on this host only ({count} objects): the global "
            f"index could not record it for the other hosts: {failed}"
        ) from failed
    return count


def _shared(core: StoreCore) -> SharedTier | None:
    for tier in core.chain:
        if isinstance(tier, SharedTier):
            return tier
    return None


def _check(value: object, kind: type, name: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise InvalidArgument(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
