"""Red team of direct runs (issue 28, commits 349dc37 and 1943511): the extension's
``start_direct`` opens the segment files and starts reading before the load's request
leaves, ``DirectRun.finish()`` verifies in order, ``disjoint`` is check_outs' fast path,
and ``Loads._load_direct`` keeps min(confirmed, verified) leading chunks.

Attacked here, with real segment files written by a real disk tier and real
``kvlife serve`` processes: a run finished from two threads at once, closed from another
thread while it finishes, dropped with its reads in flight, many runs at once, buffers
deleted or resized under a run, a run caught in a reference cycle, frame sequences that
change while they are parsed, argument types the parser must refuse without leaking a
buffer export or a descriptor, very long and many distinct paths, a segment truncated
while it is read, one buffer named by two frames; ``disjoint`` under ``-W error`` and at
its edges; and on the served load: an offset the extension cannot take, a lookup handed
to another client of another server, two threads sharing one client, a reconnect
between lookup and load, an interrupt in ``on_chunk``, a segment file replaced by one
holding other chunks' frames. The promise: never a wrong byte kept, a typed error for
bad input, nothing leaked, every chunk counted once.

Found by this red team, all mended (each test here failed before its mend):
- a lookup made by one client on one server and loaded by another client whose first
  connection went to another server on the same socket kept the first store's old bytes:
  connection numbers were counted per client from 1, so both were "epoch 1" (now one
  count per process, from a random start: kvlife/client/connection.py ``next_epoch``);
- a frame offset of 2**63 raised an untyped OverflowError out of the load
  (``parse_frames`` now bounds offsets and segments below 2**63, and the load takes
  the server's path on OverflowError too);
- a DirectRun in a reference cycle was never collected and kept its segment files open
  (the type now takes part in the cycle collector: its clear stops and releases it);
- one buffer named by two frames was counted twice by ``finish()`` (``start_direct``
  now refuses frames whose buffers share memory, before any read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.client import RemoteStore
from kvlife.client import direct as client_direct
from kvlife.core.errors import InvalidArgument, KVLifeError, ProtocolError
from kvlife.native import frames as native
from kvlife.native.spans import disjoint
from kvlife.tiers.buffers import aligned_empty
from kvlife.tiers.disk.frame import HEADER_BYTES
from tests.attack import test_direct_reads_attack as first_team
from tests.attack.test_direct_reads_attack import (
    CHUNKS,
    _aligned,
    _check_prefix,
    _lookup,
    _ns,
    _put_on_disk,
    _same,
    _start,
    _with_frames,
)
from tests.server.conftest import ServerProc
from tests.test_native_direct import _frames as stored_frames

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the extension is not built (KVLIFE_NATIVE=0 or no compiler)"
)

Frames = list[native.DirectFrame]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _fresh(frames: Frames) -> tuple[Frames, list[np.ndarray]]:
    """The same frames, each into a new aligned buffer of its own."""
    out: Frames = []
    bufs = []
    for p, off, body, n, header, checksum in frames:
        buf = aligned_empty(body.nbytes)
        buf[:] = 0xEE
        out.append((p, off, buf, n, header, checksum))
        bufs.append(buf)
    return out, bufs


def _stored_ok(bufs: Sequence[np.ndarray], stored: Sequence[bytes], k: int) -> None:
    for i in range(k):
        assert bufs[i].tobytes() == stored[i], f"frame {i} counted with other bytes"


# --------------------------------------------------------------------------- DirectRun


def test_finish_from_two_threads_at_once_counts_once(tmp_path: Path) -> None:
    frames, _, stored = stored_frames(tmp_path)
    fds = _fds()
    for _ in range(30):
        fr, bufs = _fresh(frames * 4)
        run = native.start_direct(fr, 2)
        gate = threading.Barrier(2)
        got: list[Any] = []

        def finish(
            run: native.DirectRun = run,
            gate: threading.Barrier = gate,
            got: list[Any] = got,
        ) -> None:
            gate.wait()
            try:
                got.append(run.finish())
            except RuntimeError as exc:
                got.append(exc)

        ts = [threading.Thread(target=finish) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        counts = [g for g in got if isinstance(g, int)]
        assert len(got) == 2 and counts == [len(fr)], got
        _stored_ok(bufs, stored * 4, len(fr))
        assert run.reading == 0
    assert _fds() <= fds


def test_close_from_another_thread_while_finishing_is_refused_or_waits(tmp_path: Path) -> None:
    frames, _, stored = stored_frames(tmp_path)
    fds = _fds()
    fr, bufs = _fresh(frames * 40)  # 160 frames: finish() takes a while
    run = native.start_direct(fr, 4)
    stop = threading.Event()
    seen: list[object] = []

    def closer() -> None:
        while not stop.is_set():
            try:
                run.close()
                seen.append(None)
            except RuntimeError as exc:
                seen.append(exc)

    t = threading.Thread(target=closer)
    t.start()
    try:
        count = run.finish()
    except RuntimeError:
        count = None  # the closer got there first: the run was closed, nothing counted
    stop.set()
    t.join(10)
    for s in seen:
        assert s is None or "being finished" in str(s)
    if count is not None:
        assert count == len(fr)
        _stored_ok(bufs, stored * 40, count)
    run.close()
    assert run.reading == 0
    with pytest.raises(RuntimeError):
        run.finish()
    assert _fds() <= fds


def test_runs_dropped_in_flight_and_many_at_once_leave_no_descriptor_or_thread(
    tmp_path: Path,
) -> None:
    frames, _, stored = stored_frames(tmp_path)
    gc.collect()
    fds, tasks = _fds(), _tasks()
    runs = []
    keep = []
    for _ in range(120):  # 120 runs open at once, each with its file and threads
        fr, bufs = _fresh(frames)
        runs.append(native.start_direct(fr, 4))
        keep.append(bufs)
    assert _fds() >= fds + 100
    for i, run in enumerate(runs[::2]):
        assert run.finish() == len(frames)
        _stored_ok(keep[2 * i], stored, len(frames))
    del runs, keep  # the other half dropped unfinished, reads perhaps in flight
    gc.collect()
    assert _fds() <= fds
    assert _tasks() <= tasks


def test_buffers_deleted_or_resized_under_a_run_stay_the_runs(tmp_path: Path) -> None:
    frames, _, stored = stored_frames(tmp_path)
    raws: list[np.ndarray] = []
    refs = []
    fr: Frames = []
    for p, off, body, n, header, checksum in frames:
        view = aligned_empty(body.nbytes)
        raw = view.base
        assert isinstance(raw, np.ndarray) and raw.flags.owndata
        raws.append(raw)
        refs.append((view.ctypes.data - raw.ctypes.data, body.nbytes))
        fr.append((p, off, view, n, header, checksum))
    run = native.start_direct(fr, 2)
    for raw in raws:
        with pytest.raises(ValueError):
            raw.resize(1 << 20)  # referenced (its view is exported to the run): refused
    alive = [weakref.ref(f[2]) for f in fr]
    del fr, view
    gc.collect()
    assert all(r() is not None for r in alive)  # the run holds the buffers it reads into
    assert run.finish() == len(frames)
    del run
    gc.collect()
    assert all(r() is None for r in alive)  # and lets them go once spent
    for raw, (at, n), want in zip(raws, refs, stored, strict=True):
        assert raw[at : at + n].tobytes() == want


class _Held(np.ndarray):
    """An array that can hold a reference to the run reading into it."""

    run: Any


def test_a_run_in_a_reference_cycle_is_collected_and_closes_its_files(tmp_path: Path) -> None:
    frames, _, _ = stored_frames(tmp_path)
    gc.collect()
    fds = _fds()
    for _ in range(5):
        p, off, body, n, header, checksum = frames[0]
        held = aligned_empty(body.nbytes).view(_Held)
        run = native.start_direct([(p, off, held, n, header, checksum)], 1)
        held.run = run  # run -> buffer export -> held -> run
        del held, run
    gc.collect()
    assert _fds() <= fds


def test_frame_sequences_that_change_while_parsed(tmp_path: Path) -> None:
    frames, _, stored = stored_frames(tmp_path)
    fds = _fds()
    backing: list[Any] = list(frames)

    class Shifty:
        """A sequence whose items change while it is read (the parser copies it)."""

        def __len__(self) -> int:
            return len(backing)

        def __getitem__(self, i: int) -> Any:
            if i >= len(backing):
                raise IndexError(i)
            item = backing[i]
            backing.clear()  # everything after this one is gone
            return item

    class Off:
        """An offset whose __index__ drops the caller's frames list."""

        def __init__(self, value: int, victim: list[Any]) -> None:
            self.value, self.victim = value, victim

        def __index__(self) -> int:
            self.victim.clear()
            gc.collect()
            return self.value

    run = native.start_direct(Shifty(), 1)  # type: ignore[arg-type]
    n = run.finish()
    assert n <= 1
    fr, bufs = _fresh(frames)
    victim: list[Any] = list(fr)
    p, off, body, nb, header, checksum = fr[1]
    victim[1] = (p, Off(off, victim), body, nb, header, checksum)
    del fr, body
    run = native.start_direct(victim, 1)
    assert run.finish() == len(frames)
    _stored_ok(bufs, stored, len(frames))
    del run, victim
    gc.collect()
    assert _fds() <= fds


