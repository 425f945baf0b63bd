"""Numba kernels of the page-mapped flash translation layer (FTL) and its NAND timing.

This is the hot core of :mod:`kvlife.sim.ssd`: everything that runs once per page (map
updates, invalidation, block allocation, garbage collection, die and channel queueing) is
compiled with ``numba.njit`` over flat numpy arrays, so that a Python-facing device class
can stay thin and a simulation reaches millions of page writes per second.

State lives in :class:`FtlArrays`, a named tuple of arrays that numba passes by reference.
Integer fields of the arrays are addressed by the module constants below (``B_*`` for a
block's row, ``C_*`` for counters, ``P_*`` for integer parameters, ``F_*`` for timing
parameters, ``FC_*`` for time counters); :mod:`kvlife.sim.ssd` is the only user and
turns the counters into typed statistics.

Model, in short:

- An erase unit ("block") is a superblock striped over all dies, like an FDP reclaim
  unit: page ``k`` of a block lives on die ``k % n_dies``.
- Each write stream (FDP reclaim-unit handle) has its own open block for host writes and
  its own open block as GC destination; GC copies a victim's valid pages into the GC
  block of the stream that wrote the victim.
- GC runs on demand: when a stream needs a new host block and at most ``gc_reserve``
  blocks are free, victims are collected until more than ``gc_reserve`` are free. The
  victim is the sealed block with the fewest valid pages (greedy, found in O(pages per
  block) through per-valid-count bucket lists) or the best (1-u)*age/(1+u) score
  (cost-benefit, Rosenblum and Ousterhout's LFS cleaner; a full scan).
- Timing: every die is a first-come-first-served server with a busy-until time, served
  in the order operations are issued. A page read occupies its die for tR, a program
  for tPROG, an erase occupies every die of the superblock for the (pro-rated) tBERS.
  Each channel is a FCFS pipe of page transfers whose slot is reserved when the
  operation is issued (a fluid approximation of the controller's out-of-order channel
  scheduling: reserving the slot when the die finishes would let one backlogged die
  push every later transfer on its channel into the future). A read completes at
  ``max(sense done + transfer, channel slot end)``. A GC copy's program is booked on its
  die when the GC issues it, not when its source read finishes, for the same reason.
  GC reads, programs and erases queue on the same dies and channels as host I/O, so GC
  shows up in host read and write latency.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit
from numpy.typing import NDArray

from kvlife.sim.errors import FtlInvariantError

UNMAPPED = -1
"""Value of an L2P entry with no physical page, and of a P2L entry that holds no live page."""

# Columns of FtlArrays.blk (one row per block).
B_VALID = 0
B_WPTR = 1
B_STATE = 2
B_STREAM = 3
B_SEAL = 4
B_NEXT = 5
B_PREV = 6
B_ERASES = 7
N_BLK_FIELDS = 8

# Block states.
BS_FREE = 0
BS_OPEN_HOST = 1
BS_OPEN_GC = 2
BS_SEALED = 3
BS_VICTIM = 4

# Kinds of open block per stream (columns of FtlArrays.open_blk).
K_HOST = 0
K_GC = 1

# Integer counters (FtlArrays.ctr).
C_HOST_WRITES = 0
C_NAND_WRITES = 1
C_GC_COPIES = 2
C_GC_VICTIMS = 3
C_GC_RUNS = 4
C_ERASES = 5
C_TRIMS = 6
C_HOST_READS = 7
C_UNMAPPED_READS = 8
C_FREE_HEAD = 9
C_FREE_COUNT = 10
C_LIVE = 11
N_COUNTERS = 12

# Integer parameters (FtlArrays.prm).
P_PPB = 0
P_NBLOCKS = 1
P_NLPN = 2
P_NSTREAMS = 3
P_GC_POLICY = 4
P_GC_RESERVE = 5
P_NDIES = 6
P_NCHANNELS = 7
N_PARAMS = 8

# Timing parameters in seconds (FtlArrays.fprm).
F_T_READ = 0
F_T_PROG = 1
F_T_ERASE = 2
F_T_XFER = 3
F_T_CMD = 4
N_FPARAMS = 5

# Time counters in seconds (FtlArrays.fctr).
FC_GC_DIE_TIME = 0
N_FCOUNTERS = 1

GC_GREEDY = 0
GC_COST_BENEFIT = 1

# Operation kinds of an object replay (see replay_objects).
OP_WRITE = 0
OP_READ = 1
OP_DELETE = 2


class FtlArrays(NamedTuple):
    """The whole mutable state of one simulated FTL, as flat arrays."""

    l2p: NDArray[np.int32]
    """Logical page -> physical page, or UNMAPPED."""
    p2l: NDArray[np.int32]
    """Physical page -> logical page it holds live, or UNMAPPED (free or invalid)."""
    blk: NDArray[np.int64]
    """Per block, the B_* fields (valid count, write pointer, state, stream, ...)."""
    free_ring: NDArray[np.int64]
    """FIFO ring of free blocks; head and count are C_FREE_HEAD and C_FREE_COUNT."""
    bucket_head: NDArray[np.int64]
    """Per valid count, the first sealed block with that many valid pages (or -1)."""
    open_blk: NDArray[np.int64]
    """[stream, K_HOST | K_GC] -> open block, or -1."""
    ctr: NDArray[np.int64]
    """Integer counters, C_*."""
    prm: NDArray[np.int64]
    """Integer parameters, P_*."""
    fprm: NDArray[np.float64]
    """Timing parameters, F_*."""
    busy: NDArray[np.float64]
    """Busy-until time of each die, then of each channel."""
    fctr: NDArray[np.float64]
    """Time counters, FC_*."""


def new_ftl_arrays(
    *,
    pages_per_block: int,
    n_blocks: int,
    logical_pages: int,
    n_streams: int,
    gc_policy: int,
    gc_reserve: int,
    n_dies: int,
    n_channels: int,
    t_read: float,
    t_prog: float,
    t_erase: float,
    t_xfer: float,
    t_cmd: float,
) -> FtlArrays:
    """Allocate the state of an empty device: every block free, every logical page unmapped."""
    blk = np.zeros((n_blocks, N_BLK_FIELDS), dtype=np.int64)
    blk[:, B_NEXT] = -1
    blk[:, B_PREV] = -1
    blk[:, B_STATE] = BS_FREE
    ctr = np.zeros(N_COUNTERS, dtype=np.int64)
    ctr[C_FREE_COUNT] = n_blocks
    prm = np.zeros(N_PARAMS, dtype=np.int64)
    prm[P_PPB] = pages_per_block
    prm[P_NBLOCKS] = n_blocks
    prm[P_NLPN] = logical_pages
    prm[P_NSTREAMS] = n_streams
    prm[P_GC_POLICY] = gc_policy
    prm[P_GC_RESERVE] = gc_reserve
    prm[P_NDIES] = n_dies
    prm[P_NCHANNELS] = n_channels
    fprm = np.zeros(N_FPARAMS, dtype=np.float64)
    fprm[F_T_READ] = t_read
    fprm[F_T_PROG] = t_prog
    fprm[F_T_ERASE] = t_erase
    fprm[F_T_XFER] = t_xfer
    fprm[F_T_CMD] = t_cmd
    return FtlArrays(
        l2p=np.full(logical_pages, UNMAPPED, dtype=np.int32),
        p2l=np.full(n_blocks * pages_per_block, UNMAPPED, dtype=np.int32),
        blk=blk,
        free_ring=np.arange(n_blocks, dtype=np.int64),
        bucket_head=np.full(pages_per_block + 1, -1, dtype=np.int64),
        open_blk=np.full((n_streams, 2), -1, dtype=np.int64),
        ctr=ctr,
        prm=prm,
        fprm=fprm,
        busy=np.zeros(n_dies + n_channels, dtype=np.float64),
        fctr=np.zeros(N_FCOUNTERS, dtype=np.float64),
    )


# ---------------------------------------------------------------------------------------
# Timing: FCFS servers with busy-until times.


@njit(cache=True, inline="always")
def _t_read(st: FtlArrays, die: int, t: float) -> float:
    """Read one page issued at ``t``: sense on the die (FCFS), then cross the channel."""
    nd = st.prm[P_NDIES]
    ch = nd + die % st.prm[P_NCHANNELS]
    start = max(t, st.busy[die])
    sensed = start + st.fprm[F_T_READ]
    st.busy[die] = sensed
    xfer = st.fprm[F_T_XFER]
    slot_end = max(t, st.busy[ch]) + xfer
    st.busy[ch] = slot_end
    return float(max(sensed + xfer, slot_end))


@njit(cache=True, inline="always")
def _t_prog(st: FtlArrays, die: int, t_issue: float, t_ready: float) -> float:
    """Program one page issued at ``t_issue`` whose data is available at ``t_ready``.

    The die time is booked FCFS at issue (work-conserving: a GC copy whose source read is
    still queued does not leave its destination die idle, as an out-of-order controller
    would fill that gap); the returned completion also respects the data dependency.
    """
    nd = st.prm[P_NDIES]
    ch = nd + die % st.prm[P_NCHANNELS]
    xfer = st.fprm[F_T_XFER]
    t_prog = st.fprm[F_T_PROG]
    slot_end = max(t_issue, st.busy[ch]) + xfer
    st.busy[ch] = slot_end
    end = max(slot_end, st.busy[die]) + t_prog
    st.busy[die] = end
    return float(max(end, t_ready + xfer + t_prog))


@njit(cache=True)
def _t_erase(st: FtlArrays, t: float) -> float:
    done = t
    for d in range(st.prm[P_NDIES]):
        start = max(t, st.busy[d])
        end = start + st.fprm[F_T_ERASE]
        st.busy[d] = end
        done = max(done, end)
    return done


# ---------------------------------------------------------------------------------------
# Bucket lists of sealed blocks by valid count (greedy victim selection in O(ppb)).


@njit(cache=True, inline="always")
def _bucket_insert(st: FtlArrays, b: int, v: int) -> None:
    h = st.bucket_head[v]
    st.blk[b, B_NEXT] = h
    st.blk[b, B_PREV] = -1
    if h >= 0:
        st.blk[h, B_PREV] = b
    st.bucket_head[v] = b


@njit(cache=True, inline="always")
def _bucket_remove(st: FtlArrays, b: int, v: int) -> None:
    p = st.blk[b, B_PREV]
    n = st.blk[b, B_NEXT]
    if p >= 0:
        st.blk[p, B_NEXT] = n
    else:
        st.bucket_head[v] = n
    if n >= 0:
        st.blk[n, B_PREV] = p
    st.blk[b, B_NEXT] = -1
    st.blk[b, B_PREV] = -1


# ---------------------------------------------------------------------------------------
# Blocks and pages.


@njit(cache=True, inline="always")
def _invalidate(st: FtlArrays, ppn: int) -> None:
    ppb = st.prm[P_PPB]
    b = ppn // ppb
    st.p2l[ppn] = UNMAPPED
    v = st.blk[b, B_VALID]
    if st.blk[b, B_STATE] == BS_SEALED:
        _bucket_remove(st, b, v)
        _bucket_insert(st, b, v - 1)
    st.blk[b, B_VALID] = v - 1


@njit(cache=True)
def _pop_free(st: FtlArrays) -> int:
    count = st.ctr[C_FREE_COUNT]
    if count <= 0:
        raise FtlInvariantError("FTL ran out of free blocks during garbage collection")
    head = st.ctr[C_FREE_HEAD]
    b = st.free_ring[head]
    st.ctr[C_FREE_HEAD] = (head + 1) % st.prm[P_NBLOCKS]
    st.ctr[C_FREE_COUNT] = count - 1
    return int(b)


@njit(cache=True)
def _push_free(st: FtlArrays, b: int) -> None:
    n = st.prm[P_NBLOCKS]
    st.free_ring[(st.ctr[C_FREE_HEAD] + st.ctr[C_FREE_COUNT]) % n] = b
    st.ctr[C_FREE_COUNT] += 1


@njit(cache=True)
def _select_victim(st: FtlArrays) -> int:
    ppb = st.prm[P_PPB]
    if st.prm[P_GC_POLICY] == GC_GREEDY:
        for v in range(ppb):
            h = st.bucket_head[v]
            if h >= 0:
                return int(h)
        return -1
    # Cost-benefit: maximise (1 - u) * age / (1 + u); age counted in host page writes.
    best = -1
    best_score = -1.0
    now = st.ctr[C_HOST_WRITES]
    for b in range(st.prm[P_NBLOCKS]):
        if st.blk[b, B_STATE] != BS_SEALED:
            continue
        v = st.blk[b, B_VALID]
        if v == 0:
            return b
        if v >= ppb:
            continue
        u = v / ppb
        age = float(now - st.blk[b, B_SEAL] + 1)
        score = (1.0 - u) * age / (1.0 + u)
        if score > best_score:
            best_score = score
            best = b
    return best


@njit(cache=True)
def _seal(st: FtlArrays, b: int) -> None:
    st.blk[b, B_STATE] = BS_SEALED
    st.blk[b, B_SEAL] = st.ctr[C_HOST_WRITES]
    _bucket_insert(st, b, st.blk[b, B_VALID])


@njit(cache=True)
def _program(
    st: FtlArrays, stream: int, kind: int, lpn: int, t_issue: float, t_ready: float
) -> float:
    """Write one logical page into the open block of (stream, kind); returns completion."""
    b = st.open_blk[stream, kind]
    if b < 0:
        # Host writes run garbage collection before they get here (_host_write_page), so
        # that this function never recurses into GC.
        b = _pop_free(st)
        st.blk[b, B_STATE] = BS_OPEN_HOST if kind == K_HOST else BS_OPEN_GC
        st.blk[b, B_STREAM] = stream
        st.blk[b, B_WPTR] = 0
        st.open_blk[stream, kind] = b
    ppb = st.prm[P_PPB]
    off = st.blk[b, B_WPTR]
    ppn = b * ppb + off
    st.blk[b, B_WPTR] = off + 1
    st.p2l[ppn] = lpn
    st.l2p[lpn] = ppn
    st.blk[b, B_VALID] += 1
    st.ctr[C_NAND_WRITES] += 1
    done = _t_prog(st, off % st.prm[P_NDIES], t_issue, t_ready)
    if off + 1 == ppb:
        _seal(st, b)
        st.open_blk[stream, kind] = -1
    return done


@njit(cache=True)
def _gc_one(st: FtlArrays, t: float) -> float:
    """Collect one victim block; returns when its last copy or erase completes."""
    ppb = st.prm[P_PPB]
    v = _select_victim(st)
    if v < 0:
        raise FtlInvariantError("garbage collection found no sealed block with an invalid page")
    _bucket_remove(st, v, st.blk[v, B_VALID])
    st.blk[v, B_STATE] = BS_VICTIM
    stream = st.blk[v, B_STREAM]
    base = v * ppb
    nd = st.prm[P_NDIES]
    done = t
    copies = 0
    for off in range(ppb):
        lpn = st.p2l[base + off]
        if lpn >= 0:
            tr = _t_read(st, off % nd, t)
            st.p2l[base + off] = UNMAPPED
            st.blk[v, B_VALID] -= 1
            d = _program(st, stream, K_GC, lpn, t, tr)
            done = max(done, d)
            copies += 1
    if st.blk[v, B_VALID] != 0:
        raise FtlInvariantError("victim block kept valid pages after relocation")
    done = max(done, _t_erase(st, t))
    st.blk[v, B_WPTR] = 0
    st.blk[v, B_STATE] = BS_FREE
    st.blk[v, B_ERASES] += 1
    _push_free(st, v)
    st.ctr[C_GC_COPIES] += copies
    st.ctr[C_GC_VICTIMS] += 1
    st.ctr[C_ERASES] += 1
    st.fctr[FC_GC_DIE_TIME] += (
        copies * (st.fprm[F_T_READ] + st.fprm[F_T_PROG]) + nd * st.fprm[F_T_ERASE]
    )
    return done


@njit(cache=True)
def _collect_garbage(st: FtlArrays, t: float) -> None:
    reserve = st.prm[P_GC_RESERVE]
    if st.ctr[C_FREE_COUNT] > reserve:
        return
    while st.ctr[C_FREE_COUNT] <= reserve:
        _gc_one(st, t)
    st.ctr[C_GC_RUNS] += 1


@njit(cache=True, inline="always")
def _host_write_page(st: FtlArrays, lpn: int, stream: int, t: float) -> float:
    old = st.l2p[lpn]
    if old >= 0:
        # Invalidate first so that a GC triggered by this write does not copy the old page.
        _invalidate(st, old)
        st.l2p[lpn] = UNMAPPED
    else:
        st.ctr[C_LIVE] += 1
    st.ctr[C_HOST_WRITES] += 1
    if st.open_blk[stream, K_HOST] < 0:
        _collect_garbage(st, t)
    return _program(st, stream, K_HOST, lpn, t, t)


@njit(cache=True, inline="always")
def _host_read_page(st: FtlArrays, lpn: int, t: float) -> float:
    ppn = st.l2p[lpn]
    if ppn < 0:
        st.ctr[C_UNMAPPED_READS] += 1
        return t
    st.ctr[C_HOST_READS] += 1
    return _t_read(st, (ppn % st.prm[P_PPB]) % st.prm[P_NDIES], t)


@njit(cache=True, inline="always")
def _trim_page(st: FtlArrays, lpn: int) -> None:
    old = st.l2p[lpn]
    if old >= 0:
        _invalidate(st, old)
        st.l2p[lpn] = UNMAPPED
        st.ctr[C_LIVE] -= 1
        st.ctr[C_TRIMS] += 1


# ---------------------------------------------------------------------------------------
# Batch entry points (called from Python).


@njit(cache=True)
def write_pages(st: FtlArrays, lpns: NDArray[np.int64], stream: int, t: float) -> float:
    """One host write command of ``lpns`` submitted at ``t``; returns its completion time."""
    done = t
    for i in range(lpns.shape[0]):
        done = max(done, _host_write_page(st, lpns[i], stream, t))
    return float(done + st.fprm[F_T_CMD])


@njit(cache=True)
def read_pages(st: FtlArrays, lpns: NDArray[np.int64], t: float) -> float:
    """One host read command of ``lpns`` submitted at ``t``; returns its completion time."""
    done = t
    for i in range(lpns.shape[0]):
        done = max(done, _host_read_page(st, lpns[i], t))
    return float(done + st.fprm[F_T_CMD])


@njit(cache=True)
def trim_pages(st: FtlArrays, lpns: NDArray[np.int64]) -> None:
    """TRIM (deallocate) ``lpns``: their physical pages become invalid, reads see unmapped."""
    for i in range(lpns.shape[0]):
        _trim_page(st, lpns[i])


@njit(cache=True)
def write_sequential(st: FtlArrays, first: int, count: int, stream: int, t: float) -> float:
    """Write logical pages first..first+count-1 in order, one page per command at ``t``."""
    done = t
    for lpn in range(first, first + count):
        done = max(done, _host_write_page(st, lpn, stream, t))
    return done


@njit(cache=True)
def write_uniform_random(st: FtlArrays, count: int, seed: int, stream: int, t: float) -> float:
    """Overwrite ``count`` logical pages drawn uniformly at random (seeded), all at ``t``."""
    np.random.seed(seed)
    n = st.prm[P_NLPN]
    done = t
    for _ in range(count):
        lpn = np.random.randint(0, n)
        done = max(done, _host_write_page(st, lpn, stream, t))
    return done


@njit(cache=True)
def replay_objects(
    st: FtlArrays,
    op_kind: NDArray[np.int8],
    op_time: NDArray[np.float64],
    op_obj: NDArray[np.int64],
    op_stream: NDArray[np.int64],
    obj_npages: NDArray[np.int64],
    obj_offset: NDArray[np.int64],
    lpn_table: NDArray[np.int64],
    free_lpns: NDArray[np.int64],
    free_top: NDArray[np.int64],
    out_latency: NDArray[np.float64],
) -> None:
    """Replay an object-level write/read/delete stream onto the FTL.

    Each object is written at most once. A write takes ``obj_npages[o]`` logical pages
    from the free stack ``free_lpns[:free_top[0]]`` and records them in
    ``lpn_table[obj_offset[o]:...]``; a read reads them; a delete TRIMs them and returns
    them to the stack. ``out_latency[i]`` receives the latency of op ``i`` (seconds).
    Ops must be sorted by time (the caller's order is the FCFS order).
    """
    t_cmd = st.fprm[F_T_CMD]
    for i in range(op_kind.shape[0]):
        o = op_obj[i]
        t = op_time[i]
        n = obj_npages[o]
        off = obj_offset[o]
        kind = op_kind[i]
        done = t
        if kind == OP_WRITE:
            if n > 0 and lpn_table[off] != UNMAPPED:
                raise FtlInvariantError("object written twice in one replay")
            top = free_top[0]
            if top < n:
                raise FtlInvariantError("object write needs more logical pages than are free")
            s = op_stream[i]
            for k in range(n):
                top -= 1
                lpn = free_lpns[top]
                lpn_table[off + k] = lpn
                done = max(done, _host_write_page(st, lpn, s, t))
            free_top[0] = top
            out_latency[i] = done + t_cmd - t
        elif kind == OP_READ:
            for k in range(n):
                lpn = lpn_table[off + k]
                if lpn < 0:
                    st.ctr[C_UNMAPPED_READS] += 1
                else:
                    done = max(done, _host_read_page(st, lpn, t))
            out_latency[i] = done + t_cmd - t
        else:
            top = free_top[0]
            for k in range(n):
                lpn = lpn_table[off + k]
                if lpn < 0:
                    raise FtlInvariantError("object deleted that is not stored")
                _trim_page(st, lpn)
                free_lpns[top] = lpn
                top += 1
                lpn_table[off + k] = UNMAPPED
            free_top[0] = top
            out_latency[i] = 0.0
