"""One tensor-parallel rank's load failing under a real vLLM (CPU build, TP=2: two worker
processes, each with its kvlife connector, on one store ``kvlife serve`` serves): every
frame of rank 1's shard is damaged, rank 0's is whole. Rank 1 reports the blocks through
``get_block_ids_with_load_errors``; vLLM's ``KVOutputAggregator`` unions the ranks'
failed blocks and its scheduler recomputes them, so no rank uses what rank 0 loaded
while rank 1's half is missing: the outputs equal those of the engine that stored the
prompts. The campaign's ``tp-rank-load-fails`` kind (kvlife/experiments/campaign/vllm.py).
Two TP=2 engines and two server starts: four to six minutes on two shared cores, so it
runs with ``make test-slow``."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from kvlife.experiments.campaign.tally import KindTally
from kvlife.experiments.campaign.vllm import CHUNK, tp_rank_load_fails

pytest.importorskip("kvlife.client.remote")


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 binds a core per rank")
def test_one_rank_failing_its_load_is_recomputed_never_used_half_loaded(
    tiny_model: Path, tmp_path: Path
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(4 * CHUNK + 7)] for _ in range(2)]
    t = KindTally("tp-rank-load-fails", "vllm")
    got = tp_rank_load_fails(sys.executable, tiny_model, tmp_path, prompts, t, "tp")
    assert got is not None and t.injections == 1, t.notes
    requests, tokens = got
    # vLLM's scheduler saw the failed blocks (merged from rank 1) and recomputed them
    assert t.detections == 1 and requests >= 1 and tokens >= CHUNK, t.notes
    assert t.lost_explained == 2 * 4  # rank 1's frames: two prompts of four chunks
    # and the outputs are the reference's: nothing half-loaded was used
    assert t.served_chunks == 2 and t.wrong_chunks == 0 and t.wrong_bytes == 0
