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
* ``run.lock`` — while a run holds the directory: the claim of that run (see
  :class:`RunDirClaim`), removed when it ends;
* ``autotune.json`` — with ``protocol.replicas_per_device = "auto"``: every decision of
  the replicas-per-device auto-tuner (see :mod:`distsgd.tuner.replicas`);
* ``ticks.jsonl``, ``final_weights.pt`` — with ``train.record_ticks``;
  ``eval_weights/NNNN.pt`` — with ``train.save_eval_weights`` (see
  :class:`~distsgd.config.TrainConfig`).
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import logging
import math
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from distsgd.config import (
    ConfigError,
    ConfigWarning,
    RunConfig,
    check_local_processes,
    schedule_conflicts,
)
from distsgd.data import load_dataset, resolve_root
from distsgd.engine import GradientEngine
from distsgd.metrics import (
    ChecksumMismatch,
    MetricsWriter,
    TensorBoardWriter,
    load_checked,
    save_checked,
    write_json,
)
from distsgd.models import build_model
from distsgd.protocols import build_protocol
from distsgd.protocols.base import AsynchronousProtocol
from distsgd.runtime.sim import (
    REPLICA_CALIBRATION_MAX_K,
    DeviceProfile,
    SimRuntime,
    Tick,
    TrainingDiverged,
    calibrate,
    calibrate_replicas,
)
from distsgd.tuner.replicas import ReplicaAutoTuner

