"""Experiment: do KV lifetimes predict SSD write amplification, and do placement hints help?

Why: NVMe Flexible Data Placement (FDP) and write streams let the host tell an SSD which
writes belong together. If data that dies together is placed together, GC finds blocks
that are entirely invalid and copies little. A KV cache knows a lot about when its
objects die (a one-off prompt's KV dies in seconds, a conversation's history when the
conversation closes or is evicted), so it is a natural source of hints. This experiment
replays one KV write/read/delete stream (:mod:`kvlife.sim.kvstream`) onto the same SSD
model (:mod:`kvlife.sim.ssd`) with seven placement strategies:

- ``single-stream``: no hints, everything in one stream;
- ``class-hints``: one stream per KV class (system prompt / conversation history / fresh);
- ``online-predictor``: a per-feature running mean of the log lifetimes of objects that
  have already died, binned into lifetime classes (never looks ahead);
- ``oracle``: each object's true lifetime, binned the same way;
- ``oracle-5%-wrong``, ``oracle-20%-wrong``, ``oracle-50%-wrong``: the oracle with that
  share of objects sent to a random *other* stream.

Lifetimes are counted in host pages written between an object's write and its delete
(the clock that matters to GC) and binned at 1/16, 1/4 and 1 device logical capacities.
For each strategy it reports WAF, GC time and read P99 after a warm-up, as JSON, as a
table and as an HTML report with a plot. Entry point for the CLI: :func:`main`.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from kvlife.sim import ftl_kernels as fk
from kvlife.sim.device import LatencyStats
from kvlife.sim.errors import DeviceConfigError, RequestError
from kvlife.sim.kvstream import (
    KVClass,
    KVStream,
    SyntheticKVConfig,
    mooncake_stream,
    read_mooncake,
    synthetic_stream,
)
from kvlife.sim.ssd import Ftl, SSDConfig

LIFETIME_EDGES = (1.0 / 16.0, 1.0 / 4.0, 1.0)
"""Lifetime bin edges in device logical capacities; 4 bins -> 4 streams."""

MISLABEL_FRACTIONS = (0.05, 0.20, 0.50)
"""Shares of objects the noisy oracles send to a wrong stream."""

STRATEGIES = (
    "single-stream",
    "class-hints",
    "online-predictor",
    "oracle",
    *(f"oracle-{round(p * 100)}%-wrong" for p in MISLABEL_FRACTIONS),
)
"""Strategy names, in report order."""


# ---------------------------------------------------------------------------------------
# Placement strategies: each returns one stream per object.


def lifetime_bins(lifetimes_pages: NDArray[np.float64], capacity_pages: int) -> NDArray[np.int64]:
    """Stream per object from its lifetime (host pages); never-deleted objects get the last bin."""
    edges = np.array(LIFETIME_EDGES) * capacity_pages
    return np.searchsorted(edges, lifetimes_pages, side="right").astype(np.int64)


class OnlineLifetimePredictor:
    """Per-feature exponentially weighted mean of log2(lifetime) over objects already dead.

    Objects still alive are not seen (right-censoring), so long-lived features are
    underestimated until their objects start dying; an unseen feature falls back to the
    mean over all features, and before any death to the middle bin.
    """

    def __init__(self, capacity_pages: int, alpha: float = 0.05) -> None:
        self.edges = np.log2(np.array(LIFETIME_EDGES) * capacity_pages + 1.0)
        self.alpha = alpha
        self._mean: dict[int, float] = {}
        self._global: float | None = None

    def observe(self, feature: int, lifetime_pages: float) -> None:
        x = math.log2(lifetime_pages + 1.0)
        m = self._mean.get(feature)
        self._mean[feature] = x if m is None else m + self.alpha * (x - m)
        g = self._global
        self._global = x if g is None else g + self.alpha * (x - g)

    def predict(self, feature: int) -> int:
        m = self._mean.get(feature, self._global)
        if m is None:
            return len(LIFETIME_EDGES) // 2
        return int(np.searchsorted(self.edges, m, side="right"))


def predictor_streams(stream: KVStream) -> NDArray[np.int64]:
    """Streams chosen online: each write uses only deaths that happened before it."""
    pred = OnlineLifetimePredictor(stream.capacity_pages)
    clock = stream.write_clock()
    birth = np.zeros(stream.n_objects, dtype=np.int64)
    out = np.zeros(stream.n_objects, dtype=np.int64)
    kinds = stream.op_kind.tolist()
    objs = stream.op_obj.tolist()
    feats = stream.obj_feature.tolist()
    clk = clock.tolist()
    for i, k in enumerate(kinds):
        o = objs[i]
        if k == fk.OP_WRITE:
            birth[o] = clk[i]
            out[o] = pred.predict(feats[o])
        elif k == fk.OP_DELETE:
            pred.observe(feats[o], float(clk[i] - birth[o]))
    return out


def mislabel(
    streams: NDArray[np.int64], fraction: float, n_streams: int, seed: int
) -> NDArray[np.int64]:
    """Send ``fraction`` of objects (chosen at random) to a uniformly random other stream."""
    rng = np.random.default_rng(seed)
    out = streams.copy()
    wrong = rng.random(streams.size) < fraction
    shift = rng.integers(1, n_streams, size=streams.size)
    out[wrong] = (streams[wrong] + shift[wrong]) % n_streams
    return out


def strategy_streams(
    stream: KVStream, strategy: str, n_streams: int, seed: int
) -> NDArray[np.int64]:
    """Per object stream for one named strategy."""
    if strategy == "single-stream":
        return np.zeros(stream.n_objects, dtype=np.int64)
    if strategy == "class-hints":
        return stream.obj_class.astype(np.int64)
    if strategy == "online-predictor":
        return predictor_streams(stream)
    oracle = lifetime_bins(stream.lifetimes_pages(), stream.capacity_pages)
    if strategy == "oracle":
        return oracle
    for p in MISLABEL_FRACTIONS:
        if strategy == f"oracle-{round(p * 100)}%-wrong":
            return mislabel(oracle, p, n_streams, seed)
    raise RequestError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


# ---------------------------------------------------------------------------------------
# Replay and results.


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """Measured outcome of one placement strategy (after the warm-up)."""

    strategy: str
    """Strategy name (see STRATEGIES)."""
    streams_used: int
    """Distinct streams the strategy wrote to."""
    waf: float
    """NAND page writes / host page writes."""
    host_page_writes: int
    """Host pages written in the measured window."""
    nand_page_writes: int
    """NAND pages programmed in the measured window (host + GC copies)."""
    gc_events: int
    """Blocks collected by GC in the window."""
    gc_time_s: float
    """GC work in device-seconds (die-seconds / dies) in the window."""
    gc_share: float
    """GC time / window span: the share of the device's NAND time spent on GC."""
    read_latency: LatencyStats
    """Latency of object reads in the window."""
    write_latency: LatencyStats
    """Latency of object writes in the window."""


