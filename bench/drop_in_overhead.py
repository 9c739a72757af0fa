"""Overhead of the drop-in (``distsgd.torch``) hardsync against plain DDP, side by side.

Every rank holds two copies of the same model: one wrapped in torch's
``DistributedDataParallel`` with ``torch.optim.SGD``, one trained by the same SGD wrapped
in ``distsgd.torch.DistributedOptimizer`` (protocol ``hardsync``: gradient buckets of
``--bucket-cap-mb`` whose all-reduces start from backward, as DDP's). They alternate in blocks of ``--block`` steps on the same
minibatches (the drop-in's Sampler), ``--rounds`` times, so both see the same machine
load (a first round of each warms up, uncounted); rank 0 sums each one's step wall seconds (forward, backward, all-reduce, step) and
writes samples/s of each, their ratio (issue 16: wrapper ≥ 0.95 × DDP), the CPU
milliseconds per step of each (``time.process_time``: all of the rank's threads, gloo's
included; less sensitive to the other engineers' load than wall time), rank 0's wall
milliseconds per step in each phase (``PHASES``) and the load average before and after
(the machine is shared).

``--compare-with PATH`` adds a third contestant, the ``DistributedOptimizer`` of another
checkout's ``distsgd/torch/optimizer.py`` (e.g. ``/work/main``'s: the code before a
change), loaded under this checkout's package, so before and after run side by side in
one invocation. ``--protocol`` times another protocol's drop-in (e.g. ``diloco``, whose
step hands the user's step to the protocol object) against the same DDP baseline.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/drop_in_overhead.py --model cnn --batch 128 --out result.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import distsgd.torch as dsgd
from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.models import build_model

PHASES = ("zero_grad_forward", "backward", "step")
"""A step's phases, timed apart: where the all-reduces are waited for differs (DDP and
the drop-in now at the end of backward, the drop-in before bucket views in ``step``)."""


def load_optimizer_module(path: str) -> ModuleType:
    """``path`` (an ``optimizer.py`` of ``distsgd.torch``) as a module of this package."""
    spec = importlib.util.spec_from_file_location("distsgd.torch._compared_optimizer", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare-with {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each, alternating")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="both: DDP's and ours")
    parser.add_argument("--compare-with", default=None, help="another optimizer.py to time")
    parser.add_argument(
        "--protocol", default="hardsync", help="the drop-in's protocol (DDP stays hardsync)"
    )
    parser.add_argument("--average-every", type=int, default=8, help="local SGD / DiLoCo H")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    extra = (
        {"average_every": args.average_every} if args.protocol in ("local_sgd", "diloco") else {}
    )
    ctx = dsgd.init(args.protocol, **extra)
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
    if args.compare_with:
        other = build_model(args.model, ds.input_shape, ds.num_classes)
        other.load_state_dict(plain.state_dict())
        compared = load_optimizer_module(args.compare_with).DistributedOptimizer
        sgd = torch.optim.SGD(other.parameters(), lr=0.01, momentum=0.9)
        runs["drop_in_compared"] = (
            other,
            compared(sgd, other, ctx, bucket_cap_mb=args.bucket_cap_mb),
        )
    seconds = {name: 0.0 for name in runs}
    cpu_seconds = {name: 0.0 for name in runs}
    phase_seconds = {name: dict.fromkeys(PHASES, 0.0) for name in runs}
    steps = {name: 0 for name in runs}
    load_before = os.getloadavg()
    i = 0
    for r in range(args.rounds + 1):  # round 0 warms all up and is not counted
        for name, (model, opt) in runs.items():
            for _ in range(args.block):
                x, y = batches[i % len(batches)]
                i += 1
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                if r > 0:
                    seconds[name] += t3 - t0
                    cpu_seconds[name] += time.process_time() - c0
                    steps[name] += 1
                    for phase, s in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                        phase_seconds[name][phase] += s
    if ctx.rank == 0:
        rate = {n: steps[n] * args.batch * ctx.world_size / seconds[n] for n in runs}
        result = {
            "model": args.model,
            "protocol": args.protocol,
            "batch_per_process": args.batch,
            "processes": ctx.world_size,
            "steps_each": steps["ddp"],
            "throughput(samples/s)": rate,
            "cpu_per_step(ms)": {n: 1e3 * cpu_seconds[n] / steps[n] for n in runs},
            "wall_per_step_by_phase(ms)": {
                n: {p: 1e3 * s / steps[n] for p, s in phase_seconds[n].items()} for n in runs
            },
            "drop_in_over_ddp": rate["drop_in"] / rate["ddp"],
            "bucket_cap_mb": args.bucket_cap_mb,
            "load_average_1_5_15(before)": load_before,
            "load_average_1_5_15(after)": os.getloadavg(),
        }
        if args.compare_with:
            source = Path(args.compare_with).read_bytes()
            result["compared_over_ddp"] = rate["drop_in_compared"] / rate["ddp"]
            result["compared_optimizer"] = {
                "path": args.compare_with,
                "sha256": hashlib.sha256(source).hexdigest(),
            }
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ctx.close()


if __name__ == "__main__":
    main()
