"""The one entry below the CLI: resolve a config, then train on the simulated cluster or
on real processes; train the user's own model and data (:func:`fit`) and take the trained
model out of a run (:func:`export_model`).

``distsgd train`` and :func:`distsgd.train` both come here, so a config given as a TOML
path, a dict or a :class:`~distsgd.config.RunConfig`, with ``--set``-style overrides,
resolves the same way, and the choice between the simulated cluster (one process,
:class:`~distsgd.trainer.Trainer`) and the launcher of real processes
(:mod:`distsgd.launch`) is made here and only here.

Example::

    import distsgd
    s = distsgd.train("configs/async.toml", overrides=["train.max_epochs=1"])
    print(s["best_metric"], s["staleness_mean"])

    result = distsgd.fit(my_module, (x_train, y_train), (x_test, y_test),
                         overrides=["protocol.name=sma", "train.max_epochs=2"])
    result.model  # my_module's class, with the evaluated weights, in eval mode
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distsgd import launch
from distsgd.config import (
    ConfigError,
    ConfigWarning,
    LocalRanks,
    RunConfig,
    apply_override,
    check_device,
    check_local_processes,
    check_nesting,
    check_schedule,
    read_toml,
    schedule_conflicts,
    set_setting,
)
from distsgd.data import load_dataset
from distsgd.engine import UserCode, build_engine, check_user_code, config_for_data
from distsgd.factories import is_import_path
from distsgd.metrics import (
    ChecksumMismatch,
    OutputWriteError,
    load_checked,
    load_checkpoint_file,
    read_metrics,
    save_checked,
)
from distsgd.models import model_from_config
from distsgd.rundir import RunDirClaim, check_out_file, check_path_names, enclosing_tuner_dir
from distsgd.runtime import profiles
from distsgd.runtime.dist import elastic_refusal, join_running_run
from distsgd.runtime.factory import measure_device, warn_spread
from distsgd.runtime.faults import RankFaults
from distsgd.trainer import Trainer
from distsgd.tuner.online import is_tuning_run, train_tuned

__all__ = [
    "RESUMABLE_SETTINGS",
    "FitResult",
    "calibrate",
    "default_out_dir",
    "export_model",
    "fit",
    "is_tuning_run",
    "join",
    "resolve_config",
    "run",
    "train",
]

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
        "device",  # a GPU run resumes on a CPU-only machine and the other way round
    )
) | frozenset(f"dist.{k}" for k in ("backend", "master_addr", "master_port", "timeout_s"))


def default_out_dir(cfg: RunConfig) -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<name or protocol>`` under the current directory (the name
    reduced to letters, digits, ``-``, ``_`` and ``.``, so it cannot leave ``runs/``),
    with ``-2``, ``-3``, … appended when that directory exists already."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.name or cfg.protocol.name).lstrip(".")
    path = Path("runs") / f"{stamp}-{label or cfg.protocol.name}"
    n = 2
    while path.exists():  # several runs started within one second: -2, -3, ...
        path = Path("runs") / f"{stamp}-{label or cfg.protocol.name}-{n}"
        n += 1
    return path


def _check_overrides(overrides: Any) -> None:
    """``overrides`` is None or a list (or tuple) of ``section.key=value`` strings.

    Raises:
        ConfigError: anything else, e.g. a dict or one string (iterated, it gave
            "--set 't': expected KEY=VALUE" for its keys or characters).
    """
    ok = overrides is None or (
        isinstance(overrides, list | tuple) and all(isinstance(x, str) for x in overrides)
    )
    if not ok:
        raise ConfigError(
            f"overrides = {overrides!r} is not allowed: expected a list of "
            "'section.key=value' strings, e.g. ['optimizer.lr=0.05', 'tune.promote=2']"
        )


def resolve_config(
    config: RunConfig | str | Path | dict[str, Any] | None,
    overrides: list[str] | None = None,
    *,
    num_processes: int | None = None,
) -> RunConfig:
    """The run's config: a RunConfig, a TOML path, a nested dict, or None for the default
    run, with ``dist.num_processes = num_processes`` (``--num-processes``; the layout is
    then fitted to it) and ``section.key=value`` overrides (TOML values) applied on top.

    Raises:
        ConfigError: a bad setting, value or file, or overrides that are not a list of
            strings.
    """
    _check_overrides(overrides)
    if isinstance(config, RunConfig):
        if not overrides and num_processes is None:
            return config
        raw = config.to_dict()
    elif isinstance(config, dict):
        check_nesting(config)  # before the copy walks it
        raw = copy.deepcopy(config)  # the caller's dict is left as it was
    else:
        raw = read_toml(config)
    if num_processes is not None:
        set_setting(raw, "dist.num_processes", num_processes, f"--num-processes {num_processes}")
    for item in overrides or []:
        apply_override(raw, item)
    return RunConfig.from_dict(raw)


def calibrate(
    config: RunConfig | str | Path | dict[str, Any] | None,
    overrides: list[str] | None = None,
    out: str | Path | None = None,
) -> tuple[Path, profiles.DeviceProfileFile]:
    """Measure the simulated cluster's device profile of ``config`` on this machine and
    write it (``distsgd calibrate CONFIG [--out FILE]``).

    Measured with the torch threads a simulated run of ``config`` uses
    (``train.num_threads``, 0: all cores): the device (``seconds_per_batch``,
    ``seconds_per_sample``, median of 3 measurements with their spread), the parameter
    server's work per push (always: the file may plan an asynchronous run) and, for SMA
    and local SGD with k > 1 or ``"auto"``, t(k)/t(1) at the run's b
    (:func:`distsgd.runtime.factory.measure_device`).

    Args:
        config, overrides: as :func:`resolve_config`.
        out: the profile file to write (``cluster.profile`` of a later run, on any
            machine); None: this machine's profile cache
            (:mod:`distsgd.runtime.profiles`), replacing what it held for the key, so the
            next simulated run uses the new measurement (recalibration).

    Returns:
        (the path written, the profile).

    Raises:
        ConfigError: bad settings, or ``out`` (or, without it, the profile cache) cannot
            be written (:func:`~distsgd.rundir.check_out_file`), before any measurement.
        OutputWriteError: the profile could not be written after all (a full disk).
    """
    cfg = resolve_config(config, overrides)
    check_device(cfg)  # before anything is measured or written, and where it goes
    if out is not None:
        check_out_file(out)
    else:
        profiles.check_cache_dir()
    torch.set_num_threads(cfg.train.num_threads or (os.cpu_count() or 1))
    torch.manual_seed(cfg.train.seed)
    ds = load_dataset(cfg.data, seed=cfg.train.seed)
    cfg = config_for_data(cfg, ds)
    prof = measure_device(cfg, ds, server=True)
    path = Path(out) if out is not None else profiles.cache_path(prof.key)
    try:
        profiles.write_profile(path, prof)
    except OSError as e:  # checked above: the disk filled up, or went away, meanwhile
        raise OutputWriteError.of(e, path.parent) from None
    warn_spread(prof, path)
    return path, prof


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config of the run in ``run_dir`` (its ``config.toml``) with the overrides a
    resume allows (:data:`RESUMABLE_SETTINGS`).

    Raises:
        ConfigError: another setting is overridden, or the run has no config.toml.
    """
    _check_overrides(overrides)
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
    cfg = RunConfig.from_toml(path, overrides)
    if "memory_format" not in path.read_text(errors="replace"):
        # a run from before train.memory_format trained contiguous: resume it so
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, memory_format="contiguous"))
    return cfg


