#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
# Parallel over the machine's cores, at most 2 workers, whole files per worker (module fixtures run once);
# tests/conftest.py puts the files with long tests first. A later -n in "$@" wins (-n 0: one process).
exec "$root/.venv/bin/python" -m pytest -n auto --maxprocesses 2 --dist loadfile "$@"
