"""StoreAPI: the public API of a store, the one both stores have and engines type against.

``KVStore`` (the store embedded in a process) and ``RemoteStore`` (a client of the store
``kvlife serve`` serves) subclass :class:`StoreAPI` explicitly, so mypy checks each
against it, and they inherit the part of the API that is the same for both: the
signatures, the docstrings of the contract, the argument checks
(:mod:`kvlife.store.args`) and the turning of a call's arguments into a
:class:`~kvlife.core.objects.PromptRef`. Each store supplies the steps those calls hand
over to (the ``_`` members at the end: its put and load protocols) and the calls whose
work is its own. Those steps are members of the protocol too, so a third store
subclasses StoreAPI as well. One contract suite (tests/server/test_contract.py) runs
against both stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ROOT_PARENT, ChunkKey, ModelIdentity, Namespace
from kvlife.core.objects import PromptRef, TierName
from kvlife.core.sources import MAX_VERSION, Source, SourceSpan
from kvlife.results import LoadResult, LookupResult, PutResult, StoreCounters, StoreInfo
from kvlife.store import args
from kvlife.tiers.base import AuditReport
from kvlife.transforms.contract import Accept

Tokens = Sequence[int] | np.ndarray
"""Token ids: a sequence of ints or a one-dimensional integer array."""
Outs = Sequence[np.ndarray] | None
"""A load's output buffers: one per hit, or None (new read-only arrays)."""
P = TypeVar("P")
"""What a store's ``prepare_put`` returns and its ``commit_put`` takes."""


class LoadProgress(Protocol):
    """An asynchronous load: ``chunk(i)`` waits for chunk ``i`` only and returns its
    array, or None when it (or a chunk before it) is a miss; ``wait()`` returns the
    :class:`~kvlife.results.LoadResult` (or raises the load's error)."""

    def __len__(self) -> int: ...

    def chunk(self, i: int, timeout: float | None = None) -> np.ndarray | None: ...

    def completed(self) -> int: ...

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> LoadResult: ...


@dataclass(frozen=True, slots=True)
class Criteria:
    """What an ``invalidate`` selects (criteria intersect; at least one is needed)."""

    weights_digest: str | None = None
    adapter_id: str | None = None
    namespace: Namespace | None = None
    prefix: ChunkKey | None = None
    source: str | None = None
    """Name of an upstream source: chunks that depend on it at a version in
    ``versions``, and every chunk chained after them."""
    versions: tuple[int, int] | None = None
    """``[lo, hi)`` of the source's versions (with ``source`` only)."""
    model: str | None = None
    """``ModelIdentity.model_id``."""
    keep_weights_digest: str | None = None
    """With ``model``: every weights version of that model but this one."""


def source_criteria(
    source: Source | str | None, before_version: int | None
) -> tuple[str | None, tuple[int, int] | None]:
    """``invalidate``'s ``source`` and ``before_version`` as a name and a version range
    ``[lo, hi)``: a name alone is every version, with ``before_version`` the versions
    below it; a :class:`Source` is that one version (InvalidArgument with
    ``before_version``: name the source by its name to give a bound)."""
    if source is None:
        if before_version is not None:
            raise InvalidArgument("before_version needs a source")
        return None, None
    if isinstance(source, Source):
        if before_version is not None:
            raise InvalidArgument(
                f"invalidate(source={source}) names one version; pass the name "
                f"{source.name!r} with before_version to cover the versions below it"
            )
        return source.name, (source.version, source.version + 1)
    if not isinstance(source, str):
        raise InvalidArgument(f"source must be a Source or a name, got {type(source).__name__}")
    Source(source)  # the name's own checks (non-empty, no '@' or NUL, length)
    if before_version is None:
        return source, (0, MAX_VERSION)
    if isinstance(before_version, bool) or not isinstance(before_version, int):
        raise InvalidArgument(f"before_version must be an int, got {before_version!r}")
    if not 0 < before_version <= MAX_VERSION:
        raise InvalidArgument(f"before_version must be in [1, 2**64], got {before_version}")
    return source, (0, before_version)


