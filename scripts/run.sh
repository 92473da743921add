#!/usr/bin/env bash
# The README's main-job command: set up .venv if needed, then run the demo
# (defaults: JAX on the CPU with 8 virtual devices). Extra arguments go to the CLI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
if [ "$#" -eq 0 ]; then set -- run; fi
exec "$root/.venv/bin/nvalchemi-jaxbridge" "$@"
