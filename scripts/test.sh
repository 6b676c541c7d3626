#!/usr/bin/env bash
# Quickstart, step 2: install what the tests need (same as setup, without the main job) and run
# the whole suite. Extra arguments go to pytest (e.g. -k recovery, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ONLY=1 bash scripts/setup.sh
# One worker per core (at most 4), a test module per worker at a time (--dist loadfile: a module's
# fixtures are built once, and its tests never race each other). Measured on 2 cores: the suite
# kept one core idle half the time when serial (subprocess start-ups, syncs, SIGKILL waits).
# PYTEST_WORKERS=0 runs it serially, in this process.
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-auto}" --maxprocesses=4 --dist loadfile "$@"
