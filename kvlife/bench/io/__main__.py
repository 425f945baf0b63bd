"""``python -m kvlife.bench.io``: the same as ``kvlife bench io``."""

from kvlife.bench.io.cli import main

raise SystemExit(main())
