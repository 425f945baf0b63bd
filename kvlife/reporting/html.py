"""The report files: JSON for machines (arrays for plots left out) and one self-contained
HTML page with the figures side by side and PNG plots (matplotlib, Agg) embedded as
base64, so the page can be mailed or attached as it is."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from kvlife.report import format_table
from kvlife.reporting.lifecycle import STATES


def clean(obj: Any) -> Any:
    """``obj`` without ``_``-prefixed keys, with NaN/inf as None (strict JSON)."""
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return clean(float(obj))
    return obj


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(clean(report), indent=1, allow_nan=False)


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.3g}"
        return f"{v:.{digits}f}"
    return str(v)


def _ms(p: dict[str, float]) -> str:
    return " / ".join(f"{1000 * p[k]:.1f}" for k in ("p50", "p90", "p99"))


def host_rows(h: dict[str, Any]) -> list[list[str]]:
    """The headline figures of a host run, one row each."""
    lat, hits, amp = h["latency"], h["hits"], h["amplification"]
    rows = [
        ["TTFT P50 / P90 / P99 (ms)", _ms(lat["ttft_s"])],
        ["TPOT P50 / P90 / P99 (ms)", _ms(lat["tpot_s"])],
        [
            "queue / load P99 (ms)",
            f"{1000 * lat['queue_s']['p99']:.1f} / {1000 * lat['load_s']['p99']:.1f}",
        ],
        ["prefix hit ratio", _f(hits["prefix_hit_ratio"], 4)],
    ]
    for tier, r in hits["per_tier_ratio"].items():
        rows.append([f"  {tier} hit ratio", _f(r, 4)])
    rows += [
        ["read amplification (bytes read / bytes loaded)", _f(amp["read"])],
        ["write amplification (bytes written / new bytes)", _f(amp["write"])],
        ["SSD WAF (NAND / host writes)", _f(amp["ssd_waf"])],
    ]
    ssd = h.get("ssd")
    if ssd:
        rows += [
            [
                "SSD GC time (device-s) / share of span",
                f"{_f(ssd['gc_time_s'])} / {_f(ssd['gc_share_of_span'])}",
            ],
            [
                "SSD read P99 under GC / clear (ms)",
                f"{1000 * ssd['read_p99_under_gc_s']:.2f} / {1000 * ssd['read_p99_clear_s']:.2f}",
            ],
            ["SSD reads under GC / clear", f"{ssd['reads_under_gc']:,} / {ssd['reads_clear']:,}"],
        ]
    for dev, u in h["utilisation"].items():
        rows.append([f"utilisation: {dev}", _f(u)])
    f = h["faults"]
    rows.append(
        [
            "faults injected / detected",
            f"{sum(f['injected'].values()):,} / {sum(f['detected'].values()):,}",
        ]
    )
    rows.append(["faults: blocks recomputed", f"{sum(f['recomputed_blocks'].values()):,}"])
    rows.append(["faults: wrong blocks served", str(f["wrong_blocks_served"])])
    iso = h["isolation"]
    if "jain_hit_ratio" in iso:
        rows.append(["isolation: Jain index of tenant hit ratios", _f(iso["jain_hit_ratio"])])
        rows.append(["isolation: tenant TTFT P99 max / min", _f(iso["ttft_p99_max_over_min"])])
    rows.append(["replay seconds", _f(h["speed"]["seconds"], 1)])
    return rows


def cluster_rows(c: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    heads = [
        "design",
        "load",
        "TTFT P50/P90/P99 ms",
        "hit",
        "shared hit",
        "pool util",
        "host NIC util",
        "compute util",
        "saturated",
    ]
    rows = []
    for d in c["designs"]:
        for pt in d["points"]:
            rows.append(
                [
                    d["design"],
                    f"{pt['load']:g}x",
                    _ms(pt["ttft_s"]),
                    _f(pt["prefix_hit_ratio"]),
                    _f(pt["shared_hit_ratio"]),
                    _f(pt["utilisation"]["pool"]),
                    _f(pt["utilisation"]["host_link_max"]),
                    _f(pt["utilisation"]["compute"]),
                    pt["saturated"] or "-",
                ]
            )
    return heads, rows


def lifecycle_rows(lc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    heads = [
        "class",
        "lives",
        "open",
        "lifespan P50 s",
        "P90 s",
        "open age P50 s",
        "open: loads P50 / P90",
        "reused",
        "loads P90",
        "reuse dist P50 s",
        "indexed share",
    ]
    rows = []
    for cls, c in lc["classes"].items():
        rows.append(
            [
                cls,
                f"{c['lives_closed']:,}",
                f"{c['lives_open']:,}",
                _f(c["lifespan_s"]["p50"], 1),
                _f(c["lifespan_s"]["p90"], 1),
                _f(c["open_age_s"]["p50"], 1),
                f"{_f(c['open_reuse_count']['p50'], 1)} / {_f(c['open_reuse_count']['p90'], 1)}",
                _f(c["reused_share"]),
                _f(c["reuse_count"]["p90"], 1),
                _f(c["reuse_distance_s"]["p50"], 1),
                _f(c["state_share"]["indexed"]),
            ]
        )
    return heads, rows


def _source_column(lc: dict[str, Any], tiers: list[str]) -> list[str]:
    """One source's column of :func:`source_rows`."""
    c = lc["overall"]

    def pct(key: str, q: str) -> str:
        return _f(c[key][q], 1) if c[key]["count"] else "-"

    def pair(key: str) -> str:
        return f"{pct(key, 'p50')} / {pct(key, 'p90')}"

    col = [
        f"{lc['events']:,}",
        _f(lc["span_s"], 0),
        ", ".join(lc["classes"]) or "-",
        f"{c['lives_closed']:,} / {c['lives_open']:,}",
        pair("lifespan_s"),
        pct("open_age_s", "p50"),
        pair("reuse_count"),
        pair("open_reuse_count"),
        _f(c["reused_share_with_open"]),
        pair("reuse_distance_s"),
    ]
    col += [_f(c["state_share_with_open"][s]) for s in STATES]
    res = c["tier_residency_s"]
    col += [_f(res[t]["p50"], 1) if t in res else "-" for t in tiers]
    col.append(lc["stability"]["verdict"])
    return col


