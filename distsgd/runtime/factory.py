"""The one factory of runtimes: ``runtime = "sim"`` or ``"dist"`` chosen once, here.

A :class:`RuntimeKind` does the three things that differ between the simulated cluster
and real processes before the trainer's loop starts:

1. :meth:`RuntimeKind.prepare` — process-level set-up: torch threads; on real processes
   also joining the process group;
2. :meth:`RuntimeKind.calibrate` — the simulated cluster's device profile measured on
   this machine and folded into the config (so ``config.toml`` reproduces the run); real
   processes have no simulated clock and keep the config as it is;
3. :meth:`RuntimeKind.build` — the :class:`~distsgd.runtime.base.Runtime` over the
   protocol, the engine and the data.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import statistics
import sys
import warnings
from datetime import datetime
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from distsgd.config import ConfigError, ConfigWarning, ProtocolConfig, RunConfig
from distsgd.data import Dataset
from distsgd.engine import GradientEngine, UserCode, build_engine
from distsgd.layout import build_protocol, spec_for
from distsgd.protocols.base import AsynchronousProtocol
from distsgd.runtime import dist as rdist
from distsgd.runtime import network, profiles
from distsgd.runtime.base import Runtime
from distsgd.runtime.faults import RankFaults
from distsgd.runtime.sim import (
    REPLICA_CALIBRATION_MAX_K,
    DeviceProfile,
    SimRuntime,
    calibrate,
    calibrate_replicas,
    calibrate_server,
)

__all__ = [
    "RuntimeKind",
    "calibrated_config",
    "device_profile",
    "measure_device",
    "profile_key",
    "runtime_kind",
    "warn_spread",
    "with_device_profile",
    "with_replica_profile",
]


def _throwaway_engine(cfg: RunConfig, code: UserCode | None) -> GradientEngine:
    """A model only for timing: it must not touch the run's weights, BatchNorm statistics
    or seeded RNG stream (the caller reseeds before building the run's model)."""
    return build_engine(cfg, code)


#: the device profile is measured this many times (median kept, spread reported)
PROFILE_REPEATS = 3


def profile_key(
    cfg: RunConfig, engine: GradientEngine, code: UserCode | None = None
) -> profiles.ProfileKey:
    """The cache key of ``cfg``'s device profile on this machine: the model (its name or
    factory, an object model's class; its kwargs) and P, the run's b, this process's torch
    threads, torch's version, :func:`~distsgd.runtime.profiles.machine_id`, and the
    engine's device (a GPU by name), precision, compilation and resolved memory format."""
    m = cfg.model
    model = m.label
    if code is not None and code.model is not None:
        model = f"(object) {type(engine.model).__qualname__}"
    device = engine.device
    if device.type == "cuda":
        device_name = f"cuda {torch.cuda.get_device_name(device)}"
    else:
        device_name = device.type
    return profiles.ProfileKey(
        model,
        int(engine.num_parameters),
        cfg.protocol.batch_size,
        torch.get_num_threads(),
        torch.__version__,
        profiles.machine_id(),
        engine.memory_format,
        device_name,
        cfg.train.precision,
        cfg.train.compile,
        json.dumps(m.kwargs, sort_keys=True, default=repr),
    )


def _replicas_needed(cfg: RunConfig) -> int:
    """The k up to which the run needs measured t(k)/t(1) (0: none; see
    :func:`with_replica_profile`)."""
    p, c = cfg.protocol, cfg.cluster
    spec = spec_for(p)
    k = p.initial_replicas_per_device if spec.replicated else 1
    if not spec.replicated or not (k > 1 or p.auto_replicas):
        return 0
    if c.seconds_per_replica >= 0 or c.replica_ratios:
        return 0
    return min(p.autotune_max_replicas, REPLICA_CALIBRATION_MAX_K) if p.auto_replicas else k


def measure_device(
    cfg: RunConfig,
    dataset: Dataset,
    code: UserCode | None = None,
    *,
    server: bool | None = None,
    max_replicas: int | None = None,
    repeats: int = PROFILE_REPEATS,
) -> profiles.DeviceProfileFile:
    """Measure ``cfg``'s device on this machine, with this process's torch threads:
    :func:`~distsgd.runtime.sim.calibrate` ``repeats`` times (the median of each
    coefficient kept; spread = (max − min)/median of t(b) at the run's b), the server's
    work per push (:func:`~distsgd.runtime.sim.calibrate_server`, unless ``server`` is
    False: the tuner's parameter-server candidates need it whatever the run's protocol),
    t(k)/t(1) up to ``max_replicas``
    (:func:`~distsgd.runtime.sim.calibrate_replicas`; None: what the run needs), and a
    synchronous learner's work per iteration beyond its gradient
    (:func:`~distsgd.runtime.dist.calibrate_iteration`: the real hardsync iteration at
    world size 1 minus the gradient, in the same process).

    Returns:
        the profile, keyed by :func:`profile_key`.
    """
    engine = _throwaway_engine(cfg, code)
    b = cfg.protocol.batch_size
    fits = [calibrate(engine, dataset) for _ in range(max(repeats, 1))]
    spb = statistics.median(f.seconds_per_batch for f in fits)
    sps = statistics.median(f.seconds_per_sample for f in fits)
    t_b = [f.compute_seconds(b) for f in fits]
    spread = (max(t_b) - min(t_b)) / statistics.median(t_b) if min(t_b) > 0 else 0.0
    prof = profiles.DeviceProfileFile(
        profile_key(cfg, engine, code),
        spb,
        sps,
        repeats=len(fits),
        spread=spread,
        measured_at=datetime.now().isoformat(timespec="seconds"),
    )
    if server is not False:
        prof.seconds_per_push = _server_seconds(cfg, engine)
    prof.seconds_per_iteration = _iteration_seconds(cfg, dataset, code)
    k = _replicas_needed(cfg) if max_replicas is None else max_replicas
    if k > 1:
        prof.replica_ratios, _ = calibrate_replicas(engine, dataset, b, max_replicas=k)
    return prof


def _server_seconds(cfg: RunConfig, engine: GradientEngine) -> float:
    """The server's seconds per push (:func:`calibrate_server`) on a throwaway protocol of
    ``cfg``'s (when ``cfg`` has no server: an asynchronous parameter server with ``cfg``'s λ,
    batch size and, where a parameter server can send it, number format; nothing else of
    ``cfg``'s protocol, whose other settings may not be a parameter server's)."""
    if not spec_for(cfg.protocol).has_server:
        p = cfg.protocol
        compression = p.compression if p.compression in ("bf16", "fp16") else "none"
        cfg = cfg.replace(
            protocol=ProtocolConfig(
                name="parameter_server",
                mode="async",
                num_learners=p.num_learners,
                batch_size=p.batch_size,
                compression=compression,
            )
        )
    proto = cast(AsynchronousProtocol, build_protocol(cfg, engine.initial_weights()))
    return calibrate_server(proto, cfg.optimizer.lr)


def _iteration_seconds(cfg: RunConfig, dataset: Dataset, code: UserCode | None) -> float:
    """A synchronous learner's seconds per iteration beyond its gradient
    (:func:`~distsgd.runtime.dist.calibrate_iteration`, on throwaway models of ``cfg``'s)."""
    return rdist.calibrate_iteration(cfg, dataset, lambda: _throwaway_engine(cfg, code))


def _cached_device(
    cfg: RunConfig, dataset: Dataset, code: UserCode | None
) -> profiles.DeviceProfileFile:
    """The device profile from the cache (measured and written there when missing or
    unreadable; what it lacks that the run needs is measured and added); says which on
    stderr. ``distsgd calibrate CONFIG`` replaces the entry (recalibration)."""
    profiles.check_cache_dir()  # one line now, not a traceback after measuring
    engine = _throwaway_engine(cfg, code)
    key = profile_key(cfg, engine, code)
    path = profiles.cache_path(key)
    if path.is_dir():
        raise ConfigError(
            f"the profile cache entry {str(path)!r} is a directory: remove it (or set "
            f"{profiles.CACHE_ENV} to another directory)"
        )
    prof = None
    if path.exists():
        try:
            prof = profiles.read_profile(path, setting="the cached profile")
        except ConfigError as e:
            print(f"distsgd: measuring the device profile again: {e}", file=sys.stderr)
    if prof is not None and prof.key != key:
        prof = None  # a hash collision or a hand-edited file
    if prof is None:
        prof = measure_device(cfg, dataset, code)
        profiles.write_profile(path, prof)
        print(
            f"distsgd: device profile measured on this machine ({_describe(prof)}), cached in "
            f"{path}",
            file=sys.stderr,
        )
        warn_spread(prof, path)
        return prof
    missing_push = prof.seconds_per_push is None
    missing_iteration = prof.seconds_per_iteration is None  # a file of an older distsgd
    k = _replicas_needed(cfg)
    added = []
    if missing_push:
        prof.seconds_per_push = _server_seconds(cfg, engine)
        added.append("the server's seconds per push")
    if missing_iteration:
        prof.seconds_per_iteration = _iteration_seconds(cfg, dataset, code)
        added.append("the work per iteration beyond the gradient")
    if k > 1 and len(prof.replica_ratios) < k:
        b = cfg.protocol.batch_size
        prof.replica_ratios, _ = calibrate_replicas(engine, dataset, b, max_replicas=k)
        added.append(f"the replica curve up to k = {k}")
    if added:
        profiles.write_profile(path, prof)
    print(
        f"distsgd: cached device profile used ({_describe(prof)}) from {path}"
        + (f"; measured now and added to it: {', '.join(added)}" if added else ""),
        file=sys.stderr,
    )
    warn_spread(prof, path)  # every run that uses it, not only the one that measured it
    return prof


#: what a named profile may have been measured with that changes its device's seconds
_COMPARED = ("batch_size", "precision", "compile", "memory_format", "model_kwargs")


def _warn_other_settings(
    cfg: RunConfig, measured: profiles.ProfileKey, run: profiles.ProfileKey
) -> None:
    """One warning line when ``cluster.profile`` was measured with other settings than the
    run's (its machine, threads and torch are meant to differ; a file without a field is
    not compared on it)."""
    differ = [
        f"{name} {getattr(measured, name)!r} (this run: {getattr(run, name)!r})"
        for name in _COMPARED
        if getattr(measured, name) != getattr(run, name)
        and not (name == "model_kwargs" and not measured.model_kwargs)
    ]
    if differ:
        warnings.warn(
            f"cluster.profile = {cfg.cluster.profile!r} was measured with "
            + ", ".join(differ)
            + ": its seconds are of that setting (measure again with distsgd calibrate on "
            "this run's config)",
            ConfigWarning,
            stacklevel=2,
        )


def _describe(prof: profiles.DeviceProfileFile) -> str:
    text = (
        f"{prof.seconds_per_batch * 1e3:.3f} ms/batch + {prof.seconds_per_sample * 1e6:.1f} "
        f"µs/sample, spread {prof.spread:.0%} over {prof.repeats}"
    )
    if prof.seconds_per_push is not None:
        text += f", server {prof.seconds_per_push * 1e3:.3f} ms/push"
    if prof.seconds_per_iteration is not None:
        text += f", {prof.seconds_per_iteration * 1e3:.3f} ms/iteration beyond the gradient"
    return text


def warn_spread(prof: profiles.DeviceProfileFile, path: Path) -> None:
    """One :class:`~distsgd.runtime.profiles.ProfileSpreadWarning` when ``prof``'s repeated
    measurements differ by more than :data:`~distsgd.runtime.profiles.SPREAD_WARNING`."""
    if prof.spread > profiles.SPREAD_WARNING:
        warnings.warn(
            f"the device profile's {prof.repeats} measurements differ by {prof.spread:.0%} "
            f"(more than {profiles.SPREAD_WARNING:.0%}: the machine's load changed while it "
            f"was measured); simulated seconds carry that uncertainty. Measure again on a "
            f"quieter machine with distsgd calibrate CONFIG (or delete {path})",
            profiles.ProfileSpreadWarning,
            stacklevel=2,
        )


def _named_device(cfg: RunConfig, code: UserCode | None) -> profiles.DeviceProfileFile:
    """The profile file ``cluster.profile`` names, checked against the run's model.

    Raises:
        ConfigError: unreadable, missing keys, or measured on another model (name or P).
    """
    path = Path(cfg.cluster.profile).expanduser()
    prof = profiles.read_profile(path)
    engine = _throwaway_engine(cfg, code)
    key = profile_key(cfg, engine, code)
    model = key.model
    if (prof.key.model, prof.key.num_parameters) != (model, engine.num_parameters):
        raise ConfigError(
            f"cluster.profile = {cfg.cluster.profile!r} is not allowed: it was measured on "
            f"model {prof.key.model!r} with {prof.key.num_parameters} parameters, this run "
            f"trains {model!r} with {engine.num_parameters} (measure it with distsgd "
            "calibrate on this run's config)"
        )
    _warn_other_settings(cfg, prof.key, key)
    if (
        spec_for(cfg.protocol).has_server
        and prof.seconds_per_push is None
        and cfg.cluster.seconds_per_push < 0
    ):
        raise ConfigError(
            f"cluster.profile = {cfg.cluster.profile!r} is not allowed: it has no "
            "'seconds_per_push' and the protocol has a parameter server (measure it with "
            "distsgd calibrate on a config with a parameter server, or set "
            "cluster.seconds_per_push)"
        )
    note = ""
    if (
        prof.seconds_per_iteration is None
        and not spec_for(cfg.protocol).has_server
        and cfg.cluster.seconds_per_iteration < 0
    ):
        note = (
            "; the file has no seconds_per_iteration (written by an older distsgd): no work "
            "per iteration beyond the gradient is charged (measure it again with distsgd "
            "calibrate CONFIG --out FILE, or set cluster.seconds_per_iteration)"
        )
    print(f"distsgd: device profile from {path} ({_describe(prof)}){note}", file=sys.stderr)
    return prof


def with_device_profile(
    cfg: RunConfig, dataset: Dataset, code: UserCode | None = None
) -> tuple[RunConfig, bool]:
    """``cfg`` with the simulated device's ``cluster.seconds_per_sample``,
    ``seconds_per_batch``, ``seconds_per_iteration`` (0 from a named file without it) and
    (for a protocol with a parameter server) ``seconds_per_push`` filled in where the
    config asks for them (-1): from the profile
    file ``cluster.profile`` names, else from this machine's profile cache
    (:mod:`distsgd.runtime.profiles`; measured on a throwaway model of the run's, ``code``:
    the user's objects, when the cache has no profile for this machine, model, b, threads
    and torch version). A device profile given in the config
    leaves ``seconds_per_push`` and ``seconds_per_iteration`` at -1, which charge no
    server work and no work beyond the gradient (:func:`device_profile`).

    Returns:
        ``(config, calibrated)``: whether the profile was measured on this machine (now or
        by an earlier run, from the cache).

    Raises:
        ConfigError: a bad ``cluster.profile`` (see :func:`_named_device`).
    """
    c = cfg.cluster
    if not c.needs_calibration and not c.profile:
        return cfg, False  # a given device: -1 stays, the simulator charges no server work
    named = bool(c.profile)
    prof = _named_device(cfg, code) if named else _cached_device(cfg, dataset, code)
    # the config's own figures win (and say so); -1 takes the profile's
    mine = {k: getattr(c, k) for k in _DEVICE_FIGURES if getattr(c, k) >= 0}
    theirs = {k: getattr(prof, k) or 0.0 for k in _DEVICE_FIGURES if k not in mine}
    cluster = dataclasses.replace(c, **theirs)
    if c.seconds_per_push < 0 and prof.seconds_per_push is not None:
        cluster = dataclasses.replace(cluster, seconds_per_push=prof.seconds_per_push)
    if mine:
        given = ", ".join(f"cluster.{k} = {v:g}" for k, v in mine.items())
        verb = "replaces" if len(mine) == 1 else "replace"
        print(f"distsgd: the config's {given} {verb} the profile's", file=sys.stderr)
    k = _replicas_needed(cfg)
    if k > 1 and len(prof.replica_ratios) >= 2:
        cluster = dataclasses.replace(cluster, replica_ratios=list(prof.replica_ratios))
    return cfg.replace(cluster=cluster), not named


#: the device figures a profile gives and a config may give instead (-1: the profile's;
#: a profile without the last one, of an older distsgd, charges 0)
_DEVICE_FIGURES = ("seconds_per_sample", "seconds_per_batch", "seconds_per_iteration")


def with_replica_profile(
    cfg: RunConfig, dataset: Dataset, calibrated: bool, code: UserCode | None = None
) -> RunConfig:
    """``cfg`` with Crossbow's t(k)/t(1) (``cluster.replica_ratios``) measured at the run's
    b for SMA and local SGD with k > 1 or ``"auto"`` when the device profile was
    ``calibrated`` here and the profile did not hold them already
    (:func:`with_device_profile`); without a measurement, k separate minibatches
    (``seconds_per_replica = t(1)``). Other protocols, or a profile the config gives:
    ``cfg`` unchanged."""
    p, c = cfg.protocol, cfg.cluster
    k = _replicas_needed(cfg)
    if not k:
        return cfg
    if calibrated:
        # the fixed k, or the k the auto-tuner is likely to try (beyond, the model
        # continues the last measured step)
        ratios, _ = calibrate_replicas(
            _throwaway_engine(cfg, code), dataset, p.batch_size, max_replicas=k
        )
        c = dataclasses.replace(c, replica_ratios=ratios)
    if not c.replica_ratios:
        t1 = c.seconds_per_batch + p.batch_size * c.seconds_per_sample
        c = dataclasses.replace(c, seconds_per_replica=t1)
    return cfg.replace(cluster=c)


def calibrated_config(
    cfg: RunConfig, dataset: Dataset, code: UserCode | None = None
) -> tuple[RunConfig, bool]:
    """``cfg`` with the simulated cluster's profile filled in where the config asks for
    it: the device (:func:`with_device_profile`: a named profile file, else this
    machine's cache, measured on a miss), then replicas (:func:`with_replica_profile`).
    Returns ``(config, calibrated)``."""
    cfg, calibrated = with_device_profile(cfg, dataset, code)
    return with_replica_profile(cfg, dataset, calibrated, code), calibrated


def device_profile(cfg: RunConfig, calibrated: bool) -> DeviceProfile:
    """The simulated device of ``cfg.cluster`` (after :func:`calibrated_config`)."""
    c = cfg.cluster
    r = c.seconds_per_replica
    return DeviceProfile(
        c.seconds_per_batch,
        c.seconds_per_sample,
        calibrated,
        seconds_per_replica=r if r >= 0 else None,
        replica_ratios=tuple(c.replica_ratios),
        seconds_per_push=max(c.seconds_per_push, 0.0),
        seconds_per_iteration=max(c.seconds_per_iteration, 0.0),
        seconds_per_push_contended=c.seconds_per_push_contended,
    )


class RuntimeKind(abc.ABC):
    """How one kind of runtime is set up and built (see the module docstring)."""

    @abc.abstractmethod
    def prepare(self, cfg: RunConfig) -> None:
        """Process-level set-up before any data or model is loaded."""

    #: the run is this one process: nothing to agree on with other ranks, so the run
    #: directory can be claimed and checked before any set-up
    single_process: bool = True

    def calibrate(
        self, cfg: RunConfig, dataset: Dataset, code: UserCode | None = None
    ) -> tuple[RunConfig, bool]:
        """The config with what this runtime measures folded in, and whether the device
        profile was measured (on a throwaway model built like the run's)."""
        return cfg, False

    @abc.abstractmethod
    def build(
        self, cfg: RunConfig, engine: GradientEngine, dataset: Dataset, initial: Tensor
    ) -> Runtime:
        """The runtime, its protocol starting from ``initial`` (shape ``[P]``)."""


class _Simulated(RuntimeKind):
    def __init__(self) -> None:
        self.calibrated = False  # the device profile was measured by calibrate()

    def prepare(self, cfg: RunConfig) -> None:
        torch.set_num_threads(cfg.train.num_threads or (os.cpu_count() or 1))

    def calibrate(
        self, cfg: RunConfig, dataset: Dataset, code: UserCode | None = None
    ) -> tuple[RunConfig, bool]:
        cfg, self.calibrated = calibrated_config(cfg, dataset, code)
        return cfg, self.calibrated

    def build(
        self, cfg: RunConfig, engine: GradientEngine, dataset: Dataset, initial: Tensor
    ) -> Runtime:
        p = cfg.protocol
        spec = spec_for(p)
        # the protocol in the form runtime dist runs it: hardsync with backup learners is
        # served (BackupHardSync), so both runtimes apply the same pushes in the same way
        protocol = (
            spec.build_served(p, cfg.optimizer, initial)
            if spec.served_on_dist(p)
            else build_protocol(cfg, initial)
        )
        return SimRuntime(
            protocol,
            engine,
            dataset,
            batch_size=p.batch_size,
            num_learners=p.num_learners,
            profile=device_profile(cfg, self.calibrated),
            cluster=cfg.cluster,
            replicas_per_device=p.initial_replicas_per_device if spec.replicated else 1,
            seed=cfg.train.seed,
            bn_recalibration_samples=cfg.train.bn_recalibration_samples,
            num_servers=cfg.dist.num_servers if spec.has_server else 1,
            compression=p.compression,
            backup_learners=p.backup_learners if p.name == "hardsync" else 0,
        )


class _RealProcesses(RuntimeKind):
    single_process = False

    def __init__(self, faults: RankFaults | None) -> None:
        self.faults = faults

    def prepare(self, cfg: RunConfig) -> None:
        info = rdist.process_info()
        if info is None:
            raise RuntimeError(
                "runtime 'dist' runs inside processes started by distsgd.launch or "
                "torchrun; use distsgd.train() or the distsgd CLI"
            )
        try:
            network.prepare_rank(cfg.train.num_threads)  # gloo's interface, threads per rank
        except ConfigError as e:
            if not str(e).startswith("MASTER_ADDR"):  # the store answers: rank 0 is told
                rdist.refuse_to_join(str(e), cfg.dist.timeout_s)
            raise
        rdist.init_process_group(cfg, info)

    def build(
        self, cfg: RunConfig, engine: GradientEngine, dataset: Dataset, initial: Tensor
    ) -> Runtime:
        return rdist.build_runtime(cfg, engine, dataset, initial, self.faults)


def runtime_kind(cfg: RunConfig, faults: RankFaults | None = None) -> RuntimeKind:
    """The kind of runtime ``cfg.runtime`` names (``faults``: injected into real
    processes by tests, :class:`~distsgd.runtime.faults.RankFaults`).

    Raises:
        ConfigError: an unknown runtime (the config validates it first).
    """
    if cfg.runtime == "sim":
        return _Simulated()
    if cfg.runtime == "dist":
        return _RealProcesses(faults)
    raise ConfigError(f"runtime = {cfg.runtime!r} is not allowed: expected 'sim' or 'dist'")
