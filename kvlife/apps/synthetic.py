"""``kvlife demo --synthetic``: a multi-tenant chat workload through a real store, end to end.

No model: a deterministic KV generator stands in for the engine (the KV of a chunk is
BLAKE3-XOF of its key, so any served chunk can be checked bit for bit against what a
recompute would give), which lets the store be exercised at scale, with fault injection
and a restart, in seconds (``kvlife demo`` runs the real model). The workload: two
organisations whose users share their organisation's system prompt, several turns per
user with the assistant's reply appended to the history. Midway, one byte of a stored
replica is flipped on disk; the store must catch it on load, recompute, and count it.
Then the store is closed and reopened (a restart) and every user sends one more turn.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import blake3
import numpy as np
from tqdm import tqdm

from kvlife.core.events import JsonlSink
from kvlife.core.identity import (
    ChunkKey,
    KVLayout,
    ModelIdentity,
    Namespace,
    NamespaceKind,
    prompt_chunk_keys,
)
from kvlife.report import format_table
from kvlife.store import KVStore
from kvlife.tiers.disk import DiskTier

MiB = 1 << 20
SMOLLM2_LAYOUT = KVLayout(
    num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", tokens_per_chunk=256
)
"""SmolLM2-135M's KV shape (23,040 bytes per token in fp16)."""
VOCAB = 49_152
SYSTEM_TOKENS = 1024
USER_TOKENS = (120, 400)
REPLY_TOKENS = (80, 300)


def synthetic_kv(key: ChunkKey, layout: KVLayout) -> np.ndarray:
    """The stand-in engine's KV of one chunk: a pure function of the chunk key."""
    raw = blake3.blake3(key).digest(length=layout.chunk_nbytes)
    return np.frombuffer(raw, dtype=np.uint16).view(np.float16).reshape(layout.chunk_shape)


@dataclass
class PhaseStats:
    name: str
    requests: int = 0
    prompt_tokens: int = 0
    tokens_dram: int = 0
    tokens_disk: int = 0
    tokens_computed: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    put_s: float = 0.0
    corrupt_caught: int = 0
    wrong_kv_served: int = 0

    @property
    def hit_ratio(self) -> float:
        return (self.tokens_dram + self.tokens_disk) / max(self.prompt_tokens, 1)


@dataclass
class User:
    name: str
    org: str
    history: list[int] = field(default_factory=list)


def _turn(
    store: KVStore,
    identity: ModelIdentity,
    user: User,
    system: dict[str, list[int]],
    rng: np.random.Generator,
    stats: PhaseStats,
) -> None:
    ns = Namespace(NamespaceKind.ORGANISATION, user.org)
    lay = identity.layout
    user_msg = rng.integers(0, VOCAB, int(rng.integers(*USER_TOKENS))).tolist()
    prompt = system[user.org] + user.history + user_msg
    t0 = time.perf_counter()
    hit = store.lookup(identity, ns, prompt)
    t1 = time.perf_counter()
    loaded = store.load(hit, request_id=f"{user.name}#{len(user.history)}")
    t2 = time.perf_counter()
    keys = prompt_chunk_keys(identity, ns, prompt)
    for i, arr in enumerate(loaded.arrays):
        if not np.array_equal(arr.view(np.uint16), synthetic_kv(keys[i], lay).view(np.uint16)):
            stats.wrong_kv_served += 1
    stats.corrupt_caught += len(loaded.corrupt)
    # "prefill" the rest: every full chunk's KV, the cached ones included, for the put
    kv = [synthetic_kv(k, lay) for k in keys]
    t3 = time.perf_counter()
    store.put_prompt(identity, ns, prompt, kv)
    t4 = time.perf_counter()
    stats.requests += 1
    stats.prompt_tokens += len(prompt)
    stats.tokens_dram += loaded.tiers.get("dram", 0) * lay.tokens_per_chunk
    stats.tokens_disk += loaded.tiers.get("disk", 0) * lay.tokens_per_chunk
    stats.tokens_computed += len(prompt) - loaded.loaded * lay.tokens_per_chunk
    stats.lookup_s += t1 - t0
    stats.load_s += t2 - t1
    stats.put_s += t4 - t3
    reply = rng.integers(0, VOCAB, int(rng.integers(*REPLY_TOKENS))).tolist()
    user.history += user_msg + reply