__all__ = ["train", "Trainer", "RunDirClaim", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
_RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoint.pt")
RUN_LOCK = "run.lock"
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
    p = cfg.protocol
    lam = p.num_learners if num_learners is None else num_learners
    base = f"λ={lam} b={p.batch_size}"
    if p.name in ("sma", "local_sgd"):
        k = f"k={p.replicas_per_device if replicas is None else replicas}"
        if replicas is not None and p.auto_replicas:
            k += " (auto)"
        return f"{base} {k}" if p.name == "sma" else f"{base} {k} H={p.average_every}"
    if p.name == "parameter_server":
        if p.mode == "softsync":
            return f"{base} {p.softsync}-softsync"
        return f"{base} {p.mode}"
    if p.name == "compute_groups":
        return f"{base} g={p.num_groups}"
    return base


def check_out_dir_writable(out_dir: str | Path) -> None:
    """Refuse a run directory that cannot be one, before anything is started or written.

    Raises:
        ConfigError: ``out_dir`` (or a folder on its path) is a file, or the directory
            (or, when it does not exist yet, the nearest existing folder above it) is not
            writable by this process.
    """
    out = Path(out_dir)
    for node in (out, *out.parents):
        if node.exists() or node.is_symlink():
            if not node.is_dir():
                what = "is a file" if node == out else f"lies under {str(node)!r}, a file"
                raise ConfigError(
                    f"--out {str(out)!r} {what}: expected a directory (new, or a run's)"
                )
            if not os.access(node, os.W_OK | os.X_OK):
                raise ConfigError(
                    f"--out {str(out)!r} is not writable: {str(node)!r} does not allow this "
                    "process to create files; choose a writable directory"
                )
            return


class RunDirClaim:
    """One run's exclusive claim on its run directory, held for the run's whole life.

    An OS lock, ``fcntl.flock`` on ``<out_dir>/run.lock`` (released by the kernel when the
    holding process ends, however it ends), with the holder's pid, host and start time
    written in the file so that a refused run can name it. Two runs into one directory:
    the second stops with a :class:`ConfigError` naming the first. The lock file is
    removed when the claim is released, and so is the directory when the claim created
    it and nothing else was written.

    Who holds it: the process that owns the run directory: the one running a ``sim`` run;
    the launching process of a ``dist`` run on one machine (its rank 0 finds the claim
    held by its parent and goes on); rank 0 under torchrun.

    Example::

        claim = RunDirClaim.acquire("runs/r")
        try:
            ...  # write the run
        finally:
            claim.release()
    """

    def __init__(self, out_dir: Path, fd: int, created: list[Path]) -> None:
        self.out_dir = out_dir
        self.path = out_dir / RUN_LOCK
        self._fd: int | None = fd
        self._created = created  # the folders the claim made, deepest first

    @classmethod
    def acquire(cls, out_dir: str | Path, *, parent_may_hold: bool = False) -> RunDirClaim | None:
        """Create ``out_dir`` if missing and claim it.

        Args:
            out_dir: the run directory.
            parent_may_hold: a claim held by this process's parent on this host is the
                run's own (a rank started by the local launcher): return None.

        Raises:
            ConfigError: ``out_dir`` cannot be created or written, or another run holds
                it (the message names its pid and host).
        """
        out = Path(out_dir)
        check_out_dir_writable(out)
        for _ in range(10):  # retried only if the lock file was removed under us
            created = [d for d in (out, *out.parents) if not d.exists()]
            try:
                out.mkdir(parents=True, exist_ok=True)
                fd = os.open(out / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue  # the folder was removed by a claim ending just now
            except OSError as e:
                raise ConfigError(
                    f"--out {str(out)!r} cannot be written: {e.strerror or e}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if parent_may_hold and _is_parent(holder):
                    return None
                raise ConfigError(
                    f"output directory {str(out)!r} is in use by another run "
                    f"({_describe_holder(holder)}); wait for it to end or choose another "
                    "output directory (--out)"
                ) from None
            if _same_file(fd, out / RUN_LOCK):
                _write_holder(fd)
                return cls(out, fd, created)
            os.close(fd)  # we locked a lock file that its holder removed: try again
        raise ConfigError(f"output directory {str(out)!r} could not be claimed (lock file churn)")

    def release(self) -> None:
        """End the claim: remove the lock file (and the directory if the claim created it
        and it is empty, with the missing folders above it), then unlock. Idempotent."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
            for folder in self._created:
                folder.rmdir()  # only if nothing else was written
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_holder(fd: int) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": datetime.now().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _is_parent(holder: dict[str, Any]) -> bool:
    return holder.get("pid") == os.getppid() and holder.get("host") == socket.gethostname()


def _describe_holder(holder: dict[str, Any]) -> str:
    if "pid" not in holder:
        return "holder not yet recorded"
    since = f" since {holder['started_at']}" if holder.get("started_at") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')}{since}"


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
            the trainer (e.g. to record every training loss of a tuner probe).
        evaluate: evaluate on the test set (False: no evaluations and no metrics
            records, e.g. for a tuner probe that only needs its training losses).

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
        evaluate: bool = True,
    ) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.is_writer = True  # the dist runtime: rank 0 (coordinating server) only
        self.initial_weights = initial_weights
        self.on_tick = on_tick
        self.evaluate = evaluate and cfg.train.evaluate

    # ---- set-up ------------------------------------------------------------------------
    def _load_data(self) -> RunConfig:
        """Load the dataset under the run's seed, record its resolved root in the config
        (so config.toml reproduces the run anywhere) and check it holds one iteration."""
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        self.dataset = load_dataset(cfg.data, seed=cfg.train.seed)
        if cfg.data.dataset != "synthetic" and not cfg.data.root:
            root = str(resolve_root(cfg.data))
            self.cfg = cfg = cfg.replace(data=dataclasses.replace(cfg.data, root=root))
        if self.dataset.num_train < cfg.protocol.global_batch:
            raise ConfigError(
                f"protocol.batch_size = {cfg.protocol.batch_size} with protocol.num_learners = "
                f"{cfg.protocol.num_learners} needs {cfg.protocol.global_batch} samples per "
                f"iteration but the training set has {self.dataset.num_train}"
            )
        return cfg

    def _build(self) -> None:
        cfg = self.cfg
        if cfg.runtime == "dist":
            return self._build_dist()
        threads = cfg.train.num_threads or (os.cpu_count() or 1)
        torch.set_num_threads(threads)
        cfg = self._load_data()
        shape, classes = self.dataset.input_shape, self.dataset.num_classes
        self.profile_calibrated = self.cfg.cluster.needs_calibration
        if self.profile_calibrated:
            # a throwaway model: timing it must not touch the run's weights, BatchNorm
            # statistics or RNG stream
            prof = calibrate(
                GradientEngine(build_model(cfg.model.name, shape, classes)), self.dataset
            )
            self.cfg = cfg = cfg.replace(
                cluster=dataclasses.replace(
                    cfg.cluster,
                    seconds_per_sample=prof.seconds_per_sample,
                    seconds_per_batch=prof.seconds_per_batch,
                )
            )
        p = cfg.protocol
        replicated = p.name in ("sma", "local_sgd")
        k = p.initial_replicas_per_device if replicated else 1
        c = cfg.cluster
        if (
            replicated
            and (k > 1 or p.auto_replicas)
            and c.seconds_per_replica < 0
            and not c.replica_ratios
        ):
            # the k-dependent device profile: t(k)/t(1) measured at the run's b where the
            # profile is calibrated, else the profile's own "k separate minibatches"
            if self.profile_calibrated:
                # the fixed k, or the k the tuner is likely to try (beyond, the model
                # continues the last measured step)
                top = min(p.autotune_max_replicas, REPLICA_CALIBRATION_MAX_K)
                ratios, _ = calibrate_replicas(
                    GradientEngine(build_model(cfg.model.name, shape, classes)),
                    self.dataset,
                    p.batch_size,
                    max_replicas=top if p.auto_replicas else k,
                )
                c = dataclasses.replace(c, replica_ratios=ratios)
            if not c.replica_ratios:
                t1 = c.seconds_per_batch + p.batch_size * c.seconds_per_sample
                c = dataclasses.replace(c, seconds_per_replica=t1)
            self.cfg = cfg = cfg.replace(cluster=c)
        r = c.seconds_per_replica
        profile = DeviceProfile(
            c.seconds_per_batch,
            c.seconds_per_sample,
            self.profile_calibrated,
            seconds_per_replica=r if r >= 0 else None,
            replica_ratios=tuple(c.replica_ratios),
        )
        torch.manual_seed(cfg.train.seed)  # same seed => same initial weights
        self.engine = GradientEngine(build_model(cfg.model.name, shape, classes))
        initial = self._start_weights(self.engine.initial_weights())
        self.protocol = build_protocol(cfg, initial)
        self.tuner = self._replica_tuner()
        self.runtime = SimRuntime(
            self.protocol,
            self.engine,
            self.dataset,
            batch_size=p.batch_size,
            num_learners=p.num_learners,
            profile=profile,
            cluster=cfg.cluster,
            replicas_per_device=k,
            average_every=p.average_every if p.name == "local_sgd" else 1,
            seed=cfg.train.seed,
        )

    def _build_dist(self) -> None:
        """Real processes (:mod:`distsgd.runtime.dist`): join the process group, then build
        data, model and this rank's part of the protocol under the run's seed."""
        from distsgd.runtime import dist as rdist

        cfg = self.cfg
        info = rdist.process_info()
        if info is None:
            raise RuntimeError(
                "runtime 'dist' runs inside processes started by distsgd.runtime.launch or "
                "torchrun; use distsgd.train() or the distsgd CLI"
            )
        torch.set_num_threads(rdist.threads_per_process(cfg, info))
        rdist.init_process_group(cfg, info)
        cfg = self._load_data()
        self.profile_calibrated = False  # no simulated clock: cluster settings are unused
        torch.manual_seed(cfg.train.seed)  # same seed => same initial weights as sim
        shape, classes = self.dataset.input_shape, self.dataset.num_classes
        self.engine = GradientEngine(build_model(cfg.model.name, shape, classes))
        self.runtime = rdist.build_runtime(
            cfg, self.engine, self.dataset, self._start_weights(self.engine.initial_weights())
        )
        self.protocol = self.runtime.protocol
        self.is_writer = self.runtime.is_writer
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
        constructor, else the file ``train.initial_weights``, else ``initial`` (seeded)."""
        given = self.initial_weights
        path = self.cfg.train.initial_weights
        if given is None and path:
            try:
                given = load_checked(path)
            except ChecksumMismatch as e:
                raise ConfigError(f"train.initial_weights = {path!r} is not allowed: {e}") from None
            except Exception as e:  # noqa: BLE001 - missing or not a tensor file
                raise ConfigError(
                    f"train.initial_weights = {path!r} is not allowed: expected a file written "
                    f"by torch.save holding the flattened weights ({e})"
                ) from None
        if given is None:
            return initial
        if not isinstance(given, torch.Tensor) or given.shape != initial.shape:
            shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ConfigError(
                f"initial weights have shape {shape}, the model {self.cfg.model.name!r} has "
                f"{tuple(initial.shape)}"
            )
        return given.to(initial.dtype).clone()

    # ---- checkpoints -------------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "protocol_name": self.cfg.protocol.name,
            "num_parameters": self.engine.num_parameters,
            "protocol": self.protocol.state_dict(),
            "runtime": self.runtime.state_dict(),
            "buffers": self.engine.buffers_state(),
            "torch_rng": torch.get_rng_state(),
            "trainer": dict(self.counters),
            "autotune": self.tuner.state_dict() if self.tuner is not None else None,
        }

    def _save_checkpoint(self) -> None:
        state = self._checkpoint_state()  # collective on the dist runtime
        if not self.is_writer:
            return
        save_checked(state, self.out_dir / "checkpoint.pt")

    def _load_checkpoint(self) -> None:
        self._apply_checkpoint(self._read_checkpoint())

    def _read_checkpoint(self) -> dict[str, Any]:
        path = self.out_dir / "checkpoint.pt"
        if not path.exists():
            raise ConfigError(f"cannot resume: {path} does not exist")
        try:
            state = load_checked(path)
        except ChecksumMismatch as e:
            raise ConfigError(f"cannot resume: {e}") from None
        except Exception as e:  # noqa: BLE001 - any unpickling failure means corrupt
            raise ConfigError(f"cannot resume: {path} is not a readable checkpoint ({e})") from None
        if not isinstance(state, dict):
            raise ConfigError(
                f"cannot resume: {path} holds a {type(state).__name__}, not a checkpoint "
                "written by distsgd (a dict of the run's state)"
            )
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
            if isinstance(e, RuntimeError) and _is_process_loss(e):
                raise
            raise ConfigError(
                f"cannot resume: {self.out_dir / 'checkpoint.pt'} does not hold the state of "
                f"this run's components ({type(e).__name__}: {e})"
            ) from None

    def _apply_checkpoint_state(self, state: dict[str, Any]) -> None:
        if self.cfg.runtime == "dist" and not getattr(self.runtime, "runs_training_loop", True):
            self.runtime.load_state_dict(state["runtime"])  # a learner: its data position
            return
        if self.tuner is not None and state.get("autotune") is not None:
            self.tuner.load_state_dict(state["autotune"])
            self._set_replicas(self.tuner.k)
        self.protocol.load_state_dict(state["protocol"])
        self.runtime.load_state_dict(state["runtime"])
        self.engine.load_buffers_state(state["buffers"])
        torch.set_rng_state(state["torch_rng"])
        self.counters.update(state["trainer"])

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

    def _evaluate(self) -> dict[str, Any] | None:
        c = self.counters
        t0 = time.perf_counter()
        weights = self.runtime.eval_weights()
        if self.cfg.train.record_ticks and self.is_writer:
            self._final_weights = weights.clone()  # final_weights.pt at the end of the run
        if self.cfg.train.save_eval_weights and self.is_writer:
            snap = self.out_dir / "eval_weights" / f"{c['evals']:04d}.pt"
            snap.parent.mkdir(parents=True, exist_ok=True)
            save_checked(weights.detach().clone(), snap)
        loss_sum, loss_count = c["loss_sum"], c["loss_count"]
        if self.cfg.runtime == "dist":  # every rank's learners' losses
            loss_sum, loss_count = self.runtime.reduce_losses(loss_sum, loss_count)
        c["loss_sum"], c["loss_count"] = 0.0, 0
        evaluate = self.engine.evaluate
        if self.cfg.runtime == "dist":  # the ranks in lock step share the test set
            evaluate = self.runtime.evaluate
        acc, loss = evaluate(
            weights,
            self.dataset.test_x,
            self.dataset.test_y,
            self.cfg.train.eval_batch_size,
        )
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
            "iterations": self._iterations(),
            "virtual_s": self.runtime.virtual_time,
            "wall_s": c["train_wall_s"],
            "eval_wall_s": c["eval_wall_s"],
            "test_accuracy": acc,
            "test_loss": loss,
            "train_loss": train_loss,
            "lr": self._lr(),
            "staleness_mean": st_mean,
        }
        c["evals"] += 1
        if acc > c["best_accuracy"]:
            c["best_accuracy"] = acc
        target = self.cfg.train.target_accuracy
        if target > 0 and acc >= target and c["reached_samples"] < 0:
            c["reached_samples"] = samples
            c["reached_wall_s"] = c["train_wall_s"]
            c["reached_virtual_s"] = self.runtime.virtual_time
        return record

    def _iterations(self) -> int:
        proto = self.protocol
        if isinstance(proto, AsynchronousProtocol):
            return proto.version
        return proto.iteration

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

    def _check_out_dir(self) -> None:
        """Refuse an ``out_dir`` that cannot be written or already holds a run.

        Raises:
            ConfigError: see :func:`check_out_dir_writable`; or a run's files are there.
        """
        check_out_dir_writable(self.out_dir)
        if any((self.out_dir / f).exists() for f in _RUN_FILES):
            hint = (
                "continue it with --resume"
                if (self.out_dir / "checkpoint.pt").exists()
                else "it has no checkpoint to resume from; delete it to start again"
            )
            raise ConfigError(
                f"output directory {str(self.out_dir)!r} already holds a run; choose another "
                f"output directory (--out) or {hint}"
            )

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Train to the stop rule; returns the summary (also written to summary.json).

        On the dist runtime every rank calls this; rank 0 (the coordinating server for
        parameter-server protocols) writes the run directory and returns the summary,
        other ranks return ``{}``.
        """
        if self.cfg.runtime == "dist":
            return self._run_dist(resume)
        # the claim first (a run that fails to start removes it, and the directory if it
        # made it); no run file is written before data, model and profile are ready
        claim = RunDirClaim.acquire(self.out_dir)
        try:
            if not resume:
                self._check_out_dir()
            self._build()
            self._init_counters()
            if resume:
                self._load_checkpoint()
                self._check_resumable()
            return self._run_writing(resume)
        finally:
            if claim is not None:
                claim.release()

    def _init_counters(self) -> None:
        self.counters: dict[str, Any] = {
            "evals": 0,
            "train_wall_s": 0.0,
            "eval_wall_s": 0.0,
            "best_accuracy": 0.0,
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
                f"the run in {str(self.out_dir)!r} already reached its target accuracy; "
                "to train on, resume with --set train.stop_at_target=false"
            )

    def _run_dist(self, resume: bool) -> dict[str, Any]:
        """Every rank: build, agree on the start (rank 0 checks the run directory and
        reads the checkpoint), then train in the one loop or serve (parameter-server
        learners and shards)."""
        claim = None
        try:
            self._build()
            rt = self.runtime
            self._init_counters()
            start: tuple[str, Any] = ("ok", None)
            if self.is_writer:
                try:
                    # held by the local launcher (this rank's parent), else by this rank
                    claim = RunDirClaim.acquire(self.out_dir, parent_may_hold=True)
                    if resume:
                        start = ("ok", self._read_checkpoint())
                        saved = dict(start[1]["trainer"])
                        if saved.get("reached_samples", -1) >= 0 and self.cfg.train.stop_at_target:
                            self.counters.update(saved)
                            self._check_resumable()
                    else:
                        self._check_out_dir()
                except ConfigError as e:
                    start = ("error", str(e))
            kind, payload = rt.share_with_all(start)
            if kind == "error":
                raise ConfigError(payload)
            if resume:
                self._apply_checkpoint(payload)
                self.counters["stop_reason"] = ""
            if not getattr(rt, "runs_training_loop", True):
                rt.serve()
                return {}
            if not self.is_writer:
                self.progress = False
                self._loop(None, resumed=resume)
                return {}
            return self._run_writing(resume)
        finally:
            if hasattr(self, "runtime"):
                self.runtime.close()
            if claim is not None:
                claim.release()

    def _run_writing(self, resume: bool) -> dict[str, Any]:
        """The writing rank's run: files, the training loop, the outcome."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.toml").write_text(self.cfg.to_toml())
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
        ticks = None
        if self.cfg.train.record_ticks:
            ticks = (self.out_dir / "ticks.jsonl").open("a" if resume else "w")
            self.on_tick = self._tick_recorder(ticks, self.on_tick)
        try:
            summary = self._loop(metrics, resumed=resume)
            if getattr(self, "_final_weights", None) is not None:
                save_checked(self._final_weights, self.out_dir / "final_weights.pt")
        except TrainingDiverged as e:
            self.counters["stop_reason"] = "diverged"
            self._write_outcome(self._summary(status="diverged", error=str(e)))
            raise
        except KeyboardInterrupt:
            self.counters["stop_reason"] = "interrupted"
            self._write_outcome(self._summary(status="interrupted"))
            raise
        except getattr(self.runtime, "failure_types", ()) as e:
            self.counters["stop_reason"] = "process_lost"
            self._write_outcome(self._summary(status="failed", error=str(e)))
            raise
        finally:
            metrics.close()
            self.tensorboard.close()
            if ticks is not None:
                ticks.close()
        return summary

    @staticmethod
    def _tick_recorder(
        f: Any, then: Callable[[Tick, Trainer], None] | None
    ) -> Callable[[Tick, Trainer], None]:
        """``train.record_ticks``: one ``ticks.jsonl`` line per tick with losses."""

        def on_tick(tick: Tick, trainer: Trainer) -> None:
            if tick.losses:
                rec = {
                    "iterations": trainer._iterations(),
                    "samples": trainer.runtime.samples,
                    "train_wall_s": trainer.counters["train_wall_s"],
                    "clock_s": trainer.runtime.virtual_time,
                    "loss": sum(tick.losses) / len(tick.losses),
                }
                f.write(json.dumps(rec) + "\n")
            if then is not None:
                then(tick, trainer)

        return on_tick

    def _loop(self, metrics: MetricsWriter | None, resumed: bool) -> dict[str, Any]:
        """The training loop. On the dist runtime every rank of a synchronous protocol runs
        it in lock step (``metrics`` None except on rank 0, which evaluates and decides
        when to stop; the decision is shared)."""
        cfg, c, rt = self.cfg, self.counters, self.runtime
        is_dist = cfg.runtime == "dist"
        t = cfg.train
        num_train = self.dataset.num_train
        eval_every = t.eval_every_samples or num_train
        budget = self._budget_samples()
        next_eval = c["evals"] * eval_every if not resumed else c.get("next_eval", 0)
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
        last_eval_samples = -1 if not resumed else c.get("last_eval_samples", -1)
        try:
            while True:
                budget_hit = budget is not None and rt.samples >= budget
                time_hit = t.max_seconds > 0 and c["train_wall_s"] >= t.max_seconds
                time_hit = time_hit or (
                    t.max_virtual_seconds > 0 and rt.virtual_time >= t.max_virtual_seconds
                )
                if is_dist and (t.max_seconds > 0 or t.max_virtual_seconds > 0):
                    time_hit = rt.any_rank(time_hit)
                if rt.samples >= next_eval or budget_hit or time_hit:
                    if rt.samples != last_eval_samples and self.evaluate:
                        record = self._evaluate()
                        last_eval_samples = rt.samples
                        if record is not None and metrics is not None:
                            metrics.write(record)
                            self.tensorboard.write(record)
                            bar.set_postfix(
                                acc=f"{record['test_accuracy']:.4f}",
                                loss=f"{record['test_loss']:.3f}",
                                sigma=f"{record['staleness_mean']:.2f}",
                                refresh=False,
                            )
                    while next_eval <= rt.samples:
                        next_eval += eval_every
                    reached = c["reached_samples"] >= 0
                    if reached and t.stop_at_target:
                        c["stop_reason"] = "target_accuracy"
                    elif budget_hit:
                        c["stop_reason"] = "max_epochs/max_samples"
                    elif time_hit:
                        c["stop_reason"] = (
                            "max_seconds"
                            if t.max_seconds > 0 and c["train_wall_s"] >= t.max_seconds
                            else "max_virtual_seconds"
                        )
                    if is_dist:
                        c["stop_reason"] = rt.share(c["stop_reason"])
                    c["next_eval"] = next_eval
                    c["last_eval_samples"] = last_eval_samples
                    every = t.checkpoint_every_evals
                    if c["stop_reason"] or (every and c["evals"] % every == 0):
                        self._save_checkpoint()
                    if c["stop_reason"]:
                        break
                lr = self._lr()
                t0 = time.perf_counter()
                v0 = rt.virtual_time
                tick = rt.advance(lr)
                c["train_wall_s"] += time.perf_counter() - t0
                if self.tuner is not None and not self.tuner.done:
                    self._autotune(tick.samples, rt.virtual_time - v0)
                c["loss_sum"] += sum(tick.losses)
                c["loss_count"] += len(tick.losses)
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
        if p.name == "sma":
            # α = 0 means 1 / (all learners) = 1 / (devices · k), SPEC §4
            alpha = p.alpha if p.alpha > 0 else 1.0 / (p.num_devices * k)
            self.protocol.set_replicas_per_device(k, alpha=alpha)
        else:
            self.protocol.set_replicas_per_device(k)
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
        if p.name == "local_sgd" and self.protocol.iteration % p.average_every:
            return
        seconds = c["autotune_seconds"]
        if self.cfg.runtime == "dist":
            seconds = self.runtime.max_over_ranks(seconds)
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
        reached = c["reached_samples"] >= 0
        wall = c["train_wall_s"]
        last = self.metrics.records[-1] if self.metrics.records else {}
        p = cfg.protocol
        summary = {
            "name": cfg.name,
            "status": status,
            "stop_reason": c["stop_reason"],
            "protocol": p.name,
            "runtime": cfg.runtime,
            "layout": _layout(cfg, rt.num_learners, getattr(rt, "replicas_per_device", None)),
            "model": cfg.model.name,
            "dataset": cfg.data.dataset,
            "num_learners": rt.num_learners,
            "batch_size": p.batch_size,
            "global_batch": rt.num_learners * p.batch_size,
            "lr": cfg.optimizer.lr,
            "momentum": cfg.optimizer.momentum,
            "seed": cfg.train.seed,
            "target_accuracy": cfg.train.target_accuracy,
            # None: the run never evaluated (train.evaluate = false)
            "best_accuracy": c["best_accuracy"] if c["evals"] > 0 else None,
            "final_accuracy": last.get("test_accuracy"),
            "reached": reached,
            "time_to_accuracy_s": c["reached_wall_s"] if reached else None,
            "time_to_accuracy_virtual_s": c["reached_virtual_s"] if reached else None,
            "samples_to_accuracy": c["reached_samples"] if reached else None,
            "epochs_to_accuracy": (
                c["reached_samples"] / self.dataset.num_train if reached else None
            ),
            "samples": rt.samples,
            "epochs": rt.samples / self.dataset.num_train,
            "iterations": self._iterations(),
            "train_wall_s": wall,
            "eval_wall_s": c["eval_wall_s"],
            "virtual_s": rt.virtual_time,
            "throughput_samples_per_s": rt.samples / wall if wall > 0 else None,
            "throughput_virtual_samples_per_s": (
                rt.samples / rt.virtual_time if rt.virtual_time > 0 else None
            ),
            "staleness_mean": st_mean,
            "staleness_max": st_max,
            "replicas_per_device": (
                self.runtime.replicas_per_device if p.name in ("sma", "local_sgd") else None
            ),
            "num_parameters": self.engine.num_parameters,
            "device_profile": {
                "seconds_per_batch": cfg.cluster.seconds_per_batch,
                "seconds_per_sample": cfg.cluster.seconds_per_sample,
                "seconds_per_replica": cfg.cluster.seconds_per_replica,
                "calibrated": self.profile_calibrated,
                "replica_ratios": cfg.cluster.replica_ratios,
            },
            "finished_at": datetime.now().isoformat(timespec="seconds"),
        }
        if cfg.runtime == "dist":
            summary["num_processes"] = getattr(rt, "world_size", None)
            summary["events"] = list(getattr(rt, "events", []))
        if error:
            summary["error"] = error
        return summary


def default_out_dir(cfg: RunConfig) -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<name or protocol>`` under the current directory (the name
    reduced to letters, digits, ``-``, ``_`` and ``.``, so it cannot leave ``runs/``)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.name or cfg.protocol.name).lstrip(".")
    return Path("runs") / f"{stamp}-{label or cfg.protocol.name}"


