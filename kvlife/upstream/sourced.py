"""The one place the application side hands a built prompt's sources to the store.

The store (``StoreAPI.put_prompt``/``lookup`` with ``sources=``, ``invalidate(source=,
before_version=)``) hashes into each chunk's key the sources of every span that starts
before the chunk's end, keeps them in the chunk's record, and drops by source every
chunk that depends on an old version and every chunk chained after it. These helpers
pass a :class:`~kvlife.upstream.builder.BuiltPrompt`'s tokens and spans, so an
application never builds the spans twice or forgets them on one of the calls.
"""

from __future__ import annotations

from typing import Any

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ModelIdentity, Namespace
from kvlife.core.sources import Source, SourceSpan
from kvlife.results import LookupResult, PutResult
from kvlife.store.api import StoreAPI
from kvlife.transforms.contract import Accept
from kvlife.upstream.builder import BuiltPrompt


def lookup(
    store: StoreAPI[Any],
    identity: ModelIdentity,
    namespace: Namespace,
    prompt: BuiltPrompt,
    *,
    accept: Accept = Accept.EXACT,
) -> LookupResult:
    """The stored chunks of ``prompt`` built from exactly these sources' versions."""
    return store.lookup(
        identity, namespace, list(prompt.tokens), sources=prompt.spans, accept=accept
    )


def put(
    store: StoreAPI[Any],
    identity: ModelIdentity,
    namespace: Namespace,
    prompt: BuiltPrompt,
    kv: object,
    *,
    upto: int | None = None,
    request_id: str = "",
) -> PutResult:
    """Store the full chunks of ``prompt``'s KV (``kv`` as ``put_prompt`` takes it),
    each keyed and recorded with the sources it depends on; with ``upto``, only the
    chunks inside its first ``upto`` tokens (the part whose KV is exact: their keys are
    those of the whole prompt's chunks, as a chunk depends on the spans that start
    before its end)."""
    tokens, spans = list(prompt.tokens), prompt.spans
    if upto is not None:
        if not 0 <= upto <= len(tokens):
            raise InvalidArgument(f"upto {upto} outside the prompt's {len(tokens)} tokens")
        tokens = tokens[:upto]
        spans = tuple(
            SourceSpan(s.source, s.start, min(s.end, upto)) for s in spans if s.start < upto
        )
    return store.put_prompt(identity, namespace, tokens, kv, sources=spans, request_id=request_id)


def supersede(store: StoreAPI[Any], source: Source) -> int:
    """``source`` is now the current version: drop every chunk that depends on an older
    version of it (and everything chained after those). Returns the objects removed."""
    if source.version == 0:
        return 0
    return store.invalidate(source=source.name, before_version=source.version)
