"""Argument checks and state helpers shared by the protocols (private)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from distsgd.checks import check_bool, check_choice, check_float, check_int

from .base import make_sgd

__all__ = [  # re-exported for the protocol modules
    "OptimizerFactory",
    "SERVER_OPTIMIZERS",
    "STALENESS_LR",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
]

STALENESS_LR = ("none", "softsync", "measured", "per_gradient")
"""Rudra's staleness-dependent learning rates (docs/protocols.md §2); :class:`ParameterServer`."""
SERVER_OPTIMIZERS = ("sgd", "adagrad")
"""The parameter server's update rules (docs/protocols.md §2), see :class:`ParameterServer`:
``"sgd"`` is the protocol's optimizer (torch.optim.SGD, or the ``make_optimizer``
factory's), ``"adagrad"`` Rudra's AdaGrad server."""

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]
"""``make_optimizer([param])`` → a torch.optim.Optimizer over exactly ``param``, a flat
``[P]`` vector or a replica stack ``[λ, P]``, with its hyperparameters (the learning rate
is set on every step). Its update must be coordinate-wise (each coordinate from its own
gradient history), so one optimizer over a stack updates each replica as its own would."""


def check_initial(initial: Any) -> Tensor:
    """A detached contiguous copy of ``initial``, which must be a 1-D floating tensor."""
    if not isinstance(initial, Tensor):
        raise ValueError(
            f"initial must be a torch.Tensor of shape [P], got {type(initial).__name__}"
        )
    if initial.dim() != 1 or initial.numel() == 0 or not initial.is_floating_point():
        raise ValueError(
            "initial must be a non-empty 1-D floating-point tensor of shape [P], got "
            f"shape {list(initial.shape)} and dtype {initial.dtype}"
        )
    return initial.detach().clone().contiguous()


def check_sgd_args(momentum: Any, weight_decay: Any, nesterov: Any) -> tuple[float, float, bool]:
    """Validate the torch.optim.SGD settings shared by every protocol."""
    momentum = check_float("momentum", momentum, 0.0, 1.0, max_inclusive=False)
    weight_decay = check_float("weight_decay", weight_decay, 0.0)
    nesterov = check_bool("nesterov", nesterov)
    if nesterov and momentum == 0:
        raise ValueError("nesterov = True is not allowed with momentum = 0: expected False")
    return momentum, weight_decay, nesterov


def check_optimizer_args(
    make_optimizer: Any, momentum: Any, weight_decay: Any, nesterov: Any
) -> tuple[float, float, bool]:
    """Validate a protocol's optimizer arguments: the SGD settings, which configure the
    default torch.optim.SGD and must stay 0 / False when ``make_optimizer`` is given (the
    factory carries its optimizer's settings).

    Raises:
        ValueError: a bad SGD setting, a ``make_optimizer`` that is not callable, or an SGD
            setting given together with ``make_optimizer``.
    """
    momentum, weight_decay, nesterov = check_sgd_args(momentum, weight_decay, nesterov)
    if make_optimizer is None:
        return momentum, weight_decay, nesterov
    if not callable(make_optimizer):
        raise ValueError(
            f"make_optimizer = {make_optimizer!r} is not allowed: expected None or a "
            "callable [param] -> torch.optim.Optimizer"
        )
    for name, value in (
        ("momentum", momentum),
        ("weight_decay", weight_decay),
        ("nesterov", nesterov),
    ):
        if value:
            raise ValueError(
                f"{name} = {value!r} is not allowed with make_optimizer: expected "
                f"{False if name == 'nesterov' else 0} (it configures the default SGD; the "
                "factory carries its optimizer's settings)"
            )
    return momentum, weight_decay, nesterov


def build_optimizer(
    param: Tensor,
    make_optimizer: OptimizerFactory | None,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
) -> torch.optim.Optimizer:
    """The optimizer over ``param`` (``[P]`` or a stack ``[λ, P]``): ``make_optimizer([param])``,
    or torch.optim.SGD with the given settings when it is None.

    Raises:
        ValueError: the factory returned something other than a torch.optim.Optimizer over
            exactly ``[param]``.
    """
    if make_optimizer is None:
        return make_sgd(param, 0.0, momentum, weight_decay, nesterov)
    opt = make_optimizer([param])
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(
            f"make_optimizer returned {type(opt).__name__}: expected a torch.optim.Optimizer"
        )
    groups = opt.param_groups
    if len(groups) != 1 or len(groups[0]["params"]) != 1 or groups[0]["params"][0] is not param:
        raise ValueError(
            "make_optimizer([param]) must return an optimizer with one parameter group "
            "holding exactly param"
        )
    return opt


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """``"module:Class(setting=value, …)"`` of ``opt``'s class and hyperparameters (the
    learning rate left out: it is set on every step); the configuration a state_dict of
    a protocol with a ``make_optimizer`` factory is checked against."""
    cls = type(opt)
    settings = ", ".join(f"{k}={v!r}" for k, v in sorted(opt.defaults.items()) if k != "lr")
    return f"{cls.__module__}:{cls.__qualname__}({settings})"


def check_lr(lr: Any) -> float:
    """The learning rate of one step: a finite number >= 0."""
    return check_float("lr", lr, 0.0)


def check_vector(name: str, t: Any, like: Tensor) -> Tensor:
    """``t`` must have the shape, dtype and device of ``like``."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name} must have shape {list(like.shape)}, dtype {like.dtype} and device "
            f"{like.device}; got shape {list(t.shape)}, dtype {t.dtype}, device {t.device}"
        )
    return t


def check_index(name: str, value: Any, count: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise ValueError(f"{name} = {value!r} is not allowed: expected an integer in [0, {count})")
    return value


def clone_state(obj: Any) -> Any:
    """Deep copy of a state tree: tensors cloned, containers rebuilt, scalars shared."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


