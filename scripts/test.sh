#!/usr/bin/env bash
# Set-up, then lint, the import contracts, the documentation site and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m ruff format --check .
# the layers and no-cycles contracts in pyproject.toml (import-linter's lint-imports, run
# through the interpreter so that no console-script shim needs to be on PATH)
python3 -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
# the documentation site: no broken link, anchor or API reference (into a temporary folder;
# not --quiet, which hides the warnings that --strict counts)
site_dir="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
python3 -m pytest "$@"
