"""Client processes of the server tests: ``python -m tests.server.workers VERB SOCKET ...``.

- ``garbage SOCKET``: sends malformed frames on a raw connection and prints, as JSON, the
  error class of each reply.
- ``share SOCKET WORKER WORKERS PROMPTS``: puts its own prompts and a set every worker
  puts, loads every worker's prompts and verifies every byte; prints a JSON summary.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

import msgpack
import numpy as np

from kvlife.client import RemoteStore
from kvlife.core.errors import StoreUnavailable
from kvlife.core.identity import PUBLIC, Namespace, NamespaceKind
from kvlife.server import protocol
from tests.conftest import TINY, prompt_kv, tiny_identity

N = TINY.tokens_per_chunk


def _ask(sock: socket.socket, body: bytes) -> str:
    sock.sendall(struct.pack(">I", len(body)) + body)
    reply = protocol.recv_frame(sock)
    assert reply is not None
    _rid, ok, result = msgpack.unpackb(reply, raw=False)
    return "ok" if ok else str(result[0])


def garbage(path: str) -> None:
    owner = RemoteStore(path)
    tokens, kv = prompt_kv(99, 2 * N)
    pending = owner.prepare_put(tiny_identity(), PUBLIC, tokens, kv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    ident = protocol.encode_identity(tiny_identity())
    bad_ident = dict(ident)
    bad_ident["model_id"] = ""

    def req(verb: str, args: object) -> bytes:
        out: bytes = msgpack.packb([7, verb, args], use_bin_type=True)
        return out

    out: dict[str, object] = {
        "not_msgpack": _ask(sock, b"\xc1\xff\x00garbage"),
        "unknown_verb": _ask(sock, req("format_disk", {})),
        "wrong_type": _ask(sock, req("release", {"load": "one"})),
        "missing_field": _ask(sock, req("lookup", {"identity": ident})),
        "unknown_load": _ask(sock, req("release", {"load": 12345})),
        # a put id another session holds: not this session's to commit
        "unknown_put": _ask(sock, req("commit_put", {"put": pending.put})),
        "bad_identity": _ask(
            sock,
            req(
                "lookup",
                {"identity": bad_ident, "namespace": "public", "tokens": b""},
            ),
        ),
        "odd_tokens": _ask(
            sock, req("lookup", {"identity": ident, "namespace": "public", "tokens": b"abc"})
        ),
    }
    sock.sendall(struct.pack(">I", 2**31))
    reply = protocol.recv_frame(sock)
    assert reply is not None
    out["huge_frame"] = str(msgpack.unpackb(reply, raw=False)[2][0])
    sock.settimeout(10)
    out["huge_frame_closed"] = sock.recv(1) == b""
    owner.commit_put(pending)  # the owner's session still holds it
    owner.close()
    print(json.dumps(out))


def expected(worker: int, prompt: int) -> tuple[Namespace, np.ndarray, np.ndarray]:
    ns = PUBLIC if worker < 0 else Namespace(NamespaceKind.USER, f"w{worker}")
    tokens, kv = prompt_kv(1000 * (worker + 1) + prompt, 4 * N)
    return ns, tokens, kv


def verify(store: RemoteStore, worker: int, prompt: int) -> int:
    """Load a prompt and compare every byte; the chunks loaded (a miss is allowed, wrong
    bytes never)."""
    ns, tokens, kv = expected(worker, prompt)
    got = store.get(tiny_identity(), ns, tokens)
    for i, arr in enumerate(got.arrays):
        if not np.array_equal(arr, kv[:, :, :, i * N : (i + 1) * N]):
            raise AssertionError(f"wrong bytes served: worker {worker} prompt {prompt} chunk {i}")
    return got.loaded


def share(path: str, worker: int, workers: int, prompts: int) -> None:
    store = RemoteStore(path)
    ident = tiny_identity()
    for p in range(prompts):
        for w in (worker, -1):  # its own prompts and the shared ones (-1)
            ns, tokens, kv = expected(w, p)
            store.put_prompt(ident, ns, tokens, kv)
    loaded = chunks = 0
    deadline = time.monotonic() + 60
    for w in [*range(workers), -1]:
        for p in range(prompts):
            while True:  # another worker's prompt may not be there yet
                n = verify(store, w, p)
                if n == 4 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            loaded += n
            chunks += 4
    store.close()
    print(json.dumps({"worker": worker, "loaded": loaded, "chunks": chunks}))


def churn(path: str, seed: int) -> None:
    """Puts and loads until killed; every load verified (used by the kill tests)."""
    rng = np.random.default_rng(seed)
    store = RemoteStore(path)
    ident = tiny_identity()
    while True:
        p = int(rng.integers(0, 12))
        ns, tokens, kv = expected(0, p)
        try:
            if rng.random() < 0.5:
                store.put_prompt(ident, ns, tokens, kv)
            else:
                verify(store, 0, p)
        except StoreUnavailable:
            time.sleep(0.01)


def main(argv: list[str]) -> int:
    verb, path, *rest = argv
    if verb == "garbage":
        garbage(path)
    elif verb == "share":
        share(path, int(rest[0]), int(rest[1]), int(rest[2]))
    elif verb == "churn":
        churn(path, int(rest[0]))
    else:
        raise SystemExit(f"unknown worker {verb}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
