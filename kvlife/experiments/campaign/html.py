"""The campaign's HTML report: the totals, a table per deployment with a row per fault
kind, and a PNG plot (injections and wrong bytes per kind, recovery time) embedded as
base64, so the report is one self-contained file."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

COLUMNS = (
    ("kind", "fault kind"),
    ("injections", "injections"),
    ("sigkills", "SIGKILLs"),
    ("detections", "detections"),
    ("served_chunks", "chunks served (checked)"),
    ("wrong_bytes", "wrong bytes served"),
    ("stale_served", "stale chunks served"),
    ("acked_lost", "acknowledged lost"),
    ("lost_explained", "lost, reported"),
    ("recomputed", "chunks recomputed"),
    ("typed_errors", "typed errors"),
    ("recovery_p50_ms", "recovery p50 ms"),
    ("recovery_max_ms", "recovery max ms"),
)


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v * 1e3:.1f}"


def plot_png(kinds: list[dict[str, Any]]) -> bytes:
    """Injections per kind (log scale) with wrong bytes marked, and recovery p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{k['system']}/{k['deployment']}/{k['kind']}" for k in kinds]
    inj = [max(k["injections"], 0) for k in kinds]
    wrong = [k["wrong_bytes"] for k in kinds]
    rec = [(k["recovery_s"]["p50"] or 0.0) * 1e3 for k in kinds]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.28 * len(kinds) + 1.5)), sharey=True)
    ys = list(range(len(kinds)))
    colors = ["tab:red" if w else "tab:blue" for w in wrong]
    a.barh(ys, inj, color=colors)
    a.set_xscale("symlog")
    a.set_yticks(ys, labels, fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("injections (red: wrong bytes served)")
    b.barh(ys, rec, color="tab:green")
    b.set_xlabel("recovery time p50, ms")
    fig.suptitle("kvlife fault campaign")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def render(doc: dict[str, Any]) -> str:
    """The report for a campaign JSON document (:meth:`Campaign.to_json`)."""
    kinds: list[dict[str, Any]] = doc["kinds"]
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvlife fault campaign</title>",
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;"
        "margin-bottom:1.5em}td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}.bad{background:#fcc}</style></head><body>",
        "<h1>kvlife fault campaign</h1>",
        f"<p>seed {doc['seed']}, {'full' if doc['full'] else 'short'} run, "
        f"{html.escape(str(doc.get('command', '')))}; {doc.get('elapsed_s', 0):.0f} s "
        f"on {html.escape(str(doc.get('host', '')))}.</p>",
        "<h2>Totals</h2><table><tr><th>system</th>",
    ]
    tot = doc["totals"]
    fields = list(next(iter(tot.values())).keys()) if tot else []
    out.append("".join(f"<th>{f}</th>" for f in fields) + "</tr>")
    for system, row in tot.items():
        out.append(
            f"<tr><td>{html.escape(system)}</td>"
            + "".join(f"<td>{row[f]}</td>" for f in fields)
            + "</tr>"
        )
    out.append("</table>")
    png = base64.b64encode(plot_png(kinds)).decode() if kinds else ""
    if png:
        out.append(
            f"<img alt='injections and recovery per kind' src='data:image/png;base64,{png}'>"
        )
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in kinds:
        groups.setdefault((k["system"], k["deployment"]), []).append(k)
    for (system, dep), rows in groups.items():
        out.append(f"<h2>{html.escape(system)} / {html.escape(dep)}</h2><table><tr>")
        out.append("".join(f"<th>{html.escape(h)}</th>" for _, h in COLUMNS) + "</tr>")
        for k in rows:
            vals = dict(k)
            vals["recovery_p50_ms"] = _ms(k["recovery_s"]["p50"])
            vals["recovery_max_ms"] = _ms(k["recovery_s"]["max"])
            bad = k["wrong_bytes"] or k["stale_served"] or k["acked_lost"]
            out.append(
                f"<tr class='{'bad' if bad else ''}'>"
                + "".join(f"<td>{html.escape(str(vals[c]))}</td>" for c, _ in COLUMNS)
                + "</tr>"
            )
        out.append("</table>")
        notes = [(k["kind"], n) for k in rows for n in k["notes"]]
        if notes:
            out.append(
                "<ul>"
                + "".join(f"<li>{html.escape(kind)}: {html.escape(n)}</li>" for kind, n in notes)
                + "</ul>"
            )
    if doc.get("skipped"):
        out.append("<h2>Not run</h2><ul>")
        out.extend(f"<li>{html.escape(s)}</li>" for s in doc["skipped"])
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out)
