"""``kvlife bench server``: the store served by ``kvlife serve`` against the in-process
store and the machine's limits, measured in the same run.

- lookup of a 128-chunk prompt through the server vs in-process (median, P99);
- load of 2 MiB and 16 MiB chunks from the server's DRAM tier into a client buffer vs
  ``memcpy`` of the same bytes (and, beside it, vs a streaming copy of them, ``of_stream``
  and ``shared_of_stream``: the loads copy by streaming stores and pass memcpy), and
  from its disk tier vs raw O_DIRECT reads: into
  ordinary buffers (the grant path: one copy from the arena) and into shared buffers
  from ``RemoteStore.alloc_buffer`` (the data lands there, no copy by the client);
- put through the server vs ``memcpy`` into DRAM, and with write-through vs a raw
  O_DIRECT write plus ``fdatasync``;
- 1, 2 and 4 client processes loading concurrently from DRAM: aggregate throughput and
  each client's P99;
- the DRAM load again from a server run with ``--verify-dram-on-load`` (every chunk
  checked against its replica's xxh3-128 seal): what that setting costs. Puts seal every
  chunk they adopt (one xxh3-128 each), which the put points include;
- the machine's own figures (memcpy, raw O_DIRECT write and read, a Python loop's
  speed; :func:`kvlife.bench.limits.machine_figures`), under ``"machine"``.
- one round trip to the floor's bare server after 2 ms idle and back to back, under
  ``"round_trip"``, and each DRAM put and disk load point's ``round_trip_bound`` (and
  ``round_trip_bound_hot``): its ratio if the call took only its limit's time plus one
  round trip after idleness (back to back); a served call that sleeps while it waits
  cannot pass the first (:func:`.run.add_round_trip_bounds`); each disk load point's
  ``shared_bound`` and ``ordinary_bound``: the same with its ceiling's time (the reads
  verified natively; raw reads with the copy out beside them) in place of the raw
  reads', what no served load of that kind passes with every byte verified.
- beside each disk load point's raw reads of the bench's own file, raw reads of the
  frames the loads read, where the store wrote them (``frames_raw_gbps``, its speed
  against the raw file's ``ratio_frames_raw``, and each load against it,
  ``<load>_of_frames_raw``): the same bytes at another place on the disk can read at
  another speed, so this tells the frames' place from the store's work.

Targets (issue 10): lookup <= 2x in-process (median and P99); DRAM load >= 0.8x memcpy,
disk load >= 0.85x raw; put >= 0.8x memcpy, write-through put >= 0.85x raw. A benchmark,
not a test: it prints a table and writes JSON; nothing here asserts speed.
LMCache's multi-process mode runs beside on the same chunks when a peer venv is found
(kvlife/bench/peer_lmcache_mp.py).

One module per benchmark: :mod:`.lookup`, :mod:`.loads` (DRAM, disk, and DRAM with
every load verified), :mod:`.puts`, :mod:`.scaling` (client processes), :mod:`.peer`
(LMCache); :mod:`.workload` makes their chunks, :mod:`.servers` the ``kvlife serve``
processes, :mod:`.run` the run and its JSON document, :mod:`.report` the tables,
:mod:`.cli` the command line; :mod:`.floor` (with :mod:`.floor_server`) the protocol's
floor: the DRAM puts and the disk loads again through a bare server with no store, on
the servers' CPU, so a miss can be told apart: the machine's (the floor misses too) or
kvlife's own (the floor does not).
"""

from kvlife.bench.server.cli import build_parser, main
from kvlife.bench.server.config import TARGETS, ServerBenchConfig
from kvlife.bench.server.report import format_report
from kvlife.bench.server.run import run_server_bench

__all__ = [
    "TARGETS",
    "ServerBenchConfig",
    "build_parser",
    "format_report",
    "main",
    "run_server_bench",
]
