#!/usr/bin/env bash
# Run the test suite (sets the environment up first when it is missing or out of date).
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ deploy/setup.sh -nt "$stamp" ]; then
    bash deploy/setup.sh --no-run
    touch "$stamp"
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
