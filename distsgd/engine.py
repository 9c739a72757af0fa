"""Gradient and evaluation maths on flat parameter vectors.

:class:`GradientEngine` owns one ``nn.Module`` whose parameters are views into a single
contiguous buffer of P float32 values, and whose gradients land in a second buffer of the
same layout (with ``train.memory_format = "channels_last"``, convolution kernels of more
than one input channel are copies in NHWC order, see :class:`GradientEngine`). Computing a learner's gradient at weights ``w`` is then one copy into the
buffer, one forward/backward, and one copy out: no per-parameter Python loop on the hot
path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.data import Subset

from distsgd.batched import (
    PATHS,
    choose_path,
    explicit_replica_gradients,
    functional_replica_gradients,
    supports,
    vmap_replica_gradients,
)
from distsgd.config import (
    COMPILE_MODES,
    MEMORY_FORMATS,
    ConfigError,
    ConfigWarning,
    RunConfig,
    resolve_device,
    resolved_device_setting,
)
from distsgd.data import DEFAULT_ROOTS, Dataset, MapSplit, Split, TensorSplit, resolve_root
from distsgd.factories import USER_CODE_FAILURES, resolve_callable
from distsgd.models import CNN, LeNet, model_from_config, with_data_shape
from distsgd.objectives import LOSSES, METRICS, Loss, Metric, build_loss, build_metric

__all__ = [
    "GradientEngine",
    "UserCode",
    "build_engine",
    "check_on_data",
    "check_user_code",
    "config_for_data",
    "bn_recalibration_indices",
    "bn_recalibration_inputs",
    "eval_subset",
    "eval_subset_indices",
    "first_line",
    "resolve_memory_format",
]

# Offset of the recalibration slice's generator from ``train.seed`` (any fixed number: the
# slice must be the same on every runtime, rank and protocol for the same seed).
_RECALIBRATION_SEED_OFFSET = 0x5EED_BA7C


# Offset of the evaluation subset's generator from ``train.seed`` (any fixed number other
# than the recalibration's: the subset must be the same on every runtime and rank layout).
_EVAL_SUBSET_SEED_OFFSET = 0xE7A1_5E75


def eval_subset_indices(num_test: int, num_samples: int, seed: int) -> Tensor | None:
    """Evaluation-set indices of the subset that intermediate evaluations score
    (``train.eval_samples``).

    The first n = ``num_samples`` of a permutation of ``range(num_test)`` drawn from a
    ``torch.Generator`` seeded with ``seed + 0xE7A15E75``, sorted: a fixed, seeded subset,
    the same at every evaluation of a run, on every runtime and rank layout, and after a
    resume (it depends on nothing else).

    Args:
        num_test: evaluation samples (>= 1).
        num_samples: ``train.eval_samples`` (>= 0; 0: the whole set).
        seed: ``train.seed``.

    Returns:
        int64 indices, shape ``[n]``, distinct and increasing, in ``[0, num_test)``; None
        when the subset is the whole set (``num_samples`` 0 or >= ``num_test``).
    """
    if num_samples <= 0 or num_samples >= num_test:
        return None
    g = torch.Generator().manual_seed(seed + _EVAL_SUBSET_SEED_OFFSET)
    return torch.randperm(num_test, generator=g)[:num_samples].sort().values


def eval_subset(split: Split, num_samples: int, seed: int) -> Split:
    """The evaluation subset of ``split`` (:func:`eval_subset_indices`) as a split of its
    own, built once per run: the tensors' rows gathered (:class:`TensorSplit`, a copy of
    n samples) or a ``torch.utils.data.Subset`` view (:class:`MapSplit`, items read when
    evaluated); ``split`` itself when the subset is the whole set."""
    idx = eval_subset_indices(split.num_samples, num_samples, seed)
    if idx is None:
        return split
    if isinstance(split, TensorSplit):
        return TensorSplit(split.x[idx], split.y[idx])
    if isinstance(split, MapSplit):
        return MapSplit(Subset(split.dataset, idx.tolist()), split.collate, split.setting)
    return TensorSplit(*split.batch(idx))  # another Split: its samples, gathered once


def bn_recalibration_indices(
    num_train: int, num_samples: int, batch_size: int, seed: int
) -> Tensor:
    """Training-set indices of the slice over which BatchNorm statistics are recomputed.

    The first n of a permutation of ``range(num_train)`` drawn from a ``torch.Generator``
    seeded with ``seed + 0x5EEDBA7C``, n = ``min(num_samples, num_train)`` rounded down to
    a multiple of B = ``min(batch_size, n)`` so that every batch of the recalibration
    holds B samples (then the mean of the batch means is the mean over the slice).

    Args:
        num_train: N, training samples (>= 1).
        num_samples: ``train.bn_recalibration_samples`` (>= 1).
        batch_size: ``train.eval_batch_size`` (>= 1).
        seed: ``train.seed``.

    Returns:
        int64 indices, shape ``[n]``, distinct, in ``[0, N)``.
    """
    n = min(num_samples, num_train)
    n -= n % min(batch_size, n)
    g = torch.Generator().manual_seed(seed + _RECALIBRATION_SEED_OFFSET)
    return torch.randperm(num_train, generator=g)[:n]


def bn_recalibration_inputs(
    dataset: Dataset, num_samples: int, batch_size: int, seed: int
) -> tuple[Tensor, int]:
    """The recalibration slice's inputs ``[n, ...]`` (a copy) and its batch size
    ``min(batch_size, n)``; see :func:`bn_recalibration_indices`."""
    idx = bn_recalibration_indices(dataset.num_train, num_samples, batch_size, seed)
    return dataset.train.batch(idx)[0], min(batch_size, idx.numel())


@dataclass(frozen=True)
class UserCode:
    """The user's objects in place of the config's import paths (the simulated runtime
    in one process only: a closure cannot reach another process). None: the config's.

    Attributes:
        model: called as ``model(**model.kwargs)`` → ``nn.Module``.
        data: called as ``data(**data.kwargs)`` → ``(train, eval)``.
        loss: ``(outputs, targets)`` → scalar tensor.
        metric: ``(outputs, targets)`` → the batch's mean value.
    """

    model: Callable[..., nn.Module] | None = None
    data: Callable[..., Any] | None = None
    loss: Callable[[Tensor, Tensor], Tensor] | None = None
    metric: Callable[[Tensor, Tensor], Any] | None = None

    @property
    def any(self) -> bool:
        """True when some object replaces an import path."""
        return any(v is not None for v in (self.model, self.data, self.loss, self.metric))


def check_user_code(cfg: RunConfig) -> None:
    """Resolve every import path ``cfg`` names (model and data factories, collate, loss,
    metric) without calling them: the launcher does this before it starts any rank, so
    that a path that does not import is one line, not one failure per process.

    Raises:
        ConfigError: a path does not import or names no callable.
    """
    t = cfg.train
    paths = {
        "model.factory": cfg.model.factory,
        "data.factory": cfg.data.factory,
        "data.collate": cfg.data.collate,
        "train.loss": "" if t.loss in LOSSES else t.loss,
        "train.metric": "" if t.metric in METRICS else t.metric,
    }
    for setting, path in paths.items():
        if path:
            resolve_callable(setting, path)


def first_line(e: BaseException) -> str:
    """``"<ExceptionType>: <first line of its message>"``, for one-line errors."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_on_data(
    engine: GradientEngine, dataset: Dataset, cfg: RunConfig, code: UserCode | None = None
) -> None:
    """Run the model, the loss and the metric once on two training samples and two
    evaluation samples (evaluation mode, no gradient), then one training step (training
    mode, forward, loss and backward) on a batch of ``protocol.batch_size`` training
    samples, so that a model, loss or metric that does not fit the data fails here, in one
    line naming its setting, before the device is calibrated or the run writes anything.
    The model's buffers (BatchNorm statistics) and the random generators are left as they
    were.

    Raises:
        ConfigError: the forward raises or returns something other than a tensor; the
            model gives fewer outputs than the labels have classes (``cross_entropy``);
            the loss raises, is not a scalar, or (``mse``, ``bce_with_logits``) gets
            outputs and targets of different shapes; the metric raises or is not a number;
            the training step raises.
    """
    if code is not None and code.model is not None:
        model = f"the model (a {type(engine.model).__qualname__} object)"
    elif cfg.model.factory:
        model = f"model.factory = {cfg.model.factory!r}"
    else:
        model = f"model.name = {cfg.model.name!r}"
    loss_name, metric_name = engine.loss.name, engine.metric.name
    modes = [(m, m.training) for m in engine.model.modules()]
    engine.model.eval()
    try:
        with torch.no_grad():
            for split in (dataset.train, dataset.test):
                x, y = engine.to_device(*split.batch(torch.arange(min(2, split.num_samples))))
                try:
                    out = engine.model(x)
                except USER_CODE_FAILURES as e:  # the user's forward on the data
                    raise ConfigError(
                        f"{model}: its forward on a batch of the data (inputs "
                        f"{list(x.shape)} {x.dtype}) raised {first_line(e)}"
                    ) from None
                if not isinstance(out, Tensor):
                    raise ConfigError(
                        f"{model}: its forward returned a {type(out).__name__}, expected "
                        "one tensor of outputs (e.g. return the logits alone)"
                    )
                if loss_name in ("mse", "bce_with_logits") and out.shape != y.shape:
                    raise ConfigError(
                        f"train.loss = {loss_name!r} needs outputs and targets of one shape: "
                        f"the model gives {list(out.shape)}, the data {list(y.shape)} "
                        "(reshape one of them, or choose another loss)"
                    )
                try:
                    value = float(engine.loss.chunk_means(out, y, 1)[0])
                except ConfigError:
                    raise
                except USER_CODE_FAILURES as e:  # the loss on these outputs/targets
                    raise ConfigError(
                        f"train.loss = {loss_name!r} on outputs {list(out.shape)} "
                        f"{out.dtype} and targets {list(y.shape)} {y.dtype} raised "
                        f"{first_line(e)}"
                    ) from None
                if not math.isfinite(value):
                    raise ConfigError(
                        f"train.loss = {loss_name!r} is {value} on the untrained model's "
                        f"outputs {list(out.shape)} and targets {list(y.shape)} {y.dtype}, "
                        "before any update: check the loss function and the data"
                    )
                try:
                    engine.metric.batch_sum(out, y)
                except ConfigError:
                    raise
                except USER_CODE_FAILURES as e:  # the user's metric
                    raise ConfigError(
                        f"train.metric = {metric_name!r} on outputs {list(out.shape)} and "
                        f"targets {list(y.shape)} {y.dtype} raised {first_line(e)}"
                    ) from None
        _check_classes(model, out, dataset, loss_name)
        _check_training_step(engine, dataset, cfg, model)
    finally:
        for m, training in modes:
            m.training = training


