"""A vLLM engine's prefill profile, measured once on the engine itself: what the
connector's planner weighs a load against (docs/planner.md).

:func:`measure_prefill` times prompts of random tokens through a running ``vllm.LLM``
(one output token each, so the time is vLLM's time to first token: the prefill and one
sampling step), each after a prefix of ``start`` tokens that vLLM's own prefix cache
already holds when the engine has prefix caching on, and fits
:class:`~kvlife.planner.PrefillProfile` to them. The result is saved as JSON and named
by the ``[planner] prefill_profile`` of a ``kvlife.config`` file; the scheduler-side
connector reads it at start-up and refits it to nothing further (vLLM does not tell the
connector how long a prefill took), so it is measured on the engine as it will run
(model, dtype, threads) and measured again when that changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlife.planner import PrefillProfile
from kvlife.planner.cost import PrefillSample

POINTS: tuple[tuple[int, int], ...] = ((0, 64), (0, 256), (0, 512), (0, 1024), (512, 256))
"""``(start, length)`` of the timed prompts: lengths over the range the planner decides
on, and one after a cached prefix."""


def measure_prefill(
    llm: Any,
    points: Sequence[tuple[int, int]] = POINTS,
    *,
    repeats: int = 2,
    seed: int = 0,
    label: str = "",
) -> PrefillProfile:
    """Time one-token generations of ``length`` new tokens after ``start`` cached ones
    (the best of ``repeats``; a point with ``start`` is taken only when the engine has
    prefix caching, and points past ``max_model_len`` are skipped) and fit the profile."""
    from vllm import SamplingParams

    cfg = llm.llm_engine.model_config
    vocab = int(cfg.hf_config.vocab_size)
    max_len = int(cfg.max_model_len)
    caching = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    samples = []
    for start, length in points:
        if start + length >= max_len or (start and not caching):
            continue
        best = float("inf")
        for _ in range(repeats):
            # fresh tokens each repeat (nothing cached beyond the intended prefix)
            prefix = rng.integers(5, vocab, start).tolist()
            tail = rng.integers(5, vocab, length).tolist()
            if start:
                llm.generate([{"prompt_token_ids": prefix}], sp, use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prefix + tail}], sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t0)
        samples.append(PrefillSample(start, length, best))
    return PrefillProfile.fit(samples, label or f"vllm {cfg.model} dtype={cfg.dtype}")
