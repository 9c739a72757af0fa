"""A multilayer perceptron with batch normalisation for tabular features (Ioffe & Szegedy,
"Batch Normalization", ICML 2015): ``[Linear → BatchNorm1d → ReLU] × depth → Linear``.

Its BatchNorm running statistics are buffers, not parameters: distsgd recomputes them for
the evaluated model before every evaluation (README, "BatchNorm statistics"), which is
what ``compare_bn.py`` measures across protocols.

Example::

    import torch
    from tabular.model import build

    model = build(num_features=64, num_classes=10)
    logits = model(torch.randn(32, 64))  # [32, 10]
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["build", "accuracy"]


def build(
    num_features: int = 64, num_classes: int = 10, hidden: int = 128, depth: int = 2
) -> nn.Sequential:
    """The model factory named in the configs (``model.factory = "tabular.model:build"``,
    its arguments in ``[model.kwargs]``).

    Args:
        num_features: input features F (64 for digits, 30 for breast_cancer).
        num_classes: classes C (10 for digits, 2 for breast_cancer).
        hidden: width of every hidden layer.
        depth: hidden layers, each Linear → BatchNorm1d → ReLU.

    Returns:
        ``nn.Sequential`` mapping float32 ``[B, F]`` to logits ``[B, C]`` (B >= 2 in
        training mode, as BatchNorm needs).

    Raises:
        ValueError: a size below 1 (``num_classes`` below 2).
    """
    if min(num_features, hidden, depth) < 1 or num_classes < 2:
        raise ValueError(
            f"model.kwargs: num_features = {num_features}, num_classes = {num_classes}, "
            f"hidden = {hidden}, depth = {depth}: sizes must be >= 1, num_classes >= 2"
        )
    layers: list[nn.Module] = []
    width = num_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.BatchNorm1d(hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def accuracy(model: nn.Module, features: Tensor, labels: Tensor) -> float:
    """Share of ``features [N, F]`` whose arg-max logit is ``labels [N]`` — the metric the
    configs name (``accuracy``). Puts ``model`` in evaluation mode (BatchNorm uses its
    running statistics) and leaves it there."""
    model.eval()
    with torch.no_grad():
        return float((model(features).argmax(dim=1) == labels).float().mean())
