"""Run configuration: one dataclass per component, loaded from TOML, validated on construction.

Every field documents its unit and its special values. A wrong value raises
:class:`ConfigError` (a ``ValueError``) whose message names the setting (as a dotted key,
e.g. ``protocol.softsync``), the value given and what is allowed; the CLI prints that one
line and exits with status 2.

Example::

    from distsgd.config import RunConfig
    cfg = RunConfig.from_toml("configs/async.toml", overrides=["optimizer.lr=0.05"])
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from distsgd.checks import ConfigError, check_bool, check_choice, check_float, check_int, fail
from distsgd.factories import (
    USER_CODE_FAILURES,
    failure_text,
    is_import_path,
    search_current_directory,
)
from distsgd.layout import PROTOCOL_SETTINGS, PROTOCOLS, fitted, protocols_with, spec_for
from distsgd.protocols import SERVER_OPTIMIZERS, STALENESS_LR, OptimizerFactory

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "MAX_NESTING",
    "check_device",
    "check_nesting",
    "check_schedule",
    "check_local_processes",
    "read_toml",
    "set_setting",
    "LocalRanks",
    "resolve_device",
    "resolved_device_setting",
    "schedule_conflicts",
    "DataConfig",
    "ModelConfig",
    "ProtocolConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "ClusterConfig",
    "TrainConfig",
    "DistConfig",
    "TuneConfig",
    "TuneSearchSettings",
    "OfflineTuneSettings",
    "OnlineTuneSettings",
    "RunConfig",
    "fit_layout",
    "PROTOCOLS",
    "DATASETS",
    "MODELS",
    "COMPILE_MODES",
    "MEMORY_FORMATS",
]

DATASETS = ("fashion_mnist", "mnist", "cifar10", "synthetic")
LOSSES = ("cross_entropy", "mse", "bce_with_logits")  # distsgd.objectives.LOSSES
METRICS = {"accuracy": "max", "loss": "min", "perplexity": "min"}  # objectives.METRICS
MODELS = ("mlp", "cnn", "lenet", "resnet20")
PS_MODES = ("softsync", "async", "hardsync")
AUTOTUNE_RULES = ("crossbow", "marginal")  # distsgd.replicas.RULES
COMPRESSIONS = ("none", "bf16", "fp16", "int8", "powersgd")
"""The values of ``protocol.compression`` (:mod:`distsgd.runtime.compression`)."""
STALL_DISTRIBUTIONS = ("exponential", "fixed")
"""The values of ``cluster.stall_distribution``."""
SCHEDULES = ("constant", "step")
RUNTIMES = ("sim", "dist")
DIST_BACKENDS = ("auto", "gloo", "nccl")
PRECISIONS = ("fp32", "bf16-mixed")
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
COMPILE_MODES = (
    "off",
    "on",
    "reduce-overhead",
)  # train.compile; distsgd.engine.GradientEngine(compile=...)
# train.memory_format; distsgd.engine.GradientEngine(memory_format=...)
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")


MAX_LR = 1000.0
"""The largest learning rate ``optimizer.lr`` and any rate of the schedule may be: far
above any rate that trains (linear probes use up to 30), far below what overflows float32
in ``lr × gradient``."""
MAX_COUNT = 10**12
"""The largest sample count of a budget or an evaluation period (a million epochs of
Fashion-MNIST): products with seconds or bytes stay far inside float64."""
MAX_SCHEDULE_CHECK_STEPS = 1000
"""Scheduler steps of the run's span over which a torch scheduler's rates are checked at
set-up (:meth:`ScheduleConfig.check_rates`; about 0.1 s of replay on a CPU core)."""


class ConfigWarning(UserWarning):
    """Settings that are each allowed but contradict one another (the run still starts)."""


def _check_builtin_or_path(setting: str, value: Any, builtin: tuple[str, ...]) -> None:
    """``value`` must be one of ``builtin`` or an import path ``"module:function"``."""
    if value not in builtin and not is_import_path(value):
        allowed = ", ".join(repr(x) for x in builtin)
        fail(setting, value, f'{allowed} or an import path "module:function"')


def check_import_path(setting: str, value: Any) -> None:
    """``value`` must be "" or an import path ``"package.module:function"``.

    Raises:
        ConfigError: naming ``setting``, the value and the form allowed.
    """
    if value != "" and not is_import_path(value):
        fail(setting, value, '"" or an import path "package.module:function"')


def _check_kwargs(setting: str, value: Any, reserved: tuple[str, ...]) -> None:
    """``value`` must be a table of keyword arguments (identifier keys, none of them
    ``reserved``) whose values TOML can hold (``config.toml`` records them): strings,
    numbers, booleans, lists, tables."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in value
    ):
        fail(setting, value, "a table of keyword arguments, e.g. [" + setting + "] hidden = 64")
    for key, v in value.items():
        _check_toml_value(f"{setting}.{key}", v)
    taken = [k for k in reserved if k in value]
    if taken:
        fail(setting, value, f"no {', '.join(repr(k) for k in taken)} key (distsgd passes it)")


def _check_toml_value(setting: str, value: Any) -> None:
    if isinstance(value, dict):  # a nested table: any string keys
        if not all(isinstance(k, str) for k in value):
            fail(setting, value, "a table with string keys")
        for key, v in value.items():
            _check_toml_value(f"{setting}.{key}", v)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_toml_value(f"{setting}[{i}]", v)
    elif not isinstance(value, str | int | float | bool):
        fail(setting, value, "a string, number, boolean, list or table")


