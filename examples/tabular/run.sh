#!/usr/bin/env bash
# tabular: train with hardsync, 4-softsync, SMA and local SGD on the simulated cluster (--runtime sim)
# and on real processes (--runtime dist), then print each run's time to target.
#
#   bash run.sh                              # everything, into runs/<time>/
#   OUT=runs/a bash run.sh --set train.seed=1  # extra arguments go to every run
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/$(date +%Y%m%d-%H%M%S)}
PROTOCOLS=(hardsync softsync sma local_sgd)

# The first simulated run measures this machine's device profile; the others simulate
# the same device, so that their simulated times compare.
profile=()
for protocol in "${PROTOCOLS[@]}"; do
    "$PYTHON" -m distsgd train "$protocol.toml" --runtime sim --out "$OUT/$protocol-sim" \
        --quiet "${profile[@]}" "$@"
    if [ ${#profile[@]} -eq 0 ]; then
        read -r -a profile < <("$PYTHON" -c '
import sys, tomllib
c = tomllib.load(open(sys.argv[1], "rb"))["cluster"]
for key in ("seconds_per_sample", "seconds_per_batch"):
    print("--set", f"cluster.{key}={c[key]!r}", end=" ")
print()' "$OUT/$protocol-sim/config.toml")
    fi
done

# Real processes: hardsync and local SGD 4 ranks, 4-softsync 1 server + 4 learners; SMA on 2 ranks
# with 2 replicas each (the same 4 learners as the simulated 1 device x 4).
for protocol in "${PROTOCOLS[@]}"; do
    layout=()
    if [ "$protocol" = sma ]; then
        layout=(--num-processes 2 --set protocol.replicas_per_device=2)
    fi
    "$PYTHON" -m distsgd train "$protocol.toml" --runtime dist --out "$OUT/$protocol-dist" \
        --quiet "${layout[@]}" "$@"
done

"$PYTHON" - "$OUT" "${PROTOCOLS[@]}" <<'PY'
import json, sys
from pathlib import Path

out, protocols = Path(sys.argv[1]), sys.argv[2:]
print(f"\ntime to target ({out}; sim: simulated seconds, dist: wall seconds of training)")
print(f"{'protocol':<10} {'runtime':<8} {'target':>8} {'best':>8} {'reached':>8} "
      f"{'samples':>8} {'time (s)':>9}")
for protocol in protocols:
    for runtime in ("sim", "dist"):
        s = json.loads((out / f"{protocol}-{runtime}" / "summary.json").read_text())
        t = s["time_to_target_virtual_s"] if runtime == "sim" else s["time_to_target_s"]
        print(f"{protocol:<10} {runtime:<8} {s['target']:>8.3f} {s['best_metric']:>8.3f} "
              f"{'yes' if s['reached'] else 'no':>8} {s['samples_to_target'] or '-':>8} "
              f"{'-' if t is None else f'{t:.1f}':>9}")
PY
