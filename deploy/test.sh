#!/usr/bin/env bash
# Run the test suite (sets the environment up first when it is missing or out of date).
#
# The tests run on every core (pytest-xdist), one module per pytest worker (a package whose modules
# share processes: one package; tests/conftest.py's SHARED_PACKAGES), so that a module's
# fixtures (its P, D and proxy processes) start once: one worker more than cores, because tests
# also wait (for processes to start, die or time out), and on 2 cores 3 workers left the CPU
# idle 6% of the run (PDSERVE_TEST_WORKERS overrides). The few tests marked `serial` assert on
# latency under load and run afterwards, alone.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ deploy/setup.sh -nt "$stamp" ]; then
    bash deploy/setup.sh --no-run
    touch "$stamp"
fi
.venv/bin/ruff check .
workers=${PDSERVE_TEST_WORKERS:-$(($(nproc) + 1))}
status=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile -m "not serial" "$@" || status=$?
serial=0
.venv/bin/python -m pytest -p no:xdist -m serial "$@" || serial=$?
# 5: nothing collected (a path given that holds no test of that phase) is no failure alone
if [ "$status" -eq 5 ] && [ "$serial" -ne 5 ]; then status=0; fi
if [ "$serial" -ne 0 ] && [ "$serial" -ne 5 ]; then status=$serial; fi
exit "$status"