def _bad_items(frames: Frames, tmp: Path) -> dict[str, tuple[Any, type[BaseException]]]:
    p, off, body, n, header, checksum = frames[1]
    mv = memoryview(bytearray(header * 2))[::2]
    return {
        "bytes-path": ((os.fsencode(p), off, body, n, header, checksum), TypeError),
        "pathlib-path": ((Path(p), off, body, n, header, checksum), TypeError),
        "int-path": ((3, off, body, n, header, checksum), TypeError),
        "str-header": ((p, off, body, n, header.decode("latin-1"), checksum), TypeError),
        "strided-header": ((p, off, body, n, mv, checksum), (TypeError, BufferError)),  # type: ignore[dict-item]
        "short-checksum": ((p, off, body, n, header, checksum[:15]), ValueError),
        "long-header": ((p, off, body, n, header + bytes(4096), checksum), ValueError),
        "negative-nbytes": ((p, off, body, -1, header, checksum), ValueError),
        "huge-nbytes": ((p, off, body, 1 << 62, header, checksum), ValueError),
        "nbytes-too-big": ((p, off, body, 1 << 70, header, checksum), (OverflowError, ValueError)),  # type: ignore[dict-item]
        "negative-offset": ((p, -4096, body, n, header, checksum), ValueError),
        "huge-offset": ((p, 1 << 70, body, n, header, checksum), (OverflowError, ValueError)),  # type: ignore[dict-item]
        "float-offset": ((p, float(off), body, n, header, checksum), TypeError),
        "bytes-body": ((p, off, bytes(body.nbytes), n, header, checksum), ValueError),
        "five-fields": ((p, off, body, n, header), TypeError),
        "seven-fields": ((p, off, body, n, header, checksum, 0), TypeError),
        "a-list": ([p, off, body, n, header, checksum], TypeError),
        "none": (None, TypeError),
    }


