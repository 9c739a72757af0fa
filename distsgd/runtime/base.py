"""The runtime interface the trainer drives: one tick at a time, evaluation, state, replicas.

Two runtimes implement it: the simulated cluster (:class:`~distsgd.runtime.sim.SimRuntime`,
one process, a virtual clock) and real processes (:mod:`distsgd.runtime.dist`, one rank
each). The trainer's loop is the same for both; what differs is behind these methods:

* :meth:`Runtime.advance` runs one tick — a synchronous iteration, or one applied update
  of an asynchronous protocol — and returns its :class:`Tick`;
* :meth:`Runtime.eval_weights` and :meth:`Runtime.evaluate` give the model to evaluate
  (the central model for SMA and the parameter server) and score it;
* the collectives (:meth:`Runtime.share`, :meth:`Runtime.any_rank`,
  :meth:`Runtime.reduce_losses`, :meth:`Runtime.max_over_ranks`,
  :meth:`Runtime.share_with_all`) make every rank of a real run take the same decision;
  in one process they return their argument;
* :meth:`Runtime.state_dict` / :meth:`Runtime.load_state_dict` hold what a checkpoint
  needs beyond the protocol (data positions, the clock, the event queue);
* :meth:`Runtime.set_replicas_per_device` changes Crossbow's k at a synchronisation point.

Runtimes are built by :func:`distsgd.runtime.factory.runtime_kind`.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from distsgd.data import Dataset, LearnerStream, Split
from distsgd.engine import GradientEngine
from distsgd.layout import protocols_with

__all__ = [
    "Runtime",
    "Tick",
    "TrainingDiverged",
    "check_losses",
    "draw_minibatches",
    "time_in_turn",
]


class TrainingDiverged(RuntimeError):
    """A learner's training loss became NaN or infinite."""


def check_losses(
    learners: list[int],
    losses: list[float],
    lr: float,
    samples: int | None,
    step: int | None = None,
    what: str = "training loss",
) -> None:
    """Raise :class:`TrainingDiverged` naming the first of ``learners`` whose loss is NaN
    or infinite, with the base rate ``lr``, the ``samples`` drawn and the ``step`` (None:
    not named); ``what`` the checked value is (the drop-in checks a gradient where its
    loop gives no loss)."""
    at = "" if step is None else f" at step {step}"
    drawn = "" if samples is None else f" (sample {samples})"
    for learner, loss in zip(learners, losses, strict=True):
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"{what} became {loss}{at}{drawn} on learner {learner} "
                f"with base learning rate {lr:g}; lower optimizer.lr or add a warm-up "
                "(schedule.warmup_epochs), or check train.loss and the data"
            )


@dataclass
class Tick:
    """What one call of :meth:`Runtime.advance` did.

    Attributes:
        samples: training samples whose gradients were computed in this tick.
        losses: minibatch mean losses (nats) of the learners that computed.
        update: the parameter-server update applied in this tick, if any.
        membership: records of the membership changes made in this tick
            (``membership.jsonl``, docs/elastic.md).
    """

    samples: int
    losses: list[float]
    update: Any = None
    membership: list[dict[str, Any]] = field(default_factory=list)