def _check_classes(model: str, out: Tensor, dataset: Dataset, loss_name: str) -> None:
    """Cross-entropy needs an output per class: compare the model's outputs ``[B, K]``
    with the labels' class count (:meth:`Dataset.class_count`: built-in data, integer
    label tensors, a map-style data set's ``targets``)."""
    classes = dataset.class_count()
    if loss_name != "cross_entropy" or classes is None or out.dim() != 2:
        return
    if out.shape[1] < classes:
        raise ConfigError(
            f"{model}: it gives {out.shape[1]} outputs per sample but the labels of the data "
            f"go up to {classes - 1}: train.loss = 'cross_entropy' needs one output per "
            f"class, {classes} here"
        )


def _check_training_step(
    engine: GradientEngine, dataset: Dataset, cfg: RunConfig, model: str
) -> None:
    """One gradient at the initial weights on the first ``protocol.batch_size`` training
    samples, its buffers and random numbers undone (see :func:`check_on_data`)."""
    b = min(cfg.protocol.batch_size, dataset.train.num_samples)
    x, y = dataset.train.batch(torch.arange(b))
    buffers = engine.buffers_state()
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            engine.gradient(engine.initial_weights(), x, y)
        except ConfigError:
            raise
        except USER_CODE_FAILURES as e:  # the user's model, loss or backward
            raise ConfigError(
                f"{model}: a training step (training mode: forward, train.loss and backward) "
                f"on a batch of protocol.batch_size = {b} samples (inputs {list(x.shape)} "
                f"{x.dtype}) raised {first_line(e)}"
            ) from None
        finally:
            engine.load_buffers_state(buffers)


