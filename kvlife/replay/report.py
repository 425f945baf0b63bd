"""Replay reports: a terminal table, JSON, and an HTML page with embedded PNG plots
(matplotlib, Agg backend): TTFT CDF, hit ratio against capacity per policy, bytes per
tier over time."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.report import format_table


def _gib(n: float) -> str:
    return f"{n / (1 << 30):,.1f} GiB"


def table(report: dict[str, Any]) -> str:
    """The headline numbers as an aligned table."""
    rows = [
        ["block hit ratio", f"{report['block_hit_ratio']:.4f}"],
        ["usable-prefix hit ratio", f"{report['prefix_hit_ratio']:.4f}"],
    ]
    for name, t in report["tiers"].items():
        rows.append([f"  {name} prefix hit ratio", f"{t['prefix_hit_ratio']:.4f}"])
        rows.append([f"  {name} read / written", f"{_gib(t['bytes_read'])} / "
                     f"{_gib(t['bytes_written'])}"])  # fmt: skip
        rows.append([f"  {name} evictions", str(t["evictions"])])
    rows.append(["read amplification", f"{report['read_amplification']:.3f}"])
    rows.append(["write amplification", f"{report['write_amplification']:.3f}"])
    for key in ("ttft_s", "tpot_s"):
        if key in report:
            p = report[key]
            rows.append([f"{key[:4].upper()} P50/P90/P99 (s)",
                         f"{p['p50']:.3f} / {p['p90']:.3f} / {p['p99']:.3f}"])  # fmt: skip
    ftl = report.get("disk_ftl")
    if ftl:
        rows.append(["disk FTL: WAF / GC share of span", f"{ftl['waf']:.3f} / "
                     f"{ftl['gc_share_of_span']:.3f}"])  # fmt: skip
        rows.append(["disk FTL: read P99 under GC / clear (s)", f"{ftl['read_p99_under_gc_s']:.3f}"
                     f" / {ftl['read_p99_clear_s']:.3f}"])  # fmt: skip
    pl = report.get("planner")
    if pl:
        a, b = pl["ttft_s_always_load"], pl["ttft_s"]
        rows.append(["TTFT P50/P99 always-load (s)", f"{a['p50']:.3f} / {a['p99']:.3f}"])
        rows.append(["TTFT P50/P99 planner (s)", f"{b['p50']:.3f} / {b['p99']:.3f}"])
        rows.append(["  prefixes recomputed", f"{pl['requests_recomputed']} of "
                     f"{pl['requests_with_prefix']}"])  # fmt: skip
    rows.append(["block touches per second", f"{report['speed']['block_touches_per_s']:,.0f}"])
    return format_table(["metric", "value"], rows)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=2)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(report: dict[str, Any], sweep: dict[str, Any] | None) -> dict[str, str]:
    """Base64 PNGs by title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    ttft = report.get("_ttft")
    if ttft is not None and len(ttft):
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = np.sort(np.asarray(ttft))
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF")
        ax.grid(True, alpha=0.3)
        out["TTFT CDF"] = _png(fig)
        plt.close(fig)
    if sweep is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for pol, pts in sweep["curves"].items():
            ax.plot([100 * p["share"] for p in pts], [p["block_hit_ratio"] for p in pts],
                    marker="o", label=pol)  # fmt: skip
        for ref, pts in sweep.get("references", {}).items():  # Belady, libCacheSim's
            ax.plot([100 * p["share"] for p in pts], [p["block_hit_ratio"] for p in pts],
                    ls=":", marker="x", label=ref)  # fmt: skip
        ax.axhline(sweep["ideal_hit_ratio"], color="grey", ls="--", label="infinite cache")
        ax.set_xlabel("capacity (% of unique blocks)")
        ax.set_ylabel("block hit ratio")
        ax.set_title("Hit ratio against capacity")
        ax.legend()
        ax.grid(True, alpha=0.3)
        out["Hit ratio against capacity"] = _png(fig)
        plt.close(fig)
    tl = report.get("timeline")
    if tl:
        fig, ax = plt.subplots(figsize=(6, 4))
        t = np.asarray(tl["t_s"])
        for name, v in tl.items():
            if name == "t_s":
                continue
            ax.plot(t, np.asarray(v["read"]) / (1 << 30), label=f"{name} read")
            ax.plot(t, np.asarray(v["written"]) / (1 << 30), ls="--", label=f"{name} written")
        ax.set_xlabel("trace time (s)")
        ax.set_ylabel("GiB per bin")
        ax.set_title("Bytes per tier over time")
        ax.legend()
        ax.grid(True, alpha=0.3)
        out["Bytes per tier over time"] = _png(fig)
        plt.close(fig)
    return out


def write_html(path: str | Path, report: dict[str, Any], sweep: dict[str, Any] | None) -> None:
    """One self-contained page: the table, the plots (embedded PNGs), the JSON."""
    parts = [
        "<!doctype html><meta charset='utf-8'><title>kvlife replay</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}</style>",
        f"<h1>kvlife replay: {html.escape(report['trace']['name'])}</h1>",
        f"<pre>{html.escape(table(report))}</pre>",
    ]
    for title, b64 in plots(report, sweep).items():
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{b64}'>")  # fmt: skip
    parts.append(f"<h2>JSON</h2><pre>{html.escape(to_json(report))}</pre>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")
