"""Wall seconds of one short run on a :class:`distsgd.launch.RankPool` beyond its training:
what every ``--tune`` probe on real processes pays (issue 18).

Runs ``--runs`` probe-like runs (hardsync 2 × 64 on Fashion-MNIST ``cnn``, no evaluation,
ticks recorded, ``train.max_seconds = --seconds``) one after the other on one pool of 2
ranks and prints, per run, the caller's wall seconds and the run's ``train_wall_s``; the
first run includes the ranks' start. Compare two trees side by side, alternating::

    for round in 1 2; do for tree in before after; do
      (cd $tree && PYTHONPATH=. python bench/pool_overhead.py); done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from distsgd import launch
from distsgd.api import resolve_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.0, help="training seconds per run")
    args = ap.parse_args()
    cfg = resolve_config(
        None,
        [
            'runtime="dist"',
            "data.dataset=fashion_mnist",
            "model.name=cnn",
            "protocol.name=hardsync",
            "protocol.num_learners=2",
            "protocol.batch_size=64",
            "optimizer.lr=0.05",
            "optimizer.momentum=0.9",
            "train.num_threads=1",
            f"train.max_seconds={args.seconds}",
            "train.stop_at_target=false",
            "train.record_ticks=true",
            "train.evaluate=false",
            "train.checkpoint_every_evals=0",
            "train.eval_every_samples=60000",
        ],
    )
    beyond = []
    with tempfile.TemporaryDirectory(prefix="pool-overhead-") as tmp, launch.RankPool(2) as pool:
        for i in range(args.runs):
            t0 = time.perf_counter()
            pool.run(cfg, Path(tmp) / str(i))
            wall = time.perf_counter() - t0
            train = json.loads((Path(tmp) / str(i) / "summary.json").read_text())["train_wall_s"]
            print(
                f"run {i}: wall {wall:.2f} s, training {train:.2f} s, beyond {wall - train:.2f} s"
            )
            if i > 0:
                beyond.append(wall - train)
    print(f"median beyond training (runs 1-{args.runs - 1}): {statistics.median(beyond):.3f} s")


if __name__ == "__main__":
    main()