def source_rows(lifecycles: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Every source's lifecycle (a replay, each live log) side by side: one column per
    source, one row per figure, all classes pooled (``overall``)."""
    tiers = sorted({t for lc in lifecycles.values() for t in lc["overall"]["tier_residency_s"]})
    labels = [
        "events",
        "span s",
        "classes",
        "lives closed / open",
        "lifespan P50 / P90 s",
        "open age P50 s",
        "loads per closed life P50 / P90",
        "loads per open life P50 / P90",
        "reused (any load)",
        "reuse distance P50 / P90 s",
        *(f"time {s} (share)" for s in STATES),
        *(f"in {t} until evicted P50 s" for t in tiers),
        "stable classes",
    ]
    cols = [_source_column(lc, tiers) for lc in lifecycles.values()]
    rows = [[label, *(col[i] for col in cols)] for i, label in enumerate(labels)]
    return ["figure", *lifecycles], rows


def trace_lifetime_rows(lt: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    heads = [
        "class (first position)",
        "blocks",
        "reused",
        "touches P90",
        "useful lifetime P50 s",
        "P90 s",
        "reuse gap P50 s",
    ]
    rows = [
        [
            cls,
            f"{c['blocks']:,}",
            _f(c["reused_share"]),
            _f(c["touches"]["p90"], 1),
            _f(c["useful_lifetime_s"]["p50"], 1),
            _f(c["useful_lifetime_s"]["p90"], 1),
            _f(c["reuse_gap_s"]["p50"], 1),
        ]
        for cls, c in lt["classes"].items()
    ]
    return heads, rows


def text(report: dict[str, Any]) -> str:
    """The report for a terminal."""
    out = []
    h = report.get("host")
    if h:
        out.append(f"host run: {h['trace']['name']} ({h['trace']['requests']:,} requests)")
        out.append(format_table(["metric", "value"], host_rows(h)))
    c = report.get("cluster")
    if c:
        out.append(f"\ncluster: {c['hosts']} hosts, {c['trace']['note']}")
        out.append(format_table(*cluster_rows(c)))
        out.append("\n".join(c["findings"]))
    lt = report.get("lifecycle_trace")
    if lt:
        out.append(f"\nlifetimes in the trace (no cache): {lt['stability']['verdict']}")
        out.append(format_table(*trace_lifetime_rows(lt)))
    if len(report.get("lifecycle", {})) > 1:
        out.append("\nlifecycle by source (all classes pooled):")
        out.append(format_table(*source_rows(report["lifecycle"])))
    for name, lc in report.get("lifecycle", {}).items():
        out.append(f"\nlifecycle ({name}): {lc['stability']['verdict']}")
        out.append(format_table(*lifecycle_rows(lc)))
    return "\n".join(out)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(report: dict[str, Any]) -> dict[str, str]:
    """Base64 PNGs by title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    h = report.get("host")
    if h and "_ttft" in h and len(h["_ttft"]):
        ttft = np.asarray(h["_ttft"])
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
        xs = np.sort(ttft)
        a1.plot(xs, np.arange(1, xs.size + 1) / xs.size)
        a1.set_xscale("log")
        a1.set_xlabel("TTFT (s)")
        a1.set_ylabel("fraction of requests")
        a1.grid(True, alpha=0.3)
        a2.scatter(np.asarray(h["_arrival"]), ttft, s=2, alpha=0.4)
        a2.set_yscale("log")
        a2.set_xlabel("arrival (s)")
        gc = np.asarray(h.get("_gc_windows", []), dtype=np.float64).reshape(-1, 2)
        if gc.size:
            # seconds of GC windows opened per second, in 60 bins (GC runs inside writes)
            edges = np.linspace(0.0, max(float(gc[:, 1].max()), 1.0), 61)
            busy, _ = np.histogram(gc[:, 0], edges, weights=gc[:, 1] - gc[:, 0])
            a3 = a2.twinx()
            a3.plot(edges[:-1], busy / (edges[1] - edges[0]), color="red", lw=1)
            a3.set_ylabel("SSD GC window s per s", color="red")
        a2.set_ylabel("TTFT (s)")
        out["TTFT: CDF, and over time with GC windows"] = _png(fig)
        plt.close(fig)
    if h and h.get("_io"):
        end = max(float(h["span_s"]), 1.0)
        edges = np.linspace(0.0, end, 61)
        fig, ax = plt.subplots(figsize=(11, 3.6))
        width = edges[1] - edges[0]
        for name, rows in h["_io"].items():
            if not rows:
                continue
            a = np.asarray(rows, dtype=np.float64).reshape(-1, 3)
            r, _ = np.histogram(a[:, 0], edges, weights=a[:, 1])
            w, _ = np.histogram(a[:, 0], edges, weights=a[:, 2])
            ax.plot(edges[:-1], r / width / 1e9, label=f"{name} read")
            ax.plot(edges[:-1], w / width / 1e9, ls="--", label=f"{name} written")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("GB/s")
        ax.legend(ncol=3)
        ax.grid(True, alpha=0.3)
        out["Bytes per tier over time"] = _png(fig)
        plt.close(fig)
    c = report.get("cluster")
    if c:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        for d in c["designs"]:
            loads = [p["load"] for p in d["points"]]
            a1.plot(loads, [p["ttft_s"]["p99"] for p in d["points"]], marker="o", label=d["design"])
            a2.plot(
                loads,
                [p["utilisation"]["pool"] for p in d["points"]],
                marker="o",
                label=d["design"],
            )
        for ax, lab in ((a1, "TTFT P99 (s)"), (a2, "shared tier: busy time / span")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("load (x the trace's request rate)")
            ax.set_ylabel(lab)
            ax.grid(True, alpha=0.3)
        a1.set_yscale("log")
        a1.legend(fontsize=8)
        out[f"Cluster of {c['hosts']} hosts: TTFT P99 and shared-tier load"] = _png(fig)
        plt.close(fig)
    for name, samples in report.get("_lifespans", {}).items():
        if not any(len(v) for v in samples.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for cls, v in samples.items():
            if len(v):
                xs = np.sort(np.maximum(np.asarray(v, dtype=np.float64), 1e-3))
                ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=f"{cls} ({xs.size:,})")
        ax.set_xscale("log")
        ax.set_xlabel("lifespan, create to delete (s)")
        ax.set_ylabel("fraction of lives")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        out[f"Lifespan CDF per class ({name})"] = _png(fig)
        plt.close(fig)
    return out


def _table_html(heads: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{th}</tr>{body}</table>"


def write_html(path: str | Path, report: dict[str, Any]) -> None:
    """One self-contained page: tables side by side, embedded plots, the JSON."""
    e = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'><title>kvlife report</title>",
        "<style>body{font-family:sans-serif;max-width:72em;margin:2em auto}"
        "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
        "padding:2px 8px;text-align:right}td:first-child{text-align:left}"
        ".row{display:flex;gap:2em;flex-wrap:wrap}</style>",
        "<h1>kvlife report</h1>",
        f"<p><code>{e(' '.join(report.get('command', [])))}</code></p>",
    ]
    h = report.get("host")
    if h:
        parts.append(
            f"<h2>One host: {e(h['trace']['name'])}, {h['trace']['requests']:,} "
            f"requests, {h['trace']['block_touches']:,} block touches</h2>"
        )
        tenants = [
            [name, f"{t['requests']:,}", _f(t["prefix_hit_ratio"], 4), _ms(t["ttft_s"])]
            for name, t in h["tenants"].items()
        ]
        parts.append("<div class='row'>")
        parts.append(_table_html(["metric", "value"], host_rows(h)))
        parts.append(
            _table_html(["tenant", "requests", "hit ratio", "TTFT P50/P90/P99 ms"], tenants)
        )
        parts.append("</div>")
    c = report.get("cluster")
    if c:
        parts.append(f"<h2>Cluster: {c['hosts']} hosts</h2><p>{e(c['trace']['note'])}</p>")
        parts.append(_table_html(*cluster_rows(c)))
        parts.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in c["findings"]) + "</ul>")
    lt = report.get("lifecycle_trace")
    if lt:
        parts.append("<h2>Lifetimes in the trace (policy-free: first to last touch)</h2>")
        parts.append(f"<p>Stable classes: <b>{e(lt['stability']['verdict'])}</b></p>")
        parts.append(_table_html(*trace_lifetime_rows(lt)))
    if report.get("lifecycle"):
        parts.append("<h2>Lifecycle by source (all classes pooled)</h2>")
        parts.append(
            "<p>The same analysis of each source: the replay's cache and each live "
            "engine's store log. Open lives' time runs to the end of their log.</p>"
        )
        parts.append(_table_html(*source_rows(report["lifecycle"])))
    for name, lc in report.get("lifecycle", {}).items():
        parts.append(f"<h2>Lifecycle distribution ({e(name)})</h2>")
        parts.append(
            f"<p>{lc['events']:,} events over {lc['span_s']:,.0f} s. Stable classes: "
            f"<b>{e(lc['stability']['verdict'])}</b></p>"
        )
        parts.append(_table_html(*lifecycle_rows(lc)))
    for title, b64 in plots(report).items():
        parts.append(f"<h2>{e(title)}</h2><img alt='{e(title)}' src='data:image/png;base64,{b64}'>")
    parts.append(f"<h2>JSON</h2><details><pre>{e(to_json(report))}</pre></details>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")
