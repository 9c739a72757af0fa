"""The set-up both tuners share: the layouts the candidates run on (:func:`tune_layout`),
the device profile fixed once so every probe runs on the same simulated cluster
(:func:`fixed_base`), the cluster's timing model (:func:`cluster_model`), and
``distsgd tune``'s measurements for its budget (:func:`fix_setup`): a run's build, one
evaluation, on ``dist`` the network (:func:`~distsgd.runtime.netcal.calibrate_network`), on
``sim`` the simulator's wall speed."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distsgd.config import TUNE_STEADY_SHARE, ConfigError, RunConfig, required_processes
from distsgd.data import load_dataset
from distsgd.engine import UserCode, build_engine, config_for_data
from distsgd.runtime.factory import with_device_profile
from distsgd.runtime.netcal import NetworkProfile, calibrate_network
from distsgd.tuner import perf_model as pm
from distsgd.tuner.budget import TuneBudget, first_probe_estimate
from distsgd.tuner.omnivore import Candidate, DecisionLog
from distsgd.tuner.probes import Prober, run_limits

__all__ = [
    "RunLayout",
    "tune_layout",
    "cluster_model",
    "tuning_threads",
    "FixedBase",
    "fixed_base",
    "TuneSetup",
    "fix_setup",
    "log_setup",
]


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The processes and learners the tune's candidates run on (:func:`tune_layout`).

    Attributes:
        num_processes: N, the processes every probe runs on (1 on ``sim``).
        num_learners: λ of hardsync and SMA (devices).
        ps_learners: λ of the parameter-server layouts (compute groups, n-softsync).
    """

    num_processes: int
    num_learners: int
    ps_learners: int


def tune_layout(config: RunConfig) -> RunLayout:
    """The processes and learners the tune's candidates run on: (N, λ, λ_ps).

    λ learners of hardsync (devices of SMA) and λ_ps of the parameter-server layouts
    (compute groups, n-softsync). ``sim``: N = 1, λ = λ_ps = ``protocol.num_learners``.
    ``dist``: N = ``dist.num_processes`` (0: what the base protocol needs), λ = N,
    λ_ps = N − ``dist.num_servers`` (a server takes a process).

    Raises:
        ConfigError: on ``dist``, N larger than this machine's CPU cores (each probe
            starts N processes; more than the cores cannot give a useful measurement and
            may not finish within the budget); ``tune.families`` none of which these
            layouts can probe.
    """
    lam = ps_lam = config.protocol.num_learners
    num_processes = 1
    if config.runtime == "dist":
        num_processes = (
            config.dist.num_processes or required_processes(config.protocol, config.dist)[0]
        )
        cores = os.cpu_count() or 1
        if num_processes > cores:
            setting = (
                f"dist.num_processes = {num_processes}"
                if config.dist.num_processes
                else f"dist.num_processes = 0 (what {config.protocol.name} with "
                f"protocol.num_learners = {config.protocol.num_learners} needs: "
                f"{num_processes})"
            )
            raise ConfigError(
                f"{setting} is not allowed for tuning (distsgd tune, train --tune): expected "
                f"at most {cores} processes (the CPU cores of this machine); set "
                "--num-processes or protocol.num_learners"
            )
        lam, ps_lam = num_processes, num_processes - config.dist.num_servers
    s = config.tune
    ps_ok = ps_lam >= 2 and s.max_groups != 1
    probeable = {
        "hardsync": lam >= 1,
        "compute_groups": ps_ok,
        "softsync": ps_lam >= 2,
        "sma": any(b <= config.protocol.batch_size for b in s.batch_sizes),
        "local_sgd": lam >= 2,
        "diloco": lam >= 2,
    }
    if not any(probeable[f] for f in s.families):
        where = (
            f"{num_processes} processes ({lam} learners, {ps_lam} beside "
            f"{config.dist.num_servers} server rank(s))"
            if config.runtime == "dist"
            else f"{lam} learners"
        )
        raise ConfigError(
            f"tune.families = {s.families!r} is not allowed with {where}: expected at "
            "least one family these layouts can probe: "
            + ", ".join(f for f, ok in probeable.items() if ok)
        )
    return RunLayout(num_processes, lam, ps_lam)


