"""The replay engine, report and CLI entry points (synthetic workloads, small)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvlife.bench.replay import main as bench_main
from kvlife.core.errors import InvalidArgument
from kvlife.core.events import MemorySink
from kvlife.replay.cache import CacheRun, CacheSim
from kvlife.replay.cli import replay_main, sweep_main
from kvlife.replay.engine import ComputeModel, Timing, make_device, simulate
from kvlife.replay.runner import ReplayConfig, parse_capacity, replay
from kvlife.trace.model import Trace, TraceBuilder
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace

TRACE = synthetic_trace(SyntheticConfig(seed=4, sessions=80))


def test_parse_capacity() -> None:
    assert parse_capacity("10%", 1000, 64) == 100
    assert parse_capacity("2KiB", 1000, 64) == 32
    assert parse_capacity("1 GB", 1000, 10**6) == 1000
    assert parse_capacity("0", 1000, 64) == 0
    assert parse_capacity("7 blocks", 1000, 64) == 7
    with pytest.raises(InvalidArgument, match="capacity"):
        parse_capacity("lots", 1000, 64)


def test_ttft_by_hand_for_two_requests() -> None:
    b = TraceBuilder("hand", 100)
    b.add(0.0, 300, 10, [1, 2, 3])
    b.add(10.0, 300, 10, [1, 2, 3])  # all three blocks hit
    trace = b.build()
    run = CacheSim("lru", 10).run(trace)
    assert run.prefix_dram.tolist() == [0, 3]
    cm = ComputeModel(prefill_tokens_per_s=100.0, decode_s_per_token=0.01,
                      decode_s_per_context_token=0.0, instances=1)  # fmt: skip
    timing = simulate(trace, run, cm, {"dram": make_device("dram", "dram")}, 1000)
    assert timing.ttft[0] == pytest.approx(3.0)  # 300 tokens at 100 tokens/s
    # 1 token of prefill plus a 3000-byte DRAM read (100 ns + 15 ns)
    assert timing.ttft[1] == pytest.approx(0.01 + 115e-9)
    assert np.allclose(timing.tpot, 0.01)


def test_queueing_on_one_instance() -> None:
    b = TraceBuilder("q", 100)
    for i in range(3):
        b.add(0.0, 100, 1, [10 * i + 1])
    trace = b.build()
    run = CacheSim("lru", 10).run(trace)
    cm = ComputeModel(prefill_tokens_per_s=100.0, instances=1)
    timing = simulate(trace, run, cm, {"dram": make_device("dram", "dram")}, 64)
    assert timing.ttft.tolist() == pytest.approx([1.0, 2.0, 3.0])
    assert timing.queue.tolist() == pytest.approx([0.0, 1.0, 2.0])


def test_replay_report_is_deterministic_and_complete() -> None:
    u = TRACE.n_unique_blocks()
    cfg = ReplayConfig("lru", dram_blocks=u // 10, disk_blocks=u // 4)
    a, b = replay(TRACE, cfg), replay(TRACE, cfg)
    assert np.array_equal(a["_ttft"], b["_ttft"])
    for key in ("block_hit_ratio", "prefix_hit_ratio", "ttft_s", "tpot_s", "tenants",
                "lifespan_s", "reuse_distance_touches", "read_amplification"):  # fmt: skip
        assert key in a
    assert set(a["tiers"]) == {"dram", "disk"}
    assert a["prefix_hit_ratio"] <= a["block_hit_ratio"] <= 1 - u / TRACE.n_touches
    assert a["demotions"] > 0 and a["read_amplification"] > 1.0
    assert set(a["tenants"]) == set(TRACE.tenant_names)
    assert sum(t["requests"] for t in a["tenants"].values()) == TRACE.n_requests
    assert a["ttft_s"]["p50"] <= a["ttft_s"]["p90"] <= a["ttft_s"]["p99"]
    # more cache, fewer tokens to prefill: TTFT does not get worse
    big = replay(TRACE, ReplayConfig("lru", dram_blocks=u))
    assert big["ttft_s"]["mean"] <= a["ttft_s"]["mean"]
    assert big["block_hit_ratio"] == pytest.approx(1 - u / TRACE.n_touches)


def test_cli_replay_writes_json_html_and_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, html, ev = tmp_path / "r.json", tmp_path / "r.html", tmp_path / "e.parquet"
    argv = ["--max-requests", "100", "--policy", "s3fifo", "--dram", "5%", "--disk", "20%",
            "--json", str(out), "--report", str(html), "--events", str(ev), "--live"]  # fmt: skip
    assert replay_main(argv) == 0
    text = capsys.readouterr().out
    assert "usable-prefix hit ratio" in text and "agrees with simulation: True" in text
    data = json.loads(out.read_text())
    assert data["config"]["policy"] == "s3fifo" and data["live"]["agrees"] is True
    assert set(data["sweep"]["curves"]) >= {"lru", "lfu", "s3fifo", "arc", "lifespan"}
    page = html.read_text()
    assert page.count("data:image/png;base64,") == 3
    assert ev.stat().st_size > 0
    assert replay_main(["--dram", "lots"]) == 1


def test_cli_sweep_and_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    argv = ["--max-requests", "200", "--policies", "lru,arc", "--shares", "0.1,0.5",
            "--json", str(out), "--no-peers"]  # fmt: skip
    assert sweep_main(argv) == 0
    data = json.loads(out.read_text())
    lru = data["curves"]["lru"]
    assert lru[0]["block_hit_ratio"] <= lru[1]["block_hit_ratio"] <= data["ideal_hit_ratio"]
    bench = tmp_path / "b.json"
    argv = ["--max-requests", "100", "--repeat", "3", "--json", str(bench)]
    assert bench_main(argv) == 0
    b = json.loads(bench.read_text())
    assert b["decisions"] == "kvlife.placement"  # the figures are the placement engine's
    assert b["repeat"] == 3 and b["policy_only"].keys() == b["full"].keys()
    for fig in b["policy_only"].values():
        assert len(fig["runs_per_cpu_s"]) == len(fig["runs_per_s"]) == 3
        assert fig["block_touches_per_cpu_s"] == max(fig["runs_per_cpu_s"]) > 0
        assert fig["block_touches_per_s"] == max(fig["runs_per_s"]) > 0
        assert min(fig["runs_per_cpu_s"]) <= fig["block_touches_per_cpu_s_median"]
        assert 0 <= fig["hit_ratio"] <= 1
    assert b["full"]["lru"]["block_touches_per_s"] > 0
    assert b["machine"]["python_loop_mips"] > 0 and b["machine"]["cpu_count"] >= 1
    assert "load_average_1m" in b["machine_after"]
    text = capsys.readouterr().out
    assert "touches/CPU-s (best of 3)" in text and "Python loop" in text
    assert bench_main(["--max-requests", "10", "--policies", "lru,nope"]) == 1
    assert bench_main(["--max-requests", "10", "--repeat", "0"]) == 1


def _two_same_requests() -> tuple[Trace, CacheRun]:
    b = TraceBuilder("plan", 100)
    b.add(0.0, 300, 10, [1, 2, 3])
    b.add(10.0, 300, 10, [1, 2, 3])  # all three blocks hit, on the disk tier
    trace = b.build()
    return trace, CacheSim("lru", 0, 10).run(trace)


@pytest.mark.parametrize("block_bytes", [1000, 10 * 10**9])
def test_the_planner_reads_a_prefix_only_when_that_beats_recomputing_it(
    block_bytes: int,
) -> None:
    """300 tokens take 3 s to prefill. Three 1 kB blocks read in microseconds from the
    NVMe model: loaded, as always-load does. Three 10 GB blocks take 4.6 s: the planner
    recomputes them (3 s), always-load waits for the disk."""
    trace, run = _two_same_requests()
    cm = ComputeModel(prefill_tokens_per_s=100.0, instances=1)

    def timed(planner: bool) -> Timing:
        devices = {"disk": make_device("nvme", "disk")}
        return simulate(trace, run, cm, devices, block_bytes, planner=planner)

    load, plan = timed(False), timed(True)
    read_s = 80e-6 + 3 * block_bytes / 6.5e9
    assert load.ttft[1] == pytest.approx(read_s + 0.01)
    if read_s < 3.0:
        assert plan.declined.tolist() == [0, 0]
        assert plan.ttft[1] == pytest.approx(load.ttft[1])
    else:
        assert plan.declined.tolist() == [0, 3]
        assert plan.ttft[1] == pytest.approx(3.0)


def test_replay_reports_ttft_with_and_without_the_planner() -> None:
    u = TRACE.n_unique_blocks()
    report = replay(
        TRACE, ReplayConfig("lru", dram_blocks=u // 10, disk_blocks=u // 4, planner=True)
    )
    pl = report["planner"]
    assert pl["ttft_s_always_load"] == report["ttft_s"]
    assert 0 <= pl["requests_recomputed"] <= pl["requests_with_prefix"]
    assert pl["ttft_s"]["count"] == TRACE.n_requests


def test_disk_through_the_ftl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--disk-model ftl``: the same cache decisions as the bandwidth model, every block
    the disk tier takes written to the FTL and every disk hit read from it, GC counted
    (``nand = host + GC copies``); events still reach a sink; bad combinations refused."""
    u = TRACE.n_unique_blocks()
    base = ReplayConfig("lru", dram_blocks=u // 20, disk_blocks=u // 8)
    bw = replay(TRACE, base)
    sink = MemorySink()
    ftl = replay(TRACE, replace(base, disk_model="ftl", disk_op=0.1), sink=sink)
    events = sink.take()
    assert events  # the FTL's recorder passes every event on
    for key in ("block_hit_ratio", "prefix_hit_ratio", "tiers", "dropped_blocks"):
        assert ftl[key] == bw[key], key
    d = ftl["disk_ftl"]
    disk = ftl["tiers"]["disk"]
    per_block = ftl["config"]["block_bytes"] // d["unit_bytes"]
    assert d["host_unit_writes"] == disk["bytes_written"] // d["unit_bytes"]
    assert (
        d["reads_under_gc"] + d["reads_clear"] == disk["bytes_read"] // ftl["config"]["block_bytes"]
    )
    assert d["nand_unit_writes"] == d["host_unit_writes"] + d["gc_copies"]
    assert d["gc_copies"] > 0 and d["waf"] > 1.0  # the tier is rewritten: GC runs
    assert per_block >= 1 and ftl["speed"]["ftl_host_unit_writes_per_s"] > 0
    assert ftl["ttft_s"]["mean"] > 0 and ftl["ttft_s"] != bw["ttft_s"]

    out = tmp_path / "r.json"
    argv = ["--max-requests", "300", "--dram", "5%", "--disk", "20%", "--disk-model", "ftl",
            "--disk-drives", "2", "--json", str(out)]  # fmt: skip
    assert replay_main(argv) == 0
    assert "disk FTL: WAF" in capsys.readouterr().out
    assert json.loads(out.read_text())["disk_ftl"]["drives"] == 2
    with pytest.raises(InvalidArgument, match="planner"):
        replace(base, disk_model="ftl", planner=True)
    with pytest.raises(InvalidArgument, match="nvme"):
        replace(base, disk_model="ftl", disk_device="rdma")
    with pytest.raises(InvalidArgument, match="disk model"):
        replace(base, disk_model="flash")
