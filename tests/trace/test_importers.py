"""Trace importers: real files (skipped when absent), a written bailian file, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvlife.core.errors import KVLifeError
from kvlife.trace.errors import TraceFormatError
from kvlife.trace.importers import read_azure, read_bailian, read_mooncake, read_trace
from kvlife.trace.synthetic import SyntheticConfig, synthetic_trace

TRACES = Path("/work/shared/traces")
MOONCAKE = TRACES / "mooncake_fast25_conversation_trace.jsonl"
AZURE_CODE = TRACES / "azure_llm_2023_code.csv"


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_mooncake_real_trace_figures() -> None:
    tr = read_mooncake(MOONCAKE)
    assert tr.n_requests == 12031
    assert tr.n_touches == 288_500
    assert tr.n_unique_blocks() == 182_790
    assert tr.block_tokens == 512
    assert tr.timestamps[0] == 0.0 and tr.timestamps[-1] > 3000  # about an hour, in seconds
    assert list(tr.request_blocks(0)) == list(range(14))
    assert tr.input_tokens[0] == 6758 and tr.output_tokens[0] == 500


@pytest.mark.skipif(not AZURE_CODE.exists(), reason="Azure trace not present")
def test_azure_real_trace_has_no_reuse() -> None:
    tr = read_azure(AZURE_CODE)
    assert tr.n_requests == 8819
    assert not tr.reuse_info
    assert tr.n_unique_blocks() == tr.n_touches  # every block distinct
    assert 3400 < tr.timestamps[-1] < 3700
    assert tr.input_tokens[0] == 4808 and tr.output_tokens[0] == 10
    assert tr.request_blocks(0).size == -(-4808 // 512)


def _bailian(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bailian_rechains_hash_ids(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40,
         "output_length": 10, "type": "text", "turn": 1, "hash_ids": [7, 8]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 1.0, "input_length": 70,
         "output_length": 5, "type": "text", "turn": 2, "hash_ids": [7, 8, 9, 10]},
        {"chat_id": 3, "parent_chat_id": -1, "timestamp": 2.0, "input_length": 33,
         "output_length": 5, "type": "image", "turn": 1, "hash_ids": [8, 7]},
    ]  # fmt: skip
    tr = read_bailian(_bailian(tmp_path / "b.jsonl", rows))
    assert tr.block_tokens == 16 and tr.n_requests == 3
    a, b, c = (list(tr.request_blocks(i)) for i in range(3))
    assert b[:2] == a  # the shared prefix keeps its ids
    assert len(set(c) & set(a)) == 0  # same hashes in another order: another prefix
    assert [tr.category_names[k] for k in tr.categories] == ["text", "text", "image"]
    assert list(tr.timestamps) == [0.5, 1.0, 2.0]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}',
         "input_length"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, "x"]}',
         "hash_ids"),
        ('{"timestamp": "now", "input_length": 1, "output_length": 1, "hash_ids": []}',
         "timestamp"),
    ],
)  # fmt: skip
def test_mooncake_bad_field_names_file_line_field(tmp_path: Path, line: str, field: str) -> None:
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}'
    p = tmp_path / "m.jsonl"
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_mooncake(p)
    assert info.value.line == 2 and info.value.field == field
    assert f"{p}:2" in str(info.value) and field in str(info.value)
    assert isinstance(info.value, KVLifeError)


def test_bad_json_and_backwards_time(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": []}\n{oops\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl:2: not JSON"):
        read_mooncake(p)
    p.write_text(
        '{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": []}\n'
        '{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": []}\n'
    )
    with pytest.raises(TraceFormatError, match="goes backwards"):
        read_mooncake(p)


def test_bailian_and_azure_bad_fields(tmp_path: Path) -> None:
    row = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40,
           "output_length": 10, "type": "", "turn": 1, "hash_ids": [7]}  # fmt: skip
    with pytest.raises(TraceFormatError, match="'type'"):
        read_bailian(_bailian(tmp_path / "b.jsonl", [row]))
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,x\n")
    with pytest.raises(TraceFormatError) as info:
        read_azure(p)
    assert info.value.line == 2 and info.value.field == "GeneratedTokens"
    p.write_text("when,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="header"):
        read_azure(p)
    with pytest.raises(KVLifeError, match="unknown trace format"):
        read_trace(p, "nope")
    with pytest.raises(KVLifeError, match="cannot open"):
        read_mooncake(tmp_path / "missing.jsonl")


def test_synthetic_is_seeded_labelled_and_shares_prefixes() -> None:
    cfg = SyntheticConfig(seed=3, sessions=60)
    a, b = synthetic_trace(cfg), synthetic_trace(cfg)
    assert np.array_equal(a.blocks, b.blocks) and np.array_equal(a.timestamps, b.timestamps)
    c = synthetic_trace(SyntheticConfig(seed=4, sessions=60))
    assert not np.array_equal(a.blocks, c.blocks)
    assert set(a.category_names) == {"chat", "rag", "agent", "reasoning"}
    assert len(a.tenant_names) == 4 and all(n.startswith("tenant-") for n in a.tenant_names)
    assert bool(np.all(np.diff(a.timestamps) >= 0))
    # reuse exists (system prompts, chat history, RAG documents), but not everything is reused
    assert a.n_unique_blocks() < a.n_touches
    # tenants never share blocks: each has its own system prompt and corpus
    owners: dict[int, int] = {}
    for i in range(a.n_requests):
        for blk in a.request_blocks(i).tolist():
            assert owners.setdefault(blk, int(a.tenants[i])) == int(a.tenants[i])
    reasoning = a.categories == a.category_names.index("reasoning")
    assert a.output_tokens[reasoning].mean() > 4 * a.output_tokens[~reasoning].mean()
