"""One ``distsgd tune`` as a session of phases (docs/protocols.md §3; docs/tuning.md).

:class:`TuneSession` runs the phases in order, one method each; every decision goes to
``decisions.jsonl`` with its reason, and what a phase finds goes into the session's
:class:`TuneState` for the phases after it:

1. :meth:`~TuneSession.setup` fixes the device profile once (calibrated on this machine
   unless the config gives it), so every probe runs on the same simulated cluster; on real
   processes (``--runtime dist``) it also measures the network
   (:func:`~distsgd.runtime.netcal.calibrate_network`), so the cluster model predicts the
   wall seconds per iteration of unprobed layouts; it refuses a budget below the setup and
   one probe;
2. :meth:`~TuneSession.cold_start`: Omnivore's cold start from the initial weights
   (:class:`~distsgd.tuner.omnivore.OmnivoreSearch`);
3. :meth:`~TuneSession.joint_search`, beyond Omnivore: the performance model ranks
   unprobed protocol families, layouts and batch sizes, the best ``tune.extra_probes``
   are probed;
4. :meth:`~TuneSession.long_run` of the best configuration until the target accuracy or
   its share of the budget, which gives the snapshot for steady state and the loss curve
   and evaluation points the statistical-efficiency fit needs;
5. :meth:`~TuneSession.steady_state`: Omnivore's steady state from that snapshot (when the
   long run stopped before the target), which sets the lower η to try;
6. :meth:`~TuneSession.learning_rate_step`: where to step η
   (:mod:`~distsgd.tuner.step_search`), or, when the plan keeps η, a second long run from
   the first one's snapshot;
7. :meth:`~TuneSession.plan`: ``plan.toml`` (a config ``distsgd train`` accepts as is) and
   its predicted time to accuracy HE · SE (:mod:`~distsgd.tuner.plan`);
8. :meth:`~TuneSession.report`: ``tune.json``, ``report.md`` and its figures.

Budget B = ``tune.budget_s``: every phase decision is a method of
:class:`~distsgd.tuner.budget.TuneBudget` (the shares of B per phase are stated there).

Runtimes. ``sim``: probes are equal in *simulated* time (``tune.probe_seconds`` on the
virtual clock) and every time is simulated seconds. ``dist`` (N processes,
``dist.num_processes`` or what the base protocol needs): probes are ordinary dist
trainings of ``tune.probe_seconds`` wall seconds of training
(:class:`~distsgd.tuner.probes.Prober`), the candidates are the layouts that fit N
processes (:func:`tune_layout`), HE is measured in wall seconds (the model's, scaled by
measured / predicted, for unprobed layouts), so the prediction and ``verify`` compare wall
seconds with wall seconds.
"""

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
from tqdm import tqdm

from distsgd.config import TUNE_STEADY_SHARE, ConfigError, RunConfig, TuneConfig, required_processes
from distsgd.data import load_dataset
from distsgd.engine import UserCode, build_engine, config_for_data
from distsgd.rundir import check_out_path, enclosing_tuner_dir
from distsgd.runtime.factory import with_device_profile
from distsgd.runtime.netcal import NetworkProfile, calibrate_network
from distsgd.tuner import perf_model as pm
from distsgd.tuner.budget import TuneBudget, first_probe_estimate
from distsgd.tuner.omnivore import (
    Candidate,
    DecisionLog,
    OmnivoreSearch,
    ProbeResult,
    pick_best,
    probe_joint,
    rank_joint,
)
from distsgd.tuner.plan import (
    PLAN_EVAL_EVERY,
    extrapolate_plan,
    plan_config,
    plan_switch,
    predict_plan,
)
from distsgd.tuner.probes import LongRun, Prober, check_optimizer_searchable, check_runtime
from distsgd.tuner.report import clean_state, write_report, write_tune_json
from distsgd.tuner.step_search import choose_step, truncate_run, usable_step_points

__all__ = [
    "fixed_base",
    "FixedBase",
    "TuneSession",
    "TuneSetup",
    "TuneState",
    "tune_layout",
    "cluster_model",
    "tuning_threads",
]

_LONG_RUN = "long_run"  # the snapshot of the first long run's final model
_SECOND_LONG_RUN = "long_run_2"  # the snapshot of the second long run's final model
_DEFAULT_MAX_EPOCHS = 10.0  # the plan's and the runs' limit when train.max_epochs is 0


