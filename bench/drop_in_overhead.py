"""Overhead of the drop-in (``distsgd.torch``) hardsync against plain DDP, side by side.

Every rank holds two copies of the same model: one wrapped in torch's
``DistributedDataParallel`` with ``torch.optim.SGD``, one trained by the same SGD wrapped
in ``distsgd.torch.DistributedOptimizer`` (protocol ``hardsync``: gradient buckets of
``--bucket-cap-mb`` whose all-reduces start from backward, as DDP's). They alternate in blocks of ``--block`` steps on the same
minibatches (the drop-in's Sampler), ``--rounds`` times, so both see the same machine
load (a first round of each warms up, uncounted); rank 0 sums each one's step wall seconds (forward, backward, all-reduce, step) and
writes samples/s of each, their ratio (issue 16: wrapper ≥ 0.95 × DDP) and the load
average before and after (the machine is shared).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/drop_in_overhead.py --model cnn --batch 128 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import distsgd.torch as dsgd
from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each, alternating")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="both: DDP's and ours")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = dsgd.init("hardsync")
    ds = load_dataset(DataConfig(dataset="synthetic", num_train=8192, num_test=64), seed=0)
    data = TensorDataset(ds.train_x, ds.train_y)
    sampler = dsgd.Sampler(data, ctx, batch_size=args.batch)
    batches = list(DataLoader(data, batch_size=args.batch, sampler=sampler))
    torch.manual_seed(0)
    plain = build_model(args.model, ds.input_shape, ds.num_classes)
    mine = build_model(args.model, ds.input_shape, ds.num_classes)
    mine.load_state_dict(plain.state_dict())
    ddp = DistributedDataParallel(plain, bucket_cap_mb=args.bucket_cap_mb)
    runs = {
        "ddp": (ddp, torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)),
        "drop_in": (
            mine,
            dsgd.DistributedOptimizer(
                torch.optim.SGD(mine.parameters(), lr=0.01, momentum=0.9),
                mine,
                ctx,
                bucket_cap_mb=args.bucket_cap_mb,
            ),
        ),
    }
    seconds = {name: 0.0 for name in runs}
    steps = {name: 0 for name in runs}
    load_before = os.getloadavg()
    i = 0
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        for name, (model, opt) in runs.items():
            for _ in range(args.block):
                x, y = batches[i % len(batches)]
                i += 1
                t0 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                if r > 0:
                    seconds[name] += time.perf_counter() - t0
                    steps[name] += 1
    if ctx.rank == 0:
        rate = {n: steps[n] * args.batch * ctx.world_size / seconds[n] for n in runs}
        result = {
            "model": args.model,
            "batch_per_process": args.batch,
            "processes": ctx.world_size,
            "steps_each": steps["ddp"],
            "throughput(samples/s)": rate,
            "drop_in_over_ddp": rate["drop_in"] / rate["ddp"],
            "bucket_cap_mb": args.bucket_cap_mb,
            "load_average_1_5_15(before)": load_before,
            "load_average_1_5_15(after)": os.getloadavg(),
        }
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ctx.close()


if __name__ == "__main__":
    main()