def build_engine(cfg: RunConfig, code: UserCode | None = None) -> GradientEngine:
    """The engine of ``cfg``'s model (built from torch's global generator: seed it first),
    loss and metric; ``code``'s objects replace the config's import paths.

    Raises:
        ConfigError: a factory, loss or metric does not resolve, fails or returns the
            wrong type.
    """
    code = code or UserCode()
    t = cfg.train
    model = model_from_config(cfg.model, code.model)
    if not any(p.requires_grad for p in model.parameters()):
        setting = f"model.factory = {cfg.model.factory!r}" if cfg.model.factory else "the model"
        raise ConfigError(
            f"{setting}: the model has no trainable parameters (nothing to train); give it "
            "parameters with requires_grad = True"
        )
    return GradientEngine(
        model,
        build_loss(code.loss or t.loss),
        build_metric(code.metric or t.metric, t.metric_direction),
        device=resolve_device(t.device, int(os.environ.get("LOCAL_RANK", "0"))),
        precision=t.precision,
        compile=t.compile,
        memory_format=t.memory_format,
    )


def config_for_data(cfg: RunConfig, dataset: Dataset, code: UserCode | None = None) -> RunConfig:
    """``cfg`` completed from its loaded data, so that the run's ``config.toml``
    reproduces it anywhere: a built-in file data set's resolved ``data.root``, a built-in
    model's ``input_shape`` and ``num_classes`` (:func:`~distsgd.models.with_data_shape`),
    ``train.device = "auto"`` resolved (:func:`~distsgd.config.resolved_device_setting`), a
    relative ``cluster.profile`` made absolute (a resume from another directory finds it).

    Raises:
        ConfigError: a built-in model needs ``num_classes`` and the data does not say it.
    """
    code = code or UserCode()
    device = resolved_device_setting(cfg.train.device)
    if device != cfg.train.device:
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, device=device))
    if not cfg.data.factory and code.data is None and cfg.data.dataset in DEFAULT_ROOTS:
        if not cfg.data.root:
            cfg = cfg.replace(data=dataclasses.replace(cfg.data, root=str(resolve_root(cfg.data))))
    profile = cfg.cluster.profile
    if profile and not Path(profile).expanduser().is_absolute():
        absolute = str(Path(profile).expanduser().resolve())
        cfg = cfg.replace(cluster=dataclasses.replace(cfg.cluster, profile=absolute))
    if not cfg.model.factory and code.model is None:
        data = f"data.factory = {cfg.data.factory!r}" if cfg.data.factory else "this data"
        model = with_data_shape(cfg.model, dataset.input_shape, dataset.class_count(), data)
        cfg = cfg.replace(model=model)
    return cfg


