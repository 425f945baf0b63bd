"""The seeded cross-layer fault campaign (``kvlife experiment faults``).

A deterministic workload (:mod:`.workload`: every chunk's payload a pure function of its
key) runs through the store while faults are injected, and every chunk served is held
against :mod:`.oracle`. The pieces:

- :mod:`.workload`: the prompts, the identity, the payload of a key;
- :mod:`.oracle`: checks served arrays against the payloads, counts wrong bytes;
- :mod:`.tally`: per fault kind, injections, detections, wrong bytes served,
  acknowledged data lost, recovery time, chunks recomputed; the campaign's JSON;
- :mod:`.seams`: the file seam the in-process kinds inject through (bit flips on
  read, lost writes, slow calls, errno faults);
- :mod:`.embedded`: the cheap kinds, in this process, against an embedded store;
- :mod:`.combos`: two or three compatible faults hitting one put, load, demotion,
  compaction or reopen (named combinations and seeded draws);
- :mod:`.kills`: SIGKILLs of forked writer processes at each step of the commit
  protocol, of demotion and of compaction (:mod:`.kill_driver` runs them in a process
  of their own, which only forks);
- :mod:`.served`: ``kvlife serve`` with client processes killed, and the server killed;
- :mod:`.remote`: Redis as a shared tier behind the loopback fault proxy (time-outs,
  partitions) and a host fenced while it publishes;
- :mod:`.lmcache` (and :mod:`.lmcache_child`, run in LMCache's environment): the same
  oracle against LMCache's local-disk backend;
- :mod:`.payload`: the payload of a key, with only numpy imported;
- :mod:`.html`: the HTML report (a table per kind, a PNG plot);
- :mod:`.runner`: the campaign's configuration and its run.
"""
