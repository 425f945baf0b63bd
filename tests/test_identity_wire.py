"""Guard for the store server's wire format (``kvlife.server.protocol``): an identity
sent to ``kvlife serve`` must arrive with the same digest, tensor-parallel shard and
engine digest included, or a served store would key another shard's or another engine's
KV the same (isolation silently lost). Skipped while the server is not in the tree."""

from __future__ import annotations

import pytest

from kvlife.core.identity import KVLayout, ModelIdentity

protocol = pytest.importorskip("kvlife.server.protocol")


@pytest.mark.parametrize(
    "identity",
    [
        ModelIdentity("m", "w", "t", KVLayout(30, 3, 64, "float16", 64)),
        ModelIdentity(
            "m",
            "w",
            "t",
            KVLayout(30, 1, 64, "bfloat16", 64, tp_rank=1, tp_size=2, kv_head_start=1),
            "rope",
            "lora#1",
            "ld",
            engine_digest="vllm-0.32.0-bs32",
        ),
        ModelIdentity(
            "m",
            "w",
            "t",
            KVLayout(15, 3, 64, "float16", 64, pp_rank=1, pp_size=2, first_layer=15),
        ),
    ],
)
def test_identity_round_trips_the_wire_with_its_digest(identity: ModelIdentity) -> None:
    wire = protocol.encode_identity(identity)
    protocol.check_identity(wire)
    assert protocol.decode_identity(wire).digest == identity.digest