@dataclass(frozen=True, slots=True)
class LifetimeHintsResult:
    """Outcome of :func:`run_lifetime_hints` on one stream and one device."""

    workload: str
    """Stream name."""
    workload_info: dict[str, float]
    """Figures of the stream (objects, ops, pages, hit ratio, ...)."""
    device: dict[str, float | int | str]
    """The SSD configuration used."""
    warmup_host_pages: int
    """Host pages written before measuring."""
    rows: tuple[StrategyResult, ...]
    """One row per strategy, in STRATEGIES order."""
    conclusion: str = ""
    """Plain-language reading of the rows."""
    lifetime_by_class: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per KV class: objects, pages, deleted share, lifetime quantiles (capacities)."""

    def row(self, strategy: str) -> StrategyResult:
        for r in self.rows:
            if r.strategy == strategy:
                return r
        raise KeyError(strategy)

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (NaN and inf become None)."""

        def clean(x: object) -> object:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return [clean(v) for v in x]
            return x

        d = asdict(self)
        out = clean(d)
        assert isinstance(out, dict)
        return out

    def table(self) -> str:
        """A fixed-width text table of the rows."""
        head = (
            f"{'strategy':<20} {'streams':>7} {'WAF':>7} {'GC events':>10} "
            f"{'GC time s':>10} {'GC share':>9} {'read P50 ms':>12} {'read P99 ms':>12} "
            f"{'write P99 ms':>13}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(
                f"{r.strategy:<20} {r.streams_used:>7} {r.waf:>7.3f} {r.gc_events:>10} "
                f"{r.gc_time_s:>10.2f} {r.gc_share:>9.1%} {r.read_latency.p50_s * 1e3:>12.3f} "
                f"{r.read_latency.p99_s * 1e3:>12.3f} {r.write_latency.p99_s * 1e3:>13.3f}"
            )
        return "\n".join(lines)


def _device_summary(cfg: SSDConfig) -> dict[str, float | int | str]:
    return {
        "n_blocks": cfg.n_blocks,
        "pages_per_block": cfg.pages_per_block,
        "page_bytes": cfg.page_bytes,
        "logical_pages": cfg.logical_pages,
        "op": cfg.op,
        "cell": cfg.cell.value,
        "n_dies": cfg.n_dies,
        "n_streams": cfg.n_streams,
        "gc_policy": cfg.gc_policy.value,
    }