class StoreAPI(Protocol[P]):
    """The store's public API (docs/store.md; docs/server.md for the served store)."""

    # ------------------------------------------------------------------ puts

    def put_prompt(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        sources: Sequence[SourceSpan] = (),
        prefix_tokens: Tokens | None = None,
        request_id: str = "",
    ) -> PutResult:
        """Store the full chunks of a prompt's KV (what ``prepare_put`` + ``commit_put``
        do; a served store does it in one round trip once it has extents staged).

        ``kv`` is one array (or CPU tensor) shaped ``(layers, 2, kv_heads, T, head_dim)``
        with ``chunks * tokens_per_chunk <= T <= len(tokens)``, or a sequence of chunk
        arrays shaped like ``identity.layout.chunk_shape``. A trailing partial chunk is
        never stored. Everything is validated before anything is written.

        ``sources``: which upstream source (a document, a tool output at a version) the
        prompt's tokens came from, as spans in absolute positions (those of ``start``;
        a put of a continuation passes the spans before ``start`` too). Each chunk
        depends on the sources of every span that starts before its end: its key hashes
        them (a lookup with another version misses) and its record keeps them, durably,
        for :meth:`invalidate` by source.

        Tokens that continue a prompt start at ``start`` after the chunk named either by
        its key (``parent``) or by every token before ``start`` (``prefix_tokens``, with
        ``start`` at a chunk boundary): the store derives the parent's key from those in
        the namespace it writes. A served store with principals (``kvlife serve
        --tenants``) keys namespaces with a secret, so a parent key a client computed
        itself is one no lookup follows there; a key the server returned (a put's
        ``keys``) or ``prefix_tokens`` are right on any store.
        """
        ref = args.prompt(
            identity, namespace, tokens, start, parent, extra_keys, sources, prefix_tokens
        )
        return self._put_prompt(ref, kv, request_id)

    def prepare_put(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        kv: object,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        sources: Sequence[SourceSpan] = (),
        prefix_tokens: Tokens | None = None,
        request_id: str = "",
    ) -> P:
        """Validate the KV and create TENTATIVE objects for the prompt's new chunks;
        nothing is visible until :meth:`commit_put`. Keep the arrays of ``kv`` unchanged
        until the commit or abort (the embedded store references them; a served store
        has copied them into the server's arena when this returns). ``sources`` as for
        :meth:`put_prompt`."""
        ref = args.prompt(
            identity, namespace, tokens, start, parent, extra_keys, sources, prefix_tokens
        )
        return self._prepare_put(ref, kv, request_id)

    def commit_put(self, pending: P) -> PutResult:
        """Write, make durable as the tier promises, then index the pending chunks. On a
        write error the batch is aborted and the typed error raised; nothing of it is
        visible. A pending put is finished once (InvalidArgument after)."""
        ...

    def put_async(self, pending: P) -> Future[PutResult]:
        """``commit_put`` in the background; ``.result()`` returns or raises as it would."""
        ...

    def abort_put(self, pending: P, reason: str = "aborted by caller") -> None:
        """Roll back a pending put: its TENTATIVE objects become DELETED."""
        ...

    # ------------------------------------------------------------------ reads

    def lookup(
        self,
        identity: ModelIdentity,
        namespace: Namespace,
        tokens: Tokens,
        *,
        start: int = 0,
        parent: ChunkKey = ROOT_PARENT,
        extra_keys: Sequence[bytes] = (),
        sources: Sequence[SourceSpan] = (),
        prefix_tokens: Tokens | None = None,
        accept: Accept = Accept.EXACT,
    ) -> LookupResult:
        """The longest run of INDEXED leading chunks that have a replica ``accept`` takes
        (default: exact replicas only), each with the fastest such tier, the replica's
        transform and its estimated decode cost. A chunk whose readable replicas are all
        refused (or of a transform this reader does not know) ends the run. ``sources``
        as the put declared them (:meth:`put_prompt`): the same tokens built from
        another version of a source are other chunks."""
        ref = args.prompt(
            identity, namespace, tokens, start, parent, extra_keys, sources, prefix_tokens
        )
        return self._lookup(ref, args.accept(accept))

    def load(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
    ) -> LoadResult:
        """Load the hits of ``lookup`` in order, verified, into ``outs`` (one writable
        buffer per hit, sharing no memory with another or with itself: else
        InvalidArgument, nothing read) or new read-only arrays; framed replicas (a
        transforming tier's) are verified and decoded into them. Each chunk is served
        from a replica the lookup's ``accept`` takes. The first chunk that is gone or
        fails verification ends the result; a corrupt replica is invalidated (reason
        ``corrupt``)."""
        args.outs(lookup, outs)
        return self._load(lookup, outs, request_id)

    def load_async(
        self,
        lookup: LookupResult,
        outs: Sequence[np.ndarray] | None = None,
        *,
        request_id: str = "",
        depth: int | None = None,
    ) -> LoadProgress:
        """Like :meth:`load`, returning at once; ``handle.chunk(i)`` waits for chunk i only.
        ``depth`` bounds the reads in flight of an embedded store (None: every chunk at
        once); reads start in chunk order, so with a small depth the first chunks
        complete first and a consumer works on chunk i while later ones are read. A
        served store's server streams a load with its own bound and ignores it."""
        args.outs(lookup, outs)
        args.depth(depth)
        return self._load_async(lookup, outs, request_id, depth)

    def get(
        self, identity: ModelIdentity, namespace: Namespace, tokens: Tokens, **kwargs: object
    ) -> LoadResult:
        """lookup + load in one call."""
        return self.load(self.lookup(identity, namespace, tokens, **kwargs))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ management

    def invalidate(
        self,
        *,
        weights_digest: str | None = None,
        adapter_id: str | None = None,
        namespace: Namespace | None = None,
        prefix: ChunkKey | None = None,
        source: Source | str | None = None,
        before_version: int | None = None,
        model: str | None = None,
        keep_weights_digest: str | None = None,
    ) -> int:
        """Invalidate and delete every object matching all the given criteria; ``prefix``
        selects that chunk and every chunk chained after it, present or not in between.
        ``source`` selects the chunks that depend on an upstream source (their put
        declared a span of it starting before their end) and every chunk chained after
        them: a name selects every version of it (with ``before_version``, those below
        it), a :class:`~kvlife.core.sources.Source` that version only. ``model`` selects
        a model's chunks (``ModelIdentity.model_id``); with ``keep_weights_digest``,
        those of every weights version of it but that one (the current one).
        Puts in flight are covered too: a chunk of a put prepared before this returned
        is never stored. On a store whose chain has a shared tier (Redis, Mooncake) the
        invalidation is global: recorded in the shared index first, so every host stops
        serving what it covers at its next lookup (docs/remote.md), then applied here
        (IndexUnreachable if it could only be applied here). Returns the number of
        objects removed here; durable when it returns."""
        name, versions = source_criteria(source, before_version)
        if keep_weights_digest is not None and model is None:
            raise InvalidArgument("keep_weights_digest needs a model (whose other versions go)")
        for what, value in (("model", model), ("keep_weights_digest", keep_weights_digest)):
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgument(f"{what} must be a non-empty str, got {value!r:.80}")
        return self._invalidate(
            Criteria(
                weights_digest,
                adapter_id,
                namespace,
                prefix,
                name,
                versions,
                model,
                keep_weights_digest,
            )
        )

    def evict(self, tier: str, nbytes: int) -> int:
        """Evict ``nbytes``' worth of replicas from ``tier``, coldest first by its policy:
        victims until the room they held there adds up to at least ``nbytes`` (or no
        unpinned replica is left), however much of its budget was free already; each
        victim held only there is demoted to the next tier first where the chain allows.
        Not "until ``nbytes`` are free". Returns the payload bytes of the replicas evicted
        from it (a tier that stores frames or rounds to pages charges a replica a
        different room)."""
        ...

    def flush(self) -> int:
        """Make every object durable; returns how many replicas were copied."""
        ...

    def drain(self) -> None:
        """Wait for background work (promotions) planned so far."""
        ...

    def check(self) -> AuditReport:
        """Audit every tier that can be audited (payload checksums included)."""
        ...

    def info(self) -> StoreInfo:
        """Tiers, objects and bytes by state, counters since open and over the store's
        lifetime."""
        ...

    @property
    def counters(self) -> StoreCounters:
        """Counters since the store opened."""
        ...

    @property
    def tier_names(self) -> list[TierName]:
        """The chain, fastest first."""
        ...

    def close(self, *, flush: bool = ...) -> None:
        """Release what this handle holds; the embedded store flushes first unless
        ``flush=False``, a served store's client only when ``flush=True``."""
        ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ a store's own steps

    def _put_prompt(self, prompt: PromptRef, kv: object, request_id: str) -> PutResult: ...

    def _prepare_put(self, prompt: PromptRef, kv: object, request_id: str) -> P: ...

    def _lookup(self, prompt: PromptRef, accept: Accept) -> LookupResult: ...

    def _load(self, lookup: LookupResult, outs: Outs, request_id: str) -> LoadResult: ...

    def _load_async(
        self, lookup: LookupResult, outs: Outs, request_id: str, depth: int | None
    ) -> LoadProgress: ...

    def _invalidate(self, criteria: Criteria) -> int: ...
