"""``python -m kvlife.bench.server``: ``kvlife bench server`` (and its scaling clients,
``--worker``)."""

from kvlife.bench.server.cli import main

raise SystemExit(main())
