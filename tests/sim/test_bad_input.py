"""Impossible configurations and requests raise typed errors that name what was wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError
from kvlife.sim import ftl_kernels as fk
from kvlife.sim.cxl import CXLDramConfig, CXLSSDConfig
from kvlife.sim.device import MemoryConfig
from kvlife.sim.errors import (
    DeviceConfigError,
    DeviceFullError,
    RequestError,
    TraceFormatError,
    UnknownCellTypeError,
)
from kvlife.sim.kvstream import KVStream, SyntheticKVConfig, mooncake_stream, read_mooncake
from kvlife.sim.lifetime_hints import run_lifetime_hints
from kvlife.sim.network import NetworkLinkConfig
from kvlife.sim.ssd import CellType, Ftl, GcPolicy, NandTiming, SSDConfig, SSDModel
from kvlife.sim.validation import greedy_waf_closed_form

OK: dict[str, Any] = {"n_blocks": 64, "op": 0.5, "page_bytes": 4096, "block_bytes": 16 * 4096}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"op": 0.0}, "op"),
        ({"op": -0.1}, "op"),
        ({"op": float("nan")}, "op"),
        ({"n_blocks": 0}, "n_blocks"),
        ({"n_blocks": -3}, "n_blocks"),
        ({"page_bytes": 8192, "block_bytes": 4096}, "larger than block_bytes"),
        ({"block_bytes": 16 * 4096 + 100}, "whole number of pages"),
        ({"page_bytes": 0}, "page_bytes"),
        ({"n_channels": 0}, "n_channels"),
        ({"dies_per_channel": 0}, "dies_per_channel"),
        ({"n_streams": 0}, "n_streams"),
        ({"gc_reserve_blocks": 0}, "gc_reserve_blocks"),
        ({"channel_bytes_per_s": 0.0}, "channel_bytes_per_s"),
        ({"controller_overhead_s": -1e-6}, "controller_overhead_s"),
        ({"die_block_pages": 0}, "die_block_pages"),
        ({"gc_policy": "greedy"}, "gc_policy"),
        ({"timing": (1, 2, 3)}, "timing"),
        # 64 blocks at OP 0.01 leave no spare block for GC at all.
        ({"op": 0.01}, "over-provisioning too small"),
        # 8 streams hold 16 open blocks: more than the 21 spare blocks allow with reserve.
        ({"op": 0.5, "n_streams": 11}, "over-provisioning too small"),
        ({"n_blocks": 1 << 20, "block_bytes": 4096 * 4096}, "limit"),
    ],
)
def test_impossible_ssd_configs(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(DeviceConfigError, match=match):
        SSDConfig(**{**OK, **changes})


def test_config_errors_are_value_errors_and_kvlife_errors() -> None:
    with pytest.raises(ValueError):
        SSDConfig(**{**OK, "op": 0})
    with pytest.raises(KVLifeError):
        SSDConfig(**{**OK, "op": 0})


def test_unknown_cell_types() -> None:
    with pytest.raises(UnknownCellTypeError, match=r"'plc'.*slc, mlc, tlc, qlc"):
        CellType.from_name("plc")
    with pytest.raises(UnknownCellTypeError):
        SSDConfig(**{**OK, "cell": "tlc"})
    assert CellType.from_name(" QLC ") is CellType.QLC
    assert issubclass(UnknownCellTypeError, DeviceConfigError)


def test_unknown_gc_policy_and_bad_timing() -> None:
    with pytest.raises(DeviceConfigError, match="unknown GC policy 'fifo'"):
        GcPolicy.from_name("fifo")
    with pytest.raises(DeviceConfigError, match="program_s"):
        NandTiming(read_s=1e-5, program_s=0.0, erase_s=1e-3)
    with pytest.raises(DeviceConfigError, match="op"):
        SSDConfig.for_logical_pages(1000, 64, 0.0)
    with pytest.raises(DeviceConfigError, match="over-provisioning"):
        greedy_waf_closed_form(0.0)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: MemoryConfig(latency_s=0.0), "latency_s"),
        (lambda: MemoryConfig(bandwidth_bytes_per_s=float("inf")), "bandwidth"),
        (lambda: CXLDramConfig(latency_s=-1.0), "latency_s"),
        (lambda: CXLSSDConfig(cache_bytes=0), "cache_bytes"),
        (lambda: CXLSSDConfig(cache_bytes=1024, cache_page_bytes=4096), "larger than"),
        (lambda: CXLSSDConfig(flash_read_s=0.0), "flash_read_s"),
        (lambda: NetworkLinkConfig(bandwidth_bytes_per_s=0.0), "bandwidth"),
        (lambda: NetworkLinkConfig(rtt_s=-1e-6), "rtt_s"),
        (lambda: SyntheticKVConfig(capacity_pages=0), "capacity_pages"),
        (lambda: SyntheticKVConfig(fresh_fraction=1.5), "fresh_fraction"),
        (lambda: SyntheticKVConfig(capacity_pages=1000), "quarter of the capacity"),
    ],
)
def test_impossible_other_configs(factory: Any, match: str) -> None:
    with pytest.raises(DeviceConfigError, match=match):
        factory()


def test_bad_requests_on_the_ftl() -> None:
    ftl = Ftl(SSDConfig(**OK))
    n = ftl.config.logical_pages
    with pytest.raises(RequestError, match="out of range"):
        ftl.write(0.0, [n])
    with pytest.raises(RequestError, match="out of range"):
        ftl.trim([-1])
    with pytest.raises(RequestError, match="stream 1 out of range"):
        ftl.write(0.0, [0], stream=1)
    with pytest.raises(RequestError, match="1-D"):
        ftl.read(0.0, np.zeros((2, 2), dtype=np.int64))
    assert ftl.counters().host_page_writes == 0  # nothing happened


def test_writing_past_logical_capacity_raises() -> None:
    dev = SSDModel(SSDConfig(**OK))
    dev.write(0.0, dev.capacity_bytes - 4096, key=1)
    with pytest.raises(DeviceFullError, match="key 2 needs 2 more pages but only 1"):
        dev.write(0.0, 8192, key=2)
    assert dev.free_bytes() == 4096  # the failed write took nothing
    with pytest.raises(RequestError, match="stream"):
        dev.write_hinted(0.0, 4096, key=3, hint=5)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp"),
        (
            '{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}',
            "input_length",
        ),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1.5]}', "hash_ids"),
    ],
)
def test_malformed_trace_lines(tmp_path: Path, line: str, match: str) -> None:
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]})
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=f"bad.jsonl:2: .*{match}"):
        read_mooncake(p)


def test_trace_time_going_backwards_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    rec = {"input_length": 1, "output_length": 1, "hash_ids": [0]}
    p.write_text(json.dumps({**rec, "timestamp": 5}) + "\n" + json.dumps({**rec, "timestamp": 4}))
    with pytest.raises(TraceFormatError, match="backwards"):
        read_mooncake(p)
    with pytest.raises(TraceFormatError, match="cannot open"):
        read_mooncake(tmp_path / "missing.jsonl")
    with pytest.raises(DeviceConfigError, match="capacity_pages"):
        mooncake_stream([], capacity_pages=0)


def _stream(kinds: list[int], objs: list[int], n_objects: int) -> KVStream:
    return KVStream(
        name="bad",
        capacity_pages=1024,
        op_kind=np.array(kinds, dtype=np.int8),
        op_time=np.arange(len(kinds), dtype=np.float64),
        op_obj=np.array(objs, dtype=np.int64),
        obj_npages=np.ones(n_objects, dtype=np.int64),
        obj_class=np.zeros(n_objects, dtype=np.int8),
        obj_feature=np.zeros(n_objects, dtype=np.int64),
    )


W, R, D = fk.OP_WRITE, fk.OP_READ, fk.OP_DELETE


@pytest.mark.parametrize(
    ("kinds", "objs", "match"),
    [
        ([W, W], [0, 0], "object 0 written twice"),
        ([W, D, D], [0, 0, 0], "object 0 deleted twice"),
        ([D, W], [0, 0], "op 0 uses object 0 while it is not stored"),
        ([W, D, R], [0, 0, 0], "op 2 uses object 0"),
        ([R], [1], "op 0 uses object 1"),
        ([W], [5], "unknown object"),
    ],
)
def test_malformed_streams_are_refused_before_replay(
    kinds: list[int], objs: list[int], match: str
) -> None:
    s = _stream(kinds, objs, 2)
    with pytest.raises(TraceFormatError, match=match):
        s.check()
    with pytest.raises(TraceFormatError, match=match):
        run_lifetime_hints(s)


def test_stream_arrays_must_agree() -> None:
    with pytest.raises(TraceFormatError, match="differ in length"):
        KVStream(
            name="bad",
            capacity_pages=8,
            op_kind=np.zeros(2, dtype=np.int8),
            op_time=np.zeros(1),
            op_obj=np.zeros(2, dtype=np.int64),
            obj_npages=np.ones(1, dtype=np.int64),
            obj_class=np.zeros(1, dtype=np.int8),
            obj_feature=np.zeros(1, dtype=np.int64),
        )
    with pytest.raises(TraceFormatError, match="non-decreasing"):
        KVStream(
            name="bad",
            capacity_pages=8,
            op_kind=np.zeros(2, dtype=np.int8),
            op_time=np.array([1.0, 0.0]),
            op_obj=np.zeros(2, dtype=np.int64),
            obj_npages=np.ones(1, dtype=np.int64),
            obj_class=np.zeros(1, dtype=np.int8),
            obj_feature=np.zeros(1, dtype=np.int64),
        )
    with pytest.raises(RequestError, match="no operations"):
        run_lifetime_hints(_stream([], [], 1))
