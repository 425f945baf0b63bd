"""Validation of the SSD model against Desnoyers' closed form for greedy GC.

Why: a device model whose WAF is off makes every conclusion built on it wrong. Under
uniformly random overwrites of a full device with greedy victim selection, Desnoyers
("Analytic modeling of SSD write performance", SYSTOR 2012) derives, for large blocks in
steady state,

    WAF = alpha / (alpha + W0(-alpha * exp(-alpha))),   alpha = physical / logical = 1 + op

with W0 the principal branch of the Lambert W function. :func:`measure_uniform_waf` runs
the same workload on :class:`~kvlife.sim.ssd.Ftl` (fill the device, overwrite it several
times to reach steady state, then measure) so that the two can be compared; tests and the
benchmark (:mod:`kvlife.sim.bench_ssd`) use it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvlife.sim.errors import DeviceConfigError
from kvlife.sim.ssd import Ftl, SSDConfig

VALIDATION_OPS = (0.07, 0.125, 0.20, 0.28, 0.50)
"""Over-provisioning points of the validation table."""


def greedy_waf_closed_form(op: float) -> float:
    """Desnoyers' steady-state WAF of greedy GC under uniform random writes, alpha = 1 + op."""
    if not (math.isfinite(op) and op > 0):
        raise DeviceConfigError(f"over-provisioning must be a finite number > 0, got {op!r}")
    from scipy.special import lambertw

    a = 1.0 + op
    w0 = float(lambertw(-a * math.exp(-a), 0).real)
    return a / (a + w0)


@dataclass(frozen=True, slots=True)
class UniformWafRow:
    """One validation point: simulated WAF next to the closed form."""

    op: float
    """Requested over-provisioning."""
    effective_op: float
    """physical / logical - 1 after rounding the logical size to whole pages."""
    pages_per_block: int
    """Pages per erase block of the simulated device."""
    logical_pages: int
    """Logical pages of the simulated device."""
    closed_form_waf: float
    """Desnoyers' WAF at alpha = 1 + effective_op."""
    simulated_waf: float
    """NAND / host page writes over the measured window."""
    error_pct: float
    """(simulated - closed form) / closed form, in percent."""
    host_page_writes: int
    """Host pages written in the measured window."""
    seconds: float
    """Wall time of the whole run (fill, warm-up, measurement)."""


def measure_uniform_waf(
    op: float,
    *,
    n_blocks: int,
    pages_per_block: int = 256,
    warmup_capacities: float = 4.0,
    measure_capacities: float = 4.0,
    seed: int = 0,
) -> UniformWafRow:
    """Fill a device, overwrite it at random to steady state, measure WAF over a window."""
    cfg = SSDConfig(
        n_blocks=n_blocks,
        op=op,
        page_bytes=4096,
        block_bytes=4096 * pages_per_block,
    )
    t0 = time.perf_counter()
    ftl = Ftl(cfg)
    ftl.fill_sequential()
    ftl.write_uniform_random(int(warmup_capacities * cfg.logical_pages), seed=seed)
    before = ftl.counters()
    ftl.write_uniform_random(int(measure_capacities * cfg.logical_pages), seed=seed + 1)
    window = ftl.counters().since(before)
    closed = greedy_waf_closed_form(cfg.effective_op)
    sim = window.waf
    return UniformWafRow(
        op=op,
        effective_op=cfg.effective_op,
        pages_per_block=cfg.pages_per_block,
        logical_pages=cfg.logical_pages,
        closed_form_waf=closed,
        simulated_waf=sim,
        error_pct=(sim - closed) / closed * 100.0,
        host_page_writes=window.host_page_writes,
        seconds=time.perf_counter() - t0,
    )


__all__ = ["VALIDATION_OPS", "UniformWafRow", "greedy_waf_closed_form", "measure_uniform_waf"]