def _channels_last(t: Tensor) -> Tensor:
    """A 4-D NCHW tensor ``t`` with channels-last (NHWC) strides: a view of ``t`` re-strided
    where both orders are the same memory (one channel, or one pixel: a first
    convolution's kernel on grey images), else a copy. Re-striding matters: oneDNN picks
    its layout from the strides, and NCHW strides of a one-channel kernel make it run the
    whole first layer (its largest activations) in NCHW."""
    n, c, h, w = t.shape
    if c == 1 or h * w == 1:
        return t.as_strided(t.shape, (c * h * w, 1, w * c, c))
    return t.contiguous(memory_format=torch.channels_last)


def resolve_memory_format(setting: str, model: nn.Module) -> str:
    """``train.memory_format = setting`` resolved for ``model``: ``"contiguous"`` or
    ``"channels_last"`` as given; ``"auto"``: channels_last for the built-in ``cnn`` and
    ``lenet`` (:class:`~distsgd.models.CNN`, :class:`~distsgd.models.LeNet`), contiguous
    for every other model. A user's model stays contiguous unless asked: channels-last
    activations are not contiguous tensors, so a forward that calls ``.view`` on them
    (a common way to flatten) fails. ``resnet20`` stays contiguous: its float32
    gradients are less accurate in channels-last on torch's CPU kernels (float64 agrees
    in both layouts). Speed and accuracy of each layout: docs/benchmarks.md. See
    :class:`~distsgd.config.TrainConfig`.

    Raises:
        ValueError: ``setting`` is not one of ``MEMORY_FORMATS``.
    """
    if setting not in MEMORY_FORMATS:
        raise ValueError(
            f"memory_format = {setting!r} is not allowed: expected one of "
            + ", ".join(repr(m) for m in MEMORY_FORMATS)
        )
    if setting != "auto":
        return setting
    return "channels_last" if type(model) in (CNN, LeNet) else "contiguous"


