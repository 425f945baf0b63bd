"""Shared fixtures: a tiny KV layout and model identity, deterministic KV payloads; the
hypothesis budget profiles of the default suite and of the slow tier."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from hypothesis import settings

from kvlife.core.identity import KVLayout, ModelIdentity

# session-scoped Redis servers for remote tiers; the vLLM virtualenv (tests/vllm) has no
# redis-py and runs no remote test
pytest_plugins = (
    ["tests.remote.servers", "tests.remote.mooncake_env"]
    if importlib.util.find_spec("redis") is not None
    else []
)

# Hypothesis budgets. The expensive property tests (state machines, power cuts, fuzzers that
# start stores) take their example counts from budget(): a small one in the default suite
# (which must stay under 15 minutes), the long one under the "slow" profile. The profile is
# "slow" when the -m expression selects slow tests (make test-slow) or when
# KVLIFE_HYPOTHESIS_PROFILE=slow (e.g. `KVLIFE_HYPOTHESIS_PROFILE=slow pytest -q tests/x.py`
# runs the default tests of x.py at their long budgets). Tests that set no max_examples get
# hypothesis' usual 100 under both.
settings.register_profile("default", max_examples=100)
settings.register_profile("slow", max_examples=100)
HYPOTHESIS_PROFILE_ENV = "KVLIFE_HYPOTHESIS_PROFILE"


def pytest_configure(config: pytest.Config) -> None:
    # before collection: the test modules build their settings when imported
    markexpr = str(config.getoption("markexpr", "") or "")
    selects_slow = "slow" in markexpr and "not slow" not in markexpr
    settings.load_profile(
        os.environ.get(HYPOTHESIS_PROFILE_ENV) or ("slow" if selects_slow else "default")
    )


def budget(default: int, slow: int) -> int:
    """An expensive test's budget (examples, steps): ``default`` in the default suite,
    ``slow`` under the slow profile (see above)."""
    return slow if settings.get_current_profile_name() == "slow" else default


TINY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", tokens_per_chunk=16)


def tiny_identity(**changes: str) -> ModelIdentity:
    fields = {"model_id": "tiny", "weights_digest": "w0", "tokenizer_digest": "t0"}
    fields.update(changes)
    return ModelIdentity(layout=TINY, **fields)


def prompt_kv(seed: int, ntokens: int, layout: KVLayout = TINY) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (tokens, kv) for a prompt: KV shaped (layers, 2, heads, T, dim)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, ntokens)
    kv = rng.standard_normal(
        (layout.num_layers, 2, layout.num_kv_heads, ntokens, layout.head_dim)
    ).astype(np.float16)
    return tokens, kv


@pytest.fixture
def identity() -> ModelIdentity:
    return tiny_identity()


@pytest.fixture
def server_hashes_puts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged puts in this process tell the server what is written (``put_written``)
    and the server hashes it, instead of the client sealing each chunk as it copies it:
    the path of a put larger than ``SEAL_PUT_BYTES`` and of a client without the
    extension (kvlife/client/puts.py)."""
    import kvlife.client.puts as client_puts

    monkeypatch.setattr(client_puts, "SEAL_PUT_BYTES", -1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave no killed server's arena in shared memory: crash tests SIGKILL servers, and a
    killed server cannot remove its files (kvlife.server.stale_arenas). Once, by the
    process that ran or coordinated every test (not an xdist worker, whose neighbour may
    be inspecting a server it just killed), sparing files made or sized in the last half
    minute (another session's crash test may be looking at a server it just started
    and killed)."""
    if hasattr(session.config, "workerinput"):
        return
    from kvlife.server.stale_arenas import sweep
    from kvlife.tiers.shm import SHM_DIR

    sweep(SHM_DIR, grace_s=30)
