"""Synchronous SGD (hardsync, S-SGD): one update per iteration with the mean gradient.

Rule (docs/protocols.md §1; the synchronous baseline of Gupta, Zhang, Wang, "Model Accuracy and
Runtime Tradeoff in Distributed Deep Learning", ICDM 2016, arXiv:1509.04210, §3 "hardsync")::

    every learner l computes g_l = ∇ℓ(w; B_l) on the same weights w
    w ← SGD(w, (1/λ) Σ_l g_l, lr)          # torch.optim.SGD: momentum, weight decay, nesterov
                                           # (or the make_optimizer factory's optimizer)

With mean-loss gradients over disjoint minibatches of b samples this equals one learner
with batch λ·b; ``num_learners = 1`` is the plain training loop. Nothing in the rule
assumes SGD: any coordinate-wise torch.optim optimizer (``make_optimizer``, e.g. AdamW)
applied to the mean gradient equals that optimizer in a single-process loop with batch λ·b.

Backup learners (Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting Distributed
Synchronous SGD", 2016, arXiv:1604.00981, §3): λ + β learners compute on the same w; the
step uses the FIRST λ gradients to arrive and drops the late β::

    S = the first λ learners of the step's arrival order (a runtime's clock decides it)
    w ← SGD(w, (1/λ) Σ_{l ∈ S} g_l, lr)    # β gradients dropped per step

λ stays the number of gradients a step averages (its effective batch is λ·b samples, as
without backups); the run has λ + β learners. With β = 0 the rule is hardsync's above.

Example::

    >>> import torch
    >>> from distsgd.protocols import HardSync
    >>> p = HardSync(torch.zeros(3), num_learners=2)
    >>> p.step(torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]), lr=0.5)
    >>> p.eval_weights()
    tensor([-1., -1., -1.])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

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
    check_vector,
    describe_optimizer,
    load_optimizer,
    load_vector,
    optimizer_state,
    optimizer_step,
)
from .base import AllReduce, SynchronousProtocol

__all__ = ["HardSync"]


class HardSync(SynchronousProtocol):
    """Hardsync / plain SGD on one shared weight vector (docs/protocols.md §1).

    Args:
        initial: initial weights, shape ``[P]``, floating point (copied).
        num_learners: λ >= 1, gradients averaged by each iteration.
        backup_learners: β >= 0 further learners computing on the same weights; each
            iteration uses the first λ of the λ + β gradients (:meth:`first_arrivals`).
        momentum: μ in [0, 1) of torch.optim.SGD.
        weight_decay: L2 coefficient >= 0 (torch.optim.SGD's, added to the mean gradient).
        nesterov: Nesterov momentum; requires ``momentum > 0``.
        make_optimizer: ``[w] → torch.optim.Optimizer`` (see
            :data:`~distsgd.protocols.OptimizerFactory`) applied to the weights instead
            of SGD; ``momentum``, ``weight_decay`` and ``nesterov`` must then stay 0 /
            False. None (default): torch.optim.SGD with those settings.

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    shares_weights = True

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        make_optimizer: OptimizerFactory | None = None,
        backup_learners: int = 0,
    ) -> None:
        self._w = check_initial(initial)
        self.num_learners = check_int("num_learners", num_learners, 1)
        self.backup_learners = check_int("backup_learners", backup_learners, 0)
        self.momentum, self.weight_decay, self.nesterov = check_optimizer_args(
            make_optimizer, momentum, weight_decay, nesterov
        )
        self._custom_optimizer = make_optimizer is not None
        self._opt = build_optimizer(
            self._w, make_optimizer, self.momentum, self.weight_decay, self.nesterov
        )
        self._iteration = 0

    @property
    def num_parameters(self) -> int:
        """P, the length of the flat weight vector."""
        return self._w.numel()

    @property
    def num_computing(self) -> int:
        """λ + β, the learners that compute a gradient each iteration."""
        return self.num_learners + self.backup_learners

    def learner_weights(self, learner: int) -> Tensor:
        """The shared weights, shape ``[P]`` (a view: do not modify).

        Raises:
            ValueError: ``learner`` not in ``[0, num_computing)``.
        """
        check_index("learner", learner, self.num_computing)
        return self._w

    def first_arrivals(self, order: Sequence[int]) -> list[int]:
        """The learners whose gradients this iteration averages: the first λ of ``order``,
        sorted; the other β are dropped (Chen et al. 2016, arXiv:1604.00981, §3).

        Args:
            order: every learner ``0 … λ+β−1`` once, in the order its gradient arrived.

        Raises:
            ValueError: ``order`` is not a permutation of ``range(num_computing)``.
        """
        if sorted(order) != list(range(self.num_computing)):
            raise ValueError(
                f"order = {list(order)!r} is not allowed: expected each learner "
                f"0 … {self.num_computing - 1} once"
            )
        return sorted(order[: self.num_learners])

    def exchange_step(self, grads: Tensor, lr: float) -> AllReduce:
        """The mean of ``grads`` over every learner of the run, applied by
        :meth:`apply_mean_gradient` (:meth:`step`: ``w ← opt(w, grads.mean(0), lr)``).

        Args:
            grads: shape ``[num_learners, P]``, same dtype and device as the weights; row l
                is learner l's mean-loss gradient at :meth:`learner_weights`.
            lr: learning rate α0 >= 0.

        Raises:
            ValueError: wrong shape, dtype or device of ``grads`` (a bad ``lr`` from the
                all-reduce's ``apply``).
        """
        check_vector("grads", grads, self._w.expand(self.num_learners, -1))
        return AllReduce(grads, functools.partial(self.apply_mean_gradient, lr=lr), mean=True)

    def apply_mean_gradient(self, grad: Tensor, lr: float) -> None:
        """Apply ``w ← opt(w, grad, lr)`` with the learners' mean gradient already reduced
        (by an all-reduce, or by one forward/backward over their concatenated minibatches).

        Args:
            grad: shape ``[P]``.
            lr: learning rate α0 >= 0.

        Raises:
            ValueError: wrong shape, dtype or device of ``grad``, or a bad ``lr``.
        """
        lr = check_lr(lr)
        check_vector("grad", grad, self._w)
        optimizer_step(self._opt, self._w, grad, lr)
        self._iteration += 1

    def eval_weights(self) -> Tensor:
        """A copy of the weights, shape ``[P]``."""
        return self._w.clone()

    def _config(self) -> dict[str, Any]:
        config = {
            "num_parameters": self.num_parameters,
            "num_learners": self.num_learners,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }
        if self.backup_learners:
            config["backup_learners"] = self.backup_learners
        if self._custom_optimizer:
            config["optimizer"] = describe_optimizer(self._opt)
        return config

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: weights ``[P]``, iteration count and the optimizer's per-parameter
        state (SGD's momentum buffer; e.g. Adam's step, exp_avg and exp_avg_sq)."""
        return {
            "protocol": "HardSync",
            "config": self._config(),
            "weights": self._w.clone(),
            "iteration": self._iteration,
            "optimizer": optimizer_state(self._opt),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from a HardSync of the same configuration.
        """
        check_header(state, "HardSync", self._config())
        load_vector("weights", state["weights"], self._w)
        self._iteration = int(state["iteration"])
        load_optimizer(self._opt, state["optimizer"])
