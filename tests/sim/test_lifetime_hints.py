"""KV streams (synthetic and Mooncake) and the lifetime-hints experiment."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvlife.sim import ftl_kernels as fk
from kvlife.sim.kvstream import (
    KVClass,
    KVStream,
    MooncakeRequest,
    SyntheticKVConfig,
    mooncake_stream,
    read_mooncake,
    synthetic_stream,
)
from kvlife.sim.lifetime_hints import (
    LIFETIME_EDGES,
    STRATEGIES,
    OnlineLifetimePredictor,
    lifetime_bins,
    main,
    mislabel,
    predictor_streams,
    run_lifetime_hints,
)

TRACE = Path("/work/shared/traces/mooncake_fast25_conversation_trace.jsonl")

SMALL = SyntheticKVConfig(capacity_pages=16384, total_write_pages=6 * 16384, seed=3)


@pytest.fixture(scope="module")
def small_stream() -> KVStream:
    return synthetic_stream(SMALL)


def _check_well_formed(s: KVStream) -> None:
    """Each object written once, deleted at most once and only after its write, read only
    while live; live pages never exceed the capacity."""
    state = np.zeros(s.n_objects, dtype=np.int8)  # 0 unwritten, 1 live, 2 deleted
    for kind, o in zip(s.op_kind.tolist(), s.op_obj.tolist(), strict=True):
        if kind == fk.OP_WRITE:
            assert state[o] == 0
            state[o] = 1
        elif kind == fk.OP_READ:
            assert state[o] == 1
        else:
            assert state[o] == 1
            state[o] = 2
    assert s.max_live_pages() <= s.capacity_pages
    assert np.all(np.diff(s.op_time) >= 0)
    assert np.all(s.obj_npages >= 1)


def test_synthetic_stream_is_well_formed_and_seeded(small_stream: KVStream) -> None:
    _check_well_formed(small_stream)
    again = synthetic_stream(SMALL)
    assert np.array_equal(again.op_obj, small_stream.op_obj)
    assert np.array_equal(again.op_time, small_stream.op_time)
    other = synthetic_stream(
        SyntheticKVConfig(capacity_pages=16384, total_write_pages=16384, seed=4)
    )
    assert not np.array_equal(other.op_obj[:1000], small_stream.op_obj[:1000])
    assert small_stream.host_pages_written >= SMALL.total_write_pages
    # The cache fills and evicts.
    assert small_stream.info["evictions"] > 0
    assert small_stream.max_live_pages() > 0.95 * SMALL.capacity_pages


def test_synthetic_classes_have_different_lifetimes(small_stream: KVStream) -> None:
    lt = small_stream.lifetimes_pages()
    med = {}
    for c in (KVClass.HISTORY, KVClass.FRESH):
        m = (small_stream.obj_class == c) & np.isfinite(lt)
        assert m.any()
        med[c] = float(np.median(lt[m]))
    assert med[KVClass.FRESH] < 0.25 * med[KVClass.HISTORY]
    # System prompts are few, big and rarely deleted.
    sys_mask = small_stream.obj_class == KVClass.SYSTEM
    assert small_stream.obj_npages[sys_mask].min() == SMALL.system_prompt_pages
    assert np.isfinite(lt[sys_mask]).mean() < np.isfinite(lt[~sys_mask]).mean()


def test_mooncake_stream_lru_exact_ops() -> None:
    reqs = [
        MooncakeRequest(0, 1024, 10, (0, 1)),  # writes blocks (0,0) and (1,1)
        MooncakeRequest(1000, 1100, 10, (0, 1, 2)),  # hits both, writes (2,2): 100 tokens
        MooncakeRequest(2000, 1024, 10, (0, 3)),  # hit (0,0), write (1,3) evicting (1,1)
    ]
    # Capacity 9 pages: two full blocks of 4 pages fit, plus the 1-page partial block.
    s = mooncake_stream(reqs, capacity_pages=9, pages_per_block=4)
    ops = list(zip(s.op_kind.tolist(), s.op_obj.tolist(), strict=True))
    w, r, d = fk.OP_WRITE, fk.OP_READ, fk.OP_DELETE
    assert ops == [(w, 0), (w, 1), (r, 0), (r, 1), (w, 2), (r, 0), (d, 1), (w, 3)]
    assert s.obj_npages.tolist() == [4, 4, 1, 4]
    assert s.obj_class.tolist() == [KVClass.SYSTEM, KVClass.FRESH, KVClass.HISTORY, KVClass.FRESH]
    assert s.op_time.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert s.info["hit_ratio"] == pytest.approx(3 / 7)
    _check_well_formed(s)


def test_read_mooncake_parses_and_limits(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 100, "output_length": 5, "hash_ids": [0]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = read_mooncake(p)
    assert reqs == [MooncakeRequest(0, 600, 5, (0, 1)), MooncakeRequest(5, 100, 5, (0,))]
    assert len(read_mooncake(p, max_requests=1)) == 1


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_real_mooncake_trace_lru_hit_ratio() -> None:
    reqs = read_mooncake(TRACE)
    assert len(reqs) == 12031
    unique = len({(i, h) for r in reqs for i, h in enumerate(r.hash_ids)})
    assert unique == 182790
    s = mooncake_stream(reqs, capacity_pages=int(0.1 * unique) * 4)
    assert s.info["block_touches"] == 288500
    # The trace's README: LRU hit ratio 0.278 with 10% of the unique blocks.
    assert s.info["hit_ratio"] == pytest.approx(0.278, abs=0.01)
    assert s.max_live_pages() <= s.capacity_pages


def test_lifetime_bins_and_mislabel() -> None:
    cap = 1600
    lt = np.array([0.0, 99.0, 100.0, 399.0, 400.0, 1599.0, 1600.0, np.inf])
    assert [e * cap for e in LIFETIME_EDGES] == [100.0, 400.0, 1600.0]
    assert lifetime_bins(lt, cap).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    base = np.zeros(20000, dtype=np.int64)
    noisy = mislabel(base, 0.2, 4, seed=1)
    changed = noisy != base
    assert changed.mean() == pytest.approx(0.2, abs=0.01)
    assert set(noisy[changed].tolist()) == {1, 2, 3}
    assert np.array_equal(mislabel(base, 0.0, 4, seed=1), base)


def test_online_predictor_learns_only_from_deaths() -> None:
    pred = OnlineLifetimePredictor(capacity_pages=1600)
    assert pred.predict(5) == len(LIFETIME_EDGES) // 2  # nothing seen yet
    for _ in range(50):
        pred.observe(5, 10.0)
        pred.observe(6, 5000.0)
    assert pred.predict(5) == 0
    assert pred.predict(6) == 3
    assert pred.predict(99) in (1, 2)  # unseen feature: the global mean


def test_predictor_streams_never_look_ahead() -> None:
    # Two objects of one feature: the first is written before anything has died, so it
    # must get the default bin even though it dies quickly.
    s = KVStream(
        name="t",
        capacity_pages=1600,
        op_kind=np.array([fk.OP_WRITE, fk.OP_DELETE, fk.OP_WRITE], dtype=np.int8),
        op_time=np.array([0.0, 1.0, 2.0]),
        op_obj=np.array([0, 0, 1]),
        obj_npages=np.array([1, 1]),
        obj_class=np.array([2, 2], dtype=np.int8),
        obj_feature=np.array([7, 7]),
    )
    assert predictor_streams(s).tolist() == [len(LIFETIME_EDGES) // 2, 0]


def test_oracle_hints_beat_no_hints_and_noise_erodes_them(small_stream: KVStream) -> None:
    res = run_lifetime_hints(small_stream, warmup_capacities=1.0)
    assert [r.strategy for r in res.rows] == list(STRATEGIES)
    single, oracle = res.row("single-stream"), res.row("oracle")
    assert single.streams_used == 1
    assert oracle.waf < single.waf
    assert res.row("oracle-5%-wrong").waf < res.row("oracle-50%-wrong").waf
    assert oracle.gc_time_s < single.gc_time_s
    for r in res.rows:
        assert r.waf >= 1.0
        assert r.host_page_writes > 0
        assert r.read_latency.count > 0
    assert res.conclusion.startswith("Without hints WAF is")
    d = res.to_json()
    json.dumps(d)  # JSON-ready
    assert {"workload", "device", "rows", "conclusion", "lifetime_by_class"} <= set(d)


def test_cli_writes_json_and_report(tmp_path: Path) -> None:
    out, rep = tmp_path / "r.json", tmp_path / "r.html"
    argv = ["--capacity-pages", "8192", "--capacities", "3", "--warmup", "1", "--no-progress"]
    assert main([*argv, "--json", str(out), "--report", str(rep)]) == 0
    d = json.loads(out.read_text())
    assert [r["strategy"] for r in d["rows"]] == list(STRATEGIES)
    assert all({"waf", "gc_time_s", "read_latency"} <= set(r) for r in d["rows"])
    html = rep.read_text()
    assert "data:image/png;base64," in html
    assert rep.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_cli_reads_a_trace(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    rng = np.random.default_rng(0)
    with p.open("w") as fh:
        for i in range(400):
            ids = [0, *rng.integers(1, 3000, size=int(rng.integers(1, 12))).tolist()]
            fh.write(
                json.dumps(
                    {
                        "timestamp": i * 50,
                        "input_length": 512 * len(ids),
                        "output_length": 1,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )
    out = tmp_path / "r.json"
    argv = ["--trace", str(p), "--capacity-pages", "2048", "--warmup", "0.5", "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["workload"] == "mooncake:t.jsonl"
    assert d["workload_info"]["requests"] == 400
