"""The one entry below the CLI: resolve a config, then train on the simulated cluster or
on real processes.

``distsgd train`` and :func:`distsgd.train` both come here, so a config given as a TOML
path, a dict or a :class:`~distsgd.config.RunConfig`, with ``--set``-style overrides,
resolves the same way, and the choice between the simulated cluster (one process,
:class:`~distsgd.trainer.Trainer`) and the launcher of real processes
(:mod:`distsgd.launch`) is made here and only here.

Example::

    import distsgd
    s = distsgd.train("configs/async.toml", overrides=["train.max_epochs=1"])
    print(s["best_metric"], s["staleness_mean"])
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

from distsgd import launch
from distsgd.config import (
    ConfigError,
    ConfigWarning,
    RunConfig,
    apply_override,
    check_local_processes,
    schedule_conflicts,
)
from distsgd.engine import check_user_code
from distsgd.rundir import RunDirClaim
from distsgd.runtime.faults import RankFaults
from distsgd.trainer import Trainer

__all__ = ["RESUMABLE_SETTINGS", "default_out_dir", "resolve_config", "run", "train"]

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


def default_out_dir(cfg: RunConfig) -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<name or protocol>`` under the current directory (the name
    reduced to letters, digits, ``-``, ``_`` and ``.``, so it cannot leave ``runs/``)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.name or cfg.protocol.name).lstrip(".")
    return Path("runs") / f"{stamp}-{label or cfg.protocol.name}"


def resolve_config(
    config: RunConfig | str | Path | dict[str, Any] | None,
    overrides: list[str] | None = None,
) -> RunConfig:
    """The run's config: a RunConfig, a TOML path, a nested dict, or None for the default
    run, with ``section.key=value`` overrides (TOML values) applied on top.

    Raises:
        ConfigError: a bad setting, value or file.
    """
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        raw = config.to_dict()
    elif isinstance(config, dict):
        raw = copy.deepcopy(config)  # the caller's dict is left as it was
    else:
        return RunConfig.from_toml(config, overrides)
    for item in overrides or []:
        apply_override(raw, item)
    return RunConfig.from_dict(raw)


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config of the run in ``run_dir`` (its ``config.toml``) with the overrides a
    resume allows (:data:`RESUMABLE_SETTINGS`).

    Raises:
        ConfigError: another setting is overridden, or the run has no config.toml.
    """
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if key not in RESUMABLE_SETTINGS:
            raise ConfigError(
                f"--set {item!r}: only these settings may change when resuming: "
                + ", ".join(sorted(RESUMABLE_SETTINGS))
            )
    path = Path(run_dir) / "config.toml"
    if not path.exists():
        raise ConfigError(f"cannot resume: {path} does not exist")
    return RunConfig.from_toml(path, overrides)


def run(
    cfg: RunConfig,
    out: Path,
    *,
    progress: bool = False,
    resume: bool = False,
    faults: RankFaults | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` into the run directory ``out``: on the simulated cluster in this
    process (``runtime = "sim"``), or on real processes started by the launcher
    (``runtime = "dist"``; under torchrun, this process's rank). Returns the summary
    (``{}`` on a rank other than the writer under torchrun).

    Before anything starts: a ``dist`` run on this machine is refused when its processes
    cannot fit it (:func:`~distsgd.config.check_local_processes`); schedule settings the
    budget contradicts are warned about (:class:`~distsgd.config.ConfigWarning`, once,
    on rank 0); the launching process of a ``dist`` run claims ``out`` for the run's life
    (:class:`~distsgd.rundir.RunDirClaim`) before any rank starts (a ``sim`` run, and
    rank 0 under torchrun, claim it in the trainer).

    Raises:
        ConfigError: see :func:`train`.
    """
    _warn_schedule(cfg)
    if cfg.runtime == "sim":
        return Trainer(cfg, out, progress).run(resume=resume)
    if launch.under_launcher():  # torchrun: this process is a rank; rank 0 claims `out`
        return launch.run(cfg, out, resume=resume, progress=progress, faults=faults)
    check_local_processes(cfg)
    check_user_code(cfg)  # one line here, not one failure per rank
    claim = RunDirClaim.acquire(out)
    try:
        return launch.run(cfg, out, resume=resume, progress=progress, faults=faults)
    finally:
        if claim is not None:
            claim.release()


def _warn_schedule(cfg: RunConfig) -> None:
    """Warn once (rank 0 under torchrun) about schedule settings the budget contradicts."""
    if os.environ.get("RANK", "0") != "0":
        return
    for message in schedule_conflicts(cfg):
        warnings.warn(message, ConfigWarning, stacklevel=4)  # the caller of train()


def train(
    config: RunConfig | str | Path | dict[str, Any] | None = None,
    *,
    overrides: list[str] | None = None,
    out_dir: str | Path | None = None,
    resume: str | Path | None = None,
    progress: bool = False,
    faults: RankFaults | None = None,
) -> dict[str, Any]:
    """Train as ``distsgd train`` does and return the summary dict.

    Args:
        config: a RunConfig, a TOML path, a nested dict, or None for the default run.
        overrides: ``section.key=value`` strings applied on top (TOML values).
        out_dir: run directory (default ``runs/<time>-<protocol>``).
        resume: a run directory to continue from its checkpoint; only ``train.*``
            overrides of budgets and bookkeeping are allowed with it (see
            :data:`RESUMABLE_SETTINGS`, e.g. a larger ``train.max_epochs``).
        progress: show a progress bar.
        faults: for tests of fault handling, faults injected into the ranks of a
            ``dist`` run (:class:`~distsgd.runtime.faults.RankFaults`).

    Returns:
        The summary (as in ``summary.json``): ``protocol``, ``runtime``,
        ``target``, ``best_metric``, ``reached``, ``time_to_target_s`` (wall,
        training only), ``time_to_target_virtual_s``, ``samples_to_target``,
        ``throughput_samples_per_s``, ``staleness_mean``, ``staleness_max`` and more.

    Raises:
        ConfigError / DatasetError (both ValueError): bad settings or data; an ``out_dir``
            that is held by another run, is a file or is not writable; a ``dist`` run on
            this machine with more processes than it can hold; a checkpoint or weights
            file that does not match its checksum.
        TrainingDiverged: the loss became NaN or infinite.
        DistRunFailed: a process of a dist run was lost where the protocol cannot go on.

    Warns:
        ConfigWarning: schedule settings the budget contradicts
            (:func:`~distsgd.config.schedule_conflicts`).

    Example::

        import distsgd
        s = distsgd.train("configs/async.toml", overrides=["train.max_epochs=1"])
        print(s["best_metric"], s["staleness_mean"])
    """
    if resume is not None:
        if config is not None:
            raise ConfigError(
                "--resume continues a run from its own config.toml; do not pass a config as well"
            )
        cfg = resume_config(resume, overrides)
        return run(cfg, Path(resume), progress=progress, resume=True, faults=faults)
    cfg = resolve_config(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(cfg)
    return run(cfg, out, progress=progress, faults=faults)
