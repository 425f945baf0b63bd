"""How the vLLM connector and the SGLang backend find their store: one embedded store
shared by every connector of a process, refused clearly when another process holds it;
the address checked; lifecycle events fanned out to each subscriber."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlife.core.errors import InvalidArgument
from kvlife.core.identity import PUBLIC, ModelIdentity
from kvlife.engines.vllm.stores import EmbeddedStoreInUse, StoreAddress, close_all, open_store
from tests.conftest import prompt_kv


def test_connectors_of_one_process_share_one_embedded_store(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    addr = StoreAddress.from_extra_config({"kvlife.path": str(tmp_path), "kvlife.dram_mib": 4})
    scheduler, worker = open_store(addr), open_store(addr)
    assert scheduler.store is worker.store
    tokens, kv = prompt_kv(3, 32)
    worker.store.put_prompt(identity, PUBLIC, tokens, kv)
    assert scheduler.store.lookup(identity, PUBLIC, tokens).tokens == 32
    kinds = {e.kind for e in scheduler.take_events()}
    assert "index" in kinds and {e.kind for e in worker.take_events()} == kinds
    assert scheduler.take_events() == []  # drained
    worker.release()
    assert scheduler.store.lookup(identity, PUBLIC, tokens).tokens == 32  # still open
    scheduler.release()
    scheduler.release()  # idempotent
    again = open_store(addr)  # reopened from disk: flushed at the last release
    assert again.store.lookup(identity, PUBLIC, tokens).tokens == 32
    close_all()


def test_a_store_held_by_another_process_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from kvlife.store import KVStore
                s = KVStore.open({str(tmp_path)!r}, dram_bytes=1 << 20, disk_bytes=1 << 24)
                print("held", flush=True)
                sys.stdin.read()
                s.close()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(EmbeddedStoreInUse, match=r"kvlife serve.*kvlife\.socket"):
            open_store(StoreAddress(path=str(tmp_path)))
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "exactly one of"),
        ({"kvlife.path": "a", "kvlife.socket": "b"}, "exactly one of"),
        ({"kvlife.path": "a", "kvlife.dram_mib": -1}, "kvlife.dram_mib"),
        ({"kvlife.path": "a", "kvlife.write_through": "yes"}, "write_through"),
        ({"kvlife.socket": "s", "kvlife.events": "e.jsonl"}, "embedded store"),
        ({"kvlife.socket": "s", "kvlife.direct_reads": "yes"}, "direct_reads"),
    ],
)
def test_bad_addresses_are_typed_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        StoreAddress.from_extra_config(extra)


def test_kvlife_events_logs_the_embedded_stores_events_once_per_process(
    tmp_path: Path, identity: ModelIdentity
) -> None:
    """``kvlife.events``: the store's own lifecycle events, written once however many
    connectors share it, valid schema v1, and what they say is live is what the store
    indexes; a connector asking the same store for another log is refused."""
    import json

    from kvlife.trace.schema import validate_event

    log = tmp_path / "events.jsonl"
    extra = {"kvlife.path": str(tmp_path / "kv"), "kvlife.dram_mib": 4, "kvlife.events": str(log)}
    addr = StoreAddress.from_extra_config(extra)
    scheduler, worker = open_store(addr), open_store(addr)
    with pytest.raises(InvalidArgument, match=r"kvlife\.events"):
        open_store(StoreAddress.from_extra_config({**extra, "kvlife.events": "other.jsonl"}))
    tokens, kv = prompt_kv(3, 32)
    worker.store.put_prompt(identity, PUBLIC, tokens, kv)
    hit = scheduler.store.lookup(identity, PUBLIC, tokens)
    scheduler.store.load(hit)
    from kvlife.store import KVStore

    assert isinstance(worker.store, KVStore)  # embedded
    indexed = {k.hex() for k in worker.store.indexed_keys()}
    worker.release()
    scheduler.release()  # the last release closes the store and the log
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for r in records:
        validate_event(r)
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(set(seqs))  # one writer: each event once, in order
    kinds = [r["kind"] for r in records]
    assert kinds.count("put") == kinds.count("index") == len(indexed) == 2
    assert kinds.count("load") == 2
    assert {r["key"] for r in records if r["kind"] == "index"} == indexed
    again = open_store(addr)  # reopened: the log is appended to, not replaced
    again.release()
    assert len(log.read_text().splitlines()) > len(records)
    close_all()


def test_the_scheduler_side_opens_a_served_store_without_direct_reads() -> None:
    """``kvlife.direct_reads`` (default true) is for the workers, which load; the
    scheduler side only counts hits, and its lookups would name frames it never reads."""
    worker = StoreAddress.from_extra_config({"kvlife.socket": "s"})
    assert worker.direct_reads is True
    scheduler = worker.without_direct_reads()
    assert scheduler.direct_reads is False and scheduler.socket == "s"
    off = StoreAddress.from_extra_config({"kvlife.socket": "s", "kvlife.direct_reads": False})
    assert off.direct_reads is False and off.without_direct_reads().direct_reads is False