def cluster_model(cfg: RunConfig, num_parameters: int) -> pm.ClusterModel:
    """The simulated cluster's timing model from the config's ``[cluster]`` section."""
    c = cfg.cluster
    return pm.ClusterModel(
        t_batch=c.seconds_per_batch,
        t_sample=c.seconds_per_sample,
        latency_s=c.latency_s,
        bandwidth_gbps=c.bandwidth_gbps,
        num_parameters=num_parameters,
        jitter=c.jitter,
        t_replica=c.seconds_per_replica if c.seconds_per_replica >= 0 else None,
        replica_ratios=tuple(c.replica_ratios),
        t_server=max(c.seconds_per_push, 0.0),
        t_server_contended=c.seconds_per_push_contended,
        t_iteration=max(c.seconds_per_iteration, 0.0),
        cores=c.cores,
        allreduce_latency_s=c.allreduce_network[0],
        allreduce_bandwidth_gbps=c.allreduce_network[1],
    )


def tuning_threads(cfg: RunConfig, num_processes: int) -> int:
    """Torch threads of one of ``num_processes`` processes sharing this machine
    (``train.num_threads`` if set): those a tuning probe trains with, and so those its
    device profile is measured (and cached) at."""
    return cfg.train.num_threads or max(1, (os.cpu_count() or 1) // max(num_processes, 1))


@dataclasses.dataclass
class FixedBase:
    """The base every probe of a tune shares (:func:`fixed_base`).

    Attributes:
        cfg: the config with the data's resolved settings and the device profile fixed.
        dataset: the loaded data set.
        engine: the model built under the run's seed (its initial weights are a run's).
        build_s: wall seconds of loading the data and building the engine.
    """

    cfg: RunConfig
    dataset: Any
    engine: Any
    build_s: float


def fixed_base(
    cfg: RunConfig,
    num_processes: int,
    code: UserCode | None = None,
    check: Callable[[RunConfig, int], None] | None = None,
) -> FixedBase:
    """Load the data and fix the device profile once (calibrated on this machine unless the
    config gives it), so every probe runs on the same simulated cluster, and build the
    engine under the run's seed (the same initial weights as ``distsgd train``). The device
    is timed with the torch threads of one of ``num_processes`` processes sharing this
    machine (``train.num_threads`` if set, :func:`tuning_threads`). ``check(cfg,
    training samples)`` runs before the profile is measured (may raise ConfigError)."""
    torch.set_num_threads(tuning_threads(cfg, num_processes))
    torch.manual_seed(cfg.train.seed)
    t0 = time.perf_counter()
    ds = load_dataset(cfg.data, seed=cfg.train.seed, factory=getattr(code, "data", None))
    cfg = config_for_data(cfg, ds, code)
    build_s = time.perf_counter() - t0
    if check is not None:
        check(cfg, ds.num_train)
    cfg, _ = with_device_profile(cfg, ds, code)
    torch.manual_seed(cfg.train.seed)  # the same initial weights as distsgd train
    t0 = time.perf_counter()
    engine = build_engine(cfg, code)
    build_s += time.perf_counter() - t0
    return FixedBase(cfg, ds, engine, build_s)


def _or_messages(value: float | None) -> float:
    """A fitted all-reduce term, or -1 (the messages' value) where none was fitted."""
    return -1.0 if value is None else value


def _measured_network(
    cfg: RunConfig, num_parameters: int, timings: dict[str, float]
) -> tuple[RunConfig, NetworkProfile]:
    """``cfg`` with the network measured between two gloo processes (no jitter term); the
    measurement's wall seconds are added to ``timings["build_s"]`` (a dist run starts
    processes too)."""
    t0 = time.perf_counter()
    network = calibrate_network(num_parameters, repeats=10)
    timings["build_s"] += time.perf_counter() - t0
    cfg = cfg.replace(
        cluster=dataclasses.replace(
            cfg.cluster,
            latency_s=network.latency_s,
            bandwidth_gbps=network.bandwidth_gbps,
            allreduce_latency_s=_or_messages(network.allreduce_latency_s),
            allreduce_bandwidth_gbps=_or_messages(network.allreduce_bandwidth_gbps),
            jitter=0.0,
        )
    )
    return cfg, network


_TIMING_ITERATIONS = 20  # iterations of the setup's timing probe (sim): enough to pass warm-up


def _timed_wall_per_clock_second(
    cfg: RunConfig, num_learners: int, initial: torch.Tensor, timings: dict[str, float]
) -> float:
    """Wall seconds one second of the probes' clock takes here: 1 on real processes; on
    the simulated cluster, measured by a timing probe of hardsync on ``num_learners``
    (:data:`_TIMING_ITERATIONS` iterations, in a temporary directory): its training wall
    seconds over its simulated seconds. The simulator's wall speed (every learner computed
    in this one process, plus its per-iteration bookkeeping) is what a probe costs, not
    the device profile's compute time, which can be hundreds of times smaller for a small
    model. Sets ``timings["train_samples_per_s"]`` (training samples per wall second) and
    raises ``timings["build_s"]`` to the timing probe's cost outside training when larger."""
    if cfg.runtime != "sim":
        return 1.0
    b = cfg.protocol.batch_size
    cand = Candidate("hardsync", num_learners, b, cfg.optimizer.lr, 0.0)
    train = run_limits(True, max_epochs=0.0, max_samples=_TIMING_ITERATIONS * num_learners * b)
    with tempfile.TemporaryDirectory(prefix="distsgd-tune-timing-") as tmp:
        prober = Prober(cfg, Path(tmp), 0.0, 1, initial)
        result, _ = prober.run(cand, "initial", train)  # a probe: no evaluation
    timings["build_s"] = max(timings["build_s"], result.wall_s - result.train_wall_s)
    simulated_s = result.virtual_s[-1] if result.virtual_s else 0.0
    if result.train_wall_s <= 0 or simulated_s <= 0 or result.samples <= 0:
        return 1.0  # nothing trained (a diverged timing probe): count simulated as wall
    timings["train_samples_per_s"] = result.samples / result.train_wall_s
    return result.train_wall_s / simulated_s


@dataclasses.dataclass
class TuneSetup:
    """What ``distsgd tune``'s set-up fixes for every later phase (:func:`fix_setup`).

    Attributes:
        config: the config as given (``tune.budget_s`` overridden by ``--budget``).
        cfg: ``config`` with the device profile (on ``dist`` also the network) fixed: the
            base of every probe.
        out: the tune directory.
        layout: the processes and learners of :func:`tune_layout`.
        network: the network measured on ``dist`` (None on ``sim``).
        cluster: the cluster's timing model (:func:`cluster_model`).
        initial: the seeded initial weights ``[P]``, the cold start's snapshot.
        timings: wall seconds of a run's build (``build_s``) and of one evaluation
            (``eval_s``), measured in the setup.
        costs: the budget's decisions, started when the setup started.
        num_train: training samples (a candidate's λ·b must not exceed them).
    """

    config: RunConfig
    cfg: RunConfig
    out: Path
    layout: RunLayout
    network: NetworkProfile | None
    cluster: pm.ClusterModel
    initial: torch.Tensor
    timings: dict[str, float]
    costs: TuneBudget
    num_train: int


def fix_setup(config: RunConfig, out: Path) -> TuneSetup:
    """``distsgd tune``'s set-up measurements (:class:`TuneSetup`): :func:`fixed_base` with
    the seeded initial weights ``[P]``, the wall seconds of loading the data and building
    the model (``build_s``) and of one evaluation on the test set (``eval_s``), on ``dist``
    the network, on ``sim`` the simulator's wall speed, for the budget
    (:mod:`distsgd.tuner.budget`).

    Raises:
        ConfigError: the layout errors of :func:`tune_layout`; a budget below the set-up
            and one probe (:meth:`~distsgd.tuner.budget.TuneBudget.minimum_s`)."""
    t0 = time.perf_counter()
    settings = config.tune
    layout = tune_layout(config)
    base = fixed_base(config, layout.num_processes)
    cfg, ds, engine = base.cfg, base.dataset, base.engine
    initial, num_params, num_train = engine.initial_weights(), engine.num_parameters, ds.num_train
    # one evaluation, timed on a part of the test set and scaled to all of it
    n, t_eval = min(ds.num_test, 2 * cfg.train.eval_batch_size), time.perf_counter()
    engine.evaluation_sums(initial, ds.test, cfg.train.eval_batch_size, 0, n)
    eval_s = (time.perf_counter() - t_eval) * ds.num_test / n
    timings = {"build_s": base.build_s, "eval_s": eval_s}
    network = None
    if cfg.runtime == "dist":
        cfg, network = _measured_network(cfg, num_params, timings)
    cluster = cluster_model(cfg, num_params)
    wall_per_clock = _timed_wall_per_clock_second(cfg, layout.num_learners, initial, timings)
    costs = TuneBudget(
        settings.budget_s,
        settings.segment_fraction,
        TUNE_STEADY_SHARE,
        first_probe_estimate(settings.probe_seconds, wall_per_clock, timings["build_s"]),
        timings["eval_s"],
        start=t0,
    )
    if costs.minimum_s() > settings.budget_s:
        raise ConfigError(
            f"--budget {settings.budget_s:g}s is not allowed for this config: expected at "
            f"least {math.ceil(costs.minimum_s())}s (the setup took {costs.elapsed():.1f} s "
            f"and one probe of {settings.probe_seconds:g} s is expected to take "
            f"{costs.first_probe_s:.1f} s wall; a shorter tune.probe_seconds costs less)"
        )
    return TuneSetup(config, cfg, out, layout, network, cluster, initial, timings, costs, num_train)


def log_setup(log: DecisionLog, fixed: TuneSetup, clock: str) -> None:
    """``distsgd tune``'s set-up decisions: the cluster the probes run on, their length
    (on ``clock``, the runtime's clock), the budget."""
    cfg, c = fixed.cfg, fixed.cfg.cluster
    settings, costs = cfg.tune, fixed.costs
    if cfg.runtime == "dist":
        _log_dist_setup(log, fixed)
    else:
        log(
            "setup",
            f"device profile {c.seconds_per_batch * 1e3:.3f} ms/batch + "
            f"{c.seconds_per_sample * 1e6:.1f} µs/sample, λ = {cfg.protocol.num_learners}",
            "calibrated once on this machine so every probe runs on the same simulated cluster"
            if fixed.config.cluster.needs_calibration
            else "given by the config",
        )
    log(
        "setup",
        f"probes of {settings.probe_seconds:g} {clock} seconds each",
        "equal-time probes from the same snapshot fold hardware and statistical efficiency "
        "into one score (Omnivore)",
    )
    log(
        "setup",
        f"budget {settings.budget_s:g} s wall; a step starts only if its expected cost "
        "fits in the time left to its phase",
        f"setup took {costs.elapsed():.1f} s; first probe expected to take "
        f"{costs.first_probe_s:.1f} s wall, later ones as long as the longest so far; "
        f"one evaluation {fixed.timings['eval_s']:.2f} s. Slack: one step's overrun of its "
        "expected cost, plus writing the plan and report",
    )


def _log_dist_setup(log: DecisionLog, fixed: TuneSetup) -> None:
    """The set-up's decisions on real processes: the layouts and the measured cluster."""
    cfg, c, network = fixed.cfg, fixed.cfg.cluster, fixed.network
    assert network is not None
    log(
        "setup",
        f"probes on {fixed.layout.num_processes} real processes (dist runtime, wall clock): "
        f"hardsync and SMA on λ = {fixed.layout.num_learners} learners (devices), the "
        f"parameter-server layouts on λ = {fixed.layout.ps_learners} learners and "
        f"{cfg.dist.num_servers} server rank(s)",
        "candidates are limited to layouts that fit the processes",
    )
    log(
        "setup",
        f"cluster model of this machine: device {c.seconds_per_batch * 1e3:.3f} ms/batch "
        f"+ {c.seconds_per_sample * 1e6:.1f} µs/sample, network latency "
        f"{network.latency_s * 1e6:.1f} µs, bandwidth {network.bandwidth_gbps:.3f} Gbit/s",
        (
            "device calibrated with one process's threads"
            if fixed.config.cluster.needs_calibration
            else "device profile given by the config"
        )
        + "; network measured between two gloo processes (netcal); it predicts the "
        "wall seconds per iteration of unprobed configurations (no jitter term), scaled "
        "by measured / predicted of the probed ones",
    )
