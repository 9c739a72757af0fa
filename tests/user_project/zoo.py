"""Models, data, a loss and a metric that only this test package defines."""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset


class Points(Dataset):
    """Tabular samples as a map-style data set: ``(features [F] float32, label int64)``."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def _clusters(
    n: int, num_features: int, num_classes: int, g: torch.Generator
) -> tuple[Tensor, Tensor]:
    means = torch.randn(num_classes, num_features, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, num_classes, (n,), generator=g)
    # features on very different scales, as tabular columns are (BatchNorm's use)
    scale = torch.logspace(-1, 1, num_features)
    x = (2.0 * means[y] + torch.randn(n, num_features, generator=g)) * scale
    return x, y


def tabular(
    num_train: int = 512, num_test: int = 128, num_features: int = 12, num_classes: int = 3
):
    """Gaussian classes with features of unequal scale, as map-style data sets."""
    g = torch.Generator().manual_seed(0)
    train = Points(*_clusters(num_train, num_features, num_classes, g))
    test = Points(*_clusters(num_test, num_features, num_classes, g))
    return train, test


def tabular_tensors(num_train: int = 512, num_test: int = 128):
    """The same kind of data as a pair of tensor pairs (the fast path)."""
    g = torch.Generator().manual_seed(0)
    return _clusters(num_train, 12, 3, g), _clusters(num_test, 12, 3, g)


def tabular_mlp(
    num_features: int = 12, hidden: int = 32, num_classes: int = 3, batchnorm: bool = True
) -> nn.Module:
    """An MLP with BatchNorm over tabular features: ``[B, F]`` → logits ``[B, K]``."""
    norm: nn.Module = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
    return nn.Sequential(
        nn.Linear(num_features, hidden), norm, nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def tokens(num_train: int = 512, num_test: int = 128, vocab: int = 12, seq_len: int = 8):
    """Token sequences: the next token is the current one plus one (mod ``vocab``).

    Returns ``((x [N, T] int64, y [N, T] int64), (x, y))``: non-image inputs and a target
    per position.
    """
    g = torch.Generator().manual_seed(1)

    def draw(n: int) -> tuple[Tensor, Tensor]:
        start = torch.randint(0, vocab, (n, 1), generator=g)
        x = (start + torch.arange(seq_len)) % vocab
        return x, (x + 1) % vocab

    return draw(num_train), draw(num_test)


class TokenModel(nn.Module):
    """Embedding then a linear layer per position: ``[B, T]`` ids → ``[B, T, vocab]``."""

    def __init__(self, vocab: int = 12, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.embed(x)))


def smooth_l1(outputs: Tensor, targets: Tensor) -> Tensor:
    """A user loss on one-hot targets: ``(outputs [B, K], labels [B]) -> scalar``."""
    onehot = nn.functional.one_hot(targets, outputs.shape[-1]).to(outputs.dtype)
    return nn.functional.smooth_l1_loss(outputs, onehot)


def smooth_l1_raw(outputs: Tensor, targets: Tensor) -> Tensor:
    """A user regression loss: ``(outputs [B, 1], targets [B, 1]) -> scalar``."""
    return nn.functional.smooth_l1_loss(outputs, targets)


def error_rate(outputs: Tensor, targets: Tensor) -> Tensor:
    """A user metric, lower is better: the batch's fraction of wrong predictions."""
    return (outputs.argmax(dim=-1) != targets).float().mean()


# ---- what a user gets wrong ------------------------------------------------------------


def per_sample_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Not a scalar: one loss per sample."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def not_a_module(**kwargs):
    return "a string"


def not_tensor_items(num_train: int = 64):
    return [("text", 1)] * num_train, None


def ragged_items(num_train: int = 64):
    return [(torch.zeros(1 + i % 3), torch.tensor(0)) for i in range(num_train)], None


def raising_factory():
    raise FileNotFoundError("/data/missing.csv")


NOT_CALLABLE = 3


class TupleModel(nn.Module):
    """Returns (logits, features): a forward distsgd cannot train on as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.fc(x), x


class Frozen(nn.Module):
    """No trainable parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3).requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def float_targets():
    """Class labels as floats: cross-entropy's targets must be integers."""
    (tx, ty), (ex, ey) = tabular_tensors()
    return (tx, ty.float()), (ex, ey.float())


def regression_flat():
    """Targets ``[N]`` where a one-output model gives ``[N, 1]``."""
    (tx, _), (ex, _) = tabular_tensors()
    return (tx, tx.sum(dim=1)), (ex, ex.sum(dim=1))


def nan_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """A loss that is NaN whatever the weights."""
    return (outputs * float("nan")).mean()


def exits(**kwargs):
    """A factory that ends the interpreter instead of returning."""
    sys.exit(0)


def interrupts(**kwargs):
    """A factory that raises KeyboardInterrupt itself."""
    raise KeyboardInterrupt


def exiting_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """A loss that calls sys.exit."""
    sys.exit(3)


def empty_train():
    """No training sample at all."""
    (tx, ty), test = tabular_tensors()
    return (tx[:0], ty[:0]), test


def nan_inputs():
    """One NaN feature in the 6th training sample."""
    (tx, ty), test = tabular_tensors()
    tx = tx.clone()
    tx[5, 3] = float("nan")
    return (tx, ty), test


def regression():
    """A regression: targets ``[N, 1]`` float, values well outside [0, 1]."""
    (tx, _), (ex, _) = tabular_tensors()
    return (tx, 3.0 * tx[:, :1]), (ex, 3.0 * ex[:, :1])


def nan_metric(outputs: Tensor, targets: Tensor) -> float:
    """A metric that is NaN on every batch."""
    return float("nan")


def nan_on_large_batches(outputs: Tensor, targets: Tensor) -> float:
    """Accuracy on batches of at most 2 samples (the check before a run), NaN on larger."""
    if targets.shape[0] > 2:
        return float("nan")
    return float((outputs.argmax(dim=-1) == targets).float().mean())
