"""Protocol base classes: pure update rules on flat parameter vectors (sans-IO).

A protocol is state plus update rules. It never sleeps, sends, spawns or reads a clock; a
runtime (the simulated cluster or real processes) calls it. All tensors are flat float32
vectors of the model's P parameters (shape ``[P]``) or stacks of them (``[λ, P]``).
All state lives in ``state_dict()``, whose values are tensors, numbers, strings and
lists/dicts of them, so a checkpoint loads with ``torch.load(weights_only=True)``.

Two families:

* :class:`SynchronousProtocol` — lock-step: every iteration each learner computes one
  gradient on ``learner_weights(l)`` and the runtime calls ``step(grads, lr)`` once with all
  of them (hardsync, SMA, local SGD, plain). What the learners exchange is stated apart
  from how it travels (DESIGN.md, "Communication once"): :meth:`SynchronousProtocol.
  exchange_step` does the local work and names the :class:`AllReduce` the iteration
  needs; each runtime carries it out in its own way (in one process, over c10d, in the
  drop-in).
* :class:`AsynchronousProtocol` — a parameter server: learners ``pull``, compute, ``push``
  at their own pace (Rudra's n-softsync / async / hardsync, Omnivore's compute groups).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = [
    "AllReduce",
    "Protocol",
    "SynchronousProtocol",
    "AsynchronousProtocol",
    "Update",
    "make_sgd",
]


def _eager(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` without the wrappers torch puts around it for torch.compile (found
    through ``__wrapped__``, as :func:`functools.wraps` leaves it); ``method`` itself when
    it has none."""
    return inspect.unwrap(method)


class EagerSGD(torch.optim.SGD):
    """torch.optim.SGD, its update and state untouched, whose methods skip torch.compile's
    guards.

    torch wraps ``Optimizer.__init__``'s ``add_param_group``, ``step``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` in ``torch._disable_dynamo`` /
    ``_use_grad_for_differentiable``, which import ``torch._dynamo`` on first call
    (seconds of start-up in every process). A protocol's optimizer is never traced by
    torch.compile, so those guards do nothing here: this class calls the functions they
    wrap, and ``step`` runs under ``torch.no_grad()`` as the guard does for a
    non-differentiable optimizer.
    """

    add_param_group = _eager(torch.optim.SGD.add_param_group)
    zero_grad = _eager(torch.optim.SGD.zero_grad)
    state_dict = _eager(torch.optim.SGD.state_dict)
    load_state_dict = _eager(torch.optim.SGD.load_state_dict)
    _step = _eager(torch.optim.SGD.step)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One torch.optim.SGD step (see :meth:`torch.optim.SGD.step`)."""
        with torch.no_grad():
            return self._step(closure)


def make_sgd(
    param: Tensor, lr: float, momentum: float, weight_decay: float, nesterov: bool = False
) -> torch.optim.SGD:
    """torch.optim.SGD (as :class:`EagerSGD`) over one flat (or stacked ``[λ, P]``) tensor.

    Momentum and weight decay are elementwise, so one optimizer over a ``[λ, P]`` stack
    updates λ replicas independently, exactly as λ separate optimizers would.
    """
    return EagerSGD([param], lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce a synchronous protocol asks of its runtime, and what to do with the
    result (sans-IO: the protocol names the tensor, the runtime moves it).

    The run's total is taken over the rows of every process's payload: their sum, or with
    ``mean`` their sum divided by the number of rows of all processes. A protocol object
    that holds every learner of the run (one process) reduces its rows alone:
    :meth:`reduce_here`.

    Attributes:
        payload: shape ``[R, P]``: one row per learner or device the protocol object holds
            (may be a view of its state: a runtime reads it, never writes it).
        apply: the protocol's rule for the run's total, shape ``[P]``; its return value
            is handed back to the runtime's caller (e.g. an evaluation model).
        mean: False: the total is the sum of the rows; True: their mean.
    """

    payload: Tensor
    apply: Callable[[Tensor], Any]
    mean: bool = False

    def reduce_here(self) -> Tensor:
        """The total of this process's rows alone, shape ``[P]`` (a new tensor)."""
        return self.payload.mean(0) if self.mean else self.payload.sum(0)


