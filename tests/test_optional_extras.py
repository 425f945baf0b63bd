"""The store, the server and the client import without the optional extras' packages
(redis-py for the remote tiers, mooncake; prometheus-client and rich of the ops extra):
the vLLM virtualenv installs kvlife without them, and an engine that never configures a
remote tier, or a server run without ``--metrics``, must not need them."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKED = ("redis", "mooncake", "prometheus_client", "rich")
MODULES = ("kvlife.store", "kvlife.server.server", "kvlife.client.remote", "kvlife.cli")


@pytest.mark.parametrize("module", MODULES)
def test_imports_without_the_remote_extras(module: str) -> None:
    code = (
        "import sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # an import of it raises ImportError\n"
        f"import {module}\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
