"""Omnivore compute groups: synchronous inside a group, asynchronous across groups.

Rule (docs/protocols.md §3; Hadjis, Zhang, Mitliagkas, Iter, Ré, "Omnivore: An Optimizer for
Multi-device Deep Learning on CPUs and GPUs", arXiv:1606.04487, compute groups). The λ
learners form g groups of λ/g consecutive learners (group j = learners
``j·λ/g … (j+1)·λ/g − 1``). The workers of this protocol are the groups::

    group j pulls (w, i); each member computes a gradient on that w;
    the runtime pushes their mean ḡ_j = (g/λ) Σ_{l ∈ j} g_l with i
    the server applies every push at once (c = 1):   w ← SGD(w, ḡ_j, α), i ← i + 1
                                     (SGD, or the make_optimizer factory's optimizer)

This is a :class:`ParameterServer` with ``num_learners = g`` and ``softsync = g``; its
staleness-dependent rates apply per group push (``softsync`` means α0/g). g = 1 is
hardsync with λ learners; g = λ is asynchronous SGD.

Asynchrony begets momentum (Mitliagkas, Zhang, Hadjis, Ré, arXiv:1605.09774): g
asynchronous groups add implicit momentum ≈ 1 − 1/g, so with ``momentum_compensation``
the server uses the explicit momentum ``max(0, μ − (1 − 1/g))`` for a target μ. This
compensation assumes the server's optimizer is SGD with momentum μ: it is not allowed with
``make_optimizer`` (the groups themselves run with any coordinate-wise optimizer).

Example (two groups of two learners)::

    >>> import torch
    >>> from distsgd.protocols import ComputeGroups
    >>> cg = ComputeGroups(torch.zeros(2), num_learners=4, num_groups=2, momentum=0.9,
    ...                    momentum_compensation=True)
    >>> cg.members(1), cg.group_of(1), round(cg.explicit_momentum, 6)
    ([2, 3], 0, 0.4)
    >>> w, v = cg.pull(1)
    >>> member_grads = torch.tensor([[1.0, 0.0], [3.0, 2.0]])
    >>> cg.push(1, member_grads.mean(0), v, lr=0.5).clock
    [(1, 0)]
    >>> cg.eval_weights()
    tensor([-1.0000, -0.5000])
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

from ._util import (
    SERVER_OPTIMIZERS,
    OptimizerFactory,
    check_bool,
    check_choice,
    check_header,
    check_index,
    check_int,
    check_optimizer_args,
)
from .base import AsynchronousProtocol, Update
from .parameter_server import ParameterServer

__all__ = ["ComputeGroups"]


class ComputeGroups(AsynchronousProtocol):
    """Omnivore compute groups over a parameter server (docs/protocols.md §3).

    Workers are the groups (``num_workers == num_groups``); ``Update.clock`` holds
    ``(group, version_pulled)`` pairs.

    Args:
        initial: initial weights, shape ``[P]``, floating point (copied).
        num_learners: λ >= 1.
        num_groups: g, a divisor of λ.
        staleness_lr: as :class:`ParameterServer` (``"softsync"`` gives α0/g).
        optimizer: ``"sgd"`` or ``"adagrad"`` (server optimizer).
        momentum: μ in [0, 1): the explicit momentum, or the target momentum when
            ``momentum_compensation``; must be 0 for ``"adagrad"``.
        weight_decay: L2 coefficient >= 0.
        momentum_compensation: use ``max(0, μ − (1 − 1/g))`` as explicit momentum.
        nesterov: Nesterov momentum; requires ``momentum > 0``. It is dropped, with a
            warning, when the compensated momentum is 0.
        make_optimizer: the server's optimizer instead of SGD, as
            :class:`ParameterServer`'s (``momentum``, ``weight_decay``, ``nesterov`` and
            ``momentum_compensation`` must then stay 0 / False).

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        num_groups: int,
        staleness_lr: str = "none",
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        momentum_compensation: bool = False,
        nesterov: bool = False,
        make_optimizer: OptimizerFactory | None = None,
    ) -> None:
        self.num_learners = check_int("num_learners", num_learners, 1)
        self.num_groups = check_int("num_groups", num_groups, 1)
        if num_groups > num_learners or num_learners % num_groups:
            raise ValueError(
                f"num_groups = {num_groups!r} is not allowed: expected a divisor of "
                f"num_learners = {num_learners}"
            )
        self.group_size = num_learners // num_groups
        check_choice("optimizer", optimizer, SERVER_OPTIMIZERS)
        self.momentum, weight_decay, nesterov = check_optimizer_args(
            make_optimizer, momentum, weight_decay, nesterov
        )
        self.momentum_compensation = check_bool("momentum_compensation", momentum_compensation)
        if momentum_compensation and make_optimizer is not None:
            raise ValueError(
                "momentum_compensation = True is not allowed with make_optimizer: expected "
                "False (the compensation lowers the server's SGD momentum)"
            )
        if momentum_compensation:
            explicit = max(0.0, self.momentum - (1.0 - 1.0 / num_groups))
        else:
            explicit = self.momentum
        if nesterov and explicit == 0:
            warnings.warn(
                f"nesterov = True has no effect: the compensated momentum for "
                f"num_groups = {num_groups} is 0",
                stacklevel=2,
            )
        self._server = ParameterServer(
            initial,
            num_learners=num_groups,
            softsync=num_groups,
            barrier=False,
            staleness_lr=staleness_lr,
            optimizer=optimizer,
            momentum=explicit if optimizer == "sgd" else self.momentum,
            weight_decay=weight_decay,
            nesterov=nesterov and explicit > 0,
            make_optimizer=make_optimizer,
        )

    # ---- layout -------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Group indices assigned so far (active or retired); a joining group gets the next."""
        return self._server.num_workers

    @property
    def active_workers(self) -> list[int]:
        """Groups that may pull and push now, increasing; g is their number."""
        return self._server.active_workers

    def admit(self) -> int:
        """Add a whole compute group of ``group_size`` learners (numbered after every
        learner so far); it pulls next. Returns its group index. The server's rule is
        asynchronous across groups, so g and the ``softsync`` rate follow the active groups
        (:meth:`ParameterServer.admit`)."""
        return self._server.admit()

    def retire(self, worker: int) -> None:
        """Remove active group ``worker`` (all its learners).

        Raises:
            ValueError: ``worker`` is not an active group.
            RuntimeError: it is the last group.
        """
        self._server.retire(worker)

    def group_of(self, learner: int) -> int:
        """The group of ``learner``.

        Raises:
            ValueError: ``learner`` not in ``[0, num_workers · group_size)``.
        """
        check_index("learner", learner, self.num_workers * self.group_size)
        return learner // self.group_size

    def members(self, group: int) -> list[int]:
        """The learners of ``group``, consecutive and increasing.

        Raises:
            ValueError: ``group`` not in ``[0, num_workers)``.
        """
        check_index("group", group, self.num_workers)
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    @property
    def explicit_momentum(self) -> float:
        """The momentum the server's SGD uses (compensated if ``momentum_compensation``)."""
        return self._server.momentum

    @property
    def server(self) -> ParameterServer:
        """The underlying parameter server (workers = groups); do not push to it directly."""
        return self._server

    # ---- delegated protocol -------------------------------------------------------------
    @property
    def version(self) -> int:
        """Updates (group pushes) applied so far."""
        return self._server.version

    @property
    def staleness_lr(self) -> str:
        """The staleness-dependent learning-rate rule of the server."""
        return self._server.staleness_lr

    @property
    def optimizer(self) -> str:
        """The server optimizer's name, ``"sgd"`` (SGD or the ``make_optimizer`` factory's)
        or ``"adagrad"``."""
        return self._server.optimizer

    @property
    def weight_decay(self) -> float:
        """L2 coefficient of the server optimizer."""
        return self._server.weight_decay

    @property
    def staleness_counts(self) -> dict[int, int]:
        """Histogram ``{σ: number of applied group gradients with that staleness}``."""
        return self._server.staleness_counts

    @property
    def num_gradients(self) -> int:
        """Group gradients applied so far (equals :attr:`version`)."""
        return self._server.num_gradients

    @property
    def staleness_mean(self) -> float:
        """Mean σ over all applied group gradients, in updates (0.0 before the first)."""
        return self._server.staleness_mean

    @property
    def staleness_max(self) -> int:
        """Largest σ applied so far, in updates (0 before the first)."""
        return self._server.staleness_max

    def can_pull(self, worker: int) -> bool:
        """Always True (no barrier across groups).

        Raises:
            ValueError: ``worker`` not in ``[0, num_groups)``.
        """
        return self._server.can_pull(worker)

    def pull(self, worker: int) -> tuple[Tensor, int]:
        """Weights (a copy, shape ``[P]``) and version for group ``worker``.

        Raises:
            ValueError: ``worker`` not in ``[0, num_groups)``.
        """
        return self._server.pull(worker)

    def push(self, worker: int, grad: Tensor, version: int, lr: float) -> Update:
        """Apply group ``worker``'s mean gradient (shape ``[P]``) computed on ``version``.

        Every push completes an update (c = 1), so an :class:`Update` is always returned.

        Raises:
            ValueError: as :meth:`ParameterServer.push`.
        """
        update = self._server.push(worker, grad, version, lr)
        assert update is not None  # c = 1
        return update

    def eval_weights(self) -> Tensor:
        """A copy of the server's weights, shape ``[P]``."""
        return self._server.eval_weights()

    def _config(self) -> dict[str, Any]:
        return {
            "num_learners": self.num_learners,
            "num_groups": self.num_groups,
            "momentum": self.momentum,
            "momentum_compensation": self.momentum_compensation,
        }

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: the layout and the parameter server's state (``"server"``)."""
        return {
            "protocol": "ComputeGroups",
            "config": self._config(),
            "server": self._server.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from a ComputeGroups of the same configuration.
        """
        check_header(state, "ComputeGroups", self._config())
        self._server.load_state_dict(state["server"])