class Protocol(ABC):
    """What every protocol offers its runtime: its learners, its family (:attr:`served`),
    its progress, its evaluation model and its state."""

    num_learners: int
    served: ClassVar[bool]
    """True: a runtime serves it from a parameter server (:class:`AsynchronousProtocol`'s
    pull / push); False: lock step (:class:`SynchronousProtocol`'s exchange_step)."""

    @property
    @abstractmethod
    def iteration(self) -> int:
        """Iterations (synchronous) or updates (parameter server) applied so far."""

    @abstractmethod
    def eval_weights(self) -> Tensor:
        """The model this protocol defines for evaluation, shape ``[P]``."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """A snapshot (tensors cloned) of all state; survives ``torch.load(weights_only=True)``."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; continuing is then bit-identical to never saving.

        Raises:
            ValueError: ``state`` comes from another protocol class or configuration, or a
                tensor in it has the wrong shape.
        """


class SynchronousProtocol(Protocol):
    """Lock-step protocol over ``num_learners`` learners.

    Each iteration the runtime computes, for every learner ``l``, the mean-loss gradient of
    its minibatch at ``learner_weights(l)`` and calls :meth:`exchange_step`, then carries
    out the :class:`AllReduce` it returns over every process of the run (:meth:`step` is
    both in one process).

    Learners that all compute on one weight vector (``shares_weights``) exchange the mean
    of their gradients before the update: a runtime may compute that mean by its own path
    (one forward/backward over the learners' concatenated minibatches; DDP's all-reduce of
    gradient buckets during backward) and hand it to :meth:`apply_mean_gradient`.
    """

    served = False
    shares_weights: ClassVar[bool] = False
    """True: every learner computes on ``learner_weights(0)`` and the iteration's exchange
    is the mean gradient (:meth:`apply_mean_gradient`)."""
    steps_outside: ClassVar[bool] = False
    """True: a single learner's step may be taken outside the protocol and given as its new
    weights (:meth:`local_step_to`, then :meth:`period_exchange` when it returns True)."""

    @abstractmethod
    def learner_weights(self, learner: int) -> Tensor:
        """Weights, shape ``[P]``, that ``learner`` computes its next gradient on.

        May be a view of internal state: callers must not modify it.
        """

    @property
    def replicas(self) -> Tensor:
        """Every learner's weights, shape ``[num_learners, P]`` (a view where the protocol
        holds them as one stack: do not modify)."""
        return torch.stack([self.learner_weights(j) for j in range(self.num_learners)])

    @abstractmethod
    def exchange_step(self, grads: Tensor, lr: float) -> AllReduce | None:
        """The local part of one iteration, and the all-reduce it needs.

        Args:
            grads: shape ``[num_learners, P]``; row l is learner l's gradient at
                ``learner_weights(l)``.
            lr: base learning rate for this iteration (from the schedule).

        Returns:
            The :class:`AllReduce` whose total completes the iteration (its ``apply``
            must run before the next call), or None when the iteration exchanges nothing.
        """

    def step(self, grads: Tensor, lr: float) -> None:
        """Apply one iteration in one process: :meth:`exchange_step`, its all-reduce over
        this object's rows (:meth:`AllReduce.reduce_here`) and its rule.

        Args:
            grads: shape ``[num_learners, P]``; row l is learner l's gradient at
                ``learner_weights(l)``.
            lr: base learning rate for this iteration (from the schedule).
        """
        exchange = self.exchange_step(grads, lr)
        if exchange is not None:
            exchange.apply(exchange.reduce_here())

    def apply_mean_gradient(self, grad: Tensor, lr: float) -> None:
        """Apply the learners' mean gradient ``[P]``, reduced by the runtime (protocols
        with ``shares_weights`` only).

        Raises:
            NotImplementedError: the learners do not share one weight vector.
        """
        raise NotImplementedError(f"{type(self).__name__} learners do not share weights")

    backup_learners: int = 0
    """β learners that compute beside the ``num_learners`` each iteration and whose
    gradients arrive too late to count (hardsync's backup learners); 0: none."""

    def first_arrivals(self, order: Sequence[int]) -> list[int]:
        """The learners whose gradients an iteration with backup learners averages, given
        every learner in arrival ``order`` (protocols with ``backup_learners`` only).

        Raises:
            NotImplementedError: the protocol has no backup learners.
        """
        raise NotImplementedError(f"{type(self).__name__} has no backup learners")

    def local_step_to(self, weights: Tensor) -> bool:
        """One iteration of the only learner, stepped outside the protocol: its weights
        become ``weights`` ``[P]``; True when the iteration ends with an exchange
        (:meth:`period_exchange`). Protocols with ``steps_outside`` only.

        Raises:
            NotImplementedError: the protocol's step cannot be taken outside it.
        """
        raise NotImplementedError(f"{type(self).__name__} takes no step from outside")

    def period_exchange(self) -> AllReduce:
        """The all-reduce that ends the iteration after :meth:`local_step_to` returned
        True. Protocols with ``steps_outside`` only.

        Raises:
            NotImplementedError: the protocol's step cannot be taken outside it.
        """
        raise NotImplementedError(f"{type(self).__name__} takes no step from outside")

    def begin_iteration(self, lr: float) -> bool:
        """Prepare the learners for an iteration at rate ``lr``; True when their weights
        were reset to ``learner_weights`` and a local optimizer outside the protocol (the
        drop-in's) must clear its state too. :meth:`exchange_step` calls it first; the
        default resets nothing."""
        return False

    def eval_exchange(self) -> AllReduce | None:
        """The all-reduce that gives the evaluation model when this object holds only some
        of the run's learners (its ``apply`` returns the model ``[P]``), or None when
        :meth:`eval_weights` is the run's model on every process."""
        return None

    @property
    def iteration(self) -> int:
        """Iterations applied so far."""
        return self._iteration  # type: ignore[attr-defined]


@dataclass
class Update:
    """One update applied by a parameter server (Rudra's vector clock of that update).

    Attributes:
        version: server version after this update (the first update gives 1).
        clock: ``(learner, version_pulled)`` of every gradient aggregated, in arrival order.
        staleness: σ of each of those gradients: the server version the update was applied
            to (``version - 1``) minus the version the gradient was computed on.
        lr: effective learning rate used (after staleness modulation; for
            ``per_gradient`` the base rate α0, the per-gradient factors being in
            ``scales``).
        scales: per-gradient multipliers applied before averaging (1.0 unless
            ``per_gradient``).
    """

    version: int
    clock: list[tuple[int, int]]
    staleness: list[int]
    lr: float
    scales: list[float] = field(default_factory=list)


class AsynchronousProtocol(Protocol):
    """A parameter server (Rudra ICDM 2016 §3): learners pull, compute and push at their pace.

    ``workers`` are the units that pull and push: learners for the parameter server,
    compute groups for Omnivore.
    """

    num_workers: int
    served = True
    barrier: bool = False
    """True: a worker that pushed pulls again only once the update is applied (hardsync
    through the server; :meth:`can_pull`)."""
    workers_needed: int = 1
    """Workers an update needs: a server that has fewer left (the others lost) cannot go on
    (hardsync with β backup learners: λ of the λ + β)."""

    def members(self, worker: int) -> list[int]:
        """The learners whose mean gradient ``worker`` pushes (a compute group's members;
        by default the worker alone)."""
        return [worker]

    @property
    def active_workers(self) -> list[int]:
        """Workers that may pull and push now, increasing (all of them unless the
        protocol admits and retires workers: :meth:`admit`, :meth:`retire`)."""
        return list(range(self.num_workers))

    def admit(self) -> int:
        """Add a worker to a running protocol and return its index (docs/elastic.md).

        Raises:
            RuntimeError: the protocol's membership is fixed (this default).
        """
        raise RuntimeError(
            f"{type(self).__name__} has a fixed membership: a worker cannot join a running run"
        )

    def retire(self, worker: int) -> Update | None:
        """Remove ``worker`` from a running protocol; returns the update its leaving
        completed, if any (docs/elastic.md).

        Raises:
            RuntimeError: the protocol's membership is fixed (this default).
        """
        raise RuntimeError(
            f"{type(self).__name__} has a fixed membership: worker {worker} cannot leave a "
            "running run"
        )

    def reset_membership(self, num_workers: int) -> None:
        """Make workers ``0 … num_workers − 1`` the active ones and forget later indices
        (a run resumed with the workers it was launched with; docs/elastic.md).

        Raises:
            RuntimeError: the protocol's membership is fixed (this default).
        """
        raise RuntimeError(
            f"{type(self).__name__} has a fixed membership: it cannot be reset to "
            f"{num_workers} workers"
        )

    @property
    @abstractmethod
    def version(self) -> int:
        """Updates applied so far."""

    @property
    def iteration(self) -> int:
        """Updates applied so far (:attr:`version`; a synchronous protocol's iterations)."""
        return self.version

    @property
    @abstractmethod
    def staleness_counts(self) -> dict[int, int]:
        """Histogram of the staleness of every gradient applied so far: ``{σ: count}``."""

    @property
    @abstractmethod
    def num_gradients(self) -> int:
        """Gradients applied so far (pushes that are part of an applied update)."""

    @property
    def staleness_mean(self) -> float:
        """Mean σ over all gradients applied so far, in updates (0.0 before the first)."""
        counts = self.staleness_counts
        n = sum(counts.values())
        return sum(s * c for s, c in counts.items()) / n if n else 0.0

    @property
    def staleness_max(self) -> int:
        """Largest σ applied so far, in updates (0 before the first)."""
        return max(self.staleness_counts, default=0)

    @abstractmethod
    def pull(self, worker: int) -> tuple[Tensor, int]:
        """Current weights (a copy, shape ``[P]``) and the version they carry.

        Raises:
            RuntimeError: under a barrier (hardsync) when ``can_pull(worker)`` is False.
        """

    @abstractmethod
    def can_pull(self, worker: int) -> bool:
        """False while a barrier holds ``worker`` back (hardsync: it has pushed for the
        current version and the update is not yet applied)."""

    @abstractmethod
    def push(self, worker: int, grad: Tensor, version: int, lr: float) -> Update | None:
        """Hand the server a gradient (shape ``[P]``) computed on weights of ``version``.

        Returns the :class:`Update` if this push completed one, else None (buffered).
        ``lr`` is the base rate α0 from the schedule at this moment.
        """

    @abstractmethod
    def eval_weights(self) -> Tensor:
        """The server's current weights, shape ``[P]``."""
