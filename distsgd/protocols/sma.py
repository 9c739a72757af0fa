"""Crossbow's synchronous model averaging (SMA) with hierarchical synchronisation.

Rule (docs/protocols.md §4; Koliousis, Watcharapichat, Weidlich, Mai, Costa, Pietzuch, "Crossbow:
Scaling Deep Learning with Small Batch Sizes on Multi-GPU Servers", VLDB 2019,
arXiv:1901.02244, Algorithm 1). λ replicas w_j, a central average model z and its
previous value z_prev; each iteration, synchronously::

    c_j = α (w_j − z)                          # from the replica before its update
    w_j ← SGD(w_j, ∇ℓ(w_j; B_j), γ) − c_j      # torch.optim.SGD over the stack [λ, P]
                                               # (local momentum, weight decay), or the
                                               # make_optimizer factory's optimizer
    z   ← z + Σ_j c_j + μ_z (z − z_prev)       # Polyak momentum; z_prev ← old z

Replicas are reset to z (their optimizer state — momentum buffers, Adam's moments —
cleared) whenever γ is lower than the previous iteration's: Crossbow's rule for step
schedules, so a schedule that lowers γ at every step resets the replicas at every step.
The local optimizer may be any coordinate-wise torch.optim optimizer: the rule needs only
that each replica's update comes from its own gradient history. Hierarchically (Crossbow's multi-GPU synchronisation), the λ replicas sit on λ/k devices of
k consecutive replicas; each device sums its own corrections, the per-device sums are
all-reduced, and every device applies the same z update. :meth:`SMA.step` is exactly
:meth:`SMA.local_step` followed by :meth:`SMA.apply_central` of the summed device sums
(:meth:`SMA.exchange_step` names that all-reduce), so a distributed runtime runs
``local_step`` on its own replicas, all-reduces the sums and calls ``apply_central``. ``alpha`` is literal here: 0 means no correction (the
config's "0 means 1/λ" is mapped by :func:`distsgd.layout.sma_alpha`).

Example (two replicas, α = 1/2, μ_z = 0: z becomes the mean of the pre-update replicas)::

    >>> import torch
    >>> from distsgd.protocols import SMA
    >>> sma = SMA(torch.zeros(2), num_learners=2, alpha=0.5, central_momentum=0.0)
    >>> sma.step(torch.tensor([[1.0, 1.0], [3.0, 3.0]]), lr=1.0)   # z = 0: no correction
    >>> sma.learner_weights(0), sma.learner_weights(1), sma.eval_weights()
    (tensor([-1., -1.]), tensor([-3., -3.]), tensor([0., 0.]))
    >>> sma.step(torch.zeros(2, 2), lr=1.0)
    >>> sma.eval_weights()
    tensor([-2., -2.])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._util import (
    OptimizerFactory,
    build_optimizer,
    check_float,
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

__all__ = ["SMA"]


class SMA(SynchronousProtocol):
    """Crossbow SMA: ``num_learners`` replicas on ``num_devices`` devices (docs/protocols.md §4).

    Args:
        initial: initial weights, shape ``[P]``, floating point; every replica and z start
            here (copied).
        num_learners: λ >= 1 replicas.
        replicas_per_device: k, a divisor of λ (None: λ, one device).
        alpha: correction weight α in [0, 1] (literal; 0 disables the correction).
        central_momentum: μ_z in [0, 1), Polyak momentum on z.
        momentum: local momentum μ in [0, 1) of each replica's SGD.
        weight_decay: L2 coefficient >= 0 of each replica's SGD.
        nesterov: Nesterov local momentum; requires ``momentum > 0``.
        make_optimizer: ``[stack] → torch.optim.Optimizer`` (see
            :data:`~distsgd.protocols.OptimizerFactory`), the replicas' local optimizer
            over the stack ``[λ, P]`` instead of SGD; ``momentum``, ``weight_decay`` and
            ``nesterov`` must then stay 0 / False. None (default): SGD.

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        replicas_per_device: int | None = None,
        alpha: float = 0.1,
        central_momentum: float = 0.9,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        make_optimizer: OptimizerFactory | None = None,
    ) -> None:
        z = check_initial(initial)
        self.num_learners = check_int("num_learners", num_learners, 1)
        self.replicas_per_device, self.num_devices = check_replica_layout(
            num_learners, replicas_per_device
        )
        self.alpha = check_float("alpha", alpha, 0.0, 1.0)
        self.central_momentum = check_float(
            "central_momentum", central_momentum, 0.0, 1.0, max_inclusive=False
        )
        self.momentum, self.weight_decay, self.nesterov = check_optimizer_args(
            make_optimizer, momentum, weight_decay, nesterov
        )
        self._make_optimizer = make_optimizer
        self._z = z
        self._z_prev = z.clone()
        self._replicas = z.expand(num_learners, -1).clone()
        self._opt = self._new_optimizer(self._replicas)
        self._iteration = 0
        self._last_lr = -1.0  # none yet
        self._pending_central = False

    @property
    def num_parameters(self) -> int:
        """P, the length of the flat weight vector."""
        return self._z.numel()

    def learner_weights(self, learner: int) -> Tensor:
        """Replica ``learner``'s weights, shape ``[P]`` (a view: do not modify).

        Raises:
            ValueError: ``learner`` not in ``[0, num_learners)``.
        """
        check_index("learner", learner, self.num_learners)
        return self._replicas[learner]

    @property
    def replicas(self) -> Tensor:
        """All replicas, shape ``[num_learners, P]`` (a view: do not modify)."""
        return self._replicas

    def eval_weights(self) -> Tensor:
        """A copy of the central model z, shape ``[P]``."""
        return self._z.clone()

    def device_corrections(self) -> Tensor:
        """Σ_j c_j = α Σ_j (w_j − z) over each device's k replicas, from the current replicas.

        Returns:
            shape ``[num_devices, P]``. :meth:`local_step` returns these sums for the
            replicas as they were before its update (zero after a learning-rate drop,
            which first resets the replicas to z).
        """
        c = (self._replicas - self._z).mul_(self.alpha)
        return c.view(self.num_devices, self.replicas_per_device, -1).sum(1)

    def local_step(self, grads: Tensor, lr: float) -> Tensor:
        """Update the replicas: ``w_j ← SGD(w_j, grads[j], lr) − c_j``.

        If ``lr`` is lower than the previous iteration's, the replicas are first reset to z
        and their optimizer state cleared. Must be followed by :meth:`apply_central`.

        Args:
            grads: shape ``[num_learners, P]``; row j is replica j's gradient at
                :meth:`learner_weights`.
            lr: γ >= 0.

        Returns:
            The per-device correction sums, shape ``[num_devices, P]``.

        Raises:
            ValueError: bad ``grads`` (shape, dtype, device) or ``lr``.
            RuntimeError: the previous ``local_step`` was not followed by ``apply_central``.
        """
        lr = check_lr(lr)
        check_vector("grads", grads, self._replicas)
        if self._pending_central:
            raise RuntimeError("local_step called twice without apply_central in between")
        self.begin_iteration(lr)
        r, k = self._replicas, self.replicas_per_device
        if self.weight_decay == 0 and self._make_optimizer is None:
            # The SGD direction does not depend on w_j, so the correction can come first,
            # fused: w_j ← w_j + α (z − w_j) (one pass), then the SGD step; the device
            # sums are α (Σ_j w_j − k z) from one pass over the replicas. Few passes over
            # the [λ, P] stack matter: with k replicas of small batches it is as large as
            # the gradient computation (same rule, other float32 rounding order).
            sums = r.view(self.num_devices, k, -1).sum(1).sub_(self._z, alpha=k).mul_(self.alpha)
            r.lerp_(self._z.expand_as(r), self.alpha)
            optimizer_step(self._opt, r, grads, lr)
        else:  # weight decay (or another optimizer) may read w_j: correct after the step
            corrections = (r - self._z).mul_(self.alpha)
            sums = corrections.view(self.num_devices, k, -1).sum(1)
            optimizer_step(self._opt, r, grads, lr)
            r.sub_(corrections)
        self._last_lr = lr
        self._pending_central = True
        return sums

    def apply_central(self, total_correction: Tensor) -> None:
        """``z ← z + total_correction + μ_z (z − z_prev)``; ``z_prev ←`` old z.

        Args:
            total_correction: Σ_j c_j over all replicas of all devices (the all-reduced sum
                of :meth:`local_step`'s result), shape ``[P]``.

        Raises:
            ValueError: bad shape, dtype or device.
            RuntimeError: not preceded by :meth:`local_step`.
        """
        check_vector("total_correction", total_correction, self._z)
        if not self._pending_central:
            raise RuntimeError("apply_central called without a preceding local_step")
        momentum_term = (self._z - self._z_prev).mul_(self.central_momentum)
        self._z_prev.copy_(self._z)
        self._z.add_(total_correction).add_(momentum_term)
        self._pending_central = False
        self._iteration += 1

    def begin_iteration(self, lr: float) -> bool:
        """Crossbow's reset: when ``lr`` is lower than the previous iteration's, every
        replica becomes z and its optimizer state is cleared (True); else nothing (False).
        Resetting twice before one :meth:`local_step` changes nothing more."""
        if lr >= self._last_lr:
            return False
        self._replicas.copy_(self._z.expand_as(self._replicas))
        self._opt.state.clear()
        return True

    def exchange_step(self, grads: Tensor, lr: float) -> AllReduce:
        """:meth:`local_step`, then the sum of the per-device corrections over every
        device of the run, applied by :meth:`apply_central`.

        Args:
            grads: shape ``[num_learners, P]``.
            lr: γ >= 0.

        Raises:
            ValueError: bad ``grads`` or ``lr``.
            RuntimeError: called between ``local_step`` and ``apply_central``.
        """
        return AllReduce(self.local_step(grads, lr), self.apply_central)

    def set_replicas_per_device(self, replicas_per_device: int, alpha: float | None = None) -> None:
        """Change k, the replicas on each device, at a synchronisation point.

        Crossbow's auto-tuner (docs/protocols.md §4; Koliousis et al., VLDB 2019, §4.3) adds one
        learner per device as a copy of an existing replica and removes the last one added
        when throughput stops improving. Growing appends to each device copies of its last
        replica (weights and local optimizer state); shrinking drops each device's last
        replicas. z and z_prev are unchanged, so the central model, and the next
        iteration's corrections of the replicas kept, are exactly as without the change.
        ``num_learners`` becomes ``num_devices · k``.

        Args:
            replicas_per_device: the new k >= 1.
            alpha: the new α in [0, 1] (None: unchanged), e.g. 1/k for the config's α = 0.

        Raises:
            ValueError: k < 1 or ``alpha`` outside [0, 1].
            RuntimeError: called between ``local_step`` and ``apply_central``.
        """
        k_new = check_int("replicas_per_device", replicas_per_device, 1)
        if alpha is not None:
            alpha = check_float("alpha", alpha, 0.0, 1.0)
        if self._pending_central:
            raise RuntimeError(
                "set_replicas_per_device called between local_step and apply_central"
            )
        self._replicas, self._opt = regroup_replicas(
            self._replicas, self._opt, self.num_devices, k_new, self._new_optimizer
        )
        self.replicas_per_device = k_new
        self.num_learners = self.num_devices * k_new
        if alpha is not None:
            self.alpha = alpha

    def add_replica_per_device(self, alpha: float | None = None) -> None:
        """k ← k + 1: each device gets a copy of its last replica (see
        :meth:`set_replicas_per_device`)."""
        self.set_replicas_per_device(self.replicas_per_device + 1, alpha)

    def remove_replica_per_device(self, alpha: float | None = None) -> None:
        """k ← k − 1: each device drops its last replica (see
        :meth:`set_replicas_per_device`).

        Raises:
            ValueError: k is already 1.
        """
        if self.replicas_per_device == 1:
            raise ValueError("cannot remove a replica: each device holds only one")
        self.set_replicas_per_device(self.replicas_per_device - 1, alpha)

    def _new_optimizer(self, stack: Tensor) -> torch.optim.Optimizer:
        return build_optimizer(
            stack, self._make_optimizer, self.momentum, self.weight_decay, self.nesterov
        )

    def _config(self) -> dict[str, Any]:
        config = {
            "num_parameters": self.num_parameters,
            "num_learners": self.num_learners,
            "replicas_per_device": self.replicas_per_device,
            "alpha": self.alpha,
            "central_momentum": self.central_momentum,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }
        if self._make_optimizer is not None:
            config["optimizer"] = describe_optimizer(self._opt)
        return config

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: replicas ``[λ, P]``, z and z_prev ``[P]``, iteration, last lr (-1.0
        before the first step) and the replicas' optimizer state (SGD's momentum buffers;
        e.g. Adam's step, exp_avg and exp_avg_sq, of the stack's shape).

        Raises:
            RuntimeError: called between ``local_step`` and ``apply_central``.
        """
        if self._pending_central:
            raise RuntimeError("state_dict called between local_step and apply_central")
        return {
            "protocol": "SMA",
            "config": self._config(),
            "replicas": self._replicas.clone(),
            "central": self._z.clone(),
            "central_prev": self._z_prev.clone(),
            "iteration": self._iteration,
            "last_lr": self._last_lr,
            "optimizer": optimizer_state(self._opt),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from an SMA of the same configuration.
        """
        check_header(state, "SMA", self._config())
        load_vector("replicas", state["replicas"], self._replicas)
        load_vector("central", state["central"], self._z)
        load_vector("central_prev", state["central_prev"], self._z_prev)
        self._iteration = int(state["iteration"])
        self._last_lr = float(state["last_lr"])
        self._pending_central = False
        self._opt.state.clear()
        load_optimizer(self._opt, state["optimizer"])
