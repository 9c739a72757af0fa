"""Synchronisation protocols as pure update rules on flat parameter vectors (sans-IO).

* :class:`HardSync` — synchronous SGD / plain loop (SPEC.md §1).
* :class:`ParameterServer` — Rudra hardsync / n-softsync / async with staleness-dependent
  learning rates (SPEC.md §2).
* :class:`ComputeGroups` — Omnivore compute groups (SPEC.md §3).
* :class:`SMA` — Crossbow synchronous model averaging (SPEC.md §4).
* :class:`LocalSGD` — local SGD with periodic averaging (SPEC.md §5).

They know nothing of the config: :func:`distsgd.layout.build_protocol` makes the one a
:class:`~distsgd.config.RunConfig` asks for.
"""

from __future__ import annotations

from ._util import SERVER_OPTIMIZERS, STALENESS_LR
from .base import AsynchronousProtocol, SynchronousProtocol, Update, make_sgd
from .compute_groups import ComputeGroups
from .hardsync import HardSync
from .local_sgd import LocalSGD
from .parameter_server import ParameterServer
from .sma import SMA

__all__ = [
    "SERVER_OPTIMIZERS",
    "STALENESS_LR",
    "AsynchronousProtocol",
    "ComputeGroups",
    "HardSync",
    "LocalSGD",
    "ParameterServer",
    "SMA",
    "SynchronousProtocol",
    "Update",
    "make_sgd",
]
