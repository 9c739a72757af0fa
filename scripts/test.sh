#!/usr/bin/env bash
# Set-up, then lint, the import contracts and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m ruff format --check .
# the layers and no-cycles contracts in pyproject.toml (import-linter's lint-imports, run
# through the interpreter so that no console-script shim needs to be on PATH)
python3 -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
python3 -m pytest "$@"
