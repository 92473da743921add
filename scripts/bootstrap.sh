#!/usr/bin/env bash
# Creates .venv (Python >= 3.12) and installs the package with its test, thirdparty, mlip and engines extras.
# Idempotent: re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.installed-pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"

find_python() {
    local cand
    for cand in "${JAXBRIDGE_PYTHON:-}" "$(command -v pyenv >/dev/null 2>&1 && pyenv which python 2>/dev/null || true)" \
                python3.13 python3.12 python3 python; do
        [ -n "$cand" ] || continue
        command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    echo "bootstrap: no Python >= 3.12 found; install one (pyenv install 3.12) or set JAXBRIDGE_PYTHON" >&2
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python)"
    echo "bootstrap: creating .venv with $py ($("$py" --version))" >&2
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "bootstrap: installing nvalchemi_jaxbridge[test,thirdparty,mlip,engines] into .venv (first run downloads torch and jax)" >&2
    "$venv/bin/python" -m pip install --quiet --progress-bar off -e ".[test,thirdparty,mlip,engines]"
    echo "$want" > "$stamp"
fi
