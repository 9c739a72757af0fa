"""BatchNorm across protocols: the held-out accuracy of SMA, local SGD and the parameter
server (4-softsync), each evaluated with the BatchNorm statistics of its central model
(recomputed before every evaluation over ``train.bn_recalibration_samples`` training rows,
distsgd's README "BatchNorm statistics"), against hardsync's at the same numbers of
training samples, over several seeds.

Every run trains the same budget without stopping at the target and evaluates at the same
sample counts; the simulated device is fixed (no calibration), so the runs differ only in
protocol and seed. Prints one Markdown table (mean over seeds, differences to hardsync in
accuracy points, i.e. percentage points) and, per protocol, the mean difference at the
final evaluation and the largest one over the second half of the evaluations.

    python3 compare_bn.py                       # 3 seeds x 4 epochs, simulated runtime
    python3 compare_bn.py --seeds 0 1 2 3 4 --epochs 6 --out runs/bn
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import distsgd

PROTOCOLS = ("hardsync", "softsync", "sma", "local_sgd")
"""The example's configs compared; the first is the reference."""

FIXED_DEVICE = ["cluster.seconds_per_sample=1e-4", "cluster.seconds_per_batch=1e-3"]
"""A simulated device given, not measured: the same for every run (and no calibration)."""

Curve = dict[int, float]
"""Held-out accuracy by training samples seen."""


def train_curve(protocol: str, seed: int, epochs: float, every: int, out: Path) -> Curve:
    """One run of ``<protocol>.toml`` (in the current directory) for ``epochs`` epochs,
    evaluated every ``every`` samples; its accuracy by samples."""
    run_dir = out / f"{protocol}-seed{seed}"
    overrides = FIXED_DEVICE + [
        f"train.seed={seed}",
        f"train.max_epochs={epochs}",
        f"train.eval_every_samples={every}",
        "train.stop_at_target=false",
    ]
    distsgd.train(f"{protocol}.toml", overrides=overrides, out_dir=run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["samples"]: r["eval_metric"] for r in records}


def differences(curves: dict[str, list[Curve]], protocol: str) -> dict[int, list[float]]:
    """Per sample count that every run evaluated: ``protocol``'s accuracy minus hardsync's
    in points, one per seed (seeds paired: the same seed's runs)."""
    reference = curves[PROTOCOLS[0]]
    common = set.intersection(*(set(c) for runs in curves.values() for c in runs))
    return {
        s: [100 * (c[s] - r[s]) for c, r in zip(curves[protocol], reference, strict=True)]
        for s in sorted(common)
    }


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):+.2f} ± {sd:.2f}"


def table(curves: dict[str, list[Curve]]) -> str:
    """Markdown: per evaluation, hardsync's mean accuracy (%) and every other protocol's
    mean and its difference to hardsync (points, mean ± sd over seeds)."""
    deltas = {p: differences(curves, p) for p in PROTOCOLS[1:]}
    header = ["samples", f"{PROTOCOLS[0]} (%)"] + [f"{p} (%, Δ points)" for p in PROTOCOLS[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for s in deltas[PROTOCOLS[1]]:
        ref = statistics.fmean(100 * c[s] for c in curves[PROTOCOLS[0]])
        cells = [str(s), f"{ref:.2f}"]
        for p in PROTOCOLS[1:]:
            acc = statistics.fmean(100 * c[s] for c in curves[p])
            cells.append(f"{acc:.2f} ({_mean_sd(deltas[p][s])})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(curves: dict[str, list[Curve]]) -> list[str]:
    """Per protocol: the mean difference at the final evaluation and the largest mean
    |difference| over the second half of the evaluations, against 1 point."""
    lines = []
    for p in PROTOCOLS[1:]:
        deltas = differences(curves, p)
        samples = list(deltas)
        final = statistics.fmean(deltas[samples[-1]])
        late = max(abs(statistics.fmean(deltas[s])) for s in samples[len(samples) // 2 :])
        within = "within" if abs(final) <= 1.0 else "NOT within"
        lines.append(
            f"{p}: final evaluation ({samples[-1]} samples) {final:+.2f} points vs "
            f"{PROTOCOLS[0]} ({within} 1 point); largest |mean Δ| over the second half "
            f"{late:.2f} points"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=float, default=4.0)
    parser.add_argument("--every", type=int, default=640, help="evaluate every N samples")
    parser.add_argument("--out", type=Path, default=Path("runs/compare_bn"))
    args = parser.parse_args(argv)
    curves: dict[str, list[Curve]] = {p: [] for p in PROTOCOLS}
    for seed in args.seeds:
        for p in PROTOCOLS:
            curves[p].append(train_curve(p, seed, args.epochs, args.every, args.out))
            print(f"trained {p} seed {seed}", file=sys.stderr, flush=True)
    text = "\n".join(
        [
            f"Held-out accuracy, seeds {args.seeds}, {args.epochs} epochs "
            "(mean over seeds; Δ: minus hardsync, points, mean ± sd)",
            "",
            table(curves),
            "",
            *verdict(curves),
        ]
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_bn.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
