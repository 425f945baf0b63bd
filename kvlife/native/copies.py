"""Copies of chunks by non-temporal stores (issue 28): a served put's copy into the
arena, a served load's copy out of it into the caller's own buffers, and the DRAM
tiers' copies in and out of their replicas.

A client writes a staged put's chunks into arena extents that the server then hashes
from memory, in another process on another CPU. ``np.copyto`` (glibc's ``memcpy``,
which streams only past hundreds of MiB) reads each destination line into this core's
cache before writing it: three bytes of memory traffic per byte copied, and the copy
evicts what the cache held. The extension's ``stream_copy`` writes whole lines without
reading them first (SSE2 non-temporal stores, the interpreter lock released): two bytes
per byte. Measured (scratch, 2-vCPU machine alone, 4-chunk served puts alternated put
by put with ``np.copyto``): 16 MiB chunks 7.4-8.3 ms against 9.9-11.1 ms, 2 MiB within
2% either way in three runs of four, 1 MiB 4% faster; a copy of 4 x 16 MiB alone 17.4
GB/s against 11.4-12.5. A chunk cut from one KV tensor (strided) is streamed run by
run: 2 MiB 1.35-2.03 ms against 1.59-5.09 ms, 16 MiB 7.1-9.2 against 10.1-13.1 ms.

The same copy out of an arena or a replica (2026-12-07, paired scratch runs against
``np.copyto``, huge-page arena): a served 4 x 2 MiB load from DRAM into the caller's
buffers took 0.76-0.78 of the time, 4 x 16 MiB 0.59-0.62; from disk 0.97-0.98 (the
copy overlaps the reads but for the last chunk's); an in-process put into the memory
tier, sealed by :func:`copy_sealed` in place of a Python loop over blocks, 0.88 of the
time at 2 MiB, 0.82 at 16 MiB. The bytes land outside the cache: a caller that reads
them at once reads them from memory, as it would any copy larger than the cache.

Small pieces, sources whose contiguous runs are short or that share memory with the
destination, and everything where the extension is not available go through
``np.copyto`` (the same bytes either way: ``tests/test_native_copies.py``).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import numpy as np
import xxhash

from kvlife.native import frames

STREAM_BYTES = 64 << 10
"""Pieces at least this large are streamed (a smaller one is a tail of whole heads: the
call's own cost would show)."""


def _streaming(dst: np.ndarray, src: object) -> ModuleType | None:
    """The extension, where it may stream ``src`` into ``dst``: arrays of one dtype and
    shape that holds no Python objects (a byte copy of a reference is not a copy: numpy
    exports such arrays' buffers all the same), ``dst`` writable, C-contiguous and at
    least :data:`STREAM_BYTES` (the extension checks the rest: runs, shared memory)."""
    module = frames.native_module()
    if (
        module is not None
        and isinstance(src, np.ndarray)
        and dst.nbytes >= STREAM_BYTES
        and dst.dtype == src.dtype
        and not dst.dtype.hasobject  # references: numpy copies them, counted
        and dst.shape == src.shape
        and dst.flags.writeable
        and dst.flags.c_contiguous
    ):
        return module
    return None


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``, by non-temporal stores where ``dst`` and ``src`` are
    arrays of one dtype and shape that holds no Python objects (a byte copy of a
    reference is not a copy: numpy exports such arrays' buffers all the same), ``dst``
    writable, C-contiguous and at least :data:`STREAM_BYTES`, ``src`` contiguous or
    strided with runs of at least 1 KiB (``STREAM_RUN``: a chunk cut from one KV
    tensor), sharing no memory with ``dst``, and the extension is available; otherwise
    ``np.copyto`` itself (with its errors)."""
    module = _streaming(dst, src)
    if module is not None:
        try:
            if module.stream_copy(dst, src):
                return  # streamed; False: a short run or shared memory, nothing copied
        except (BufferError, TypeError, ValueError):
            pass  # a dtype numpy exports no buffer of: refused before any byte moved
    np.copyto(dst, src)


@cache
def sealing() -> bool:
    """Whether :func:`copy_sealed` hashes as it copies here (the extension and its
    streaming hash are available, tried once on a block): a served put's client then
    seals its chunks itself."""
    module = frames.native_module()
    if module is None:
        return False
    src = np.arange(STREAM_BYTES, dtype=np.uint8)
    seal = module.copy_sealed(np.empty_like(src), src)
    return seal is not None and bytes(seal) == bytes(xxhash.xxh3_128_digest(src.data))


def copy_sealed(dst: np.ndarray, src: np.ndarray) -> bytes:
    """:func:`stream_copy`, and the xxh3-128 of the bytes copied (canonical, as
    ``xxhash``'s ``digest()`` gives it): by the extension's ``copy_sealed``, which hashes
    each block of ``src`` and then copies it from this core's cache (no second pass over
    memory), where :func:`stream_copy` would stream and the extension has the streaming
    hash; otherwise copied, then ``dst`` hashed (the bytes as they landed). What a
    served put's client sends with its commit as the seals of its chunks."""
    module = _streaming(dst, src)
    if module is not None:
        try:
            seal = module.copy_sealed(dst, src)
        except (BufferError, TypeError, ValueError):
            seal = None  # refused before any byte moved
        if seal is not None:
            return bytes(seal)
    stream_copy(dst, src)
    return bytes(xxhash.xxh3_128_digest(np.ascontiguousarray(dst).reshape(-1).view(np.uint8).data))
