"""Built-in models by name (``mlp``, ``cnn``, ``lenet``, ``resnet20``) and the user's by
factory (:func:`model_from_config`).

Every model maps float32 images ``[B, C, H, W]`` to logits ``[B, num_classes]``; the
sizes of flattened layers follow from ``input_shape``, so each model works on
Fashion-MNIST/MNIST (``[1, 28, 28]``) and CIFAR-10 (``[3, 32, 32]``) alike. Parameters are
initialised from torch's global random generator: call ``torch.manual_seed`` first for a
reproducible model.

Parameter counts for 10 classes:

============  ==============  ==============
model         ``[1, 28, 28]``  ``[3, 32, 32]``
============  ==============  ==============
mlp           269,322         855,050
cnn           421,642         545,098
lenet         3,274,634       4,259,274
resnet20      269,434         269,722
============  ==============  ==============

Example::

    from distsgd.models import build_model, num_parameters

    model = build_model("cnn", (1, 28, 28), num_classes=10)
    logits = model(torch.zeros(8, 1, 28, 28))  # [8, 10]
    num_parameters(model)  # 421642
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distsgd.checks import ConfigError, check_choice, check_int
from distsgd.config import MODELS, ModelConfig
from distsgd.factories import USER_CODE_FAILURES, failure_text, resolve_callable

__all__ = [
    "build_model",
    "model_from_config",
    "with_data_shape",
    "num_parameters",
    "MLP",
    "CNN",
    "LeNet",
    "ResNet20",
]


def _check_input_shape(input_shape: tuple[int, ...], min_side: int, name: str) -> None:
    rank_ok = len(input_shape) >= 1 if name == "mlp" else len(input_shape) == 3
    ok = (
        isinstance(input_shape, tuple | list)
        and rank_ok
        and all(isinstance(d, int) and d >= 1 for d in input_shape)
    )
    if not ok:
        allowed = "any shape of one sample" if name == "mlp" else "(C, H, W)"
        raise ValueError(f"input_shape = {input_shape!r} is not allowed: expected {allowed}")
    if name == "mlp":
        return
    if min(input_shape[1:]) < min_side:
        raise ValueError(
            f"model.name = {name!r} needs images of at least {min_side}×{min_side}, "
            f"got input_shape = {tuple(input_shape)!r}"
        )


class MLP(nn.Module):
    """Multilayer perceptron with two hidden layers of 256 ReLU units.

    Shapes: ``[B, *input_shape]`` (images ``[B, C, H, W]``, or features ``[B, F]``) →
    flatten ``[B, D]`` → fc ``[B, 256]`` → ReLU → fc ``[B, 256]`` → ReLU →
    fc ``[B, num_classes]``.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), 256),
            nn.ReLU(),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Small convolutional network: two 3×3 conv layers and two fully connected layers.

    Shapes for input ``[B, C, H, W]`` (H' = ⌊⌊H/2⌋/2⌋, W' likewise):
    conv 3×3, 32, pad 1 → ``[B, 32, H, W]`` → max-pool 2 → ReLU → ``[B, 32, H/2, W/2]`` →
    conv 3×3, 64, pad 1 → max-pool 2 → ReLU → ``[B, 64, H', W']`` → flatten →
    fc ``[B, 128]`` → ReLU → fc ``[B, num_classes]``.
    0.42M parameters on ``[1, 28, 28]`` (H' = W' = 7).

    Max-pooling comes before the ReLU: ReLU is monotone, so max-pool then ReLU is the same
    function as ReLU then max-pool, and its gradient is the same bit for bit (zero
    wherever a window's maximum is <= 0, else the pooled gradient at the same argmax);
    the ReLU and its backward then run on a 4× smaller tensor. Parameter names and order
    are those of conv → ReLU → max-pool.
    """

    kernel: int = 3
    """Side of the conv kernels (padding ``kernel // 2`` keeps H and W)."""
    hidden: int = 128
    """Width of the first fully connected layer."""
    dropout: float = 0.0
    """Dropout probability after the first fully connected layer (0: no dropout layer)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        k = self.kernel
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, k, padding=k // 2),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(32, 64, k, padding=k // 2),
            nn.MaxPool2d(2),
            nn.ReLU(),
        )
        head = [nn.Flatten(), nn.Linear(64 * (h // 2 // 2) * (w // 2 // 2), self.hidden), nn.ReLU()]
        if self.dropout:
            head.append(nn.Dropout(self.dropout))
        self.classifier = nn.Sequential(*head, nn.Linear(self.hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class LeNet(CNN):
    """LeNet-style network of the TensorFlow layers tutorial ("Build a Convolutional
    Neural Network using Estimators", MNIST), after LeCun et al. 1998.

    Shapes for input ``[B, C, H, W]`` (H' = ⌊⌊H/2⌋/2⌋, W' likewise):
    conv 5×5, 32, pad 2 → max-pool 2 → ReLU → ``[B, 32, H/2, W/2]`` →
    conv 5×5, 64, pad 2 → max-pool 2 → ReLU → ``[B, 64, H', W']`` → flatten →
    fc ``[B, 1024]`` → ReLU → dropout p = 0.4 → fc ``[B, num_classes]``.
    3.27M parameters on ``[1, 28, 28]``. Max-pooling before the ReLU as in :class:`CNN`.
    """

    kernel, hidden, dropout = 5, 1024, 0.4


class _BasicBlock(nn.Module):
    """Two 3×3 conv–BN layers with an identity shortcut, option A (He et al. 2016, §4.2).

    When the block halves the resolution (stride 2) and doubles the channels, the shortcut
    takes every other pixel and pads the new channels with zeros: it has no parameters.
    """

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.pad = planes - in_planes

    def shortcut(self, x: Tensor) -> Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            lo = self.pad // 2
            x = F.pad(x, (0, 0, 0, 0, lo, self.pad - lo))
        return x

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for small images: He, Zhang, Ren, Sun, "Deep Residual Learning for Image
    Recognition", CVPR 2016, §4.2 (CIFAR-10), n = 3.

    Shortcuts are identity with zero-padding for the extra channels (the paper's option A,
    used there for all CIFAR models), so the 20 weighted layers hold all 0.27M parameters.
    Weights of conv layers use He initialisation (He et al. 2015, as in the paper);
    BatchNorm starts at γ = 1, β = 0.

    Shapes for input ``[B, C, H, W]``: conv 3×3, 16 → BN → ReLU ``[B, 16, H, W]`` →
    3 basic blocks at 16 channels ``[B, 16, H, W]`` → 3 at 32, the first with stride 2
    ``[B, 32, ⌈H/2⌉, ⌈W/2⌉]`` → 3 at 64, the first with stride 2
    ``[B, 64, ⌈H/4⌉, ⌈W/4⌉]`` → global average pool ``[B, 64]`` → fc ``[B, num_classes]``.
    On 32×32 (CIFAR) the feature maps are 32, 16, 8; on 28×28 they are 28, 14, 7.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c = input_shape[0]
        self.conv1 = nn.Conv2d(c, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.blocks(out)
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
        return self.fc(out)


_MIN_SIDE = {"mlp": 1, "cnn": 4, "lenet": 4, "resnet20": 1}
_CLASSES = {"mlp": MLP, "cnn": CNN, "lenet": LeNet, "resnet20": ResNet20}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model called ``name`` for images of ``input_shape`` and ``num_classes`` classes.

    Args:
        name: ``mlp``, ``cnn``, ``lenet`` or ``resnet20`` (``model.name``).
        input_shape: one sample's shape ``(C, H, W)``, e.g. ``Dataset.input_shape``.
        num_classes: number of output logits.

    Returns:
        An ``nn.Module`` mapping float32 ``[B, C, H, W]`` to logits ``[B, num_classes]``.

    Raises:
        ValueError: unknown ``name`` (the message names ``model.name`` and the choices),
            malformed ``input_shape``, images too small for the model's two 2× poolings,
            or ``num_classes`` < 1.
    """
    check_choice("model.name", name, MODELS)
    _check_input_shape(input_shape, _MIN_SIDE[name], name)
    check_int("num_classes", num_classes, 1)
    return _CLASSES[name](tuple(input_shape), num_classes)


def num_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model`` (trainable or not; buffers excluded)."""
    return sum(p.numel() for p in model.parameters())


_BUILTIN_KWARGS = ("input_shape", "num_classes")


def model_from_config(
    cfg: ModelConfig, factory: Callable[..., nn.Module] | None = None
) -> nn.Module:
    """The model ``cfg`` names: ``factory(**kwargs)`` (``cfg.factory`` resolved, or the
    object given), else the built-in ``cfg.name`` with ``kwargs`` ``input_shape`` and
    ``num_classes`` (:func:`with_data_shape` fills them in from the data).

    Parameters are initialised from torch's global generator: seed it first.

    Raises:
        ConfigError: the factory does not import, raises, or returns no ``nn.Module``; a
            built-in model's kwargs are missing or unknown.
    """
    if factory is None and not cfg.factory:
        kw = cfg.kwargs
        extra = sorted(set(kw) - set(_BUILTIN_KWARGS))
        missing = [k for k in _BUILTIN_KWARGS if k not in kw]
        if extra or missing:
            raise ConfigError(
                f"model.kwargs = {kw!r} is not allowed for model.name = {cfg.name!r}: expected "
                "input_shape ([C, H, W]) and num_classes, and nothing else"
            )
        shape = kw["input_shape"]
        if not isinstance(shape, list | tuple):
            raise ConfigError(
                f"model.kwargs.input_shape = {shape!r} is not allowed: expected [C, H, W]"
            )
        try:
            return build_model(cfg.name, tuple(shape), kw["num_classes"])
        except ValueError as e:
            raise ConfigError(f"model.kwargs for model.name = {cfg.name!r}: {e}") from None
    setting = f"model.factory = {cfg.factory!r}" if factory is None else "the model factory"
    make = resolve_callable("model.factory", factory or cfg.factory)
    try:
        model = make(**cfg.kwargs)
    except USER_CODE_FAILURES as e:  # the user's factory failed: one line says how
        raise ConfigError(f"{setting} raised {failure_text(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{setting} returned a {type(model).__name__}: expected a torch.nn.Module"
        )
    return model


def with_data_shape(
    cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int | None, data: str
) -> ModelConfig:
    """``cfg`` with a built-in model's ``input_shape`` and ``num_classes`` filled in from
    the data where ``kwargs`` lacks them (a user's factory: ``cfg`` unchanged).

    Args:
        input_shape: one training input's shape.
        num_classes: the data's number of classes, None when unknown.
        data: the data's setting, for the error message.

    Raises:
        ConfigError: ``num_classes`` is needed but unknown.
    """
    if cfg.factory:
        return cfg
    kw = dict(cfg.kwargs)
    kw.setdefault("input_shape", list(input_shape))
    if "num_classes" not in kw:
        if num_classes is None:
            raise ConfigError(
                f"model.kwargs.num_classes is required for model.name = {cfg.name!r} with "
                f"{data} (its number of classes is not known): set it"
            )
        kw["num_classes"] = num_classes
    return dataclasses.replace(cfg, kwargs=kw)
