"""``kvlife report``: the JSON shape and invariants of one run, on a trace written here and
on a slice of the Mooncake trace (when ../shared/traces has it), the cluster mode, the
lifecycle analysis, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlife.cli import main as kvlife_main
from kvlife.core.errors import InvalidArgument
from kvlife.core.events import LifecycleEvent
from kvlife.replay.cache import CacheSim
from kvlife.replay.ops import OpsRecorder, OpsStreamError, split_requests
from kvlife.reporting.cli import main as report_main
from kvlife.reporting.cli import parse_bytes
from kvlife.reporting.cluster import ClusterConfig, route, run_cluster
from kvlife.reporting.lifecycle import LifecycleAnalysis
from kvlife.trace.importers import read_mooncake
from kvlife.trace.model import TraceBuilder

MOONCAKE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")


def write_trace(path: Path, convs: int = 40, turns: int = 5, seed: int = 0) -> Path:
    """A Mooncake-format trace: conversations that extend their own prefix each turn,
    all starting with one shared system block (id 0)."""
    rng = np.random.default_rng(seed)
    next_id = 1
    rows = []
    for c in range(convs):
        chain = [0]
        t0 = float(rng.uniform(0, 60_000))
        for k in range(turns):
            grow = int(rng.integers(1, 4))
            chain += list(range(next_id, next_id + grow))
            next_id += grow
            rows.append(
                (
                    t0 + k * 20_000.0 + c,
                    len(chain) * 512 - 100,
                    int(rng.integers(1, 300)),
                    list(chain),
                )
            )
    rows.sort(key=lambda r: r[0])
    with path.open("w") as fh:
        for ts, inp, out, ids in rows:
            fh.write(
                json.dumps(
                    {
                        "timestamp": int(ts),
                        "input_length": inp,
                        "output_length": out,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )
    return path


def run_report(tmp_path: Path, trace: Path, *extra: str) -> tuple[dict[str, Any], str]:
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    rc = kvlife_main(
        ["report", "--trace", str(trace), "--json", str(out_json), "--html", str(out_html), *extra]
    )
    assert rc == 0
    return json.loads(out_json.read_text()), out_html.read_text()


def check_host(h: dict[str, Any]) -> None:
    hits = h["hits"]
    # every prefix hit is served by exactly one tier
    assert sum(hits["per_tier"].values()) == hits["prefix_hits"]
    assert 0 <= hits["prefix_hits"] <= hits["block_touches"]
    assert hits["prefix_hits"] + hits["computed_blocks"] == hits["block_touches"]
    ssd = h["ssd"]
    assert ssd["waf"] >= 1.0
    assert ssd["nand_unit_writes"] == ssd["host_unit_writes"] + ssd["gc_copies"]
    # every block written to the SSD tier reached the FTL, in mapping units
    assert ssd["host_unit_writes"] * ssd["unit_bytes"] == h["bytes"]["written"]["ssd"]
    assert h["amplification"]["ssd_waf"] == ssd["waf"]
    for key in ("ttft_s", "tpot_s"):
        p = h["latency"][key]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
    assert h["faults"]["wrong_blocks_served"] == 0
    assert all(u >= 0 for u in h["utilisation"].values())


def test_report_on_a_small_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    r, page = run_report(
        tmp_path,
        trace,
        "--dram",
        "1GiB",
        "--ssd",
        "4GiB",
        "--remote",
        "8GiB",
        "--tenants",
        "user",
        "--tenant-shares",
        "equal",
        "--fdp",
    )
    assert r["kind"] == "kvlife.report"
    h = r["host"]
    check_host(h)
    assert h["hits"]["per_tier"]["ssd"] > 0  # the tiny DRAM pushes reuse down to the SSD
    assert h["hits"]["per_tier"]["remote"] == h["remote"]["hits"]
    assert h["ssd"]["streams"] == 4
    assert h["isolation"]["tenants"] == 4
    assert set(h["tenant_shares"]) == {"dram", "disk"}
    lc = r["lifecycle"]["replay"]
    assert set(lc["classes"]) <= {"pos0", "pos1-3", "pos4-15", "pos16+"}
    assert "verdict" in lc["stability"]
    assert page.count("data:image/png;base64,") >= 3


def test_faults_cut_prefixes_and_are_counted(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    base, _ = run_report(tmp_path, trace, "--dram", "1GiB", "--ssd", "4GiB", "--remote", "8GiB")
    r, _ = run_report(
        tmp_path, trace, "--dram", "1GiB", "--ssd", "4GiB", "--remote", "8GiB", "--fault-rate", "1"
    )
    h = r["host"]
    check_host(h)
    f = h["faults"]
    # every SSD or remote read fails: only DRAM serves, and what was lost is recomputed
    assert h["hits"]["per_tier"]["ssd"] == h["hits"]["per_tier"]["remote"] == 0
    lost = base["host"]["hits"]["per_tier"]["ssd"] + base["host"]["hits"]["per_tier"]["remote"]
    assert sum(f["recomputed_blocks"].values()) == lost > 0
    assert f["injected"] == f["detected"]
    assert f["wrong_blocks_served"] == 0


@pytest.mark.skipif(not MOONCAKE.exists(), reason="needs ../shared/traces")
def test_report_on_a_mooncake_slice(tmp_path: Path) -> None:
    r, page = run_report(
        tmp_path,
        MOONCAKE,
        "--max-requests",
        "300",
        "--dram",
        "8GiB",
        "--ssd",
        "32GiB",
        "--remote",
        "64GiB",
    )
    h = r["host"]
    check_host(h)
    assert h["trace"]["requests"] == 300
    assert h["ssd"]["gc_runs"] > 0  # the small SSD is overwritten: GC runs
    assert "<img" in page


def test_cluster_mode(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    r, page = run_report(
        tmp_path,
        trace,
        "--cluster",
        "4",
        "--cluster-dram",
        "2GiB",
        "--shared",
        "16GiB",
        "--loads",
        "1,8",
        "--kv-bytes-per-token",
        "131072",
    )
    c = r["cluster"]
    assert c["hosts"] == 4
    assert [d["design"] for d in c["designs"]] == [
        "rdma-pool",
        "cpu-dram-pool",
        "cxl-shared",
        "local-ssd",
    ]
    for d in c["designs"]:
        assert [p["load"] for p in d["points"]] == [1.0, 8.0]
        for p in d["points"]:
            assert sum(p["per_tier_ratio"].values()) == pytest.approx(p["prefix_hit_ratio"])
            assert all(u >= 0 for u in p["utilisation"].values())
        if d["design"] == "local-ssd":
            assert all(p["shared_hit_ratio"] == 0 for p in d["points"])
    assert c["findings"]
    assert "Cluster" in page


def test_affinity_routes_a_conversation_to_one_host(tmp_path: Path) -> None:
    trace = read_mooncake(write_trace(tmp_path / "t.jsonl", convs=12, turns=4))
    hosts = route(trace, ClusterConfig(hosts=8, load_penalty_blocks=0.0), cap_blocks=1000)
    # requests are conversations: each later turn extends an earlier one's blocks
    first_of: dict[int, int] = {}
    offs = trace.offsets.tolist()
    for r in range(trace.n_requests):
        conv = int(trace.blocks[offs[r] + 1])  # the conversation's first own block
        assert hosts[r] == first_of.setdefault(conv, int(hosts[r]))
    rr = run_cluster(trace, ClusterConfig(hosts=8, routing="round-robin", loads=(1.0,)))
    assert rr["routing"]["requests_per_host_max"] <= -(-trace.n_requests // 8)


def test_lifecycle_analysis_of_known_events() -> None:
    def ev(t: float, kind: str, key: str, ns: str = "a", tier: str = "") -> LifecycleEvent:
        return LifecycleEvent(time=t, seq=0, kind=kind, key=key, state="", tier=tier, namespace=ns)

    events = []
    for i in range(160):
        k = f"k{i}"
        short = i % 2 == 0
        t = float(i)
        life = 1.0 if short else 10.0
        events += [
            ev(t, "put", k, "short" if short else "long"),
            ev(t, "write", k, tier="dram"),
            ev(t, "commit", k),
            ev(t, "index", k),
            ev(t + 0.5, "load", k),
            ev(t + life, "evict", k, tier="dram"),
            ev(t + life, "invalidate", k),
            ev(t + life, "delete", k),
        ]
    events.sort(key=lambda e: e.time)
    a = LifecycleAnalysis(lambda _k, e: e.namespace).add_all(events)
    res = a.result()
    short, long_ = res["classes"]["short"], res["classes"]["long"]
    assert short["lives_closed"] == long_["lives_closed"] == 80
    assert short["lifespan_s"]["p50"] == pytest.approx(1.0)
    assert long_["lifespan_s"]["p50"] == pytest.approx(10.0)
    assert short["reuse_count"]["p50"] == 1.0
    assert short["reuse_distance_s"]["p50"] == pytest.approx(0.5)
    assert long_["tier_residency_s"]["dram"]["p50"] == pytest.approx(10.0)
    assert res["stability"]["verdict"].startswith("yes")


def test_a_restart_does_not_restart_a_life() -> None:
    """A store restarted mid-log recovers and re-indexes what it held: the life goes on
    (one life, indexed since its first index), as the demo's log after its restart."""

    def ev(t: float, kind: str) -> LifecycleEvent:
        return LifecycleEvent(time=t, seq=0, kind=kind, key="k", state="", namespace="a")

    moves = [(0, "put"), (1, "commit"), (2, "index"), (10, "load"), (50, "recover"),
             (50, "index"), (60, "load")]  # fmt: skip
    events = [ev(t, k) for t, k in moves]
    # another key's put ends the log at t = 100
    events.append(LifecycleEvent(time=100.0, seq=0, kind="put", key="z", state=""))
    o = LifecycleAnalysis(lambda _k, e: e.namespace).add_all(events).result()["classes"]["a"]
    assert (o["lives_open"], o["lives_closed"]) == (1, 0)
    assert o["open_reuse_count"]["p50"] == 2.0
    assert o["state_s_with_open"] == {
        "tentative": 1.0,
        "committed": 1.0,
        "indexed": 98.0,
        "invalidated": 0.0,
    }


