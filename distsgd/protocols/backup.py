"""Hardsync with backup learners, served: the first λ gradients of a version form the step.

Rule (Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting Distributed Synchronous SGD", 2016,
arXiv:1604.00981, §3; docs/protocols.md "Backup learners"). A server holds w at version v;
each of the λ + β learners pulls (w, v), computes g on its minibatch and pushes (g, v_pulled)::

    v_pulled == v:  buffer g; that learner pulls again once v + 1 is applied
                    the λ-th buffered g applies
                        w ← opt(w, (1/λ) Σ_{l ∈ S} g_l, lr)    # S: the first λ, in learner order
                        v ← v + 1                              # HardSync.apply_mean_gradient
    v_pulled <  v:  g is dropped (counted in dropped_gradients); the learner pulls v at once

This is :class:`~distsgd.protocols.HardSync`'s backup rule (:meth:`HardSync.first_arrivals`)
with the arrival order that of the pushes at a real server; the step goes through a
:class:`HardSync` object, so with the same chosen λ gradients the weights equal
``HardSync.step`` on them (same optimizer, momentum, schedule). Every applied gradient has
staleness 0. A lost learner leaves no gap while λ learners are left (:attr:`workers_needed`).

Example (λ = 2, β = 1; learner 2's gradient comes late and is dropped)::

    >>> import torch
    >>> from distsgd.protocols import BackupHardSync
    >>> p = BackupHardSync(torch.zeros(2), num_learners=2, backup_learners=1)
    >>> p.push(1, torch.ones(2), 0, lr=0.5) is None
    True
    >>> p.push(0, torch.ones(2) * 3, 0, lr=0.5).clock
    [(1, 0), (0, 0)]
    >>> p.push(2, torch.ones(2), 0, lr=0.5), p.dropped_gradients
    (None, 1)
    >>> p.eval_weights()
    tensor([-1., -1.])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._util import OptimizerFactory, check_header, check_index, check_int, check_vector
from .base import AsynchronousProtocol, Update
from .hardsync import HardSync

__all__ = ["BackupHardSync"]


class BackupHardSync(AsynchronousProtocol):
    """Hardsync with β backup learners as a parameter-server protocol (see the module).

    Workers are the λ + β learners (``num_workers``).

    Args:
        initial: initial weights, shape ``[P]``, floating point (copied).
        num_learners: λ >= 1, gradients each step averages.
        backup_learners: β >= 0 further learners.
        momentum: μ in [0, 1) of torch.optim.SGD.
        weight_decay: L2 coefficient >= 0 of torch.optim.SGD.
        nesterov: Nesterov momentum; requires ``momentum > 0``.
        make_optimizer: ``[w] → torch.optim.Optimizer`` instead of SGD (as
            :class:`HardSync`'s); None (default): SGD.

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        backup_learners: int,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        make_optimizer: OptimizerFactory | None = None,
    ) -> None:
        self._sync = HardSync(
            initial,
            num_learners,
            momentum,
            weight_decay,
            nesterov,
            make_optimizer,
            backup_learners=backup_learners,
        )
        self.num_learners = self._sync.num_learners
        self.backup_learners = self._sync.backup_learners
        self.num_workers = self._sync.num_computing
        self.workers_needed = self.num_learners
        self._buffer: list[tuple[int, Tensor]] = []
        self._pushed = [False] * self.num_workers
        self.dropped_gradients = 0

    @property
    def version(self) -> int:
        """Steps applied so far."""
        return self._sync.iteration

    @property
    def staleness_counts(self) -> dict[int, int]:
        """Every applied gradient has staleness 0: ``{0: num_gradients}``."""
        return {0: self.num_gradients} if self.num_gradients else {}

    @property
    def num_gradients(self) -> int:
        """Gradients applied so far (λ per step)."""
        return self.version * self.num_learners

    def can_pull(self, worker: int) -> bool:
        """False after ``worker`` pushed for the current version, until it is applied.

        Raises:
            ValueError: ``worker`` not in ``[0, λ + β)``.
        """
        check_index("worker", worker, self.num_workers)
        return not self._pushed[worker]

    def pull(self, worker: int) -> tuple[Tensor, int]:
        """A copy of the weights ``[P]`` and their version.

        Raises:
            ValueError: ``worker`` not in ``[0, λ + β)``.
            RuntimeError: ``can_pull(worker)`` is False.
        """
        if not self.can_pull(worker):
            raise RuntimeError(
                f"learner {worker} cannot pull: it pushed for version {self.version} and "
                "that step is not applied yet"
            )
        return self._sync.eval_weights(), self.version

    def push(self, worker: int, grad: Tensor, version: int, lr: float) -> Update | None:
        """Hand in ``worker``'s gradient ``[P]`` computed on weights of ``version``.

        Returns the :class:`Update` when this is the λ-th gradient of the current version
        (the step is applied), else None (buffered, or dropped when ``version`` is older).

        Raises:
            ValueError: ``worker``, ``grad`` (shape, dtype, device), ``version`` (not in
                ``[0, version]``) or ``lr`` outside the allowed values.
            RuntimeError: ``worker`` already pushed for the current version.
        """
        check_index("worker", worker, self.num_workers)
        check_vector("grad", grad, self._sync.learner_weights(0))
        check_int("version", version, 0)
        if version > self.version:
            raise ValueError(
                f"version = {version} is not allowed: expected an integer in "
                f"[0, {self.version}] (the server's current version)"
            )
        if version < self.version:
            self.dropped_gradients += 1
            return None
        if self._pushed[worker]:
            raise RuntimeError(
                f"learner {worker} already pushed a gradient for version {self.version}"
            )
        self._pushed[worker] = True
        self._buffer.append((worker, grad.detach().clone()))
        if len(self._buffer) < self.num_learners:
            return None
        clock = [(w, version) for w, _ in self._buffer]
        grads = torch.stack([g for _, g in sorted(self._buffer, key=lambda e: e[0])])
        self._sync.step(grads, lr)
        self._buffer = []
        self._pushed = [False] * self.num_workers
        n = self.num_learners
        return Update(self.version, clock, [0] * n, lr, [1.0] * n)

    def eval_weights(self) -> Tensor:
        """A copy of the server's weights, shape ``[P]``."""
        return self._sync.eval_weights()

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: the hardsync state (weights, steps, optimizer), the gradients buffered
        for the current version with their learners, and the dropped count."""
        return {
            "protocol": "BackupHardSync",
            "config": {"num_workers": self.num_workers},
            "hardsync": self._sync.state_dict(),
            "buffer": [g.clone() for _, g in self._buffer],
            "buffer_workers": [w for w, _ in self._buffer],
            "dropped_gradients": self.dropped_gradients,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from a BackupHardSync of the same configuration.
        """
        check_header(state, "BackupHardSync", {"num_workers": self.num_workers})
        workers = [int(w) for w in state["buffer_workers"]]
        if len(workers) != len(state["buffer"]) or len(workers) >= self.num_learners:
            raise ValueError("state['buffer'] holds an inconsistent number of gradients")
        w0 = self._sync.learner_weights(0)
        # a checkpoint is read onto the CPU (map_location): gradients go to the weights' device
        buffer = [g.to(w0.device) for g in state["buffer"]]
        for g in buffer:
            check_vector("state['buffer'] entry", g, w0)
        self._sync.load_state_dict(state["hardsync"])
        self._buffer = [(w, g.clone()) for w, g in zip(workers, buffer, strict=True)]
        self._pushed = [w in workers for w in range(self.num_workers)]
        self.dropped_gradients = int(state["dropped_gradients"])
