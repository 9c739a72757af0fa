"""Training losses and evaluation metrics: built-in names or the user's functions.

``train.loss`` names the loss the learners minimise: ``cross_entropy`` (the default),
``mse``, ``bce_with_logits``, or an import path ``"module:function"`` of a function
``(outputs, targets) -> scalar tensor``, the mean loss of the minibatch.

``train.metric`` names what an evaluation measures and what ``train.target`` is compared
with: ``accuracy`` (higher is better), ``loss`` (the mean evaluation loss, lower is
better), ``perplexity`` (exp of the mean evaluation loss in nats, lower is better), or an
import path of a function ``(outputs, targets) -> the minibatch's mean value`` with
``train.metric_direction = "max" | "min"``. A metric is the sample-weighted mean of its
batch values over the evaluation set (perplexity: exp of the mean loss, not a mean of
per-batch perplexities), so it does not depend on how the set is cut into batches, nor
how the ranks share it.

Shapes: ``cross_entropy`` takes logits ``[B, C]`` with class indices ``[B]``, or
sequence logits ``[B, T, C]`` with ``[B, T]`` (a sample's loss is the mean over its T
positions); ``accuracy`` alike (a sample's accuracy is the fraction of its positions
predicted right), and outputs of the targets' own shape are binary logits (right when
``(output > 0) == (target > 0.5)``).

What a metric may measure: ``accuracy`` needs integer class indices (outputs with one
more dimension, the classes) or binary targets in [0, 1] of the outputs' shape, and a
classification loss: with ``train.loss = "mse"`` (a regression) it is refused when the
config is read, and on targets of another kind (float values outside [0, 1], float
class indices) at the check of the model on two samples, before the run writes
anything; choose ``loss`` or a user metric there. A user metric must return a finite
number for every batch: NaN or infinity stops the run with one line naming it, as does
``SystemExit`` raised by a user loss or metric (``sys.exit()`` in it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from distsgd.checks import ConfigError
from distsgd.factories import resolve_callable

__all__ = ["LOSSES", "METRICS", "Loss", "Metric", "build_loss", "build_metric", "reached"]

LOSSES = ("cross_entropy", "mse", "bce_with_logits")
"""The built-in ``train.loss`` names."""
METRICS = {"accuracy": "max", "loss": "min", "perplexity": "min"}
"""The built-in ``train.metric`` names and their directions."""


def _cross_entropy_per_sample(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample cross-entropy ``[B]`` (a sequence sample's: the mean over positions)."""
    if outputs.dim() <= 2:
        return F.cross_entropy(outputs, targets, reduction="none")
    b = outputs.shape[0]
    per_position = F.cross_entropy(outputs.flatten(0, -2), targets.flatten(), reduction="none")
    return per_position.view(b, -1).mean(dim=1)


@dataclass
class Loss:
    """A training loss: ``fn(outputs, targets)`` → the minibatch's mean loss (scalar).

    Attributes:
        name: the ``train.loss`` value.
        fn: the function; the built-in ``cross_entropy`` instead computes per-sample
            losses (``per_sample``), which gives every learner's own loss of a fused batch
            from one forward.
    """

    name: str
    fn: Callable[[Tensor, Tensor], Tensor]
    per_sample: Callable[[Tensor, Tensor], Tensor] | None = None

    def _checked(self, value: Any) -> Tensor:
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ConfigError(
                f"train.loss = {self.name!r} is not allowed: it returned {shape}, expected "
                "a scalar tensor (the minibatch's mean loss)"
            )
        return value.reshape(())

    def chunk_means(
        self, outputs: Tensor, targets: Tensor, num_chunks: int
    ) -> tuple[Tensor, Tensor]:
        """The loss to differentiate and each of ``num_chunks`` equal chunks' mean loss.

        Args:
            outputs: the model's outputs for B samples (leading dimension B).
            targets: their targets (leading dimension B); B divisible by m = ``num_chunks``.

        Returns:
            (scalar: the mean of the m chunk losses, which is the mean over all samples for
            a mean-reduced loss; detached ``[m]``).
        """
        if self.per_sample is not None:
            per_sample = self.per_sample(outputs, targets)
            return per_sample.mean(), per_sample.detach().view(num_chunks, -1).mean(dim=1)
        if num_chunks == 1:
            total = self._checked(self.fn(outputs, targets))
            return total, total.detach().view(1)
        chunks = zip(outputs.chunk(num_chunks), targets.chunk(num_chunks), strict=True)
        losses = torch.stack([self._checked(self.fn(o, t)) for o, t in chunks])
        return losses.mean(), losses.detach()

    def batch_sum(self, outputs: Tensor, targets: Tensor) -> float:
        """The sum over the batch's samples of their losses (evaluation)."""
        if self.per_sample is not None and outputs.dim() <= 2:
            return float(F.cross_entropy(outputs, targets, reduction="sum"))
        if self.per_sample is not None:
            return float(self.per_sample(outputs, targets).sum())
        return float(self._checked(self.fn(outputs, targets))) * targets.shape[0]


def _named_exit(
    setting: str, name: str, fn: Callable[[Tensor, Tensor], Any]
) -> Callable[[Tensor, Tensor], Any]:
    """``fn`` with a ``SystemExit`` it raises (``sys.exit()`` in the user's loss or
    metric) turned into :class:`ConfigError` naming ``setting`` (a Ctrl-C still
    interrupts)."""

    def call(outputs: Tensor, targets: Tensor) -> Any:
        try:
            return fn(outputs, targets)
        except SystemExit as e:
            raise ConfigError(
                f"{setting} = {name!r} raised SystemExit: {e} (it called sys.exit); "
                "expected it to return a value"
            ) from None

    return call


