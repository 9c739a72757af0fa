"""How a program steers a run through the :class:`~distsgd.trainer.Trainer` beyond its
config (the tuner's probes, long runs and segments), and what it hears back.

* :class:`RunOptions` — what a run does that no user sets: evaluate or not, check the
  steady-state rule and stop where it is due (:mod:`distsgd.plateau`), continue another
  run's checkpoint under this run's hyperparameters (η, μ, batch), record what the
  observer hears for another process;
* :class:`RunObserver` — the training losses, evaluations and steady-state checks of a
  run, as it makes them;
* :class:`RunRecorder` / :func:`replay` — the same events across a process boundary
  (real processes: rank 0 records into the run directory, the launching process replays
  them): ``ticks.jsonl`` (one line per tick with losses) and ``plateau_checks.jsonl``
  (one line per check), and ``final_weights.pt`` (the last evaluated model ``[P]``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from distsgd.metrics import load_checked, save_checked

__all__ = [
    "RunOptions",
    "RunObserver",
    "LossPoint",
    "RunRecorder",
    "replay",
    "recorded_final_weights",
    "eval_weights_file",
]

TICKS_FILE = "ticks.jsonl"
CHECKS_FILE = "plateau_checks.jsonl"
FINAL_WEIGHTS_FILE = "final_weights.pt"
EVAL_WEIGHTS_DIR = "eval_weights"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """A run's options outside the user's config.

    Attributes:
        evaluate: evaluate on the test set (False: no evaluations and no metrics
            records; a probe needs its training losses only).
        steady_check_samples: every this many training samples (at each multiple of it
            since the run's start): evaluate, check the steady-state rule
            (:func:`~distsgd.plateau.steady_state_due`) from the evaluations so far and stop
            where it is due (``stop_reason = "steady_state"``); 0: no checks.
        continues: the run directory's ``checkpoint.pt`` is another run's (copied there),
            resumed under this run's config: its weights, momentum buffer, protocol
            counters, data positions and clocks continue; momentum μ and batch size b are
            this config's (Omnivore's steady state changes them mid-run, docs/protocols.md §3).
        record: rank 0 records the events an observer would hear into the run directory
            (:class:`RunRecorder`; real processes, whose observer is in another process).
    """

    evaluate: bool = True
    steady_check_samples: int = 0
    continues: bool = False
    record: bool = False

    def __post_init__(self) -> None:
        if int(self.steady_check_samples) < 0:
            raise ValueError(
                f"steady_check_samples = {self.steady_check_samples} is not allowed: expected >= 0"
            )

    def to_json(self) -> dict[str, Any]:
        """The options as JSON (for the ranks of a run on real processes)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> RunOptions:
        """Options from :meth:`to_json` (None or empty: the defaults)."""
        return cls(**(data or {}))


@dataclasses.dataclass(frozen=True)
class LossPoint:
    """One tick's mean training loss.

    Attributes:
        iterations: the protocol's iterations (versions for asynchronous protocols).
        samples: training samples so far.
        train_wall_s: wall seconds of training so far.
        clock_s: the runtime's clock, seconds (simulated on ``sim``, wall elsewhere).
        loss: mean loss of the tick's minibatches.
    """

    iterations: int
    samples: int
    train_wall_s: float
    clock_s: float
    loss: float


class RunObserver:
    """What a run reports as it trains; subclasses override what they need (all no-ops).

    Every method is called on the writing rank only, in the run's order."""

    def on_losses(self, point: LossPoint) -> None:
        """A tick with training losses."""

    def on_evaluation(self, record: dict[str, Any], weights: torch.Tensor) -> None:
        """An evaluation: its ``metrics.jsonl`` record and the evaluated model ``[P]``."""

    def on_steady_check(self, check: dict[str, Any]) -> None:
        """A check of the steady-state rule: ``samples``, ``virtual_s``, ``train_wall_s``,
        ``window_samples``, ``due`` and the evaluation records it ``used``."""


class RunRecorder(RunObserver):
    """Records a run's events into its directory for :func:`replay`: the ticks, the checks
    and the last evaluated model.

    Args:
        run_dir: the run directory.
        resume: the run resumes its own checkpoint at ``samples``: events recorded after
            that are dropped (they are made again).
        samples: the training samples of the resumed checkpoint.
    """

    def __init__(self, run_dir: Path, *, resume: bool, samples: int) -> None:
        self.run_dir = Path(run_dir)
        self._final: torch.Tensor | None = None
        self._files: dict[str, Any] = {}
        for name in (TICKS_FILE, CHECKS_FILE):
            path = self.run_dir / name
            if resume and path.exists():  # the lines after the checkpoint are made again
                kept = [
                    line
                    for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["samples"] <= samples
                ]
                path.write_text("".join(line + "\n" for line in kept))
            elif path.exists():
                path.unlink()

    def _write(self, name: str, record: dict[str, Any]) -> None:
        """One line of ``name`` (opened for appending at its first line)."""
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = (self.run_dir / name).open("a")
        f.write(json.dumps(record) + "\n")

    def on_losses(self, point: LossPoint) -> None:
        self._write(TICKS_FILE, dataclasses.asdict(point))

    def on_evaluation(self, record: dict[str, Any], weights: torch.Tensor) -> None:
        self._final = weights.detach().clone()

    def on_steady_check(self, check: dict[str, Any]) -> None:
        self._write(CHECKS_FILE, check)
        self._files[CHECKS_FILE].flush()

    def close(self, completed: bool) -> None:
        """Close the files; a ``completed`` run also writes its last evaluated model."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if completed and self._final is not None:
            save_checked(self._final, self.run_dir / FINAL_WEIGHTS_FILE)


def replay(run_dir: str | Path, observer: RunObserver) -> None:
    """Feed ``observer`` the losses and checks :class:`RunRecorder` recorded in
    ``run_dir``, in order (nothing where it recorded nothing)."""
    run_dir = Path(run_dir)
    for line in _lines(run_dir / TICKS_FILE):
        observer.on_losses(LossPoint(**json.loads(line)))
    for line in _lines(run_dir / CHECKS_FILE):
        observer.on_steady_check(json.loads(line))


def recorded_final_weights(run_dir: str | Path) -> torch.Tensor | None:
    """The last evaluated model ``[P]`` :class:`RunRecorder` kept of a completed run in
    ``run_dir`` (None: none kept)."""
    final = Path(run_dir) / FINAL_WEIGHTS_FILE
    return load_checked(final) if final.exists() else None


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def eval_weights_file(run_dir: str | Path, eval_index: int) -> Path:
    """Where :class:`RunRecorder` keeps evaluation ``eval_index``'s model."""
    return Path(run_dir) / EVAL_WEIGHTS_DIR / f"{eval_index:04d}.pt"
