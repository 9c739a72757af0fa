"""Probes: short real training runs of candidate configurations through the Trainer.

A probe is ``distsgd train`` of a candidate's config (:func:`candidate_config`), started
from a snapshot's weights and stopped after a fixed time on the runtime's clock:
``train.max_virtual_seconds`` (simulated seconds) on the ``sim`` runtime,
``train.max_seconds`` (wall seconds of training, equal-wall-time probes as in Omnivore)
on real processes. Each probe writes an ordinary run directory under ``probes/``.

* ``sim``: the Trainer runs in this process from the in-memory snapshot
  (``Trainer(initial_weights=...)``) and records every tick's training loss
  (``Trainer(on_tick=...)``).
* ``dist``: an ordinary dist training (:func:`distsgd.launch.run`; with ``keep_ranks``
  on one :class:`~distsgd.launch.RankPool` for all the prober's runs, closed by
  :meth:`Prober.close`); the snapshot goes to the ranks as a file (``train.initial_weights``, under ``snapshots/``) and rank 0
  writes every tick's loss to the probe's ``ticks.jsonl`` and the final central model to
  ``final_weights.pt`` (``train.record_ticks``), which are read back here.

A long run (:meth:`Prober.long_run`, Omnivore's run of the best configuration until the
target) is the same kind of run with evaluations; it comes back as a :class:`LongRun`, and
:class:`RunClock` says which of its records' keys hold the runtime's clock.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from distsgd import launch
from distsgd.checks import fail
from distsgd.config import ConfigError, RunConfig, required_processes
from distsgd.metrics import load_checked, save_checked
from distsgd.runtime.sim import TrainingDiverged
from distsgd.trainer import Trainer
from distsgd.tuner.omnivore import Candidate, ProbeResult

__all__ = [
    "candidate_config",
    "Prober",
    "check_runtime",
    "safe_name",
    "check_optimizer_searchable",
    "RunClock",
    "LongRun",
]


@dataclasses.dataclass(frozen=True)
class RunClock:
    """The runtime's clock as the tuner reads it from a run's records: simulated seconds
    on ``sim``, wall seconds of training on real processes.

    Attributes:
        name: ``simulated`` or ``wall`` (as the decisions and the report say it).
        eval_key: the key of an evaluation record (``metrics.jsonl``) with its time on
            this clock, seconds since the run's start.
        time_to_target_key: the key of a run summary (``summary.json``) with its time to
            the target accuracy on this clock, seconds (None when not reached).
        run_seconds_key: the key of a run summary with the run's length on this clock.
    """

    name: str
    eval_key: str
    time_to_target_key: str
    run_seconds_key: str

    @classmethod
    def of(cls, simulated: bool) -> RunClock:
        """The simulated clock (``sim`` runtime) or the wall clock (real processes)."""
        if simulated:
            return cls("simulated", "virtual_s", "time_to_target_virtual_s", "virtual_s")
        return cls("wall", "wall_s", "time_to_target_s", "train_wall_s")

    def at(self, record: dict[str, Any]) -> float:
        """Seconds on this clock at an evaluation record."""
        return float(record[self.eval_key])


@dataclasses.dataclass
class LongRun:
    """One long run (:meth:`Prober.long_run`).

    Attributes:
        result: its ticks (losses, iterations, clock) and evaluation records.
        summary: its ``summary.json`` (empty when the run wrote none): ``reached``,
            ``epochs``, ``best_metric``, ``virtual_s``, ``train_wall_s``, the times to
            accuracy, ….
    """

    result: ProbeResult
    summary: dict[str, Any]

    @property
    def reached(self) -> bool:
        """Whether the run reached the target accuracy."""
        return bool(self.summary.get("reached"))

    @property
    def epochs(self) -> float:
        """Epochs the run trained (0 without a summary)."""
        return float(self.summary.get("epochs", 0.0) or 0.0)


def check_runtime(runtime: str) -> None:
    """Raise ConfigError when the tuner cannot probe on ``runtime`` (``sim`` and ``dist``
    are supported)."""
    if runtime not in ("sim", "dist"):
        raise ConfigError(
            f"runtime = {runtime!r} is not allowed for distsgd tune: expected 'sim' or 'dist'"
        )


def check_optimizer_searchable(cfg: RunConfig) -> None:
    """Raise ConfigError when the base config names what the tuner would silently replace:
    an ``optimizer.name`` other than ``"sgd"`` (Omnivore's search, docs/protocols.md §3, and joint
    search probe SGD's η × μ grids) or a torch scheduler in ``schedule.kind`` (the plan
    sets the schedule: η constant, or one step the tuner searches)."""
    if not cfg.optimizer.is_sgd:
        fail(
            "optimizer.name",
            cfg.optimizer.name,
            "'sgd' for distsgd tune (it searches SGD's learning rate × momentum grids)",
        )
    if cfg.schedule.kind not in ("constant", "step"):
        fail(
            "schedule.kind",
            cfg.schedule.kind,
            "'constant' or 'step' for distsgd tune (the plan sets the schedule: a constant "
            "learning rate or one step the tuner searches)",
        )


def candidate_config(base: RunConfig, cand: Candidate) -> RunConfig:
    """``base`` with the candidate's protocol, layout, η and μ (schedule constant).

    Mapping: ``hardsync`` → protocol ``hardsync``; ``compute_groups`` → ``compute_groups``
    with g groups and Rudra's α0/n learning-rate rule off (momentum is what Omnivore
    tunes); ``softsync`` → ``parameter_server`` in n-softsync with ``staleness_lr =
    softsync`` (α0/n); ``sma`` → ``sma`` with k replicas per device and ``alpha = 0``,
    which the config reads as α = 1/λ over all λ learners (docs/protocols.md §4).
    """
    p = base.protocol
    common = {
        "num_learners": cand.num_learners,
        "batch_size": cand.batch_size,
        "momentum_compensation": False,
        "staleness_lr": "none",
    }
    if cand.family == "hardsync":
        proto = dataclasses.replace(p, name="hardsync", **common)
    elif cand.family == "compute_groups":
        proto = dataclasses.replace(p, name="compute_groups", num_groups=cand.num_groups, **common)
    elif cand.family == "softsync":
        proto = dataclasses.replace(
            p,
            name="parameter_server",
            mode="softsync",
            softsync=cand.softsync,
            server_optimizer="sgd",
            **{**common, "staleness_lr": "softsync"},
        )
    elif cand.family == "sma":
        proto = dataclasses.replace(
            p,
            name="sma",
            replicas_per_device=cand.replicas_per_device,
            alpha=0.0,
            **common,
        )
    else:  # pragma: no cover - Candidate families are fixed
        raise AssertionError(cand.family)
    opt = dataclasses.replace(base.optimizer, lr=cand.lr, momentum=cand.momentum, nesterov=False)
    cluster = base.cluster
    if cluster.speed_factors and len(cluster.speed_factors) != cand.num_learners:
        cluster = dataclasses.replace(cluster, speed_factors=[])
    return base.replace(
        protocol=proto,
        optimizer=opt,
        schedule=dataclasses.replace(base.schedule, kind="constant", warmup_epochs=0.0),
        cluster=cluster,
    )


def _status(run_dir: Path) -> str | None:
    """``status`` of the run's ``summary.json`` (None without one)."""
    path = run_dir / "summary.json"
    return json.loads(path.read_text()).get("status") if path.exists() else None


