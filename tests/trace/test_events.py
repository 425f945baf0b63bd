"""Lifecycle event schema v1: live store and simulator events validate; files round-trip."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest

from kvlife.core.events import JsonlSink, LifecycleEvent, MemorySink
from kvlife.replay.cache import CacheSim
from kvlife.replay.live import run_live
from kvlife.trace.errors import TraceError
from kvlife.trace.events_io import ParquetSink, read_events
from kvlife.trace.schema import event_schema, validate_event
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace

TRACE = synthetic_trace(SyntheticConfig(seed=1, sessions=25))


def _check_all(events: list[LifecycleEvent]) -> None:
    validator = jsonschema.Draft202012Validator(event_schema())
    assert events
    for e in events:
        d = e.to_dict()
        validator.validate(d)
        validate_event(d)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def _live_events(dram: int, disk: int) -> list[LifecycleEvent]:
    sink = MemorySink()
    run_live(TRACE, "lru", dram, disk, sink=sink)
    return sink.take()


def _sim_events(dram: int, disk: int) -> list[LifecycleEvent]:
    sink = MemorySink()
    CacheSim("lru", dram, disk, sink=sink, block_bytes=256, class_hints=False).run(TRACE)
    return sink.take()


@pytest.mark.parametrize(
    ("dram", "disk"),
    # the disk-tier case replays the most: a long tier (make test-slow)
    [(60, 0), pytest.param(40, 80, marks=pytest.mark.slow)],
)
def test_live_and_simulated_events_follow_schema_and_agree(dram: int, disk: int) -> None:
    live, sim = _live_events(dram, disk), _sim_events(dram, disk)
    _check_all(live)
    _check_all(sim)
    # the same moves, as many of each kind, from the real store and from the simulator
    assert Counter(e.kind for e in sim) == Counter(e.kind for e in live)
    assert {"put", "write", "seal", "commit", "index", "load", "evict", "delete"} <= {
        e.kind for e in sim
    }
    if disk:
        assert Counter(e.reason for e in sim if e.kind == "offload") == Counter(
            e.reason for e in live if e.kind == "offload"
        )


def test_schema_rejects_bad_records() -> None:
    good = LifecycleEvent(time=1.0, seq=1, kind="put", key="ab" * 32, state="tentative")
    validate_event(good.to_dict())
    for field, value in [("kind", "teleport"), ("key", "xyz"), ("seq", 0), ("v", 2)]:
        bad = {**good.to_dict(), field: value}
        with pytest.raises(TraceError, match=field):
            validate_event(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, event_schema())
    with pytest.raises(TraceError, match="missing"):
        validate_event({k: v for k, v in good.to_dict().items() if k != "state"})


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_event_files_round_trip(tmp_path: Path, suffix: str) -> None:
    events = _sim_events(60, 0)
    path = tmp_path / f"events{suffix}"
    sink = ParquetSink(path, row_group=100) if suffix == ".parquet" else JsonlSink(path)
    for e in events:
        sink.emit(e)
    sink.close()
    assert read_events(path) == events


def test_parquet_is_readable_without_kvlife(tmp_path: Path) -> None:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    path = tmp_path / "e.parquet"
    sink = ParquetSink(path)
    for e in _sim_events(60, 0)[:50]:
        sink.emit(e)
    sink.close()
    table = pq.read_table(path)
    assert table.num_rows == 50
    assert table.schema.metadata[b"kvlife.event_schema"] == b"1"
    assert set(table.column("v").to_pylist()) == {1}


def test_reader_refuses_other_versions(tmp_path: Path) -> None:
    rec = LifecycleEvent(time=1.0, seq=1, kind="put", key="ab" * 32, state="tentative")
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({**rec.to_dict(), "v": 2}) + "\n")
    with pytest.raises(TraceError, match="version 2"):
        read_events(path)
