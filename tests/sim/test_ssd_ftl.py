"""Behaviour of the page-mapped FTL: invariants under random operations, streams, timing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlife.sim.ssd import Ftl, GcPolicy, NandTiming, SSDConfig, SSDModel

# A tiny device: 24 blocks of 4 pages, 50% over-provisioning (64 logical pages), 3 streams.
TINY = SSDConfig(
    n_blocks=24,
    op=0.5,
    page_bytes=4096,
    block_bytes=4 * 4096,
    n_streams=3,
    n_channels=2,
    dies_per_channel=2,
)

op_strategy = st.tuples(
    st.sampled_from(["write", "write", "write", "trim", "read"]),
    st.lists(st.integers(0, TINY.logical_pages - 1), min_size=1, max_size=6),
    st.integers(0, TINY.n_streams - 1),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_strategy, min_size=1, max_size=120),
    policy=st.sampled_from(list(GcPolicy)),
)
def test_random_operations_keep_every_invariant(
    ops: list[tuple[str, list[int], int]], policy: GcPolicy
) -> None:
    ftl = Ftl(replace(TINY, gc_policy=policy))
    live: set[int] = set()
    stream_of: dict[int, int] = {}
    t = 0.0
    all_lpns = np.arange(TINY.logical_pages)
    for kind, lpns, stream in ops:
        t += 1e-3
        if kind == "write":
            done = ftl.write(t, lpns, stream)
            assert done >= t
            live.update(lpns)
            stream_of.update({lpn: stream for lpn in lpns})
        elif kind == "trim":
            ftl.trim(lpns)
            live.difference_update(lpns)
        else:
            assert ftl.read(t, lpns) >= t
        # Every live LBA maps to exactly one valid physical page, valid counts match, ...
        assert ftl.audit() == []
        # ... trimmed (and never written) LBAs read as unmapped ...
        mapped = ftl.mapped(all_lpns)
        assert set(np.flatnonzero(mapped).tolist()) == live
        assert ftl.live_pages == len(live)
        # ... and NAND writes never fall below host writes.
        c = ftl.counters()
        assert c.nand_page_writes >= c.host_page_writes
        assert c.nand_page_writes == c.host_page_writes + c.gc_copies
    # Streams stay apart, even after GC moved pages: a block holds one stream's data.
    if live:
        lpns_live = np.array(sorted(live))
        blocks = ftl.placement(lpns_live)
        owners = ftl.block_stream(blocks)
        assert owners.tolist() == [stream_of[lpn] for lpn in lpns_live.tolist()]


def test_sequential_overwrites_need_no_copies() -> None:
    cfg = SSDConfig(n_blocks=256, op=0.1, page_bytes=4096, block_bytes=64 * 4096)
    ftl = Ftl(cfg)
    ftl.fill_sequential()
    before = ftl.counters()
    for _ in range(3):
        ftl.fill_sequential()
    window = ftl.counters().since(before)
    assert window.gc_events > 0
    assert window.gc_copies == 0
    assert window.waf == 1.0


def test_trim_lowers_write_amplification() -> None:
    cfg = SSDConfig(n_blocks=512, op=0.07, page_bytes=4096, block_bytes=64 * 4096)
    half = cfg.logical_pages // 2

    def waf(trim_half: bool) -> float:
        ftl = Ftl(cfg)
        ftl.fill_sequential()
        if trim_half:
            ftl.trim(np.arange(half, cfg.logical_pages))
        rng = np.random.default_rng(1)
        before = ftl.counters()
        for _ in range(40):
            ftl.write(0.0, rng.integers(0, half, size=2000))
        return ftl.counters().since(before).waf

    with_trim, without = waf(True), waf(False)
    # Trimming half the device doubles the effective spare space: far less copying.
    assert with_trim < 0.6 * without


def _short_and_long_lived_waf(separate: bool, policy: GcPolicy) -> float:
    """Long-lived data with slow random churn, interleaved with a log of short-lived chunks.

    Each step writes one 32-page chunk of short-lived data (trimmed half a ring later) and
    overwrites 8 random long-lived pages. With ``separate`` the short-lived chunks go to
    their own stream.
    """
    cfg = SSDConfig(
        n_blocks=512, op=0.1, page_bytes=4096, block_bytes=64 * 4096, n_streams=2, gc_policy=policy
    )
    n = cfg.logical_pages
    split = int(0.8 * n)
    ftl = Ftl(cfg)
    ftl.write(0.0, np.arange(split))
    rng = np.random.default_rng(3)
    chunk = 32
    ring = np.arange(split, n)
    n_chunks = ring.size // chunk
    lag = n_chunks // 2
    before = ftl.counters()
    for i in range(6000):
        if i == 2000:
            before = ftl.counters()
        c = i % n_chunks
        ftl.write(0.0, ring[c * chunk : (c + 1) * chunk], 1 if separate else 0)
        ftl.write(0.0, rng.integers(0, split, size=8), 0)
        if i >= lag:
            d = (i - lag) % n_chunks
            ftl.trim(ring[d * chunk : (d + 1) * chunk])
    assert ftl.audit() == []
    return ftl.counters().since(before).waf


def test_separating_short_lived_data_into_its_own_stream_lowers_waf() -> None:
    separate = _short_and_long_lived_waf(True, GcPolicy.GREEDY)
    mixed = _short_and_long_lived_waf(False, GcPolicy.GREEDY)
    assert separate < 0.85 * mixed


def test_cost_benefit_beats_greedy_when_lifetimes_are_mixed() -> None:
    greedy = _short_and_long_lived_waf(False, GcPolicy.GREEDY)
    cost_benefit = _short_and_long_lived_waf(False, GcPolicy.COST_BENEFIT)
    assert cost_benefit < 0.95 * greedy


def test_runs_are_deterministic() -> None:
    cfg = SSDConfig(n_blocks=128, op=0.2, page_bytes=4096, block_bytes=32 * 4096)
    results = []
    for _ in range(2):
        ftl = Ftl(cfg)
        ftl.fill_sequential()
        ftl.write_uniform_random(5 * cfg.logical_pages, seed=7)
        results.append((ftl.counters(), ftl.erase_counts().tolist()))
    assert results[0] == results[1]


def test_idle_device_latencies_follow_the_timing_model() -> None:
    timing = NandTiming(read_s=50e-6, program_s=500e-6, erase_s=3e-3)
    cfg = SSDConfig(
        n_blocks=64,
        op=0.5,
        page_bytes=16384,
        block_bytes=16 * 16384,
        timing=timing,
        channel_bytes_per_s=1.6384e9,  # one 16 KiB page in 10 us
        controller_overhead_s=5e-6,
        n_channels=2,
        dies_per_channel=2,
    )
    ftl = Ftl(cfg)
    xfer = 10e-6
    assert ftl.write(1.0, [0]) - 1.0 == pytest.approx(xfer + 500e-6 + 5e-6)
    assert ftl.read(2.0, [0]) - 2.0 == pytest.approx(50e-6 + xfer + 5e-6)
    # An unmapped page costs only the controller.
    assert ftl.read(3.0, [1]) - 3.0 == pytest.approx(5e-6)
    # Four pages on four dies are programmed in parallel; the two channels each carry
    # two transfers back to back.
    assert ftl.write(4.0, [4, 5, 6, 7]) - 4.0 == pytest.approx(2 * xfer + 500e-6 + 5e-6)
    # A read queued behind a program on the same die waits for it.
    t = 5.0
    ftl.write(t, [8])  # page 8 lands on the next die in the stripe
    wait = ftl.read(t, [8]) - t
    assert wait == pytest.approx(xfer + 500e-6 + 50e-6 + xfer + 5e-6)


def test_gc_shows_up_in_read_tail_latency() -> None:
    """Same write and read load; less over-provisioning means more GC and a worse read P99."""

    def read_p99(op: float) -> tuple[float, float]:
        cfg = replace(SSDConfig.for_logical_pages(16384, 64, op), n_channels=2, dies_per_channel=4)
        dev = SSDModel(cfg)
        rng = np.random.default_rng(5)
        n_keys = cfg.logical_pages // 4 - 8
        t = 0.0
        for k in range(n_keys):
            t = dev.write(t, 4 * cfg.page_bytes, k)
        # Steady mixed load: one 4-page overwrite and one 1-page read every 3 ms.
        for _ in range(6000):
            t += 3e-3
            dev.write(t, 4 * cfg.page_bytes, int(rng.integers(n_keys)))
            dev.read(t, cfg.page_bytes, int(rng.integers(n_keys)))
        s = dev.stats()
        return s.read_latency.p99_s, s.ftl.gc_time_s

    p99_low, gc_low = read_p99(0.07)
    p99_high, gc_high = read_p99(1.0)
    assert gc_low > 2 * gc_high
    assert p99_low > 1.5 * p99_high


def test_ssd_model_keys_overwrite_in_place_and_trim_frees_space() -> None:
    cfg = SSDConfig(n_blocks=64, op=0.5, page_bytes=4096, block_bytes=16 * 4096)
    dev = SSDModel(cfg)
    cap = dev.capacity_bytes
    dev.write(0.0, 10 * 4096, key=1)
    assert dev.stored_bytes(1) == 10 * 4096
    assert dev.free_bytes() == cap - 10 * 4096
    dev.write(0.1, 3 * 4096 + 1, key=1)  # shrinks to 4 pages
    assert dev.stored_bytes(1) == 4 * 4096
    assert dev.free_bytes() == cap - 4 * 4096
    s = dev.stats()
    assert s.ftl.host_page_writes == 14
    assert s.ftl.trimmed_pages == 6
    assert s.live_pages == 4
    dev.trim(1)
    dev.trim(1)  # idempotent
    assert dev.free_bytes() == cap
    assert dev.stats().live_pages == 0
    dev.read(0.2, 4096, key=1)  # reading a deleted key reads unmapped space
    assert dev.stats().ftl.unmapped_page_reads == 1
    assert dev.ftl.audit() == []


@pytest.mark.parametrize("policy", list(GcPolicy))
def test_long_random_run_on_tiny_device_collects_garbage_soundly(policy: GcPolicy) -> None:
    ftl = Ftl(replace(TINY, gc_policy=policy))
    rng = np.random.default_rng(11)
    for i in range(3000):
        lpns = rng.integers(0, TINY.logical_pages, size=int(rng.integers(1, 6)))
        if rng.random() < 0.8:
            ftl.write(i * 1e-3, lpns, int(rng.integers(TINY.n_streams)))
        else:
            ftl.trim(lpns)
    c = ftl.counters()
    assert c.gc_events > 100
    assert c.gc_copies > 0
    assert ftl.audit() == []


def _reference_greedy_waf(n_blocks: int, ppb: int, op: float, capacities: float) -> float:
    """A deliberately naive pure-Python greedy FTL (one stream, one reserve block)."""
    physical = n_blocks * ppb
    logical = int(physical / (1 + op))
    l2p = [-1] * logical
    p2l = [-1] * physical
    valid = [0] * n_blocks
    free = list(range(n_blocks))
    sealed: set[int] = set()
    open_blk = {"host": -1, "gc": -1}
    wptr = {"host": 0, "gc": 0}
    counts = {"host": 0, "nand": 0}

    def program(kind: str, lpn: int) -> None:
        if open_blk[kind] < 0:
            open_blk[kind], wptr[kind] = free.pop(0), 0
        b = open_blk[kind]
        ppn = b * ppb + wptr[kind]
        wptr[kind] += 1
        p2l[ppn], l2p[lpn] = lpn, ppn
        valid[b] += 1
        counts["nand"] += 1
        if wptr[kind] == ppb:
            sealed.add(b)
            open_blk[kind] = -1

    def write(lpn: int) -> None:
        if l2p[lpn] >= 0:
            p2l[l2p[lpn]] = -1
            valid[l2p[lpn] // ppb] -= 1
        counts["host"] += 1
        if open_blk["host"] < 0:
            while len(free) <= 1:
                victim = min(sealed, key=lambda b: (valid[b], b))
                sealed.discard(victim)
                for ppn in range(victim * ppb, (victim + 1) * ppb):
                    if p2l[ppn] >= 0:
                        lp, p2l[ppn] = p2l[ppn], -1
                        valid[victim] -= 1
                        program("gc", lp)
                free.append(victim)
        program("host", lpn)

    rng = np.random.default_rng(0)
    for lpn in range(logical):
        write(lpn)
    for lpn in rng.integers(0, logical, size=int(2 * logical)).tolist():
        write(lpn)
    h0, n0 = counts["host"], counts["nand"]
    for lpn in rng.integers(0, logical, size=int(capacities * logical)).tolist():
        write(lpn)
    return (counts["nand"] - n0) / (counts["host"] - h0)


@pytest.mark.parametrize(("ppb", "op"), [(8, 0.1), (16, 0.2)])
def test_matches_a_naive_reference_ftl(ppb: int, op: float) -> None:
    n_blocks = 4096 // ppb
    cfg = SSDConfig(n_blocks=n_blocks, op=op, page_bytes=4096, block_bytes=ppb * 4096)
    ftl = Ftl(cfg)
    ftl.fill_sequential()
    ftl.write_uniform_random(2 * cfg.logical_pages, seed=1)
    before = ftl.counters()
    ftl.write_uniform_random(6 * cfg.logical_pages, seed=2)
    ours = ftl.counters().since(before).waf
    reference = _reference_greedy_waf(n_blocks, ppb, op, capacities=6)
    # Different random streams and tie-breaks: agreement within sampling noise.
    assert ours == pytest.approx(reference, rel=0.02)
