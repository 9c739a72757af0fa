"""Local SGD: independent replica steps with periodic model averaging.

Rule (docs/protocols.md §5; Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019,
arXiv:1805.09767, Algorithm 1; Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches,
Use Local SGD", ICLR 2020, arXiv:1808.07217 — post-local SGD runs this after a hardsync
phase)::

    every iteration t = 1, 2, …:
        w_l ← SGD(w_l, ∇ℓ(w_l; B_l), γ)          # torch.optim.SGD over the stack [λ, P],
                                                  # or the make_optimizer factory's optimizer
        if t mod H == 0:  w_l ← (1/λ) Σ_j w_j     # model averaging; optimizer state stays local

The local optimizer may be any coordinate-wise torch.optim optimizer (e.g. local AdamW:
each replica's moments stay its own, as momentum buffers do). The evaluation model is the
mean of the replicas. With H = 1 and no momentum the replicas
stay equal and each step is hardsync up to float rounding (mean of steps = step of mean).

Example::

    >>> import torch
    >>> from distsgd.protocols import LocalSGD
    >>> ls = LocalSGD(torch.zeros(2), num_learners=2, average_every=2)
    >>> ls.step(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), lr=1.0)
    >>> ls.learner_weights(0), ls.learner_weights(1)
    (tensor([-1.,  0.]), tensor([-3.,  0.]))
    >>> ls.step(torch.zeros(2, 2), lr=1.0)          # t = 2: averaged
    >>> ls.learner_weights(0), ls.learner_weights(1)
    (tensor([-2.,  0.]), tensor([-2.,  0.]))
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ._util import (
    OptimizerFactory,
    build_optimizer,
    check_header,
    check_index,
    check_initial,
    check_int,
    check_lr,
    check_optimizer_args,
    check_replica_layout,
    check_vector,
    describe_optimizer,
    load_optimizer,
    load_vector,
    optimizer_state,
    optimizer_step,
    regroup_replicas,
)
from .base import AllReduce, SynchronousProtocol

__all__ = ["LocalSGD"]


class LocalSGD(SynchronousProtocol):
    """Local SGD with model averaging every ``average_every`` iterations (docs/protocols.md §5).

    Args:
        initial: initial weights, shape ``[P]``, floating point; every replica starts here.
        num_learners: λ >= 1 replicas.
        average_every: H >= 1, averaging period in iterations.
        replicas_per_device: k, a divisor of λ (None: λ, one device); the λ replicas sit
            on λ/k devices of k consecutive replicas (it matters only to
            :meth:`set_replicas_per_device`).
        momentum: local momentum μ in [0, 1) of each replica's SGD.
        weight_decay: L2 coefficient >= 0.
        nesterov: Nesterov local momentum; requires ``momentum > 0``.
        make_optimizer: ``[stack] → torch.optim.Optimizer`` (see
            :data:`~distsgd.protocols.OptimizerFactory`), the replicas' local optimizer
            over the stack ``[λ, P]`` instead of SGD; ``momentum``, ``weight_decay`` and
            ``nesterov`` must then stay 0 / False. None (default): SGD.

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    steps_outside: ClassVar[bool] = True
    state_name: ClassVar[str] = "LocalSGD"
    """The ``"protocol"`` a :meth:`state_dict` carries and :meth:`load_state_dict` expects."""

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        average_every: int,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        replicas_per_device: int | None = None,
        make_optimizer: OptimizerFactory | None = None,
    ) -> None:
        w = check_initial(initial)
        self.num_learners = check_int("num_learners", num_learners, 1)
        self.average_every = check_int("average_every", average_every, 1)
        self.replicas_per_device, self.num_devices = check_replica_layout(
            num_learners, replicas_per_device
        )
        self.momentum, self.weight_decay, self.nesterov = check_optimizer_args(
            make_optimizer, momentum, weight_decay, nesterov
        )
        self._make_optimizer = make_optimizer
        self._replicas = w.expand(num_learners, -1).clone()
        self._opt = self._new_optimizer(self._replicas)
        self._iteration = 0

    @property
    def num_parameters(self) -> int:
        """P, the length of the flat weight vector."""
        return self._replicas.shape[1]

    @property
    def replicas(self) -> Tensor:
        """All replicas, shape ``[num_learners, P]`` (a view: do not modify)."""
        return self._replicas

    def learner_weights(self, learner: int) -> Tensor:
        """Replica ``learner``'s weights, shape ``[P]`` (a view: do not modify).

        Raises:
            ValueError: ``learner`` not in ``[0, num_learners)``.
        """
        check_index("learner", learner, self.num_learners)
        return self._replicas[learner]

    def exchange_step(self, grads: Tensor, lr: float) -> AllReduce | None:
        """:meth:`local_step`; at the end of an averaging period the mean of every replica
        of the run, applied by :meth:`apply_average` (None between averagings).

        Args:
            grads: shape ``[num_learners, P]``; row l is replica l's gradient.
            lr: γ >= 0.

        Raises:
            ValueError: bad ``grads`` (shape, dtype, device) or ``lr``.
        """
        if not self.local_step(grads, lr):
            return None
        return self.period_exchange()

    def period_exchange(self) -> AllReduce:
        """The all-reduce that ends an averaging period: the mean of every replica of the
        run ``[P]``, applied by :meth:`apply_average`."""
        return AllReduce(self._replicas, self.apply_average, mean=True)

    def local_step_to(self, weights: Tensor) -> bool:
        """One iteration of a single replica stepped outside the protocol (the drop-in's
        user optimizer took the step): replica 0 ← ``weights`` ``[P]`` in place of
        :meth:`local_step`'s optimizer step. When it returns True, :meth:`period_exchange`
        names the all-reduce that ends the period.

        Returns:
            True when this iteration ends an averaging period (t mod H == 0).

        Raises:
            ValueError: more than one replica, or bad ``weights`` (shape, dtype, device).
        """
        if self.num_learners != 1:
            raise ValueError(
                f"local_step_to needs num_learners = 1, not {self.num_learners}: it sets "
                "the only replica"
            )
        check_vector("weights", weights, self._replicas[0])
        self._replicas[0].copy_(weights)
        self._iteration += 1
        return self._iteration % self.average_every == 0

    def local_step(self, grads: Tensor, lr: float) -> bool:
        """Step every replica on its own gradient, without averaging.

        :meth:`exchange_step` calls this and, when it returns True, names the all-reduce
        of the replicas' mean that :meth:`apply_average` takes.

        Args:
            grads: shape ``[num_learners, P]``; row l is replica l's gradient.
            lr: γ >= 0.

        Returns:
            True when this iteration ends an averaging period (t mod H == 0).

        Raises:
            ValueError: bad ``grads`` (shape, dtype, device) or ``lr``.
        """
        lr = check_lr(lr)
        check_vector("grads", grads, self._replicas)
        optimizer_step(self._opt, self._replicas, grads, lr)
        self._iteration += 1
        return self._iteration % self.average_every == 0

    def apply_average(self, mean: Tensor) -> None:
        """Set every replica to ``mean``, the average of all replicas, shape ``[P]``
        (optimizer state stays local).

        Raises:
            ValueError: bad shape, dtype or device.
        """
        check_vector("mean", mean, self._replicas[0])
        self._replicas.copy_(mean.expand_as(self._replicas))

    def eval_exchange(self) -> AllReduce | None:
        """Between averagings, the mean of every replica of the run (the evaluation model
        ``[P]`` when the replicas sit on several processes); None right after one."""
        if self._iteration % self.average_every == 0:
            return None
        return AllReduce(self._replicas, _identity, mean=True)

    def eval_weights(self) -> Tensor:
        """The mean of the replicas, shape ``[P]`` (a copy of replica 0 when they are equal
        after averaging, so no rounding is added)."""
        if self._iteration % self.average_every == 0:
            return self._replicas[0].clone()
        return self._replicas.mean(0)

    def set_replicas_per_device(self, replicas_per_device: int) -> None:
        """Change k, the replicas on each device, between iterations (Crossbow's auto-tuner,
        docs/protocols.md §4): growing appends to each device copies of its last replica (weights
        and optimizer state), shrinking drops each device's last replicas.
        ``num_learners`` becomes ``num_devices · k``. Called right after an averaging
        step, every replica kept or added equals the average.

        Raises:
            ValueError: k < 1.
        """
        k_new = check_int("replicas_per_device", replicas_per_device, 1)
        self._replicas, self._opt = regroup_replicas(
            self._replicas, self._opt, self.num_devices, k_new, self._new_optimizer
        )
        self.replicas_per_device = k_new
        self.num_learners = self.num_devices * k_new

    def add_replica_per_device(self) -> None:
        """k ← k + 1 (see :meth:`set_replicas_per_device`)."""
        self.set_replicas_per_device(self.replicas_per_device + 1)

    def remove_replica_per_device(self) -> None:
        """k ← k − 1 (see :meth:`set_replicas_per_device`).

        Raises:
            ValueError: k is already 1.
        """
        if self.replicas_per_device == 1:
            raise ValueError("cannot remove a replica: each device holds only one")
        self.set_replicas_per_device(self.replicas_per_device - 1)

    def _new_optimizer(self, stack: Tensor) -> torch.optim.Optimizer:
        return build_optimizer(
            stack, self._make_optimizer, self.momentum, self.weight_decay, self.nesterov
        )

    def _config(self) -> dict[str, Any]:
        config = {
            "num_parameters": self.num_parameters,
            "num_learners": self.num_learners,
            "average_every": self.average_every,
            "replicas_per_device": self.replicas_per_device,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }
        if self._make_optimizer is not None:
            config["optimizer"] = describe_optimizer(self._opt)
        return config

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: replicas ``[λ, P]``, iteration and the replicas' optimizer state."""
        return {
            "protocol": self.state_name,
            "config": self._config(),
            "replicas": self._replicas.clone(),
            "iteration": self._iteration,
            "optimizer": optimizer_state(self._opt),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from a LocalSGD of the same configuration.
        """
        check_header(state, self.state_name, self._config())
        load_vector("replicas", state["replicas"], self._replicas)
        self._iteration = int(state["iteration"])
        load_optimizer(self._opt, state["optimizer"])


def _identity(total: Tensor) -> Tensor:
    return total
