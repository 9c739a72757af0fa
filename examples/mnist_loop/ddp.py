"""PyTorch's MNIST example loop (a Net of two conv layers with dropout, Adadelta with
StepLR, train() and test() per epoch) on Fashion-MNIST, twice: ``ddp.py`` under DDP and
``distsgd_loop.py`` on any distsgd protocol, named by the environment variable PROTOCOL
(default hardsync). ``diff ddp.py distsgd_loop.py`` is what changes:

    torchrun --nproc-per-node 4 examples/mnist_loop/ddp.py --epochs 3
    PROTOCOL=sma torchrun --nproc-per-node 4 examples/mnist_loop/distsgd_loop.py --epochs 3
    PROTOCOL=parameter_server torchrun --nproc-per-node 4 examples/mnist_loop/distsgd_loop.py
"""

import argparse
import gzip
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DATA = Path("/usr/share/datasets/fashion-mnist")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def read_idx(path):
    """An IDX file (gzip): uint8 tensor of its shape."""
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).view(shape)


def fashion_mnist(split, limit):
    """Fashion-MNIST ``train`` or ``t10k``: images [N, 1, 28, 28] normalised, labels [N]."""
    x = read_idx(DATA / f"{split}-images-idx3-ubyte.gz")[: limit or None]
    y = read_idx(DATA / f"{split}-labels-idx1-ubyte.gz")[: limit or None]
    x = (x.float().div(255).unsqueeze(1) - 0.2860) / 0.3530
    return TensorDataset(x, y.long())


def log(text):
    print(f"[rank {os.environ.get('RANK', '0')}] {text}", flush=True)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            log(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.sampler)}]"
                f"\tLoss: {loss.item():.6f}"
            )


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    test_loss /= len(test_loader.dataset)
    log(
        f"Test set: Average loss: {test_loss:.4f}, "
        f"Accuracy: {correct}/{len(test_loader.dataset)} "
        f"({100.0 * correct / len(test_loader.dataset):.2f}%)"
    )


def main():
    parser = argparse.ArgumentParser(description="Fashion-MNIST example loop")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--train-samples", type=int, default=0, help="0: all 60000")
    parser.add_argument("--test-samples", type=int, default=0, help="0: all 10000")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    dist.init_process_group("gloo")

    dataset1 = fashion_mnist("train", args.train_samples)
    dataset2 = fashion_mnist("t10k", args.test_samples)
    train_sampler = DistributedSampler(dataset1)
    train_loader = DataLoader(dataset1, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(dataset2, batch_size=args.test_batch_size)

    model = DDP(Net().to(device))
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
