"""``kvlife experiment isolation``: can a tenant tell, by timing its own requests, whether
another tenant stored a prompt?

Tenant B times its own probe (``lookup`` + ``load`` of whatever it hits, through a real
``kvlife serve --tenants`` process and its client) for a prompt that tenant A stored just
before (arm *stored*) or for a fresh prompt nobody stored while A stored another prompt
of the same size just before (arm *absent*: so the arms differ only in whether the
probed prompt is A's, not in whether A was active, which alone moves a probe's time:
a server woken by A's put answers B sooner); the arms are interleaved in a seeded
random order, every trial with a new random prompt, probed ``--repeats`` times (the
least time counts, as an attacker filters scheduling noise). The
distinguishing power is the ROC AUC of the probe's time between the arms (the
probability that a *stored* trial is slower than an *absent* one: a hit loads KV; for
the engine's probes, faster: a hit saves prefill; 0.5: no signal), with a bootstrap 95%
interval (2,000 resamples of each arm).

Three probes, same prompts and sizes:

- **cross-tenant** (the isolation claim): A stores in its user scope, B probes with its
  own principal. Target: the interval's upper bound <= 0.55.
- **within one tenant** (the positive control: the probe can see a hit): A stores and A
  probes (through a second connection of A's, as B's is one). Expected: AUC near 1.
- **token-hash baseline** (:class:`~kvlife.experiments.baseline.TokenHashStore`, the
  undefended prefix cache that engines use, keyed by token ids only, in this process):
  A puts, B looks up and copies what it hits. Expected: it leaks (AUC near 1).

Times are wall-clock ``perf_counter`` on a machine other processes share: indicative.
With ``--engine-trials N`` two more probes run through the HF engine
(:class:`~kvlife.engines.hf.HFEngine` on a small random Llama, CPU, its store the
server's client): A generates after each stored prompt (the engine stores its chunks),
the prober times ``prefill`` (lookup + load + prefill of what it did not load), across
tenants and within A's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvlife.core.errors import KVLifeError
from kvlife.core.identity import KVLayout, ModelIdentity, Namespace, NamespaceKind
from kvlife.experiments.baseline import TokenHashStore
from kvlife.tenancy import token_digest

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_chunk=16)
"""64 KiB chunks: a hit's load moves a measurable amount."""
IDENT = ModelIdentity(
    model_id="isolation-probe", weights_digest="w", tokenizer_digest="t", layout=LAYOUT
)
TARGET_UPPER = 0.55


