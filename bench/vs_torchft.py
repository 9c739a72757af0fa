"""DiLoCo side by side: torchft's ``DiLoCo`` and distsgd's (the drop-in) on the same work.

Two processes on loopback train the same Fashion-MNIST model (distsgd's ``mlp``, the
same initial weights from ``--seed``) with the same inner optimizer (SGD, ``--lr``,
``--momentum``), the same minibatches (process r takes its b samples of each step from a
seeded permutation per epoch), the same H (``--sync-every``) and the same outer
optimizer (Nesterov SGD ``--outer-lr``, ``--outer-momentum``). Only the wrapper
differs: ``distsgd.torch.DistributedOptimizer`` under ``protocol = "diloco"``, or
torchft's ``Manager`` (a lighthouse in the parent, one replica group per process,
gloo) with ``torchft.local_sgd.DiLoCo``. Each system runs ``--seeds`` seeds, one after
the other, alternating.

At every outer step rank 0 keeps a copy of the weights and the training wall seconds so
far (evaluation is not in the loop, so it takes no time from training); afterwards the
copies are evaluated on the whole test set. Reported per run: samples and wall seconds to
``--target`` (the first outer step at or above it), final accuracy; then the medians over
the seeds and distsgd's ratios to torchft's. torchft is a bench-only dependency
(``pip install --no-deps torchft==0.2.0`` plus its opentelemetry requirements).

    flock /tmp/distsgd-bench.lock python bench/vs_torchft.py --seeds 3 --lr 0.05 --momentum 0 \\
        --out bench/results/vs_torchft.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from distsgd.config import DataConfig
from distsgd.data import load_dataset
from distsgd.models import build_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(
    rank: int, args: dict, model, inner, after_step
) -> list[tuple[int, float, torch.Tensor]]:
    """The user's loop, the same for both systems: ``args['steps']`` steps of b samples
    per process; rank 0 keeps (samples, train seconds, weights) at every outer step."""
    ds = args["dataset"]
    b, world, h = args["batch"], 2, args["sync_every"]
    n = ds.num_train
    per_epoch = n // (world * b)
    snapshots = [(0, 0.0, _flat(model))] if rank == 0 else []
    train_s = 0.0
    perm = None
    for step in range(args["steps"]):
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            g = torch.Generator().manual_seed(args["seed"] * 1000 + epoch)
            perm = torch.randperm(n, generator=g)
        t0 = time.perf_counter()
        idx = perm[(i * world + rank) * b : (i * world + rank + 1) * b]
        loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
        inner.zero_grad(set_to_none=True)
        loss.backward()
        after_step()
        train_s += time.perf_counter() - t0
        if rank == 0 and (step + 1) % h == 0:
            snapshots.append(((step + 1) * world * b, train_s, _flat(model)))
    return snapshots


def _model(args: dict) -> torch.nn.Module:
    ds = args["dataset"]
    torch.manual_seed(args["seed"])
    return build_model("mlp", ds.input_shape, ds.num_classes)


def _inner(model: torch.nn.Module, args: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=args["momentum"])


def _distsgd(rank: int, args: dict) -> list:
    import distsgd.torch as dsgd

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args["port"]),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    ctx = dsgd.init(
        "diloco",
        average_every=args["sync_every"],
        outer_lr=args["outer_lr"],
        outer_momentum=args["outer_momentum"],
        outer_nesterov=True,
        batch_size=args["batch"],
    )
    model = _model(args)
    inner = _inner(model, args)
    opt = dsgd.DistributedOptimizer(inner, model, ctx)
    try:
        return _train(rank, args, model, inner, opt.step)
    finally:
        ctx.close()


def _torchft(rank: int, args: dict) -> list:
    import torch.distributed as dist
    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    model = _model(args)
    inner = _inner(model, args)
    outer = torch.optim.SGD(
        model.parameters(), lr=args["outer_lr"], momentum=args["outer_momentum"], nesterov=True
    )
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        min_replica_size=2,
        use_async_quorum=False,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["inner"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica{rank}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args["lighthouse"],
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=60),
    )
    try:
        with DiLoCo(
            manager,
            [model],
            inner,
            [outer],
            sync_every=args["sync_every"],
            backup_device=torch.device("cpu"),
            pin_memory=False,
        ):
            return _train(rank, args, model, inner, inner.step)
    finally:
        manager.shutdown(wait=False)


def _child(rank: int, system: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    args = {**args, "dataset": load_dataset(DataConfig(dataset="fashion_mnist"), seed=args["seed"])}
    snaps = (_distsgd if system == "distsgd" else _torchft)(rank, args)
    if rank == 0:
        torch.save(snaps, out)


def _accuracy(flat: torch.Tensor, model: torch.nn.Module, ds) -> float:
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    with torch.no_grad():
        right = sum(
            int((model(ds.test_x[i : i + 2000]).argmax(1) == ds.test_y[i : i + 2000]).sum())
            for i in range(0, ds.num_test, 2000)
        )
    return right / ds.num_test


def run(system: str, seed: int, opts: argparse.Namespace, ds) -> dict:
    args = {
        "seed": seed,
        "batch": opts.batch,
        "lr": opts.lr,
        "momentum": opts.momentum,
        "sync_every": opts.sync_every,
        "outer_lr": opts.outer_lr,
        "outer_momentum": opts.outer_momentum,
        "steps": opts.steps,
        "port": _free_port(),
    }
    lighthouse = None
    if system == "torchft":
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100)
        args["lighthouse"] = lighthouse.address()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "snapshots.pt")
        t0 = time.perf_counter()
        mp.spawn(_child, args=(system, args, out), nprocs=2, join=True)
        total = time.perf_counter() - t0
        snaps = torch.load(out, weights_only=True)
    if lighthouse is not None:
        lighthouse.shutdown()
    torch.manual_seed(0)
    model = build_model("mlp", ds.input_shape, ds.num_classes)
    curve = [(s, t, _accuracy(w, model, ds)) for s, t, w in snaps]
    hit = next(((s, t) for s, t, a in curve if a >= opts.target), None)
    return {
        "system": system,
        "seed": seed,
        "samples_to_target": hit[0] if hit else None,
        "seconds_to_target": hit[1] if hit else None,
        "final_accuracy": curve[-1][2],
        "train_s": curve[-1][1],
        "total_wall_s": total,
        "curve": [(s, round(t, 3), a) for s, t, a in curve],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=936, help="steps per process (936: 1 epoch)")
    ap.add_argument("--batch", type=int, default=32, help="samples per process per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--sync-every", type=int, default=8, help="H, inner steps per outer step")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out", default=None, help="JSON file of every run")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset(DataConfig(dataset="fashion_mnist"), seed=0)
    runs = []
    for seed in range(opts.seeds):
        for system in ("torchft", "distsgd"):
            r = run(system, seed, opts, ds)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
    summary = {}
    for system in ("torchft", "distsgd"):
        mine = [r for r in runs if r["system"] == system]
        reached = [r for r in mine if r["samples_to_target"] is not None]
        summary[system] = {
            "reached": f"{len(reached)}/{len(mine)}",
            "median_samples_to_target": (
                statistics.median(r["samples_to_target"] for r in reached) if reached else None
            ),
            "median_seconds_to_target": (
                statistics.median(r["seconds_to_target"] for r in reached) if reached else None
            ),
            "median_final_accuracy": statistics.median(r["final_accuracy"] for r in mine),
            "median_train_s": statistics.median(r["train_s"] for r in mine),
        }
    a, b = summary["distsgd"], summary["torchft"]
    ratios = {
        key: a[key] / b[key] if a[key] and b[key] else None
        for key in ("median_samples_to_target", "median_seconds_to_target", "median_train_s")
    }
    print(json.dumps({"summary": summary, "distsgd_over_torchft": ratios}, indent=1))
    if opts.out:
        Path(opts.out).write_text(
            json.dumps({"args": vars(opts), "summary": summary, "ratios": ratios, "runs": runs})
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
