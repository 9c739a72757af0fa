"""Simulator cost: wall time of the simulated cluster vs a plain PyTorch loop.

Both train Fashion-MNIST ``cnn`` over the same number of samples at the same per-learner
batch, side by side in one process, alternating, ``--repeats`` times each; the ratio of
medians is reported (target <= 1.15: the simulation of λ learners should cost little more
than computing their gradients). Evaluation is excluded from both.

    python bench/sim_cost.py --samples 30000 --repeats 3 --out bench/results/sim_cost.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import distsgd
from distsgd.config import DataConfig
from distsgd.data import ShardedSampler, load_dataset
from distsgd.models import build_model

PROTOCOLS = {
    "plain (λ=1)": ["protocol.name=plain", "protocol.num_learners=1"],
    "hardsync λ=4": ["protocol.name=hardsync", "protocol.num_learners=4"],
    "async λ=4": [
        "protocol.name=parameter_server",
        "protocol.mode=async",
        "protocol.num_learners=4",
        "protocol.staleness_lr=softsync",
    ],
    "groups λ=4 g=2": [
        "protocol.name=compute_groups",
        "protocol.num_learners=4",
        "protocol.num_groups=2",
    ],
    "sma λ=4 k=4": [
        "protocol.name=sma",
        "protocol.num_learners=4",
        "protocol.replicas_per_device=4",
    ],
}


def plain_loop(samples: int, batch_size: int, seed: int, threads: int) -> float:
    """A textbook PyTorch loop: seconds for ``samples`` samples (data on the CPU already)."""
    torch.set_num_threads(threads)
    ds = load_dataset(DataConfig(), seed=seed)
    torch.manual_seed(seed)
    model = build_model("cnn", ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = ShardedSampler(ds.num_train, 1, batch_size, seed)
    model.train()
    done, epoch, step = 0, 0, 0
    t0 = time.perf_counter()
    while done < samples:
        if step == sampler.steps_per_epoch:
            epoch, step = epoch + 1, 0
        idx = sampler.batch_indices(0, epoch, step)
        step += 1
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
        loss.backward()
        opt.step()
        float(loss.detach())
        done += batch_size
    return time.perf_counter() - t0


def sim_run(overrides: list[str], samples: int, batch_size: int, seed: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        s = distsgd.train(
            None,
            overrides=[
                *overrides,
                f"protocol.batch_size={batch_size}",
                f"train.max_samples={samples}",
                "train.max_epochs=0",
                "train.target=0",
                f"train.eval_every_samples={10 * samples}",
                "train.checkpoint_every_evals=0",
                f"train.seed={seed}",
                f"train.num_threads={threads}",
                "train.tensorboard=false",
                # a fixed profile: calibration is not part of the cost being measured
                "cluster.seconds_per_sample=1e-4",
                "cluster.seconds_per_batch=1e-3",
            ],
            out_dir=Path(d) / "run",
        )
        return s["train_wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=30000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args()

    times: dict[str, list[float]] = {"plain PyTorch loop": []}
    times.update({k: [] for k in PROTOCOLS})
    for r in range(args.repeats):
        times["plain PyTorch loop"].append(
            plain_loop(args.samples, args.batch_size, r, args.threads)
        )
        for name, ov in PROTOCOLS.items():
            times[name].append(sim_run(ov, args.samples, args.batch_size, r, args.threads))
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)

    base = statistics.median(times["plain PyTorch loop"])
    lines = [
        f"# Simulator cost: {args.samples} samples of Fashion-MNIST `cnn`, per-learner batch "
        f"{args.batch_size}, {args.threads} threads, median of {args.repeats}",
        "",
        "| run | wall s (median) | samples/s | ratio to plain loop |",
        "|---|---|---|---|",
    ]
    for name, ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {m:.2f} | {args.samples / m:.0f} | {m / base:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
