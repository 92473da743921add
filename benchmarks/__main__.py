"""`python -m benchmarks run|list|soak`: see benchmarks/runner.py."""

from benchmarks.runner import main

raise SystemExit(main())
