"""The pieces of the server's defences on their own: the budget ledger (a state machine
against a model, connections of one process sharing its bounds), the frame reader
(frames split anyhow arrive whole and in order; a large body is charged, a refused one
is read and dropped; a stalled one times out), the decoder's bounds, the identity cache
(right and within its budget), a put in pieces adding up as one, and every limit
documented with its default in ``kvlife serve --help`` and docs/server.md."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import sys
import threading
import time
from typing import ClassVar

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlife.client.puts import joined
from kvlife.core.errors import InvalidArgument, LimitExceeded, ProtocolError
from kvlife.core.identity import ChunkKey
from kvlife.results import PutResult
from kvlife.server import protocol
from kvlife.server.identities import MAX_CACHED_CHARS, IdentityCache
from kvlife.server.limits import INFINITE, PAGE, Budget, Ledger, Limits, budgets, flag
from kvlife.server.reader import RECV_BYTES, BodyTimeout, Discarded, FrameReader, FrameTooLarge
from kvlife.tiers.buffers import ALIGN
from tests.conftest import TINY, tiny_identity
from tests.server.conftest import ROOT, child_env

N = TINY.tokens_per_chunk

# ---------------------------------------------------------------------- ledger


class LedgerMachine(RuleBasedStateMachine):
    """Takes never exceed either bound of any budget, the per-client one binding all the
    connections of one process together; a take of several budgets is all or none, and
    a refused one changes nothing and is counted once, against a budget it would have
    exceeded; the totals are the sum of the sessions'; a session's end gives back all it
    held (and a new connection of the same process takes its place)."""

    BOUNDS: ClassVar[dict[str, tuple[int, int]]] = {"x": (10, 4), "y": (7, 5)}
    PIDS: ClassVar[list[int | None]] = [100, 100, 200, None]
    """Sessions 0 and 1 are connections of one process; 3's process is unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(
            {k: Budget(t, s, k, f"session-{k}", f"{k}-things") for k, (t, s) in self.BOUNDS.items()}
        )
        self.accounts = [self.ledger.open(pid) for pid in self.PIDS]
        self.refused = dict.fromkeys(self.BOUNDS, 0)

    def _client(self, s: int) -> dict[str, int]:
        """What the process of session ``s`` holds, all its sessions together."""
        same = [
            a
            for i, a in enumerate(self.accounts)
            if i == s or (self.PIDS[i] is not None and self.PIDS[i] == self.PIDS[s])
        ]
        return {k: sum(a.held.get(k, 0) for a in same) for k in self.BOUNDS}

    @rule(s=st.integers(0, 3), x=st.integers(0, 5), y=st.none() | st.integers(0, 5))
    def take(self, s: int, x: int, y: int | None) -> None:
        charge = {"x": x} if y is None else {"x": x, "y": y}
        before = dict(self.accounts[s].held)
        client = self._client(s)
        over = [
            k
            for k, n in charge.items()
            if client[k] + n > self.BOUNDS[k][1] or self.ledger.used[k] + n > self.BOUNDS[k][0]
        ]
        try:
            self.ledger.take(self.accounts[s], charge, f"s{s}")
        except LimitExceeded as exc:
            assert over and f"{over[0]}-things" in str(exc)
            assert self.accounts[s].held == before  # all or none
            self.refused[over[0]] += 1
        else:
            assert not over

    @precondition(lambda self: any(any(a.held.values()) for a in self.accounts))
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        held = [i for i, a in enumerate(self.accounts) if any(a.held.values())]
        account = self.accounts[data.draw(st.sampled_from(held))]
        kind = data.draw(st.sampled_from([k for k, v in account.held.items() if v]))
        n = data.draw(st.integers(1, account.held[kind]))
        self.ledger.give(account, {kind: n})

    @rule(s=st.integers(0, 3))
    def session_ends(self, s: int) -> None:
        self.ledger.close(self.accounts[s])
        assert self.accounts[s].held == {}
        self.accounts[s] = self.ledger.open(self.PIDS[s])

    @invariant()
    def accounting(self) -> None:
        for k, (total, session) in self.BOUNDS.items():
            assert self.ledger.used[k] == sum(a.held.get(k, 0) for a in self.accounts)
            assert 0 <= self.ledger.used[k] <= total
            for s in range(len(self.accounts)):
                assert self._client(s)[k] == self.accounts[s].peer.held.get(k, 0) <= session
            assert self.ledger.refused[k] == self.refused[k]
        assert self.ledger.peers == 2


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_giving_back_more_than_held_is_a_broken_invariant() -> None:
    ledger = Ledger({"x": Budget(10, 10, "x", "x", "x")})
    account = ledger.open(None)
    ledger.take(account, {"x": 2}, "s")
    with pytest.raises(AssertionError):
        ledger.give(account, {"x": 3})  # never clamped back to zero
    assert account.held == {"x": 2} and ledger.used["x"] == 2


