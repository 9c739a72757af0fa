"""Probes: short real training runs of candidate configurations through the Trainer.

A probe is ``distsgd train`` of a candidate's config (:func:`candidate_config`), started
from a snapshot's weights and stopped after a fixed time on the runtime's clock:
``train.max_virtual_seconds`` (simulated seconds) on the ``sim`` runtime,
``train.max_seconds`` (wall seconds of training, equal-wall-time probes as in Omnivore)
on real processes. Each probe writes an ordinary run directory under ``probes/``.

* ``sim``: the Trainer runs in this process from the in-memory snapshot
  (``Trainer(initial_weights=...)``) and its observer hears every tick's training loss
  (:class:`~distsgd.control.RunObserver`).
* ``dist``: an ordinary dist training (:func:`distsgd.launch.run`; with ``keep_ranks``
  on one :class:`~distsgd.launch.RankPool` for all the prober's runs, closed by
  :meth:`Prober.close`); the snapshot goes to the ranks as a file
  (``train.initial_weights``, under ``snapshots/``) and rank 0 records what an observer
  hears and the final central model (:class:`~distsgd.control.RunRecorder`), replayed
  here.

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
from distsgd.config import ConfigError, RunConfig
from distsgd.control import (
    LossPoint,
    RunObserver,
    RunOptions,
    eval_weights_file,
    recorded_final_weights,
    replay,
)
from distsgd.engine import UserCode
from distsgd.metrics import load_checked, save_checked
from distsgd.runtime.sim import TrainingDiverged
from distsgd.trainer import BothObservers, Trainer
from distsgd.tuner.omnivore import Candidate, ProbeResult

__all__ = [
    "ResultLosses",
    "run_summary",
    "run_limits",
    "candidate_config",
    "Prober",
    "check_runtime",
    "safe_name",
    "check_optimizer_searchable",
    "check_tunable",
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


def check_tunable(config: RunConfig) -> None:
    """Refuse what the search cannot tune, in one line: a runtime without probes
    (:func:`check_runtime`), an optimizer or schedule it does not search
    (:func:`check_optimizer_searchable`), a lower-is-better metric.

    The plan maps the target to a training loss through a line fitted between the metric
    and the training loss near the target (``1 − metric = e0 + s · loss``, accuracy-like
    metrics: higher is better, :class:`~distsgd.tuner.perf_model.ErrorVsLoss`), and its
    learning-rate step qualifies evaluations within ``tune.step_margin`` of the target in
    the metric's units. A metric whose direction is ``min`` (a loss, perplexity) is not
    covered by that model.

    Raises:
        ConfigError: the runtime, optimizer or schedule above; ``train.metric`` is
            lower-is-better.
    """
    check_runtime(config.runtime)
    t = config.train
    direction = t.metric_direction or ("max" if t.metric == "accuracy" else "min")
    if direction != "max":
        raise ConfigError(
            f"train.metric = {t.metric!r} is not allowed for distsgd tune: its direction is "
            "'min', and the tuner's time-to-target model covers higher-is-better metrics "
            "(accuracy, or a user metric with train.metric_direction = 'max'); train it "
            "with distsgd train"
        )
    check_optimizer_searchable(config)


def candidate_config(base: RunConfig, cand: Candidate, **train: Any) -> RunConfig:
    """``base`` with the candidate's protocol, layout, η and μ (schedule constant) and the
    ``train.*`` settings ``train`` (e.g. :func:`run_limits`).

    Mapping: ``hardsync`` → protocol ``hardsync``; ``compute_groups`` → ``compute_groups``
    with g groups and Rudra's α0/n learning-rate rule off (momentum is what Omnivore
    tunes); ``softsync`` → ``parameter_server`` in n-softsync with ``staleness_lr =
    softsync`` (α0/n); ``sma`` → ``sma`` with k replicas per device and ``alpha = 0``,
    which the config reads as α = 1/λ over all λ learners (docs/protocols.md §4);
    ``local_sgd`` / ``diloco`` → that protocol averaging every H iterations, one
    replica per device (DiLoCo's outer optimizer from ``base``). ``base``'s backup
    learners go to the hardsync candidates only.
    """
    p = base.protocol
    common = {
        "num_learners": cand.num_learners,
        "batch_size": cand.batch_size,
        "momentum_compensation": False,
        "staleness_lr": "none",
        "backup_learners": 0,  # hardsync's alone
    }
    if cand.family == "hardsync":
        proto = dataclasses.replace(
            p, name="hardsync", **{**common, "backup_learners": p.backup_learners}
        )
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
    elif cand.family in ("local_sgd", "diloco"):
        proto = dataclasses.replace(
            p,
            name=cand.family,
            average_every=cand.average_every,
            replicas_per_device=1,
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
        train=dataclasses.replace(base.train, **train) if train else base.train,
    )


def run_limits(simulated: bool, clock_s: float = 0.0, **train: Any) -> dict[str, Any]:
    """``train.*`` settings of a tuner's run: ``clock_s`` seconds on the runtime's clock
    (simulated seconds on ``sim``, wall seconds of training on real processes; 0: no
    limit), no stop at the target, no evaluations, checkpoints or TensorBoard; then
    ``train``."""
    key = "max_virtual_seconds" if simulated else "max_seconds"
    limits = {"max_seconds": 0.0, "max_virtual_seconds": 0.0, key: clock_s}
    off = {"stop_at_target": False, "eval_every_samples": 0, "checkpoint_every_evals": 0}
    return {**limits, **off, "tensorboard": False, **train}


def run_summary(run_dir: Path) -> dict[str, Any]:
    """A run directory's ``summary.json`` ({} when it has none)."""
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


_ASCII = str.maketrans({"λ": "lam", "η": "eta", "μ": "mu"})


def safe_name(text: str) -> str:
    """A file name from a label: λ, η, μ spelled ``lam``, ``eta``, ``mu``, anything else
    outside ``[A-Za-z0-9_.=-]`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text.translate(_ASCII)).strip("_")


@dataclasses.dataclass
class RunEnd:
    """How a run of :meth:`ProbeRunner.run` ended.

    Attributes:
        diverged: a loss became NaN or infinite.
        summary: its ``summary.json`` ({} when it wrote none).
        final: the last evaluated model ``[P]`` of a run that completed (None: it did not
            complete or did not evaluate).
        notes: what happened beside the run (a rank lost after it completed).
    """

    diverged: bool
    summary: dict[str, Any]
    final: torch.Tensor | None
    notes: list[str]


class _LastModel(RunObserver):
    """Keeps the last evaluated model."""

    weights: torch.Tensor | None = None

    def on_evaluation(self, record: dict[str, Any], weights: torch.Tensor) -> None:
        self.weights = weights.detach().clone()


class ProbeRunner:
    """The one runner of the tuner's runs (probes, long runs, segments of ``--tune``): a
    run config into a run directory, on the simulated cluster in this process or on real
    processes (``keep_ranks``: one :class:`~distsgd.launch.RankPool` for every run,
    restarted when a run needs another number of processes; :meth:`close` ends it).

    A run starts from the seeded model, from given weights ``[P]`` (``sim``; on real
    processes the config's ``train.initial_weights`` file) or, with ``resume``, from the
    run directory's ``checkpoint.pt`` (with :attr:`RunOptions.continues
    <distsgd.control.RunOptions>` another run's, continued under this config's μ and
    batch). The observer hears the run's losses, evaluations and steady-state checks
    (on real processes replayed from what rank 0 recorded, :func:`~distsgd.control.replay`).

    Args:
        simulated: the ``sim`` runtime (else ``dist``).
        num_processes: ``dist``: the processes every run needs
            (:func:`~distsgd.tuner.setup.tune_layout`), the pool's ranks.
        keep_ranks: ``dist``: run on one pool of ranks (else a launch per run).
        code: the user's objects (``sim`` only, as for any run).
    """

    def __init__(
        self,
        simulated: bool,
        *,
        num_processes: int = 1,
        keep_ranks: bool = True,
        code: UserCode | None = None,
    ) -> None:
        self.simulated = simulated
        self.num_processes = num_processes
        self.keep_ranks = keep_ranks
        self.code = code
        self._pool: launch.RankPool | None = None

    def close(self) -> None:
        """End the pool's ranks, if any were started."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def run(
        self,
        cfg: RunConfig,
        run_dir: Path,
        options: RunOptions,
        observer: RunObserver,
        *,
        weights: torch.Tensor | None = None,
        resume: bool = False,
        progress: bool = False,
    ) -> RunEnd:
        """Train ``cfg`` into ``run_dir`` with ``options``; ``observer`` hears it.

        Raises:
            DistRunFailed: a rank was lost before the run completed (one lost after rank
                0 completed it and wrote its files leaves a complete run and a note).
            ConfigError / KeyboardInterrupt: as for any run.
        """
        diverged, notes = False, []
        last = _LastModel()
        try:
            if self.simulated:
                trainer = Trainer(
                    cfg,
                    run_dir,
                    progress=progress,
                    initial_weights=weights,
                    options=options,
                    observer=BothObservers(last, observer),
                    code=self.code,
                )
                trainer.run(resume=resume)
            else:
                self._launch(
                    cfg, run_dir, dataclasses.replace(options, record=True), resume, progress
                )
        except TrainingDiverged:
            diverged = True
        except launch.DistRunFailed as e:
            if run_summary(run_dir).get("status") != "completed":
                raise
            notes.append(f"completed; afterwards {e}")
        final = last.weights
        if not self.simulated:
            replay(run_dir, observer)
            final = recorded_final_weights(run_dir)
        summary = run_summary(run_dir)
        completed = not diverged and summary.get("status") == "completed"
        return RunEnd(diverged, summary, final if completed else None, notes)

    def _launch(
        self, cfg: RunConfig, run_dir: Path, options: RunOptions, resume: bool, progress: bool
    ) -> None:
        if not self.keep_ranks:
            launch.run(cfg, run_dir, resume=resume, progress=progress, options=options)
            return
        if self._pool is None:
            self._pool = launch.RankPool(self.num_processes)
        self._pool.run(cfg, run_dir, resume=resume, progress=progress, options=options)


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
        num_processes: ``dist``: the processes every run needs.
    """

    def __init__(
        self,
        base: RunConfig,
        out_dir: Path,
        probe_seconds: float,
        score_window: int,
        initial: torch.Tensor,
        keep_ranks: bool = False,
        num_processes: int = 1,
    ) -> None:
        check_runtime(base.runtime)
        self.base = base
        self.simulated = base.runtime == "sim"  # the probes run on the simulated cluster
        self.clock = RunClock.of(self.simulated)  # the clock of the probes' records
        self.runner = ProbeRunner(
            self.simulated, num_processes=num_processes, keep_ranks=keep_ranks
        )
        self.out_dir = Path(out_dir)
        self.probe_seconds = probe_seconds
        self.score_window = score_window
        self.snapshots: dict[str, torch.Tensor] = {"initial": initial}
        self.count = 0

    def close(self) -> None:
        """End the pool's ranks (``keep_ranks``), if any were started."""
        self.runner.close()

    def run(
        self,
        cand: Candidate,
        snapshot: str,
        train: dict[str, Any],
        kind: str = "probe",
    ) -> tuple[ProbeResult, torch.Tensor | None]:
        """Train ``cand`` from ``snapshot`` with ``train`` settings; record every tick's
        loss. A probe does not evaluate (its score needs training losses only).

        Returns:
            (the result, the final central model ``[P]`` of a long run that did not
            diverge, else None).
        """
        cfg = candidate_config(self.base, cand, **train)
        self.count += 1
        run_dir = self.out_dir / "probes" / f"{self.count:03d}-{kind}-{safe_name(cand.label())}"
        result = ProbeResult(cand, snapshot, score_window=self.score_window, run_dir=str(run_dir))
        options = RunOptions(evaluate=kind != "probe")
        weights = None
        if self.simulated:
            weights = self.snapshots[snapshot]
        else:
            path = str(self.snapshot_file(snapshot).resolve())
            cfg = cfg.replace(train=dataclasses.replace(cfg.train, initial_weights=path))
        t0 = time.perf_counter()
        end = self.runner.run(
            cfg, run_dir, options, ResultLosses(result, self.simulated), weights=weights
        )
        result.wall_s = time.perf_counter() - t0
        result.diverged, result.notes = end.diverged, end.notes
        result.train_wall_s = float(end.summary.get("train_wall_s") or 0.0)
        result.samples = int(end.summary.get("samples") or 0)
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            result.evals = [json.loads(x) for x in metrics.read_text().splitlines() if x]
        return result, end.final if options.evaluate else None

    def snapshot_file(self, name: str) -> Path:
        """The snapshot's weights as a file for the ranks (written once)."""
        path = self.out_dir / "snapshots" / f"{safe_name(name)}.pt"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            save_checked(self.snapshots[name].clone(), path)
        return path

    def __call__(self, cand: Candidate, snapshot: str) -> ProbeResult:
        """One equal-time probe (the :data:`~distsgd.tuner.omnivore.ProbeFn` interface)."""
        train = run_limits(self.simulated, self.probe_seconds, max_epochs=0.0, max_samples=0)
        result, _ = self.run(cand, snapshot, train)
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
        train = run_limits(
            self.simulated,
            max_epochs=self.base.train.max_epochs if max_epochs is None else max_epochs,
            max_samples=0,
            max_seconds=max_seconds,
            max_virtual_seconds=max_clock_s if self.simulated else 0.0,
            stop_at_target=True,
            eval_every_samples=eval_every_samples,
            save_eval_weights=save_eval_weights,
        )
        result, final = self.run(cand, snapshot, train, kind="long_run")
        if final is not None:
            self.snapshots[name] = final
        return LongRun(result, run_summary(Path(result.run_dir)))

    def eval_snapshot(self, long_run: ProbeResult, eval_index: int, name: str) -> None:
        """Make the model of ``long_run``'s evaluation number ``eval_index`` (its
        kept with ``save_eval_weights``) snapshot ``name``.

        Raises:
            FileNotFoundError: the long run kept no weights for that evaluation.
        """
        self.snapshots[name] = load_checked(eval_weights_file(long_run.run_dir, eval_index))


class ResultLosses(RunObserver):
    """Appends each tick's loss, iterations and clock (the runtime's: simulated seconds on
    ``sim``, wall seconds of training on real processes) to a probe's result, counted from
    ``iterations0`` and ``clock0_s`` (where the probe started)."""

    def __init__(
        self, result: ProbeResult, simulated: bool, iterations0: int = 0, clock0_s: float = 0.0
    ) -> None:
        self.result, self.simulated = result, simulated
        self.iterations0, self.clock0_s = iterations0, clock0_s

    def on_losses(self, point: LossPoint) -> None:
        self.result.losses.append(point.loss)
        self.result.iterations.append(point.iterations - self.iterations0)
        clock = point.clock_s if self.simulated else point.train_wall_s
        self.result.virtual_s.append(clock - self.clock0_s)
