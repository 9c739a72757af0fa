"""A user's own training loop (model, data, loss, logging) on any distsgd protocol.

Run with torchrun; one argument switches the protocol::

    torchrun --nproc-per-node 4 examples/own_loop/train.py --protocol hardsync
    torchrun --nproc-per-node 4 examples/own_loop/train.py --protocol sma
    torchrun --nproc-per-node 4 examples/own_loop/train.py --protocol softsync   # rank 0 serves
    torchrun --nproc-per-node 4 examples/own_loop/train.py --protocol async

An asynchronous run that must survive a killed learner runs under distsgd's launcher
instead (torchrun's agent stops every rank when one dies)::

    python -m distsgd.torch.launch --nproc-per-node 4 examples/own_loop/train.py --protocol async

The task: 10 Gaussian classes on 16 squashed features (made here from a seed, so
every machine has it without a download). Prints one line per
epoch (rank 0 or the first learner), then the test accuracy of the protocol's model
(z for SMA, the server's for the parameter server) and whether it reached --target;
the exit status is 0 when it did.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distsgd.torch as dsgd

# --protocol: (distsgd protocol, its settings)
PROTOCOLS = {
    "hardsync": ("hardsync", {}),
    "local_sgd": ("local_sgd", {"average_every": 4}),
    "sma": ("sma", {"alpha": 0.1, "central_momentum": 0.9}),
    "softsync": ("parameter_server", {"mode": "softsync", "softsync": 1, "momentum": 0.9}),
    "async": ("parameter_server", {"mode": "async", "staleness_lr": "softsync", "momentum": 0.9}),
    "compute_groups": ("compute_groups", {"num_groups": 1, "momentum": 0.9}),
}


def make_data(num_samples: int, seed: int) -> TensorDataset:
    """``num_samples`` points ``[16]`` of 10 Gaussian classes around fixed random means."""
    means = 0.6 * torch.randn(10, 16, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (num_samples,), generator=g)
    x = means[y] + 0.5 * torch.randn(num_samples, 16, generator=g)
    return TensorDataset(torch.tanh(x), y)  # squashed: the classes are not linear any more


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="hardsync")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    parser.add_argument("--out", default=None, help="server: staleness.json, summary.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    name, settings = PROTOCOLS[args.protocol]
    try:
        ctx = dsgd.init(name, **settings)  # 1. join the run
    except dsgd.ConfigError as e:  # a layout the world cannot hold: one line, exit status 2
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = make_model()
    test = make_data(2000, seed=2)
    if ctx.is_server:  # parameter server / compute groups: rank 0 serves
        result = ctx.serve(model, out_dir=args.out)
        ctx.close()
        print(f"server: {result.num_updates} updates, staleness {result.staleness_counts}")
        return report(accuracy(model, test), args.target)

    train = make_data(8000, seed=1)
    sampler = dsgd.Sampler(train, ctx, batch_size=args.batch_size)  # 2. shard the data
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = dsgd.DistributedOptimizer(sgd, model, ctx)  # 3. wrap the optimizer
    talk = ctx.learner == 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, total, count = time.perf_counter(), 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step(loss)
            total, count = total + loss.item(), count + 1
        if talk:
            seconds = time.perf_counter() - t0
            print(f"epoch {epoch + 1}: train loss {total / count:.4f} ({seconds:.1f} s)")
    weights = opt.eval_weights()  # collective for local SGD between averagings
    ctx.close()
    if ctx.has_server or not talk:  # the server reports the central model's accuracy
        return 0
    torch.nn.utils.vector_to_parameters(weights, model.parameters())
    return report(accuracy(model, test), args.target)


def report(acc: float, target: float) -> int:
    reached = acc >= target
    print(f"test accuracy {acc:.4f} (target {target}): {'reached' if reached else 'NOT reached'}")
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
