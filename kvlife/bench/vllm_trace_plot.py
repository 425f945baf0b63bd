"""The figure of ``kvlife bench vllm-trace --plot F.png``: per configuration that ran,
its TTFT percentiles (P50, P90, P99) beside vLLM's own, and the distribution of every
request's TTFT (one line per configuration); configurations that did not run are named
under the figure with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_png(result: dict[str, Any], path: Path) -> None:
    """Write the figure of one ``kvlife bench vllm-trace`` result (its JSON) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ran = {n: c for n, c in result["configs"].items() if c["ran"]}
    with_rows = any(c.get("ttft_by_request_s") for c in ran.values())
    if with_rows:
        fig, (bars, cdf) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    else:  # a result from before per-request TTFTs were recorded: the percentiles only
        fig, bars = plt.subplots(1, 1, figsize=(6.0, 4.0))
        cdf = None
    width = 0.8 / max(1, len(ran))
    pcts = ("p50", "p90", "p99")
    for i, (name, c) in enumerate(ran.items()):
        label = f"{name} (degraded)" if c.get("degraded") else name
        xs = np.arange(len(pcts)) + i * width
        bars.bar(xs, [c["ttft_s"][p] * 1e3 for p in pcts], width, label=label)
        per_request = sorted(c.get("ttft_by_request_s") or [])
        if per_request and cdf is not None:
            ys = np.arange(1, len(per_request) + 1) / len(per_request)
            cdf.step([t * 1e3 for t in per_request], ys, where="post", label=label)
    bars.set_xticks(np.arange(len(pcts)) + width * (len(ran) - 1) / 2, [p.upper() for p in pcts])
    bars.set_ylabel("TTFT (ms)")
    bars.set_yscale("log")
    bars.set_title(f"TTFT, {result.get('requests', '?')} requests of the trace", fontsize=9)
    axes = [bars]
    if cdf is not None:
        cdf.set_xscale("log")
        cdf.set_xlabel("TTFT (ms)")
        cdf.set_ylabel("share of requests")
        cdf.set_title("every request's TTFT", fontsize=9)
        axes.append(cdf)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    missing = [n for n, c in result["configs"].items() if not c["ran"]]
    if missing:
        fig.text(0.01, 0.01, "did not run here: " + ", ".join(missing), fontsize=7)
    fig.tight_layout(rect=(0, 0.04 if missing else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