def tune_layout(config: RunConfig) -> tuple[int, int, int]:
    """The processes and learners the tune's candidates run on: ``(N, λ, λ_ps)``.

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
    return num_processes, lam, ps_lam


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


def _fixed_profile(
    cfg: RunConfig, num_processes: int = 1
) -> tuple[RunConfig, torch.Tensor, int, dict[str, float], int]:
    """:func:`fixed_base` with the seeded initial weights ``[P]``; also times loading the
    data (``build_s``) and one evaluation on the test set (``eval_s``), wall seconds, for
    the budget (:mod:`distsgd.tuner.budget`). Returns (config, initial weights, P,
    timings, training samples)."""
    base = fixed_base(cfg, num_processes)
    cfg, ds, engine, build_s = base.cfg, base.dataset, base.engine, base.build_s
    initial = engine.initial_weights()
    # one evaluation, timed on a part of the test set and scaled to all of it
    n = min(ds.num_test, 2 * cfg.train.eval_batch_size)
    t0 = time.perf_counter()
    engine.evaluation_sums(initial, ds.test, cfg.train.eval_batch_size, 0, n)
    timings = {"build_s": build_s, "eval_s": (time.perf_counter() - t0) * ds.num_test / n}
    return cfg, initial, engine.num_parameters, timings, ds.num_train


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
    train = {
        "max_epochs": 0.0,
        "max_samples": _TIMING_ITERATIONS * num_learners * b,
        "max_seconds": 0.0,
        "max_virtual_seconds": 0.0,
        "stop_at_target": False,
        "eval_every_samples": 0,
        "checkpoint_every_evals": 0,
        "tensorboard": False,
    }
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
    """What :meth:`TuneSession.setup` fixes for every later phase.

    Attributes:
        config: the config as given (``tune.budget_s`` overridden by ``--budget``).
        cfg: ``config`` with the device profile (on ``dist`` also the network) fixed: the
            base of every probe.
        out: the tune directory.
        num_processes: N of :func:`tune_layout` (1 on ``sim``).
        num_learners: λ of hardsync and SMA.
        ps_learners: λ of the parameter-server layouts.
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
    num_processes: int
    num_learners: int
    ps_learners: int
    network: NetworkProfile | None
    cluster: pm.ClusterModel
    initial: torch.Tensor
    timings: dict[str, float]
    costs: TuneBudget
    num_train: int


def _fix_setup(config: RunConfig, out: Path) -> TuneSetup:
    """The setup phase's measurements (see :meth:`TuneSession.setup`)."""
    t0 = time.perf_counter()
    settings = config.tune
    num_processes, lam, ps_lam = tune_layout(config)
    cfg, initial, num_params, timings, num_train = _fixed_profile(config, num_processes)
    network = None
    if cfg.runtime == "dist":
        cfg, network = _measured_network(cfg, num_params, timings)
    cluster = cluster_model(cfg, num_params)
    wall_per_clock = _timed_wall_per_clock_second(cfg, lam, initial, timings)
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
    return TuneSetup(
        config, cfg, out, num_processes, lam, ps_lam, network, cluster, initial, timings, costs,
        num_train,
    )  # fmt: skip


@dataclasses.dataclass
class TuneState:
    """What the phases found, in the order they find it.

    Attributes:
        chosen: the best probe of the cold start, then of the joint search.
        noise_scale: B_noise of the batch-size law, samples (``tune.noise_scale``, or the
            cold start's samples per iteration).
        ranked: the joint search's unprobed candidates by predicted time to accuracy
            (seconds, candidate), soonest first.
        eval_every_samples: the long runs' evaluation interval, samples.
        samples_per_s: the chosen probe's training throughput, samples per wall second.
        long_run: the first long run (None: skipped for lack of budget).
        long_run_s: its time to accuracy on the runtime's clock (inf: not reached).
        steady: steady state's recommendation (None: steady state did not search).
        switch: the configuration the plan continues with after the long run (η/10 when
            the long run reached the target; None without a usable long run).
        step_at: the long run's evaluation record the plan steps η at (None: no step).
        step_runs: the runs at the lower η tried (:attr:`StepChoice.runs`).
        plan_runs: the runs the prediction fits, in order (the long run, up to the step,
            then the run from there or the second long run).
        tuner_measured_s: the time to accuracy of the plan's chain as the tuner measured
            it, on the runtime's clock (None: not seen reaching the target).
        plan: the plan's run config.
        prediction: :func:`~distsgd.tuner.plan.predict_plan` with ``tuner_measured_s``.
        extrapolation: :func:`~distsgd.tuner.plan.extrapolate_plan` (sim only).
    """

    chosen: ProbeResult | None = None
    noise_scale: float = math.nan
    ranked: list[tuple[float, Candidate]] = dataclasses.field(default_factory=list)
    eval_every_samples: int = PLAN_EVAL_EVERY
    samples_per_s: float = math.nan
    long_run: LongRun | None = None
    long_run_s: float = math.inf
    steady: Candidate | None = None
    switch: Candidate | None = None
    step_at: dict[str, Any] | None = None
    step_runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    plan_runs: list[ProbeResult] = dataclasses.field(default_factory=list)
    tuner_measured_s: float | None = None
    plan: RunConfig | None = None
    prediction: dict[str, Any] = dataclasses.field(default_factory=dict)
    extrapolation: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def chosen_candidate(self) -> Candidate:
        """The chosen configuration (after the cold start)."""
        assert self.chosen is not None, "the cold start comes first"
        return self.chosen.candidate


