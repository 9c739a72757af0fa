"""Statistical efficiency in Crossbow's regime: samples (epochs) to a target test accuracy
for a plain PyTorch loop swept over the batch size b, each with its learning rate and a
linear warm-up for the large batches, against SMA with k small-batch learners
(:class:`distsgd.replica_step.ReplicaStep`, Crossbow Algorithm 1, α = 1/k).

Samples to target do not depend on the machine's speed, so the figures hold on a loaded
CPU; the wall seconds it prints are this machine's and mean nothing elsewhere.

Each run: Fashion-MNIST (``--train-samples`` first training samples, a new permutation
each epoch), evaluation of the whole test set every ``--eval-every`` samples, stop at the
target or after ``--max-epochs``. Plain-loop runs are ``b:lr[:warmup_epochs]``; SMA runs
``k:b:lr``. Example (the CPU table in bench/results/crossbow_regime_cpu.md)::

    python bench/crossbow_regime.py --model mlp --target 0.88 --max-epochs 12 \\
        --plain 64:0.05 256:0.1 1024:0.2:1 1024:0.4:2 --sma 4:16:0.02 \\
        --seeds 0 --out bench/results/crossbow_regime_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's distsgd

from distsgd.config import DataConfig  # noqa: E402
from distsgd.data import load_dataset  # noqa: E402
from distsgd.engine import GradientEngine  # noqa: E402
from distsgd.models import build_model  # noqa: E402
from distsgd.replica_step import ReplicaStep  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        model.eval()
        right = sum(
            int((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum())
            for i in range(0, len(y), 1000)
        )
        model.train()
    return right / len(y)


class Tracker:
    """Evaluates every ``every`` samples; records the first time the target is reached."""

    def __init__(self, target: float, every: int, test: tuple[torch.Tensor, torch.Tensor]):
        self.target, self.every, self.test = target, every, test
        self.next, self.samples, self.train_s, self.best = every, 0, 0.0, 0.0
        self.reached: dict[str, float] | None = None
        self.curve: list[tuple[int, float]] = []

    def count(self, samples: int, seconds: float, model: torch.nn.Module) -> bool:
        """Count a step; True once the target is reached."""
        self.samples += samples
        self.train_s += seconds
        if self.samples < self.next:
            return False
        self.next += self.every
        acc = accuracy(model, *self.test)
        self.curve.append((self.samples, acc))
        self.best = max(self.best, acc)
        if acc >= self.target and self.reached is None:
            self.reached = {"samples": self.samples, "seconds": self.train_s}
        return self.reached is not None


def plain_run(ds, xs, ys, test, device, b, lr, warmup_epochs, args, seed) -> dict[str, Any]:
    """Plain loop: SGD (momentum 0.9), lr rising linearly over ``warmup_epochs``."""
    torch.manual_seed(seed)
    model = build_model(args.model, ds.input_shape, ds.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    n = len(ys)
    warm_steps = max(1, int(warmup_epochs * n / b)) if warmup_epochs else 0
    tr, step = Tracker(args.target, args.eval_every, test), 0
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(args.max_epochs):
        order = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n - b + 1, b):
            step += 1
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, step / warm_steps) if warm_steps else lr
            sync(device)
            t0 = time.perf_counter()
            idx = order[start : start + b]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
            sync(device)
            if tr.count(b, time.perf_counter() - t0, model):
                return result(f"plain b={b} lr={lr} warmup={warmup_epochs}", tr, n)
    return result(f"plain b={b} lr={lr} warmup={warmup_epochs}", tr, n)


def sma_run(ds, xs, ys, test, device, k, b, lr, args, seed) -> dict[str, Any]:
    """SMA: k replicas of b samples each per iteration, α = 1/k, μ = μ_z = 0.9."""
    torch.manual_seed(seed)
    engine = GradientEngine(build_model(args.model, ds.input_shape, ds.num_classes), device=device)
    step = ReplicaStep(engine, engine.initial_weights(), k, b, 1 / k, mode=args.mode)
    view = build_model(args.model, ds.input_shape, ds.num_classes).to(device)
    n = len(ys)
    tr = Tracker(args.target, args.eval_every, test)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    first = torch.arange(k * b, device=device).view(k, b)
    step.warm_up(xs[first], ys[first])  # compiling or capturing is not training time
    name = f"SMA k={k} b={b} lr={lr} mode={step.mode}"
    for _ in range(args.max_epochs):
        order = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n - k * b + 1, k * b):
            idx = order[start : start + k * b].view(k, b)
            sync(device)
            t0 = time.perf_counter()
            step.step(xs[idx], ys[idx], lr)
            sync(device)
            if tr.samples + k * b >= tr.next:  # an evaluation is due: z into the model
                torch.nn.utils.vector_to_parameters(step.z, view.parameters())
            if tr.count(k * b, time.perf_counter() - t0, view):
                return result(name, tr, n)
    return result(name, tr, n)


def result(name: str, tr: Tracker, n: int) -> dict[str, Any]:
    reached = tr.reached or {}
    samples = reached.get("samples")
    return {
        "run": name,
        "samples_to_target": samples,
        "epochs_to_target": None if samples is None else samples / n,
        "train_s_to_target": reached.get("seconds"),
        "samples_run": tr.samples,
        "best": tr.best,
        "curve": tr.curve,
    }


def median_or_none(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) == len(values) and got else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-root", default="")
    ap.add_argument("--train-samples", type=int, default=60_000)
    ap.add_argument("--test-samples", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--target", type=float, default=0.88)
    ap.add_argument("--max-epochs", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=6_000)
    ap.add_argument("--plain", nargs="*", default=[], help="b:lr[:warmup_epochs]")
    ap.add_argument("--sma", nargs="*", default=[], help="k:b:lr")
    ap.add_argument("--mode", default="eager", help="ReplicaStep mode of the SMA runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    table = {"dataset": "fashion_mnist", **({"root": args.data_root} if args.data_root else {})}
    ds = load_dataset(DataConfig(**table))
    xs, ys = (t.to(device) for t in ds.train.batch(torch.arange(args.train_samples)))
    test = tuple(t.to(device) for t in ds.test.batch(torch.arange(args.test_samples)))
    rows = []
    for seed in args.seeds:
        for spec in args.plain:
            b, lr, *w = spec.split(":")
            warm = float(w[0]) if w else 0.0
            rows.append(plain_run(ds, xs, ys, test, device, int(b), float(lr), warm, args, seed))
            rows[-1]["seed"] = seed
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
        for spec in args.sma:
            k, b, lr = spec.split(":")
            rows.append(sma_run(ds, xs, ys, test, device, int(k), int(b), float(lr), args, seed))
            rows[-1]["seed"] = seed
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
