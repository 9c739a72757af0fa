"""Does the simulated k-replica device profile follow the batched path on this machine?

The simulated runtime charges one device iteration of k replicas × b samples
``t(1) · ρ(k)`` with ρ(k) the calibrated t(k)/t(1) (``cluster.replica_ratios``,
:func:`distsgd.runtime.sim.calibrate_replicas`), and the replicas auto-tuner decides on
T(k)/T(k−1) (Crossbow §4.3), so the calibrated ratios must match the batched path's.
Fashion-MNIST ``cnn``, one thread:

1. the trainer's calibration, ``--calibrations`` times (k = 1 … ``--max-k``, median of
   5 interleaved rounds each);
2. a separate direct measurement of the batched path, k = 1 … ``--max-k``, median (and,
   from the same timings, the fastest) of ``--repeats`` interleaved rounds;
3. the tuner's gains T(k)/T(k−1) − 1 and its choice (threshold 10%, Crossbow's rule) on
   each curve.

    flock /tmp/distsgd-bench.lock python bench/replica_calibration.py --batch 8 \\
        --out bench/results/replica_calibration_b8.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

import torch

from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.replicas import ReplicaAutoTuner
from distsgd.runtime.sim import calibrate_replicas, measure_replica_seconds


def tuner_choice(ratios: list[float], b: int) -> tuple[int, list[str]]:
    """The tuner's final k and gains on a t(k)/t(1) curve (threshold 10%, crossbow)."""
    tuner = ReplicaAutoTuner(0.1, 1, len(ratios), warmup=0)
    while not tuner.done:
        tuner.observe(b * tuner.k, ratios[tuner.k - 1])
    return tuner.k, [f"{d.gain:+.1%}" for d in tuner.decisions if d.gain is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--calibrations", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    ds = load_dataset(DataConfig(), seed=0)
    torch.manual_seed(0)
    engine = GradientEngine(build_model("cnn", ds.input_shape, ds.num_classes))
    b, n = args.batch, args.max_k
    curves = {}
    for i in range(args.calibrations):
        ratios, _ = calibrate_replicas(engine, ds, b, max_replicas=n)
        curves[f"calibration {i + 1}"] = ratios
    raw: list[list[float]] = []  # the direct measurement's timings, per k in order

    def median_keeping(v: list[float]) -> float:
        raw.append(v)
        return statistics.median(v)

    ks = tuple(range(1, n + 1))
    direct = measure_replica_seconds(engine, ds, b, ks, args.repeats, median_keeping)
    curves["direct (median)"] = [direct[k] / direct[1] for k in ks]
    curves["direct (min)"] = [min(v) / min(raw[0]) for v in raw]
    load_after = os.getloadavg()
    names = list(curves)
    lines = [
        f"# Calibrated k-replica profile vs the batched path (Fashion-MNIST cnn, b = {b})",
        "",
        "Command: `flock /tmp/distsgd-bench.lock python bench/replica_calibration.py "
        f"--batch {b} --max-k {n} --calibrations {args.calibrations} --repeats "
        f"{args.repeats}`",
        "",
        f"{platform.machine()}, torch {torch.__version__}, 1 thread; load average (1, 5 min) "
        f"before {load_before[0]:.2f}, {load_before[1]:.2f}, after {load_after[0]:.2f}, "
        f"{load_after[1]:.2f} (other work shared the machine). Direct t(1) = "
        f"{direct[1] * 1e3:.2f} ms.",
        "",
        "## t(k)/t(1)",
        "",
        "| k | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for k in range(1, n + 1):
        lines.append(f"| {k} | " + " | ".join(f"{curves[c][k - 1]:.3f}" for c in names) + " |")
    lines += ["", "## Tuner on each curve (threshold 10%, rule crossbow)", ""]
    lines += ["| curve | gains T(k)/T(k−1) − 1, k = 2, 3, … | chosen k |", "|---|---|---|"]
    for c in names:
        k, gains = tuner_choice(curves[c], b)
        lines.append(f"| {c} | {', '.join(gains)} | {k} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
