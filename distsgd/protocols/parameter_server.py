"""Rudra's parameter server: hardsync, n-softsync and async SGD with staleness accounting.

Rule (docs/protocols.md §2; Gupta, Zhang, Wang, "Model Accuracy and Runtime Tradeoff in Distributed
Deep Learning: A Systematic Study", ICDM 2016, arXiv:1509.04210, §3 synchronisation
protocols and staleness-dependent learning rate). The server holds w and a version i
(updates applied so far). A learner pulls (w, i), computes Δ, pushes (Δ, i_pulled)::

    buffer (Δ, learner, i_pulled)
    when c = ⌊λ/n⌋ gradients are buffered:
        σ_l = i − i_pulled_l                                # staleness, in updates
        s_l = 1 / max(1, σ_l)   if staleness_lr == "per_gradient" else 1
        g   = (1/c) Σ_l s_l Δ_l
        α   = α0            if staleness_lr in ("none", "per_gradient")
              α0 / n        if staleness_lr == "softsync"   (Rudra's rule)
              α0 / max(1, mean σ over every gradient applied so far, this update's included)
                            if staleness_lr == "measured"
        w ← optimizer(w, g, α)        # torch.optim.SGD (momentum, weight decay, nesterov),
                                      # the make_optimizer factory's optimizer (e.g. AdamW)
                                      # or torch.optim.Adagrad (weight decay)
        i ← i + 1

``n = λ`` (c = 1) is asynchronous SGD, ``n = 1`` (c = λ) 1-softsync (a fast learner may
contribute twice to one update); ``barrier=True`` (requires n = 1) is hardsync through the
server: each learner pushes exactly one gradient per version and may not pull until the
update is applied, so σ = 0 always. ``per_gradient`` is the staleness-aware rule of Zhang,
Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016,
arXiv:1511.05950.

Membership (docs/elastic.md). Without the barrier, learners may join (:meth:`admit`: a new
worker index, which then pulls) and leave (:meth:`retire`) a running server. λ is the number
of active learners; an asynchronous server (built with ``n = λ``) stays asynchronous, so its
n follows λ (c = 1 and ``softsync`` scales α0 by 1/λ of the moment); otherwise n stays and
``c = ⌊λ/min(n, λ)⌋`` is refitted. A joiner's σ is counted, like everyone's, from the version
it pulled; a retired learner's buffered gradient stays in the buffer, and the next push
applies every buffered gradient when they reach c.

What assumes SGD: Rudra's experiments and its staleness-dependent rates were made with
SGD (momentum 0.9) and AdaGrad. The rule itself only hands the server's optimizer an
aggregate gradient and a rate, so any coordinate-wise torch.optim optimizer
(``make_optimizer``) runs: ``softsync`` and ``measured`` scale that optimizer's rate,
``per_gradient`` scales the gradients, which the normalisation of an Adam-like optimizer
partly undoes. ``optimizer = "adagrad"`` is Rudra's own AdaGrad server and takes no
factory.

Example (asynchronous, two learners; learner 1's gradient is one update stale)::

    >>> import torch
    >>> from distsgd.protocols import ParameterServer
    >>> ps = ParameterServer(torch.zeros(2), num_learners=2, softsync=2)
    >>> w0, v0 = ps.pull(0)
    >>> w1, v1 = ps.pull(1)
    >>> ps.push(0, torch.ones(2), v0, lr=0.1).staleness
    [0]
    >>> u = ps.push(1, torch.ones(2), v1, lr=0.1)
    >>> u.version, u.clock, u.staleness
    (2, [(1, 0)], [1])
    >>> ps.eval_weights()
    tensor([-0.2000, -0.2000])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._util import (
    SERVER_OPTIMIZERS,
    STALENESS_LR,
    OptimizerFactory,
    build_optimizer,
    check_bool,
    check_choice,
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
from .base import AsynchronousProtocol, Update

__all__ = ["ParameterServer"]


class ParameterServer(AsynchronousProtocol):
    """Rudra parameter server with n-softsync / async / hardsync (docs/protocols.md §2).

    Workers are the learners (``num_workers == num_learners``).

    Args:
        initial: initial weights, shape ``[P]``, floating point (copied).
        num_learners: λ >= 1.
        softsync: n, 1 <= n <= λ, a divisor of λ; an update aggregates c = λ/n gradients.
        barrier: hardsync through the server; requires ``softsync = 1``.
        staleness_lr: ``"none"``, ``"softsync"``, ``"measured"`` or ``"per_gradient"``
            (see the module docstring).
        optimizer: ``"sgd"`` (torch.optim.SGD, or ``make_optimizer``'s optimizer) or
            ``"adagrad"`` (torch.optim.Adagrad, Rudra's AdaGrad server).
        momentum: μ in [0, 1) of the server's SGD; must be 0 for ``"adagrad"`` and with
            ``make_optimizer``.
        weight_decay: L2 coefficient >= 0 of the server's SGD or AdaGrad; must be 0 with
            ``make_optimizer``.
        nesterov: Nesterov momentum (SGD only); requires ``momentum > 0``.
        make_optimizer: ``[w] → torch.optim.Optimizer`` (see
            :data:`~distsgd.protocols.OptimizerFactory`), the server's optimizer instead
            of SGD; only with ``optimizer = "sgd"``. None (default): SGD.

    Raises:
        ValueError: an argument outside the allowed values (the message names it).
    """

    def __init__(
        self,
        initial: Tensor,
        num_learners: int,
        softsync: int,
        barrier: bool = False,
        staleness_lr: str = "none",
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        make_optimizer: OptimizerFactory | None = None,
    ) -> None:
        self._w = check_initial(initial)
        self.num_learners = check_int("num_learners", num_learners, 1)
        self.softsync = check_int("softsync", softsync, 1)
        if softsync > num_learners or num_learners % softsync:
            raise ValueError(
                f"softsync = {softsync!r} is not allowed: expected a divisor of "
                f"num_learners = {num_learners} (1 <= n <= λ)"
            )
        self.barrier = check_bool("barrier", barrier)
        if barrier and softsync != 1:
            raise ValueError(
                f"softsync = {softsync!r} is not allowed with barrier = True: expected 1 "
                "(hardsync aggregates all λ gradients)"
            )
        self.staleness_lr = check_choice("staleness_lr", staleness_lr, STALENESS_LR)
        self.optimizer = check_choice("optimizer", optimizer, SERVER_OPTIMIZERS)
        self.momentum, self.weight_decay, self.nesterov = check_optimizer_args(
            make_optimizer, momentum, weight_decay, nesterov
        )
        if optimizer == "adagrad" and self.momentum != 0:
            raise ValueError(
                f"momentum = {momentum!r} is not allowed with optimizer = 'adagrad': expected 0"
            )
        if optimizer == "adagrad" and make_optimizer is not None:
            raise ValueError(
                "make_optimizer is not allowed with optimizer = 'adagrad': expected None "
                "(Rudra's AdaGrad server is its own optimizer)"
            )
        self._asynchronous = softsync == num_learners
        self._active = [True] * num_learners
        self._refit()
        self._opt: torch.optim.Optimizer
        if optimizer == "sgd":
            self._opt = build_optimizer(
                self._w, make_optimizer, self.momentum, self.weight_decay, self.nesterov
            )
        else:
            self._opt = torch.optim.Adagrad([self._w], lr=0.0, weight_decay=self.weight_decay)
        self._custom_optimizer = make_optimizer is not None
        self._version = 0
        self._buffer: list[Tensor] = []
        self._buffer_clock: list[tuple[int, int]] = []
        self._pushed = [False] * num_learners  # barrier only: pushed for this version
        self._counts: list[int] = []  # staleness histogram, index σ
        self._staleness_sum = 0
        self._num_gradients = 0

    # ---- membership ---------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Worker indices assigned so far (active or retired); a joiner gets the next one."""
        return len(self._active)

    @property
    def active_workers(self) -> list[int]:
        """Learners that may pull and push now, increasing; λ is their number."""
        return [w for w, a in enumerate(self._active) if a]

    @property
    def effective_softsync(self) -> int:
        """n now: λ for an asynchronous server, else ``min(softsync, λ)``."""
        lam = len(self.active_workers)
        return lam if self._asynchronous else min(self.softsync, lam)

    def _refit(self) -> None:
        self.gradients_per_update = len(self.active_workers) // self.effective_softsync

    def _check_elastic(self, what: str) -> None:
        if self.barrier:
            raise RuntimeError(
                f"{what} is not allowed under the hardsync barrier: its membership is fixed "
                "(every version takes one gradient from each of the λ learners)"
            )

    def _check_active(self, worker: int) -> None:
        check_index("worker", worker, self.num_workers)
        if not self._active[worker]:
            raise ValueError(f"worker = {worker} is not allowed: that learner has left")

    def admit(self) -> int:
        """Add a learner; it pulls next. Returns its worker index (``num_workers`` before).

        Raises:
            RuntimeError: under the hardsync barrier.
        """
        self._check_elastic("a learner joining")
        self._active.append(True)
        self._refit()
        return len(self._active) - 1

    def retire(self, worker: int) -> None:
        """Remove an active learner; c and the λ-dependent rate are refitted. Its buffered
        gradient, if any, stays and is applied with the next update.

        Raises:
            ValueError: ``worker`` is not an active learner.
            RuntimeError: under the hardsync barrier, or ``worker`` is the last learner.
        """
        self._check_elastic("a learner leaving")
        self._check_active(worker)
        if len(self.active_workers) == 1:
            raise RuntimeError(f"learner {worker} is the last learner: it cannot leave")
        self._active[worker] = False
        self._refit()

    def reset_membership(self, num_workers: int) -> None:
        """Make learners ``0 … num_workers − 1`` the active ones and forget every later
        worker index (a run resumed with the learners it was launched with: joiners join
        again and get the next indices). c and the λ-dependent rate are refitted; buffered
        gradients stay and are applied with the next update.

        Raises:
            ValueError: ``num_workers`` not in ``[1, self.num_workers]``.
        """
        check_int("num_workers", num_workers, 1, self.num_workers)
        self._active = [True] * num_workers
        self._refit()

    # ---- queries ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Updates applied so far."""
        return self._version

    @property
    def num_parameters(self) -> int:
        """P, the length of the flat weight vector."""
        return self._w.numel()

    @property
    def num_buffered(self) -> int:
        """Gradients pushed but not yet applied (0 <= num_buffered < c)."""
        return len(self._buffer)

    @property
    def buffered_clock(self) -> list[tuple[int, int]]:
        """``(learner, version_pulled)`` of the buffered gradients, in arrival order."""
        return list(self._buffer_clock)

    @property
    def staleness_counts(self) -> dict[int, int]:
        """Histogram ``{σ: number of applied gradients with that staleness}``."""
        return {s: n for s, n in enumerate(self._counts) if n}

    @property
    def num_gradients(self) -> int:
        """Gradients applied so far."""
        return self._num_gradients

    @property
    def staleness_mean(self) -> float:
        """Mean σ over all applied gradients, in updates (0.0 before the first)."""
        return self._staleness_sum / self._num_gradients if self._num_gradients else 0.0

    @property
    def staleness_max(self) -> int:
        """Largest σ applied so far, in updates (0 before the first)."""
        return len(self._counts) - 1 if self._counts else 0

    def can_pull(self, worker: int) -> bool:
        """False under ``barrier`` after ``worker`` pushed for the current version.

        Raises:
            ValueError: ``worker`` is not an active learner.
        """
        self._check_active(worker)
        return not self.barrier or not self._pushed[worker]

    def pull(self, worker: int) -> tuple[Tensor, int]:
        """A copy of the weights, shape ``[P]``, and their version.

        Raises:
            ValueError: ``worker`` is not an active learner.
            RuntimeError: ``can_pull(worker)`` is False (barrier).
        """
        if not self.can_pull(worker):
            raise RuntimeError(
                f"learner {worker} cannot pull: under the hardsync barrier it has pushed for "
                f"version {self._version} and the update is not applied yet"
            )
        return self._w.clone(), self._version

    def eval_weights(self) -> Tensor:
        """A copy of the server's weights, shape ``[P]``."""
        return self._w.clone()

    # ---- the rule -----------------------------------------------------------------------
    def push(self, worker: int, grad: Tensor, version: int, lr: float) -> Update | None:
        """Buffer ``grad`` (shape ``[P]``) computed by ``worker`` on weights of ``version``.

        When this push makes c gradients, the update is applied and returned; its ``lr``
        is α_eff. The base rate ``lr`` (α0) of the completing push is the one used.
        ``grad`` is copied if buffered, so the caller may reuse it.

        Raises:
            ValueError: ``worker`` not an active learner, bad ``lr``, ``version`` (not in ``[0, version]``) or
                ``grad`` (not of the weights' shape, dtype and device).
            RuntimeError: under ``barrier``, ``worker`` already pushed for this version or
                pushes a gradient of an older version.
        """
        self._check_active(worker)
        check_vector("grad", grad, self._w)
        lr = check_lr(lr)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version = {version!r} is not allowed: expected an integer")
        if not 0 <= version <= self._version:
            raise ValueError(
                f"version = {version} is not allowed: expected an integer in "
                f"[0, {self._version}] (the server's current version)"
            )
        if self.barrier:
            if self._pushed[worker]:
                raise RuntimeError(
                    f"learner {worker} already pushed a gradient for version {self._version}; "
                    "hardsync takes exactly one gradient per learner per version"
                )
            if version != self._version:
                raise RuntimeError(
                    f"learner {worker} pushed a gradient of version {version} but the server is "
                    f"at version {self._version}; under hardsync every learner must pull the "
                    "new weights first"
                )
            self._pushed[worker] = True
        complete = len(self._buffer) + 1 >= self.gradients_per_update
        self._buffer.append(grad if complete else grad.detach().clone())
        self._buffer_clock.append((worker, version))
        return self._apply(lr) if complete else None

    def _apply(self, lr: float) -> Update:
        staleness = [self._version - v for _, v in self._buffer_clock]
        grads = self._buffer
        if self.staleness_lr == "per_gradient":
            scales = [1.0 / max(1, s) for s in staleness]
            grads = [g * s if s != 1.0 else g for g, s in zip(grads, scales, strict=True)]
        else:
            scales = [1.0] * len(staleness)
        aggregate = torch.stack(grads).mean(0)
        for s in staleness:
            if s >= len(self._counts):
                self._counts.extend([0] * (s + 1 - len(self._counts)))
            self._counts[s] += 1
        self._staleness_sum += sum(staleness)
        self._num_gradients += len(staleness)
        if self.staleness_lr == "softsync":
            lr_eff = lr / self.effective_softsync
        elif self.staleness_lr == "measured":
            lr_eff = lr / max(1.0, self._staleness_sum / self._num_gradients)
        else:
            lr_eff = lr
        optimizer_step(self._opt, self._w, aggregate, lr_eff)
        clock = self._buffer_clock
        self._version += 1
        self._buffer = []
        self._buffer_clock = []
        self._pushed = [False] * self.num_learners
        return Update(self._version, clock, staleness, lr_eff, scales)

    # ---- state --------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {
            "num_parameters": self.num_parameters,
            "num_learners": self.num_learners,
            "softsync": self.softsync,
            "barrier": self.barrier,
            "staleness_lr": self.staleness_lr,
            "optimizer": describe_optimizer(self._opt)
            if self._custom_optimizer
            else self.optimizer,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: weights, version, buffered gradients with their clock, barrier flags,
        staleness histogram and sums, the membership (``active[w]``: worker w has not left)
        and the optimizer state."""
        return {
            "protocol": "ParameterServer",
            "config": self._config(),
            "weights": self._w.clone(),
            "version": self._version,
            "buffer": [g.detach().clone() for g in self._buffer],
            "buffer_clock": [list(e) for e in self._buffer_clock],
            "pushed": list(self._pushed),
            "staleness_counts": list(self._counts),
            "staleness_sum": self._staleness_sum,
            "num_gradients": self._num_gradients,
            "active": list(self._active),
            "optimizer": optimizer_state(self._opt),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state is not from a ParameterServer of the same configuration.
        """
        check_header(state, "ParameterServer", self._config())
        # a checkpoint is read onto the CPU (map_location): its gradients join the weights' device
        buffer = [g.to(self._w.device) if isinstance(g, Tensor) else g for g in state["buffer"]]
        active = [bool(a) for a in state.get("active", [True] * self.num_learners)]
        if not any(active):
            raise ValueError("state['active'] holds no active learner")
        if len(buffer) != len(state["buffer_clock"]):
            raise ValueError("state['buffer'] holds an inconsistent number of gradients")
        for g in buffer:
            check_vector("state['buffer'] entry", g, self._w)
        load_vector("weights", state["weights"], self._w)
        self._active = active
        self._refit()
        self._version = int(state["version"])
        self._buffer = [g.detach().clone() for g in buffer]
        self._buffer_clock = [(int(a), int(b)) for a, b in state["buffer_clock"]]
        self._pushed = [bool(p) for p in state["pushed"]]
        self._counts = [int(n) for n in state["staleness_counts"]]
        self._staleness_sum = int(state["staleness_sum"])
        self._num_gradients = int(state["num_gradients"])
        load_optimizer(self._opt, state["optimizer"])
