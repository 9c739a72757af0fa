"""Synchronisation protocols as pure update rules on flat parameter vectors (sans-IO).

* :class:`HardSync` — synchronous SGD / plain loop (SPEC.md §1).
* :class:`ParameterServer` — Rudra hardsync / n-softsync / async with staleness-dependent
  learning rates (SPEC.md §2).
* :class:`ComputeGroups` — Omnivore compute groups (SPEC.md §3).
* :class:`SMA` — Crossbow synchronous model averaging (SPEC.md §4).
* :class:`LocalSGD` — local SGD with periodic averaging (SPEC.md §5).

:func:`build_protocol` makes the one a :class:`~distsgd.config.RunConfig` asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .base import AsynchronousProtocol, SynchronousProtocol, Update, make_sgd
from .compute_groups import ComputeGroups
from .hardsync import HardSync
from .local_sgd import LocalSGD
from .parameter_server import ParameterServer
from .sma import SMA

if TYPE_CHECKING:
    from distsgd.config import RunConfig

__all__ = [
    "AsynchronousProtocol",
    "ComputeGroups",
    "HardSync",
    "LocalSGD",
    "ParameterServer",
    "SMA",
    "SynchronousProtocol",
    "Update",
    "build_protocol",
    "make_sgd",
]


def build_protocol(cfg: RunConfig, initial: Tensor) -> SynchronousProtocol | AsynchronousProtocol:
    """The protocol ``cfg.protocol`` names, starting from ``initial`` (shape ``[P]``).

    Mapping: ``hardsync`` / ``plain`` → :class:`HardSync`; ``parameter_server`` →
    :class:`ParameterServer` with ``softsync = cfg.protocol.effective_softsync`` and a
    barrier for mode ``hardsync``; ``compute_groups`` → :class:`ComputeGroups`; ``sma`` →
    :class:`SMA` with α = ``protocol.alpha``, or 1/k when it is 0; ``local_sgd`` →
    :class:`LocalSGD`. ``optimizer.momentum``, ``weight_decay`` and ``nesterov`` go to the
    protocol's optimizer (server, group server or replicas).

    Raises:
        ConfigError: ``protocol.server_optimizer = "adagrad"`` with
            ``optimizer.momentum`` > 0 (parameter server and compute groups).
        ValueError: ``initial`` is not a non-empty 1-D floating-point tensor.
    """
    from distsgd.config import ConfigError

    p, o = cfg.protocol, cfg.optimizer
    lam = p.num_learners
    if p.name in ("parameter_server", "compute_groups") and p.server_optimizer == "adagrad":
        if o.momentum != 0:
            raise ConfigError(
                f"optimizer.momentum = {o.momentum!r} is not allowed: expected 0 when "
                "protocol.server_optimizer = 'adagrad'"
            )
    if p.name in ("hardsync", "plain"):
        return HardSync(initial, lam, o.momentum, o.weight_decay, o.nesterov)
    if p.name == "parameter_server":
        return ParameterServer(
            initial,
            lam,
            softsync=p.effective_softsync,
            barrier=p.mode == "hardsync",
            staleness_lr=p.staleness_lr,
            optimizer=p.server_optimizer,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            nesterov=o.nesterov,
        )
    if p.name == "compute_groups":
        return ComputeGroups(
            initial,
            lam,
            p.num_groups,
            staleness_lr=p.staleness_lr,
            optimizer=p.server_optimizer,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            momentum_compensation=p.momentum_compensation,
            nesterov=o.nesterov,
        )
    if p.name == "sma":
        k = p.initial_replicas_per_device
        return SMA(
            initial,
            lam,
            replicas_per_device=k,
            alpha=p.alpha if p.alpha > 0 else 1.0 / lam,  # SPEC §4: 1/k over all k learners
            central_momentum=p.central_momentum,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            nesterov=o.nesterov,
        )
    if p.name == "local_sgd":
        return LocalSGD(
            initial,
            lam,
            average_every=p.average_every,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            nesterov=o.nesterov,
            replicas_per_device=p.initial_replicas_per_device,
        )
    raise AssertionError(f"unhandled protocol.name {p.name!r}")  # config validates names