def test_live_event_log_from_the_demo(tmp_path: Path) -> None:
    """The real store of ``kvlife demo --synthetic`` writes an event log; the report
    analyses it beside the replay."""
    log = tmp_path / "events.jsonl"
    assert (
        kvlife_main(
            [
                "demo",
                "--synthetic",
                "--users",
                "3",
                "--turns",
                "2",
                "--dram-mib",
                "32",
                "--dir",
                str(tmp_path / "store"),
                "--events",
                str(log),
            ]
        )
        == 0
    )
    trace = write_trace(tmp_path / "t.jsonl", convs=5, turns=2)
    r, page = run_report(tmp_path, trace, "--dram", "1GiB", "--ssd", "4GiB", "--events", str(log))
    live = r["lifecycle"]["live:events.jsonl"]
    assert live["events"] == sum(1 for _ in log.open())
    assert sum(c["lives_closed"] + c["lives_open"] for c in live["classes"].values()) > 0
    assert "live:events.jsonl" in page


def test_ops_stream_that_does_not_match_raises(tmp_path: Path) -> None:
    trace = read_mooncake(write_trace(tmp_path / "t.jsonl", convs=5, turns=2))
    rec = OpsRecorder()
    run = CacheSim("lru", 4, 8, sink=rec, block_bytes=1).run(trace)
    assert len(split_requests(rec.rows, run)) == trace.n_requests
    with pytest.raises(OpsStreamError):
        split_requests([*rec.rows[:-1], rec.rows[0]], run)