def _lifetime_by_class(stream: KVStream) -> dict[str, dict[str, float]]:
    lt = stream.lifetimes_pages() / stream.capacity_pages
    out: dict[str, dict[str, float]] = {}
    for c in KVClass:
        m = stream.obj_class == c
        if not m.any():
            continue
        fin = lt[m][np.isfinite(lt[m])]
        q = np.percentile(fin, [10, 50, 90]) if fin.size else np.full(3, math.nan)
        out[c.name.lower()] = {
            "objects": float(m.sum()),
            "pages": float(stream.obj_npages[m].sum()),
            "deleted_share": float(fin.size / m.sum()),
            "lifetime_p10_capacities": float(q[0]),
            "lifetime_p50_capacities": float(q[1]),
            "lifetime_p90_capacities": float(q[2]),
        }
    return out


def default_device(capacity_pages: int, op: float = 0.07, n_streams: int = 4) -> SSDConfig:
    """The SSD the experiment uses: logical capacity = the stream's, TLC, 32 dies.

    Blocks have 64 pages, or fewer for small capacities so that the device keeps at
    least about 512 blocks and the streams' open blocks hold a small share of the spare.
    """
    ppb = 64
    while ppb > 4 and capacity_pages // ppb < 512:
        ppb //= 2
    base = SSDConfig.for_logical_pages(capacity_pages, pages_per_block=ppb, op=op)
    return replace(base, n_streams=n_streams)


def replay_stream(
    stream: KVStream,
    obj_stream: NDArray[np.int64],
    device: SSDConfig,
    warmup_host_pages: int,
) -> tuple[Ftl, StrategyResult]:
    """Replay ``stream`` on a fresh SSD with the given per-object streams; measure after warm-up."""
    if device.logical_pages < stream.capacity_pages:
        raise DeviceConfigError(
            f"the device holds {device.logical_pages} logical pages, fewer than the "
            f"stream's capacity of {stream.capacity_pages}"
        )
    if obj_stream.size and (obj_stream.min() < 0 or obj_stream.max() >= device.n_streams):
        raise DeviceConfigError(
            f"strategy uses streams {int(obj_stream.min())}..{int(obj_stream.max())} but the "
            f"device has {device.n_streams}"
        )
    stream.check()
    ftl = Ftl(device)
    st = ftl.arrays
    n_lpn = device.logical_pages
    free_lpns = np.arange(n_lpn - 1, -1, -1, dtype=np.int64)
    free_top = np.array([n_lpn], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(stream.obj_npages)[:-1]]).astype(np.int64)
    lpn_table = np.full(int(stream.obj_npages.sum()), fk.UNMAPPED, dtype=np.int64)
    op_stream = np.ascontiguousarray(obj_stream[stream.op_obj], dtype=np.int64)
    latency = np.zeros(stream.n_ops, dtype=np.float64)
    clock = stream.write_clock()
    w = int(np.searchsorted(clock, warmup_host_pages, side="left"))
    w = min(w, stream.n_ops)

    def run(a: int, b: int) -> None:
        fk.replay_objects(
            st,
            stream.op_kind[a:b],
            stream.op_time[a:b],
            stream.op_obj[a:b],
            op_stream[a:b],
            stream.obj_npages,
            offsets,
            lpn_table,
            free_lpns,
            free_top,
            latency[a:b],
        )

    run(0, w)
    before = ftl.counters()
    run(w, stream.n_ops)
    c = ftl.counters().since(before)
    kinds = stream.op_kind[w:]
    lat = latency[w:]
    span = float(stream.op_time[-1] - stream.op_time[w]) if w < stream.n_ops else 0.0
    written = obj_stream[stream.op_obj[stream.op_kind == fk.OP_WRITE]]
    result = StrategyResult(
        strategy="",
        streams_used=int(np.unique(written).size),
        waf=c.waf,
        host_page_writes=c.host_page_writes,
        nand_page_writes=c.nand_page_writes,
        gc_events=c.gc_events,
        gc_time_s=c.gc_time_s,
        gc_share=c.gc_time_s / span if span > 0 else math.nan,
        read_latency=LatencyStats.of(lat[kinds == fk.OP_READ]),
        write_latency=LatencyStats.of(lat[kinds == fk.OP_WRITE]),
    )
    return ftl, result


