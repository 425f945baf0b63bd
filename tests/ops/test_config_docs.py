"""The example configuration in docs/operations.md passes ``kvlife config check``."""

from __future__ import annotations

import re
from pathlib import Path

from kvlife.ops.config import check_file
from kvlife.planner import PrefillProfile
from tests.server.conftest import ROOT


def test_documented_example_passes(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc[doc.index("## Configuration file") :]
    example = re.search(r"```toml\n(.*?)```", section, re.S)
    assert example is not None
    path = tmp_path / "kvlife.toml"
    path.write_text(example.group(1))
    PrefillProfile(0.001, 1e-5, 1e-9).save(tmp_path / "prefill-profile.json")
    config, issues = check_file(path)
    assert issues == [] and config is not None
    assert [t.name for t in config.store.chain] == ["dram", "ssd"]
    assert config.server is not None and config.server.kv_events is not None
    assert config.planner is not None and config.connector_extra()["kvlife.store"] == "served"
