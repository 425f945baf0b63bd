"""A ``kvlife serve`` host of the multi-host model: the server's own code
(:func:`kvlife.server.server.run`: listener, sessions, shared-memory arena, the store)
with the chain [shm dram, shared], because ``kvlife serve`` has no option that puts a
shared (Redis, Mooncake) tier behind its DRAM. Only :func:`kvlife.server.server.open_store`
is replaced, by one that builds that chain the way it builds its own.

Run as ``python -m tests.remote.multihost_serve STORE SOCKET SHM_DIR DRAM_BYTES SPEC_JSON``;
SPEC_JSON is ``{"kind": ..., "options": [[name, value], ...], "transform": ...}``.
SIGTERM stops it cleanly (flush, close); SIGKILL is a crash.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvlife.core.events import EventSink
from kvlife.server import server as srv
from kvlife.store import KVStore, StoreConfig, TierSpec


def main() -> int:
    store, sock, shm_dir, dram, spec_json = sys.argv[1:6]
    spec = json.loads(spec_json)
    shared = TierSpec(
        spec["kind"],
        "shared",
        64 << 20,
        options=tuple((str(k), v) for k, v in spec["options"]),
        transform=str(spec.get("transform", "")),
    )

    def open_store(cfg: srv.ServeConfig, sink: EventSink | None = None) -> KVStore:
        arena = cfg.shm_dir / f"{srv.arena_prefix(cfg.path)}-{os.getpid()}"
        shm = TierSpec(
            "shm",
            "dram",
            cfg.dram_bytes,
            options=(("arena_path", str(arena)), ("staging_bytes", cfg.staging_bytes)),
        )
        return KVStore(cfg.path, StoreConfig(tiers=(shm, shared)), sink=sink)

    srv.open_store = open_store
    cfg = srv.ServeConfig(
        path=Path(store),
        socket=Path(sock),
        dram_bytes=int(dram),
        disk_bytes=0,
        staging_bytes=8 << 20,
        shm_dir=Path(shm_dir),
    )
    return srv.run(cfg)


if __name__ == "__main__":
    sys.exit(main())
