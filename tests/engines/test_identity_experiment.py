"""`kvlife experiment identity` on a tiny model: kvlife serves no wrong KV, the token-hash
baseline does, and its damage is measured rather than assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from kvlife.experiments.identity import GREEDY_TOKENS, main


def test_identity_experiment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out, png = tmp_path / "id.json", tmp_path / "id.png"
    assert main(["--tiny", "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    rows = {r["perturbation"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "same setting (control)",
        "other weights",
        "LoRA adapter",
        "other tokenizer",
        "other start position",
        "other KV dtype",
        "other tenant",
    }
    control = rows.pop("same setting (control)")
    # the control proves both stores do serve: a hit with exact KV and no damage
    for store in ("kvlife", "token_hash"):
        assert control[store]["chunks_served"] == 8 and control[store]["wrong_chunks"] == 0
        assert control[store]["max_logit_diff"] < 1e-4
    tenant = rows.pop("other tenant")
    assert tenant["kvlife"]["chunks_served"] == 0
    assert tenant["token_hash"]["cross_tenant_hits"] == tenant["token_hash"]["chunks_served"] == 8
    for name, row in rows.items():
        assert row["kvlife"]["chunks_served"] == 0, name
        assert row["kvlife"]["wrong_chunks"] == 0, name
        base = row["token_hash"]
        assert base["chunks_served"] == 8 and base["wrong_chunks"] == 8, name
        assert base["max_logit_diff"] > 1e-3, name
        assert 0 <= base["greedy_agreement"] <= GREEDY_TOKENS
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".kvlife-identity-*"))