def test_bad_sizes_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgument, match="12 parsecs"):
        parse_bytes("12 parsecs")
    trace = write_trace(tmp_path / "t.jsonl", convs=2, turns=1)
    assert kvlife_main(["report", "--trace", str(trace), "--dram", "lots"]) == 1
    assert "size 'lots'" in capsys.readouterr().err
    assert report_main(["--trace", str(trace), "--dram", "1GiB", "--ssd", "0"]) == 0


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(st.lists(st.integers(0, 30), min_size=0, max_size=8), min_size=1, max_size=25),
    dram=st.integers(0, 6),
    disk=st.integers(0, 10),
)
@example(reqs=[[16, 21, 12, 12]], dram=0, disk=4)
def test_ops_agree_with_the_run_for_any_trace(reqs: list[list[int]], dram: int, disk: int) -> None:
    """Whatever the requests and capacities, the moves cut per request add up to the
    run's own counts (loads from the SSD, promotions, demotions, placements)."""
    if dram + disk == 0:
        dram = 1
    b = TraceBuilder("hyp", 16)
    # prefix-chained ids: a block's id names its whole prefix, one id per prefix (a hash
    # cut to 16 bits gave two prefixes of one request the same id: [[16, 21, 12, 12]])
    prefix_ids: dict[tuple[int, ...], int] = {}
    for i, ids in enumerate(reqs):
        chain = [
            prefix_ids.setdefault(tuple(ids[: k + 1]), len(prefix_ids)) for k in range(len(ids))
        ]
        b.add(float(i), 16 * len(chain), 1, chain)
    trace = b.build()
    rec = OpsRecorder()
    run = CacheSim("lru", dram, disk, sink=rec, block_bytes=1).run(trace)
    ops = split_requests(rec.rows, run)
    assert len(ops) == trace.n_requests
    for r, o in enumerate(ops):
        assert len(o.disk_reads) == int(run.prefix_disk[r])
        assert o.promotions == int(run.promoted[r])
        assert len(o.demotions) == int(run.demoted[r])
        assert o.dram_new + len(o.disk_new) == int(run.new[r])


