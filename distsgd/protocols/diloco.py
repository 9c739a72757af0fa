"""DiLoCo: local SGD whose averaged change is applied by an outer optimizer.

Rule (docs/protocols.md §6; Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato,
Szlam, Shen, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08455, Algorithm 1). λ replicas w_l and one outer model θ, all starting at
the initial weights::

    every iteration t = 1, 2, …:
        w_l ← opt_in(w_l, ∇ℓ(w_l; B_l), γ)       # the inner optimizer (torch.optim.SGD over
                                                  # the stack [λ, P], or make_optimizer's)
        if t mod H == 0:
            Δ ← (1/λ) Σ_l (θ − w_l)              # the mean pseudo-gradient: the one all-reduce
            θ ← opt_out(θ, Δ, η_out)              # the outer optimizer (default Nesterov SGD,
                                                  # η_out = 0.7, μ_out = 0.9: the paper's)
            w_l ← θ                               # inner optimizer state stays local

What the learners exchange is Δ (one ``[P]`` vector per H iterations, as local SGD's
average), and the all-reduce carries the pseudo-gradients θ − w_l rather than the
weights, so a compressed exchange rounds a change, not the weights. θ and the outer
optimizer's state are the same on every process (each applies the same Δ), so the
evaluation model is θ and needs no exchange.

Degenerate cases: outer SGD with η_out = 1 and μ_out = 0 is local SGD
(:class:`~distsgd.protocols.LocalSGD`: θ − (θ − mean w_l) = mean w_l, up to float32
rounding); with H = 1 as well, and no local momentum, it is hardsync (mean of the
steps = step of the mean, up to rounding).

Example (two replicas, H = 1, outer SGD η_out = 1, μ_out = 0: θ becomes their mean)::

    >>> import torch
    >>> from distsgd.protocols import DiLoCo
    >>> p = DiLoCo(torch.zeros(2), num_learners=2, average_every=1, outer_lr=1.0,
    ...            outer_momentum=0.0, outer_nesterov=False)
    >>> p.step(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), lr=1.0)
    >>> p.eval_weights(), p.learner_weights(1)
    (tensor([-2.,  0.]), tensor([-2.,  0.]))
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from ._util import (
    OptimizerFactory,
    build_optimizer,
    check_bool,
    check_float,
    check_header,
    check_vector,
    describe_optimizer,
    load_optimizer,
    load_vector,
    optimizer_state,
    optimizer_step,
)
from .base import AllReduce
from .local_sgd import LocalSGD

__all__ = ["DiLoCo"]


class DiLoCo(LocalSGD):
    """DiLoCo: H inner steps per replica, then the outer optimizer on the mean
    pseudo-gradient (docs/protocols.md §6).

    Args:
        initial: initial weights, shape ``[P]``, floating point; θ and every replica
            start here.
        num_learners: λ >= 1 replicas.
        average_every: H >= 1, inner steps between two outer steps.
        outer_lr: η_out > 0, the outer optimizer's learning rate (fixed: the schedule
            sets the inner rate γ only).
        outer_momentum: μ_out in [0, 1) of the default outer SGD.
        outer_nesterov: Nesterov outer momentum (requires ``outer_momentum > 0``).
        make_outer_optimizer: ``[θ] → torch.optim.Optimizer`` (see
            :data:`~distsgd.protocols.OptimizerFactory`) instead of outer SGD;
            ``outer_momentum`` and ``outer_nesterov`` must then be 0 / False. Its rate is
            set to ``outer_lr`` at every outer step.
        momentum: the inner optimizer's μ, as :class:`~distsgd.protocols.LocalSGD`'s.
        weight_decay: the inner optimizer's weight decay, as ``LocalSGD``'s.
        nesterov: the inner optimizer's Nesterov momentum, as ``LocalSGD``'s.
        replicas_per_device: k replicas batched on one device, as ``LocalSGD``'s.
        make_optimizer: the inner optimizer's factory, as ``LocalSGD``'s.

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    state_name: ClassVar[str] = "DiLoCo"

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        average_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        make_outer_optimizer: OptimizerFactory | None = None,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        replicas_per_device: int | None = None,
        make_optimizer: OptimizerFactory | None = None,
    ) -> None:
        super().__init__(
            initial,
            num_learners,
            average_every,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            replicas_per_device=replicas_per_device,
            make_optimizer=make_optimizer,
        )
        self.outer_lr = check_float("outer_lr", outer_lr, 0.0, min_inclusive=False)
        self.outer_momentum = check_float(
            "outer_momentum", outer_momentum, 0.0, 1.0, max_inclusive=False
        )
        self.outer_nesterov = check_bool("outer_nesterov", outer_nesterov)
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError(
                "outer_nesterov = True is not allowed with outer_momentum = 0: expected False"
            )
        if make_outer_optimizer is not None and (self.outer_momentum or self.outer_nesterov):
            raise ValueError(
                "outer_momentum and outer_nesterov are not allowed with make_outer_optimizer: "
                "expected 0 and False (they configure the default outer SGD)"
            )
        self._custom_outer = make_outer_optimizer is not None
        self._outer = self._replicas[0].clone()
        self._outer_opt = build_optimizer(
            self._outer, make_outer_optimizer, self.outer_momentum, 0.0, self.outer_nesterov
        )

    def exchange_step(self, grads: Tensor, lr: float) -> AllReduce | None:
        """:meth:`local_step`; at the end of an outer period the mean over every replica
        of the run of its pseudo-gradient θ − w_l (payload ``[λ, P]``), applied by
        :meth:`apply_outer` (None between outer steps).

        Args:
            grads: shape ``[num_learners, P]``; row l is replica l's gradient.
            lr: inner rate γ >= 0.

        Raises:
            ValueError: bad ``grads`` (shape, dtype, device) or ``lr``.
        """
        if not self.local_step(grads, lr):
            return None
        return self.period_exchange()

    def period_exchange(self) -> AllReduce:
        """The all-reduce that ends an outer period: the mean pseudo-gradient θ − w_l over
        every replica of the run ``[P]``, applied by :meth:`apply_outer`."""
        return AllReduce(self._outer - self._replicas, self.apply_outer, mean=True)

    def apply_outer(self, pseudo_gradient: Tensor) -> None:
        """``θ ← opt_out(θ, pseudo_gradient, η_out)``, then every replica ← θ (the inner
        optimizer's state stays local).

        Args:
            pseudo_gradient: Δ, the mean of θ − w_l over all replicas, shape ``[P]``.

        Raises:
            ValueError: bad shape, dtype or device.
        """
        check_vector("pseudo_gradient", pseudo_gradient, self._outer)
        optimizer_step(self._outer_opt, self._outer, pseudo_gradient, self.outer_lr)
        self._replicas.copy_(self._outer.expand_as(self._replicas))

    def eval_exchange(self) -> AllReduce | None:
        """None: the evaluation model θ is the same on every process."""
        return None

    def eval_weights(self) -> Tensor:
        """A copy of the outer model θ, shape ``[P]``."""
        return self._outer.clone()

    def _config(self) -> dict[str, Any]:
        config = super()._config()
        config.update(
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            outer_nesterov=self.outer_nesterov,
        )
        if self._custom_outer:
            config["outer_optimizer"] = describe_optimizer(self._outer_opt)
        return config

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: :class:`~distsgd.protocols.LocalSGD`'s, plus θ ``[P]`` and the outer
        optimizer's state (SGD's momentum buffer)."""
        state = super().state_dict()
        state.update(outer=self._outer.clone(), outer_optimizer=optimizer_state(self._outer_opt))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from a DiLoCo of the same configuration.
        """
        check_header(state, self.state_name, self._config())
        super().load_state_dict(state)
        load_vector("outer", state.get("outer"), self._outer)
        load_optimizer(self._outer_opt, state.get("outer_optimizer"))