class GradientEngine:
    """Gradients of the mean training loss of ``model`` at arbitrary flat weights, and
    evaluations of its metric.

    Args:
        model: any ``nn.Module`` mapping a batch of inputs (leading dimension B) to
            outputs the loss takes (e.g. logits ``[B, K]``). Its
            parameters are re-pointed into one flat buffer; buffers (e.g. BatchNorm running
            statistics) stay with the module and are shared by every caller. The running
            statistics that training forwards leave behind belong to no model in
            particular (every learner's forwards update them, at its own weights): an
            evaluation that needs them recomputes them first (:meth:`recalibrate`).
        loss: the training loss (:func:`distsgd.objectives.build_loss`); None: the mean
            cross-entropy.
        metric: the evaluation metric (:func:`distsgd.objectives.build_metric`); None:
            accuracy.
        device: where the model and the flat buffers live (the model is moved there);
            batches are moved there as they arrive (:meth:`to_device`), and returned
            gradients live there.
        precision: ``"fp32"``, or ``"bf16-mixed"``: training forwards and the loss run
            under ``torch.autocast(device.type, torch.bfloat16)``; the flat weights and
            gradients stay float32.
        compile: ``train.compile``: ``"on"`` runs :meth:`gradient`'s forward (and so its
            backward, through AOTAutograd) compiled by ``torch.compile(..., dynamic=False)``
            (inductor; a function of the flat weights, :meth:`_functional_forward`): one compilation per input shape, and training minibatches all
            have b samples (the sampler never yields a partial batch), so it compiles
            once per b (plus once per fused λ·b and per calibration batch size). Where
            compilation fails, one :class:`~distsgd.config.ConfigWarning` and the eager
            forward from then on. ``"reduce-overhead"``: the same compiled with
            ``mode="reduce-overhead"`` (CUDA graphs of inductor's kernels on a GPU), and
            :meth:`replica_gradients`' ``grouped`` and ``bmm`` paths compiled whole
            (:func:`distsgd.batched.functional_replica_gradients`), with the same
            fallback. ``"off"``: eager.
        memory_format: ``train.memory_format`` (:func:`resolve_memory_format`). With
            ``"channels_last"`` every 2-D convolution's kernel (no other parameter) takes
            NHWC strides: a one-channel kernel stays a view of the flat buffer, re-strided
            (the same memory in both orders); any other gets storage of its own in that
            layout, and its gradient too, copied from the flat weights before each
            forward and into the flat gradient after each backward (72 KB for the
            ``cnn``). The flat buffers keep NCHW order, so ``[P]`` vectors mean the same
            in both layouts.

    Attributes:
        num_parameters: P.
        device: the ``torch.device`` of the model and the flat buffers.
        memory_format: the resolved layout, ``"contiguous"`` or ``"channels_last"``.

    Raises:
        ValueError: ``compile`` is not one of ``COMPILE_MODES``, or ``memory_format``
            not one of ``MEMORY_FORMATS``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: Loss | None = None,
        metric: Metric | None = None,
        device: torch.device | str = "cpu",
        precision: str = "fp32",
        compile: str = "off",
        memory_format: str = "auto",
    ) -> None:
        if compile not in COMPILE_MODES:
            raise ValueError(
                f"compile = {compile!r} is not allowed: expected one of "
                + ", ".join(repr(c) for c in COMPILE_MODES)
            )
        self.device = torch.device(device)
        self.precision = precision
        self.memory_format = resolve_memory_format(memory_format, model)
        self.model = model.to(self.device)
        self.loss = loss or build_loss("cross_entropy")
        self.metric = metric or build_metric("accuracy")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no trainable parameters")
        with torch.no_grad():
            self._flat = torch.cat([p.detach().reshape(-1) for p in params]).contiguous()
        self._grad = torch.zeros_like(self._flat)
        offset = 0
        self._slices: dict[int, tuple[int, int]] = {}  # id(parameter) -> its [start, end)
        # channels-last parameters with storage of their own: (parameter, its weights and
        # its gradient as NCHW views of the flat buffers)
        self._own_storage: list[tuple[Tensor, Tensor, Tensor]] = []
        self._nhwc: set[int] = set()  # id() of the parameters laid out channels-last
        # the 2-D convolutions' kernels: what channels_last lays out (no other 4-D tensor)
        kernels = {id(m.weight) for m in model.modules() if isinstance(m, nn.Conv2d)}
        for p in params:
            n = p.numel()
            self._slices[id(p)] = (offset, offset + n)
            weights = self._flat[offset : offset + n].view_as(p)
            grad = self._grad[offset : offset + n].view_as(p)
            if self.memory_format == "channels_last" and id(p) in kernels:
                self._nhwc.add(id(p))
                p.data, p.grad = _channels_last(weights), _channels_last(grad)
                if p.data_ptr() != weights.data_ptr():  # copies: NHWC differs from NCHW
                    self._own_storage.append((p, weights, grad))
            else:
                p.data, p.grad = weights, grad
            offset += n
        self.num_parameters = offset
        # torch.compile is lazy: nothing is compiled before the first gradient
        self.compile = compile
        options = {"mode": "reduce-overhead"} if compile == "reduce-overhead" else {}
        self._compiled: Callable[[Tensor, Tensor], Tensor] | None = (
            torch.compile(self._functional_forward(params), dynamic=False, **options)
            if compile != "off"
            else None
        )
        # the batched replica gradients, compiled on first use ("reduce-overhead" only)
        self._compiled_replicas: Callable[..., tuple[Tensor, Tensor]] | None = (
            torch.compile(functional_replica_gradients, dynamic=False, **options)
            if compile == "reduce-overhead"
            else None
        )

    def _load(self, weights: Tensor) -> None:
        """Point the model at ``weights`` ``[P]``: the flat buffer, then the parameters
        with storage of their own."""
        with torch.no_grad():
            self._flat.copy_(weights)
            for p, view, _ in self._own_storage:
                p.copy_(view)

    def _zero_grad(self) -> None:
        self._grad.zero_()
        for p, _, _ in self._own_storage:
            if p.grad is None:  # a wrapper set it to None
                p.grad = torch.zeros_like(p, memory_format=torch.channels_last)
            else:
                p.grad.zero_()

    def _flat_gradient(self) -> Tensor:
        """A copy of the model's gradient as ``[P]``."""
        for p, _, view in self._own_storage:
            view.copy_(p.grad)
        return self._grad.clone()

    def _functional_forward(self, params: list[Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        """``(weights [P], x) → outputs`` with the parameters as views of ``weights``: what
        is compiled. One graph input for all parameters: compiling the module itself
        would see its parameters as P-sharing views of one buffer, an aliasing that
        AOTAutograd's synthetic-base handling turned into wrong convolution gradients
        (torch 2.13, tests/test_speed_paths.py)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        nhwc = self._nhwc
        layout = [(names[id(p)], self._slices[id(p)], p.shape, id(p) in nhwc) for p in params]
        model = self.model

        def forward(weights: Tensor, x: Tensor) -> Tensor:
            views = {
                name: _channels_last(weights[a:b].view(shape))
                if channels_last
                else weights[a:b].view(shape)
                for name, (a, b), shape, channels_last in layout
            }
            return functional_call(model, views, (x,))

        return forward

    @property
    def compiled(self) -> bool:
        """True while :meth:`gradient` runs the compiled forward/backward (``compile =
        "on"`` and no compilation has failed)."""
        return self._compiled is not None

    def initial_weights(self) -> Tensor:
        """A copy of the model's initial parameters, shape ``[P]``, on :attr:`device`."""
        return self._flat.clone()

    def to_device(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        """``tensors`` on :attr:`device` (the same tensors when they are there already)."""
        return tuple(t.to(self.device, non_blocking=True) for t in tensors)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The training forward's precision context: bfloat16 autocast for
        ``"bf16-mixed"``, nothing for ``"fp32"`` (bit for bit as without it)."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def gradient(
        self,
        weights: Tensor,
        x: Tensor,
        y: Tensor,
        num_chunks: int = 1,
        module: nn.Module | None = None,
    ) -> tuple[Tensor, list[float]]:
        """Gradient of the mean training loss over the minibatch at ``weights``.

        With ``num_chunks = m`` the minibatch is the concatenation of m learners' equal
        minibatches that share ``weights``: the gradient of the mean over all samples is
        exactly the mean of their m gradients (what an all-reduce of their gradients
        gives), and each learner's own mean loss is returned.

        Args:
            weights: shape ``[P]``.
            x: inputs ``[B, ...]``; y: targets ``[B, ...]``; B divisible by m.
            num_chunks: m >= 1.
            module: run the forward/backward through this wrapper of the engine's model
                instead (e.g. ``DistributedDataParallel(engine.model)``, whose backward
                all-reduces the gradient into the same buffer).

        Returns:
            (gradient ``[P]`` — a new tensor, the m chunk losses as Python floats).
        """
        x, y = self.to_device(x, y)
        if module is None and self._compiled is not None:
            try:
                return self._compiled_gradient(self._compiled, weights, x, y, num_chunks)
            except Exception as e:  # noqa: BLE001 - any failure of torch.compile's stack
                self._compiled = None
                warnings.warn(
                    f"train.compile = {self.compile!r}: compiling the model failed "
                    f"({first_line(e)}); "
                    "computing gradients eagerly instead",
                    ConfigWarning,
                    stacklevel=2,
                )
        return self._forward_backward(module or self.model, weights, x, y, num_chunks)

    def _compiled_gradient(
        self,
        forward: Callable[[Tensor, Tensor], Tensor],
        weights: Tensor,
        x: Tensor,
        y: Tensor,
        num_chunks: int,
    ) -> tuple[Tensor, list[float]]:
        w = weights.detach().requires_grad_()
        self.model.train()
        with self.autocast():
            total, chunk_losses = self.loss.chunk_means(forward(w, x), y, num_chunks)
        (grad,) = torch.autograd.grad(total, w)
        return grad, chunk_losses.tolist()

    def _forward_backward(
        self, forward: nn.Module, weights: Tensor, x: Tensor, y: Tensor, num_chunks: int
    ) -> tuple[Tensor, list[float]]:
        self._load(weights)
        self._zero_grad()
        self.model.train()
        with self.autocast():
            total, chunk_losses = self.loss.chunk_means(forward(x), y, num_chunks)
        total.backward()
        return self._flat_gradient(), chunk_losses.tolist()

    def replica_gradients(
        self, weights: Tensor, x: Tensor, y: Tensor, path: str = "auto"
    ) -> tuple[Tensor, list[float]]:
        """Gradients of k replicas, each at its own weights on its own minibatch.

        This is the hot path of "several learners per device" (Crossbow, docs/protocols.md §4): SMA
        and local SGD replicas call it once per iteration for all replicas they hold, and
        it computes them as one batched forward/backward where that is faster (see
        :mod:`distsgd.batched`: grouped convolutions for ``cnn``, batched matrix products
        for ``mlp``, ``torch.func.vmap`` for other models, one-by-one for models with
        BatchNorm or Dropout).

        Args:
            weights: shape ``[k, P]``; row j is replica j's weights.
            x: inputs ``[k, b, C, H, W]``; y: labels ``[k, b]`` (int64).
            path: ``"auto"`` (:func:`distsgd.batched.choose_path`), ``"loop"``,
                ``"grouped"``, ``"bmm"`` or ``"vmap"``.

        Returns:
            (gradients ``[k, P]`` — a new tensor, row j of the mean cross-entropy over
            replica j's minibatch; the k losses as Python floats). The batched paths equal
            the loop up to float32 summation order.

        Raises:
            ValueError: ``path`` unknown or not applicable to the model.
        """
        x, y = self.to_device(x, y)
        k, b = y.shape[:2]
        if path == "auto":  # the batched paths compute the built-in cross-entropy
            path = choose_path(self.model, k, b) if self.loss.name == "cross_entropy" else "loop"
        elif path not in PATHS or not supports(self.model, path):
            raise ValueError(
                f"path = {path!r} is not allowed for {type(self.model).__name__}: expected "
                + ", ".join(repr(p) for p in PATHS if p == "auto" or supports(self.model, p))
            )
        if path in ("grouped", "bmm"):
            self.model.train()
            with self.autocast():
                grads, loss_t = self._batched_gradients(weights, x, y, path)
            return grads, loss_t.tolist()
        if path == "vmap":
            self.model.train()
            with self.autocast():
                grads, loss_t = vmap_replica_gradients(self.model, weights, x, y)
            return grads, loss_t.tolist()
        grads = torch.empty(k, self.num_parameters, dtype=weights.dtype, device=self.device)
        losses: list[float] = []
        for j in range(k):
            grads[j], loss = self.gradient(weights[j], x[j], y[j])
            losses.extend(loss)
        return grads, losses

    def _batched_gradients(
        self, weights: Tensor, x: Tensor, y: Tensor, path: str
    ) -> tuple[Tensor, Tensor]:
        """The ``grouped`` / ``bmm`` path, compiled where ``compile = "reduce-overhead"``
        (its outputs copied out of the CUDA graphs' memory, which the next call reuses)."""
        if self._compiled_replicas is not None:
            try:
                grads, losses = self._compiled_replicas(self.model, weights, x, y, path)
                return grads.clone(), losses.clone()
            except Exception as e:  # noqa: BLE001 - any failure of torch.compile's stack
                self._compiled_replicas = None
                warnings.warn(
                    f"train.compile = {self.compile!r}: compiling the batched replica "
                    f"gradients failed ({first_line(e)}); computing them eagerly instead",
                    ConfigWarning,
                    stacklevel=3,
                )
        return explicit_replica_gradients(self.model, weights, x, y, path)

    @property
    def has_batch_statistics(self) -> bool:
        """True when the model has layers whose output depends on the whole minibatch
        (BatchNorm): then learners sharing weights cannot be fused into one batch."""
        return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in self.model.modules())

    @property
    def has_running_statistics(self) -> bool:
        """True when the model has normalisation layers that evaluate with running
        statistics (BatchNorm with ``track_running_stats``): :meth:`recalibrate` sets them."""
        return bool(self._running_statistics_layers())

    @property
    def evaluates_with_batch_statistics(self) -> bool:
        """True when some normalisation layer keeps no running statistics, so that it
        normalises with its batch's statistics at evaluation too: then an evaluation
        depends on how the test set is cut into batches."""
        return any(
            isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is None
            for m in self.model.modules()
        )

    def _running_statistics_layers(self) -> list[nn.modules.batchnorm._NormBase]:
        return [
            m
            for m in self.model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase)
            and m.track_running_stats
            and m.running_mean is not None
            and m.running_var is not None
        ]

    @torch.no_grad()
    def batch_statistics_sums(self, weights: Tensor, x: Tensor, batch_size: int) -> Tensor:
        """Sums over the batches of ``x`` of every BatchNorm layer's batch statistics at
        ``weights``: the part of :meth:`recalibrate` that ranks can share.

        Each batch of ``batch_size`` consecutive samples goes through a forward with the
        BatchNorm layers in training mode (every other layer, e.g. Dropout, as at
        evaluation, so the forward draws no random numbers) and momentum 1, which leaves
        that batch's mean and unbiased variance in the running buffers; they are added up
        in float64 (fvcore's ``update_bn_stats``, precise BN: Wu & Johnson, "Rethinking
        'Batch' in BatchNorm", arXiv:2105.07576, 2021). The model's momenta and modes are
        restored.

        Args:
            weights: shape ``[P]``.
            x: inputs ``[n, C, H, W]``; n a multiple of ``batch_size`` (n = 0: no batch).
            batch_size: B >= 1, samples per batch.

        Returns:
            float64 ``[2S + 1]``: for each of the layers with running statistics in module
            order, the sum of its batch means ``[C_i]`` then of its batch variances
            ``[C_i]`` (S = Σ C_i), then the number of batches.

        Raises:
            ValueError: n is not a multiple of ``batch_size``.
        """
        if batch_size < 1 or x.shape[0] % batch_size:
            raise ValueError(
                f"batch_size = {batch_size} is not allowed for {x.shape[0]} samples: expected "
                "a divisor of the sample count"
            )
        layers = self._running_statistics_layers()
        size = sum(2 * m.running_mean.numel() for m in layers)
        sums = torch.zeros(size + 1, dtype=torch.float64, device=self.device)
        (x,) = self.to_device(x)
        modes = [(m, m.training) for m in self.model.modules()]
        momenta = [m.momentum for m in layers]
        try:
            self._load(weights)
            self.model.eval()
            for m in layers:
                m.train()
                m.momentum = 1.0
            for start in range(0, x.shape[0], batch_size):
                for m in layers:
                    m.reset_running_stats()  # a clean 0·old with momentum 1
                self.model(x[start : start + batch_size])
                stats = [t for m in layers for t in (m.running_mean, m.running_var)]
                sums[:size] += torch.cat(stats).to(torch.float64)
                sums[size] += 1
        finally:
            for m, momentum in zip(layers, momenta, strict=True):
                m.momentum = momentum
            for m, training in modes:
                m.training = training
        return sums

    @torch.no_grad()
    def load_batch_statistics(self, sums: Tensor) -> None:
        """Set every BatchNorm layer's running mean and variance to the mean over batches
        of :meth:`batch_statistics_sums` (summed over ranks, or not) and
        ``num_batches_tracked`` to the number of batches.

        Raises:
            ValueError: ``sums`` does not fit the model, or counts no batch.
        """
        layers = self._running_statistics_layers()
        size = sum(2 * m.running_mean.numel() for m in layers)
        if sums.shape != (size + 1,) or not float(sums[size]) >= 1:
            raise ValueError(
                f"batch statistics of shape {tuple(sums.shape)} do not fit the model: "
                f"expected [{size + 1}] with a batch count >= 1 last"
            )
        num_batches = float(sums[size])
        means = (sums[:size] / num_batches).to(torch.float32)
        offset = 0
        for m in layers:
            c = m.running_mean.numel()
            m.running_mean.copy_(means[offset : offset + c])
            m.running_var.copy_(means[offset + c : offset + 2 * c])
            offset += 2 * c
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.fill_(round(num_batches))

    def recalibrate(self, weights: Tensor, x: Tensor, batch_size: int) -> None:
        """Recompute the BatchNorm running statistics for ``weights`` (precise BN).

        The buffers become the mean over the batches of ``x`` of each layer's batch mean
        and unbiased variance, computed with ``weights`` (:meth:`batch_statistics_sums`),
        the population statistics that evaluation-mode BatchNorm assumes. Running
        statistics accumulated during training are stale for any evaluated model: with
        several learners they were collected at other weights (each learner's, or none on
        a parameter server that computes no forward). Models without running statistics
        are left untouched.

        Args:
            weights: shape ``[P]``.
            x: inputs ``[n, C, H, W]``, n >= 1 a multiple of ``batch_size``.
            batch_size: B >= 1.

        Raises:
            ValueError: n = 0 or not a multiple of ``batch_size``.
        """
        if self.has_running_statistics:
            self.load_batch_statistics(self.batch_statistics_sums(weights, x, batch_size))

    def evaluate(
        self,
        weights: Tensor,
        split: Split,
        batch_size: int,
        recalibration: tuple[Tensor, int] | None = None,
    ) -> tuple[float, float]:
        """The metric and the mean loss of ``weights`` on the evaluation ``split``.

        Every sample is counted exactly once; batches of ``batch_size`` samples.

        Args:
            weights: shape ``[P]``.
            split: the evaluation data (:class:`distsgd.data.Split`).
            batch_size: samples per evaluation batch.
            recalibration: ``(inputs [n, ...], batch size)`` over which
                :meth:`recalibrate` recomputes the BatchNorm statistics for ``weights``
                first (:func:`bn_recalibration_inputs`); None: evaluate with the buffers
                as they are.

        Returns:
            (the metric, e.g. accuracy as a fraction in [0, 1]; the mean loss).
        """
        if recalibration is not None:
            self.recalibrate(weights, *recalibration)
        metric_sum, loss_sum, count = self.evaluation_sums(weights, split, batch_size)
        return self.metric.value(metric_sum, loss_sum, count), loss_sum / count

    def evaluation_sums(
        self,
        weights: Tensor,
        split: Split,
        batch_size: int,
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[float, float, int]:
        """Sums over the samples ``[start, stop)`` of ``split`` of the metric's and the
        loss's per-sample values, and the sample count: what ranks that share an
        evaluation add up (:meth:`Metric.value` turns the totals into the metric).
        The buffers are used as they are."""
        self.model.eval()
        metric_sum = loss_sum = 0.0
        count = 0
        with torch.inference_mode():  # no autograd graph for a forward-only pass
            self._load(weights)
            for xb, yb in split.batches(batch_size, start, stop):
                xb, yb = self.to_device(xb, yb)
                outputs = self.model(xb)
                loss_sum += self.loss.batch_sum(outputs, yb)
                metric_sum += self.metric.batch_sum(outputs, yb)
                count += int(yb.shape[0])
        return metric_sum, loss_sum, count

    @torch.no_grad()
    def state_dict_at(self, weights: Tensor) -> dict[str, Tensor]:
        """The model's ``state_dict()`` with its trainable parameters at ``weights`` and
        every other entry (BatchNorm running statistics, frozen parameters) as the module
        holds it now: what ``model.pt`` saves, loadable into a fresh module of the model's
        class with ``load_state_dict``.

        Args:
            weights: shape ``[P]``, in the order of ``model.parameters()``.

        Returns:
            New tensors (copies; the engine's buffers are not touched), keyed as
            ``model.state_dict()`` keys them (a parameter shared by two modules appears
            under both names).

        Raises:
            ValueError: ``weights`` is not of shape ``[P]``.
        """
        if weights.shape != (self.num_parameters,):
            raise ValueError(
                f"weights of shape {tuple(weights.shape)} do not fit the model: expected "
                f"[{self.num_parameters}]"
            )
        state = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            where = self._slices.get(id(value))
            if where is None:
                state[name] = value.detach().clone()
            else:
                state[name] = weights[where[0] : where[1]].reshape(value.shape).clone()
        return state

    def buffers_state(self) -> dict[str, Tensor]:
        """The module's buffers (e.g. BatchNorm statistics), for checkpoints."""
        return {k: v.clone() for k, v in self.model.named_buffers()}

    def load_buffers_state(self, state: dict[str, Tensor]) -> None:
        own = dict(self.model.named_buffers())
        if set(own) != set(state):
            raise ValueError("checkpoint buffers do not match the model")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)
