"""The one training loop every runtime shares: data, model, evaluation, stop rule,
checkpoints and metrics.

Run directory layout (``out_dir``):

* ``config.toml`` — the resolved config (calibrated device profile filled in), which
  ``distsgd train`` accepts as is and which reproduces the run;
* ``metrics.jsonl`` — one record per evaluation (see :mod:`distsgd.metrics`);
* ``summary.json`` — the run's outcome (see :func:`train`);
* ``staleness.json`` — histogram of gradient staleness σ;
* ``tb/`` — TensorBoard event files, when ``tensorboard`` is installed and
  ``train.tensorboard`` is on;
* ``checkpoint.pt`` — the latest checkpoint (all state; loaded with ``weights_only=True``),
  with its SHA-256 digest in ``checkpoint.pt.sha256`` (every tensor file distsgd writes
  has one, see :func:`distsgd.metrics.save_checked`; ``--resume`` and
  ``train.initial_weights`` refuse a file that does not match its digest);
* ``model.pt`` — the trained model to take away: a plain ``state_dict()`` of the last
  evaluated model (the central model for SMA, the parameter server and compute groups:
  what :meth:`Runtime.eval_weights` returns) with the BatchNorm running statistics its
  evaluation used, so that ``model.load_state_dict(torch.load(p, weights_only=True))``
  into a fresh module of the run's model, evaluated in eval mode on the evaluation set,
  gives the last ``metrics.jsonl`` record's ``eval_metric`` (the summary's
  ``final_metric``). Written with every checkpoint and when a run ends otherwise
  (diverged, interrupted, a process lost: the last evaluated model). A run with
  ``train.evaluate = false`` saves the weights of each checkpoint with the buffers as the
  module holds them then (:meth:`Trainer._model_state`); ``distsgd export`` writes the
  same file from ``checkpoint.pt``;
* ``run.lock`` — while a run holds the directory: the claim of that run (see
  :class:`RunDirClaim`), removed when it ends;
* ``autotune.json`` — with ``protocol.replicas_per_device = "auto"``: every decision of
  the replicas-per-device auto-tuner (see :mod:`distsgd.replicas`);
* ``membership.jsonl`` — one record per learner (or compute group) that joined or left
  the running run (``cluster.membership``; docs/elastic.md);
* ``join.json`` — on a dist parameter server that learners may join: where ``distsgd
  join RUN_DIR`` finds the run's store (address, port, key namespace; nothing secret);
* ``ticks.jsonl``, ``plateau_checks.jsonl``, ``final_weights.pt`` — with
  :attr:`RunOptions.record <distsgd.control.RunOptions>` (:class:`~distsgd.control.RunRecorder`);
  ``eval_weights/NNNN.pt`` — with ``train.save_eval_weights``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from distsgd.config import (
    ConfigError,
    RunConfig,
    check_schedule,
)
from distsgd.control import LossPoint, RunObserver, RunOptions, RunRecorder, eval_weights_file
from distsgd.data import load_dataset
from distsgd.engine import (
    UserCode,
    build_engine,
    check_on_data,
    config_for_data,
    eval_subset,
)
from distsgd.layout import spec_for
from distsgd.metrics import (
    ChecksumMismatch,
    MetricsWriter,
    OutputWriteError,
    TensorBoardWriter,
    UnsafeContents,
    first_line,
    load_checked,
    load_checkpoint_file,
    save_checked,
    write_atomic,
    write_json,
)
from distsgd.objectives import reached as target_reached
from distsgd.plateau import next_check, steady_state_due
from distsgd.protocols._util import with_momentum
from distsgd.replicas import ReplicaAutoTuner
from distsgd.rundir import RunDirClaim
from distsgd.runtime.base import Tick, TrainingDiverged
from distsgd.runtime.factory import runtime_kind
from distsgd.runtime.faults import RankFaults

__all__ = ["Trainer", "CHECKPOINT_FORMAT", "BothObservers"]

CHECKPOINT_FORMAT = 1
# what a checkpoint written by distsgd holds at the top level, and the type of each entry
_CHECKPOINT_ENTRIES: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "protocol_name": str,
    "num_parameters": int,
    "protocol": dict,
    "runtime": dict,
    "buffers": dict,
    "torch_rng": torch.Tensor,
    "trainer": dict,
}
_log = logging.getLogger("distsgd.autotune")


def _layout(cfg: RunConfig, num_learners: int | None = None, replicas: int | None = None) -> str:
    """The run's layout in one line, e.g. ``"λ=4 b=8 k=2"``: as configured, or with the
    λ and k (replicas per device) the run holds now where given (``"k=2 (auto)"`` when
    the auto-tuner chose it)."""
    return spec_for(cfg.protocol).label(cfg.protocol, num_learners, replicas)


# the progress bar's words for each stop reason of the summary
_STOP_WORDS = {
    "target": "stopped",  # after "target … reached at …"
    "max_epochs/max_samples": "stopped: sample budget",
    "max_seconds": "stopped: train.max_seconds",
    "max_virtual_seconds": "stopped: train.max_virtual_seconds",
    "steady_state": "stopped: loss flattened",
}


def _metric_name(cfg: RunConfig) -> str:
    """What the run's metric is called on the progress bar: ``train.metric`` (a built-in
    name, the function name of a ``"module:function"`` path or of a callable), else
    ``"accuracy"``."""
    metric = getattr(cfg.train, "metric", "accuracy")
    if isinstance(metric, str):
        return metric.rsplit(":", 1)[-1] or "metric"
    return getattr(metric, "__name__", "metric")


def _count(samples: int) -> str:
    """A sample count as the bar shows counts: ``512``, ``45.0k``, ``1.20M``."""
    return tqdm.format_sizeof(samples) if samples >= 1000 else str(int(samples))


def _bar_postfix(
    cfg: RunConfig,
    record: dict[str, Any] | None,
    best: float | None,
    reached_samples: int,
    stop_reason: str = "",
) -> str:
    """The progress bar's postfix: the last evaluation's metric labelled with the training
    samples it was evaluated at (``eval@45.0k``, so it does not pass for a live value),
    the best so far and the target (``→ 0.9 target``, or where it was reached); while the
    run goes on, the evaluation loss when the metric is another and the mean staleness σ
    (updates) for protocols with a parameter server; once it stops, the stop reason
    (``stop_reason`` as in the summary) instead, kept short because a narrow terminal cuts
    the end of the line. Before the first evaluation (``record`` None): what ends the
    run. Formatted at evaluations only, never per tick."""
    name, target = _metric_name(cfg), cfg.train.target
    parts = []
    if record is not None:
        parts.append(f"eval@{_count(record['samples'])} {name} {record['eval_metric']:.4f}")
        if best is not None:
            parts.append(f"(best {best:.4f})")
    elif target > 0:
        parts.append(name)
    if target > 0:
        where = _count(reached_samples)
        parts.append(
            f"target {target:g} reached at {where}"
            if reached_samples >= 0
            else f"→ {target:g} target"
        )
    text = " ".join(parts)
    if stop_reason:
        return "; ".join(p for p in (text, _STOP_WORDS.get(stop_reason, stop_reason)) if p)
    if record is not None and name != "loss" and record.get("eval_loss") is not None:
        text += f", loss {record['eval_loss']:.3f}"
    if record is not None and spec_for(cfg.protocol).has_server:
        if record.get("staleness_mean") is not None:
            text += f", σ {record['staleness_mean']:.2f}"
    return text


class Trainer:
    """Builds every component from a :class:`RunConfig` and runs it to the stop rule.

    Args:
        cfg: the run's configuration.
        out_dir: run directory (created if missing).
        progress: show a progress bar on stderr.
        initial_weights: start from these weights ``[P]`` (e.g. a tuner snapshot) instead
            of the model's seeded initialisation; protocol state (momentum, versions)
            starts fresh.
        on_tick: called after every tick with the :class:`~distsgd.runtime.sim.Tick` and
            the trainer.
        options: how the run is driven beyond its config (:class:`~distsgd.control.RunOptions`;
            default: the config's own run).
        observer: hears the run's losses, evaluations and steady-state checks on the
            writing rank (:class:`~distsgd.control.RunObserver`).
        faults: injected into real processes by tests
            (:class:`~distsgd.runtime.faults.RankFaults`).

    Raises:
        ConfigError: ``out_dir`` already holds a run (and not resuming), is held by
            another run (:class:`RunDirClaim`), is a file or not writable; or a resumed
            checkpoint is not distsgd's, does not match its checksum or the config.
        DatasetError: the dataset is missing or corrupt.
        TrainingDiverged: a loss became NaN/inf (summary.json records it; the last good
            checkpoint is kept).
    """

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: str | Path,
        progress: bool = True,
        *,
        initial_weights: torch.Tensor | None = None,
        on_tick: Callable[[Tick, Trainer], None] | None = None,
        options: RunOptions | None = None,
        observer: RunObserver | None = None,
        faults: RankFaults | None = None,
        code: UserCode | None = None,
    ) -> None:
        self.cfg = cfg
        self.code = code or UserCode()
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.is_writer = True  # the dist runtime: rank 0 (coordinating server) only
        self.initial_weights = initial_weights
        self.on_tick = on_tick
        self.options = options or RunOptions()
        self.observer = observer or RunObserver()
        self.evaluate = self.options.evaluate and cfg.train.evaluate
        self.faults = faults
        # state_dict of the last evaluated model (model.pt), on every rank of the loop
        self._eval_model: dict[str, torch.Tensor] | None = None

    # ---- set-up ------------------------------------------------------------------------
    def _load_data(self) -> RunConfig:
        """Load the dataset under the run's seed, record its resolved root in the config
        (so config.toml reproduces the run anywhere), check it holds one iteration and
        that the schedule's rates over the run's budget are allowed."""
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        self.dataset = load_dataset(cfg.data, seed=cfg.train.seed, factory=self.code.data)
        self.cfg = cfg = config_for_data(cfg, self.dataset, self.code)
        cfg.protocol.check_fits(self.dataset.num_train)
        check_schedule(cfg, self.dataset.num_train)
        return cfg

    def _build(self) -> None:
        """Set up the process (threads; the process group on real processes), load the
        data, build the model under the run's seed and try it on the data (one line for a
        model that does not fit, before anything is measured or written), fold the
        runtime's calibration into the config, then build the protocol and the runtime."""
        kind = self._kind
        kind.prepare(self.cfg)
        cfg = self._load_data()
        torch.manual_seed(cfg.train.seed)  # same seed => same initial weights
        self.engine = build_engine(cfg, self.code)
        # config.toml records the layout train.memory_format = "auto" resolved to
        cfg = cfg.replace(train=replace(cfg.train, memory_format=self.engine.memory_format))
        check_on_data(self.engine, self.dataset, cfg, self.code)
        initial = self._start_weights(self.engine.initial_weights())  # before measuring
        # calibration (a throwaway model, dropout in its steps) draws nothing from the run's
        # generators
        device = self.engine.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.cfg, self.profile_calibrated = kind.calibrate(cfg, self.dataset, self.code)
        self.runtime = kind.build(self.cfg, self.engine, self.dataset, initial)
        self.protocol = self.runtime.protocol
        self.is_writer = self.runtime.is_writer
        # what intermediate evaluations score (train.eval_samples), gathered once
        self._eval_subset = eval_subset(
            self.dataset.test, self.cfg.train.eval_samples, self.cfg.train.seed
        )
        self.tuner = self._replica_tuner()  # every rank: the same decisions

    def _replica_tuner(self) -> ReplicaAutoTuner | None:
        """The replicas-per-device auto-tuner with ``replicas_per_device = "auto"``."""
        p = self.cfg.protocol
        if not p.auto_replicas:
            return None
        # the largest k whose λ·b still fits in the training set
        fit = self.dataset.num_train // (p.num_devices * p.batch_size)
        return ReplicaAutoTuner(
            p.autotune_threshold,
            p.autotune_interval,
            max(1, min(p.autotune_max_replicas, fit)),
            rule=p.autotune_rule,
        )

    def _start_weights(self, initial: torch.Tensor) -> torch.Tensor:
        """The weights ``[P]`` the run starts from: ``initial_weights`` given to the
        constructor, else the file ``train.initial_weights``, else ``initial`` (seeded).

        Raises:
            ConfigError: the file does not load or match its checksum; the weights are
                not ``[P]`` or hold NaN or infinity.
        """
        given = self.initial_weights
        path = self.cfg.train.initial_weights
        if given is None and path:
            try:
                given = load_checked(path)
            except (ChecksumMismatch, UnsafeContents) as e:
                raise ConfigError(f"train.initial_weights = {path!r} is not allowed: {e}") from None
            except Exception as e:  # noqa: BLE001 - missing or not a tensor file
                raise ConfigError(
                    f"train.initial_weights = {path!r} is not allowed: expected a file written "
                    f"by torch.save holding the flattened weights ({first_line(e)})"
                ) from None
        if given is None:
            return initial
        if not isinstance(given, torch.Tensor) or given.shape != initial.shape:
            shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ConfigError(
                f"initial weights have shape {shape}, the model {self.cfg.model.name!r} has "
                f"{tuple(initial.shape)}"
            )
        bad = int((~torch.isfinite(given)).sum())
        if bad:  # every loss would be NaN before any update
            given_here = self.initial_weights is not None
            what = "the initial weights" if given_here else f"train.initial_weights = {path!r}"
            raise ConfigError(
                f"{what} is not allowed: {bad} of its {given.numel()} weights are NaN or "
                "infinite; expected finite weights"
            )
        return given.to(initial.device, initial.dtype).clone()  # read onto the CPU

    # ---- checkpoints -------------------------------------------------------------------
    def _model_state(self) -> dict[str, torch.Tensor]:
        """What ``model.pt`` holds now: the ``state_dict()`` of the last evaluated model
        (parameters at the evaluated weights, the BatchNorm buffers recomputed for them by
        that evaluation); for a run that does not evaluate (``train.evaluate = false``) or
        has not since resuming a checkpoint without it, the weights
        :meth:`Runtime.eval_weights` gives now with the buffers as the module holds them.

        Every rank of the training loop calls it (``eval_weights`` may be collective).
        """
        if self.evaluate and self._eval_model is not None:
            return self._eval_model
        return self.engine.state_dict_at(self.runtime.eval_weights())

    def _save_evaluated_model(self) -> None:
        """``model.pt`` of the last evaluation, on the writer, without a collective: for a
        run that ends on an exception (the model of a later step may be diverged or
        unreachable)."""
        if self.is_writer and self.evaluate and self._eval_model is not None:
            save_checked(self._eval_model, self.out_dir / "model.pt")

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "protocol_name": self.cfg.protocol.name,
            "num_parameters": self.engine.num_parameters,
            "protocol": self.protocol.state_dict(),
            "runtime": self.runtime.state_dict(),
            "buffers": self.engine.buffers_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": _cuda_rng_state(self.engine.device),
            "trainer": dict(self.counters),
            "autotune": self.tuner.state_dict() if self.tuner is not None else None,
            # model.pt's contents (absent from checkpoints before distsgd export)
            "eval_model": self._model_state(),
        }

    def _save_checkpoint(self) -> None:
        state = self._checkpoint_state()  # collective on the dist runtime
        if not self.is_writer:
            return
        save_checked({**state, "launch_id": self._launch_id}, self.out_dir / "checkpoint.pt")
        save_checked(state["eval_model"], self.out_dir / "model.pt")

    def _written_by_this_launch(self) -> bool:
        """Whether the run directory's checkpoint was written by this rank's launch (a
        checkpoint of another run, or one that cannot be read, is not resumed here)."""
        path = self.out_dir / "checkpoint.pt"
        if not self._launch_id or not path.exists():
            return False
        try:
            return load_checkpoint_file(path, "resume").get("launch_id") == self._launch_id
        except ConfigError:
            return False

    def _read_checkpoint(self) -> dict[str, Any]:
        path = self.out_dir / "checkpoint.pt"
        state = load_checkpoint_file(path, "resume")
        if "format" not in state:
            _check_checkpoint_entries(state, path)  # names what a distsgd checkpoint has
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(
                f"cannot resume: {path} has format {state.get('format')!r}, "
                f"expected {CHECKPOINT_FORMAT}"
            )
        _check_checkpoint_entries(state, path)
        if (
            state.get("protocol_name") != self.cfg.protocol.name
            or state.get("num_parameters") != self.engine.num_parameters
        ):
            raise ConfigError(
                f"cannot resume: {path} was written by a different protocol or "
                "model than config.toml describes"
            )
        return state

    def _apply_checkpoint(self, state: dict[str, Any]) -> None:
        """Load a checkpoint that passed :meth:`_read_checkpoint` into every component.

        Raises:
            ConfigError: an entry's contents do not fit this run's components.
        """
        try:
            self._apply_checkpoint_state(state)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
            if isinstance(e, self.runtime.failure_types):
                raise
            raise ConfigError(
                f"cannot resume: {self.out_dir / 'checkpoint.pt'} does not hold the state of "
                f"this run's components ({type(e).__name__}: {e})"
            ) from None

    def _apply_checkpoint_state(self, state: dict[str, Any]) -> None:
        if not self.runtime.runs_training_loop:
            self.runtime.load_state_dict(state["runtime"])  # a learner: its data position
            return
        if self.tuner is not None and state.get("autotune") is not None:
            self.tuner.load_state_dict(state["autotune"])
            self._set_replicas(self.tuner.k)
        protocol_state, runtime_state = state["protocol"], state["runtime"]
        if self.options.continues:  # another run's state under this run's μ (and batch)
            momentum = self.cfg.optimizer.momentum
            protocol_state = with_momentum(protocol_state, momentum)
            runtime_state = with_momentum(runtime_state, momentum)
        self.protocol.load_state_dict(protocol_state)
        self.runtime.load_state_dict(runtime_state)
        self.engine.load_buffers_state(state["buffers"])
        eval_model = state.get("eval_model")  # None in a checkpoint before distsgd export
        self._eval_model = eval_model if isinstance(eval_model, dict) else None
        torch.set_rng_state(state["torch_rng"])
        _set_cuda_rng_state(self.engine.device, state.get("cuda_rng"))
        self.counters.update(_upgraded_counters(state["trainer"]))

    # ---- evaluation --------------------------------------------------------------------
    def _staleness(self) -> tuple[float, int, dict[int, int]]:
        proto = self.protocol
        counts = getattr(proto, "staleness_counts", None)
        if counts is None:  # synchronous: every gradient is applied to the weights it used
            n = self.runtime.samples // max(self.cfg.protocol.batch_size, 1)
            return 0.0, 0, ({0: n} if n else {})
        counts = dict(counts) if isinstance(counts, dict) else dict(enumerate(counts))
        counts = {int(k): int(v) for k, v in counts.items() if v}
        total = sum(counts.values())
        mean = sum(k * v for k, v in counts.items()) / total if total else 0.0
        return mean, (max(counts) if counts else 0), counts

    def _evaluate(self, final: bool = False) -> dict[str, Any] | None:
        """One evaluation of :meth:`Runtime.eval_weights` and, on the writer, its
        ``metrics.jsonl`` record and the target decision.

        An intermediate evaluation scores the ``train.eval_samples`` subset
        (:func:`~distsgd.engine.eval_subset`); the ``final`` one (the run's budget) the
        whole test set. When the subset reaches the target, the whole set is scored at once
        and decides (on dist the writer's decision is shared, so that every rank of the
        loop takes part in the second evaluation): a record whose metric reaches the target
        is always one of the whole set. The record's ``eval_samples`` says which set."""
        c = self.counters
        t0 = time.perf_counter()
        weights = self.runtime.eval_weights()
        if self.cfg.train.save_eval_weights and self.is_writer:
            snap = eval_weights_file(self.out_dir, c["evals"])
            snap.parent.mkdir(parents=True, exist_ok=True)
            save_checked(weights.detach().clone(), snap)
        loss_sum, loss_count = c["loss_sum"], c["loss_count"]
        # every rank's learners' losses
        loss_sum, loss_count = self.runtime.reduce_losses(loss_sum, loss_count)
        c["loss_sum"], c["loss_count"] = 0.0, 0
        value, loss, num_scored = self._score(weights, final)
        # the evaluated model with the BatchNorm statistics it was scored with (model.pt)
        self._eval_model = self.engine.state_dict_at(weights)
        if not self.is_writer:
            c["evals"] += 1
            return None
        c["eval_wall_s"] += time.perf_counter() - t0
        samples = self.runtime.samples
        train_loss = loss_sum / loss_count if loss_count else None
        st_mean, _, _ = self._staleness()
        record = {
            "eval": c["evals"],
            "samples": samples,
            "epoch": samples / self.dataset.num_train,
            "iterations": self.protocol.iteration,
            "virtual_s": self._simulated_s(),  # None on real processes: wall_s is their clock
            "wall_s": c["train_wall_s"],
            "eval_wall_s": c["eval_wall_s"],
            "eval_metric": value,
            "eval_loss": loss,
            "eval_samples": num_scored,
            "train_loss": train_loss,
            "lr": self._lr(),
            "staleness_mean": st_mean,
            "bytes_sent": self.runtime.bytes_sent,
            "dropped_gradients": self.runtime.dropped_gradients,
        }
        c["evals"] += 1
        metric = self.engine.metric
        if c["best_metric"] is None or metric.better(value, c["best_metric"]):
            c["best_metric"] = value
        if (
            num_scored == self.dataset.test.num_samples
            and target_reached(value, self.cfg.train.target, metric.direction)
            and c["reached_samples"] < 0
        ):
            c["reached_samples"] = samples
            c["reached_wall_s"] = c["train_wall_s"]
            c["reached_virtual_s"] = self._simulated_s()
        self.observer.on_evaluation(record, weights)
        return record

    def _score(self, weights: torch.Tensor, final: bool) -> tuple[float, float, int]:
        """(metric, mean loss, samples scored) of ``weights``: the runtime evaluates (on
        dist the ranks in lock step share the set; both recompute BatchNorm statistics for
        ``weights`` first) the evaluation subset, then the whole set if the subset reached
        the target (an accuracy: the target less 3 standard errors on the subset); the whole
        set at once when ``final`` or the subset is the whole set."""
        full, batch_size = self.dataset.test, self.cfg.train.eval_batch_size
        subset = self._eval_subset
        if not final and subset is not full:
            value, loss = self.runtime.evaluate(weights, subset, batch_size)
            metric, target = self.engine.metric, self.cfg.train.target
            if metric.name == "accuracy" and target > 0:
                # 3 standard errors of an accuracy at the target on the subset: a subset
                # that scores below a model that has reached the target on the whole set
                # still sends it to the whole set (else the target is found an
                # evaluation late), with 99.9% probability
                target -= 3 * math.sqrt(target * (1 - target) / subset.num_samples)
            reached = target_reached(value, target, metric.direction)
            if not self.runtime.share(reached and self.counters["reached_samples"] < 0):
                return value, loss, subset.num_samples
        value, loss = self.runtime.evaluate(weights, full, batch_size)
        return value, loss, full.num_samples

    def _simulated_s(self) -> float | None:
        """Seconds on the simulated cluster's virtual clock; None on real processes, whose
        clock is the wall (``train_wall_s``)."""
        return self.runtime.clock_s if self.runtime.clock == "simulated" else None

    def _lr(self) -> float:
        epoch = self.runtime.samples / self.dataset.num_train
        return self.cfg.schedule.lr_at(self.cfg.optimizer.lr, epoch)

    # ---- main loop ---------------------------------------------------------------------
    def _budget_samples(self) -> int | None:
        t = self.cfg.train
        budgets = []
        if t.max_epochs > 0:
            budgets.append(math.ceil(t.max_epochs * self.dataset.num_train))
        if t.max_samples > 0:
            budgets.append(t.max_samples)
        return min(budgets) if budgets else None

    def run(
        self,
        resume: bool = False,
        *,
        dir_claimed: bool = False,
        launch_id: str = "",
        restarted: bool = False,
    ) -> dict[str, Any]:
        """Train to the stop rule; returns the summary (also written to summary.json).

        The writer claims the run directory for the run's life
        (:class:`~distsgd.rundir.RunDirClaim`) unless ``dir_claimed``: the caller (the
        launching process of a dist run) holds the claim. ``launch_id``: the
        launch that started this rank (under torchrun: host, agent pid and run id),
        written into every checkpoint. ``restarted``: the launch restarted its workers
        (torchrun ``--max-restarts``): resume from the run directory's checkpoint when
        that launch wrote it, else start the run as a new one (the writer decides and
        every rank follows).

        On the dist runtime every rank calls this: every rank builds, the writer (rank 0,
        the coordinating server for parameter-server protocols) checks the run directory
        or reads the checkpoint and every rank gets the outcome; then the ranks of the
        training loop train (the writer writes the run directory and returns the
        summary, the others return ``{}``) and a parameter server's learners and shards
        serve (returning ``{}``).
        """
        self._claim: RunDirClaim | None = None
        self._dir_claimed = dir_claimed
        self._launch_id = launch_id
        try:
            self._kind = runtime_kind(self.cfg, self.faults)
            if self._kind.single_process and not dir_claimed:
                # the claim first (held for the run's life; a run that fails to start
                # removes it, and the directory if it made it): no work before it
                self._claim = RunDirClaim.acquire(self.out_dir, new_run=not resume)
            self._build()  # nothing is written before data, model and profile are ready
            self._init_counters()
            state = self._start(resume, restarted)
            resume = state is not None
            if resume:
                self._apply_checkpoint(state)
                self.counters["stop_reason"] = ""
            if not self.runtime.runs_training_loop:
                self.runtime.serve()
                return {}
            if not self.is_writer:
                self.progress = False
                self._loop(None, resumed=resume)
                return {}
            return self._run_writing(resume)
        finally:
            if hasattr(self, "runtime"):
                self.runtime.close()
                late = self.runtime.late_membership()
                if late and self.is_writer and self.out_dir.is_dir():
                    self._record_membership(late)
            if self._claim is not None:
                self._claim.release()

    def _start(self, resume: bool, restarted: bool = False) -> dict[str, Any] | None:
        """The writer claims the run directory for the run's life (if it has not yet, and
        unless the caller holds the claim) and checks it, or reads the checkpoint to
        resume (``resume``, or ``restarted`` and this launch wrote the checkpoint); every rank of
        the run gets the checkpoint (None: a new run), or the same error."""
        start: tuple[str, Any] = ("ok", None)
        if self.is_writer:
            if restarted and self._written_by_this_launch():
                resume = True
                print(
                    f"distsgd: the run's workers were restarted; resuming from "
                    f"{self.out_dir / 'checkpoint.pt'}",
                    file=sys.stderr,
                )
            try:
                if self._claim is None and not self._dir_claimed:
                    self._claim = RunDirClaim.acquire(self.out_dir, new_run=not resume)
                if resume:
                    start = ("ok", self._read_checkpoint())
                    saved = dict(start[1]["trainer"])
                    if saved.get("reached_samples", -1) >= 0 and self.cfg.train.stop_at_target:
                        self.counters.update(saved)
                        self._check_resumable()
            except ConfigError as e:
                start = ("error", str(e))
        kind, payload = self.runtime.share_with_all(start)
        if kind == "error":
            raise ConfigError(payload)
        return payload

    def _init_counters(self) -> None:
        self.counters: dict[str, Any] = {
            "evals": 0,
            "train_wall_s": 0.0,
            "eval_wall_s": 0.0,
            "best_metric": None,
            "reached_samples": -1,
            "reached_wall_s": -1.0,
            "reached_virtual_s": -1.0,
            "loss_sum": 0.0,
            "loss_count": 0,
            "stop_reason": "",
        }

    def _check_resumable(self) -> None:
        self.counters["stop_reason"] = ""
        if self.counters["reached_samples"] >= 0 and self.cfg.train.stop_at_target:
            raise ConfigError(
                f"the run in {str(self.out_dir)!r} already reached its target; "
                "to train on, resume with --set train.stop_at_target=false"
            )

    def _config_toml(self) -> str:
        """``config.toml``'s text: the resolved config, headed by a comment naming the
        sections a Python object (:func:`distsgd.fit`) replaced, which did not train."""
        objects = [
            name
            for name, given in (("[model]", self.code.model), ("[data]", self.code.data))
            if given is not None
        ]
        text = self.cfg.to_toml(applicable_only=True)
        if not objects:
            return text
        return (
            f"# {' and '.join(objects)}: Python objects given to distsgd.fit trained this run, "
            "not the settings below\n" + text
        )

    def _run_writing(self, resume: bool) -> dict[str, Any]:
        """The writing rank's run: files, the training loop, the outcome.

        Raises:
            OutputWriteError: a file of the run directory could not be written (a full
                disk): the run stops; its partial file is removed, the last checkpoint
                kept, and ``summary.json`` says ``"failed"`` if it still fits.
        """
        try:
            return self._write_run(resume)
        except OSError as e:
            if not _is_write_error(e, self.out_dir):
                raise
            err = self._write_failed(e)
        raise err

    def _write_failed(self, e: OSError) -> OutputWriteError:
        """The run's end on a file it could not write: the error naming the file and
        what is kept; a "failed" summary where it still fits."""
        out = self.out_dir
        keep = (
            f"the last checkpoint is kept (continue with --resume {out} once the "
            "directory can be written)"
            if (out / "checkpoint.pt").exists()
            else "no checkpoint was written"
        )
        err = OutputWriteError(f"{OutputWriteError.of(e, out)}; {keep}")
        self.counters["stop_reason"] = "write_failed"
        try:
            if hasattr(self, "metrics"):
                self._write_outcome(self._summary(status="failed", error=str(err)))
        except OSError:
            pass  # still no room: the files written before stay as they were
        return err

    def _write_run(self, resume: bool) -> dict[str, Any]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.out_dir / "config.toml", self._config_toml().encode())
        metrics = MetricsWriter(
            self.out_dir / "metrics.jsonl", keep_evals=self.counters["evals"] if resume else None
        )
        self.metrics = metrics
        kept = metrics.records
        self.tensorboard = TensorBoardWriter(
            self.out_dir / "tb",
            enabled=self.cfg.train.tensorboard,
            purge_step=(kept[-1]["samples"] + 1 if kept else 0) if resume else None,
        )
        self._keep_membership_records(resume)
        join_info = self.runtime.join_info()
        if join_info is not None:  # learners may join: distsgd join RUN_DIR
            write_json(self.out_dir / "join.json", join_info)
        recorder = None
        if self.options.record:
            recorder = RunRecorder(self.out_dir, resume=resume, samples=self.runtime.samples)
            self.observer = BothObservers(self.observer, recorder)
        completed = False
        try:
            summary = self._loop(metrics, resumed=resume)
            completed = True
        except (TrainingDiverged, KeyboardInterrupt, *self.runtime.failure_types) as e:
            # (stop reason, status, error) of the run's end, in this order of precedence
            stop, status, error = (
                ("diverged", "diverged", str(e))
                if isinstance(e, TrainingDiverged)
                else ("interrupted", "interrupted", None)
                if isinstance(e, KeyboardInterrupt)
                else ("process_lost", "failed", str(e))
            )
            self.counters["stop_reason"] = stop
            self._save_evaluated_model()
            self._write_outcome(self._summary(status=status, error=error))
            raise
        finally:
            metrics.close()
            self.tensorboard.close()
            if recorder is not None:
                recorder.close(completed)
        return summary

    def _keep_membership_records(self, resume: bool) -> None:
        """``membership.jsonl`` holds the changes up to the checkpoint resumed from (the
        resumed run makes the later ones again); a new run starts none."""
        path = self.out_dir / "membership.jsonl"
        if not path.exists():
            return
        keep = self.counters.get("membership_records", 0) if resume else 0
        lines = path.read_text().splitlines(keepends=True)[:keep]
        write_atomic(path, "".join(lines).encode())

    def _record_membership(self, records: list[dict[str, Any]]) -> None:
        """Append a tick's membership changes to ``membership.jsonl`` (the writer)."""
        self.counters["membership_records"] = self.counters.get("membership_records", 0) + len(
            records
        )
        if not self.is_writer:
            return
        with (self.out_dir / "membership.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def _plateau_check(self, metrics: MetricsWriter | None) -> bool:
        """The writer's check of the steady-state rule at this evaluation (its decision
        point): from the evaluation records so far only; the observer hears it. Returns
        whether it is due (on the writer; False elsewhere)."""
        if metrics is None:
            return False
        every = self.options.steady_check_samples
        due, used = steady_state_due(metrics.records, self.runtime.samples, every)
        check = {
            "samples": self.runtime.samples,
            "virtual_s": self._simulated_s(),
            "train_wall_s": self.counters["train_wall_s"],
            "window_samples": every,
            "due": due,
            "used": used,
        }
        self.observer.on_steady_check(check)
        return due

    def _observe_losses(self, tick: Tick) -> None:
        """The observer hears a tick's mean training loss (writer only; nothing is built
        for an observer that does not listen to losses)."""
        listens = type(self.observer).on_losses is not RunObserver.on_losses
        if tick.losses and self.is_writer and listens:
            point = LossPoint(
                iterations=self.protocol.iteration,
                samples=self.runtime.samples,
                train_wall_s=self.counters["train_wall_s"],
                clock_s=self.runtime.clock_s,
                loss=sum(tick.losses) / len(tick.losses),
            )
            self.observer.on_losses(point)

    def _loop(self, metrics: MetricsWriter | None, resumed: bool) -> dict[str, Any]:
        """The training loop. On the dist runtime every rank of a synchronous protocol runs
        it in lock step (``metrics`` None except on rank 0, which evaluates and decides
        when to stop; the decision is shared)."""
        cfg, c, rt = self.cfg, self.counters, self.runtime
        t = cfg.train
        num_train = self.dataset.num_train
        eval_every = t.eval_every_samples or num_train
        budget = self._budget_samples()
        next_eval = c["evals"] * eval_every if not resumed else c.get("next_eval", 0)
        # the bar counts training samples towards the sample budget (none: a count), its
        # postfix the last evaluation towards the target; the target or a time budget
        # ending the run first closes it at 100% with the stop reason
        bar = tqdm(
            total=budget,
            initial=min(rt.samples, budget or rt.samples),
            unit="sample",
            unit_scale=True,
            disable=not self.progress,
            dynamic_ncols=True,
            desc=f"{cfg.protocol.name} [{_layout(cfg)}]",
            leave=True,
        )
        postfix = (None, None)  # (last evaluation record, best metric then)
        bar.set_postfix_str(_bar_postfix(cfg, None, None, c["reached_samples"]), refresh=False)
        last_eval_samples = -1 if not resumed else c.get("last_eval_samples", -1)
        # the next check of the steady-state rule (RunOptions.steady_check_samples)
        check_every = self.options.steady_check_samples if self.evaluate else 0
        check_at = next_check(rt.samples, check_every) if check_every else None
        try:
            while True:
                budget_hit = budget is not None and rt.samples >= budget
                simulated_s = self._simulated_s()
                virtual_hit = (
                    t.max_virtual_seconds > 0
                    and simulated_s is not None
                    and simulated_s >= t.max_virtual_seconds
                )
                time_hit = virtual_hit or (t.max_seconds > 0 and c["train_wall_s"] >= t.max_seconds)
                if t.max_seconds > 0 or t.max_virtual_seconds > 0:  # every rank decides alike
                    time_hit = rt.any_rank(time_hit)
                check_hit = check_at is not None and rt.samples >= check_at
                if rt.samples >= next_eval or budget_hit or time_hit or check_hit:
                    if rt.samples != last_eval_samples and self.evaluate:
                        # a steady-state check reads the training loss only: it scores
                        # the subset, as any evaluation before the run's last one
                        record = self._evaluate(final=budget_hit or time_hit)
                        last_eval_samples = rt.samples
                        if record is not None and metrics is not None:
                            metrics.write(record)
                            self.tensorboard.write(record)
                            postfix = (record, c.get("best_metric"))
                            bar.set_postfix_str(
                                _bar_postfix(cfg, *postfix, c["reached_samples"]), refresh=False
                            )
                    while next_eval <= rt.samples:
                        next_eval += eval_every
                    reached = c["reached_samples"] >= 0
                    if reached and t.stop_at_target:
                        c["stop_reason"] = "target"
                    elif budget_hit:
                        c["stop_reason"] = "max_epochs/max_samples"
                    elif time_hit:  # on dist another rank's wall may have reached it
                        c["stop_reason"] = "max_virtual_seconds" if virtual_hit else "max_seconds"
                    elif check_hit:
                        if self._plateau_check(metrics):
                            c["stop_reason"] = "steady_state"
                    if check_hit:
                        check_at = next_check(rt.samples, check_every)
                    c["stop_reason"] = rt.share(c["stop_reason"])  # the writer decides
                    c["next_eval"] = next_eval
                    c["last_eval_samples"] = last_eval_samples
                    every = t.checkpoint_every_evals
                    if c["stop_reason"] or (every and c["evals"] % every == 0):
                        self._save_checkpoint()
                    if c["stop_reason"]:
                        bar.total = bar.n  # what ended the run is reached: 100%
                        bar.set_postfix_str(
                            _bar_postfix(cfg, *postfix, c["reached_samples"], c["stop_reason"]),
                            refresh=False,
                        )
                        break
                lr = self._lr()
                t0 = time.perf_counter()
                v0 = rt.clock_s
                tick = rt.advance(lr)
                c["train_wall_s"] += time.perf_counter() - t0
                if self.tuner is not None and not self.tuner.done:
                    self._autotune(tick.samples, rt.clock_s - v0)
                c["loss_sum"] += sum(tick.losses)
                c["loss_count"] += len(tick.losses)
                self._observe_losses(tick)
                if tick.membership:
                    self._record_membership(tick.membership)
                if self.on_tick is not None:
                    self.on_tick(tick, self)
                bar.update(
                    tick.samples if budget is None else max(0, min(tick.samples, budget - bar.n))
                )
        finally:
            bar.close()
        if not self.is_writer:
            return {}
        summary = self._summary(status="completed")
        self._write_outcome(summary)
        return summary

    # ---- replicas per device (auto-tuner) ----------------------------------------------
    def _set_replicas(self, k: int) -> None:
        """Apply k replicas per device to the protocol and the runtime (a sync point)."""
        p = self.cfg.protocol
        self.protocol.set_replicas_per_device(k, **spec_for(p).replica_settings(p, k))
        self.runtime.set_replicas_per_device(k)

    def _autotune(self, samples: int, seconds: float) -> None:
        """Feed the tuner one synchronisation interval (an iteration for SMA; H iterations,
        ending at the averaging step, for local SGD) of simulated throughput, and apply
        its decision there (Crossbow: k changes at a synchronisation point). On the dist
        runtime the seconds are the slowest rank's wall seconds of the interval (one
        all-reduce), so every rank takes the same decision; rank 0 logs and writes it."""
        c, tuner = self.counters, self.tuner
        assert tuner is not None
        c["autotune_samples"] = c.get("autotune_samples", 0) + samples
        c["autotune_seconds"] = c.get("autotune_seconds", 0.0) + seconds
        p = self.cfg.protocol
        if self.protocol.iteration % spec_for(p).sync_interval(p):
            return  # not at a synchronisation point (local SGD between averagings)
        seconds = self.runtime.max_over_ranks(c["autotune_seconds"])  # the slowest rank's
        decision = tuner.observe(c["autotune_samples"], seconds)
        c["autotune_samples"], c["autotune_seconds"] = 0, 0.0
        if decision is None:
            return
        if decision.k_after != decision.k_before:
            self._set_replicas(decision.k_after)
        if not self.is_writer:
            return
        line = decision.line()
        _log.info(line)
        if self.progress:
            tqdm.write(line)
        write_json(self.out_dir / "autotune.json", tuner.to_json())

    def _write_outcome(self, summary: dict[str, Any]) -> None:
        """summary.json and staleness.json, for finished, diverged and interrupted runs."""
        write_json(self.out_dir / "summary.json", summary)
        _, _, counts = self._staleness()
        write_json(
            self.out_dir / "staleness.json",
            {"counts": {str(k): v for k, v in sorted(counts.items())}},
        )

    def _summary(self, status: str, error: str | None = None) -> dict[str, Any]:
        cfg, c, rt = self.cfg, self.counters, self.runtime
        st_mean, st_max, _ = self._staleness()
        simulated_s = self._simulated_s()
        reached = c["reached_samples"] >= 0
        wall = c["train_wall_s"]
        last = self.metrics.records[-1] if self.metrics.records else {}
        p = cfg.protocol
        served = spec_for(p).has_server
        summary = {
            "name": cfg.name,
            "status": status,
            "stop_reason": c["stop_reason"],
            "protocol": p.name,
            "runtime": cfg.runtime,
            "layout": _layout(cfg, rt.num_learners, rt.replicas_per_device),
            "model": cfg.model.label if self.code.model is None else "(object)",
            "dataset": cfg.data.label if self.code.data is None else "(object)",
            "num_learners": rt.num_learners,
            "batch_size": p.batch_size,
            "global_batch": rt.num_learners * p.batch_size,
            "lr": cfg.optimizer.lr,
            "optimizer": cfg.optimizer.name,
            # SGD's momentum; another optimizer's settings are optimizer.kwargs
            "momentum": cfg.optimizer.momentum if cfg.optimizer.name == "sgd" else None,
            "seed": cfg.train.seed,
            "metric": self.engine.metric.name,
            "metric_direction": self.engine.metric.direction,
            "loss": self.engine.loss.name,
            "target": cfg.train.target,
            # None: the run never evaluated (train.evaluate = false)
            "best_metric": c["best_metric"] if c["evals"] > 0 else None,
            "final_metric": last.get("eval_metric"),
            # test samples scored: by intermediate evaluations (train.eval_samples; the
            # whole set when 0 or larger) and by the last one (the whole set for the final
            # evaluation and for one that reached the target)
            "eval_samples": self._eval_subset.num_samples if self.evaluate else None,
            "final_eval_samples": last.get("eval_samples"),
            "reached": reached,
            "time_to_target_s": c["reached_wall_s"] if reached else None,
            "time_to_target_virtual_s": (
                c["reached_virtual_s"] if reached and simulated_s is not None else None
            ),
            "samples_to_target": c["reached_samples"] if reached else None,
            "epochs_to_target": (
                c["reached_samples"] / self.dataset.num_train if reached else None
            ),
            "samples": rt.samples,
            "epochs": rt.samples / self.dataset.num_train,
            "iterations": self.protocol.iteration,
            "train_wall_s": wall,
            "eval_wall_s": c["eval_wall_s"],
            "virtual_s": simulated_s,  # None on real processes (their clock is the wall)
            "throughput_samples_per_s": rt.samples / wall if wall > 0 else None,
            "throughput_virtual_samples_per_s": (rt.samples / simulated_s if simulated_s else None),
            "bytes_sent": rt.bytes_sent,
            "bytes_sent_per_sample": rt.bytes_sent / rt.samples if rt.samples else None,
            "dropped_gradients": rt.dropped_gradients,
            "compression": p.compression,
            "staleness_mean": st_mean,
            "staleness_max": st_max,
            "replicas_per_device": (rt.replicas_per_device if spec_for(p).replicated else None),
            "num_parameters": self.engine.num_parameters,
            "device_profile": {
                "seconds_per_batch": cfg.cluster.seconds_per_batch,
                "seconds_per_sample": cfg.cluster.seconds_per_sample,
                "seconds_per_replica": cfg.cluster.seconds_per_replica,
                "seconds_per_iteration": cfg.cluster.seconds_per_iteration,
                # the server's figures: runs with a parameter server only (else None)
                "seconds_per_push": cfg.cluster.seconds_per_push if served else None,
                "seconds_per_push_contended": (
                    cfg.cluster.seconds_per_push_contended if served else None
                ),
                "cores": cfg.cluster.cores,
                "calibrated": self.profile_calibrated,
                "replica_ratios": cfg.cluster.replica_ratios,
            },
            "finished_at": datetime.now().isoformat(timespec="seconds"),
        }
        summary.update(rt.summary_fields())
        if error:
            summary["error"] = error
        return summary


# errors of a file system that takes no more data (full, over quota, read-only)
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def _is_write_error(e: OSError, out_dir: Path) -> bool:
    """Whether ``e`` is a failure to write a file of the run directory ``out_dir`` (not a
    socket's or another process's error)."""
    if isinstance(e, OutputWriteError) or e.errno in _STORAGE_ERRNOS:
        return True
    if not e.filename:
        return False
    return Path(os.path.abspath(e.filename)).is_relative_to(os.path.abspath(out_dir))


def _upgraded_counters(saved: dict[str, Any]) -> dict[str, Any]:
    """Trainer counters of a checkpoint, with the name an earlier version gave the best
    evaluation (``best_accuracy``: accuracy was the only metric) changed to today's."""
    saved = dict(saved)
    if "best_accuracy" in saved:
        saved.setdefault("best_metric", saved.pop("best_accuracy"))
    return saved


def _check_checkpoint_entries(state: dict[str, Any], path: Path) -> None:
    """Refuse a file that loads but is not a checkpoint written by distsgd.

    Raises:
        ConfigError: ``state`` lacks an entry of ``_CHECKPOINT_ENTRIES`` or holds one of
            another type.
    """
    missing = [k for k in _CHECKPOINT_ENTRIES if k not in state]
    if missing:
        raise ConfigError(
            f"cannot resume: {path} is not a checkpoint written by distsgd: it lacks "
            + ", ".join(missing)
        )
    for key, kind in _CHECKPOINT_ENTRIES.items():
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise ConfigError(
                f"cannot resume: {path} is not a checkpoint written by distsgd: its {key!r} "
                f"is a {type(state[key]).__name__}"
            )


def _cuda_rng_state(device: torch.device) -> torch.Tensor | None:
    """The CUDA generator's state of ``device`` (a CPU byte tensor; what dropout on the GPU
    draws from), None on a CPU run."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_cuda_rng_state(device: torch.device, state: torch.Tensor | None) -> None:
    """Restore a checkpoint's CUDA generator state on a CUDA run; a checkpoint written on
    the CPU (None) or a CUDA checkpoint resumed on the CPU leaves the generators as the
    run's seed set them (checkpoints are device-independent)."""
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


class BothObservers(RunObserver):
    """Two observers, each hearing every event in order."""

    def __init__(self, first: RunObserver, second: RunObserver) -> None:
        self.first, self.second = first, second

    def on_losses(self, point: LossPoint) -> None:
        self.first.on_losses(point)
        self.second.on_losses(point)

    def on_evaluation(self, record: dict[str, Any], weights: torch.Tensor) -> None:
        self.first.on_evaluation(record, weights)
        self.second.on_evaluation(record, weights)

    def on_steady_check(self, check: dict[str, Any]) -> None:
        self.first.on_steady_check(check)
        self.second.on_steady_check(check)
