#!/usr/bin/env bash
# Quickstart, step 2: install what the tests need (same as setup, without the main job) and run
# the whole suite. Extra arguments go to pytest (e.g. -k recovery, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ONLY=1 bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