def run(
    cfg: RunConfig,
    out: Path,
    *,
    progress: bool = False,
    resume: bool = False,
    faults: RankFaults | None = None,
    code: UserCode | None = None,
    tune: bool = False,
    ranks: LocalRanks | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` into the run directory ``out``: on the simulated cluster in this
    process (``runtime = "sim"``), or on real processes started by the launcher
    (``runtime = "dist"``; under torchrun, this process's rank). Returns the summary
    (``{}`` on a rank other than the writer under torchrun). ``code``: the user's objects
    in place of the config's import paths (:class:`~distsgd.engine.UserCode`; the
    simulated runtime only).

    Before anything starts: a ``dist`` run on this machine is refused when its processes
    cannot fit it (:func:`~distsgd.config.check_local_processes`; ``ranks``: its result,
    when the caller checked them already); schedule settings the
    budget contradicts are warned about (:class:`~distsgd.config.ConfigWarning`, once,
    on rank 0); this process claims ``out`` for the run's life
    (:class:`~distsgd.rundir.RunDirClaim`) before any work and passes the claim down to
    the trainer or the ranks (under torchrun, rank 0 claims it).

    ``tune``: tune while training (Omnivore's optimizer inside the run,
    :func:`distsgd.tuner.online.train_tuned`); with ``resume``, a tuning run continues
    from its own saved config.

    Raises:
        ConfigError: see :func:`train`; ``code`` holds objects and the runtime is not
            ``sim``.
    """
    if code is not None and code.any and cfg.runtime != "sim":
        raise ConfigError(
            f"runtime = {cfg.runtime!r} is not allowed with Python objects for the model, "
            "data, loss or metric: they cannot reach other processes; give import paths"
        )
    check_device(cfg)  # before anything is written or any rank starts
    check_schedule(cfg)  # the trainer checks it again with the user's data loaded
    inside = enclosing_tuner_dir(out)
    if inside is not None:  # its probes and segments are the tuner's to write
        kind = "the run of --tune" if is_tuning_run(inside) else "the tune"
        raise ConfigError(
            f"{'--resume' if resume else '--out'} {str(out)!r} is not allowed: it is inside "
            f"{kind} {str(inside)!r} (its probes and segments); "
            + (
                f"resume that run (--resume {inside})"
                if resume and is_tuning_run(inside)
                else "choose another --out"
            )
        )
    if tune:
        if launch.under_launcher():
            raise ConfigError(
                "--tune is not allowed under torchrun: it starts its own processes for every "
                "probe; run distsgd train --tune without torchrun"
            )
        return train_tuned(cfg, out, progress=progress, resume=resume, code=code)
    _warn_schedule(cfg)
    if cfg.runtime == "dist" and launch.under_launcher():  # a rank: rank 0 claims `out`
        return launch.run(cfg, out, resume=resume, progress=progress, faults=faults)
    if cfg.runtime == "dist":
        ranks = ranks or check_local_processes(cfg)
        check_user_code(cfg)  # one line here, not one failure per rank
    claim = RunDirClaim.acquire(out, new_run=not resume)  # the run's, held for its life
    try:
        if cfg.runtime == "sim":
            return Trainer(cfg, out, progress, code=code).run(resume=resume, dir_claimed=True)
        return launch.run(
            cfg, out, resume=resume, progress=progress, faults=faults, dir_claimed=True, ranks=ranks
        )
    finally:
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
    tune: bool = False,
) -> dict[str, Any]:
    """Train as ``distsgd train`` does and return the summary dict (the trained model is
    the run directory's ``model.pt``; :func:`fit` returns it as a module).

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
        tune: tune while training (``distsgd train --tune``,
            :mod:`distsgd.tuner.online`): the summary then also has ``tuning_wall_s``,
            ``tuning_share`` and a ``time_to_target_s`` counted from the run's start,
            tuning included. A resumed tuning run is recognised by its directory.

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
        check_path_names(resume, "--resume")
        if config is not None:
            raise ConfigError(
                "--resume continues a run from its own config.toml; do not pass a config as well"
            )
        if is_tuning_run(resume):
            if overrides:
                raise ConfigError(
                    "--set cannot be used when resuming a run of --tune (it replays its "
                    "decisions with its own config)"
                )
            return train_tuned(None, Path(resume), progress=progress, resume=True)
        cfg = resume_config(resume, overrides)
        return run(cfg, Path(resume), progress=progress, resume=True, faults=faults)
    cfg = resolve_config(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(cfg)
    return run(cfg, out, progress=progress, faults=faults, tune=tune)


# ---- the trained model out of a run --------------------------------------------------------


def join(run_dir: str | Path) -> dict[str, int]:
    """Join the running dist run in ``run_dir`` as one more learner of its parameter
    server, on this machine, until the server stops the run (docs/elastic.md).

    Reads the run's ``config.toml`` (dataset, model, batch, seed) and ``join.json`` (where
    its store is), loads the dataset and builds the model here, then joins
    (:func:`~distsgd.runtime.dist.join_running_run`). Returns ``{"num_computes": gradients
    computed, "version": the server version of the last weights received}``.

    Raises:
        ConfigError: ``run_dir`` holds no running run that takes learners (no
            config.toml or join.json, another protocol, ended, unreachable, another run
            secret), one line each.
        ServerLost: the server died or stayed silent for ``dist.timeout_s``.
    """
    run = Path(run_dir)
    config_path = run / "config.toml"
    if not run.is_dir():
        raise ConfigError(
            f"cannot join {str(run)!r}: the directory does not exist; expected the run "
            "directory of a running distsgd train"
        )
    if not config_path.is_file():
        raise ConfigError(
            f"cannot join {str(run)!r}: it has no config.toml; expected the run directory of "
            "a running distsgd train"
        )
    cfg = RunConfig.from_toml(config_path)
    why = elastic_refusal(cfg)
    if why is not None:
        raise ConfigError(f"cannot join {str(run)!r}: {why}")
    summary, join_file = run / "summary.json", run / "join.json"
    if summary.exists() and join_file.exists():
        if summary.stat().st_mtime >= join_file.stat().st_mtime:
            raise ConfigError(f"cannot join {str(run)!r}: the run has ended (summary.json)")
    try:
        info = json.loads(join_file.read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"cannot join {str(run)!r}: it has no readable join.json (the run has not started "
            "training yet)"
        ) from None
    torch.manual_seed(cfg.train.seed)
    dataset = load_dataset(cfg.data, seed=cfg.train.seed)
    cfg = config_for_data(cfg, dataset)
    engine = build_engine(cfg)
    result = join_running_run(cfg, engine, dataset, info)
    return {"num_computes": result.num_computes, "version": result.version}


def export_model(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the trained model of the run in ``run_dir`` as a plain ``state_dict()``,
    from its ``checkpoint.pt``: the same file the run writes as ``model.pt`` (the last
    evaluated model, the central model for SMA / parameter server / compute groups, with
    the BatchNorm statistics of its evaluation; see :mod:`distsgd.trainer`).

    The module is rebuilt from the run's ``config.toml``
    (:func:`~distsgd.models.model_from_config`) and must take the state with
    ``load_state_dict`` (strict), so the file is known to load into the run's model; a
    run whose model was a Python object (:func:`fit`) is not rebuilt (its
    ``summary.json`` says ``"model": "(object)"``) and the state is written as saved.

    Args:
        run_dir: a run directory of ``distsgd train`` / :func:`train` / :func:`fit`.
        out: the file to write (default ``run_dir/model.pt``); its folder is created.

    Returns:
        The path written (with its SHA-256 sidecar ``<file>.sha256``).

    Raises:
        ConfigError: ``run_dir`` is not a run directory, has no readable checkpoint or
            config, the checkpoint predates ``distsgd export`` (holds no evaluated
            model), the model's factory no longer imports or builds, the state does not
            fit the rebuilt model, or ``out`` cannot be written.
    """
    run = Path(run_dir)
    check_path_names(run, "RUN_DIR")
    path = Path(out) if out is not None else run / "model.pt"
    check_out_file(path)  # before the checkpoint is read and the model built
    if not (run / "config.toml").is_file():
        raise ConfigError(
            f"cannot export: {str(run)!r} is not a run directory (it has no config.toml)"
        )
    state = _read_eval_model(run / "checkpoint.pt")
    if not _trained_on_object(run):
        cfg = RunConfig.from_toml(run / "config.toml")
        with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
            module = model_from_config(cfg.model)
        try:
            module.load_state_dict(state)
        except RuntimeError as e:
            detail = str(e).splitlines()[0]
            raise ConfigError(
                f"cannot export: the model config.toml names ({cfg.model.label}) does not "
                f"take the state in {run / 'checkpoint.pt'} ({detail})"
            ) from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checked(state, path)
    except OSError as e:
        raise ConfigError(f"--out {str(path)!r} cannot be written: {e.strerror or e}") from None
    return path


def _read_eval_model(path: Path) -> dict[str, torch.Tensor]:
    """The ``eval_model`` entry (model.pt's state) of the checkpoint at ``path``.

    Raises:
        ConfigError: the checkpoint is missing, unreadable, not distsgd's, or predates
            ``distsgd export``.
    """
    missing = " (a run writes it at its first checkpoint)"
    state = load_checkpoint_file(path, "export", missing)
    if "protocol" not in state:
        raise ConfigError(f"cannot export: {path} is not a checkpoint written by distsgd")
    model = state.get("eval_model")
    if not isinstance(model, dict):
        raise ConfigError(
            f"cannot export: {path} predates distsgd export (it holds no evaluated model); "
            "resume the run with a larger budget to write one"
        )
    return model


def _trained_on_object(run: Path) -> bool:
    """True when the run's summary says its model was a Python object (:func:`fit`)."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("model") == "(object)"


# ---- fit: the user's model and data ----------------------------------------------------


@dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        summary: the run's summary (as in ``summary.json``; see :func:`train`);
            ``summary["final_metric"]`` is the metric of :attr:`model`.
        run_dir: the run directory (``model.pt``, ``metrics.jsonl``, ``checkpoint.pt``, …).
        model: a fresh module of the user's model class with ``model.pt`` loaded — the
            last evaluated weights (the central model for SMA / parameter server /
            compute groups) and the BatchNorm statistics of that evaluation — in eval
            mode; None on a rank other than 0 under torchrun.
        metrics: the ``metrics.jsonl`` records, one per evaluation.
    """

    summary: dict[str, Any]
    run_dir: Path
    model: nn.Module | None
    metrics: list[dict[str, Any]] = field(default_factory=list)


def fit(
    model: str | Callable[[], nn.Module] | nn.Module,
    train_data: Any,
    eval_data: Any = None,
    *,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    metric: str | Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    metric_direction: str | None = None,
    config: RunConfig | str | Path | dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    tune: bool = False,
) -> FitResult:
    """Train the user's model on the user's data with any protocol, and return the
    trained model with the summary: :func:`train` with the model, data, loss and metric
    given here in place of the config's ``model.*``, ``data.*``, ``train.loss``,
    ``train.metric`` and ``train.metric_direction`` (every other setting — protocol,
    layout, optimizer, budget, target — from ``config`` and ``overrides``).

    Import paths ``"package.module:function"`` go into the config and work on both
    runtimes; Python objects work on the simulated runtime (one process) only.

    Args:
        model: an import path of a factory called as ``factory(**model.kwargs)``; or a
            callable returning an ``nn.Module`` (called the same way); or an ``nn.Module``
            instance, which is deep-copied (it is not trained in place).
        train_data: an import path of a data factory returning ``(train, eval)`` (then
            ``eval_data`` must be None); or the training data: a map-style
            ``torch.utils.data.Dataset`` of ``(input, target)`` tensor pairs, a
            ``TensorDataset`` of two tensors or a pair ``(inputs [N, ...], targets
            [N, ...])``.
        eval_data: the evaluation data, in the same forms; None: evaluate on the
            training data.
        loss: ``cross_entropy``, ``mse``, ``bce_with_logits``, an import path, or a
            callable ``(outputs, targets) → scalar`` (the minibatch's mean loss); None:
            the config's ``train.loss`` (default ``cross_entropy``).
        metric: ``accuracy``, ``loss``, ``perplexity``, an import path, or a callable
            ``(outputs, targets) → the batch's mean`` (a finite number); None: the
            config's ``train.metric`` (default ``accuracy``, refused with ``loss="mse"``
            and on targets that are not class labels: give ``"loss"`` or your own).
        metric_direction: ``"max"`` or ``"min"``, required for a user metric; None: the
            config's ``train.metric_direction``.
        config: the rest of the run, as for :func:`train`.
        overrides: ``section.key=value`` settings on top of ``config``, as for :func:`train`.
        out_dir: run directory (default ``runs/<time>-<protocol>``).
        progress: show a progress bar.
        tune: tune while training, as :func:`train` with ``tune=True``.

    Returns:
        A :class:`FitResult`: ``summary``, ``run_dir``, ``model`` (the trained model, a
        new module of the user's class) and ``metrics``. The run's ``config.toml`` names
        an object loss or metric by its module and qualified name (e.g.
        ``"__main__:my_metric"``): a record of what ran, importable only where that
        function is.

    Raises:
        ConfigError: a model, data, loss or metric of the wrong kind; a Python object
            with ``runtime = "dist"`` (one line naming it); anything :func:`train`
            raises.
        TrainingDiverged, DistRunFailed: as :func:`train`.

    Example::

        import torch, distsgd
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                  torch.nn.ReLU(), torch.nn.Linear(16, 3))
        x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
        result = distsgd.fit(net, (x, y), overrides=["protocol.name=sma",
                             "protocol.num_learners=4", "train.max_epochs=2"])
        print(result.summary["final_metric"], result.model)
    """
    raw = resolve_config(config, overrides).to_dict()
    code = UserCode(
        model=_fit_model(raw, model),
        data=_fit_data(raw, train_data, eval_data),
        loss=_fit_objective(raw, "loss", loss),
        metric=_fit_objective(raw, "metric", metric),
    )
    if metric_direction is not None:
        raw["train"]["metric_direction"] = metric_direction
    cfg = RunConfig.from_dict(raw)
    if cfg.runtime != "sim":
        _refuse_objects_on(cfg.runtime, model, train_data, eval_data, loss, metric)
    out = Path(out_dir) if out_dir is not None else default_out_dir(cfg)
    summary = run(cfg, out, progress=progress, code=code, tune=tune)
    if not summary:  # a rank other than 0 under torchrun
        return FitResult({}, out, None, [])
    return FitResult(summary, out, _trained_model(out, code), read_metrics(out / "metrics.jsonl"))


def _fit_model(raw: dict[str, Any], model: Any) -> Callable[..., nn.Module] | None:
    """Put ``model`` into ``raw["model"]`` (an import path) or return the factory object
    that builds it (an instance: a deep copy each call)."""
    if isinstance(model, str):
        _check_path("model", model)
        raw["model"]["factory"] = model
        return None
    raw["model"]["factory"] = ""
    if isinstance(model, nn.Module):
        raw["model"]["kwargs"] = {}
        return lambda: copy.deepcopy(model)
    if callable(model):
        return model
    raise ConfigError(
        f"model = <{type(model).__name__} object> is not allowed: expected an import path "
        "'module:function', a function returning a torch.nn.Module, or an nn.Module"
    )


def _fit_data(raw: dict[str, Any], train_data: Any, eval_data: Any) -> Callable[[], Any] | None:
    """Put ``train_data`` into ``raw["data"]`` (an import path) or return a data factory
    object returning ``(train_data, eval_data)``."""
    if isinstance(train_data, str):
        _check_path("train_data", train_data)
        if eval_data is not None:
            raise ConfigError(
                f"eval_data = <{type(eval_data).__name__} object> is not allowed with "
                f"train_data = {train_data!r}: the data factory returns both (train, eval)"
            )
        raw["data"]["factory"] = train_data
        return None
    if isinstance(eval_data, str):
        raise ConfigError(
            f"eval_data = {eval_data!r} is not allowed: an import path names a data "
            "factory, given as train_data (it returns both splits)"
        )
    raw["data"]["factory"] = ""
    raw["data"]["kwargs"] = {}
    return lambda: (train_data, eval_data)


def _fit_objective(raw: dict[str, Any], key: str, value: Any) -> Callable[..., Any] | None:
    """Put the loss or metric ``value`` into ``raw["train"][key]``: a name or import path
    as it is (the config checks it), a callable by its label (and returned); None: the
    config's."""
    if value is None:
        return None
    if isinstance(value, str):
        raw["train"][key] = value
        return None
    if not callable(value):
        raise ConfigError(
            f"{key} = <{type(value).__name__} object> is not allowed: expected a name, an "
            "import path 'module:function' or a function (outputs, targets)"
        )
    raw["train"][key] = _object_label(value)
    return value


def _check_path(argument: str, value: str) -> None:
    if not is_import_path(value):
        raise ConfigError(
            f"{argument} = {value!r} is not allowed: expected an import path "
            "'package.module:function' (or, on the simulated runtime, the object itself)"
        )


def _object_label(obj: Any) -> str:
    """``"module:qualified.name"`` of a function or class (characters an import path
    cannot hold, as in ``<lambda>``, become ``_``)."""
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module, name = (re.sub(r"[^A-Za-z0-9_.]", "_", s).strip(".") for s in (module, name))
    label = f"{module}:{name}"
    return label if is_import_path(label) else "__main__:user_function"


def _refuse_objects_on(runtime: str, *values: Any) -> None:
    """One line naming the first of fit's arguments that is an object, not a path."""
    names = ("model", "train_data", "eval_data", "loss", "metric")
    for name, value in zip(names, values, strict=True):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{name} = <{type(value).__name__} object> cannot reach the processes of "
                f"runtime {runtime!r}: give an import path 'module:function'"
            )


def _trained_model(run_dir: Path, code: UserCode) -> nn.Module:
    """A fresh module of the run's model (the user's object's class, or what its
    config.toml names) with ``model.pt`` loaded, in eval mode.

    Raises:
        ConfigError: ``model.pt`` does not match its checksum.
    """
    try:
        state = load_checked(run_dir / "model.pt")
    except ChecksumMismatch as e:
        raise ConfigError(str(e)) from None
    cfg = RunConfig.from_toml(run_dir / "config.toml")
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        module = model_from_config(cfg.model, code.model)
    module.load_state_dict(state)
    return module.eval()