def test_budgets_resolve_shares_of_the_arena() -> None:
    table = budgets(Limits(session_put_share=0.25), arena_bytes=64 * PAGE, descriptors=100)
    assert table["put_bytes"].session == 16 * PAGE and table["put_bytes"].total == 64 * PAGE
    assert table["descriptors"].total == 100 and table["descriptors"].session == INFINITE
    assert PAGE == ALIGN  # the ledger charges the arena's pages


# ---------------------------------------------------------------------- frames


def _reader(limits: Limits | None = None) -> tuple[socket.socket, FrameReader, Ledger]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(5)
    limits = limits or Limits()
    ledger = Ledger(budgets(limits, 1 << 30, 100))
    return a, FrameReader(b, limits, ledger, ledger.open(None)), ledger


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(
        st.sampled_from([0, 1, 5, 300, RECV_BYTES - 4, RECV_BYTES - 3, RECV_BYTES + 7, 3 << 20]),
        min_size=1,
        max_size=5,
    ),
    cuts=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=8),
)
def test_frames_split_anyhow_arrive_whole_and_in_order(sizes: list[int], cuts: list[int]) -> None:
    bodies = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    stream = b"".join(_frame(b) for b in bodies)
    writer, reader, ledger = _reader(Limits(body_timeout_s=600))
    least = len(stream) // 500  # at most about 500 sends: a slow client, not a stalled one

    def send() -> None:  # in pieces of the drawn sizes, as a slow client would
        at, i = 0, 0
        while at < len(stream):
            n = max(least, cuts[i % len(cuts)])
            writer.sendall(stream[at : at + n])
            at, i = at + n, i + 1
        writer.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=send)
    t.start()
    got = []
    while (body := reader.next()) is not None:
        got.append(body)
    t.join()
    assert got == bodies
    assert ledger.used["bodies_bytes"] == 0  # every large body's charge came back
    writer.close()


def test_a_large_body_over_the_budget_is_read_dropped_and_refused_to_its_rid() -> None:
    limits = Limits(bodies_bytes=1 << 20)
    writer, reader, ledger = _reader(limits)
    big = msgpack.packb([42, "state", {"x": b"\0" * (2 << 20)}], use_bin_type=True)
    small = msgpack.packb([43, "state", {}])

    def send() -> None:
        writer.sendall(_frame(big) + _frame(small))

    t = threading.Thread(target=send)
    t.start()
    with pytest.raises(Discarded) as err:
        reader.next()
    assert err.value.rid == 42 and "--bodies-bytes" in str(err.value)
    assert reader.next() == small  # the stream is in step
    t.join()
    assert ledger.refused["bodies_bytes"] == 1 and ledger.used["bodies_bytes"] == 0


def test_a_stalled_body_times_out_and_a_huge_length_ends_the_stream() -> None:
    writer, reader, _ = _reader(Limits(body_timeout_s=0.3))
    writer.sendall(_frame(b"x" * 100)[:50])  # half a frame, then nothing
    t0 = time.monotonic()
    with pytest.raises(BodyTimeout, match="--body-timeout"):
        reader.next()
    assert time.monotonic() - t0 < 5
    writer, reader, ledger = _reader(Limits(max_request_bytes=1000))
    writer.sendall((1001).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge, match="--max-request-bytes"):
        reader.next()
    assert ledger.refused["request_bytes"] == 1


# ---------------------------------------------------------------------- decoder


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\x00\x10\x00\x00" + b"\x80" * (1 << 20),  # a list of 1M empty maps
        b"\x93\x01\xa5state" + b"\xdc\x01\x00" + b"\x90" * 256 + b"\x00" * 70000,
        msgpack.packb([1, "state", {"x": "y" * 70000}]),  # a string longer than any field
    ],
)
def test_the_decoder_refuses_before_building(body: bytes) -> None:
    with pytest.raises(protocol.DecodeLimit) as err:
        protocol.decode_request(body)
    assert isinstance(err.value, LimitExceeded) and isinstance(err.value, ProtocolError)
    reply = msgpack.unpackb(protocol.error_reply(1, err.value)[4:])
    assert reply[2][0] == "LimitExceeded"  # a client rebuilds it typed


