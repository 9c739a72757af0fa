"""Plain PyTorch DDP throughput: a fixed number of training samples, no evaluation.

The companion of ``bench/ddp_baseline.py`` (same launcher, same loop: torch's
``DistributedDataParallel`` over gloo, ``torch.optim.SGD``, cross-entropy, one thread per
process, each rank its slice of every global batch of a per-epoch permutation) for
throughput only: it trains ``--samples`` global samples (rounded up to whole steps) and
rank 0 writes samples per wall second of training. Data and model come from distsgd (the
same IDX reader or synthetic set, the same model factory), so only the loop differs.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_throughput.py \\
        --model cnn --batch 128 --samples 8192 --out result.json

Training seconds: the sum over steps of each step's wall seconds on rank 0 (forward,
backward with its all-reduce, optimizer step, minibatch indexing), as ``distsgd train``
counts ``train_wall_s``; start-up (process group, data, model) is excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.models import build_model


def data_config(synthetic_train: int) -> DataConfig:
    """Fashion-MNIST, or (``synthetic_train`` > 0) distsgd's synthetic set of that many
    training samples of the same shape ``[1, 28, 28]``, 10 classes."""
    if synthetic_train > 0:
        return DataConfig(dataset="synthetic", num_train=synthetic_train, num_test=64)
    return DataConfig()


def train_samples(args: argparse.Namespace) -> dict:
    """Train ``args.samples`` global samples; returns samples, steps, training seconds and
    samples/s as measured on this rank."""
    ds = load_dataset(data_config(args.synthetic_train), seed=args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build_model(args.model, ds.input_shape, ds.num_classes))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    b, n = args.batch, ds.num_train
    global_batch = world * b
    steps = -(-args.samples // global_batch)
    steps_per_epoch = n // global_batch
    if steps_per_epoch < 1:
        raise ValueError(f"--batch {b} × {world} processes exceeds the {n} training samples")
    train_s = 0.0
    perm = None
    dist.barrier()
    for step in range(steps):
        s = step % steps_per_epoch
        if s == 0:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step // steps_per_epoch)
            perm = torch.randperm(n, generator=g)
        t0 = time.perf_counter()
        idx = perm[s * global_batch + rank * b : s * global_batch + (rank + 1) * b]
        loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        train_s += time.perf_counter() - t0
    samples = steps * global_batch
    return {
        "world_size": world,
        "threads_per_process": torch.get_num_threads(),
        "batch_per_process": b,
        "samples": samples,
        "steps": steps,
        "train_wall_s": train_s,
        "throughput_samples_per_s": samples / train_s,
        "final_loss": float(loss.detach()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn", help="distsgd model name")
    ap.add_argument("--batch", type=int, default=128, help="per-process batch size, samples")
    ap.add_argument("--samples", type=int, default=8192, help="global training samples")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--synthetic-train",
        type=int,
        default=0,
        help="0: Fashion-MNIST; N > 0: distsgd's synthetic set with N training samples",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--out", type=Path, default=None, help="JSON result file (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    result = train_samples(args)
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
