#!/usr/bin/env bash
# Set-up, then the default training run: Fashion-MNIST, cnn, target 90% test accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m distsgd train "$@"