def test_odd_argument_types_are_typed_errors_and_leak_no_export_or_descriptor(
    tmp_path: Path,
) -> None:
    frames, _, _ = stored_frames(tmp_path)
    fds = _fds()
    for item, err in _bad_items(frames, tmp_path).values():
        # frame 0's header and checksum are bytearrays: a leaked export of either would
        # make them refuse to resize afterwards
        p, off, body, n, header, checksum = frames[0]
        want, csum = bytearray(header), bytearray(checksum)
        fr = [(p, off, body, n, want, csum), item]
        with pytest.raises(err):
            native.start_direct(fr, 1)
        want.append(0)
        csum.append(0)
        # the first frame's buffer was let go too: numpy may resize it again
        assert body.base is not None
    assert _fds() <= fds
    # bytes-like headers and checksums of other types are read as their bytes
    p, off, body, n, header, checksum = frames[0]
    for kind in (bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8)):
        odd: list[Any] = [(p, off, body, n, kind(header), kind(checksum))]
        run = native.start_direct(odd, 1)
        assert run.finish() == 1


def test_very_long_and_many_distinct_paths(tmp_path: Path) -> None:
    frames, _, stored = stored_frames(tmp_path)
    fds = _fds()
    p = frames[0][0]
    long_path = "/" + "/".join(["x" * 200] * 40)  # ENAMETOOLONG
    run = native.start_direct([(long_path, *frames[0][1:])], 1)
    assert run.reading == 0 and run.finish() == 0
    links = tmp_path / "links"
    links.mkdir()
    fr: Frames = []
    bufs = []
    for i in range(300):  # hard links: 300 distinct paths of one regular file
        name = links / f"seg-{i:04d}"
        os.link(p, name)
        src = frames[i % len(frames)]
        if src[0] != p:
            continue
        buf = aligned_empty(src[2].nbytes)
        fr.append((str(name), src[1], buf, *src[3:]))
        bufs.append((buf, stored[i % len(frames)]))
    run = native.start_direct(fr, 8)
    assert run.reading == len(fr)
    assert _fds() >= fds + len(fr)
    assert run.finish() == len(fr)
    for buf, want in bufs:
        assert buf.tobytes() == want
    assert _fds() <= fds