def _flip_one_byte(store_dir: Path, rng: np.random.Generator) -> str:
    """Damage one stored payload on disk the way a bad sector or torn write would."""
    segs = sorted((store_dir / "disk" / "segments").glob("seg-*.kvs"))
    segs = [s for s in segs if s.stat().st_size > 0]
    if not segs:
        return "no segment to damage"
    seg = segs[0]
    frame = 4096 + SMOLLM2_LAYOUT.chunk_nbytes
    frames = seg.stat().st_size // frame
    off = int(rng.integers(0, max(frames, 1))) * frame + 4096 + 12345
    with seg.open("r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x40]))
    return f"{seg.name} at byte {off}"


def run_synthetic_demo(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    identity = ModelIdentity(
        model_id="SmolLM2-135M-Instruct (synthetic KV)",
        weights_digest="synthetic-v1",
        tokenizer_digest="synthetic-tok-v1",
        layout=SMOLLM2_LAYOUT,
    )
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="kvlife-demo-", dir=".")
        store_dir = Path(tmp)
    else:
        store_dir = Path(args.dir)
    shared_text = rng.integers(0, VOCAB, SYSTEM_TOKENS).tolist()
    # both organisations use the same system prompt text: namespaces must keep them apart
    system = {"acme": shared_text, "globex": list(shared_text)}
    users = [User(f"user{i}", "acme" if i % 3 else "globex") for i in range(args.users)]
    dram_bytes, disk_bytes = args.dram_mib * MiB, args.disk_mib * MiB
    phases: list[PhaseStats] = []
    fault = ""
    started = time.perf_counter()
    sink = JsonlSink(args.events) if args.events else None
    try:
        store = KVStore.open(store_dir, dram_bytes=dram_bytes, disk_bytes=disk_bytes, sink=sink)
        total = args.users * args.turns + args.users
        with tqdm(total=total, desc="demo requests", unit="req", leave=False) as bar:
            for turn in range(args.turns):
                if turn == args.turns // 2 and not fault:
                    store.flush()
                    fault = _flip_one_byte(store_dir, rng)
                    phases.append(PhaseStats("turns after fault"))
                elif not phases:
                    phases.append(PhaseStats("turns before fault"))
                for user in users:
                    _turn(store, identity, user, system, rng, phases[-1])
                    bar.update()
            written = _disk(store).stats.bytes_written
            store.close()
            store = KVStore.open(store_dir, dram_bytes=dram_bytes, disk_bytes=disk_bytes, sink=sink)
            recovered = store.counters.recovered
            phases.append(PhaseStats("after restart"))
            for user in users:
                _turn(store, identity, user, system, rng, phases[-1])
                bar.update()
        info = store.info()
        written += _disk(store).stats.bytes_written
        read = _disk(store).stats.bytes_read
        store.close()
    finally:
        if sink is not None:
            sink.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started

    headers = [
        "phase",
        "requests",
        "prompt tok",
        "from DRAM",
        "from disk",
        "computed",
        "hit ratio",
        "corrupt caught",
        "wrong KV served",
    ]
    rows = [
        [
            p.name,
            str(p.requests),
            str(p.prompt_tokens),
            str(p.tokens_dram),
            str(p.tokens_disk),
            str(p.tokens_computed),
            f"{p.hit_ratio:.1%}",
            str(p.corrupt_caught),
            str(p.wrong_kv_served),
        ]
        for p in phases
    ]
    print(
        f"kvlife demo: {args.users} users x {args.turns} turns + 1 after restart, "
        f"{identity.model_id}, {SMOLLM2_LAYOUT.bytes_per_token} B of KV per token"
    )
    print(format_table(headers, rows))
    c = info.lifetime_counters
    disk = next(t for t in info.tiers if t.name == "disk")
    summary = [
        ["fault injected", fault or "none"],
        ["objects recovered after restart", str(recovered)],
        ["demotions DRAM->disk / promotions", f"{c['demotions']} / {c['promotions']}"],
        ["disk bytes written (both runs)", f"{written / MiB:.1f} MiB"],
        ["disk bytes read (after restart)", f"{read / MiB:.1f} MiB"],
        ["direct I/O", str(disk.details.get("direct_io"))],
        ["lookup time (all requests)", f"{sum(p.lookup_s for p in phases) * 1e3:.1f} ms"],
        ["load time (all requests)", f"{sum(p.load_s for p in phases) * 1e3:.1f} ms"],
        ["put time (all requests)", f"{sum(p.put_s for p in phases) * 1e3:.1f} ms"],
        ["wall time", f"{elapsed:.1f} s"],
    ]
    print()
    print(format_table(["summary", ""], summary))
    wrong = sum(p.wrong_kv_served for p in phases)
    caught = sum(p.corrupt_caught for p in phases)
    print()
    print(
        f"verified every served chunk bit for bit: {wrong} wrong; "
        f"{caught} corrupt replica(s) caught and recomputed"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "phases": [asdict(p) | {"hit_ratio": p.hit_ratio} for p in phases],
                    "fault": fault,
                    "recovered": recovered,
                    "lifetime_counters": c,
                    "wall_s": elapsed,
                },
                indent=2,
            )
        )
    return 0 if wrong == 0 else 1


def _disk(store: KVStore) -> DiskTier:
    tier = store.tier("disk")
    assert isinstance(tier, DiskTier)
    return tier
