"""The argument checks of the store's public API, shared by every store.

:class:`~kvlife.store.api.StoreAPI` runs them before it hands a call to a store's own
step, so a bad argument is the same typed :class:`~kvlife.core.errors.InvalidArgument`
from the embedded ``KVStore`` and from a ``RemoteStore``, raised before anything is
written or sent. The rest (the layout of the KV, the token ids, how far a start may go,
the parent and extra keys of a prompt, invalidation criteria) is checked where the
prompt is keyed (:func:`kvlife.core.identity.prompt_chunk_keys`, on the server for a
served store) with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import ChunkKey, ModelIdentity, Namespace
from kvlife.core.objects import PromptRef
from kvlife.core.sources import SourceSpan, check_spans
from kvlife.native.spans import disjoint, spans
from kvlife.results import LookupResult
from kvlife.store.overlap import shared_pair
from kvlife.transforms.contract import Accept


def prompt(
    identity: ModelIdentity,
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    start: int,
    parent: ChunkKey,
    extra_keys: Sequence[bytes],
    sources: Sequence[SourceSpan] = (),
    prefix_tokens: Sequence[int] | np.ndarray | None = None,
) -> PromptRef:
    """A call's prompt, its identity, namespace, start and prefix checked (a served
    store encodes them for the wire before the server sees them)."""
    _typed("identity", identity, ModelIdentity)
    hint = " (use Namespace.parse for text)" if isinstance(namespace, str) else ""
    _typed("namespace", namespace, Namespace, hint)
    # numpy integers are taken (positions often come out of arrays), as plain ints: the
    # wire carries no numpy types; a negative one is refused here, the same by either store
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or start < 0:
        raise InvalidArgument(f"start must be an int position >= 0, got {start!r}")
    spans = check_spans(sources)
    ref = PromptRef(
        identity,
        namespace,
        tokens,
        int(start),
        parent,
        extra_keys,
        spans,
        prefix_tokens=prefix_tokens,
    )
    ref.check_prefix()
    return ref


def accept(value: Accept) -> Accept:
    if not isinstance(value, Accept):
        raise InvalidArgument(f"accept must be an Accept, got {type(value).__name__}")
    return value


def outs(lookup: LookupResult, buffers: Sequence[np.ndarray | None] | None) -> None:
    """One output buffer per hit (None entries: no buffer for that hit), or none at all
    (each checked by :func:`check_outs`)."""
    if buffers is not None and len(buffers) != len(lookup.hits):
        raise InvalidArgument(f"{len(buffers)} output buffers for {len(lookup.hits)} hits")
    if buffers is not None:
        check_outs(buffers)


def check_outs(outs: Sequence[np.ndarray | None]) -> None:
    """Output buffers must be writable arrays, share no memory with one another and not
    with themselves: two chunks read into one buffer would both report success with only
    the last one's bytes in it (the same buffer passed twice, overlapping slices of one
    array), and a chunk read into a buffer whose elements overlap reads back wrong. None
    entries (no buffer for that chunk) are skipped. Buffers that are all writable,
    C-contiguous and disjoint pass in one native call (:func:`kvlife.native.spans.disjoint`);
    otherwise where each lies comes from :func:`kvlife.native.spans.spans`, every buffer
    in one call, and which share memory from :func:`kvlife.store.overlap.shared_pair`
    (exact, a sort when none overlap)."""
    given: list[tuple[int, np.ndarray]] = []
    for i, out in enumerate(outs):
        if out is None:
            continue
        if not isinstance(out, np.ndarray):
            raise InvalidArgument(f"output buffer {i} is a {type(out).__name__}, not an array")
        given.append((i, out))
    arrays = [out for _, out in given]
    if disjoint(arrays):  # the common case, in one native call (issue 28)
        return
    where = spans(arrays)
    for (i, _), span in zip(given, where, strict=True):
        if not span.writable:
            raise InvalidArgument(f"output buffer {i} is read-only")
    pair = shared_pair(arrays, where)
    if pair is None:
        return
    a, b = given[pair[0]][0], given[pair[1]][0]
    if a == b:
        raise InvalidArgument(
            f"output buffer {a} overlaps itself (two of its elements share memory): each "
            "chunk needs memory of its own"
        )
    raise InvalidArgument(
        f"output buffers {a} and {b} share memory: each chunk needs a buffer of its own"
    )


def depth(value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise InvalidArgument(f"load depth must be >= 1, got {value}")


def size(nbytes: int) -> None:
    """A size to allocate: a positive int."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidArgument(f"buffer size must be a positive int, got {nbytes!r}")


def _typed(name: str, value: object, kind: type, hint: str = "") -> None:
    if not isinstance(value, kind):
        got = type(value).__name__
        raise InvalidArgument(f"{name} must be a {kind.__name__}, got {got}{hint}")