def test_a_segment_truncated_while_a_run_reads_counts_only_stored_bytes(
    tmp_path: Path,
) -> None:
    for it in range(12):
        frames, _, stored = stored_frames(tmp_path / f"t{it}")
        fr, bufs = _fresh(frames * 8)
        run = native.start_direct(fr, 1 + it % 3)
        p, off = frames[2][0], frames[2][1]
        os.truncate(p, off + HEADER_BYTES + 10)  # cut frame 2 (and what follows)
        k = run.finish()
        _stored_ok(bufs, stored * 8, k)  # read whole before the cut, or not counted


def test_one_buffer_named_by_two_frames_is_refused_or_not_counted_twice(tmp_path: Path) -> None:
    frames, _, stored = stored_frames(tmp_path)
    buf = aligned_empty(frames[1][2].nbytes)  # 20 KiB: room for frame 0 and frame 1
    f0 = (frames[0][0], frames[0][1], buf, *frames[0][3:])
    f1 = (frames[1][0], frames[1][1], buf, *frames[1][3:])
    for _ in range(200):
        try:
            run = native.start_direct([f0, f1], 1)
        except ValueError:
            return  # refused: the mend
        k = run.finish()
        if k == 2:
            assert buf[: frames[0][3]].tobytes() == stored[0], (
                "finish() counted frame 0, whose buffer now holds frame 1's bytes"
            )


# --------------------------------------------------------------------------- disjoint