def _mse(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.mse_loss(outputs, targets.to(outputs.dtype))


def _bce(outputs: Tensor, targets: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(outputs, targets.to(outputs.dtype))


def build_loss(value: str | Callable[[Tensor, Tensor], Tensor]) -> Loss:
    """The :class:`Loss` that ``train.loss`` names (a built-in name, an import path, or on
    the simulated runtime a callable).

    Raises:
        ConfigError: the path does not resolve to a callable.
    """
    if value == "cross_entropy":
        return Loss(
            "cross_entropy",
            lambda o, t: _cross_entropy_per_sample(o, t).mean(),
            _cross_entropy_per_sample,
        )
    if value == "mse":
        return Loss("mse", _mse)
    if value == "bce_with_logits":
        return Loss("bce_with_logits", _bce)
    name = value if isinstance(value, str) else getattr(value, "__name__", repr(value))
    return Loss(name, _named_exit("train.loss", name, resolve_callable("train.loss", value)))


def _correct(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample fraction of right predictions ``[B]``.

    Raises:
        ConfigError: targets accuracy cannot score: float class indices, or targets of
            the outputs' shape (binary) outside [0, 1].
    """
    if outputs.shape == targets.shape:  # binary logits
        if targets.numel() and not bool(((targets >= 0) & (targets <= 1)).all()):
            _not_classes(outputs, targets, "binary targets of the outputs' shape in [0, 1]")
        right = (outputs > 0) == (targets > 0.5)
    else:
        if targets.is_floating_point() or targets.is_complex():
            _not_classes(outputs, targets, "integer class indices (outputs [B, C], targets [B])")
        right = outputs.argmax(dim=-1) == targets
    return right.reshape(right.shape[0], -1).to(torch.float64).mean(dim=1)


def _not_classes(outputs: Tensor, targets: Tensor, expected: str) -> None:
    raise ConfigError(
        f"train.metric = 'accuracy' is not allowed on outputs {list(outputs.shape)} and "
        f"targets {list(targets.shape)} {targets.dtype} (not class labels: accuracy counts "
        f"right classes): expected {expected}, or train.metric = 'loss' or a user metric"
    )


@dataclass
class Metric:
    """An evaluation metric and its direction.

    Attributes:
        name: the ``train.metric`` value.
        direction: ``"max"`` (higher is better) or ``"min"``.
        fn: a user metric ``(outputs, targets)`` → the batch's mean; None for built-ins.
    """

    name: str
    direction: str
    fn: Callable[[Tensor, Tensor], Any] | None = None

    def batch_sum(self, outputs: Tensor, targets: Tensor) -> float:
        """The sum over the batch's samples of the metric (0 for ``loss``/``perplexity``,
        which :meth:`value` derives from the loss).

        Raises:
            ConfigError: a user metric returns no number, or NaN or infinity;
                ``accuracy`` on targets that are not class labels (:func:`_correct`).
        """
        if self.name == "accuracy" and self.fn is None:
            return float(_correct(outputs, targets).sum())
        if self.fn is None:
            return 0.0
        value = self.fn(outputs, targets)
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(
                f"train.metric = {self.name!r} is not allowed: it returned "
                f"{type(value).__name__}, expected a number (the batch's mean)"
            ) from None
        if not math.isfinite(value):
            raise ConfigError(
                f"train.metric = {self.name!r} returned {value} on a batch of "
                f"{targets.shape[0]} evaluation samples: expected a finite number (the "
                "batch's mean)"
            )
        return value * targets.shape[0]

    def value(self, metric_sum: float, loss_sum: float, count: int) -> float:
        """The metric over ``count`` samples from the summed batch values and losses."""
        mean_loss = loss_sum / count
        if self.fn is None and self.name == "loss":
            return mean_loss
        if self.fn is None and self.name == "perplexity":
            return math.exp(min(mean_loss, 700.0))  # exp(700) is near float64's limit
        return metric_sum / count

    def better(self, a: float, b: float) -> bool:
        """True when ``a`` is strictly better than ``b``."""
        return a > b if self.direction == "max" else a < b


def reached(value: float, target: float, direction: str) -> bool:
    """Whether ``value`` reaches ``target`` (``>=`` for ``max``, ``<=`` for ``min``);
    ``target = 0`` is no target."""
    if target == 0 or not math.isfinite(value):
        return False
    return value >= target if direction == "max" else value <= target


def build_metric(value: str | Callable[[Tensor, Tensor], Any], direction: str = "") -> Metric:
    """The :class:`Metric` that ``train.metric`` and ``train.metric_direction`` name.

    Raises:
        ConfigError: a user metric without a direction, a built-in one with the wrong
            direction, or a path that does not resolve to a callable.
    """
    if isinstance(value, str) and value in METRICS:
        if direction and direction != METRICS[value]:
            raise ConfigError(
                f"train.metric_direction = {direction!r} is not allowed with train.metric = "
                f'{value!r}: expected {METRICS[value]!r} or ""'
            )
        return Metric(value, METRICS[value])
    name = value if isinstance(value, str) else getattr(value, "__name__", repr(value))
    if direction not in ("max", "min"):
        raise ConfigError(
            f"train.metric_direction = {direction!r} is not allowed with train.metric = "
            f'{name!r}: expected "max" (higher is better) or "min" (lower is better)'
        )
    fn = resolve_callable("train.metric", value)
    return Metric(name, direction, _named_exit("train.metric", name, fn))