def _conclusion(rows: Sequence[StrategyResult]) -> str:
    by = {r.strategy: r for r in rows}
    base = by["single-stream"]

    def rel(r: StrategyResult) -> str:
        return f"{(r.waf / base.waf - 1.0) * 100:+.1f}%"

    parts = [f"Without hints WAF is {base.waf:.2f}."]
    best = min(rows, key=lambda r: r.waf)
    gain = 1.0 - best.waf / base.waf
    for name in ("class-hints", "online-predictor", "oracle"):
        if name in by:
            parts.append(f"{name}: WAF {by[name].waf:.2f} ({rel(by[name])}).")
    noisy = [by[s] for s in STRATEGIES if s.endswith("-wrong") and s in by]
    if noisy:
        parts.append(
            "Mislabelled oracle: " + ", ".join(f"{r.strategy} {r.waf:.2f}" for r in noisy) + "."
        )
    if gain < 0.02:
        parts.append(
            "Hints do not help here: no strategy lowers WAF by even 2%, because objects "
            "already die in roughly the order they were written (the cache's eviction "
            "order), which is what a single log-structured stream handles well."
        )
    else:
        parts.append(
            f"The best strategy ({best.strategy}) cuts WAF by {gain:.0%} and GC time from "
            f"{base.gc_time_s:.1f} to {best.gc_time_s:.1f} device-seconds; read P99 goes from "
            f"{base.read_latency.p99_s * 1e3:.2f} ms to {best.read_latency.p99_s * 1e3:.2f} ms."
        )
        if "oracle" in by and "online-predictor" in by:
            o, p = by["oracle"], by["online-predictor"]
            if base.waf > o.waf:
                captured = (base.waf - p.waf) / (base.waf - o.waf)
                parts.append(
                    f"The online predictor captures {captured:.0%} of the oracle's WAF reduction."
                )
    worse = [r.strategy for r in rows if r.waf > base.waf * 1.02]
    if worse:
        parts.append("Worse than no hints: " + ", ".join(worse) + ".")
    return " ".join(parts)


def run_lifetime_hints(
    stream: KVStream,
    device: SSDConfig | None = None,
    *,
    strategies: Sequence[str] = STRATEGIES,
    warmup_capacities: float = 2.0,
    seed: int = 0,
    progress: bool = False,
) -> LifetimeHintsResult:
    """Replay ``stream`` once per strategy on identical fresh SSDs and compare them.

    ``device`` defaults to :func:`default_device` for the stream's capacity (4 streams).
    Measurement starts after ``warmup_capacities`` x logical capacity host pages.
    """
    if stream.n_ops == 0:
        raise RequestError(f"stream {stream.name} has no operations")
    cfg = device or default_device(stream.capacity_pages)
    if cfg.n_streams < 4:
        raise DeviceConfigError(
            f"the experiment needs a device with at least 4 streams, got {cfg.n_streams}"
        )
    warm = int(warmup_capacities * cfg.logical_pages)
    rows: list[StrategyResult] = []
    it: Sequence[str] = strategies
    if progress:
        from tqdm import tqdm

        it = tqdm(strategies, desc=f"lifetime-hints {stream.name}", unit="strategy")
    for i, name in enumerate(it):
        obj_stream = strategy_streams(stream, name, cfg.n_streams, seed + i)
        _, r = replay_stream(stream, obj_stream, cfg, warm)
        rows.append(replace(r, strategy=name))
    info = dict(stream.info)
    info.update(
        {
            "objects": float(stream.n_objects),
            "ops": float(stream.n_ops),
            "host_pages_written": float(stream.host_pages_written),
            "capacity_pages": float(stream.capacity_pages),
            "duration_s": float(stream.op_time[-1]) if stream.n_ops else 0.0,
        }
    )
    return LifetimeHintsResult(
        workload=stream.name,
        workload_info=info,
        device=_device_summary(cfg),
        warmup_host_pages=warm,
        rows=tuple(rows),
        conclusion=_conclusion(rows),
        lifetime_by_class=_lifetime_by_class(stream),
    )


# ---------------------------------------------------------------------------------------
# Report.