def test_disjoint_never_warns_raises_or_says_true_for_what_it_cannot_vouch_for() -> None:
    a = np.zeros((4, 8), np.float32)
    b = np.zeros((1, 8), np.float32)
    bx, _ = np.broadcast_arrays(b, a)  # numpy only warns on writing these
    u = a.reshape(-1).view(np.uint8)
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    when = np.zeros(4, "M8[s]")  # exported without its format: still its bytes
    cases: dict[str, tuple[list[Any], bool]] = {
        "broadcast": ([bx, np.zeros(3)], False),
        "read-only": ([ro], False),
        "transposed": ([a.T], False),
        "strided": ([a[:, ::2]], False),
        "datetime": ([when, when[:2].copy()], True),
        "datetime-twice": ([when, when[1:]], False),
        "bytes": ([b"abcd"], False),
        "same-twice": ([a, a], False),
        "one-byte-overlap": ([u[:9], u[8:20]], False),
        "adjacent": ([u[:8], u[8:20]], True),
        "empty-inside": ([a, a[1:1]], True),
        "zero-dim": ([np.zeros(()), np.zeros(())], True),
        "bytearray": ([bytearray(8), bytearray(8)], True),
        "nothing": ([], True),
        "one-row-per-view": ([a[i] for i in range(4)], True),
        "reversed-overlap": ([u[4:64], u[:8]], False),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, (arrays, want) in cases.items():
            assert disjoint(arrays) is want, name
            assert disjoint(iter(arrays)) is want, name  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        disjoint(5)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- served loads


# the served attacks use the earlier red team's module server and client pair
shared_srv = first_team.shared_srv
clients = first_team.clients


def test_outs_sharing_one_buffer_never_reach_a_direct_run(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("run-alias")
    tokens, _ = _put_on_disk(plain, ns, 900)
    lk = _lookup(mine, ns, tokens)
    outs = _aligned()
    # the module's server counts every test's direct loads: compare with before this load
    before = mine.counters.direct_loads
    with pytest.raises(InvalidArgument, match="share memory"):
        mine.load(lk, [outs[0], outs[1], outs[0]])
    assert mine.counters.direct_loads == before


def test_a_frame_offset_past_what_the_extension_takes_is_typed_or_loaded_by_the_server(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("run-overflow")
    tokens, chunks = _put_on_disk(plain, ns, 910)
    lk = _lookup(mine, ns, tokens)
    fs = [f for f in lk.frames if f is not None]
    huge = 1 << 63  # a multiple of 4096, a uint64 on the wire
    with pytest.raises(ProtocolError):
        client_direct.parse_frames([[fs[0].path, fs[0].seg, huge, fs[0].header]], [lk.hits[0].key])
    bad = [fs[0], dataclasses.replace(fs[1], off=huge), fs[2]]
    try:
        res = mine.load(_with_frames(lk, bad), _aligned())
    except KVLifeError:
        return
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, chunks)


def test_two_threads_sharing_one_client_keep_their_own_bytes_and_count_once(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    prompts = [_put_on_disk(plain, _ns(f"run-share-{k}"), 920 + k) for k in range(2)]
    lookups = [_lookup(mine, _ns(f"run-share-{k}"), prompts[k][0]) for k in range(2)]
    before = mine.counters
    fallbacks = mine.direct_fallbacks()
    errors: list[BaseException] = []
    rounds = 10

    def loads(k: int) -> None:
        try:
            for _ in range(rounds):
                res = mine.load(lookups[k], _aligned())
                assert res.loaded == CHUNKS
                _check_prefix(res.arrays, prompts[k][1])
        except BaseException as exc:  # reported below
            errors.append(exc)

    ts = [threading.Thread(target=loads, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    after = mine.counters
    direct = after.direct_loads - before.direct_loads
    assert direct + mine.direct_fallbacks() - fallbacks == 2 * rounds * CHUNKS
    assert after.tier("disk").loaded - before.tier("disk").loaded == 2 * rounds * CHUNKS
    assert direct == 2 * rounds * CHUNKS  # nothing moved: every chunk kept from here


def test_a_reconnect_between_lookup_and_load_keeps_nothing_read_here(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("run-reconnect")
    tokens, chunks = _put_on_disk(plain, ns, 930)
    lk = _lookup(mine, ns, tokens)
    with mine._wire.lock:
        mine._wire.drop()  # the next call connects again: another epoch
    before = mine.counters.direct_loads
    fallbacks = mine.direct_fallbacks()
    res = mine.load(lk, _aligned())
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, chunks)
    assert mine.counters.direct_loads == before
    assert mine.direct_fallbacks() - fallbacks == CHUNKS


def test_an_interrupt_in_on_chunk_leaves_the_session_in_step(
    clients: tuple[RemoteStore, RemoteStore],
) -> None:
    plain, mine = clients
    ns = _ns("run-interrupt")
    tokens, chunks = _put_on_disk(plain, ns, 940)
    lk = _lookup(mine, ns, tokens)

    def on_chunk(i: int, arr: np.ndarray | None) -> None:
        if i == 1:
            raise KeyboardInterrupt

    before = mine.counters.direct_loads
    with pytest.raises(KeyboardInterrupt):
        mine._loads.load(lk, _aligned(), "", on_chunk)
    counted = mine.counters.direct_loads - before
    assert counted == CHUNKS  # the server was told what was kept before on_chunk ran
    res = mine.load(_lookup(mine, ns, tokens), _aligned())
    assert res.loaded == CHUNKS
    _check_prefix(res.arrays, chunks)
    assert mine.counters.direct_loads - before == 2 * CHUNKS


def test_a_segment_file_replaced_by_one_holding_other_chunks_frames(tmp_path: Path) -> None:
    srv = _start(tmp_path / "store")
    plain = srv.client()
    mine = RemoteStore(srv.socket, timeout=30, direct_reads=True)
    try:
        ta, chunks = _put_on_disk(plain, _ns("run-victim"), 950)
        tb, _ = _put_on_disk(plain, _ns("run-other"), 951)
        lk = _lookup(mine, _ns("run-victim"), ta)
        other = _lookup(mine, _ns("run-other"), tb)
        mine_fs = [f for f in lk.frames if f is not None]
        other_fs = [f for f in other.frames if f is not None]
        seg = mine_fs[0].path
        data = bytearray(Path(seg).read_bytes())
        span = HEADER_BYTES + mine_fs[0].nbytes
        for f, g in zip(mine_fs, other_fs, strict=True):
            assert f.path == g.path and f.nbytes == g.nbytes
            data[f.off : f.off + span] = Path(g.path).read_bytes()[g.off : g.off + span]
        forged = tmp_path / "forged"
        forged.write_bytes(bytes(data))
        os.replace(forged, seg)  # the path now names a file of other chunks' frames
        before = mine.counters.direct_loads
        res = mine.load(lk, _aligned())
        _check_prefix(res.arrays, chunks)  # whatever is handed out is the victim's
        assert mine.counters.direct_loads == before
        assert srv.alive()
    finally:
        for c in (mine, plain):
            with contextlib.suppress(Exception):
                c.close()
        srv.stop()


def test_a_lookup_handed_to_another_client_of_another_server_keeps_no_old_bytes(
    tmp_path: Path,
) -> None:
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
    a = _start(tmp_path / "a" / "store")
    b: ServerProc | None = None
    plain = a.client()
    x = RemoteStore(a.socket, timeout=30, direct_reads=True)
    clients = [plain, x]
    try:
        ns = _ns("run-handed")
        tokens, old = _put_on_disk(plain, ns, 960)
        lk = _lookup(x, ns, tokens)  # x's first connection
        plain.close()
        x.close()
        a.stop()  # its store stays where it was
        b = ServerProc(
            tmp_path / "b" / "store",
            dram=4 * (1 << 20),
            disk=64 * (1 << 20),
            staging=4 * (1 << 20),
            extra=("--write-through", "--no-promote"),
        )
        b.socket = a.socket  # the same socket, another store
        b.start()
        plain = b.client()
        clients.append(plain)
        _, new = _put_on_disk(plain, ns, 961, tokens=tokens)
        assert not any(_same(p, q) for p, q in zip(old, new, strict=True))
        y = RemoteStore(b.socket, timeout=30, direct_reads=True)  # its first connection
        clients.append(y)
        fresh = _lookup(y, ns, tokens)
        named = [(f.seg, f.off) for f in fresh.frames if f is not None]
        assert named == [(f.seg, f.off) for f in lk.frames if f is not None]
        assert fresh.frames[0] is not None and lk.frames[0] is not None
        assert fresh.frames[0].path != lk.frames[0].path
        y2 = RemoteStore(b.socket, timeout=30, direct_reads=True)
        clients.append(y2)
        res = y2.load(lk, _aligned())
        for i, got in enumerate(res.arrays):
            assert not _same(got, old[i]), f"chunk {i}: the old store's bytes kept"
            assert _same(got, new[i])
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
        if b is not None:
            b.stop()
        with contextlib.suppress(Exception):
            a.stop()