# Settings that may change when a run is resumed: budgets and bookkeeping, nothing that
# changes what has been computed so far (data, seed, target, evaluation points).
RESUMABLE_SETTINGS = frozenset(
    f"train.{k}"
    for k in (
        "max_epochs",
        "max_samples",
        "max_seconds",
        "max_virtual_seconds",
        "checkpoint_every_evals",
        "num_threads",
        "stop_at_target",
        "tensorboard",
        "eval_batch_size",
    )
) | frozenset(f"dist.{k}" for k in ("backend", "master_addr", "master_port", "timeout_s"))


def train(
    config: RunConfig | str | Path | dict[str, Any] | None = None,
    *,
    overrides: list[str] | None = None,
    out_dir: str | Path | None = None,
    resume: str | Path | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Train as ``distsgd train`` does and return the summary dict.

    Args:
        config: a RunConfig, a TOML path, a nested dict, or None for the default run.
        overrides: ``section.key=value`` strings applied on top (TOML values).
        out_dir: run directory (default ``runs/<time>-<protocol>``).
        resume: a run directory to continue from its checkpoint; only ``train.*``
            overrides of budgets and bookkeeping are allowed with it (see
            ``RESUMABLE_SETTINGS``, e.g. a larger ``train.max_epochs``).
        progress: show a progress bar.

    Returns:
        The summary (as in ``summary.json``): ``protocol``, ``runtime``,
        ``target_accuracy``, ``best_accuracy``, ``reached``, ``time_to_accuracy_s`` (wall,
        training only), ``time_to_accuracy_virtual_s``, ``samples_to_accuracy``,
        ``throughput_samples_per_s``, ``staleness_mean``, ``staleness_max`` and more.

    Raises:
        ConfigError / DatasetError (both ValueError): bad settings or data; an ``out_dir``
            that is held by another run, is a file or is not writable; a ``dist`` run on
            this machine with more processes than it can hold; a checkpoint or weights
            file that does not match its checksum.
        TrainingDiverged: the loss became NaN or infinite.

    Warns:
        ConfigWarning: schedule settings the budget contradicts
            (:func:`~distsgd.config.schedule_conflicts`).

    Example::

        import distsgd
        s = distsgd.train("configs/async.toml", overrides=["train.max_epochs=1"])
        print(s["best_accuracy"], s["staleness_mean"])
    """
    if resume is not None:
        run_dir = Path(resume)
        if config is not None:
            raise ConfigError(
                "--resume continues a run from its own config.toml; do not pass a config as well"
            )
        for item in overrides or []:
            key = item.split("=", 1)[0].strip()
            if key not in RESUMABLE_SETTINGS:
                raise ConfigError(
                    f"--set {item!r}: only these settings may change when resuming: "
                    + ", ".join(sorted(RESUMABLE_SETTINGS))
                )
        if not (run_dir / "config.toml").exists():
            raise ConfigError(f"cannot resume: {run_dir / 'config.toml'} does not exist")
        cfg = RunConfig.from_toml(run_dir / "config.toml", overrides)
        return _run(cfg, run_dir, progress, resume=True)
    if isinstance(config, RunConfig):
        cfg = config
        if overrides:
            raw = cfg.to_dict()
            from distsgd.config import apply_override

            for item in overrides:
                apply_override(raw, item)
            cfg = RunConfig.from_dict(raw)
    elif isinstance(config, dict):
        raw = copy.deepcopy(config)  # the caller's dict is left as it was
        from distsgd.config import apply_override

        for item in overrides or []:
            apply_override(raw, item)
        cfg = RunConfig.from_dict(raw)
    else:
        cfg = RunConfig.from_toml(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(cfg)
    return _run(cfg, out, progress, resume=False)


def _run(cfg: RunConfig, out: Path, progress: bool, resume: bool) -> dict[str, Any]:
    """Runtime ``sim`` here; runtime ``dist`` on real processes (distsgd.runtime.launch).

    Before anything starts: a ``dist`` run on this machine is refused when its processes
    cannot fit it (:func:`~distsgd.config.check_local_processes`); conflicting schedule
    settings are warned about (:class:`~distsgd.config.ConfigWarning`, once, on rank 0);
    the launching process of a ``dist`` run claims ``out`` for the run's life
    (:class:`RunDirClaim`) before any rank starts.
    """
    if cfg.runtime == "dist":
        from distsgd.runtime.launch import run, under_launcher

        if not under_launcher():
            check_local_processes(cfg)
        _warn_schedule(cfg)
        if under_launcher():  # torchrun: this process is a rank; rank 0 claims `out`
            return run(cfg, out, resume=resume, progress=progress)
        claim = RunDirClaim.acquire(out)
        try:
            return run(cfg, out, resume=resume, progress=progress)
        finally:
            if claim is not None:
                claim.release()
    _warn_schedule(cfg)
    return Trainer(cfg, out, progress).run(resume=resume)


def _warn_schedule(cfg: RunConfig) -> None:
    """Warn once (rank 0 under torchrun) about schedule settings the budget contradicts."""
    if os.environ.get("RANK", "0") != "0":
        return
    for message in schedule_conflicts(cfg):
        warnings.warn(message, ConfigWarning, stacklevel=4)  # the caller of train()


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


def _is_process_loss(e: BaseException) -> bool:
    from distsgd.runtime.launch import is_process_loss

    return is_process_loss(e)