def check_header(state: Any, protocol: str, config: dict[str, Any]) -> None:
    """Raise ValueError unless ``state`` was saved by ``protocol`` with the same ``config``."""
    if not isinstance(state, dict) or state.get("protocol") != protocol:
        got = state.get("protocol") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state is not a {protocol} state_dict (its protocol is {got!r})")
    saved = state.get("config")
    if saved != config:
        diff = sorted(
            k for k in set(config) | set(saved or {}) if (saved or {}).get(k) != config.get(k)
        )
        raise ValueError(
            f"{protocol} state_dict was saved with a different configuration: "
            + ", ".join(
                f"{k} = {(saved or {}).get(k)!r} (this one: {config.get(k)!r})" for k in diff
            )
        )


def with_momentum(state: Any, momentum: float) -> Any:
    """``state`` continued with SGD momentum μ = ``momentum``: a copy in which every
    protocol state header (``{"protocol": name, "config": {"momentum": …}}``, at any depth:
    a runtime's state holds its ranks' protocol states) names that μ, buffers kept, so
    that :func:`check_header` accepts it under a protocol built with that μ. Omnivore
    changes μ mid-run at steady state (Hadjis et al., arXiv:1606.04487, §4)."""
    if isinstance(state, dict):
        out = {k: with_momentum(v, momentum) for k, v in state.items()}
        conf = out.get("config")
        if isinstance(out.get("protocol"), str) and isinstance(conf, dict) and "momentum" in conf:
            out["config"] = {**conf, "momentum": momentum}
        return out
    if isinstance(state, list):
        return [with_momentum(v, momentum) for v in state]
    if isinstance(state, tuple):
        return tuple(with_momentum(v, momentum) for v in state)
    return state


def load_vector(name: str, value: Any, into: Tensor) -> None:
    """Copy saved tensor ``value`` into ``into`` in place, checking its shape."""
    if not isinstance(value, Tensor) or value.shape != into.shape:
        shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"state[{name!r}] must be a tensor of shape {list(into.shape)}, got {shape}"
        )
    into.copy_(value)


def optimizer_step(opt: torch.optim.Optimizer, param: Tensor, grad: Tensor, lr: float) -> None:
    """One ``opt`` step on its single ``param`` with gradient ``grad`` at rate ``lr``."""
    opt.param_groups[0]["lr"] = lr
    param.grad = grad
    opt.step()
    param.grad = None


def optimizer_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, Tensor]]:
    """A copy of ``opt``'s per-parameter state (momentum buffer; AdaGrad step and sum).

    The hyperparameters are left out: they are the protocol's configuration, and the
    learning rate is set on every step.
    """
    return clone_state(opt.state_dict()["state"])


def load_optimizer(opt: torch.optim.Optimizer, state: Any) -> None:
    """Restore :func:`optimizer_state` into ``opt`` without aliasing the caller's tensors."""
    if not isinstance(state, dict):
        raise ValueError("state['optimizer'] must be a dict of per-parameter optimizer state")
    full = opt.state_dict()
    full["state"] = clone_state(state)
    opt.load_state_dict(full)


def regroup_replicas(
    replicas: Tensor,
    opt: torch.optim.Optimizer,
    num_devices: int,
    replicas_per_device: int,
    make_opt: Callable[[Tensor], torch.optim.Optimizer],
) -> tuple[Tensor, torch.optim.Optimizer]:
    """Replica stack ``[D·k, P]`` regrouped to ``[D·k', P]`` (device-major rows), with a
    new optimizer over it (``make_opt(stack)``) holding the optimizer state regrouped
    alike.

    Growing appends to each device copies of that device's last replica (weights and
    per-replica optimizer state: "a copy of an existing replica", Crossbow, docs/protocols.md §4);
    shrinking drops each device's last replicas. Optimizer state of the stack's shape
    (SGD's momentum buffer; Adam's exp_avg and exp_avg_sq) is regrouped with the rows;
    other state (Adam's scalar ``step`` tensor, shared by all replicas) is copied as it
    is. Returns ``(new stack, new optimizer)``.
    """
    d = num_devices
    k = replicas.shape[0] // d
    k_new = replicas_per_device

    def regroup(t: Tensor) -> Tensor:
        v = t.view(d, k, -1)
        if k_new <= k:
            v = v[:, :k_new]
        else:
            v = torch.cat([v, v[:, -1:].expand(d, k_new - k, v.shape[2])], dim=1)
        return v.reshape(d * k_new, -1).clone()

    state = {
        key: regroup(val)
        if isinstance(val, Tensor) and val.shape == replicas.shape
        else clone_state(val)
        for key, val in opt.state.get(replicas, {}).items()
    }
    stack = regroup(replicas)
    new_opt = make_opt(stack)
    if state:
        new_opt.state[stack].update(state)
    return stack, new_opt


def check_replica_layout(num_learners: int, replicas_per_device: int | None) -> tuple[int, int]:
    """``(k, devices)`` for λ replicas placed k per device (None: all on one device).

    Raises:
        ValueError: k is not an integer >= 1 dividing λ.
    """
    if replicas_per_device is None:
        replicas_per_device = num_learners
    k = check_int("replicas_per_device", replicas_per_device, 1)
    if k > num_learners or num_learners % k:
        raise ValueError(
            f"replicas_per_device = {k!r} is not allowed: expected a "
            f"divisor of num_learners = {num_learners}"
        )
    return k, num_learners // k
