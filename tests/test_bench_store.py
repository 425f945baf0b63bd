"""bench concurrency and bench async run and write JSON of the documented shape (they
are benchmarks: nothing here looks at how fast anything was)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvlife.bench import concurrency, overlap
from tests.helpers.machine import assert_machine_figures


def test_bench_concurrency_quick_writes_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.json"
    argv = ["--quick", "--threads", "1,2", "--dir", str(tmp_path), "--json", str(out)]
    assert concurrency.main(argv) == 0
    printed = capsys.readouterr().out
    assert "raw GB/s" in printed and "machine: memcpy" in printed
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "concurrency"
    assert_machine_figures(doc)
    assert set(doc["targets"]) == {"load_vs_raw_min", "lookup_p99_vs_idle_max"}
    assert [p["threads"] for p in doc["points"]] == [1, 2]
    assert doc["config"]["writer_mb_per_s"] == 64.0  # the writer's pace, a setting
    assert all(p["writer_puts"] >= 2 for p in doc["points"])  # 4 ms apart at 64 MB/s
    for p in doc["points"]:
        assert p["errors"] == [], p["errors"]
        assert p["load_gbps"] > 0 and p["raw_gbps_same_qd"] > 0 and p["lookups"] > 0
        assert {"load_vs_raw", "lookup_p50_us", "lookup_p99_us", "lookup_p99_vs_idle"} <= set(p)
        cpu = p["cpu"]  # the CPU budget (issue 28)
        for who in ("loads", "raw"):
            for k in ("user_us_per_chunk", "system_us_per_chunk", "us_per_chunk", "busy_cpus"):
                assert cpu[f"{who}_{k}"] >= 0, (who, k)
            assert cpu[f"{who}_chunks"] > 0
        assert cpu["loads_us_per_chunk"] > 0 and cpu["hash_us_per_chunk"] > 0
        for k in ("ceiling", "ceiling_available", "loads_allow"):
            assert 0 < cpu[k] <= 1, (k, cpu[k])
        assert 0 <= cpu["ceiling_same_cpu"] <= 1
        assert abs(cpu["load_vs_ceiling"] - p["load_vs_raw"] / cpu["ceiling"]) < 1e-9
        assert cpu["cpus"] == doc["cpus"] >= 1
    assert doc["cpus_available"] > 0 and doc["hash_us_per_chunk"] > 0
    assert "CPU ceiling" in printed
    for p in doc["points"]:  # the paired rounds: raw alone, loads, raw beside a raw writer
        pp = p["paired"]
        assert pp["threads"] == p["threads"] and pp["errors"] == [], pp["errors"]
        assert pp["rounds"] == doc["config"]["rounds"] >= 1
        for k in ("load_gbps", "raw_gbps", "raw_writer_gbps", "writer_bps", "raw_writer_bps"):
            assert len(pp[k]) == pp["rounds"], k
        assert all(x > 0 for x in pp["load_gbps"] + pp["raw_gbps"] + pp["raw_writer_gbps"])
        assert len(set(pp["order"])) == min(2, pp["rounds"])  # the order alternates
        ratios = [a / b for a, b in zip(pp["load_gbps"], pp["raw_gbps"], strict=True)]
        assert min(ratios) <= p["load_vs_raw_paired"] == pp["load_vs_raw"] <= max(ratios)
        assert p["load_vs_raw_writer_paired"] == pp["load_vs_raw_writer"] > 0
        assert p["disk_bytes_written"] >= 0
        # the verified ceiling: the readers' frames read and verified natively, no store
        assert len(pp["verified_gbps"]) == pp["rounds"] and pp["verified_failed"] == 0
        assert all(x > 0 for x in pp["verified_gbps"])
        ratios = [a / b for a, b in zip(pp["verified_gbps"], pp["raw_gbps"], strict=True)]
        assert min(ratios) <= pp["verified_vs_raw"] <= max(ratios)
        ratios = [a / b for a, b in zip(pp["load_gbps"], pp["verified_gbps"], strict=True)]
        assert min(ratios) <= pp["load_vs_verified"] <= max(ratios)
        assert all(o.split(",").count("verified") == 1 for o in pp["order"])
    assert "paired: vs raw / vs raw+writer" in printed and "verified ceiling" in printed
    assert {1, 2} <= {p["queue_depth"] for p in doc["raw"]["points"]}
    audit = doc["audit"]
    assert audit["errors"] == [], audit["errors"]
    assert audit["audits"] >= 1 and audit["rows"] > 0 and audit["lookups"] > 0
    assert {"audit_gbps", "load_gbps", "lookup_p99_us", "lookup_p99_vs_idle"} <= set(audit)
    assert not list(tmp_path.glob(".kvlife-bench-conc-*")), "scratch directory left behind"


def test_bench_concurrency_without_writer_runs(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    argv = ["--quick", "--no-writer", "--threads", "1", "--dir", str(tmp_path), "--json", str(out)]
    assert concurrency.main(argv) == 0
    (p,) = json.loads(out.read_text())["points"]
    assert p["demotions"] == 0 and p["disk_bytes_written"] == 0
    pp = p["paired"]  # no store writer: no raw writer either, raw alone is the limit
    assert pp["writer_bps"] == pp["raw_writer_bps"] == [0.0] * pp["rounds"]
    assert pp["raw_writer_gbps"] == pp["raw_gbps"]
    assert p["load_vs_raw_writer_paired"] == p["load_vs_raw_paired"]


def test_bench_concurrency_rejects_bad_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert concurrency.main(["--quick", "--rounds", "-1"]) == 2
    assert concurrency.main(["--quick", "--slice", "0"]) == 2
    assert concurrency.main(["--quick", "--writer-mbps", "-1"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_bench_concurrency_writer_keeps_its_pace(tmp_path: Path) -> None:
    """At 0.5 MB/s a quick put of 256 KiB is due every 0.52 s: in a point of 0.3 s the
    writer puts once (at its start), however fast the machine; without a pace (0) it
    puts as fast as it can."""
    runs = {}
    for mbps in ("0.5", "0"):
        out = tmp_path / f"w{mbps}.json"
        argv = ["--quick", "--threads", "1,2", "--rounds", "0", "--writer-mbps", mbps]
        assert concurrency.main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["config"]["writer_mb_per_s"] == float(mbps)
        runs[mbps] = [p["writer_puts"] for p in doc["points"]]
    assert all(n <= 1 for n in runs["0.5"]), runs
    assert all(n >= 2 for n in runs["0"]), runs


def test_bench_async_quick_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    assert overlap.main(["--quick", "--dir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "async"
    assert set(doc["seconds"]) == {"load", "compute", "sync", "async"}
    assert all(v > 0 for v in doc["seconds"].values())
    assert doc["async_vs_max"] > 0 and doc["sync_vs_sum"] > 0
    assert not list(tmp_path.glob(".kvlife-bench-async-*"))


def test_the_verified_ceiling_counts_only_frames_that_verify(tmp_path: Path) -> None:
    """The concurrency bench's verified ceiling reads a prompt's own disk frames; a
    frame damaged on the disk since they were named ends that prompt's read: it is
    counted as failed and none of its bytes are counted. Hits that are not on disk
    (DRAM) have no frames: RuntimeError, not a ceiling of something else."""
    from kvlife.bench.concurrency_verified import prompt_frames, verified_slice
    from kvlife.core.identity import PUBLIC, KVLayout, ModelIdentity
    from kvlife.native import frames as native
    from kvlife.store import KVStore
    from kvlife.tiers.buffers import aligned_empty
    from kvlife.tiers.disk.frame import HEADER_BYTES

    if not native.available():
        pytest.skip("the native extension is not built")
    layout = KVLayout(2, 2, 64, "float16", 16)  # 8 KiB chunks: whole pages
    ident = ModelIdentity("ceiling", "w", "t", layout)
    store = KVStore.open(tmp_path / "s", dram_bytes=1 << 20, disk_bytes=64 << 20)
    try:
        rng = np.random.default_rng(3)
        tokens = rng.integers(0, 30000, 3 * 16)
        kv = rng.standard_normal((2, 2, 2, 3 * 16, 64)).astype(np.float16)
        store.put_prompt(ident, PUBLIC, tokens, kv)
        with pytest.raises(RuntimeError, match="not exact disk frames"):
            prompt_frames(store, ident, [tokens])  # still in DRAM only
        store.flush()
        store.evict("dram", 1 << 40)
        (frames,) = prompt_frames(store, ident, [tokens])
        assert len(frames) == 3
        room = aligned_empty(3 * layout.chunk_nbytes)
        n = layout.chunk_nbytes
        outs = [
            room[i * n : (i + 1) * n].view(np.float16).reshape(layout.chunk_shape) for i in range(3)
        ]
        gbps, failed = verified_slice([[frames]], [outs], 0.05)
        assert gbps > 0 and failed == 0
        for i, out in enumerate(outs):
            assert np.array_equal(out, kv[:, :, :, i * 16 : (i + 1) * 16])
        at = frames[1].off + HEADER_BYTES + 7  # one byte of chunk 1's payload
        with open(frames[1].path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        gbps, failed = verified_slice([[frames]], [outs], 0.05)
        # each pass: chunk 0 verified and counted, chunk 1 failed, chunk 2 after it
        # not counted either
        assert gbps > 0 and failed > 0 and failed % 2 == 0
    finally:
        store.close(flush=False)
