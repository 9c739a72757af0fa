#!/usr/bin/env bash
# Installs everything distsgd needs on a fresh machine: the Fashion-MNIST files (Debian
# package dataset-fashion-mnist) when they are missing, torch==2.13.0 (the CPU build the
# project is tested with), and the package itself with the test tools.
#
# The exact torch pin lives here, not in pyproject.toml (which asks torch>=2.3, so that
# `pip install -e .` keeps a user's own torch): on a machine without torch, an open range
# would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."

data_dir="${DISTSGD_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
if [ ! -f "$data_dir/train-images-idx3-ubyte.gz" ] && [ ! -f "$data_dir/train-images-idx3-ubyte" ]; then
  echo "setup: Fashion-MNIST not found in $data_dir; installing dataset-fashion-mnist" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist
fi

python3 -m pip install -q --disable-pip-version-check 'torch==2.13.0'
python3 -m pip install -q --disable-pip-version-check -e '.[test]'