def plot_png(result: LifetimeHintsResult) -> bytes:
    """A PNG with WAF, GC time and read P99 per strategy (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.strategy for r in result.rows]
    panels = [
        ("WAF", [r.waf for r in result.rows]),
        ("GC time (device-s)", [r.gc_time_s for r in result.rows]),
        ("read P99 (ms)", [r.read_latency.p99_s * 1e3 for r in result.rows]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = ["#777777", "#1f77b4", "#2ca02c", "#d62728", "#ff9896", "#ffbb78", "#c5b0d5"]
    for ax, (title, vals) in zip(axes, panels, strict=True):
        ax.bar(range(len(names)), vals, color=colors[: len(names)])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"lifetime hints on {result.workload} (OP {result.device['op']})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_report(result: LifetimeHintsResult, path: str | Path) -> Path:
    """Write a small self-contained HTML report (plot embedded) and the PNG beside it."""
    p = Path(path)
    png = plot_png(result)
    png_path = p.with_suffix(".png")
    png_path.write_bytes(png)
    rows = "\n".join(
        f"<tr><td>{r.strategy}</td><td>{r.streams_used}</td><td>{r.waf:.3f}</td>"
        f"<td>{r.gc_events}</td><td>{r.gc_time_s:.2f}</td><td>{r.gc_share:.1%}</td>"
        f"<td>{r.read_latency.p50_s * 1e3:.3f}</td><td>{r.read_latency.p99_s * 1e3:.3f}</td>"
        f"<td>{r.write_latency.p99_s * 1e3:.3f}</td></tr>"
        for r in result.rows
    )
    dev = ", ".join(f"{k}={v}" for k, v in result.device.items())
    img = (
        '<img alt="WAF, GC time and read P99 per strategy" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
    )
    info = ", ".join(f"{k}={v:g}" for k, v in result.workload_info.items())
    html = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvlife lifetime hints: {result.workload}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
td:first-child{{text-align:left}}</style></head><body>
<h1>Do KV lifetimes predict SSD write amplification?</h1>
<p><b>Workload:</b> {result.workload} ({info})</p>
<p><b>Device:</b> {dev}. Measured after {result.warmup_host_pages} host pages of warm-up.</p>
<h2>Result</h2><p>{result.conclusion}</p>
<table><tr><th>strategy</th><th>streams</th><th>WAF</th><th>GC events</th>
<th>GC time (device-s)</th><th>GC share</th><th>read P50 ms</th><th>read P99 ms</th>
<th>write P99 ms</th></tr>
{rows}
</table>
<p>{img}</p>
<p>Plot also at <a href="{png_path.name}">{png_path.name}</a>.</p>
</body></html>
"""
    p.write_text(html, encoding="utf-8")
    return p


# ---------------------------------------------------------------------------------------
# CLI.


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``kvlife experiment lifetime-hints`` (added to ``parser`` if given)."""
    p = parser or argparse.ArgumentParser(
        prog="kvlife experiment lifetime-hints",
        description="Replay a KV write/delete stream on an SSD model with and without "
        "placement hints; report WAF, GC time and read P99 per strategy.",
    )
    p.add_argument("--trace", type=Path, help="Mooncake JSON-lines trace (default: synthetic)")
    p.add_argument("--json", type=Path, help="write the result as JSON to this file")
    p.add_argument("--report", type=Path, help="write an HTML report (PNG beside it)")
    p.add_argument("--op", type=float, default=0.07, help="SSD over-provisioning (default 0.07)")
    p.add_argument("--seed", type=int, default=0, help="seed (synthetic stream, mislabelling)")
    p.add_argument(
        "--capacity-pages",
        type=int,
        default=None,
        help="cache = SSD logical capacity in pages (default: 262144 synthetic; "
        "10%% of the trace's unique blocks for a trace)",
    )
    p.add_argument(
        "--capacities",
        type=float,
        default=10.0,
        help="synthetic: host writes to generate, in capacities (default 10)",
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="trace: replay this many times faster"
    )
    p.add_argument(
        "--warmup", type=float, default=2.0, help="capacities written before measuring (default 2)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cli_main(args: argparse.Namespace) -> int:
    """Run the experiment for parsed arguments; prints the table and the conclusion."""
    if args.trace is not None:
        reqs = read_mooncake(args.trace)
        unique = len({(i, h) for r in reqs for i, h in enumerate(r.hash_ids)})
        cap = args.capacity_pages or max(1024, int(0.1 * unique) * 4)
        stream = mooncake_stream(
            reqs, capacity_pages=cap, time_scale=args.time_scale, name=f"mooncake:{args.trace.name}"
        )
    else:
        cap = args.capacity_pages or 262144
        stream = synthetic_stream(
            SyntheticKVConfig(
                capacity_pages=cap,
                total_write_pages=int(args.capacities * cap),
                seed=args.seed,
            )
        )
    device = default_device(stream.capacity_pages, op=args.op)
    result = run_lifetime_hints(
        stream, device, warmup_capacities=args.warmup, seed=args.seed, progress=not args.no_progress
    )
    print(f"workload: {result.workload}  device: {result.device}")
    print(result.table())
    print()
    print(result.conclusion)
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.report is not None:
        print(f"wrote {write_report(result, args.report)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvlife experiment lifetime-hints [--trace FILE] [--json FILE] [--report FILE.html]``."""
    args = build_parser().parse_args(argv)
    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