class TuneSession:
    """One tune: the setup's fixed measurements, the machinery every phase shares (decision
    log, progress bar, prober, Omnivore's search) and :class:`TuneState`; one method per
    phase, called in order by :func:`distsgd.tuner.tune.tune`.

    Args:
        fixed: what the setup measured (:meth:`setup` makes it; its ``out`` exists).
        progress: show a progress bar over the budget and one line per decision.

    Create it with :meth:`setup`. Example (the whole tune)::

        session = TuneSession.setup(config, "runs/tune", budget_s=600)
        # then, in order: cold_start, joint_search, long_run, steady_state,
        # learning_rate_step, plan; report() returns what tune.json holds;
        # session.prober.close() ends the ranks of a dist tune (distsgd.tuner.tune.tune)
    """

    def __init__(self, fixed: TuneSetup, progress: bool = True) -> None:
        self.fixed = fixed
        self.cfg = fixed.cfg
        self.settings: TuneConfig = fixed.cfg.tune
        self.costs = fixed.costs
        self.out = fixed.out
        self.bar = tqdm(
            total=round(self.settings.budget_s),
            unit="s",
            desc="tune",
            disable=not progress,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s budget {postfix}",
        )
        self.log = DecisionLog(self.out / "decisions.jsonl", echo=tqdm.write if progress else None)
        self.prober = Prober(
            self.cfg,
            self.out,
            self.settings.probe_seconds,
            self.settings.score_window,
            fixed.initial,
            keep_ranks=True,  # dist: one pool of ranks for every probe and long run
        )
        self.clock = self.prober.clock
        self.search = OmnivoreSearch(
            self._probe,
            self.settings,
            fixed.num_learners,
            self.cfg.protocol.batch_size,
            self.log,
            ps_learners=fixed.ps_learners,
            out_of_budget=self._search_out_of_budget,
        )
        self.state = TuneState()

    # ---- shared machinery ----------------------------------------------------------------
    def _tick(self, phase: str, extra: str = "") -> None:
        """Move the progress bar to the elapsed seconds and name what runs now."""
        self.bar.n = min(round(self.costs.elapsed()), self.bar.total)
        self.bar.set_postfix_str(f"{phase} {extra}".strip(), refresh=True)

    def _probe(self, cand: Candidate, snapshot: str) -> ProbeResult:
        """One equal-time probe, its wall cost recorded in the budget."""
        self._tick("probe", cand.label())
        r = self.prober(cand, snapshot)
        self.costs.record_probe(r.wall_s, r.train_wall_s)
        for note in r.notes:
            self.log("probe", f"note on {cand.label()}", note)
        self._tick("probe", cand.label())
        return r

    def _search_out_of_budget(self) -> bool:
        """The first probe may use the whole budget (a plan needs one), the others must be
        expected to end within the search's share."""
        return not self.costs.may_search_probe(bool(self.search.results))

    def _max_epochs(self) -> float:
        """Epochs a plan (and a run from a long run's snapshot) may train in all."""
        return self.cfg.train.max_epochs or _DEFAULT_MAX_EPOCHS

    def _long_run_rate(self) -> float:
        """Training samples per wall second of the long run (the chosen probe's without
        training time)."""
        run = self.state.long_run
        assert run is not None
        r = run.result
        return r.samples / r.train_wall_s if r.train_wall_s > 0 else self.state.samples_per_s

    # ---- 1. setup ------------------------------------------------------------------------
    @classmethod
    def setup(
        cls,
        config: RunConfig,
        out_dir: str | Path,
        *,
        budget_s: float | None = None,
        progress: bool = True,
        check: Callable[[TuneSetup], None] | None = None,
    ) -> TuneSession:
        """Check the settings, fix the device profile (and on ``dist`` the network), time a
        run's build and one evaluation, then create ``out_dir`` and log the setup.

        Args:
            config: the base config (see :func:`distsgd.tuner.tune.tune`).
            out_dir: the tune directory (created; must not hold a tune already).
            budget_s: overrides ``tune.budget_s`` (wall seconds).
            progress: show a progress bar over the budget and one line per decision.
            check: called with the setup's measurements before anything is written or
                shown (the progress bar opens after it); may raise ConfigError.

        Raises:
            ConfigError: an unavailable runtime, an optimizer or schedule the tuner does not
                search (:func:`~distsgd.tuner.probes.check_optimizer_searchable`), an
                ``out_dir`` that is a file or holds a tune, the layout errors of
                :func:`tune_layout`, a budget below the setup and one probe (nothing is
                written then).
        """
        check_runtime(config.runtime)
        check_optimizer_searchable(config)
        if budget_s is not None:
            config = config.replace(tune=dataclasses.replace(config.tune, budget_s=budget_s))
        out = Path(out_dir)
        check_out_path(out)  # a path the OS takes, not a file, writable
        if (out / "plan.toml").exists() or (out / "decisions.jsonl").exists():
            raise ConfigError(
                f"output directory {str(out)!r} already holds a tune; choose another --out"
            )
        if (out / "summary.json").exists() or (out / "checkpoint.pt").exists():
            raise ConfigError(  # a tune must not write beside a run's checkpoint
                f"output directory {str(out)!r} already holds a training run; choose another --out"
            )
        inside = enclosing_tuner_dir(out)
        if inside is not None:  # nor into another tuner's probes/
            raise ConfigError(
                f"--out {str(out)!r} is not allowed: it is inside the tuner's directory "
                f"{str(inside)!r} (its probes and segments); choose another --out"
            )
        fixed = _fix_setup(config, out)
        if check is not None:
            check(fixed)
        out.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no directory
        session = cls(fixed, progress)
        session._log_setup()
        return session

    def _log_setup(self) -> None:
        """The setup's decisions: the cluster the probes run on, their length, the budget."""
        fixed, c, clock = self.fixed, self.cfg.cluster, self.clock.name
        if self.cfg.runtime == "dist":
            self._log_dist_setup()
        else:
            self.log(
                "setup",
                f"device profile {c.seconds_per_batch * 1e3:.3f} ms/batch + "
                f"{c.seconds_per_sample * 1e6:.1f} µs/sample, λ = {self.cfg.protocol.num_learners}",
                "calibrated once on this machine so every probe runs on the same simulated cluster"
                if fixed.config.cluster.needs_calibration
                else "given by the config",
            )
        self.log(
            "setup",
            f"probes of {self.settings.probe_seconds:g} {clock} seconds each",
            "equal-time probes from the same snapshot fold hardware and statistical efficiency "
            "into one score (Omnivore)",
        )
        self.log(
            "setup",
            f"budget {self.settings.budget_s:g} s wall; a step starts only if its expected cost "
            "fits in the time left to its phase",
            f"setup took {self.costs.elapsed():.1f} s; first probe expected to take "
            f"{self.costs.first_probe_s:.1f} s wall, later ones as long as the longest so far; "
            f"one evaluation {fixed.timings['eval_s']:.2f} s. Slack: one step's overrun of its "
            "expected cost, plus writing the plan and report",
        )

    def _log_dist_setup(self) -> None:
        """The setup's decisions on real processes: the layouts and the measured cluster."""
        fixed, c, network = self.fixed, self.cfg.cluster, self.fixed.network
        assert network is not None
        self.log(
            "setup",
            f"probes on {fixed.num_processes} real processes (dist runtime, wall clock): "
            f"hardsync and SMA on λ = {fixed.num_learners} learners (devices), the "
            f"parameter-server layouts on λ = {fixed.ps_learners} learners and "
            f"{self.cfg.dist.num_servers} server rank(s)",
            "candidates are limited to layouts that fit the processes",
        )
        self.log(
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

    # ---- 2. cold start -------------------------------------------------------------------
    def cold_start(self) -> None:
        """Omnivore's cold start from the initial weights; its best probe is chosen.

        Raises:
            ConfigError: every cold-start probe diverged or none ran.
        """
        best = self.search.cold_start("initial")
        if best is None:
            raise ConfigError(
                "tune.lrs = "
                f"{self.settings.lrs!r} is not allowed: every cold-start probe diverged or none "
                "ran; expected smaller learning rates or a larger budget"
            )
        self.state.chosen = best

    # ---- 3. joint search -----------------------------------------------------------------
    def joint_search(self) -> None:
        """Beyond Omnivore: rank the unprobed families, layouts and batch sizes by predicted
        time to accuracy (HE from the cluster model, scaled by measured / predicted on real
        processes, × SE carried with the batch-size law), probe the best
        ``tune.extra_probes`` and choose one that beats the cold start's score by more than
        the tie buffer."""
        s, st, cluster = self.settings, self.state, self.fixed.cluster
        chosen = st.chosen
        assert chosen is not None
        ref = chosen.candidate
        st.noise_scale = s.noise_scale or float(pm.samples_per_iteration(ref.layout()))
        if s.extra_probes <= 0:
            return
        st.ranked = rank_joint(
            self.search,
            ref,
            s,
            cluster,
            st.noise_scale,
            self.fixed.num_train,
            self.log,
            measured_he=not self.prober.simulated,
        )
        ref_time = pm.seconds_per_iteration(ref.layout(), cluster)
        self.log(
            "joint",
            f"ranked {len(st.ranked)} unprobed configurations by predicted time to accuracy",
            f"HE from the cluster model × SE carried from {ref.shape()} with the batch-size "
            f"law, B_noise = {st.noise_scale:g} samples"
            + (" (tune.noise_scale)" if s.noise_scale else " (= its samples per iteration)"),
            ranking=[
                {"label": c.label(), "relative_time": t / ref_time} for t, c in st.ranked[:10]
            ],
        )
        extra = self._probe_ranked(chosen, ref_time)
        better = pick_best(extra, s.tie_buffer)
        if better is not None and better.score < chosen.score * (1 - s.tie_buffer):
            self.log(
                "joint",
                f"choose {better.candidate.label()}",
                f"its score {better.score:.4f} beats {chosen.score:.4f} by more than "
                f"{100 * s.tie_buffer:g}%",
            )
            st.chosen = better
        else:
            self.log(
                "joint",
                f"keep {chosen.candidate.label()}",
                "no configuration of the joint search beat its equal-time score by more than "
                f"{100 * s.tie_buffer:g}%",
            )

    def _probe_ranked(self, chosen: ProbeResult, ref_time: float) -> list[ProbeResult]:
        """Probe the best ``tune.extra_probes`` of the ranking from the initial weights,
        each only if it is expected to end within the search's share of the budget."""
        ref = chosen.candidate

        def skip() -> str | None:
            if self.costs.may_search_probe(True):
                return None
            return (
                f"search budget spent: a probe is expected to take "
                f"{self.costs.expected_probe_s():.1f} s, "
                f"{max(self.costs.left(self.costs.search_end), 0):.1f} s left to the search"
            )

        def probe(t_pred: float, cand: Candidate) -> tuple[ProbeResult, str, str]:
            self.log(
                "joint",
                f"probe {cand.label()}",
                f"predicted {t_pred / ref_time:.2f}× the time of {ref.shape()}",
            )
            r = self._probe(cand, "initial")
            return r, r.snapshot, ""

        n = self.settings.extra_probes
        return probe_joint(self.state.ranked, n, self.search, chosen, self.log, probe, skip)

    # ---- 4. long run ---------------------------------------------------------------------
    def long_run(self) -> None:
        """Omnivore's long run of the chosen configuration from the initial weights until
        the target accuracy or what the budget leaves it (after its evaluations and the
        later phases), keeping the model of every evaluation for the step search; skipped
        when that is less than one probe's training."""
        st, cfg = self.state, self.cfg
        chosen = st.chosen
        assert chosen is not None
        cand = chosen.candidate
        st.eval_every_samples = min(
            cfg.train.eval_every_samples or PLAN_EVAL_EVERY, PLAN_EVAL_EVERY
        )
        st.samples_per_s = (
            chosen.samples / chosen.train_wall_s if chosen.train_wall_s > 0 else math.nan
        )
        wall = self.costs.first_long_run_seconds(st.samples_per_s, st.eval_every_samples)
        if wall <= 0:
            self.log(
                "long run",
                "skipped the long run",
                f"{max(self.costs.left(), 0):.1f} s of the budget left, less than a run of one "
                "probe's training plus its build and evaluations; the plan is the cold start's "
                "choice without a predicted time to accuracy",
            )
            return
        self.log(
            "long run",
            f"train {cand.label()} from the initial weights",
            f"until {100 * cfg.train.target:g}% test accuracy or {wall:.1f} wall "
            f"seconds of training, evaluating every {st.eval_every_samples} samples (Omnivore's "
            "long run; it gives the steady-state snapshot and the loss curve for the SE fit; "
            "its length is what the budget leaves after its evaluations and the later phases)",
        )
        self._tick("long run", cand.label())
        run = self.prober.long_run(
            cand, wall, st.eval_every_samples, _LONG_RUN, save_eval_weights=True
        )
        self._tick("long run")
        summary = run.summary
        self.log(
            "long run",
            "reached the target" if run.reached else "stopped before the target",
            f"best accuracy {summary.get('best_metric', 0):.4f} after {run.epochs:.3f} "
            f"epochs, {summary.get(self.clock.run_seconds_key) or 0:.2f} {self.clock.name} s, "
            f"{summary.get('train_wall_s', 0):.1f} wall s of training",
        )
        st.long_run = run
        st.plan_runs = [run.result]

    # ---- 5. steady state -----------------------------------------------------------------
    def steady_state(self) -> None:
        """What the plan continues with after the long run. Reached the target: η/10 (the
        lower η of Omnivore's steady-state grid), tried from earlier snapshots. Stopped
        before it: Omnivore's steady state from the long run's snapshot within its share
        of the budget; a recommendation of another μ or layout becomes the better of η and
        η/10 at the plan's own (:func:`~distsgd.tuner.plan.plan_switch`)."""
        st, run = self.state, self.state.long_run
        if run is None:
            self.log("steady state", "skipped", "no long run; no snapshot")
            return
        if run.result.diverged:
            self.log("steady state", "skipped", "the long run diverged; no snapshot")
            return
        chosen = st.chosen_candidate
        if run.reached:
            st.long_run_s = float(run.summary.get(self.clock.time_to_target_key) or math.inf)
            st.tuner_measured_s = st.long_run_s
            st.switch = dataclasses.replace(chosen, lr=chosen.lr / 10)
            self.log(
                "steady state",
                f"skipped; try {st.switch.label()} from earlier snapshots",
                f"the long run reached the target after {st.long_run_s:.2f} {self.clock.name} s; "
                "a step to η/10 (the lower η of Omnivore's steady-state grid) at an earlier "
                "evaluation may reach it sooner",
            )
            return
        steady_end = self.costs.steady_end()
        self.search.out_of_budget = lambda: not self.costs.may_probe(steady_end)
        st.steady = self.search.steady_state(chosen, _LONG_RUN)
        st.switch = st.steady
        if dataclasses.replace(st.steady, lr=chosen.lr) != chosen:
            st.switch = plan_switch(self.search.results, chosen, _LONG_RUN, self.settings)
            self.log(
                "steady state",
                f"continue with {st.switch.label()}",
                f"steady state recommends {st.steady.label()}; a run config can change only η "
                "mid-run (a step of the schedule), so the family, layout and μ stay and η is "
                f"the better of η and η/10 at μ = {chosen.momentum:g} from the same snapshot",
            )

    # ---- 6. learning-rate step -----------------------------------------------------------
    def learning_rate_step(self) -> None:
        """With a lower η to continue with: where to step to it (the step search). With
        the same η and a long run that stopped before the target: a second long run from
        its snapshot until the target, which measures the time to accuracy."""
        st = self.state
        if st.switch is None:  # no usable long run
            return
        assert st.long_run is not None
        if st.switch.lr < st.chosen_candidate.lr:
            self._step_search()
        elif not st.long_run.reached:
            self._second_long_run()

    def _step_search(self) -> None:
        """Runs at the lower η from the long run's evaluations; the plan steps where the
        target came soonest (:func:`~distsgd.tuner.step_search.choose_step`)."""
        st, run = self.state, self.state.long_run
        assert run is not None
        points, pool = usable_step_points(
            run.result.evals,
            self.cfg.train.target,
            self.settings,
            self._max_epochs(),
            include_last=not run.reached,
            log=self.log,
        )
        choice = choose_step(
            points,
            st.long_run_s,
            self.clock,
            self._run_step,
            self.log,
            long_run_reached=run.reached,
            pool=pool,
            tie_buffer=self.settings.tie_buffer,
        )
        st.step_runs = choice.runs
        if choice.point is not None:
            assert choice.run is not None
            st.step_at = choice.point
            st.plan_runs = [truncate_run(run.result, int(choice.point["iterations"])), choice.run]
            st.tuner_measured_s = choice.seconds if math.isfinite(choice.seconds) else None

    def _run_step(
        self, point: dict[str, Any], horizon: float
    ) -> tuple[ProbeResult, dict[str, Any]] | None:
        """Train the lower η from ``point``'s snapshot until the target, ``horizon``
        seconds on the runtime's clock (inf: none) or what the budget leaves (the
        :data:`~distsgd.tuner.step_search.StepRunFn` of the step search); None when the
        budget leaves less than one probe's training."""
        st, run, switch = self.state, self.state.long_run, self.state.switch
        assert run is not None and switch is not None
        at = f"epoch {point['epoch']:.3f} (accuracy {point['eval_metric']:.4f})"
        wall = self.costs.second_long_run_seconds(self._long_run_rate(), st.eval_every_samples)
        if wall <= 0:
            self.log(
                "step",
                f"skip the step at {at}",
                f"{max(self.costs.left(), 0):.1f} s of the budget left, less than a run of "
                "one probe's training plus its build and evaluations",
            )
            return None
        name = f"eval{point['eval']}"
        self.prober.eval_snapshot(run.result, int(point["eval"]), name)
        limit = (
            f"within {horizon:.4g} {self.clock.name} s (to beat the soonest so far)"
            if math.isfinite(horizon)
            else f"within {wall:.1f} wall s of training"
        )
        self.log(
            "step",
            f"train {switch.label()} from the long run's {at}",
            f"until the target {limit}: the time to accuracy of a plan stepping η "
            f"{st.chosen_candidate.lr:g} → {switch.lr:g} there",
        )
        self._tick("step", f"epoch {point['epoch']:.2f}")
        step_run = self.prober.long_run(
            switch,
            wall,
            st.eval_every_samples,
            f"step-{name}",
            snapshot=name,
            max_epochs=self._max_epochs() - float(point["epoch"]),
            max_clock_s=horizon if math.isfinite(horizon) else 0.0,
        )
        self._tick("step")
        return step_run.result, step_run.summary

    def _second_long_run(self) -> None:
        """The plan keeps η: continue from the long run's snapshot until the target, the
        epochs left or what the budget leaves."""
        st, run, switch = self.state, self.state.long_run, self.state.switch
        assert run is not None and switch is not None
        wall = self.costs.second_long_run_seconds(self._long_run_rate(), st.eval_every_samples)
        epochs_left = max(self._max_epochs() - run.epochs, 0.01)
        if wall <= 0:
            self.log(
                "long run",
                f"skipped the run of {switch.label()} from the long run's snapshot",
                f"{max(self.costs.left(), 0):.1f} s of the budget left, less than a run of one "
                "probe's training plus its build and evaluations",
            )
            return
        self.log(
            "long run",
            f"train {switch.label()} from the long run's snapshot",
            f"until the target, {epochs_left:.2f} more epochs or {wall:.1f} wall seconds of "
            "training (steady state keeps η; it measures the time to accuracy)",
        )
        self._tick("long run 2", switch.label())
        second = self.prober.long_run(
            switch,
            wall,
            st.eval_every_samples,
            _SECOND_LONG_RUN,
            snapshot=_LONG_RUN,
            max_epochs=epochs_left,
        )
        self._tick("long run 2")
        st.plan_runs = [run.result, second.result]
        self.log(
            "long run",
            "reached the target" if second.reached else "stopped before the target",
            f"best accuracy {second.summary.get('best_metric', 0):.4f} after "
            f"{run.epochs:.3f} + {second.epochs:.3f} epochs",
        )
        if second.reached:
            first_s = run.summary.get(self.clock.run_seconds_key)
            st.tuner_measured_s = float(first_s or 0) + float(
                second.summary[self.clock.time_to_target_key]
            )

    # ---- 7. plan -------------------------------------------------------------------------
    def plan(self) -> None:
        """Write ``plan.toml`` (the chosen configuration, stepping η where the step search
        found the target soonest) and predict its time to accuracy HE · SE from the long
        runs; on the simulated runtime also on clusters of 1–8× the learners."""
        st, chosen = self.state, self.state.chosen_candidate
        step_epoch = float(st.step_at["epoch"]) if st.step_at is not None else 0.0
        steady = st.switch if st.step_at is not None else None
        st.plan = plan_config(self.cfg, chosen, steady, step_epoch, self.log)
        (self.out / "plan.toml").write_text(st.plan.to_toml(applicable_only=True))
        prediction = predict_plan(
            st.plan_runs, self.cfg.train.target, reached=st.tuner_measured_s is not None
        )
        prediction["tuner_measured_s"] = st.tuner_measured_s
        st.prediction = prediction
        if math.isfinite(prediction["predicted_s"]):
            self.log(
                "plan",
                f"plan {st.plan.name}: predicted time to accuracy "
                f"{prediction['predicted_s']:.2f} {self.clock.name} s",
                f"HE {prediction['seconds_per_iteration'] * 1e3:.3f} ms per iteration (measured "
                f"in the long runs) × SE {prediction['iterations_to_target']:.0f} iterations "
                f"(fitted loss curve reaching the target loss {prediction['target_loss']:.4f})",
            )
        else:
            self.log(
                "plan",
                f"plan {st.plan.name}: no prediction of the time to accuracy",
                prediction.get("reason", "too few training losses or evaluations to fit")
                + (
                    f"; the long run(s) reached the target in {st.tuner_measured_s:.4g} "
                    f"{self.clock.name} s (measured)"
                    if st.tuner_measured_s is not None
                    else ""
                ),
            )
        se = prediction["iterations_to_target"]
        if math.isfinite(se) and self.prober.simulated:  # larger simulated clusters
            st.extrapolation = extrapolate_plan(
                chosen, self.cfg.protocol.num_learners, se, self.fixed.cluster, st.noise_scale
            )

    # ---- 8. report -----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Close the progress bar, write ``tune.json`` (NaN/inf as null) and ``report.md``
        with its figures; returns what ``tune.json`` holds."""
        self.bar.n = min(round(self.costs.elapsed()), self.bar.total)
        self.bar.close()
        saved = clean_state(self._tune_json())
        write_tune_json(self.out, saved)
        write_report(self.out, saved)
        return saved

    def _tune_json(self) -> dict[str, Any]:
        """Everything the tune found, as ``tune.json`` keeps it (its keys are a file
        format: ``segments`` are the runs the prediction fits)."""
        fixed, st, costs, cfg = self.fixed, self.state, self.costs, self.cfg
        chosen, plan = st.chosen_candidate, st.plan
        assert plan is not None
        return {
            "config": str(fixed.config.name),
            "runtime": cfg.runtime,
            "clock": self.clock.name,
            "budget_s": self.settings.budget_s,
            "budget_costs": {
                "first_probe_expected_s": costs.first_probe_s,
                "probe_wall_s_max": costs.expected_probe_s(),
                "eval_s": costs.eval_s,
                "slack": "one step's overrun of its expected cost, plus writing the plan and "
                "report",
            },
            "tuning_wall_s": costs.elapsed(),
            "target": cfg.train.target,
            "metric": cfg.train.metric,
            "num_learners": fixed.num_learners,
            "num_processes": fixed.num_processes if cfg.runtime == "dist" else None,
            "network": None if fixed.network is None else dataclasses.asdict(fixed.network),
            "device_profile": {
                "seconds_per_batch": cfg.cluster.seconds_per_batch,
                "seconds_per_sample": cfg.cluster.seconds_per_sample,
            },
            "noise_scale": st.noise_scale,
            "chosen": dataclasses.asdict(chosen),
            "chosen_label": chosen.label(),
            "plan_name": plan.name,
            "plan_schedule": dataclasses.asdict(plan.schedule),
            "steady_state": None if st.steady is None else st.steady.label(),
            "prediction": st.prediction,
            "segments": [r.to_json() for r in st.plan_runs],
            "long_run": (
                None
                if st.long_run is None
                else {**st.long_run.result.to_json(), "summary": st.long_run.summary}
            ),
            "step_at": st.step_at,
            "step_runs": st.step_runs,
            "probes": [r.to_json() for r in self.search.results],
            "best_by_g": {str(g): r.candidate.label() for g, r in self.search.best_by_g.items()},
            "ranking": [{"label": c.label(), "predicted_relative": t} for t, c in st.ranked],
            "extrapolation": st.extrapolation,
            "decisions": len(self.log.entries),
        }
