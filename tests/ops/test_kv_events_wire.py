"""The KV-events wire format against vLLM's own types: any batch kvlife's encoder makes
decodes with vLLM's ``msgspec.msgpack.Decoder(KVEventBatch)`` to the same events and
re-encodes with vLLM's encoder to the same bytes (hypothesis; one vLLM process answers
every example). Skipped where the vLLM virtualenv is absent."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.ops.kv_events import all_blocks_cleared, block_removed, block_stored, encode_batch
from tests.ops.test_kv_events import VLLM
from tests.server.conftest import ROOT, child_env

ORACLE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
encoder = msgspec.msgpack.Encoder()

def show(e):
    d = {"type": type(e).__name__}
    for f in e.__struct_fields__:
        v = getattr(e, f)
        if isinstance(v, bytes):
            v = v.hex()
        elif isinstance(v, list):
            v = [x.hex() if isinstance(x, bytes) else x for x in v]
        d[f] = v
    return d

print("ready", flush=True)
for line in sys.stdin:
    payload = bytes.fromhex(line.strip())
    try:
        batch = decoder.decode(payload)
    except Exception as exc:
        print(json.dumps({"error": repr(exc)}), flush=True)
        continue
    print(json.dumps({
        "same": encoder.encode(batch) == payload,
        "ts": batch.ts,
        "rank": batch.data_parallel_rank,
        "events": [show(e) for e in batch.events],
    }), flush=True)
"""


@pytest.fixture(scope="module")
def oracle() -> Iterator[subprocess.Popen[str]]:
    if VLLM is None:
        pytest.skip("needs the vLLM virtualenv (.venv-vllm)")
    proc = subprocess.Popen(
        [VLLM, "-c", ORACLE],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=60)


hashes = st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=5)
names = st.text(min_size=1, max_size=12)
stored = st.builds(
    block_stored,
    hashes,
    st.none() | st.binary(min_size=32, max_size=32),
    st.integers(0, 1 << 20),
    names,
    st.just("") | names,
)
removed = st.builds(block_removed, hashes, names)
events = st.lists(stored | removed | st.builds(all_blocks_cleared), max_size=8)


@settings(max_examples=100, deadline=None)
@given(
    events,
    st.floats(allow_nan=False, allow_infinity=False),
    st.none() | st.integers(0, 1000),
)
def test_vllm_decodes_every_batch(
    oracle: subprocess.Popen[str], batch: list[dict[str, Any]], ts: float, rank: int | None
) -> None:
    assert oracle.stdin is not None and oracle.stdout is not None
    payload = encode_batch(ts, batch, rank)
    oracle.stdin.write(payload.hex() + "\n")
    oracle.stdin.flush()
    got = json.loads(oracle.stdout.readline())
    assert "error" not in got, got
    assert got["same"], "vLLM's encoder writes other bytes"
    assert got["ts"] == ts and got["rank"] == rank
    assert [e["type"] for e in got["events"]] == [e["type"] for e in batch]
    for mine, theirs in zip(batch, got["events"], strict=True):
        for field, value in mine.items():
            if field == "type":
                continue
            if isinstance(value, bytes):
                value = value.hex()
            elif isinstance(value, list):
                value = [v.hex() if isinstance(v, bytes) else v for v in value]
            assert theirs[field] == value, field
