"""Synchronisation protocols as pure update rules on flat parameter vectors (sans-IO).

* :class:`HardSync` — synchronous SGD / plain loop (docs/protocols.md §1).
* :class:`BackupHardSync` — hardsync with backup learners through a parameter server
  (docs/protocols.md "Backup learners").
* :class:`ParameterServer` — Rudra hardsync / n-softsync / async with staleness-dependent
  learning rates (docs/protocols.md §2).
* :class:`ComputeGroups` — Omnivore compute groups (docs/protocols.md §3).
* :class:`SMA` — Crossbow synchronous model averaging (docs/protocols.md §4).
* :class:`LocalSGD` — local SGD with periodic averaging (docs/protocols.md §5).
* :class:`DiLoCo` — local SGD with an outer optimizer on the averaged change
  (docs/protocols.md §6).

Each applies a torch.optim optimizer to one flat weight vector ``[P]`` (hardsync, the
parameter server's and the compute groups' server) or to a replica stack ``[λ, P]`` (SMA,
local SGD): SGD by default, or any coordinate-wise optimizer given as a factory
(``make_optimizer``, :data:`OptimizerFactory`). What assumes SGD is stated in each
docstring: Omnivore's momentum compensation (:class:`ComputeGroups`) and Rudra's AdaGrad
server (:class:`ParameterServer`) take no factory.

Devices: every state tensor (weights, replica stacks, momentum and AdaGrad buffers, the
parameter server's gradient buffer) is allocated from the initial weights (``clone``,
``expand``, ``zeros_like``, the optimizer's own ``zeros_like``), so it lives on their
device and dtype: a protocol built from CUDA weights keeps all its state on that GPU and
needs no host copy. Gradients passed in must be on the same device (checked);
``load_state_dict`` copies saved tensors onto the weights' device, so a checkpoint read
onto the CPU restores a GPU protocol and the other way round.

They know nothing of the config: :func:`distsgd.layout.build_protocol` makes the one a
:class:`~distsgd.config.RunConfig` asks for.
"""

from __future__ import annotations

from ._util import SERVER_OPTIMIZERS, STALENESS_LR, OptimizerFactory
from .backup import BackupHardSync
from .base import (
    AllReduce,
    AsynchronousProtocol,
    Protocol,
    SynchronousProtocol,
    Update,
    make_sgd,
)
from .compute_groups import ComputeGroups
from .diloco import DiLoCo
from .hardsync import HardSync
from .local_sgd import LocalSGD
from .parameter_server import ParameterServer
from .sma import SMA

__all__ = [
    "AllReduce",
    "SERVER_OPTIMIZERS",
    "STALENESS_LR",
    "OptimizerFactory",
    "AsynchronousProtocol",
    "BackupHardSync",
    "ComputeGroups",
    "DiLoCo",
    "HardSync",
    "LocalSGD",
    "ParameterServer",
    "Protocol",
    "SMA",
    "SynchronousProtocol",
    "Update",
    "make_sgd",
]
