"""Shape of the raw concurrent read limit (never how fast it is: benchmarks are not tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvlife.bench.concurrency_raw import (
    RawConcurrencyResult,
    RawFile,
    RawReadPoint,
    RawSlice,
    measure_raw_concurrency,
)
from kvlife.core.errors import InvalidArgument

KiB = 1 << 10


def _positive_finite(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-supported", "buffered"])
def test_result_has_one_typed_point_per_queue_depth(tmp_path: Path, direct: bool | None) -> None:
    res = measure_raw_concurrency(
        tmp_path,
        file_bytes=1 << 20,
        block_bytes=64 * KiB,
        queue_depths=(1, 4, 16),
        reads_per_point=32,
        direct=direct,
    )
    assert isinstance(res, RawConcurrencyResult)
    assert [p.queue_depth for p in res.points] == [1, 4, 16]
    for p in res.points:
        assert isinstance(p, RawReadPoint)
        assert p.threads == p.queue_depth and p.block_bytes == 64 * KiB
        assert p.reads >= p.threads and p.reads % p.threads == 0
        for x in (p.seconds, p.gbps, p.iops, p.latency_p50_us, p.latency_p99_us):
            assert _positive_finite(x)
        assert p.latency_p99_us >= p.latency_p50_us
    assert res.point(4) is res.points[1]
    with pytest.raises(InvalidArgument, match="not measured"):
        res.point(2)
    if direct is False:
        assert not res.direct_io and "posix_fadvise" in res.note
    doc = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert [p["queue_depth"] for p in doc["points"]] == [1, 4, 16]
    assert not list(tmp_path.iterdir()), "the prepared file is removed"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_bytes": 1000},
        {"file_bytes": 3 * 64 * KiB + 1},
        {"queue_depths": ()},
        {"queue_depths": (0,)},
        {"reads_per_point": 0},
    ],
)
def test_bad_arguments_are_typed_errors(tmp_path: Path, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"file_bytes": 1 << 20, "block_bytes": 64 * KiB} | kwargs
    with pytest.raises(InvalidArgument):
        measure_raw_concurrency(tmp_path, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-supported", "buffered"])
def test_raw_slices_read_for_a_time_with_and_without_a_paced_writer(
    tmp_path: Path, direct: bool | None
) -> None:
    rng = np.random.default_rng(0)
    with RawFile(tmp_path, file_bytes=1 << 20, block_bytes=64 * KiB, direct=direct) as f:
        assert f.path.exists()
        alone = f.read_slice(2, 0.05, rng)
        assert isinstance(alone, RawSlice) and alone.queue_depth == 2
        assert alone.reads > 0 and _positive_finite(alone.gbps)
        assert alone.seconds >= 0.05
        assert alone.write_target_bps == 0 and alone.written_bytes == 0
        beside = f.read_slice(3, 0.1, rng, write_bps=4e6, batch_blocks=2)
        assert beside.reads > 0 and _positive_finite(beside.gbps)
        assert beside.written_bytes > 0 and beside.written_bytes % (2 * 64 * KiB) == 0
        assert _positive_finite(beside.write_bps) and beside.write_target_bps == 4e6
        assert [p.name for p in tmp_path.iterdir()] == [f.path.name], "the writer's file is gone"
    assert not list(tmp_path.iterdir()), "the prepared file is removed"


@pytest.mark.parametrize(
    "kwargs",
    [{"qd": 0}, {"seconds": 0.0}, {"write_bps": -1.0}, {"batch_blocks": 0}],
)
def test_bad_raw_slices_are_typed_errors(tmp_path: Path, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"qd": 1, "seconds": 0.01} | kwargs
    with (
        RawFile(tmp_path, file_bytes=1 << 20, block_bytes=64 * KiB) as f,
        pytest.raises(InvalidArgument),
    ):
        f.read_slice(rng=np.random.default_rng(0), **args)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        RawFile(tmp_path, file_bytes=1 << 20, block_bytes=64 * KiB, segment_bytes=KiB)
    assert not list(tmp_path.iterdir())