def auc(pos: NDArray[np.float64], neg: NDArray[np.float64]) -> float:
    """P(a positive scores above a negative), ties half (the Mann-Whitney U over n m)."""
    both = np.concatenate([pos, neg])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(both.size, np.float64)
    ranks[order] = np.arange(1, both.size + 1)
    # average ranks of ties
    _, inv, counts = np.unique(both, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    ranks = (sums / counts)[inv]
    u = ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2
    return float(u / (pos.size * neg.size))


def bootstrap(
    pos: NDArray[np.float64], neg: NDArray[np.float64], seed: int, n: int = 2000
) -> tuple[float, float]:
    """95% percentile interval of the AUC, each arm resampled with replacement."""
    rng = np.random.default_rng(seed)
    vals = [
        auc(pos[rng.integers(0, pos.size, pos.size)], neg[rng.integers(0, neg.size, neg.size)])
        for _ in range(n)
    ]
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return float(lo), float(hi)


def summary(
    name: str, stored: list[float], absent: list[float], seed: int, hit_faster: bool = False
) -> dict[str, Any]:
    """The AUC of the time (``hit_faster``: of minus the time, for a probe where a hit
    saves work, the engine's prefill) between the arms."""
    pos, neg = np.asarray(stored), np.asarray(absent)
    sign = -1.0 if hit_faster else 1.0
    lo, hi = bootstrap(sign * pos, sign * neg, seed)
    return {
        "probe": name,
        "direction": "stored faster" if hit_faster else "stored slower",
        "trials_per_arm": [int(pos.size), int(neg.size)],
        "auc": auc(sign * pos, sign * neg),
        "auc_ci95": [lo, hi],
        "median_s": {"stored": float(np.median(pos)), "absent": float(np.median(neg))},
    }


# ---------------------------------------------------------------------------- a server


@contextmanager
def tenant_server(workdir: Path, dram_bytes: int) -> Iterator[tuple[Path, dict[str, str]]]:
    """``kvlife serve --tenants`` with principals a and b (tokens); its socket and the
    tokens. Stopped (SIGTERM) on exit."""
    tokens = {name: secrets.token_hex(16) for name in ("a", "b")}
    cfg = workdir / "tenants.toml"
    cfg.write_text(
        "".join(
            f'[principal.{n}]\ntoken_sha256 = "{token_digest(t)}"\n\n' for n, t in tokens.items()
        )
    )
    sock, pid = workdir / "serve.sock", workdir / "serve.pid"
    cmd = [
        sys.executable, "-m", "kvlife.cli", "serve", str(workdir / "store"),
        "--socket", str(sock), "--pid-file", str(pid), "--dram-bytes", str(dram_bytes),
        "--disk-bytes", "0", "--staging-bytes", str(16 << 20), "--tenants", str(cfg),
    ]  # fmt: skip
    log = (workdir / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, stderr=log, stdout=log)
    try:
        deadline = time.monotonic() + 60
        while not pid.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise KVLifeError(
                    f"kvlife serve did not start: {(workdir / 'serve.log').read_text()}"
                )
            time.sleep(0.02)
        yield sock, tokens
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _prompt(
    rng: np.random.Generator, chunks: int, with_kv: bool = True
) -> tuple[NDArray[np.int64], NDArray[Any]]:
    n = chunks * LAYOUT.tokens_per_chunk
    tokens = rng.integers(0, 50_000, n)
    if not with_kv:
        return tokens, np.zeros(0, np.float16)
    kv = rng.standard_normal(
        (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n, LAYOUT.head_dim)
    ).astype(np.float16)
    return tokens, kv


def _trials(
    trials: int,
    seed: int,
    chunks: int,
    store: Callable[[NDArray[np.int64], NDArray[Any]], None],
    probe: Callable[[NDArray[np.int64]], int],
    repeats: int = 1,
    *,
    with_kv: bool = True,
) -> tuple[list[float], list[float], int]:
    """``trials`` per arm in a seeded interleaving; the probe's seconds per arm (the
    least of ``repeats`` probes of the trial's prompt: what an attacker does against
    scheduling noise) and the hits the first probe saw in the *stored* arm."""
    rng = np.random.default_rng(seed)
    arms = np.array([True] * trials + [False] * trials)
    rng.shuffle(arms)
    stored: list[float] = []
    absent: list[float] = []
    hits = 0
    for warm in range(5):  # warm the paths (connections, allocations), not counted
        tokens, kv = _prompt(rng, chunks, with_kv)
        store(tokens, kv)
        probe(tokens)
        probe(_prompt(rng, chunks, False)[0])
        del warm
    for arm in arms.tolist():
        # both arms make the same work before the probe: the arms differ only in which
        # of two fresh prompts A stores (A stores as much in each: whether A was active
        # is not what is asked)
        tokens, kv = _prompt(rng, chunks, with_kv)
        decoy = rng.integers(0, 50_000, tokens.size)
        store(tokens if arm else decoy, kv)
        dt = math.inf
        got = 0
        for i in range(repeats):
            t0 = time.perf_counter()
            n = probe(tokens)
            dt = min(dt, time.perf_counter() - t0)
            if i == 0:
                got = n
        if arm:
            stored.append(dt)
            hits += got
        else:
            absent.append(dt)
    return stored, absent, hits


def _engine_probes(
    sock: Path, tokens: dict[str, str], trials: int, seed: int, chunks: int, repeats: int
) -> list[dict[str, Any]]:
    """The probes through the HF engine (a small random Llama on the CPU, fed token ids):
    A generates one token after each stored prompt (which stores its chunks), the prober
    times ``prefill`` (lookup + load + prefill of the rest)."""
    from kvlife.client import RemoteStore
    from kvlife.engines.hf import HFEngine
    from kvlife.engines.models import tiny_llama

    loaded = tiny_llama(seed=0, hidden_size=128, layers=4, heads=4, kv_heads=2)
    tpc = 16
    stores = {k: RemoteStore(sock, timeout=60, token=tokens[k[0]]) for k in ("a", "a2", "b")}
    try:
        eng = {
            k: HFEngine.for_model(loaded, st, tokens_per_chunk=tpc)  # type: ignore[arg-type]
            for k, st in stores.items()
        }
        ns = {"a": Namespace(NamespaceKind.USER, "a"), "b": Namespace(NamespaceKind.USER, "b")}
        vocab = int(loaded.model.config.vocab_size)
        out = []
        for name, prober, space, s in (
            ("cross-tenant, HF engine (prefill)", "b", "b", seed + 3),
            ("within one tenant, HF engine (positive control)", "a2", "a", seed + 4),
        ):

            def put(t: NDArray[np.int64], kv: NDArray[Any]) -> None:
                ids = (t % vocab).tolist()
                eng["a"].generate([*ids, 1], ns["a"], max_new_tokens=1, stop_at_eos=False)

            def probe(t: NDArray[np.int64], who: str = prober, sp: str = space) -> int:
                ids = [*(t % vocab).tolist(), 1]
                return len(eng[who].prefill(ids, ns[sp]).loaded_chunks)

            pos, neg, hits = _trials(trials, s, chunks, put, probe, repeats, with_kv=False)
            out.append(summary(name, pos, neg, s, hit_faster=True) | {"hits_in_stored_arm": hits})
        return out
    finally:
        for st in stores.values():
            st.close()


def run_isolation(
    trials: int = 1000,
    seed: int = 0,
    chunks: int = 16,
    repeats: int = 3,
    engine_trials: int = 0,
) -> dict[str, Any]:
    from kvlife.client import RemoteStore

    results: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvlife-isolation-"))
    try:
        # room for many prompts; older ones are evicted as trials go on (in both arms)
        dram = max(256 << 20, 8 * chunks * LAYOUT.chunk_nbytes)
        with tenant_server(workdir, dram) as (sock, tokens):
            a = RemoteStore(sock, timeout=60, token=tokens["a"])
            b = RemoteStore(sock, timeout=60, token=tokens["b"])
            a2 = RemoteStore(sock, timeout=60, token=tokens["a"])  # A's prober, as B's
            ns_a = Namespace(NamespaceKind.USER, "a")
            ns_b = Namespace(NamespaceKind.USER, "b")
            try:

                def put_a(t: NDArray[np.int64], kv: NDArray[Any]) -> None:
                    a.put_prompt(IDENT, ns_a, t, kv)

                def probe(client: RemoteStore, ns: Namespace) -> Callable[[NDArray[np.int64]], int]:
                    def run(t: NDArray[np.int64]) -> int:
                        found = client.lookup(IDENT, ns, t)
                        if found.hits:
                            client.load(found)
                        return len(found.hits)

                    return run

                for name, probe_fn, s in (
                    ("cross-tenant (kvlife serve --tenants)", probe(b, ns_b), seed),
                    ("within one tenant (positive control)", probe(a2, ns_a), seed + 1),
                ):
                    pos, neg, hits = _trials(trials, s, chunks, put_a, probe_fn, repeats)
                    results.append(summary(name, pos, neg, s) | {"hits_in_stored_arm": hits})
                if engine_trials:
                    results += _engine_probes(sock, tokens, engine_trials, seed, chunks, repeats)
            finally:
                a.close()
                a2.close()
                b.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = TokenHashStore(LAYOUT.tokens_per_chunk)

    def put_base(t: NDArray[np.int64], kv: NDArray[Any]) -> None:
        tpc = LAYOUT.tokens_per_chunk
        base.put(t.tolist(), [kv[:, :, :, i : i + tpc] for i in range(0, t.size, tpc)])

    def probe_base(t: NDArray[np.int64]) -> int:
        got = base.lookup(t.tolist())
        out = [np.array(c, copy=True) for c in got]  # B loads what it found
        return len(out)

    pos, neg, hits = _trials(trials, seed + 2, chunks, put_base, probe_base, repeats)
    results.append(
        summary("token-hash baseline (cross-tenant)", pos, neg, seed + 2)
        | {"hits_in_stored_arm": hits}
    )
    cross = results[0]
    return {
        "trials_per_arm": trials,
        "chunks_per_prompt": chunks,
        "repeats": repeats,
        "chunk_bytes": LAYOUT.chunk_nbytes,
        "seed": seed,
        "probes": results,
        "target_cross_tenant_upper": TARGET_UPPER,
        "cross_tenant_meets_target": cross["auc_ci95"][1] <= TARGET_UPPER,
        "pid": os.getpid(),
        "note": "wall-clock on a shared machine: indicative",
    }


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['trials_per_arm']} trials per arm, {result['chunks_per_prompt']} chunks, "
        f"least of {result['repeats']} probes per trial"
    ]
    for p in result["probes"]:
        lo, hi = p["auc_ci95"]
        lines.append(
            f"  {p['probe']:>40}: AUC {p['auc']:.3f} [{lo:.3f}, {hi:.3f}]  "
            f"median stored {p['median_s']['stored'] * 1e6:.0f} us, "
            f"absent {p['median_s']['absent'] * 1e6:.0f} us, hits {p['hits_in_stored_arm']}"
        )
    lines.append(
        f"cross-tenant upper bound <= {result['target_cross_tenant_upper']}: "
        f"{result['cross_tenant_meets_target']}"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = result["probes"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    y = np.arange(len(probes))
    aucs = [p["auc"] for p in probes]
    err = np.array([[p["auc"] - p["auc_ci95"][0], p["auc_ci95"][1] - p["auc"]] for p in probes]).T
    ax.errorbar(aucs, y, xerr=err, fmt="o", capsize=4)
    ax.axvline(0.5, color="grey", lw=0.8)
    ax.axvline(TARGET_UPPER, color="red", lw=0.8, ls="--", label=f"target {TARGET_UPPER}")
    ax.set_yticks(y, [p["probe"] for p in probes])
    ax.set_xlim(0.3, 1.02)
    ax.set_xlabel(f"ROC AUC of the probe's time, 95% bootstrap ({result['trials_per_arm']}/arm)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlife experiment isolation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--trials", type=int, default=1000, help="trials per arm (the issue asks >= 250)"
    )
    parser.add_argument("--quick", action="store_true", help="30 trials per arm (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=16, help="chunks per prompt (64 KiB each)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="probes per trial; the least time counts"
    )
    parser.add_argument(
        "--engine-trials",
        type=int,
        default=0,
        help="trials per arm of the probes through the HF engine (0: not run; needs torch)",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write the figure (PNG) to this file")
    args = parser.parse_args(argv)
    trials = 30 if args.quick else args.trials
    if trials < 2 or args.chunks < 1 or args.repeats < 1:
        print(
            "kvlife experiment isolation: --trials >= 2, --chunks >= 1, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    engine_trials = min(args.engine_trials, 20) if args.quick else args.engine_trials
    result = run_isolation(trials, args.seed, args.chunks, args.repeats, engine_trials)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, Path(args.plot))
    return 0