# ---------------------------------------------------------------------- documented


def test_every_limit_is_a_flag_with_its_default_in_help_and_docs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvlife.cli", "serve", "--help"],
        cwd=ROOT,
        env={**child_env(), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    docs = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    section = docs[docs.index("## Limits") :]
    for f in dataclasses.fields(Limits):
        name = f"--{flag(f.name)}"
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(name + " ")), "")
        assert line, f"{name} missing from kvlife serve --help"
        entry = out[out.index("\n" + line) :]
        assert f"(default {f.default})" in re.sub(r"\s+", " ", entry)[:400], name
        row = next((ln for ln in section.splitlines() if f"`{name}`" in ln), "")
        assert row, f"{name} missing from docs/server.md, Limits"
        assert f"`{f.default}`" in row or _human(f.default) in row, (name, row)


def _human(value: object) -> str:
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value >> 20} MiB"
    if isinstance(value, int) and value >= 1 << 10 and value % (1 << 10) == 0:
        return f"{value >> 10} KiB"
    return f"`{value}`"


# ---------------------------------------------------------------------- identities


def _raw_identity(model_id: str, reorder: bool) -> dict[str, object]:
    """An identity map as a client sends it (fields in the client's order)."""
    raw = protocol.encode_identity(tiny_identity(model_id=model_id))
    if reorder:  # the same fields, another order
        raw = dict(reversed(list(raw.items())))
    return raw


@settings(max_examples=40, deadline=None)
@given(
    sends=st.lists(
        st.tuples(st.integers(0, 30), st.sampled_from([1, 40, 200, 300, 4096]), st.booleans()),
        min_size=1,
        max_size=60,
    ),
    limit=st.sampled_from([1, 4096, 16384, 1 << 20]),
)
def test_the_identity_cache_is_right_and_within_its_budget(
    sends: list[tuple[int, int, bool]], limit: int
) -> None:
    """Whatever identities come, in whatever field order: each request gets the identity
    its map names; the cache's charge never exceeds its budget; an identity with a string
    over MAX_CACHED_CHARS, or larger than the budget, is never kept; another is kept (the
    same object the next time)."""
    cache = IdentityCache(limit)
    for n, length, reorder in sends:
        raw = _raw_identity(f"{n}-".ljust(length, "x"), reorder)
        got = cache.get(raw)
        assert got == protocol.decode_identity(raw)
        assert got.digest == tiny_identity(model_id=raw["model_id"]).digest  # type: ignore[arg-type]
        assert cache.nbytes <= limit
        if length > MAX_CACHED_CHARS or limit == 1:  # never kept: decoded again
            assert cache.get(raw) is not got
        else:  # kept (it is the newest entry, and fits the budget alone)
            assert cache.get(raw) is got
    assert (cache.nbytes == 0) == (len(cache) == 0)


def test_a_bad_identity_is_refused_and_not_kept() -> None:
    cache = IdentityCache(1 << 20)
    raw = _raw_identity("m", False)
    raw["adapter_id"] = "lora"  # without its digest: InvalidArgument from ModelIdentity
    with pytest.raises(InvalidArgument, match="adapter"):
        cache.get(raw)
    assert len(cache) == 0 and cache.nbytes == 0


# ---------------------------------------------------------------------- pieces


def test_a_put_in_pieces_adds_up_as_one_put() -> None:
    """The result of a put made of pieces: counts added, keys in order, tokens covered
    from the start only as far as every piece before covered all of its chunks."""
    keys = [ChunkKey(bytes([i]) * 32) for i in range(7)]

    def piece(first: int, n: int, covered: int, present: int = 0) -> PutResult:
        return PutResult(n, n - present, present, 0, 0, covered * N, keys[first : first + n])

    whole = joined([piece(0, 3, 3, present=1), piece(3, 3, 3), piece(6, 1, 1)], N)
    assert whole == PutResult(7, 6, 1, 0, 0, 7 * N, keys)
    gap = joined([piece(0, 3, 3), piece(3, 3, 1), piece(6, 1, 1)], N)
    assert gap.tokens_stored_or_present == 4 * N  # a hole in piece 2 ends the run
