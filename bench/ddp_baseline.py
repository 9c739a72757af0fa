"""Plain PyTorch DDP baseline (SPEC.md §1, §5): Fashion-MNIST ``cnn`` until a target test
accuracy, launched with torch's own launcher, one thread per process.

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_baseline.py \\
        --batch 64 --lr 0.05 --momentum 0.9 --target 0.9 --eval-every 5000 --out result.json

Global batch = nproc × ``--batch``. Every ``--eval-every`` training samples (global) rank 0
evaluates on the whole test set while the other ranks wait; the run stops at the first
evaluation at or above ``--target``. Time to accuracy counts training only (evaluation
excluded, as ``distsgd train`` counts it); total wall time is reported too. Data and model
come from distsgd (the same IDX reader, normalisation and ``cnn``) so that only the
training loop differs; the loop itself is torch's: ``DistributedDataParallel`` over gloo,
``torch.optim.SGD``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description="DDP baseline to a target accuracy")
    ap.add_argument("--batch", type=int, default=64, help="per-process batch size")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--eval-every", type=int, default=5000, help="global training samples")
    ap.add_argument("--max-epochs", type=float, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON result file (rank 0)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = load_dataset(DataConfig(dataset="fashion_mnist"), seed=args.seed)
    torch.manual_seed(args.seed)
    model = build_model("cnn", ds.input_shape, ds.num_classes)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    n = ds.num_train
    global_batch = world * args.batch
    steps_per_epoch = n // global_batch
    samples = 0
    train_s = 0.0
    t_start = time.perf_counter()
    next_eval = 0
    reached = None
    history = []
    epoch = 0
    done = torch.zeros(1)
    while epoch < args.max_epochs and reached is None:
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(n, generator=g)
        for step in range(steps_per_epoch):
            if samples >= next_eval:
                if rank == 0:
                    model.eval()
                    correct = 0
                    with torch.no_grad():
                        for i in range(0, ds.num_test, 1000):
                            out = model(ds.test_x[i : i + 1000])
                            correct += int((out.argmax(1) == ds.test_y[i : i + 1000]).sum())
                    acc = correct / ds.num_test
                    history.append({"samples": samples, "train_s": train_s, "accuracy": acc})
                    done[0] = 1.0 if acc >= args.target else 0.0
                    model.train()
                dist.broadcast(done, 0)
                next_eval += args.eval_every
                if done[0] > 0:
                    reached = {"samples": samples, "train_s": train_s}
                    break
            t0 = time.perf_counter()
            base = step * global_batch + rank * args.batch
            idx = perm[base : base + args.batch]
            loss = F.cross_entropy(ddp(ds.train_x[idx]), ds.train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_s += time.perf_counter() - t0
            samples += global_batch
        epoch += 1
    total = time.perf_counter() - t_start
    if rank == 0:
        result = {
            "world_size": world,
            "threads_per_process": torch.get_num_threads(),
            "batch_per_process": args.batch,
            "global_batch": global_batch,
            "lr": args.lr,
            "momentum": args.momentum,
            "target": args.target,
            "reached": reached is not None,
            "time_to_target_s": reached["train_s"] if reached else None,
            "samples_to_target": reached["samples"] if reached else None,
            "total_wall_s": total,
            "history": history,
        }
        print(json.dumps({k: v for k, v in result.items() if k != "history"}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