def _number(value: Any) -> bool:
    """True for a finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _setting(default: Any, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A section's field whose value ``check(setting, value, *args, **kwargs)`` validates
    (:func:`_check_fields`); a list ``default`` is copied for each instance."""
    metadata = {"check": (check, args, kwargs)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _kwargs(*reserved: str) -> Any:
    """A field holding a table of keyword arguments without the ``reserved`` names."""
    return field(default_factory=dict, metadata={"check": (_check_kwargs, (reserved,), {})})


def _check_fields(section: Any, name: str) -> None:
    """Validate each field of the dataclass ``section`` (the table ``[name]``): by its
    declared check (:func:`_setting`), or, for a ``bool`` field, as true or false.

    Raises:
        ConfigError: the first field whose value is not allowed, named ``name.field``.
    """
    for f in fields(section):
        value = getattr(section, f.name)
        if "check" in f.metadata:
            check, args, kwargs = f.metadata["check"]
            check(f"{name}.{f.name}", value, *args, **kwargs)
        elif f.type in ("bool", bool):
            check_bool(f"{name}.{f.name}", value)


def _check_str(key: str, value: Any, allowed: str) -> None:
    """``value`` must be a string; else :class:`ConfigError` naming ``allowed``."""
    if not isinstance(value, str):
        fail(key, value, allowed)


def _check_range(
    key: str, value: Any, minimum: float, maximum: float, allowed: str, special: tuple = ()
) -> None:
    """``value`` must be a finite number in ``[minimum, maximum]`` or one of ``special``."""
    if not _number(value) or not (value in special or minimum <= value <= maximum):
        fail(key, value, allowed)


@dataclass
class DataConfig:
    """The data set: a built-in one by name, or the user's by factory.

    Attributes:
        dataset: a built-in data set: ``fashion_mnist`` | ``mnist`` (IDX gzip files),
            ``cifar10`` (python pickle batches) or ``synthetic`` (Gaussian class clusters
            made in memory, for tests). Ignored when ``factory`` is set.
        factory: import path ``"package.module:function"`` of the user's data factory,
            called as ``function(**kwargs)``; it returns ``(train, eval)``, each a
            map-style ``torch.utils.data.Dataset`` of ``(input, target)`` tensor pairs or a
            pair of tensors ``(inputs [N, ...], targets [N, ...])``; ``eval`` may be None
            (the metric is then measured on the training set). A split that is empty or
            holds NaN or infinity is refused before the run writes anything (every sample
            of tensors; the first two items of a map-style data set, whose others are
            read as it trains). "" (default): ``dataset``.
        kwargs: keyword arguments of ``factory`` (a TOML table ``[data.kwargs]``).
        collate: import path of the function that makes a batch of a map-style data
            set's items (list of ``(input, target)`` → ``(inputs, targets)``); "" (default):
            ``torch.utils.data.default_collate``.
        root: built-in file data sets: directory holding the files. Empty means the
            ``DISTSGD_DATA_DIR`` environment variable if set, else the dataset's default
            directory (``/usr/share/datasets/fashion-mnist`` for Fashion-MNIST).
        num_train: synthetic only: number of training samples, in [1, 1000000].
        num_test: synthetic only: number of test samples, in [1, 1000000].
        noise: synthetic only: standard deviation of the per-sample noise (unitless), in
            [0, 100].
    """

    dataset: str = _setting("fashion_mnist", check_choice, DATASETS)
    factory: str = _setting("", check_import_path)
    kwargs: dict[str, Any] = _kwargs()
    collate: str = _setting("", check_import_path)
    root: str = _setting("", _check_str, "a directory path (string)")
    num_train: int = _setting(2048, check_int, 1, 1_000_000)
    num_test: int = _setting(512, check_int, 1, 1_000_000)
    noise: float = _setting(1.0, check_float, 0.0, 100.0)

    def __post_init__(self) -> None:
        _check_fields(self, "data")

    @property
    def label(self) -> str:
        """What the run trains on: the factory's path, else the built-in data set."""
        return self.factory or self.dataset


@dataclass
class ModelConfig:
    """The model: a built-in one by name, or the user's by factory.

    Attributes:
        name: a built-in model (:mod:`distsgd.models`): ``mlp``, ``cnn``, ``lenet`` or
            ``resnet20``, for images ``[C, H, W]``. Ignored when ``factory`` is set.
        factory: import path ``"package.module:function"`` of a function (or class) called
            as ``function(**kwargs)`` that returns a ``torch.nn.Module``; "" (default):
            ``name``.
        kwargs: keyword arguments of the factory (a TOML table ``[model.kwargs]``). A
            built-in model takes ``input_shape`` ``[C, H, W]`` and ``num_classes``; when
            they are missing the run fills them in from the data (and records them in the
            run's ``config.toml``).
    """

    name: str = _setting("cnn", check_choice, MODELS)
    factory: str = _setting("", check_import_path)
    kwargs: dict[str, Any] = _kwargs()

    def __post_init__(self) -> None:
        _check_fields(self, "model")

    @property
    def label(self) -> str:
        """What the run trains: the factory's path, else the built-in model's name."""
        return self.factory or self.name


@dataclass
class ProtocolConfig:
    """Synchronisation protocol and the layout of learners (docs/protocols.md §1–§5).

    Attributes:
        name: ``hardsync`` (all-reduce S-SGD, §1), ``parameter_server`` (Rudra, §2),
            ``compute_groups`` (Omnivore, §3), ``sma`` (Crossbow, §4), ``local_sgd`` or
            ``plain`` (one learner, plain loop; §5).
        num_learners: λ, model replicas computing gradients, in [1, 65536]. ``plain``
            requires 1.
        batch_size: minibatch per learner, in samples (Rudra's μ, Crossbow's b), in
            [1, 1048576].
        mode: parameter server only: ``softsync`` (n-softsync, c = ⌊λ/n⌋ gradients per
            update), ``async`` (n = λ, c = 1) or ``hardsync`` (c = λ with a barrier).
        softsync: n in n-softsync, in [1, λ]; must divide λ. Ignored unless
            ``mode = "softsync"``.
        staleness_lr: learning-rate modulation by staleness (parameter server and compute
            groups): ``none`` (α0), ``softsync`` (α0/n), ``measured`` (α0 / running mean σ)
            or ``per_gradient`` (each gradient scaled by α0/σ; α0 when σ = 0).
        server_optimizer: ``sgd``: the ``[optimizer]`` section's optimizer (SGD with
            momentum by default, as Rudra's Caffe-style experiments; another torch.optim
            optimizer when ``optimizer.name`` names one), or ``adagrad``: Rudra's AdaGrad
            server, its own optimizer (needs ``optimizer.name = "sgd"``).
        num_groups: g compute groups, in [1, λ]; must divide λ.
        momentum_compensation: compute groups: explicit momentum
            μ = max(0, μ_target − (1 − 1/g)) where μ_target is ``optimizer.momentum``
            (SGD momentum: needs ``optimizer.name = "sgd"``).
        replicas_per_device: k learners sharing one device (SMA, local SGD), in
            [1, 65536]; must divide λ.
            ``"auto"``: Crossbow's auto-tuner chooses k (docs/protocols.md §4; simulated seconds on
            the simulated runtime, the slowest rank's wall seconds on ``dist``): the run starts with
            k = 1, so ``num_learners`` is then the number of devices, and λ grows to
            devices × k as replicas are added (see :mod:`distsgd.replicas`).
        autotune_threshold: with ``replicas_per_device = "auto"``: add a replica per device
            while throughput improves by more than this fraction (0.10 = 10%), in (0, 10].
        autotune_interval: with ``"auto"``: iterations over which each k's throughput is
            measured, in [1, 1000000] (the first iteration after a change is not counted). For local
            SGD the tuner observes averaging periods, so this counts averaging periods of
            H iterations (and the uncounted first one is a period too).
        autotune_max_replicas: with ``"auto"``: the largest k tried, in [1, 1024].
        autotune_rule: with ``"auto"``: ``"crossbow"`` (docs/protocols.md §4: go on while the total
            throughput gain of an added replica is above the threshold) or ``"marginal"``
            (continue while the added replica contributes more than the threshold of an
            average replica's throughput, (k − 1) × gain; follows slowly rising curves),
            see :mod:`distsgd.replicas`.
        alpha: SMA correction weight α, in [0, 1]. 0 means 1/λ over all
            learners (docs/protocols.md §4: with μ_z = 0 the new z is the mean of the replicas).
        central_momentum: SMA Polyak momentum μ_z on the central model, in [0, 1).
        average_every: local SGD averaging period H, in iterations, in [1, 1000000];
            DiLoCo's inner steps between two outer steps.
        outer_optimizer: DiLoCo's outer optimizer (docs/protocols.md §6): ``"sgd"``
            (torch.optim.SGD with ``outer_momentum`` and ``outer_nesterov``; the paper's
            Nesterov SGD by default) or the import path ``"module:Class"`` of a
            coordinate-wise torch.optim.Optimizer subclass, built as
            ``Class([θ], lr=outer_lr)`` with its own defaults (e.g. ``"torch.optim:Adam"``).
        outer_lr: DiLoCo's outer learning rate η_out, in (0, 10] (paper: 0.7); fixed, the
            schedule scales the inner rate only.
        outer_momentum: DiLoCo's outer SGD momentum μ_out, in [0, 1) (paper: 0.9).
        outer_nesterov: Nesterov outer momentum (paper: true); needs ``outer_momentum`` > 0.
        compression: the number format of what the learners send: ``"none"`` (float32,
            the default), ``"bf16"`` or ``"fp16"`` (2 bytes a value): hardsync's gradients
            (DDP's compress hooks on ``dist``), SMA's corrections, local SGD's and
            DiLoCo's averages, and on the simulated cluster the parameter server's pushes
            and pulls (``dist`` and the drop-in send them in float32: refused there).
            ``"int8"`` (``diloco`` only): each process's mean pseudo-gradient quantised to
            int8 with a float32 absmax scale per 1024 values, exchanged by an all-gather
            and summed in float32 (not in the drop-in).
            ``"powersgd"`` (``hardsync`` on ``dist`` only): torch's DDP ``powerSGD_hook``
            (rank ``powersgd_rank`` approximations with error feedback, after 2
            iterations of float32).
            Weights, optimizer and server state stay float32
            (:mod:`distsgd.runtime.compression`).
        backup_learners: hardsync only: β backup learners, in [0, 65536] (Chen et al.
            2016, arXiv:1604.00981): λ + β learners compute each iteration and the
            iteration averages the first λ gradients to arrive, dropping the late β
            (``num_learners`` stays λ, the gradients per step: the effective batch is
            λ × ``batch_size``). 0 (default): plain hardsync. On runtime ``dist`` a
            parameter-server rank (rank 0) serves the λ + β learner ranks
            (:class:`~distsgd.protocols.BackupHardSync`), and the simulated cluster
            charges that served form; not in the drop-in.
        powersgd_rank: r, the rank of PowerSGD's approximation of each gradient matrix
            n × m (``matrix_approximation_rank``), in [1, 1024]: it sends r(n + m)
            values instead of nm where that is under half.
    """

    name: str = _setting("hardsync", check_choice, PROTOCOLS)
    num_learners: int = _setting(4, check_int, 1, 65536)
    batch_size: int = _setting(32, check_int, 1, 2**20)
    mode: str = _setting("softsync", check_choice, PS_MODES)
    softsync: int = _setting(1, check_int, 1, 65536)
    staleness_lr: str = _setting("none", check_choice, STALENESS_LR)
    server_optimizer: str = _setting("sgd", check_choice, SERVER_OPTIMIZERS)
    num_groups: int = _setting(1, check_int, 1, 65536)
    momentum_compensation: bool = False
    replicas_per_device: int | str = 1
    alpha: float = _setting(0.1, check_float, 0.0, 1.0)
    central_momentum: float = _setting(0.9, check_float, 0.0, 1.0, max_inclusive=False)
    average_every: int = _setting(8, check_int, 1, 1_000_000)
    autotune_threshold: float = _setting(0.10, check_float, 0.0, 10.0, min_inclusive=False)
    autotune_interval: int = _setting(50, check_int, 1, 1_000_000)
    autotune_max_replicas: int = _setting(16, check_int, 1, 1024)
    autotune_rule: str = _setting("crossbow", check_choice, AUTOTUNE_RULES)
    outer_optimizer: str = "sgd"
    outer_lr: float = _setting(0.7, check_float, 0.0, 10.0, min_inclusive=False)
    outer_momentum: float = _setting(0.9, check_float, 0.0, 1.0, max_inclusive=False)
    outer_nesterov: bool = True
    compression: str = _setting("none", check_choice, COMPRESSIONS)
    backup_learners: int = _setting(0, check_int, 0, 65536)
    powersgd_rank: int = _setting(1, check_int, 1, 1024)

    def __post_init__(self) -> None:
        _check_fields(self, "protocol")
        if self.replicas_per_device != "auto":
            if (
                not isinstance(self.replicas_per_device, int)
                or isinstance(self.replicas_per_device, bool)
                or not 1 <= self.replicas_per_device <= 65536
            ):
                fail(
                    "protocol.replicas_per_device",
                    self.replicas_per_device,
                    "an integer >= 1 or 'auto' (an integer at most 65536)",
                )
        elif self.name not in PROTOCOLS or not spec_for(self.name).replicated:
            fail(
                "protocol.replicas_per_device",
                self.replicas_per_device,
                f"an integer: 'auto' needs protocol.name {protocols_with('replicated')}, "
                f"not {self.name!r}",
            )
        if self.backup_learners and self.name != "hardsync":
            fail(
                "protocol.backup_learners",
                self.backup_learners,
                f"0 with protocol.name = {self.name!r} (backup learners are hardsync's)",
            )
        if self.compression == "powersgd" and self.name != "hardsync":
            fail(
                "protocol.compression",
                self.compression,
                f"'none', 'bf16' or 'fp16' with protocol.name = {self.name!r} (PowerSGD "
                "compresses hardsync's gradients: protocol.name = 'hardsync')",
            )
        if self.compression == "int8" and self.name != "diloco":
            fail(
                "protocol.compression",
                self.compression,
                f"'none', 'bf16' or 'fp16' with protocol.name = {self.name!r} (int8 "
                "quantises DiLoCo's pseudo-gradients: protocol.name = 'diloco'; local SGD is "
                "diloco with outer_lr 1, outer_momentum 0, outer_nesterov false)",
            )
        self._check_outer()
        spec_for(self.name).validate(self)  # λ-dependent rules of the protocol

    def _check_outer(self) -> None:
        """DiLoCo's outer optimizer (checked whatever the protocol: a config names a valid
        value or none)."""
        self._outer_class: type[torch.optim.Optimizer] | None = None
        if self.outer_optimizer == "sgd":
            if self.outer_nesterov and self.outer_momentum == 0:
                fail(
                    "protocol.outer_nesterov",
                    self.outer_nesterov,
                    "false when protocol.outer_momentum = 0",
                )
            return
        key, path = "protocol.outer_optimizer", self.outer_optimizer
        cls = _import_class(
            key, path, torch.optim.Optimizer, _OPTIMIZER, "'sgd'", "torch.optim:Adam"
        )
        try:
            coordinate_wise = _probe_coordinate_wise(functools.partial(cls, lr=self.outer_lr))
        except USER_CODE_FAILURES as e:  # the user's class may raise anything
            fail(key, path, f"an optimizer whose step() updates one flat tensor ({_one_line(e)})")
        if not coordinate_wise:
            fail(key, path, "a coordinate-wise optimizer")
        self._outer_class = cls

    def outer_optimizer_factory(self) -> OptimizerFactory | None:
        """``[θ] → optimizer`` of the class ``outer_optimizer`` names, at rate
        ``outer_lr``; None for ``"sgd"`` (DiLoCo builds SGD from ``outer_momentum`` and
        ``outer_nesterov``)."""
        if self._outer_class is None:
            return None
        return functools.partial(self._outer_class, lr=self.outer_lr)

    @property
    def effective_softsync(self) -> int:
        """n actually used by the parameter server: λ for async, 1 for hardsync."""
        if self.mode == "async":
            return self.num_learners
        if self.mode == "hardsync":
            return 1
        return self.softsync

    @property
    def auto_replicas(self) -> bool:
        """True when ``replicas_per_device = "auto"`` (the auto-tuner chooses k)."""
        return self.replicas_per_device == "auto"

    @property
    def initial_replicas_per_device(self) -> int:
        """k at the start of the run: 1 with ``"auto"``, else ``replicas_per_device``."""
        return 1 if self.replicas_per_device == "auto" else int(self.replicas_per_device)

    @property
    def num_devices(self) -> int:
        """Devices for SMA / local SGD: λ / k (λ itself with ``"auto"``, which starts at
        k = 1)."""
        return self.num_learners // self.initial_replicas_per_device

    @property
    def global_batch(self) -> int:
        """Samples consumed per synchronous iteration: λ·b."""
        return self.num_learners * self.batch_size

    def check_fits(self, num_train: int) -> None:
        """Raise :class:`ConfigError` unless one iteration's λ·b samples fit in the
        ``num_train`` training samples."""
        if num_train < self.global_batch:
            raise ConfigError(
                f"protocol.batch_size = {self.batch_size} with protocol.num_learners = "
                f"{self.num_learners} needs {self.global_batch} samples per iteration but "
                f"the training set has {num_train}"
            )


def check_membership(changes: Any) -> None:
    """``cluster.membership``: a list of ``{at_s, join}`` / ``{at_s, leave}`` tables in
    increasing ``at_s``; else :class:`ConfigError` naming the entry."""
    allowed = (
        "a list of {at_s = seconds >= 0, join = count >= 1} or {at_s = seconds >= 0, "
        "leave = [worker, …]} tables in increasing at_s"
    )
    if not isinstance(changes, list):
        fail("cluster.membership", changes, allowed)
    last = 0.0
    for i, change in enumerate(changes):
        key = f"cluster.membership[{i}]"
        if not isinstance(change, dict) or set(change) not in ({"at_s", "join"}, {"at_s", "leave"}):
            fail(key, change, allowed)
        at = change["at_s"]
        if not _number(at) or at < last:
            fail(f"{key}.at_s", at, f"a number of seconds >= {last} (increasing at_s)")
        last = at
        check_int(f"{key}.join", change.get("join", 1), 1, 65536)
        leave = change.get("leave", [0])
        if (
            not isinstance(leave, list)
            or not leave
            or any(not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in leave)
            or len(set(leave)) != len(leave)
        ):
            fail(f"{key}.leave", leave, "a non-empty list of distinct worker indices >= 0")


def _one_line(error: BaseException) -> str:
    """``"Type: message"`` of ``error`` on one line (at most 200 characters)."""
    text = failure_text(error)
    return text if len(text) <= 200 else text[:197] + "..."


_OPTIMIZER = "a torch.optim.Optimizer subclass"


def _import_class(key: str, path: Any, base: type, what: str, builtin: str, example: str) -> type:
    """The subclass of ``base`` an import path ``"package.module:Name"`` names (``Name``
    may be dotted); the setting's ``builtin`` values are the caller's.

    Raises:
        ConfigError: ``path`` is not of that form (the message offers ``builtin`` and
            ``example``), its module does not import, the module has no such name, or it
            is not a subclass of ``base``; the message names ``key`` and ``what`` is
            expected.
    """
    if not isinstance(path, str) or ":" not in path:
        fail(key, path, f"{builtin} or an import path 'module:Class' of {what}, e.g. {example!r}")
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        fail(key, path, f"an import path 'module:Class' of {what}")
    search_current_directory()
    try:
        obj = importlib.import_module(module_name)
    except USER_CODE_FAILURES as e:  # the user's module may raise anything while importing
        fail(key, path, f"an import path of {what} whose module imports ({_one_line(e)})")
    for part in attr.split("."):
        if not hasattr(obj, part):
            fail(key, path, f"an import path of {what} (module {module_name!r} has no {attr!r})")
        obj = getattr(obj, part)
    if not isinstance(obj, type) or not issubclass(obj, base):
        named = f"{obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) else "a "
        named += "" if isinstance(obj, type) else type(obj).__name__
        fail(key, path, f"an import path of {what} (it names {named})")
    return obj


def _accepts_keyword(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` takes the keyword argument ``name`` (or any, ``**kwargs``)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the constructor decide
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _probe_coordinate_wise(make: OptimizerFactory) -> bool:
    """Whether ``make``'s optimizer updates a ``[2, 3]`` stack row by row exactly as two
    optimizers of the rows would, over three steps with rows of unlike gradients.

    Raises:
        Exception: whatever constructing or stepping the optimizer raises.
    """
    grads = torch.tensor([[0.5, -1.0, 2.0], [30.0, 0.1, -7.0]])
    stack = torch.tensor([[0.1, 0.2, 0.3], [1.0, -2.0, 3.0]])
    rows = [stack[i].clone() for i in range(2)]
    pairs = [(stack, grads)] + [(r, grads[i]) for i, r in enumerate(rows)]
    optimizers = [make([p]) for p, _ in pairs]
    for t in range(1, 4):
        for opt, (p, g) in zip(optimizers, pairs, strict=True):
            p.grad = g * t
            opt.step()
            p.grad = None
    # rtol: the same elementwise maths on a [2, 3] and a [3] tensor may take other
    # vectorised kernels (fused multiply-adds or not) on some CPUs, a few float32 ulps
    # apart; an optimizer that mixes rows (a factored or norm-based one) is off by far more.
    return all(torch.allclose(stack[i], rows[i], rtol=1e-5, atol=1e-7) for i in range(2))


@dataclass
class OptimizerConfig:
    """The optimizer that applies the protocol's updates, and its base learning rate.

    What it steps (docs/protocols.md §1–§5): hardsync / plain the shared weights; the parameter
    server and compute groups the server's weights (``protocol.server_optimizer = "sgd"``;
    ``"adagrad"`` is Rudra's own AdaGrad server and needs ``name = "sgd"``); SMA and local
    SGD each replica's weights (one optimizer over the stack of replicas, each replica's
    state its own). Every optimizer steps one flat vector of all parameters ``[P]`` (or
    the stack ``[λ, P]``), so it must be *coordinate-wise*: each coordinate updated from its
    own gradient history, as SGD, Adam, AdamW, Adagrad, RMSprop, NAdam, RAdam, Adamax,
    Adadelta, ASGD and Rprop are. A probe at validation checks it (Adafactor's factored
    moments and Muon's orthogonalisation are refused).

    What assumes SGD: ``momentum``, ``nesterov`` and ``protocol.momentum_compensation``
    (Omnivore's rule lowers SGD momentum), Rudra's AdaGrad server, and ``distsgd tune``
    (it searches SGD's η × μ grids); each refuses another ``name`` with one line.

    Attributes:
        name: ``"sgd"`` (torch.optim.SGD with ``momentum``, ``weight_decay`` and
            ``nesterov``; the default) or the import path ``"module:Class"`` of a
            torch.optim.Optimizer subclass, e.g. ``"torch.optim:AdamW"``, built as
            ``Class([param], lr=lr, **kwargs)`` (plus ``weight_decay`` when > 0).
        lr: base learning rate α0 (γ for SMA), in (0, 1000] (:data:`MAX_LR`), of every
            optimizer; the schedule scales it and the protocol sets it on every step.
        momentum: μ in [0, 1), SGD only: the server momentum for the parameter server, the
            target momentum for compute groups, local momentum for SMA and local SGD
            replicas. With an import path it is not used (a momentum-like setting goes in
            ``kwargs``, e.g. ``betas``) and a value other than its default 0.9 is refused.
        weight_decay: L2 coefficient, in [0, 10]. ``"sgd"``: SGD's. Import path: when > 0,
            passed as the class's ``weight_decay`` argument (refused when it has none, or
            when ``kwargs`` sets it too); 0 leaves the class's own default (AdamW: 0.01;
            write ``kwargs = {weight_decay = 0.0}`` for none).
        nesterov: Nesterov momentum, SGD only.
        kwargs: keyword arguments of the class named by an import path (TOML table
            ``[optimizer.kwargs]``, or ``--set optimizer.kwargs.betas=[0.9, 0.95]``); no
            ``lr`` (use ``lr``) or ``params``; ``{}`` with ``"sgd"``.
    """

    name: str = "sgd"
    lr: float = _setting(0.05, check_float, 0.0, MAX_LR, min_inclusive=False)
    momentum: float = _setting(0.9, check_float, 0.0, 1.0, max_inclusive=False)
    weight_decay: float = _setting(0.0, check_float, 0.0, 10.0)
    nesterov: bool = False
    kwargs: dict[str, Any] = _kwargs("lr", "params")

    def __post_init__(self) -> None:
        _check_fields(self, "optimizer")
        if self.nesterov and self.momentum == 0:
            fail("optimizer.nesterov", self.nesterov, "false when optimizer.momentum = 0")
        self._class: type[torch.optim.Optimizer] | None = None
        if self.name == "sgd":
            if self.kwargs:
                fail(
                    "optimizer.kwargs",
                    self.kwargs,
                    "{} with optimizer.name = 'sgd' (name an import path such as "
                    "'torch.optim:SGD' to pass keyword arguments)",
                )
            return
        self._class = _import_class(
            "optimizer.name",
            self.name,
            torch.optim.Optimizer,
            _OPTIMIZER,
            "'sgd'",
            "torch.optim:AdamW",
        )
        self._check_sgd_settings()
        make = self.optimizer_factory()
        assert make is not None  # an import path
        try:
            coordinate_wise = _probe_coordinate_wise(make)
        except USER_CODE_FAILURES as e:  # the user's class may raise anything
            raise ConfigError(
                f"optimizer.name = {self.name!r} with optimizer.kwargs = {self.kwargs!r} is "
                "not allowed: expected an optimizer that these keyword arguments build and "
                f"whose step() updates one flat tensor from its gradient ({_one_line(e)})"
            ) from None
        if not coordinate_wise:
            fail(
                "optimizer.name",
                self.name,
                "a coordinate-wise optimizer (each coordinate updated from its own gradient "
                "history): distsgd steps one flat [P] vector or a [λ, P] stack of replicas, "
                "and this one's update of a row depends on the other rows",
            )

    def _check_sgd_settings(self) -> None:
        """With an import path: refuse the SGD-only settings, map ``weight_decay``."""
        assert self._class is not None
        why = f"with optimizer.name = {self.name!r}: it applies to 'sgd' only"
        if self.nesterov:
            fail("optimizer.nesterov", self.nesterov, f"false {why} (use optimizer.kwargs)")
        if self.momentum != 0.9:
            fail(
                "optimizer.momentum",
                self.momentum,
                f"it left out (its default 0.9) {why}; the optimizer's own settings, "
                "e.g. betas, go in optimizer.kwargs",
            )
        if self.weight_decay > 0:
            if "weight_decay" in self.kwargs:
                fail(
                    "optimizer.weight_decay",
                    self.weight_decay,
                    f"0 when optimizer.kwargs sets weight_decay = "
                    f"{self.kwargs['weight_decay']!r} (one place for it)",
                )
            if not _accepts_keyword(self._class, "weight_decay"):
                fail(
                    "optimizer.weight_decay",
                    self.weight_decay,
                    f"0 with optimizer.name = {self.name!r} (its constructor takes no "
                    "weight_decay)",
                )

    @property
    def is_sgd(self) -> bool:
        """True for ``name = "sgd"`` (torch.optim.SGD with this section's SGD settings)."""
        return self.name == "sgd"

    def optimizer_factory(self) -> OptimizerFactory | None:
        """``[param] → optimizer`` of the class ``name`` imports (:data:`~distsgd.protocols.
        OptimizerFactory`): ``Class([param], lr=lr, **kwargs)`` plus ``weight_decay`` when
        > 0. None for ``"sgd"``: the protocols build SGD from ``momentum``,
        ``weight_decay`` and ``nesterov`` themselves (today's rule, bit for bit)."""
        if self._class is None:
            return None
        kwargs = dict(self.kwargs)
        if self.weight_decay > 0:
            kwargs["weight_decay"] = self.weight_decay
        return functools.partial(self._class, lr=self.lr, **kwargs)


class _SchedulerReplay:
    """The rate of a torch LR scheduler after n steps, replayed on a proxy optimizer.

    Queries with non-decreasing n advance the live scheduler (O(1) amortised per step);
    a smaller n, or another base rate, replays from scratch. The live scheduler is not
    part of a copy or a pickle (it is rebuilt on the next query).
    """

    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls, self.kwargs = cls, kwargs
        self._reset()

    def _reset(self) -> None:
        self._base_lr: float | None = None
        self._steps = 0
        self._proxy: torch.optim.Optimizer | None = None
        self._scheduler: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"cls": self.cls, "kwargs": self.kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.cls, self.kwargs = state["cls"], state["kwargs"]
        self._reset()

    def lr(self, base_lr: float, steps: int) -> float:
        """The rate the scheduler sets after ``steps`` steps on an optimizer of rate
        ``base_lr``.

        Raises:
            Exception: whatever constructing or stepping the scheduler raises (e.g.
                OneCycleLR stepped past ``total_steps``).
        """
        if self._scheduler is None or base_lr != self._base_lr or steps < self._steps:
            self._proxy = torch.optim.SGD([torch.zeros(1)], lr=base_lr)
            self._scheduler = self.cls(self._proxy, **self.kwargs)
            self._base_lr, self._steps = base_lr, 0
        assert self._proxy is not None
        while self._steps < steps:
            self._proxy.step()  # no gradient: nothing moves; torch wants it before step()
            self._scheduler.step()
            self._steps += 1
        return float(self._proxy.param_groups[0]["lr"])


@dataclass
class ScheduleConfig:
    """Learning-rate schedule over training progress measured in epochs (samples / train size).

    The rate is a pure function of progress (asynchronous learners, a resumed run and the
    simulated clock all ask for the rate at a number of samples), so a torch scheduler is
    replayed: **one scheduler step per 1 / ``steps_per_epoch`` epochs of training
    samples**, counted from the start of the run. At ``epoch`` the rate is the one the
    scheduler sets on an optimizer of rate ``optimizer.lr`` after
    ``⌊epoch · steps_per_epoch + 1e-9⌋`` calls of ``scheduler.step()`` (the 1e-9 absorbs
    float rounding at exact boundaries). ``steps_per_epoch = 1`` (default) steps once per
    epoch, as ``scheduler.step()`` at the end of each epoch of a plain loop;
    ``steps_per_epoch = num_train / (λ·b)`` steps once per λ·b samples (a synchronous
    iteration). Only the rate is used (momentum cycling of CyclicLR / OneCycleLR is not).

    Attributes:
        kind: ``constant``, ``step`` (multiply by ``decay_factor`` at each epoch in
            ``decay_epochs``), or the import path ``"module:Class"`` of a
            ``torch.optim.lr_scheduler.LRScheduler`` subclass whose ``step()`` takes no
            metric, e.g. ``"torch.optim.lr_scheduler:CosineAnnealingLR"`` (ReduceLROnPlateau
            is refused: its rate depends on a metric, not on progress).
        warmup_epochs: linear warm-up from 0.1·lr to lr over this many epochs (0: none),
            in [0, 1000000], multiplying any kind's rate.
        decay_epochs: epochs at which the step schedule decays, increasing, each in
            (0, 1000000].
        decay_factor: multiplier at each decay, in (0, 1].
        kwargs: keyword arguments of the scheduler class (TOML table
            ``[schedule.kwargs]``, e.g. ``{T_max = 10}`` in scheduler steps); no
            ``optimizer``; ``{}`` with ``constant`` and ``step``.
        steps_per_epoch: scheduler steps per epoch, in (0, 1000000] (import-path kinds
            only).

    Every rate the schedule sets is in [0, ``MAX_LR``]: a torch scheduler's rates are
    checked over the run's span (its budget, at most ``MAX_SCHEDULE_CHECK_STEPS``
    scheduler steps) before the run writes anything (:meth:`check_rates`).
    """

    kind: str = "constant"
    warmup_epochs: float = _setting(0.0, check_float, 0.0, 1e6)
    decay_epochs: list[float] = field(default_factory=list)
    decay_factor: float = _setting(0.1, check_float, 0.0, 1.0, min_inclusive=False)
    kwargs: dict[str, Any] = _kwargs("optimizer")
    steps_per_epoch: float = _setting(1.0, check_float, 0.0, 1e6, min_inclusive=False)

    def __post_init__(self) -> None:
        _check_fields(self, "schedule")
        if (
            not isinstance(self.decay_epochs, list)
            or any(
                not isinstance(e, int | float) or isinstance(e, bool) or not 0 < e <= 1e6
                for e in self.decay_epochs
            )
            or list(self.decay_epochs) != sorted(self.decay_epochs)
        ):
            fail(
                "schedule.decay_epochs",
                self.decay_epochs,
                "an increasing list of epochs in (0, 1000000]",
            )
        self._replay: _SchedulerReplay | None = None
        if self.kind in SCHEDULES:
            if self.kwargs:
                fail(
                    "schedule.kwargs",
                    self.kwargs,
                    f"{{}} with schedule.kind = {self.kind!r} (keyword arguments are for a "
                    "torch scheduler named by an import path)",
                )
            return
        cls = _import_class(
            "schedule.kind",
            self.kind,
            torch.optim.lr_scheduler.LRScheduler,
            "a torch.optim.lr_scheduler.LRScheduler subclass",
            "'constant', 'step'",
            "torch.optim.lr_scheduler:CosineAnnealingLR",
        )
        if issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
            fail(
                "schedule.kind",
                self.kind,
                "a scheduler whose step() takes no metric (distsgd needs the rate as a "
                "function of training progress; ReduceLROnPlateau's follows a metric)",
            )
        try:  # build and step it once: keyword arguments the class rejects fail now
            _SchedulerReplay(cls, dict(self.kwargs)).lr(1.0, 2)
        except USER_CODE_FAILURES as e:  # the user's class may raise anything
            raise ConfigError(
                f"schedule.kind = {self.kind!r} with schedule.kwargs = {self.kwargs!r} is not "
                "allowed: expected a scheduler that these keyword arguments build and that "
                f"steps without arguments ({_one_line(e)})"
            ) from None
        self._replay = _SchedulerReplay(cls, dict(self.kwargs))

    def scheduler_steps(self, epoch: float) -> int:
        """Scheduler steps taken by ``epoch``: ``⌊epoch · steps_per_epoch + 1e-9⌋``."""
        return math.floor(epoch * self.steps_per_epoch + 1e-9)

    def lr_at(self, base_lr: float, epoch: float) -> float:
        """Learning rate at fractional ``epoch`` (>= 0) for base rate ``base_lr``.

        Raises:
            ConfigError: a torch scheduler that fails at this step (e.g. OneCycleLR past
                its ``total_steps``), or sets a rate outside [0, ``MAX_LR``] (past the
                steps :meth:`check_rates` checked before the run).
        """
        lr = base_lr
        if self.kind == "step":
            for e in self.decay_epochs:
                if epoch >= e:
                    lr *= self.decay_factor
        elif self._replay is not None:
            steps = self.scheduler_steps(epoch)
            try:
                lr = self._replay.lr(base_lr, steps)
            except (Exception, SystemExit) as e:  # the user's class (a Ctrl-C interrupts)
                raise ConfigError(
                    f"schedule.kind = {self.kind!r} with schedule.kwargs = {self.kwargs!r} "
                    f"is not allowed: expected a scheduler that takes {steps} steps (epoch "
                    f"{epoch:.4g} at schedule.steps_per_epoch = {self.steps_per_epoch:g}; "
                    f"{_one_line(e)})"
                ) from None
            if not 0.0 <= lr <= MAX_LR:
                raise self._rate_error(base_lr, steps, f"sets lr = {lr:g}")
        if self.warmup_epochs > 0 and epoch < self.warmup_epochs:
            lr *= 0.1 + 0.9 * epoch / self.warmup_epochs
        return lr

    def check_rates(self, base_lr: float, epochs: float) -> None:
        """Refuse a torch scheduler that sets a rate outside [0, ``MAX_LR``] (negative,
        NaN, overflowing) at a scheduler step of the run's first ``epochs`` epochs (at
        most :data:`MAX_SCHEDULE_CHECK_STEPS` steps; ``math.inf``: a run without a
        budget in samples). The built-in kinds need no check: their factors are in
        (0, 1], so their rates stay in (0, ``optimizer.lr``].

        Raises:
            ConfigError: naming ``schedule.kind``, ``schedule.kwargs``, the rate and the
                step where it is set, or the scheduler failing at a step.
        """
        if self._replay is None:
            return
        steps = MAX_SCHEDULE_CHECK_STEPS
        if math.isfinite(epochs):
            steps = min(steps, self.scheduler_steps(epochs))
        replay = _SchedulerReplay(self._replay.cls, dict(self.kwargs))
        for step in range(steps + 1):
            try:
                lr = replay.lr(base_lr, step)
            except USER_CODE_FAILURES as e:  # the user's class may raise anything
                lr, error = math.nan, _one_line(e)
            else:
                error = ""
            if error or not 0.0 <= lr <= MAX_LR:
                raise self._rate_error(
                    base_lr, step, f"fails ({error})" if error else f"sets lr = {lr:g}"
                )

    def _rate_error(self, base_lr: float, step: int, what: str) -> ConfigError:
        return ConfigError(
            f"schedule.kind = {self.kind!r} with schedule.kwargs = {self.kwargs!r} is not "
            f"allowed: from optimizer.lr = {base_lr:g} it {what} at scheduler step {step}, "
            f"epoch {step / self.steps_per_epoch:.4g} of the run (schedule.steps_per_epoch = "
            f"{self.steps_per_epoch:g}); expected rates in [0, {MAX_LR:g}]"
        )


_CALIBRATED = (
    _check_range,
    -math.inf,
    3600,
    "a number of seconds in [0, 3600], or -1 to calibrate",
)
"""The check of a time in seconds that a negative value asks to calibrate."""
_BANDWIDTH = (_check_range, 1e-6, 1e6, "0 (infinite) or in [1e-6, 1e6]", (0,))
"""The check of a bandwidth in Gb/s, 0 for infinite."""


@dataclass
class ClusterConfig:
    """The simulated cluster: device speed and network (runtime ``sim`` only).

    A learner's compute time for a minibatch of b samples is
    ``(seconds_per_batch + b * seconds_per_sample) / speed`` virtual seconds, times a
    seeded log-normal factor of relative spread ``jitter``. A message of P float32
    parameters takes ``latency_s + 32 P / (bandwidth_gbps * 1e9)`` virtual seconds.
    Every time of this section is at most an hour and every speed, ratio and bandwidth
    within [1e-6, 1e6], so the virtual clock of any allowed run stays finite.

    Attributes:
        seconds_per_sample: per-sample compute time in seconds, in [0, 3600]; negative
            (-1) means calibrate on this machine with the configured model.
        seconds_per_batch: fixed per-minibatch overhead in seconds, in [0, 3600]; negative
            means calibrate.
        seconds_per_replica: SMA / local SGD only: seconds, in [0, 3600], each further
            replica (with
            its own b samples) adds to a device that computes its k replicas as one
            batched computation (:meth:`distsgd.engine.GradientEngine.replica_gradients`):
            one device's iteration takes ``t(k) = t(1) + (k − 1) · seconds_per_replica``
            with ``t(1) = seconds_per_batch + b · seconds_per_sample`` (so
            ``seconds_per_replica = t(1)`` means k replicas cost k separate minibatches,
            and ``0.4 · t(1)`` that each further replica costs 40% of one). Used only
            while ``replica_ratios`` is empty; negative (-1) means calibrate
            ``replica_ratios`` where the device profile is calibrated, else k separate
            minibatches.
        replica_ratios: SMA / local SGD only: the measured t(k)/t(1) of one device
            computing k replicas as one batched computation, for k = 1, 2, …, n (first
            value 1, each in [1e-6, 1e6]; empty: use ``seconds_per_replica``). A device's iteration then takes
            ``t(1) · ratio(k)``, beyond n continuing the last measured step
            (:func:`distsgd.tuner.perf_model.replica_ratio`). Calibrated (measured on this
            machine at the run's b for k = 1 … min(8, autotune_max_replicas) or the fixed
            k, :func:`distsgd.runtime.sim.calibrate_replicas`) when the device profile is
            calibrated, the run has k > 1 or ``replicas_per_device = "auto"``, and
            neither this nor ``seconds_per_replica`` is given.
        speed_factors: relative speed of each learner (e.g. ``[10, 10, 1, 1]`` for two GPUs
            and two CPUs), each in [1e-6, 1e6]; empty means all 1. Length must equal λ if
            given.
        jitter: relative spread of compute times (0 = deterministic equal-speed schedule),
            in [0, 2].
        stall_probability: stragglers' random stalls: the probability, in [0, 1], that a
            learner's (or device's) minibatch is held up by a stall, drawn independently
            for each minibatch from a stream seeded by ``train.seed``; 0 (default): none.
        stall_seconds: a stall's duration in seconds, in [0, 3600]: fixed, or the mean of
            an exponential distribution (``stall_distribution``); added to that
            minibatch's compute time.
        stall_distribution: ``"exponential"`` (default) or ``"fixed"``.
        membership: parameter server (without the hardsync barrier) and compute groups on
            the simulated cluster: learners that join and leave the running run
            (docs/elastic.md), a list of changes in increasing ``at_s`` (virtual seconds
            >= 0), each ``{at_s = t, join = m}`` (m >= 1 new workers: learners, or whole
            compute groups, numbered after every worker so far, speed 1) or
            ``{at_s = t, leave = [w, …]}`` (active worker indices: learners, or groups);
            [] (default): fixed membership.
        latency_s: one-way message latency in seconds, in [0, 60].
        bandwidth_gbps: link bandwidth in gigabits per second, in [1e-6, 1e6]; 0 means
            infinite.
        allreduce_latency_s: the latency term of a ring all-reduce (``2(m−1) ·
            allreduce_latency_s + 2(m−1)/m · 32 P / bw``), seconds, in [0, 60]; -1
            (default): ``latency_s``. ``distsgd.runtime.netcal`` fits it apart from the
            messages' (gloo's all-reduce reduces and copies as it goes).
        allreduce_bandwidth_gbps: the all-reduce's bandwidth in Gb/s, in [1e-6, 1e6], 0
            infinite; -1 (default): ``bandwidth_gbps``.
        seconds_per_push: parameter-server protocols (and compute groups): seconds, in
            [0, 3600], the
            server works on each pushed gradient (apply the update, copy the weights for
            the reply); pushes are served one at a time, so the server saturates at
            ``1 / seconds_per_push`` pushes per second. Negative (-1) means measured with
            the device profile when that is calibrated or read from ``profile``
            (:func:`distsgd.runtime.sim.calibrate_server`), and free when
            ``seconds_per_sample`` / ``seconds_per_batch`` are given; 0: free.
        seconds_per_push_contended: in [0, 3600]; parameter-server protocols whose learners
            each push
            (async, n-softsync; not compute groups of several learners) with every rank on
            one machine (``cores`` > 0): the server's wall seconds per push
            measured on processes while the run's other learners compute on the same cores
            (async, one learner at batch 1, λ − 1 processes computing beside it). Where > 0 it replaces the
            server's time per push, charged as measured, not stretched by the cores'
            sharing (the wait for a core is in it), while ``seconds_per_push`` (its work
            measured alone) still counts as the server's demand for a core in the stretch
            of the learners' compute
            (:func:`distsgd.runtime.cluster_model.server_push_seconds`); 0 (default): not
            measured, ``seconds_per_push`` stretched. Not charged with ``cores`` = 0 (a
            core per process: nothing waits for one). Never calibrated by distsgd itself.
        seconds_per_iteration: synchronous protocols (hardsync, SMA, local SGD): seconds, in
            [0, 3600], a
            device works per iteration beyond its gradients: the protocol's update of the
            flat weights and the runtime loop's own work (the DDP wrapper, drawing the
            minibatch), charged once per device iteration. Negative (-1) means measured
            with the device profile when that is calibrated
            (:func:`distsgd.runtime.dist.calibrate_iteration`: the real hardsync
            iteration at world size 1 minus the gradient alone), read from ``profile``
            (0 when the file has none), and free when ``seconds_per_sample`` /
            ``seconds_per_batch`` are given; 0: free.
        cores: CPU cores the simulated cluster's processes share, in [0, 65536]; 0
            (default): every
            process (learner, server) has cores of its own, as on a real cluster. With
            more busy processes than cores (every rank on one machine), compute and the
            parameter server's work stretch by ``max(1, busy / cores)``
            (:func:`distsgd.runtime.cluster_model.core_stretch`; for a parameter server
            ``busy = learners + the server's busy fraction``,
            :func:`~distsgd.runtime.cluster_model.server_core_stretch`). With
            ``processes_per_host`` > 0 these are each host's cores, shared by the
            processes on that host only.
        processes_per_host: ranks on each host, in [0, 4096], placed as the launchers
            place them: rank r runs on host ``r // processes_per_host`` (ranks: the
            ``dist.num_servers`` server shards first, then the learners; one rank per
            device for SMA and local SGD). A message between two processes on one host
            takes ``local_latency_s + 32 P / (local_bandwidth_gbps · 1e9)``, an all-reduce
            among processes of one host the ring formula with the local terms; across
            hosts the link's (``latency_s``, ``bandwidth_gbps``, ``allreduce_*``). 0
            (default): every process is a host of its own, so every message crosses the
            link.
        local_latency_s: one-way latency of a message inside a host (loopback, shared
            memory), seconds, in [0, 60]; read with ``processes_per_host`` > 0.
        local_bandwidth_gbps: bandwidth of a message inside a host in Gb/s, in [1e-6, 1e6];
            0 means infinite; read with ``processes_per_host`` > 0.
        profile: path of a profile file written by ``distsgd calibrate --out`` (a device
            measured elsewhere, e.g. a GPU node): the device profile comes from it instead
            of being calibrated here; "" (default): calibrate on this machine, through
            the profile cache (:mod:`distsgd.runtime.profiles`). Settings given in this
            section explicitly (>= 0) win over the file.
    """

    seconds_per_sample: float = _setting(-1.0, *_CALIBRATED)
    seconds_per_batch: float = _setting(-1.0, *_CALIBRATED)
    seconds_per_replica: float = _setting(-1.0, *_CALIBRATED)
    seconds_per_push: float = _setting(-1.0, *_CALIBRATED)
    seconds_per_iteration: float = _setting(-1.0, *_CALIBRATED)
    seconds_per_push_contended: float = _setting(
        0.0, _check_range, 0, 3600, "a number of seconds in [0, 3600] (0: not measured)"
    )
    profile: str = _setting("", _check_str, 'a path of a profile file, or "" to calibrate')
    replica_ratios: list[float] = field(default_factory=list)
    speed_factors: list[float] = field(default_factory=list)
    membership: list[dict[str, Any]] = field(default_factory=list)
    jitter: float = _setting(0.1, check_float, 0.0, 2.0)
    stall_probability: float = _setting(0.0, check_float, 0.0, 1.0)
    stall_seconds: float = _setting(0.0, check_float, 0.0, 3600.0)
    stall_distribution: str = _setting("exponential", check_choice, STALL_DISTRIBUTIONS)
    latency_s: float = _setting(50e-6, check_float, 0.0, 60.0)
    bandwidth_gbps: float = _setting(10.0, *_BANDWIDTH)
    allreduce_latency_s: float = _setting(
        -1.0, _check_range, 0, 60, "in [0, 60], or -1 for latency_s", (-1,)
    )
    allreduce_bandwidth_gbps: float = _setting(
        -1.0,
        _check_range,
        1e-6,
        1e6,
        "0 (infinite) or in [1e-6, 1e6], or -1 for bandwidth_gbps",
        (-1, 0),
    )
    cores: int = _setting(0, check_int, 0, 65536)
    processes_per_host: int = _setting(0, check_int, 0, 4096)
    local_latency_s: float = _setting(50e-6, check_float, 0.0, 60.0)
    local_bandwidth_gbps: float = _setting(10.0, *_BANDWIDTH)

    def __post_init__(self) -> None:
        _check_fields(self, "cluster")
        rr = self.replica_ratios
        if not isinstance(rr, list) or (
            rr
            and (len(rr) < 2 or any(not _number(v) or not 1e-6 <= v <= 1e6 for v in rr))
            or rr
            and rr[0] != 1
        ):
            fail(
                "cluster.replica_ratios",
                rr,
                "an empty list, or t(k)/t(1) for k = 1 … n: n >= 2 numbers in [1e-6, 1e6], "
                "the first 1",
            )
        sf = self.speed_factors
        if not isinstance(sf, list) or any(not _number(s) or not 1e-6 <= s <= 1e6 for s in sf):
            fail("cluster.speed_factors", sf, "a list of numbers in [1e-6, 1e6]")
        check_membership(self.membership)

    @property
    def needs_calibration(self) -> bool:
        return self.seconds_per_sample < 0 or self.seconds_per_batch < 0

    @property
    def allreduce_network(self) -> tuple[float | None, float | None]:
        """``(allreduce_latency_s, allreduce_bandwidth_gbps)``, None where negative
        (the messages' value; :class:`distsgd.runtime.cluster_model.ClusterModel`)."""
        return (
            None if self.allreduce_latency_s < 0 else float(self.allreduce_latency_s),
            None if self.allreduce_bandwidth_gbps < 0 else float(self.allreduce_bandwidth_gbps),
        )


@dataclass
class TrainConfig:
    """Stop rule, evaluation, checkpoints and seeding.

    Attributes:
        loss: the training loss (:mod:`distsgd.objectives`): ``cross_entropy``, ``mse``,
            ``bce_with_logits`` or an import path ``"module:function"`` of
            ``(outputs, targets) -> scalar`` (the minibatch's mean loss).
        metric: what an evaluation measures: ``accuracy`` (the default; a fraction of
            right classes: refused with ``loss = "mse"`` and on targets that are not
            class labels, :mod:`distsgd.objectives`), ``loss`` (mean evaluation loss),
            ``perplexity`` (its exp) or an import path ``"module:function"`` of
            ``(outputs, targets) -> the batch's mean value``, a finite number (NaN stops
            the run).
        metric_direction: ``"max"`` (higher is better) or ``"min"``; required for a user
            metric, "" for a built-in one (accuracy: max; loss, perplexity: min).
        target: the metric value at which the run stops (time to target is measured to
            it): reached when the metric is ``>=`` it (direction max) or ``<=`` it (min);
            0 disables early stopping. An accuracy target is a fraction in [0, 1]; any
            other in [-1e12, 1e12]. The default 0.9 is for the built-in tasks: a config
            whose model, data or metric is the user's and that sets no target has none
            (0; :meth:`RunConfig.from_dict`).
        max_epochs: budget in epochs of training samples (0: no limit), in [0, 1000000].
        max_samples: budget in training samples (0: no limit), in [0, 1e12]; a run stops
            at the first iteration (or push) that reaches it, so it may overshoot by less
            than one.
        max_seconds: budget in wall seconds of training (0: no limit), in [0, 1e9].
        max_virtual_seconds: budget in simulated seconds on the virtual clock of the
            ``sim`` runtime (0: no limit), in [0, 1e12]; the run stops at the first tick
            that reaches it. The tuner's probes use it for equal-time probes
            (docs/protocols.md §3).
        eval_every_samples: evaluate the model every this many training samples (0: once
            per epoch), in [0, 1e12].
        eval_batch_size: batch size of evaluation, in samples, in [1, 1048576] (the metric
            does not depend on it, being a sample-weighted mean; default 128, the fastest
            measured for the ``cnn`` on 2 CPU cores: docs/benchmarks.md).
        eval_samples: test samples that intermediate evaluations score (0: the whole test
            set), in [0, 1e12]: a fixed, seeded subset (:func:`distsgd.engine.eval_subset_indices`,
            drawn with ``seed``), the same at every evaluation, on every runtime and rank
            layout. The final evaluation (the run's budget) and the target decision use
            the whole test set: an evaluation of the subset that reaches ``target`` is
            followed at once by one of the whole set, which decides. Default 2000: the
            standard error of an accuracy near 0.9 on 2000 samples is 0.7 points, enough
            to follow the curve, for a fifth of the cost of Fashion-MNIST's 10k (test
            sets of at most 2000 samples are scored whole).
        bn_recalibration_samples: training samples over which the running statistics of
            BatchNorm layers are recomputed with the evaluated weights before every
            evaluation (precise BN, :meth:`distsgd.engine.GradientEngine.recalibrate`),
            in samples (in [1, 1e12]; the whole training set if it is smaller; rounded down to
            whole batches of ``eval_batch_size``). A fixed, seeded slice of the training
            set, the same on every runtime and for every protocol. Unused by models
            without running statistics.
        checkpoint_every_evals: write a checkpoint every this many evaluations (0: only when
            the run stops at its target or budget), in [0, 1000000].
        seed: seeds model initialisation, data order and simulated timing, in
            [0, 2147483647].
        num_threads: torch intra-op threads (0: all cores), in [0, 256].
        compile: ``"off"`` (default) or ``"on"``: compile each learner's forward+backward
            with ``torch.compile`` (inductor; on CPU it needs a C++ compiler). Compiling
            costs tens of seconds to minutes per batch shape before the first step, and
            a compiled kernel sums in another order than the eager one (gradients agree
            to float32 rounding, not bit for bit). Where compilation fails the run warns
            once and computes eagerly. Used by gradients on the ``sim`` runtime and by
            protocols that do not wrap the model in DDP; evaluation stays eager.
            ``"reduce-overhead"``: the same with ``torch.compile(mode="reduce-overhead")``
            (on a GPU inductor's kernels replay from CUDA graphs: one launch per
            forward+backward), and the batched replica gradients of SMA and local SGD
            (``cnn``, ``mlp``) compiled too, forward and backward as one graph.
        memory_format: the layout of the model's 4-D parameters (convolution kernels) and
            so of its convolutions' activations: ``"channels_last"`` (NHWC), the faster
            layout of the CPU's oneDNN convolutions and max-pooling; ``"contiguous"``
            (NCHW, PyTorch's default); ``"auto"`` (default): channels_last for the
            built-in ``cnn`` and ``lenet`` (faster for them: docs/benchmarks.md),
            contiguous for every other model: ``resnet20``'s float32
            gradients were 1000× less accurate in channels-last on torch 2.13's CPU
            kernels, and a user's forward that flattens with ``.view`` fails on
            channels-last activations (use ``reshape``/``flatten`` before asking for
            ``"channels_last"``; :func:`distsgd.engine.resolve_memory_format`). Only
            ``nn.Conv2d`` kernels are laid out. The flat weights keep
            ``model.parameters()`` order and NCHW layout either way (files of weights do
            not change); a run records the resolved choice in its ``config.toml``. The
            kernels sum in another order: gradients agree to float32 rounding, not bit for
            bit, between the two layouts.
        stop_at_target: stop as soon as ``target`` is reached.
        tensorboard: also write TensorBoard event files (one scalar per metric, step =
            training samples) to the run directory's ``tb/``; needs the optional
            ``tensorboard`` package and is skipped silently without it.
        initial_weights: path of a file written by ``torch.save`` holding the model's
            flattened weights, shape ``[P]`` float32 (e.g. a tuner snapshot); the run
            starts from them instead of the seeded initialisation (protocol state starts
            fresh); "" (default): the seeded initialisation. Every rank of a ``dist`` run
            reads it.
        evaluate: evaluate on the test set (false: no evaluations and no metrics records;
            the run stops at its budget).
        save_eval_weights: also write the central model of every evaluation, ``[P]``
            float32, to ``eval_weights/NNNN.pt`` in the run directory (NNNN = the ``eval``
            number of its ``metrics.jsonl`` record).
        device: where the model, its flat weights and gradients, the protocols' state and
            the learners' batches live: ``"auto"`` (each rank's own GPU, ``cuda:<local
            rank mod GPUs>``, when CUDA is available, else the CPU; a run records what
            it resolved to, ``"cuda"`` or ``"cpu"``, in its ``config.toml``), ``"cpu"``,
            ``"cuda"`` (each rank's own GPU, as auto) or ``"cuda:N"`` (GPU N for every
            rank). A CUDA device this machine lacks is refused before anything starts
            (:func:`check_device`).
        precision: ``"fp32"`` or ``"bf16-mixed"``: the forward pass and the loss run under
            ``torch.autocast`` in bfloat16 on the run's device type; the flat master
            weights, the gradients learners exchange and all protocol state stay float32.
            Evaluation runs in float32.
    """

    loss: str = _setting("cross_entropy", _check_builtin_or_path, LOSSES)
    metric: str = _setting("accuracy", _check_builtin_or_path, tuple(METRICS))
    metric_direction: str = _setting("", check_choice, ("", "max", "min"))
    target: float = 0.9
    max_epochs: float = _setting(10.0, check_float, 0.0, 1e6)
    max_samples: int = _setting(0, check_int, 0, MAX_COUNT)
    max_seconds: float = _setting(0.0, check_float, 0.0, 1e9)
    max_virtual_seconds: float = _setting(0.0, check_float, 0.0, 1e12)
    eval_every_samples: int = _setting(15000, check_int, 0, MAX_COUNT)
    eval_batch_size: int = _setting(128, check_int, 1, 2**20)
    eval_samples: int = _setting(2000, check_int, 0, MAX_COUNT)
    bn_recalibration_samples: int = _setting(2048, check_int, 1, MAX_COUNT)
    checkpoint_every_evals: int = _setting(1, check_int, 0, 1_000_000)
    seed: int = _setting(0, check_int, 0, 2**31 - 1)
    num_threads: int = _setting(0, check_int, 0, 256)
    compile: str = _setting("off", check_choice, COMPILE_MODES)
    memory_format: str = _setting("auto", check_choice, MEMORY_FORMATS)
    stop_at_target: bool = True
    tensorboard: bool = True
    initial_weights: str = _setting("", _check_str, 'a file path or ""')
    evaluate: bool = True
    save_eval_weights: bool = False
    device: str = "auto"
    precision: str = _setting("fp32", check_choice, PRECISIONS)

    def __post_init__(self) -> None:
        _check_fields(self, "train")
        if self.metric in METRICS and self.metric_direction not in ("", METRICS[self.metric]):
            fail(
                "train.metric_direction",
                self.metric_direction,
                f'"" or {METRICS[self.metric]!r} with train.metric = {self.metric!r}',
            )
        if self.metric not in METRICS and not self.metric_direction:
            fail(
                "train.metric_direction",
                self.metric_direction,
                f'"max" or "min" with train.metric = {self.metric!r} (is higher better?)',
            )
        if self.metric == "accuracy" and self.loss == "mse":
            fail(
                "train.metric",
                self.metric,
                "'loss' or a user metric \"module:function\" with train.loss = 'mse' (a "
                "regression: accuracy would count (output > 0) == (target > 0.5))",
            )
        if self.metric == "accuracy":
            check_float("train.target", self.target, 0.0, 1.0)
        else:
            check_float("train.target", self.target, -1e12, 1e12)
        if (
            self.max_epochs == 0
            and self.max_samples == 0
            and self.max_seconds == 0
            and self.max_virtual_seconds == 0
            and (self.target == 0 or not self.stop_at_target)
        ):
            fail(
                "train.max_epochs",
                self.max_epochs,
                "a budget > 0 (max_epochs, max_samples or max_seconds) when no target stops the run",
            )
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.fullmatch(self.device):
            fail("train.device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N'")


@dataclass
class DistConfig:
    """Real processes through torch.distributed (runtime ``dist`` only).

    Processes a protocol needs (``num_processes = 0`` takes it; another number fits the
    layout to it, see ``num_processes``):

    * ``hardsync`` / ``plain``: one learner per process, λ processes (DDP); with
      ``protocol.backup_learners = β`` > 0, one parameter-server rank (rank 0) and λ + β
      learner ranks, λ + β + 1 processes;
    * ``sma`` / ``local_sgd``: one process per device, λ / k processes, each holding its
      k replicas (``protocol.replicas_per_device``);
    * ``parameter_server`` / ``compute_groups``: ``num_servers`` server ranks (ranks
      0 … S−1, rank 0 coordinates) plus λ learner ranks.

    Attributes:
        num_processes: processes (ranks) of the run, in [0, 4096]; 0 means what the
            protocol needs. A
            different number fits the layout to it (:func:`fit_layout`: λ and what must
            divide it change, the per-learner batch and learning rate stay); the fitted
            values are what the run records in its ``config.toml``, and
            ``RunConfig.layout_changes`` lists them (the CLI prints them as one line). It
            is an error only where no layout fits (``plain`` with more than one process,
            a parameter server with no learner rank left). ``--num-processes N`` is this
            setting.
        backend: c10d backend of the collectives: ``auto`` (NCCL for CUDA tensors, gloo
            for CPU ones, when the run trains on CUDA and this machine's ranks each have
            a GPU of their own; gloo alone otherwise: on the CPU, or several ranks sharing
            a GPU), ``gloo``, or ``nccl`` (NCCL for CUDA tensors, gloo for CPU ones; needs
            CUDA). The all-reduces of hardsync (DDP), SMA, local SGD and of a compute
            group's members are what NCCL carries; the parameter-server transport is
            point-to-point on gloo through host memory in any case
            (:func:`distsgd.runtime.dist.collective_backend`).
        master_addr: address of rank 0 for the rendezvous (loopback on one machine).
        master_port: TCP port of the rendezvous, in [0, 65535]; 0 picks a free port (one
            machine only).
        timeout_s: seconds, in [1, 3600], after which a silent peer is declared lost (collectives and
            parameter-server messages); the run then ends with an error naming it. Must
            exceed the longest legitimate silence: one minibatch's gradient, and for the
            parameter server one evaluation on the coordinator (its learners wait for it).
        num_servers: S parameter-server ranks, in [1, 64], each owning a slice of the flattened
            parameters (Rudra-adv sharding); ``parameter_server`` / ``compute_groups`` only.
    """

    num_processes: int = _setting(0, check_int, 0, 4096)
    backend: str = _setting("auto", check_choice, DIST_BACKENDS)
    master_addr: str = "127.0.0.1"
    master_port: int = _setting(0, check_int, 0, 65535)
    timeout_s: float = _setting(30.0, check_float, 1.0, 3600.0)
    num_servers: int = _setting(1, check_int, 1, 64)

    def __post_init__(self) -> None:
        _check_fields(self, "dist")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            fail("dist.master_addr", self.master_addr, "a host name or IP address")


def _cuda_available() -> str:
    """What CUDA this machine offers, for error messages."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA device (torch.cuda.is_available() is False)"
    n = torch.cuda.device_count()
    return f"this machine has {n} CUDA device{'s' if n > 1 else ''} (cuda:0 … cuda:{n - 1})"


def check_device(cfg: RunConfig) -> None:
    """Refuse a device or backend this machine cannot run, before any rank starts and
    before anything is written.

    Raises:
        ConfigError: ``train.device`` is ``"cuda"`` or ``"cuda:N"`` without CUDA, or N is
            not below the number of GPUs; ``dist.backend = "nccl"`` without CUDA, or
            with ``train.device = "cpu"``. The message names the setting, its value and
            what this machine has.
    """
    device = cfg.train.device
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(
                f"train.device = {device!r} is not allowed: {_cuda_available()}; "
                "expected 'cpu' or 'auto'"
                + (" or a device it has" if torch.cuda.is_available() else "")
            )
    if cfg.runtime == "dist" and cfg.dist.backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"dist.backend = 'nccl' is not allowed: {_cuda_available()}; expected 'gloo' "
                "or 'auto'"
            )
        if device == "cpu":
            raise ConfigError(
                "dist.backend = 'nccl' is not allowed with train.device = 'cpu' (NCCL "
                "carries CUDA tensors only): expected 'gloo' or 'auto'"
            )


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """The torch device ``train.device = setting`` names for the rank with this local
    rank: ``"auto"`` and ``"cuda"`` give ``cuda:<local_rank mod GPUs>`` when CUDA is
    available (``"auto"``: else the CPU), ``"cuda:N"`` gives GPU N, ``"cpu"`` the CPU.
    Unchecked: call :func:`check_device` first."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if ":" in setting:
        return torch.device(setting)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolved_device_setting(setting: str) -> str:
    """``train.device`` with ``"auto"`` resolved to ``"cuda"`` or ``"cpu"`` (the same on
    every rank of a machine): what a run records in its ``config.toml``."""
    if setting != "auto":
        return setting
    return "cuda" if torch.cuda.is_available() else "cpu"


def required_processes(protocol: ProtocolConfig, dist: DistConfig) -> tuple[int, str]:
    """Processes the ``dist`` runtime needs for ``protocol`` and why (see :class:`DistConfig`
    and :meth:`distsgd.layout.ProtocolSpec.processes`)."""
    return spec_for(protocol).processes(protocol, dist)


# Training/test samples and floats per sample of each dataset (synthetic: its settings).
_DATASET_SIZES = {
    "fashion_mnist": (60000, 10000, 784),
    "mnist": (60000, 10000, 784),
    "cifar10": (50000, 10000, 3072),
}
RANK_BASE_MEMORY_BYTES = 512 * 2**20
"""Resident memory of one ``dist`` rank before its dataset: the interpreter with torch and
gloo loaded (about 220 MiB measured on CPU torch), a model, its gradients, optimizer state
and communication buffers, with headroom."""
MAX_PROCESSES_PER_CORE = 4
"""More ranks than this per CPU core time-share the cores so finely that collectives and
parameter-server messages wait on descheduled peers (``dist.timeout_s``) instead of on
work; the tuner's probes are stricter still (at most one per core)."""


def _train_size_and_floats(data: DataConfig) -> tuple[int, int]:
    """(training samples, float32 values held per rank for the train + test sets)."""
    if data.factory:  # the user's data: unknown until loaded
        return 0, 0
    if data.dataset == "synthetic":
        return data.num_train, (data.num_train + data.num_test) * 784
    train, test, floats = _DATASET_SIZES[data.dataset]
    return train, (train + test) * floats


def local_process_limit(cfg: RunConfig) -> tuple[int, str]:
    """The most ``dist`` ranks of ``cfg`` this machine can run, and how it was computed.

    ``min(MAX_PROCESSES_PER_CORE · cores, physical memory // memory per rank)``, where a
    rank holds ``RANK_BASE_MEMORY_BYTES`` plus its own copy of the dataset (float32).
    """
    cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf: cores decide alone
        memory = 0
    per_rank = RANK_BASE_MEMORY_BYTES + 4 * _train_size_and_floats(cfg.data)[1]
    by_cores = MAX_PROCESSES_PER_CORE * cores
    by_memory = memory // per_rank if memory > 0 else by_cores
    why = (
        f"{MAX_PROCESSES_PER_CORE} per CPU core × {cores} cores, and "
        f"{memory / 2**30:.1f} GiB of memory / {per_rank / 2**20:.0f} MiB per rank"
    )
    return max(1, min(by_cores, by_memory)), why


@dataclass(frozen=True)
class LocalRanks:
    """The ranks of a ``dist`` run on this machine, checked against
    :func:`local_process_limit` by :func:`check_local_processes`.

    Attributes:
        count: processes (ranks) the run starts.
        why: what in the layout needs them (:meth:`~distsgd.layout.ProtocolSpec.processes`).
    """

    count: int
    why: str


def check_local_processes(cfg: RunConfig) -> LocalRanks:
    """The ranks of ``cfg`` on this machine; a ``dist`` run whose ranks cannot fit it is
    refused (one machine only; under torchrun the ranks are spread by the launcher).

    Raises:
        ConfigError: the processes the run needs (``dist.num_processes``, or what the
            protocol needs when it is 0) exceed :func:`local_process_limit`; the message
            names the setting, its value and the limit.
    """
    n, why_n = required_processes(cfg.protocol, cfg.dist)
    limit, why_limit = local_process_limit(cfg)
    if n <= limit:
        return LocalRanks(n, why_n)
    if cfg.dist.num_processes:
        key, value, need = "dist.num_processes", cfg.dist.num_processes, ""
    else:  # 0: what the protocol needs
        key, value = "protocol.num_learners", cfg.protocol.num_learners
        need = f"; the run needs {n} processes ({why_n})"
    raise ConfigError(
        f"{key} = {value} is not allowed on this machine: expected at most {limit} "
        f"processes ({why_limit}){need}"
    )


def _epoch_budgets(t: TrainConfig, num_train: int) -> list[tuple[float, str]]:
    """The run's budgets in epochs, each with the setting that sets it: ``max_epochs``,
    and ``max_samples`` where the training set's size is known (``num_train`` > 0)."""
    budgets = []
    if t.max_epochs > 0:
        budgets.append((t.max_epochs, f"train.max_epochs = {t.max_epochs}"))
    if t.max_samples > 0 and num_train > 0:  # 0: the user's data, unknown until loaded
        epochs = t.max_samples / num_train
        samples = f"{epochs:.3g} epochs of {num_train} samples"
        budgets.append((epochs, f"train.max_samples = {t.max_samples} ({samples})"))
    return budgets


def schedule_conflicts(cfg: RunConfig) -> list[str]:
    """Schedule settings the run's epoch budget contradicts, one message each (empty when
    none): a warm-up as long as the budget (the whole run at warm-up rates), a step decay
    at or past it (never reached), a DiLoCo run that ends before its first outer step (its
    evaluated model θ never moves). The budget is the smaller of ``train.max_epochs`` and
    ``train.max_samples`` (in epochs of the dataset); none when both are 0.
    """
    sched = cfg.schedule
    num_train, _ = _train_size_and_floats(cfg.data)
    budgets = _epoch_budgets(cfg.train, num_train)
    if not budgets:
        return []
    budget, which = min(budgets)
    messages = []
    if sched.warmup_epochs >= budget:
        messages.append(
            f"schedule.warmup_epochs = {sched.warmup_epochs} with {which}: the warm-up does "
            "not end before the budget, so the whole run trains at warm-up rates"
        )
    late = [e for e in sched.decay_epochs if e >= budget]
    if sched.kind == "step" and late:
        messages.append(
            f"schedule.decay_epochs = {sched.decay_epochs} with {which}: the decay at "
            f"epoch(s) {late} is never reached"
        )
    p = cfg.protocol
    first_outer = p.average_every * p.num_learners * p.batch_size  # samples to step 1
    if p.name == "diloco" and num_train > 0 and budget * num_train < first_outer:
        messages.append(
            f"protocol.average_every = {p.average_every} with {which}: the run ends before "
            f"DiLoCo's first outer step ({first_outer} samples), so the evaluated model θ "
            "stays the initial weights"
        )
    return messages


def check_schedule(cfg: RunConfig, num_train: int | None = None) -> None:
    """Refuse a schedule whose rates leave [0, ``MAX_LR``] over the run's budget
    (:meth:`ScheduleConfig.check_rates`), before any rank starts or anything is written.

    Args:
        num_train: training samples; None: the built-in data set's (unknown for a
            ``data.factory``, whose budget in samples is then not converted to epochs:
            the first ``MAX_SCHEDULE_CHECK_STEPS`` steps are checked, and again with the
            budget once the data is loaded).

    Raises:
        ConfigError: see :meth:`ScheduleConfig.check_rates`.
    """
    n = num_train if num_train is not None else _train_size_and_floats(cfg.data)[0]
    budgets = _epoch_budgets(cfg.train, n)
    cfg.schedule.check_rates(cfg.optimizer.lr, min(budgets)[0] if budgets else math.inf)


def fit_layout(
    protocol: ProtocolConfig, dist: DistConfig, n: int
) -> tuple[ProtocolConfig, list[str]]:
    """The protocol's layout fitted to ``n`` processes, and the settings that changed.

    Only the number of learners and what must divide it change; the per-learner batch
    size, the learning rate and every other setting are kept (so the global batch λ·b
    changes with λ). Rules, by the process layout of :class:`DistConfig` (each protocol's
    ``fit`` in :mod:`distsgd.layout`):

    * ``hardsync``: λ = n (one learner per process);
    * ``sma`` / ``local_sgd``: n devices of k = ``replicas_per_device`` replicas,
      λ = n·k (Crossbow's k learners per device, docs/protocols.md §4; ``"auto"``: λ = n, the
      run starts at k = 1);
    * ``parameter_server`` / ``compute_groups``: λ = n − ``dist.num_servers``;
      compute groups: g = the largest divisor of the new λ that is <= the old g
      (Omnivore's groups must partition the learners, docs/protocols.md §3); n-softsync: a fully
      asynchronous n = λ stays n = λ, otherwise n = the largest divisor of the new λ
      that is <= the old n (Rudra's n must divide λ, docs/protocols.md §2).

    Args:
        protocol: the configured protocol section.
        dist: the configured dist section (``num_servers`` is read).
        n: processes to fit, >= 1.

    Returns:
        ``(fitted, changes)``: the fitted protocol section (``protocol`` itself when it
        already needs ``n`` processes) and one ``"key old → new"`` entry per changed
        setting, in a fixed order.

    Raises:
        ConfigError: ``dist.num_processes`` cannot fit: protocol ``plain`` with n != 1, or
            n <= ``dist.num_servers`` for the parameter server and compute groups.
    """
    return fitted(protocol, dist, n)


TUNE_FAMILIES = ("hardsync", "compute_groups", "softsync", "sma", "local_sgd", "diloco")
TUNE_DEFAULT_FAMILIES = ("hardsync", "compute_groups", "softsync", "sma")
"""The families ``tune.families`` lists by default (local SGD and DiLoCo when asked)."""
TUNE_STEADY_SHARE = 0.15
"""Share of ``tune.budget_s`` kept for Omnivore's steady state (:mod:`distsgd.tuner.budget`)."""


def _check_list(key: str, value: Any, kind: type, minimum: float, maximum: float) -> None:
    if (
        not isinstance(value, list)
        or not value
        or any(
            not isinstance(v, int | float if kind is float else kind)
            or isinstance(v, bool)
            or not minimum <= v <= maximum
            for v in value
        )
    ):
        what = "integers" if kind is int else "numbers"
        fail(key, value, f"a non-empty list of {what} in [{minimum}, {maximum}]")
    if len(set(value)) != len(value):  # the same probe twice, or a grid point counted twice
        fail(key, value, "a list without repeated values")


@dataclass
class TuneSearchSettings:
    """``[tune]`` settings both tuners read (``distsgd tune`` and ``distsgd train --tune``):
    Omnivore's optimizer (docs/protocols.md §3) and the joint search.

    Attributes:
        probe_seconds: length of every probe, in (0, 1e5]: simulated seconds on the virtual clock of the
            ``sim`` runtime (equal-time probes in simulated time), wall seconds on real
            processes.
        score_window: a probe's score is the mean of its last this many training losses
            (Omnivore: 10), in [1, 1000000].
        lrs: the cold-start learning-rate grid η at g = 1 (Omnivore: 0.1 … 0.0001), each
            in [1e-8, 10].
        momenta: the momentum grid μ for g > 1 and in steady state (Omnivore: 0, .3, .6,
            .9), each in [0, 0.99].
        cold_momentum: μ probed at g = 1 (Omnivore: 0.9), in [0, 0.99].
        max_groups: largest number of compute groups g tried (0: up to λ), in [0, 65536].
        tie_buffer: scores within this relative distance of the best tie, in [0, 1]; ties
            prefer larger η, then larger μ (Omnivore: 1% in steady state).
        he_gain: more groups are accepted only if seconds per iteration improve by at
            least this fraction (Omnivore: 10%), in [0, 1].
        families: protocol families the tuner may probe: ``hardsync``,
            ``compute_groups``, ``softsync`` (n-softsync, parameter server), ``sma`` (k
            replicas per device), ``local_sgd`` and ``diloco`` (averaging every H = 4 or
            16 iterations; DiLoCo with the run's ``protocol.outer_*``; not by default).
            Without ``compute_groups`` Omnivore's grid probes g = 1
            only; its g = 1 (hardsync at the run's batch) is always probed, as the
            search's reference, and may win; the joint search probes the listed families.
        batch_sizes: per-learner batch sizes of the joint search, each in [1, 65536].
        extra_probes: unprobed configurations of the joint search probed, best predicted
            first (0: Omnivore's search only), in [0, 1000].
        noise_scale: B_noise of the batch-size law in samples (0: estimate from probes),
            in [0, 1e12].
    """

    probe_seconds: float = _setting(2.0, check_float, 0.0, 1e5, min_inclusive=False)
    score_window: int = _setting(10, check_int, 1, 1_000_000)
    lrs: list[float] = _setting([0.1, 0.01, 0.001, 0.0001], _check_list, float, 1e-8, 10.0)
    momenta: list[float] = _setting([0.0, 0.3, 0.6, 0.9], _check_list, float, 0.0, 0.99)
    cold_momentum: float = _setting(0.9, check_float, 0.0, 0.99)
    max_groups: int = _setting(0, check_int, 0, 65536)
    tie_buffer: float = _setting(0.01, check_float, 0.0, 1.0)
    he_gain: float = _setting(0.1, check_float, 0.0, 1.0)
    families: list[str] = field(default_factory=lambda: list(TUNE_DEFAULT_FAMILIES))
    batch_sizes: list[int] = _setting([16, 32, 64], _check_list, int, 1, 65536)
    extra_probes: int = _setting(3, check_int, 0, 1000)
    noise_scale: float = _setting(0.0, check_float, 0.0, 1e12)

    def __post_init__(self) -> None:
        _check_fields(self, "tune")  # the fields of the subclasses too
        if (
            not isinstance(self.families, list)
            or not self.families
            or any(f not in TUNE_FAMILIES for f in self.families)
        ):
            fail(
                "tune.families", self.families, "a non-empty list from " + ", ".join(TUNE_FAMILIES)
            )


@dataclass
class OfflineTuneSettings(TuneSearchSettings):
    """``[tune]`` settings only ``distsgd tune`` reads: its wall-clock budget, the long run and
    the learning-rate step search.

    Attributes:
        budget_s: search budget in wall seconds, in (0, 1e7] (``--budget`` overrides it); the search
            stops probing when it is spent and plans with what it has.
        segment_fraction: share of the budget for the long run of the best configuration
            (Omnivore's "run for a long period with snapshots") before steady state; with
            steady state's share (``TUNE_STEADY_SHARE``) it must leave the search a
            positive share: in [0, 0.85).
        step_points: evaluations of the long run from which the tuner first tries a
            learning-rate step to the steady-state η (η/10 when the long run reached the
            target), each by a run to the target from that evaluation's snapshot, before
            it bisects around the soonest; the plan steps at the one that reaches the
            target soonest, in [0, 20] (0: no step search; a long run that stopped before the target
            still tries its end, as Omnivore's steady state does).
        step_margin: an evaluation qualifies as a step point when its test accuracy is at
            least the target minus this margin (and below the target), in (0, 1].
    """

    READ_BY: ClassVar[str] = "``distsgd tune``"
    budget_s: float = _setting(600.0, check_float, 0.0, 1e7, min_inclusive=False)
    segment_fraction: float = _setting(0.35, check_float, 0.0, 0.9)
    step_points: int = _setting(3, check_int, 0, 20)
    step_margin: float = _setting(0.03, check_float, 0.0, 1.0, min_inclusive=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.segment_fraction >= 1 - TUNE_STEADY_SHARE:
            fail(
                "tune.segment_fraction",
                self.segment_fraction,
                f"a number >= 0 and < {1 - TUNE_STEADY_SHARE:g} (steady state takes "
                f"{TUNE_STEADY_SHARE:g} of the budget; the search needs a positive share)",
            )


@dataclass
class OnlineTuneSettings(TuneSearchSettings):
    """``[tune]`` settings only ``distsgd train --tune`` reads: successive halving and steady
    state.

    Attributes:
        first_rung: successive halving (Jamieson &
            Talwalkar, AISTATS 2016; Li et al., Hyperband, JMLR 2018) of each probe round
            (the cold start's Omnivore grid; a steady-state round): every probe first runs
            this fraction of ``probe_seconds``, then the best ``promote`` continue from
            their own checkpoints to ``probe_seconds`` and the best of those wins (1: every
            probe runs ``probe_seconds``, no second rung); in (0, 1]. Default ½: with the
            default ``probe_seconds`` first rungs of 1 s and chains of 2 s
            (docs/benchmarks.md compares other lengths).
        promote: probes of the cold start's first rung that continue to
            the second, in [1, 1000]; the next larger η than the best at g = 1 (that did not diverge)
            continues too where they leave it out (short probes prefer smaller η). The
            joint search's probes are not in the halving: they run the full length, and
            one that leads continues to twice it, as the grid's winner does.
        steady_promote: probes of a steady-state round's first rung that
            continue to the second, in [1, 1000] (1: the best first rung continues as the
            run, no second rung). From a trained model the best first rung has the effective
            rate η / (1 − μ) of the round's winner at the full length; from the initial model
            a smaller batch can lead the first rung and lose the second (hence the joint
            search's probes run the full length; docs/benchmarks.md).
        steady_rounds: steady-state re-optimisations per run at most, in [0, 20] (0:
            none; the cold start's winner trains to the end without checks).
        check_epochs: epochs, in (0, 100], between the run's steady-state checks, and the
            span over which each check asks whether the training loss fell by 10% or
            more (:func:`distsgd.plateau.steady_state_due`; a check at each multiple of it
            since the run's start; it compares with the last evaluation at or before one
            span back, so where iterations do not divide the span and the check before
            fell a few samples past its multiple, with the evaluation before that: up to
            two spans). Default ¼: where one η/10 step gains most on Fashion-MNIST's
            ``cnn`` (docs/benchmarks.md).
    """

    READ_BY: ClassVar[str] = "``distsgd train --tune``"
    first_rung: float = _setting(0.5, check_float, 0.0, 1.0, min_inclusive=False)
    promote: int = _setting(1, check_int, 1, 1000)
    steady_promote: int = _setting(1, check_int, 1, 1000)
    steady_rounds: int = _setting(2, check_int, 0, 20)
    check_epochs: float = _setting(0.25, check_float, 0.0, 100.0, min_inclusive=False)


@dataclass
class TuneConfig(OnlineTuneSettings, OfflineTuneSettings):
    """The ``[tune]`` table: :class:`TuneSearchSettings` (both tuners),
    :class:`OfflineTuneSettings` (``distsgd tune``) and :class:`OnlineTuneSettings`
    (``distsgd train --tune``), one flat table of their keys."""


_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "protocol": ProtocolConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "dist": DistConfig,
    "tune": TuneConfig,
}


@dataclass
class RunConfig:
    """A whole run: every component's config plus the runtime.

    Attributes:
        runtime: ``sim`` (deterministic simulated cluster, one process) or ``dist`` (real
            processes through torch.distributed; see :class:`DistConfig`).
        name: free-form label carried into ``summary.json`` and reports.

    With ``runtime = "dist"`` and ``dist.num_processes`` set, ``protocol`` is the layout
    fitted to that many processes (:func:`fit_layout`) and the attribute
    ``layout_changes`` (not a setting) lists each changed setting as ``"key old → new"``.
    """

    runtime: str = "sim"
    name: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def __post_init__(self) -> None:
        check_choice("runtime", self.runtime, RUNTIMES)
        if not isinstance(self.name, str):
            fail("name", self.name, "a string")
        spec_for(self.protocol).check_optimizer(self.protocol, self.optimizer)
        # The layout is fitted to an explicit process count before anything that depends
        # on λ is checked; ``layout_changes`` lists what changed (empty when it fitted).
        self.layout_changes: list[str] = []
        if self.runtime == "dist" and self.dist.num_processes:
            self.protocol, self.layout_changes = fit_layout(
                self.protocol, self.dist, self.dist.num_processes
            )
        served = spec_for(self.protocol).served_on_dist(self.protocol)
        if self.runtime == "sim" and self.protocol.compression == "powersgd":
            fail(
                "protocol.compression",
                self.protocol.compression,
                "'none', 'bf16' or 'fp16' on runtime 'sim' (PowerSGD runs as torch's DDP "
                "hook on runtime 'dist'; the simulator does not reproduce it)",
            )
        if self.runtime == "dist" and served and self.protocol.compression != "none":
            fail(
                "protocol.compression",
                self.protocol.compression,
                "'none' for a parameter server on runtime 'dist' (its pushes and pulls "
                "travel in float32 there; the simulated cluster rounds them)",
            )
        sf = self.cluster.speed_factors
        if sf and self.protocol.auto_replicas:
            fail(
                "cluster.speed_factors",
                sf,
                "[] with protocol.replicas_per_device = 'auto' (λ changes during the run)",
            )
        computing = self.protocol.num_learners + self.protocol.backup_learners
        if sf and len(sf) != computing:
            backups = " plus protocol.backup_learners" if self.protocol.backup_learners else ""
            fail(
                "cluster.speed_factors",
                sf,
                f"a list of {computing} speeds (one per learner: protocol.num_learners"
                f"{backups}) or []",
            )
        if self.cluster.membership:
            self._check_membership()

    def _check_membership(self) -> None:
        """``cluster.membership`` fits the run: the simulated cluster, an elastic protocol,
        active workers named by each ``leave``, one left at every moment."""
        p, ms = self.protocol, self.cluster.membership
        if self.runtime != "sim":
            fail(
                "cluster.membership",
                ms,
                "[] on runtime 'dist' (a schedule of the simulated cluster)",
            )
        if p.name not in ("parameter_server", "compute_groups") or (
            p.name == "parameter_server" and p.mode == "hardsync"
        ):
            fail(
                "cluster.membership",
                ms,
                "[] with a synchronous protocol (membership changes need "
                "protocol.name = 'parameter_server' in mode 'async' or 'softsync', or "
                "'compute_groups')",
            )
        workers = p.num_groups if p.name == "compute_groups" else p.num_learners
        active = set(range(workers))
        for i, change in enumerate(ms):
            if "join" in change:
                active |= set(range(workers, workers + change["join"]))
                workers += change["join"]
                if workers > 65536:
                    fail(
                        f"cluster.membership[{i}].join",
                        change["join"],
                        f"at most {65536 - workers + change['join']} (65536 workers in all)",
                    )
                continue
            gone = [w for w in change["leave"] if w not in active]
            if gone or len(active) == len(change["leave"]):
                fail(
                    f"cluster.membership[{i}].leave",
                    change["leave"],
                    f"active workers (then {sorted(active)}), leaving at least one",
                )
            active -= set(change["leave"])

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Build from a nested dict (as parsed from TOML). Unknown keys are errors, and so
        is nesting deeper than :data:`MAX_NESTING` (:func:`check_nesting`).

        ``train.target``'s default 0.9 is an accuracy on the built-in tasks: where the
        model, the data or the metric is the user's (a factory or an import path) and no
        ``train.target`` is given, the target is 0 (none: no target is reported or stops
        the run)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a table, got {type(raw).__name__}")
        check_nesting(raw)
        top: dict[str, Any] = {}
        for key, value in raw.items():
            if key in _SECTIONS:
                section_cls = _SECTIONS[key]
                if not isinstance(value, dict):
                    fail(key, value, f"a table [{key}]")
                known = {f.name for f in fields(section_cls)}
                value = {_RENAMED.get((key, sub), sub): v for sub, v in value.items()}
                for sub in value:
                    if sub not in known:
                        raise ConfigError(
                            f"{key}.{sub} is not a setting; known settings of [{key}]: "
                            + ", ".join(sorted(known))
                        )
                try:
                    top[key] = section_cls(**value)
                except TypeError as e:  # pragma: no cover - guarded by the key check
                    raise ConfigError(f"[{key}]: {e}") from None
            elif key in ("runtime", "name"):
                top[key] = value
            else:
                raise ConfigError(
                    f"{key} is not a setting; known: runtime, name, "
                    + ", ".join(f"[{s}]" for s in _SECTIONS)
                )
        train = raw.get("train", {})
        if "target" not in train and _users_own_task(top):  # no target nobody set
            top["train"] = dataclasses.replace(top.get("train", TrainConfig()), target=0.0)
        return cls(**top)

    @classmethod
    def from_toml(
        cls, path: str | Path | None = None, overrides: list[str] | None = None
    ) -> RunConfig:
        """Load ``path`` (None: defaults) and apply ``key=value`` overrides (TOML values).

        Raises:
            ConfigError: unreadable file, bad TOML, unknown key or disallowed value.
        """
        raw = read_toml(path)
        for item in overrides or []:
            apply_override(raw, item)
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_toml(self, *, applicable_only: bool = False) -> str:
        """Serialise to TOML text that :meth:`from_toml` reads back.

        Args:
            applicable_only: write only the settings that apply to this training run (the
                run directory's ``config.toml``): leave out each setting of
                :meth:`unread_settings`, which the run does not read, whatever its value.
                False (default): every setting, so ``from_toml`` gives back an equal
                config (the launcher hands configs to its ranks this way, and tests write
                configs for ``distsgd tune``).

        A setting left out reads back as its default, so ``from_toml(to_toml(cfg,
        applicable_only=True))`` equals ``cfg`` where every unread setting holds its default
        (the usual case) and otherwise differs only in unread settings, which the run never
        looks at; the text written is then a fixed point. A field of value None (TOML has no
        null) is left out when its default is None too. Dict-valued fields (e.g.
        ``[model.kwargs]``) are written as inline tables ``kwargs = {hidden = 64}``.

        Raises:
            TypeError: a value TOML cannot hold (None where the default is not None, or an
                object that is no bool, number, string, list or dict).
        """
        d = self.to_dict()
        unread = self.unread_settings() if applicable_only else frozenset()
        lines = [f"{k} = {_toml_value(d[k])}" for k in ("runtime", "name")]
        for section, section_cls in _SECTIONS.items():
            defaults = _field_defaults(section_cls)
            body = []
            for k, v in d[section].items():
                if f"{section}.{k}" in unread or (v is None and defaults.get(k) is None):
                    continue
                if v is None:
                    raise TypeError(f"cannot write {section}.{k} = None as TOML")
                body.append(f"{_toml_key(k)} = {_toml_value(v)}")
            if body or not applicable_only:
                lines += ["", f"[{section}]", *body]
        return "\n".join(lines) + "\n"

    def unread_settings(self) -> frozenset[str]:
        """The settings (dotted keys) that a training run of this config does not read,
        whatever their values; every other setting, one added later included, is read.

        * ``data.num_train``, ``data.num_test``, ``data.noise``: synthetic data only;
          ``data.root``: file-backed data sets only (unread for ``synthetic``); with a
          ``data.factory``, none of the built-in data set's settings (``dataset`` included),
          without one, not ``factory``, ``kwargs``, ``collate``;
        * ``model.name`` with a ``model.factory``, else ``model.factory``;
        * ``protocol.*``: the settings of other protocols, and those of this protocol's
          other modes (:meth:`distsgd.layout.ProtocolSpec.settings`: n-softsync's ``softsync``
          outside mode ``softsync``, the auto-tuner's ``autotune_*`` unless
          ``replicas_per_device = "auto"``);
        * ``schedule.decay_epochs``, ``schedule.decay_factor``: unless ``kind = "step"``;
          ``schedule.kwargs``, ``schedule.steps_per_epoch``: with a built-in kind;
        * ``optimizer.kwargs`` with ``name = "sgd"``; ``optimizer.momentum`` and
          ``nesterov`` with any other optimizer (they configure SGD only);
        * ``cluster.*``: on the ``dist`` runtime (the simulated cluster's device and
          network; ``summary.json`` echoes the configured profile, nothing uses it);
          ``cluster.seconds_per_replica`` and ``cluster.replica_ratios`` on the ``sim``
          runtime for protocols with one learner per device (k = 1: t(1) alone);
          ``cluster.seconds_per_push`` and ``seconds_per_push_contended`` for protocols
          without a parameter server,
          ``cluster.seconds_per_iteration`` for those with one;
        * ``train.max_virtual_seconds``: on the ``dist`` runtime (no virtual clock);
        * ``dist.*``: on the ``sim`` runtime; ``dist.num_servers`` for protocols without a
          parameter server;
        * ``tune.*``: ``distsgd tune`` reads them, a training run does not.
        """
        unread = {f"tune.{f.name}" for f in fields(TuneConfig)}
        data = self.data
        if data.factory:  # the user's data: no built-in data set's settings
            unread |= {"data.dataset", "data.root", "data.num_train", "data.num_test", "data.noise"}
        else:
            unread |= {"data.factory", "data.kwargs", "data.collate"}
            if data.dataset != "synthetic":
                unread |= {"data.num_train", "data.num_test", "data.noise"}
            else:
                unread.add("data.root")
        unread.add("model.name" if self.model.factory else "model.factory")
        spec = spec_for(self.protocol)
        unread |= {f"protocol.{k}" for k in PROTOCOL_SETTINGS - spec.settings(self.protocol)}
        if self.schedule.kind != "step":
            unread |= {"schedule.decay_epochs", "schedule.decay_factor"}
        if self.schedule.kind in SCHEDULES:
            unread |= {"schedule.kwargs", "schedule.steps_per_epoch"}
        if self.optimizer.name == "sgd":
            unread.add("optimizer.kwargs")
        else:
            unread |= {"optimizer.momentum", "optimizer.nesterov"}
        if self.runtime == "dist":
            unread |= {f"cluster.{f.name}" for f in fields(ClusterConfig)}
            unread.add("train.max_virtual_seconds")
            if not spec.has_server:
                unread.add("dist.num_servers")
        else:
            unread |= {f"dist.{f.name}" for f in fields(DistConfig)}
            if not spec.replicated:
                unread |= {"cluster.seconds_per_replica", "cluster.replica_ratios"}
            if not spec.has_server:
                unread |= {"cluster.seconds_per_push", "cluster.seconds_per_push_contended"}
            else:
                unread.add("cluster.seconds_per_iteration")
        return frozenset(unread)

    def replace(self, **sections: Any) -> RunConfig:
        """A copy with whole sections or top-level fields replaced (validated again)."""
        return dataclasses.replace(self, **sections)


def _users_own_task(sections: dict[str, Any]) -> bool:
    """Whether the model, the data or the metric of these sections is the user's."""
    model, data = sections.get("model"), sections.get("data")
    train = sections.get("train")
    return bool(
        (model is not None and model.factory)
        or (data is not None and data.factory)
        or (train is not None and train.metric not in METRICS)
    )


MAX_NESTING = 32
"""The deepest a config may nest tables and lists (a section is level 1, ``[model.kwargs]``
level 2, each table or list inside a value one more)."""


def check_nesting(raw: Any) -> None:
    """Refuse a config (a nested dict) whose tables and lists go deeper than
    :data:`MAX_NESTING` levels, before anything walks it recursively (a copy, the checks,
    writing ``config.toml``); a table that holds itself is refused alike.

    Raises:
        ConfigError: naming the outermost setting of the deep value.
    """
    stack: list[tuple[Any, int, str]] = [(raw, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_NESTING:
            fail(where, "<nested table or list>", f"at most {MAX_NESTING} levels of nesting")
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list | tuple):
            items = enumerate(value)
        else:
            continue
        for key, v in items:
            name = where if depth >= 2 else (f"{where}.{key}" if where else str(key))
            stack.append((v, depth + 1, name))


_RENAMED: dict[tuple[str, str], str] = {("train", "target_accuracy"): "target"}
"""Settings read under their former names (config.toml of runs written before the rename)."""


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes of quotes, backslashes and control characters
    are TOML's too; DEL, which JSON leaves as it is, is escaped as TOML requires."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007F")


def _toml_key(key: str) -> str:
    """A TOML key: bare when it is letters, digits, ``_`` and ``-`` only, else quoted."""
    if key and all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in key):
        return key
    return _toml_string(key)


def _toml_value(v: Any) -> str:
    """One TOML value: bool, int, float (``inf``/``nan`` too), string, list, or dict as an
    inline table (nested as deep as it goes).

    Raises:
        TypeError: any other object (None included: TOML has no null).
    """
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        if any(not isinstance(k, str) for k in v):
            raise TypeError(f"cannot write {v!r} as TOML: table keys must be strings")
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def _field_defaults(section_cls: type) -> dict[str, Any]:
    """Each field's default value (from ``default_factory`` where it has one)."""
    out: dict[str, Any] = {}
    for f in fields(section_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _parse_toml_value(text: str) -> Any:
    """``text`` as one TOML value. Raises tomllib.TOMLDecodeError (too deep a value too)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise tomllib.TOMLDecodeError(f"nested deeper than {MAX_NESTING} levels") from None


def _override_value(item: str, text: str) -> Any:
    """The value of ``--set item`` (see :func:`apply_override`)."""
    try:
        return _bare_or_toml(text)
    except tomllib.TOMLDecodeError as e:  # it opens a list, table or string
        error = e
    inner = text[1:-1]
    if text.startswith("[") and text.endswith("]") and not any(c in inner for c in "[]{}"):
        words = [w.strip() for w in _split_items(inner)]
        if words[-1] == "":
            words.pop()  # a trailing comma, or []
        if any(not w for w in words):
            raise ConfigError(f"--set {item!r}: a list with an empty item")
        try:
            return [_bare_or_toml(w) for w in words]
        except tomllib.TOMLDecodeError as e:
            error = e
    raise ConfigError(
        f"--set {_shortened(item)!r}: {_shortened(text)!r} is not a TOML value ({error}); "
        'e.g. [1, 2], ["a", "b"], "text"'
    )


def _shortened(text: str, limit: int = 80) -> str:
    """``text``, or its first ``limit`` characters and ``…`` (a message stays one line)."""
    return text if len(text) <= limit else text[:limit] + "…"


def _split_items(inner: str) -> list[str]:
    """The items of a flat list's inside, split at the commas outside quotes."""
    items, start, quote, escaped = [], 0, "", False
    for i, c in enumerate(inner):
        if quote:
            if escaped:
                escaped = False
            elif c == "\\" and quote == '"':  # TOML's escapes: basic strings only
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == ",":
            items.append(inner[start:i])
            start = i + 1
    return [*items, inner[start:]]


def _bare_or_toml(word: str) -> Any:
    """A TOML value, else (a bare word) the string itself; raises
    ``tomllib.TOMLDecodeError`` for text that opens a list, table or string."""
    try:
        return _parse_toml_value(word)
    except tomllib.TOMLDecodeError:
        if word[:1] in ("[", "{", '"', "'"):
            raise
        return word


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The raw config dict of the TOML file ``path`` (None: ``{}``, the defaults).

    Raises:
        ConfigError: the file is missing, unreadable, not UTF-8 or not valid TOML, or nests
            deeper than :data:`MAX_NESTING` can be read.
    """
    if path is None:
        return {}
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(
            f"config file {str(p)!r} is not allowed: its tables and lists are nested "
            f"too deep to read; expected at most {MAX_NESTING} levels"
        ) from None
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(p)!r} is a directory, not a TOML file") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` override to a raw config dict in place.

    The value is parsed as TOML (``0.1``, ``true``, ``[1, 2]``, ``"text"``); a bare word
    that is not valid TOML is taken as a string (``protocol.name=sma``), and so is each bare
    word of a flat list (``tune.families=[hardsync, sma]``, as a shell leaves
    ``'["hardsync", "sma"]'`` without its quotes).

    Raises:
        ConfigError: the item has no ``=`` or an empty key, or its value opens a list or a
            table (``[``, ``{``) or a quoted string but is not TOML.
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optimizer.lr=0.05")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optimizer.lr=0.05")
    set_setting(raw, key, _override_value(item, text.strip()), f"--set {item!r}")


def set_setting(raw: dict[str, Any], key: str, value: Any, given: str) -> None:
    """Set ``key`` (``section.key``) of a raw config dict to ``value`` in place.

    Raises:
        ConfigError: a part of ``key`` names a value, not a section (the message starts
            with ``given``, what the user typed).
    """
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{given}: {part} is not a section")
        node = nxt
    node[parts[-1]] = value
