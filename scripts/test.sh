#!/usr/bin/env bash
# Set-up, then lint and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m pytest "$@"