class Runtime(abc.ABC):
    """What the trainer needs of a runtime.

    Attributes:
        clock: what :attr:`clock_s` measures: ``"simulated"`` seconds of the virtual
            clock, or ``"wall"`` seconds measured on real processes.
        is_writer: this process evaluates and writes the run directory.
        runs_training_loop: this process runs the trainer's loop (a parameter server's
            learner or shard serves instead, :meth:`serve`).
        failure_types: exceptions that mean a process of the run was lost.
        engine: the gradient engine (model and flat buffers).
        protocol: this process's protocol object.
        samples: training samples consumed so far (all learners).
        num_learners: λ now (Crossbow's auto-tuner changes it).
        replicas_per_device: k now.
        bytes_sent: bytes the run's exchanges have sent so far, all processes together
            (:func:`~distsgd.runtime.compression.ring_allreduce_bytes` for an all-reduce,
            P values for a parameter-server push or pull), in the wire format of
            ``protocol.compression``.
        dropped_gradients: gradients computed but left out of every update so far
            (hardsync's backup learners: β per iteration).
    """

    clock: ClassVar[str]
    is_writer: bool = True
    runs_training_loop: bool = True
    failure_types: tuple[type[BaseException], ...] = ()
    engine: GradientEngine
    protocol: Any
    samples: int
    num_learners: int
    replicas_per_device: int = 1
    bytes_sent: int = 0
    dropped_gradients: int = 0

    @property
    @abc.abstractmethod
    def clock_s(self) -> float:
        """The run's clock, seconds of training (see :attr:`clock`)."""

    @abc.abstractmethod
    def advance(self, lr: float) -> Tick:
        """One tick at base learning rate ``lr``.

        Raises:
            TrainingDiverged: a training loss became NaN or infinite.
        """

    @abc.abstractmethod
    def eval_weights(self) -> Tensor:
        """The model to evaluate, shape ``[P]`` (collective on real processes where the
        protocol needs one)."""

    def evaluate(self, weights: Tensor, split: Split, batch_size: int) -> tuple[float, float]:
        """The metric (e.g. accuracy, a fraction) and the mean loss of ``weights`` on the
        evaluation ``split``."""
        return self.engine.evaluate(weights, split, batch_size)

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the runtime (``None`` on a rank that does not write)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def set_replicas_per_device(self, replicas_per_device: int) -> None:
        """Change k between synchronous iterations (SMA and local SGD only).

        Raises:
            RuntimeError: the protocol holds no replicas.
        """
        raise RuntimeError(
            f"replicas per device can change only for protocols {protocols_with('replicated')}"
        )

    # ---- decisions every rank takes together (identity in one process) -----------------
    def share(self, obj: Any) -> Any:
        """``obj`` of the writer, on every rank that runs the training loop."""
        return obj

    def share_with_all(self, obj: Any) -> Any:
        """``obj`` of the writer, on every rank of the run (servers included)."""
        return obj

    def any_rank(self, flag: bool) -> bool:
        """True everywhere if ``flag`` is True on any rank of the training loop."""
        return flag

    def reduce_losses(self, loss_sum: float, count: int) -> tuple[float, int]:
        """The learners' loss sum and count over every rank of the training loop."""
        return loss_sum, count

    def max_over_ranks(self, value: float) -> float:
        """The largest ``value`` over the ranks of the training loop."""
        return value

    # ---- lifecycle ---------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until the run ends (ranks with ``runs_training_loop = False``)."""
        raise RuntimeError(f"{type(self).__name__} runs the training loop; it does not serve")

    def summary_fields(self) -> dict[str, Any]:
        """Runtime-specific entries of ``summary.json`` (e.g. processes, events)."""
        return {}

    def close(self) -> None:  # noqa: B027 - a runtime in one process holds nothing
        """Release what the runtime holds (the process group)."""

    def late_membership(self) -> list[dict[str, Any]]:
        """Membership records made after the last :meth:`advance` (a learner the server
        lost while the run was ending), read after :meth:`close`; none by default."""
        return []

    def join_info(self) -> dict[str, Any] | None:
        """What the writer puts into ``RUN_DIR/join.json`` for learners that join the
        running run (``distsgd join``, docs/elastic.md); None (default): none can."""
        return None


def time_in_turn(
    fns: list[Callable[[], Any]], repeats: int, device: torch.device, warmup: int = 1
) -> list[list[float]]:
    """Wall seconds of each of ``fns`` (waiting for ``device``'s queued work), called in
    turn in each of ``warmup + repeats`` rounds, so that a change of the machine's load
    during the measurement reaches all alike; the warm-up rounds are dropped. Returns one
    list of ``repeats`` seconds per function (the calibrations' common timing loop)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + repeats):
        for fn, kept in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                kept.append(time.perf_counter() - t0)
    return times


def draw_minibatches(streams: list[LearnerStream], dataset: Dataset) -> tuple[Tensor, Tensor]:
    """The next minibatch of each of a rank's learner ``streams``: inputs ``[k, b, ...]``
    and targets ``[k, b, ...]`` (what one synchronous iteration of the rank draws)."""
    idx = torch.stack([s.next_indices() for s in streams])  # [k, b]
    return dataset.train.batch(idx)
