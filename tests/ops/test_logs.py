"""Structured logs of a real ``kvlife serve``: one line per lifecycle-significant event,
human text by default, one JSON object per line with ``--log-json``."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from kvlife.core.errors import LeaseError
from kvlife.core.events import FanOutSink, LifecycleEvent, MemorySink
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind
from kvlife.core.logs import JsonFormatter, LogSink, configure
from kvlife.faults.damage import flip, scan_frames
from kvlife.store import KVStore
from kvlife.tiers.base import Reservation
from kvlife.tiers.redis.server import RedisServer
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.ops.corrupt import store_with_a_flipped_payload
from tests.remote.test_leases import arr, meta
from tests.remote.test_leases import tier as lease_tier
from tests.server.conftest import ServerProc, wait_for

N = TINY.tokens_per_chunk


def _lines(srv: ServerProc) -> list[dict[str, object]]:
    return [json.loads(line) for line in srv.log.read_text().splitlines()]


def test_a_corruption_caught_is_one_json_line(tmp_path: Path) -> None:
    path = tmp_path / "store"
    ident, tokens, keys = store_with_a_flipped_payload(path)
    srv = ServerProc(path, extra=("--log-json",)).start()
    try:
        wait_for(lambda: any(e["event"] == "start" for e in _lines(srv)), 30, "the start line")
        store = srv.client()
        try:
            assert store.load(store.lookup(ident, PUBLIC, tokens)).corrupt == [keys[1]]
        finally:
            store.close()
        wait_for(lambda: any(e["event"] == "corrupt" for e in _lines(srv)), 30, "the line")
    finally:
        assert srv.stop() == 0
    lines = _lines(srv)  # every line is JSON (json.loads raised otherwise)
    assert [e["event"] for e in lines] == ["recovery", "start", "corrupt", "stop"]
    (line,) = [e for e in lines if e["event"] == "corrupt"]
    assert line["logger"] == "kvlife.store" and line["level"] == "warning"
    assert line["key"] == keys[1].hex()
    assert line["namespace"] == "public"
    assert line["state"] == "invalidated"
    assert "checksum" in str(line["reason"]) or "corrupt" in str(line["reason"])
    assert isinstance(line["seq"], int) and str(line["time"]).endswith("Z")
    start = next(e for e in lines if e["event"] == "start")
    assert start["logger"] == "kvlife.serve" and start["pid"] == srv.pid
    assert next(e for e in lines if e["event"] == "recovery")["recovered"] == 3


def test_a_row_quarantined_at_open_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "store"
    tokens, kv = prompt_kv(9, 3 * N)
    first = ServerProc(path, extra=("--write-through",)).start()
    try:
        store = first.client()
        keys = store.put_prompt(tiny_identity(), PUBLIC, tokens, kv).keys
        store.close()
    finally:
        assert first.stop() == 0
    frame = next(f for f in scan_frames(path) if f.key == keys[2])
    flip(frame.segment, frame.offset + 60, 8)  # inside the key field of its header
    first.log.unlink()
    srv = ServerProc(path, extra=("--log-json",)).start()
    try:
        wait_for(lambda: any(e["event"] == "start" for e in _lines(srv)), 30, "the start line")
    finally:
        assert srv.stop() == 0
    lines = _lines(srv)
    assert [e["event"] for e in lines] == ["recovery", "quarantine", "start", "stop"]
    assert lines[0]["dropped"] == 1 and lines[0]["objects"] == 2
    assert lines[1]["tier"] == "disk" and lines[1]["rows"] == 1 and lines[1]["segments"] == 0
    assert lines[1]["level"] == "warning"


def test_text_lines_by_default_and_tenant_names_withheld(tmp_path: Path) -> None:
    """The sink on a server with principals logs a tenant's namespace as ``tenants``;
    the human line keeps the server's old shape (``... kvlife store: corrupt key=...``)."""
    out = tmp_path / "log"
    with out.open("w") as fh:
        logs = configure(fh)
        try:
            sink = LogSink(tenants=True)
            ns = str(Namespace(NamespaceKind.ORGANISATION, "acme"))
            for kind in ("put", "corrupt", "index"):
                sink.emit(LifecycleEvent(1.0, 7, kind, "ab" * 32, "invalidated", namespace=ns))
            logging.getLogger("kvlife.serve").info("plain words")
        finally:
            logs.close()
    lines = out.read_text().splitlines()
    assert len(lines) == 2
    assert " kvlife store: corrupt key=" + "ab" * 32 in lines[0]
    assert "namespace=tenants" in lines[0] and "acme" not in lines[0]
    assert lines[1].endswith("kvlife serve: plain words")


class _Evictions(MemorySink):
    def kinds(self) -> frozenset[str]:
        return frozenset({"evict"})


def test_a_sink_is_sent_only_the_moves_it_wants(tmp_path: Path) -> None:
    """The store builds no event for a move its sink does not want (the server's sinks
    want rare moves only, so puts and loads pay nothing for them)."""
    sink = _Evictions()
    every = MemorySink()
    tokens, kv = prompt_kv(8, 2 * N)
    for path, s in ((tmp_path / "a", sink), (tmp_path / "b", every)):
        with KVStore.open(path, dram_bytes=1 << 20, disk_bytes=8 << 20, sink=s) as store:
            store.put_prompt(tiny_identity(), PUBLIC, tokens, kv)
            store.load(store.lookup(tiny_identity(), PUBLIC, tokens))
            store.evict("dram", 1 << 30)
    got = sink.take()
    assert [e.kind for e in got] == ["evict", "evict"]
    assert [e.seq for e in got] == [1, 2]
    assert {e.kind for e in every.take()} >= {"put", "index", "load", "offload", "evict"}
    fan = FanOutSink(_Evictions(), LogSink())
    assert fan.kinds() == frozenset({"evict", "corrupt", "invalidate"})
    assert FanOutSink(_Evictions(), MemorySink()).kinds() is None


def test_a_fenced_publication_is_one_line(
    redis_server: RedisServer, index_ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shared tier's publication refused by the global index (a lease that expired on
    the server's clock: the writer is fenced) logs one ``fenced`` line."""
    a = lease_tier(redis_server, index_ns, "host-a", ttl_ms=200)
    res = a.prepare_store([meta(2)])
    assert isinstance(res, Reservation)
    time.sleep(0.4)
    object.__setattr__(res.state.lease, "local_deadline", time.monotonic() + 60)  # lying clock
    with caplog.at_level(logging.INFO, logger="kvlife"), pytest.raises(LeaseError):
        a.commit_store(res, [arr(2)])
    (record,) = [r for r in caplog.records if getattr(r, "kvlife_event", "") == "fenced"]
    line = json.loads(JsonFormatter().format(record))
    assert line["event"] == "fenced" and line["level"] == "warning"
    assert line["logger"] == "kvlife.globalindex.index"
    assert line["host"] == "host-a" and "KVLEXPIRED" in line["reason"]
