"""The fault injectors of :mod:`kvlife.faults` themselves: they do what they promise.

FaultyIO fails exactly the calls it was armed for (sticky or once, after n), stalls a
call until released (also inside a store's load), and counts; the damage helpers hit
the frames they name; the SIGKILL harness starts, watches and kills a child and reads
its log, and reports a child that ends by itself.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import pytest

from kvlife.faults import crash
from kvlife.faults.crash import AckLog, CrashHarnessError, LogLine, read_log
from kvlife.faults.damage import (
    catalog_file,
    delete_segment,
    scan_frames,
    segment_files,
    swap_frames,
    truncate,
    zero_fill,
)
from kvlife.faults.fileio import FaultyIO, FileOp
from kvlife.store import KVStore
from tests.helpers.workload import (
    KiB,
    MiB,
    assert_served_correctly,
    kv_for_key,
    load_prompt,
    make_prompt,
    put,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _file(tmp_path: Path, io: FaultyIO) -> int:
    fd = io.open(tmp_path / "f", create=True)
    io.pwritev(fd, [np.arange(16, dtype=np.uint8)], 0)
    return fd


def test_sticky_fault_fails_every_call_after_n_until_disarmed(tmp_path: Path) -> None:
    io = FaultyIO()
    fd = _file(tmp_path, io)
    buf = np.zeros(16, dtype=np.uint8)
    io.arm("preadv", errno.EIO, after=2)
    assert io.preadv(fd, [buf], 0) == 16
    assert io.preadv(fd, [buf], 0) == 16
    for _ in range(3):
        with pytest.raises(OSError) as raised:
            io.preadv(fd, [buf], 0)
        assert raised.value.errno == errno.EIO
    assert io.injected == {"preadv": 3}
    io.fdatasync(fd)  # other calls are untouched
    io.disarm()
    assert io.preadv(fd, [buf], 0) == 16
    assert io.calls["preadv"] == 6
    io.close(fd)


def test_one_shot_fault_fails_one_call(tmp_path: Path) -> None:
    io = FaultyIO()
    fd = _file(tmp_path, io)
    io.arm(FileOp.FDATASYNC, errno.ENOSPC, once=True)
    with pytest.raises(OSError) as raised:
        io.fdatasync(fd)
    assert raised.value.errno == errno.ENOSPC
    io.fdatasync(fd)
    assert io.injected == {"fdatasync": 1}
    io.close(fd)


def test_arming_an_unknown_call_is_refused() -> None:
    io = FaultyIO()
    with pytest.raises(ValueError, match="pwrite"):
        io.arm("pwrite", errno.EIO)
    with pytest.raises(ValueError):
        io.stall("read")


def test_stall_blocks_one_call_until_released(tmp_path: Path) -> None:
    io = FaultyIO()
    fd = _file(tmp_path, io)
    stall = io.stall("preadv", after=1)
    buf = np.zeros(16, dtype=np.uint8)
    assert io.preadv(fd, [buf], 0) == 16  # the first call passes
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(io.preadv(fd, [buf], 0)))
    reader.start()
    assert stall.wait_entered(10.0)
    reader.join(0.2)
    assert reader.is_alive() and got == [], "the stalled call did not wait"
    io.fdatasync(fd)  # other calls go on meanwhile
    stall.release()
    reader.join(10.0)
    assert got == [16] and not stall.timed_out
    assert io.preadv(fd, [buf], 0) == 16  # a stall is one call only
    io.close(fd)


def test_stall_times_out_with_an_error(tmp_path: Path) -> None:
    io = FaultyIO()
    fd = _file(tmp_path, io)
    stall = io.stall("fdatasync", timeout_s=0.05)
    with pytest.raises(OSError) as raised:
        io.fdatasync(fd)
    assert raised.value.errno == errno.ETIMEDOUT and stall.timed_out
    io.close(fd)


def test_stall_inside_a_store_load_then_release_serves_correct_bytes(tmp_path: Path) -> None:
    io = FaultyIO()
    store = KVStore.open(tmp_path, dram_bytes=0, disk_bytes=8 * MiB, fileio=io)
    try:
        prompt = next(p for p in (make_prompt(5, i) for i in range(50)) if len(p.keys) >= 3)
        put(store, prompt)
        stall = io.stall("preadv")
        results = []
        loader = threading.Thread(target=lambda: results.append(load_prompt(store, prompt)))
        loader.start()
        assert stall.wait_entered(10.0), "the load never read from disk"
        loader.join(0.2)
        assert loader.is_alive(), "the load finished while its read was stalled"
        stall.release()
        loader.join(10.0)
        assert len(results) == 1 and results[0].complete
        assert_served_correctly(results[0], prompt.keys)
    finally:
        io.disarm()
        store.close()


# ------------------------------------------------------------------ damage


def _built(path: Path) -> list[bytes]:
    store = KVStore.open(
        path, dram_bytes=0, disk_bytes=8 * MiB, segment_bytes=64 * KiB, direct_io=False
    )
    keys: list[bytes] = []
    try:
        for i in range(6):
            p = make_prompt(77, i)
            put(store, p)
            keys.extend(k for k in p.keys if k not in keys)
    finally:
        store.close()
    return keys


def test_scan_frames_finds_every_frame_and_swap_exchanges_them(tmp_path: Path) -> None:
    keys = _built(tmp_path)
    frames = scan_frames(tmp_path)
    assert sorted(f.key for f in frames) == sorted(keys)
    assert catalog_file(tmp_path).exists()
    a, b = (fs := [f for f in frames if f.segment == frames[0].segment])[0], fs[-1]
    swap_frames(a, b, "payloads")
    data = a.segment.read_bytes()
    pa = data[a.payload_offset : a.payload_offset + a.payload_len]
    assert pa == kv_for_key(b.key).tobytes()
    assert [f.key for f in scan_frames(tmp_path)] == [f.key for f in frames]
    swap_frames(a, b, "whole-frames")  # headers now name each other's key
    swapped = [f.key for f in scan_frames(tmp_path) if f.segment == a.segment]
    assert swapped[0] == b.key and swapped[-1] == a.key


def test_truncate_zero_fill_and_delete_lose_the_frames_hit(tmp_path: Path) -> None:
    _built(tmp_path)
    frames = scan_frames(tmp_path)
    segs = segment_files(tmp_path)
    assert len(segs) >= 3
    first = [f for f in frames if f.segment == segs[0]]
    zero_fill(segs[0], first[0].offset, 64)  # the header's magic and key
    truncate(segs[1], 0)
    delete_segment(segs[2])
    left = {f.key for f in scan_frames(tmp_path)}
    lost = {first[0].key} | {f.key for f in frames if f.segment in (segs[1], segs[2])}
    assert left == {f.key for f in frames} - lost


# ------------------------------------------------------------------ SIGKILL harness


def test_harness_kills_a_ready_child_and_reads_its_log(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = crash.start_child(
        "tests.helpers.crash_workload:idle", tmp_path, log, pythonpath=[REPO_ROOT]
    )
    try:
        lines = child.wait_until(lambda ls: LogLine("ready", ()) in ls, timeout_s=60.0)
    finally:
        child.kill()
    assert child.killed_by_signal()
    assert lines == [LogLine("start", ()), LogLine("ready", ())]


def test_harness_reports_a_child_that_ends_by_itself(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = crash.start_child(
        "tests.helpers.crash_workload:exit_early", tmp_path, log, pythonpath=[REPO_ROOT]
    )
    with pytest.raises(CrashHarnessError, match="exited by itself"):
        child.wait_until(lambda ls: False, timeout_s=60.0)
    assert child.kill() == 0 and not child.killed_by_signal()


def test_read_log_ignores_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "log"
    log = AckLog(path)
    log.ack("put 3 0 0 0")
    log.line("gone abcd")
    log.close()
    with path.open("a") as fh:
        fh.write("put 4 0")  # torn by a kill: no newline
    assert read_log(path) == [LogLine("put", ("3", "0", "0", "0")), LogLine("gone", ("abcd",))]
    assert read_log(tmp_path / "absent") == []
    with pytest.raises(ValueError):
        AckLog(tmp_path / "other").line("two\nlines")


def test_a_fault_limited_to_a_file_name_spares_the_others(tmp_path: Path) -> None:
    io = FaultyIO()
    seg = io.open(tmp_path / "seg-00000001.kvs", create=True)
    other = io.open(tmp_path / "superblock", create=True)
    io.arm("fdatasync", errno.EIO, path="seg-*.kvs")
    io.fdatasync(other)
    with pytest.raises(OSError):
        io.fdatasync(seg)
    stall = io.stall("unlink", path="superblock", timeout_s=0.05)
    io.unlink(tmp_path / "seg-00000001.kvs")  # not the stalled name: passes at once
    assert not stall.entered.is_set()
    assert io.injected == {"fdatasync": 1}
    io.close(seg)
    io.close(other)
