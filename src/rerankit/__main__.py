"""``python -m rerankit``: the same command line as ``rerankit``."""

from rerankit.cli import main

raise SystemExit(main())