def _store_workload(store: Any, ns: Any) -> None:
    """Three 2-chunk prompts put, each loaded twice, the first one invalidated."""
    from tests.conftest import prompt_kv, tiny_identity

    ident = tiny_identity()
    prompts = [prompt_kv(seed, 32) for seed in range(3)]
    for tokens, kv in prompts:
        store.put_prompt(ident, ns, tokens, kv)
    for _ in range(2):
        for tokens, _kv in prompts:
            store.load(store.lookup(ident, ns, tokens))
    first = store.lookup(ident, ns, prompts[0][0]).hits[0].key
    assert store.invalidate(prefix=first) == 2


def test_live_logs_of_each_source_side_by_side(tmp_path: Path) -> None:
    """Two live logs, one written through the vLLM connector's store opener
    (``kvlife.events``) and one as ``kvlife demo --events`` writes it, each labelled,
    beside the replay: the same figures per source in the JSON and in one HTML table;
    the time in each state adds up to the lives' spans; bad ``--events`` fail first."""
    from kvlife.core.events import JsonlSink
    from kvlife.core.identity import PUBLIC, Namespace
    from kvlife.engines.vllm.stores import StoreAddress, open_store
    from kvlife.store import KVStore

    conn_log, demo_log = tmp_path / "conn.jsonl", tmp_path / "demo.jsonl"
    lease = open_store(
        StoreAddress.from_extra_config(
            {"kvlife.path": str(tmp_path / "kv1"), "kvlife.events": str(conn_log)}
        )
    )
    _store_workload(lease.store, PUBLIC)
    lease.release()
    sink = JsonlSink(demo_log)
    store = KVStore.open(tmp_path / "kv2", dram_bytes=1 << 22, disk_bytes=1 << 24, sink=sink)
    _store_workload(store, Namespace.parse("organisation:acme"))
    store.close()
    sink.close()

    trace = write_trace(tmp_path / "t.jsonl", convs=5, turns=2)
    args = ["--dram", "1GiB", "--ssd", "4GiB"]
    r, page = run_report(
        tmp_path, trace, *args, "--events", f"vllm={conn_log}", "--events", f"hf={demo_log}"
    )
    assert list(r["lifecycle"]) == ["replay", "live:vllm", "live:hf"]
    for name in ("live:vllm", "live:hf"):
        o = r["lifecycle"][name]["overall"]
        assert (o["lives_closed"], o["lives_open"]) == (2, 4)
        assert o["reuse_count"]["p50"] == o["open_reuse_count"]["p50"] == 2.0
        assert o["reused_share_with_open"] == 1.0
        assert o["reuse_distance_s"]["count"] == 12  # 6 lives x 2 loads, open ones too
        # a life's time in its states adds up to its lifespan (closed) or its age (open)
        spans = o["lifespan_s"]["mean"] * 2 + o["open_age_s"]["mean"] * 4
        assert sum(o["state_s_with_open"].values()) == pytest.approx(spans)
        assert o["state_s_with_open"]["invalidated"] >= 0
    assert list(r["lifecycle"]["live:hf"]["classes"]) == ["organisation:acme"]
    head = "<tr><th>figure</th><th>replay</th><th>live:vllm</th><th>live:hf</th></tr>"
    assert "Lifecycle by source" in page and head in page

    with pytest.raises(InvalidArgument, match="given twice"):
        report_main(
            ["--trace", str(trace), "--events", f"a={conn_log}", "--events", f"a={demo_log}"]
        )
    with pytest.raises(InvalidArgument, match="not a file"):
        report_main(["--trace", str(trace), "--events", str(tmp_path / "missing.jsonl")])