_ASCII = str.maketrans({"λ": "lam", "η": "eta", "μ": "mu"})


def safe_name(text: str) -> str:
    """A file name from a label: λ, η, μ spelled ``lam``, ``eta``, ``mu``, anything else
    outside ``[A-Za-z0-9_.=-]`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text.translate(_ASCII)).strip("_")


class Prober:
    """Runs probes and long runs of candidates from named snapshots.

    Args:
        base: the base config (device profile already fixed, so every probe shares it).
        out_dir: the tune directory; probes go to ``out_dir/probes/NNN-<label>``.
        probe_seconds: probe length on the runtime's clock.
        score_window: losses averaged by the score.
        initial: the cold-start snapshot's weights ``[P]``.
        keep_ranks: ``dist``: run every probe and long run on one pool of ranks (no
            process start per run); :meth:`close` ends them.
    """

    def __init__(
        self,
        base: RunConfig,
        out_dir: Path,
        probe_seconds: float,
        score_window: int,
        initial: torch.Tensor,
        keep_ranks: bool = False,
    ) -> None:
        check_runtime(base.runtime)
        self.base = base
        self.keep_ranks = keep_ranks
        self._pool: launch.RankPool | None = None
        self.out_dir = Path(out_dir)
        self.probe_seconds = probe_seconds
        self.score_window = score_window
        self.snapshots: dict[str, torch.Tensor] = {"initial": initial}
        self.count = 0

    def close(self) -> None:
        """End the pool's ranks (``keep_ranks``), if any were started."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def simulated(self) -> bool:
        """Whether the probes run on the simulated cluster (``sim`` runtime)."""
        return self.base.runtime == "sim"

    @property
    def clock(self) -> RunClock:
        """The clock of the probes' records."""
        return RunClock.of(self.simulated)

    def _train_settings(self, seconds: float) -> dict[str, Any]:
        key = "max_virtual_seconds" if self.simulated else "max_seconds"
        return {
            "max_epochs": 0.0,
            "max_samples": 0,
            "max_seconds": 0.0,
            "max_virtual_seconds": 0.0,
            key: seconds,
            "stop_at_target": False,
            "eval_every_samples": 0,
            "checkpoint_every_evals": 0,
            "tensorboard": False,
        }

    def run(
        self,
        cand: Candidate,
        snapshot: str,
        train: dict[str, Any],
        kind: str = "probe",
    ) -> tuple[ProbeResult, torch.Tensor | None]:
        """Train ``cand`` from ``snapshot`` with ``train`` settings; record every tick.

        Returns:
            (the result, the final central model ``[P]`` of a long run that did not
            diverge, else None).
        """
        cfg = candidate_config(self.base, cand)
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, **train))
        self.count += 1
        run_dir = self.out_dir / "probes" / f"{self.count:03d}-{kind}-{safe_name(cand.label())}"
        result = ProbeResult(cand, snapshot, score_window=self.score_window, run_dir=str(run_dir))
        t0 = time.perf_counter()
        if self.simulated:
            final = self._run_sim(cfg, run_dir, snapshot, kind, result)
        else:
            final = self._run_dist(cfg, run_dir, snapshot, kind, result)
        result.wall_s = time.perf_counter() - t0
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            result.evals = [json.loads(x) for x in metrics.read_text().splitlines() if x]
        return result, final

    def _run_sim(
        self, cfg: RunConfig, run_dir: Path, snapshot: str, kind: str, result: ProbeResult
    ) -> torch.Tensor | None:
        def on_tick(tick: Any, trainer: Trainer) -> None:
            if tick.losses:
                result.losses.append(sum(tick.losses) / len(tick.losses))
                result.iterations.append(trainer._iterations())
                result.virtual_s.append(trainer.runtime.virtual_time)

        trainer = Trainer(
            cfg,
            run_dir,
            progress=False,
            initial_weights=self.snapshots[snapshot],
            on_tick=on_tick,
            evaluate=kind != "probe",  # a probe's score needs training losses only
        )
        try:
            trainer.run()
        except TrainingDiverged:
            result.diverged = True
        result.train_wall_s = float(trainer.counters.get("train_wall_s", 0.0))
        result.samples = int(trainer.runtime.samples)
        if result.diverged or kind == "probe":
            return None
        return trainer.runtime.eval_weights().clone()

    def snapshot_file(self, name: str) -> Path:
        """The snapshot's weights as a file for the ranks (written once)."""
        path = self.out_dir / "snapshots" / f"{safe_name(name)}.pt"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            save_checked(self.snapshots[name].clone(), path)
        return path

    def _run_dist(
        self, cfg: RunConfig, run_dir: Path, snapshot: str, kind: str, result: ProbeResult
    ) -> torch.Tensor | None:
        cfg = cfg.replace(
            train=dataclasses.replace(
                cfg.train,
                initial_weights=str(self.snapshot_file(snapshot).resolve()),
                record_ticks=True,
                evaluate=kind != "probe",  # a probe's score needs training losses only
            )
        )
        try:
            if self.keep_ranks:
                n = required_processes(cfg.protocol, cfg.dist)[0]
                if self._pool is None or self._pool.num_processes != n:
                    self.close()
                    self._pool = launch.RankPool(n)
                self._pool.run(cfg, run_dir)
            else:
                launch.run(cfg, run_dir)
        except TrainingDiverged:
            result.diverged = True
        except launch.DistRunFailed as e:
            # a rank lost after rank 0 completed the run and wrote its files (e.g. one
            # that aborted while exiting) leaves a complete probe; anything else is fatal
            if _status(run_dir) != "completed":
                raise
            result.notes.append(f"completed; afterwards {e}")
        ticks = run_dir / "ticks.jsonl"
        for line in ticks.read_text().splitlines() if ticks.exists() else []:
            rec = json.loads(line)
            result.losses.append(rec["loss"])
            result.iterations.append(rec["iterations"])
            result.virtual_s.append(rec["train_wall_s"])
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            result.train_wall_s = float(summary.get("train_wall_s") or 0.0)
            result.samples = int(summary.get("samples") or 0)
        final = run_dir / "final_weights.pt"
        if result.diverged or kind == "probe" or not final.exists():
            return None
        return load_checked(final)

    def __call__(self, cand: Candidate, snapshot: str) -> ProbeResult:
        """One equal-time probe (the :data:`~distsgd.tuner.omnivore.ProbeFn` interface)."""
        result, _ = self.run(cand, snapshot, self._train_settings(self.probe_seconds))
        return result

    def long_run(
        self,
        cand: Candidate,
        wall_seconds: float,
        eval_every_samples: int,
        name: str,
        snapshot: str = "initial",
        max_epochs: float | None = None,
        max_clock_s: float = 0.0,
        save_eval_weights: bool = False,
    ) -> LongRun:
        """Omnivore's long run of the best configuration from ``snapshot``: train until the
        target accuracy, ``max_epochs`` (default the base config's), ``wall_seconds`` of
        training or ``max_clock_s`` seconds on the runtime's clock (simulated seconds on
        ``sim``, wall seconds of training on real processes; 0: no such limit), evaluating
        every ``eval_every_samples``; its final central model becomes snapshot ``name``.
        With ``save_eval_weights`` every evaluation's model is kept in the run directory
        (:meth:`eval_snapshot` loads one).

        Returns:
            the run's ticks, evaluations and summary.
        """
        max_seconds = wall_seconds
        if max_clock_s > 0 and not self.simulated:
            max_seconds = min(wall_seconds, max_clock_s)
        train = {
            "max_epochs": self.base.train.max_epochs if max_epochs is None else max_epochs,
            "max_samples": 0,
            "max_seconds": max_seconds,
            "max_virtual_seconds": max_clock_s if self.simulated else 0.0,
            "stop_at_target": True,
            "eval_every_samples": eval_every_samples,
            "checkpoint_every_evals": 0,
            "tensorboard": False,
            "save_eval_weights": save_eval_weights,
        }
        result, final = self.run(cand, snapshot, train, kind="long_run")
        if final is not None:
            self.snapshots[name] = final
        summary_path = Path(result.run_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        return LongRun(result, summary)

    def eval_snapshot(self, long_run: ProbeResult, eval_index: int, name: str) -> None:
        """Make the model of ``long_run``'s evaluation number ``eval_index`` (its
        ``eval_weights/NNNN.pt``, written with ``save_eval_weights``) snapshot ``name``.

        Raises:
            FileNotFoundError: the long run kept no weights for that evaluation.
        """
        path = Path(long_run.run_dir) / "eval_weights" / f"{eval_index:04d}.pt"
        self.snapshots[name] = load_checked(path)
