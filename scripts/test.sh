#!/usr/bin/env bash
# Set-up, then lint, the import contracts and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m ruff format --check .
lint-imports  # the layers and no-cycles contracts in pyproject.toml
python3 -m pytest "$@"
