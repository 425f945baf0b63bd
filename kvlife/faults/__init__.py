"""Fault injectors: the faults kvlife's tests hold the store to, as a public API.

- :mod:`kvlife.faults.fileio`: :class:`~kvlife.faults.fileio.FaultyIO`, a file seam
  that fails chosen calls with a chosen errno (sticky or once, after n calls) or stalls
  them until released;
- :mod:`kvlife.faults.powercut`: :class:`~kvlife.faults.powercut.PowerCutIO`, a file
  seam that holds what is not yet durable apart and loses it in a simulated power cut;
- :mod:`kvlife.faults.damage`: damage to a closed store's files (frames found through
  the segment format; flips, overwrites, truncation, swaps, deletion);
- :mod:`kvlife.faults.throttle`: :func:`~kvlife.faults.throttle.throttle`, any tier
  behind a read-bandwidth limit (token bucket) and an added latency, and the
  ``throttled-disk`` tier kind;
- :mod:`kvlife.faults.crash` and :mod:`kvlife.faults.crash_child`: the SIGKILL harness
  (a writer child process, its acknowledgement log, the kill);
- :mod:`kvlife.experiments.campaign`: the seeded cross-layer fault campaign and its oracle
  (``kvlife experiment faults``).

See ``docs/faults.md``. Nothing here is imported by the store itself.
"""
