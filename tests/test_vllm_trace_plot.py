"""``kvlife bench vllm-trace --plot``: the figure is drawn from the result's JSON (a real
run's shape: configurations that ran, one degraded, one that did not run), as a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.bench.vllm_trace_plot import plot_png

pytest.importorskip("matplotlib")


def _config(p50: float, by_request: list[float], degraded: str = "") -> dict[str, object]:
    return {
        "ran": True,
        "ttft_s": {"p50": p50, "p90": p50 * 1.2, "p99": p50 * 1.5},
        "ttft_by_request_s": by_request,
        "degraded": degraded,
    }


def test_the_figure_is_a_png_of_every_config(tmp_path: Path) -> None:
    result = {
        "requests": 4,
        "configs": {
            "vllm": _config(0.74, [0.7, 0.74, 0.8, 0.94]),
            "kvlife dram+disk": _config(0.61, [0.5, 0.61, 0.7, 0.8]),
            "lmcache": _config(3.7, [3.6, 3.7, 3.9, 4.1], degraded="no cpu connector"),
            "vllm offload": {"ran": False, "error": "CPU Offloading is ... only on CUDA"},
        },
    }
    out = tmp_path / "trace.png"
    plot_png(result, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_result_without_per_request_rows_draws_the_percentiles(tmp_path: Path) -> None:
    old = _config(0.74, [])
    result = {"requests": 28, "configs": {"vllm": old, "kvlife dram": _config(0.78, [])}}
    out = tmp_path / "old.png"
    plot_png(result, out)
    assert out.read_bytes()[:4] == b"\x89PNG"
