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
import os

import torch
from torch import Tensor

from distsgd.config import ConfigError, RunConfig
from distsgd.data import Dataset
from distsgd.engine import GradientEngine, UserCode, build_engine
from distsgd.layout import build_protocol, spec_for
from distsgd.runtime import dist as rdist
from distsgd.runtime.base import Runtime
from distsgd.runtime.faults import RankFaults
from distsgd.runtime.sim import (
    REPLICA_CALIBRATION_MAX_K,
    DeviceProfile,
    SimRuntime,
    calibrate,
    calibrate_replicas,
)

__all__ = [
    "RuntimeKind",
    "calibrated_config",
    "device_profile",
    "runtime_kind",
    "with_device_profile",
    "with_replica_profile",
]


def _throwaway_engine(cfg: RunConfig, code: UserCode | None) -> GradientEngine:
    """A model only for timing: it must not touch the run's weights, BatchNorm statistics
    or seeded RNG stream (the caller reseeds before building the run's model)."""
    return build_engine(cfg, code)


def with_device_profile(
    cfg: RunConfig, dataset: Dataset, code: UserCode | None = None
) -> tuple[RunConfig, bool]:
    """``cfg`` with the simulated device's ``cluster.seconds_per_sample`` and
    ``seconds_per_batch`` measured on this machine where the config asks for it (-1),
    on a throwaway model of the run's (``code``: the user's objects, :class:`UserCode`).

    Returns:
        ``(config, calibrated)``: whether the profile was measured here.
    """
    if not cfg.cluster.needs_calibration:
        return cfg, False
    prof = calibrate(_throwaway_engine(cfg, code), dataset)
    cluster = dataclasses.replace(
        cfg.cluster,
        seconds_per_sample=prof.seconds_per_sample,
        seconds_per_batch=prof.seconds_per_batch,
    )
    return cfg.replace(cluster=cluster), True


def with_replica_profile(
    cfg: RunConfig, dataset: Dataset, calibrated: bool, code: UserCode | None = None
) -> RunConfig:
    """``cfg`` with Crossbow's t(k)/t(1) (``cluster.replica_ratios``) measured at the run's
    b for SMA and local SGD with k > 1 or ``"auto"`` when the device profile was
    ``calibrated`` here; without a measurement, k separate minibatches
    (``seconds_per_replica = t(1)``). Other protocols, or a profile the config gives:
    ``cfg`` unchanged."""
    p, c = cfg.protocol, cfg.cluster
    spec = spec_for(p)
    k = p.initial_replicas_per_device if spec.replicated else 1
    if not spec.replicated or not (k > 1 or p.auto_replicas):
        return cfg
    if c.seconds_per_replica >= 0 or c.replica_ratios:
        return cfg
    if calibrated:
        # the fixed k, or the k the auto-tuner is likely to try (beyond, the model
        # continues the last measured step)
        top = min(p.autotune_max_replicas, REPLICA_CALIBRATION_MAX_K)
        ratios, _ = calibrate_replicas(
            _throwaway_engine(cfg, code),
            dataset,
            p.batch_size,
            max_replicas=top if p.auto_replicas else k,
        )
        c = dataclasses.replace(c, replica_ratios=ratios)
    if not c.replica_ratios:
        t1 = c.seconds_per_batch + p.batch_size * c.seconds_per_sample
        c = dataclasses.replace(c, seconds_per_replica=t1)
    return cfg.replace(cluster=c)


def calibrated_config(
    cfg: RunConfig, dataset: Dataset, code: UserCode | None = None
) -> tuple[RunConfig, bool]:
    """``cfg`` with the simulated cluster's profile measured on this machine where the
    config asks for it: the device (:func:`with_device_profile`), then replicas
    (:func:`with_replica_profile`). Returns ``(config, calibrated)``."""
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
        return SimRuntime(
            build_protocol(cfg, initial),
            engine,
            dataset,
            batch_size=p.batch_size,
            num_learners=p.num_learners,
            profile=device_profile(cfg, self.calibrated),
            cluster=cfg.cluster,
            replicas_per_device=p.initial_replicas_per_device if spec.replicated else 1,
            average_every=spec.sync_interval(p),
            seed=cfg.train.seed,
            bn_recalibration_samples=cfg.train.bn_recalibration_samples,
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
        torch.set_num_threads(rdist.threads_per_process(cfg, info))
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
