"""Training throughput of the Fashion-MNIST default through each data path.

The default run (``cnn``, hardsync λ = 4 × b = 32, simulated runtime, evaluation off,
a fixed device profile so that no calibration runs) trains ``--samples`` samples with
its data given three ways, alternating, ``--repeats`` times each, in one process:

* ``builtin`` — ``data.dataset = "fashion_mnist"``: the registered built-in factory,
  tensors (a batch is two index operations);
* ``factory-tensors`` — the same tensors returned by a user data factory
  (``data.factory``), the path a user's tensor data takes;
* ``factory-items`` — the same samples as a map-style ``torch.utils.data.Dataset`` of
  ``(image, label)`` items, batched by ``default_collate`` (the general path).

The ratio of each path's median samples/s to ``builtin``'s is reported. Run the
``builtin`` path alone on an older checkout (``--variants builtin``, with ``PYTHONPATH``
pointing at it) to compare with the code before the general data path; see
``bench/results/data_path.md``.

    flock /tmp/distsgd-bench.lock python bench/data_path.py --samples 6400 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

import distsgd
from distsgd.config import DataConfig
from distsgd.data import load_dataset

VARIANTS = {
    "builtin": [],
    "factory-tensors": ["data.factory=bench.data_path:fashion_mnist_tensors"],
    "factory-items": [
        "data.factory=bench.data_path:fashion_mnist_items",
        "model.kwargs.num_classes=10",
    ],
}
BASE = [
    "model.name=cnn",
    "protocol.name=hardsync",
    "protocol.num_learners=4",
    "protocol.batch_size=32",
    "train.evaluate=false",
    "train.target=0",
    "train.tensorboard=false",
    "train.checkpoint_every_evals=0",
    "cluster.seconds_per_sample=1e-4",
    "cluster.seconds_per_batch=1e-3",
]


def fashion_mnist_tensors() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The built-in Fashion-MNIST tensors, as a user's factory would return them."""
    ds = load_dataset(DataConfig())
    return (ds.train_x, ds.train_y), (ds.test_x, ds.test_y)


class Items(Dataset):
    """Map-style view of tensors: item i is ``(x[i], y[i])``."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def fashion_mnist_items() -> tuple[Items, Items]:
    """The same samples as map-style data sets of ``(image, label)`` items."""
    (tx, ty), (ex, ey) = fashion_mnist_tensors()
    return Items(tx, ty), Items(ex, ey)


def throughput(variant: str, samples: int, threads: int) -> float:
    """Training samples per wall second of one run (evaluation off)."""
    with tempfile.TemporaryDirectory() as tmp:
        s = distsgd.train(
            None,
            overrides=BASE
            + VARIANTS[variant]
            + [f"train.max_samples={samples}", f"train.num_threads={threads}"],
            out_dir=Path(tmp) / "run",
            progress=False,
        )
    return float(s["throughput_samples_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=6400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    torch.set_num_threads(args.threads)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:  # alternating: a change of load reaches every path alike
            rates[v].append(throughput(v, args.samples, args.threads))
    load = (
        " ".join(Path("/proc/loadavg").read_text().split()[:3])
        if os.path.exists("/proc/loadavg")
        else "?"
    )
    base = statistics.median(rates[variants[0]])
    print(f"load average after: {load}; {args.samples} samples, {args.threads} threads")
    print("| data path | samples/s (median) | runs | ratio to first |")
    print("|---|---|---|---|")
    for v in variants:
        med = statistics.median(rates[v])
        runs = ", ".join(f"{r:.0f}" for r in rates[v])
        print(f"| {v} | {med:.0f} | {runs} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
