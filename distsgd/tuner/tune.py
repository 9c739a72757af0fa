"""``distsgd tune``: find the configuration that reaches the target accuracy soonest.

Phases (SPEC.md §3; every decision goes to ``decisions.jsonl`` with its reason):

1. fix the device profile once (calibrated on this machine unless the config gives it),
   so every probe runs on the same simulated cluster; on real processes (``--runtime
   dist``) also measure the network (:func:`~distsgd.runtime.netcal.calibrate_network`),
   so the cluster model predicts the wall seconds per iteration of unprobed layouts;
2. Omnivore's cold start from the initial weights (:class:`OmnivoreSearch`);
3. the joint search beyond Omnivore: the performance model ranks unprobed protocol
   families, layouts and batch sizes, the best ``tune.extra_probes`` are probed;
4. the long run of the best configuration ("segment") until the target accuracy or its
   share of the budget, which gives the snapshot for steady state and the loss curve and
   evaluation points the statistical-efficiency fit needs;
5. Omnivore's steady state from that snapshot;
6. the plan (``plan.toml``, a config ``distsgd train`` accepts as is), its predicted time
   to accuracy ``HE · SE``, the report; with ``verify`` the plan is trained and its
   measured time to accuracy added.

Budget B = ``tune.budget_s`` (every phase decision is a method of
:class:`~distsgd.tuner.budget.TuneBudget`): the cold start and joint search end at
``(1 − segment_fraction − 0.15)·B``; the first long run gets what is left less a reserve of
``(0.15 + 0.4·segment_fraction)·B`` for the later phases (all that is left if the reserve
leaves it less than one probe's training); steady state ``0.15·B`` from its start; the
second long run the rest; every phase ends at B at the latest, and a phase that finishes
early leaves its time to the next. A step starts only if its expected wall cost fits, so
the tune ends within the budget plus one step's overrun and the report; a budget below the
setup and one probe is refused.

Runtimes. ``sim``: probes are equal in *simulated* time (``tune.probe_seconds`` on the
virtual clock) and every time is simulated seconds. ``dist`` (N processes,
``dist.num_processes`` or what the base protocol needs): probes are ordinary dist
trainings of ``tune.probe_seconds`` wall seconds of training (:class:`Prober`), the
candidates are the layouts that fit N processes (hardsync on N learners, SMA on N devices,
compute groups and n-softsync on N − ``dist.num_servers`` learners), HE is measured in wall
seconds (the model's, scaled by measured / predicted, for unprobed layouts), so the
prediction and ``verify`` compare wall seconds with wall seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from distsgd.config import (
    TUNE_STEADY_SHARE,
    ConfigError,
    RunConfig,
    TuneConfig,
    required_processes,
)
from distsgd.data import load_dataset
from distsgd.engine import GradientEngine
from distsgd.models import build_model
from distsgd.runtime.netcal import calibrate_network
from distsgd.runtime.sim import calibrate
from distsgd.tuner import perf_model as pm
from distsgd.tuner.budget import TuneBudget, first_probe_estimate
from distsgd.tuner.omnivore import (
    Candidate,
    DecisionLog,
    OmnivoreSearch,
    ProbeResult,
    he_scales,
    joint_candidates,
    pick_best,
    rank_candidates,
)
from distsgd.tuner.probes import Prober, candidate_config, check_runtime

__all__ = ["tune", "tune_layout", "parse_budget", "predict_plan", "verify_plan"]

_STEADY_SHARE = TUNE_STEADY_SHARE
_PLAN_EVAL_EVERY = 5000
_MIN_EVALS = 4  # evaluations of the long runs a prediction needs
_MAX_EXTRAPOLATION = 10.0  # a prediction beyond this many times the long runs' seconds: none


def parse_budget(text: str) -> float:
    """Seconds in a budget like ``90s``, ``10m``, ``1h`` or ``45`` (seconds).

    Raises:
        ConfigError: anything else, or a budget that is not > 0 and at most 7 days.
    """
    t = str(text).strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}
    unit = t[-1:] if t[-1:] in scale else "s"
    num = t[:-1] if t[-1:] in scale else t
    try:
        value = float(num) * scale[unit]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or value > 7 * 24 * 3600:
        raise ConfigError(
            f"--budget {text!r} is not allowed: expected a duration > 0 and at most 168h, "
            "such as 90s, 10m or 1h"
        )
    return value


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
            raise ConfigError(
                f"dist.num_processes = {num_processes} is not allowed for distsgd tune: "
                f"expected at most {cores} (the CPU cores of this machine; 0 = what the "
                "protocol needs)"
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


def _fixed_profile(
    cfg: RunConfig, num_processes: int = 1
) -> tuple[RunConfig, torch.Tensor, int, dict[str, float]]:
    """Calibrate once (if needed) and make the seeded initial weights ``[P]``; also time
    loading the data (``build_s``) and one evaluation on the test set (``eval_s``), wall
    seconds, for the budget (:mod:`distsgd.tuner.budget`). The device is timed with the
    torch threads of one of ``num_processes`` processes sharing this machine
    (``train.num_threads`` if set)."""
    torch.set_num_threads(
        cfg.train.num_threads or max(1, (os.cpu_count() or 1) // max(num_processes, 1))
    )
    torch.manual_seed(cfg.train.seed)
    t0 = time.perf_counter()
    ds = load_dataset(cfg.data, seed=cfg.train.seed)
    build_s = time.perf_counter() - t0
    if cfg.cluster.needs_calibration:
        prof = calibrate(
            GradientEngine(build_model(cfg.model.name, ds.input_shape, ds.num_classes)), ds
        )
        cfg = cfg.replace(
            cluster=dataclasses.replace(
                cfg.cluster,
                seconds_per_sample=prof.seconds_per_sample,
                seconds_per_batch=prof.seconds_per_batch,
            )
        )
    torch.manual_seed(cfg.train.seed)  # the same initial weights as distsgd train
    t0 = time.perf_counter()
    engine = GradientEngine(build_model(cfg.model.name, ds.input_shape, ds.num_classes))
    build_s += time.perf_counter() - t0
    initial = engine.initial_weights()
    # one evaluation, timed on a part of the test set and scaled to all of it
    n = min(ds.num_test, 2 * cfg.train.eval_batch_size)
    t0 = time.perf_counter()
    engine.evaluate(initial, ds.test_x[:n], ds.test_y[:n], cfg.train.eval_batch_size)
    timings = {"build_s": build_s, "eval_s": (time.perf_counter() - t0) * ds.num_test / n}
    return cfg, initial, engine.num_parameters, timings


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
    )


def _binned(x: list[float], y: list[float], bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Mean of y over ``bins`` equal runs of consecutive points (smooths tick noise)."""
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if xa.size <= bins:
        return xa, ya
    idx = np.array_split(np.arange(xa.size), bins)
    return np.array([xa[i].mean() for i in idx]), np.array([ya[i].mean() for i in idx])


def predict_plan(segments: list[ProbeResult], target_accuracy: float) -> dict[str, Any]:
    """Predicted time to accuracy of the plan from scratch: HE · SE.

    ``segments`` are the long runs in order (the first from the initial weights, each next
    one from the previous one's snapshot, possibly at a lower η). HE: their measured
    seconds per iteration (total seconds / total iterations). SE: the iterations of every
    segment but the last, plus the iterations until the last segment's fitted loss curve
    (:func:`~distsgd.tuner.perf_model.fit_loss_curve` on its tick losses, iterations
    counted from its start) reaches the target loss. :func:`fit_error_vs_loss` maps the
    target accuracy to that loss from every segment's evaluation points, each taken as
    (its own fitted curve's loss at the evaluation, accuracy), which removes the lag of
    interval-mean training losses.

    No prediction (with its ``reason``) when the long runs made fewer than 4 evaluations,
    when the target maps to a loss <= 0, when the curve levels off above the target loss,
    or when the prediction exceeds 10× the seconds the long runs measured (extrapolated
    that far the fit says little; the figure is kept as ``extrapolated_s``).

    Returns:
        dict with ``seconds_per_iteration``, ``iterations_to_target``, ``target_loss``,
        ``curve`` (of the last segment: L_inf, A, beta, rmse), ``predicted_s``; values are
        NaN/inf when the data do not determine them.
    """
    iters = sum(s.iterations[-1] for s in segments if s.iterations)
    secs = sum(s.virtual_s[-1] for s in segments if s.virtual_s)
    he = secs / iters if iters else math.nan
    out: dict[str, Any] = {
        "seconds_per_iteration": he,
        "iterations_to_target": math.nan,
        "target_loss": math.nan,
        "curve": None,
        "predicted_s": math.nan,
        "segments": len(segments),
    }
    curves = []
    for seg in segments:
        if seg.diverged or len(seg.losses) < 3:
            curves.append(None)
            continue
        xs, ys = _binned(seg.iterations, seg.losses)
        curves.append(pm.fit_loss_curve(xs, ys))
    while len(curves) > 1 and curves[-1] is None:  # a last run too short to fit
        curves.pop()
        segments = segments[:-1]
    last = curves[-1] if curves else None
    if last is None:
        return out
    out["curve"] = dataclasses.asdict(last)
    pts = [
        (float(curve(e["iterations"])), e["test_accuracy"])
        for seg, curve in zip(segments, curves, strict=True)
        if curve is not None
        for e in seg.evals
        if e.get("iterations", 0) > 0
    ]
    if len(pts) < _MIN_EVALS:
        out["reason"] = (
            f"the long run(s) made {len(pts)} evaluation(s), fewer than {_MIN_EVALS}: too few "
            "to map the target accuracy to a training loss (give a larger --budget)"
        )
        return out
    try:
        ev = pm.fit_error_vs_loss(np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    except ValueError:
        return out
    target_loss = ev.target_loss(target_accuracy)
    if not target_loss > 0:  # cross-entropy is positive: the linear map does not hold there
        out.update(
            target_loss=target_loss,
            reason=f"the evaluation points map the target accuracy to a training loss of "
            f"{target_loss:.4f} <= 0: the long run ended too far from the target to "
            "extrapolate (give a larger --budget)",
        )
        return out
    before = sum(s.iterations[-1] for s in segments[:-1] if s.iterations)
    se = before + pm.iterations_to_loss(last, target_loss)
    if not math.isfinite(se):
        out["reason"] = (
            f"the fitted loss curve levels off at {last.L_inf:.4f}, above the target loss "
            f"{target_loss:.4f} (give a larger --budget)"
        )
    predicted = pm.time_to_accuracy(he, se)
    if math.isfinite(predicted) and predicted > _MAX_EXTRAPOLATION * secs:
        out.update(
            target_loss=target_loss,
            error_vs_loss={"e0": ev.e0, "s": ev.s},
            extrapolated_s=predicted,
            reason=f"the fitted curve reaches the target loss {target_loss:.4f} after "
            f"{predicted:.4g} s, more than {_MAX_EXTRAPOLATION:g}× the {secs:.4g} s the long "
            "run(s) measured: too far to extrapolate (give a larger --budget)",
        )
        return out
    out.update(
        target_loss=target_loss,
        iterations_to_target=se,
        predicted_s=predicted,
        error_vs_loss={"e0": ev.e0, "s": ev.s},
    )
    return out


def step_pool(evals: list[dict[str, Any]], target_accuracy: float) -> list[dict[str, Any]]:
    """Every evaluation a step may start from, in order: after some training and before
    the first that reached ``target_accuracy`` (all of them if none did)."""
    pool = []
    for e in evals:
        if e.get("samples", 0) <= 0:
            continue
        if e["test_accuracy"] >= target_accuracy:
            break
        pool.append(e)
    return pool


def step_points(
    evals: list[dict[str, Any]],
    target_accuracy: float,
    margin: float,
    count: int,
    include_last: bool = False,
) -> list[dict[str, Any]]:
    """The evaluations of a long run from which the tuner tries a learning-rate step,
    latest first.

    Qualify: evaluations after some training (``samples > 0``) before the first one that
    reached ``target_accuracy``, with test accuracy >= ``target_accuracy − margin``. Of
    these, ``count`` spread evenly from the last qualifying one back to the first (one:
    the last). With ``include_last`` (a long run that stopped before the target) its last
    evaluation is always among them, qualifying or not: Omnivore's steady state steps
    there.

    Args:
        evals: the run's ``metrics.jsonl`` records in order (``eval``, ``samples``,
            ``test_accuracy``, …).
        target_accuracy: the target, in [0, 1].
        margin: accuracy below the target that still qualifies, in (0, 1).
        count: at most this many points (0: only the forced last one).

    Returns:
        The chosen records, latest first.
    """
    before = step_pool(evals, target_accuracy)
    ok = [e for e in before if e["test_accuracy"] >= target_accuracy - margin]
    last = before[-1] if include_last and before else None
    n = count
    if last is not None:
        ok = [e for e in ok if e is not last]
        n = max(count - 1, 0)
    if len(ok) > n:  # n evenly spread, the last qualifying one always among them
        idx = sorted({round(i) for i in np.linspace(len(ok) - 1, 0, n)}) if n else []
        ok = [ok[i] for i in idx]
    if last is not None:
        ok.append(last)
    return list(reversed(ok))


def plan_switch(
    results: list[ProbeResult], current: Candidate, snapshot: str, settings: TuneConfig
) -> Candidate:
    """The η a plan continues with when steady state recommends another μ or layout: a
    run config changes only η mid-run, so of ``current`` and ``current`` at η/10 probed
    from ``snapshot`` the better score wins (ties within ``tie_buffer`` prefer the larger
    η, as in Omnivore); ``current`` if neither was probed."""
    options = (current, dataclasses.replace(current, lr=current.lr / 10))
    probed = [r for r in results if r.snapshot == snapshot and r.candidate in options]
    best = pick_best(probed, settings.tie_buffer)
    return current if best is None else best.candidate


@dataclasses.dataclass
class StepChoice:
    """Outcome of :func:`choose_step`.

    Attributes:
        point: the long run's evaluation record the plan steps at (None: no step).
        seconds: time to accuracy of the plan stepping there (long run up to the point plus
            the run from it), on the runtime's clock; without a step, the long run's own
            (inf if it stopped before the target).
        run: the run from ``point`` (None without a step).
        runs: one record per run tried (``eval``, ``epoch``, ``accuracy``, ``clock_s``,
            ``reached``, ``time_to_accuracy_s``, ``best_accuracy``, ``run_dir``).
    """

    point: dict[str, Any] | None
    seconds: float
    run: ProbeResult | None
    runs: list[dict[str, Any]]


def choose_step(
    points: list[dict[str, Any]],
    long_run_s: float,
    clock_key: str,
    tta_key: str,
    run_step: Callable[[dict[str, Any], float], tuple[ProbeResult, dict[str, Any]] | None],
    log: DecisionLog,
    clock: str = "simulated",
    long_run_reached: bool = True,
    pool: list[dict[str, Any]] | None = None,
    tie_buffer: float = 0.01,
) -> StepChoice:
    """Where the plan steps its learning rate: the point whose run reaches the target
    soonest (beyond Omnivore, whose steady state steps wherever the long run ended).

    For each point (latest first), ``run_step(point, horizon)`` trains the lower η from the
    point's snapshot until the target or ``horizon`` seconds on the runtime's clock (the
    soonest time to accuracy so far minus the point's time: a run that cannot beat it is
    cut there; inf while nothing reached the target); it returns the run and its summary,
    or None when the budget allows no more runs. A point whose horizon is <= 0 is skipped.
    The time to accuracy of a step at the point = the point's ``clock_key`` + the run's
    ``tta_key``.

    Then, with ``pool`` (:func:`step_pool`), the search refines around the soonest step
    while the budget lasts: it tries the evaluations of ``pool`` midway between the
    soonest step and its nearest tried neighbour on each side (the pool's ends count as
    neighbours), later one first, and repeats until no untried evaluation lies midway —
    a bisection over the pool, so about 2·log2(len(pool)) more runs at most.

    Args:
        points: :func:`step_points`, latest first.
        long_run_s: the long run's own time to accuracy (inf if it stopped before).
        clock_key: the records' clock (``virtual_s`` or ``wall_s``).
        tta_key: the summaries' time to accuracy on that clock.
        long_run_reached: whether the long run reached the target (only for the log).
        pool: the evaluations the refinement may try (None: no refinement).
        tie_buffer: a step replaces the soonest so far only if it is sooner by more than
            this fraction (Omnivore's 1% tie buffer): a tie keeps the step found first, or
            no step.

    No run reached the target sooner: no step (``point`` None) — a step the tuner did not
    see reach the target is not planned, even where steady state chose the lower η.
    """
    best_s = long_run_s
    best: dict[str, Any] | None = None
    best_run: ProbeResult | None = None
    runs: list[dict[str, Any]] = []
    tried: set[int] = set()

    def attempt(point: dict[str, Any], why: str) -> bool:
        """Run from ``point``; False when the budget allows no more runs."""
        nonlocal best_s, best, best_run
        tried.add(int(point["eval"]))
        horizon = best_s - float(point[clock_key])
        if horizon <= 0:
            log(
                "step",
                f"skip the step at epoch {point['epoch']:.3f}",
                f"the soonest time to accuracy so far ({best_s:.4g} {clock} s) comes before it",
            )
            return True
        out = run_step(point, horizon)
        if out is None:
            return False
        run, summary = out
        reached = bool(summary.get("reached")) and summary.get(tta_key) is not None
        chain = float(point[clock_key]) + float(summary[tta_key]) if reached else math.inf
        runs.append(
            {
                "eval": point["eval"],
                "epoch": point["epoch"],
                "accuracy": point["test_accuracy"],
                "clock_s": point[clock_key],
                "why": why,
                "reached": reached,
                "time_to_accuracy_s": chain if reached else None,
                "best_accuracy": summary.get("best_accuracy"),
                "run_dir": run.run_dir,
                "evals": [
                    {"clock_s": e.get(clock_key), "test_accuracy": e.get("test_accuracy")}
                    for e in run.evals
                ],
            }
        )
        at = f"step at epoch {point['epoch']:.3f}"
        if chain < best_s * (1 - tie_buffer):
            log(
                "step",
                f"{at} reaches the target after {chain:.4g} {clock} s",
                "the soonest so far"
                + (f" (before: {best_s:.4g} s)" if math.isfinite(best_s) else ""),
            )
            best_s, best, best_run = chain, point, run
        else:
            log(
                "step",
                at
                + (
                    f" reached the target after {chain:.4g} {clock} s"
                    if reached
                    else " did not reach the target within its limit"
                )
                + f" (best accuracy {summary.get('best_accuracy') or 0:.4f})",
                f"not sooner than {best_s:.4g} {clock} s"
                if math.isfinite(best_s)
                else "no time to accuracy",
            )
        return True

    budget_left = True
    for point in points:
        if not attempt(point, "spread over the qualifying evaluations"):
            budget_left = False
            break
    while budget_left and pool and best is not None:
        ids = [int(e["eval"]) for e in pool]
        if int(best["eval"]) not in ids:
            break
        i = ids.index(int(best["eval"]))
        done = [j for j, e in enumerate(ids) if e in tried]
        lo = max((j for j in done if j < i), default=-1)
        hi = min((j for j in done if j > i), default=len(pool))
        mids = [m for m in ((i + hi) // 2, (lo + i + 1) // 2) if m != i and ids[m] not in tried]
        if not mids:
            break
        for m in mids:  # the later one first
            why = f"midway between the soonest step (epoch {best['epoch']:.3f}) and its " + (
                "next tried point" if m > i else "previous tried point (or the start)"
            )
            log("step", f"refine: try epoch {pool[m]['epoch']:.3f}", why)
            if not attempt(pool[m], why):
                budget_left = False
                break
    if best is None and runs:
        log(
            "step",
            "no step",
            "no run at the lower η reached the target "
            + ("sooner than the long run" if long_run_reached else "within its limit")
            + ": a step the tuner did not see reach the target is not planned",
        )
    return StepChoice(best, best_s if best is not None else long_run_s, best_run, runs)


def _truncate(run: ProbeResult, iterations: int) -> ProbeResult:
    """``run`` up to ``iterations`` (its ticks and evaluations at or before it)."""
    keep = [i for i, it in enumerate(run.iterations) if it <= iterations]
    return dataclasses.replace(
        run,
        iterations=[run.iterations[i] for i in keep],
        virtual_s=[run.virtual_s[i] for i in keep],
        losses=[run.losses[i] for i in keep],
        evals=[e for e in run.evals if e.get("iterations", 0) <= iterations],
        notes=list(run.notes),
    )


def _plan_config(
    base: RunConfig, cand: Candidate, steady: Candidate | None, seg_epochs: float, log: DecisionLog
) -> RunConfig:
    cfg = candidate_config(base, cand)
    schedule = dataclasses.replace(base.schedule, kind="constant", warmup_epochs=0.0)
    if steady is not None and steady != cand:
        same_shape = dataclasses.replace(steady, lr=cand.lr) == cand
        if same_shape and steady.lr < cand.lr and seg_epochs > 0:
            schedule = dataclasses.replace(
                schedule,
                kind="step",
                decay_epochs=[round(seg_epochs, 4)],
                decay_factor=float(f"{steady.lr / cand.lr:.6g}"),  # 0.1, not 0.0999…
            )
            log(
                "plan",
                f"step η {cand.lr:g} → {steady.lr:g} at epoch {seg_epochs:.3f}",
                "the run at the lower η from that evaluation's snapshot reached the target soonest",
            )
        else:
            log(
                "plan",
                f"keep {cand.label()} for the whole run",
                f"steady state recommends {steady.label()} after epoch {seg_epochs:.3f}; "
                "a run config holds one layout and momentum, so the plan keeps the first phase",
            )
    t = base.train
    train = dataclasses.replace(
        t,
        stop_at_target=True,
        max_seconds=0.0,
        max_virtual_seconds=0.0,
        max_epochs=t.max_epochs or 10.0,
        eval_every_samples=min(t.eval_every_samples or _PLAN_EVAL_EVERY, _PLAN_EVAL_EVERY),
    )
    name = f"tuned {cand.shape()} η={cand.lr:g} μ={cand.momentum:g}"
    if schedule.kind == "step":
        name += f" (η×{schedule.decay_factor:g} at epoch {schedule.decay_epochs[0]:g})"
    return cfg.replace(name=name, schedule=schedule, train=train)


def verify_plan(tune_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Train ``tune_dir/plan.toml`` into ``tune_dir/verify`` and add the measured time to
    accuracy next to the prediction in ``tune.json`` and the report.

    Raises:
        ConfigError: no plan in ``tune_dir``, or ``verify/`` already holds a run.
    """
    from distsgd.trainer import Trainer
    from distsgd.tuner.report import write_report

    tune_dir = Path(tune_dir)
    plan = tune_dir / "plan.toml"
    if not plan.exists():
        raise ConfigError(f"{plan} does not exist: run distsgd tune first")
    cfg = RunConfig.from_toml(plan)
    if cfg.runtime == "dist":
        from distsgd.runtime.launch import run

        summary = run(cfg, tune_dir / "verify", progress=progress)
    else:
        summary = Trainer(cfg, tune_dir / "verify", progress=progress).run()
    state = json.loads((tune_dir / "tune.json").read_text())
    key = "time_to_accuracy_virtual_s" if cfg.runtime == "sim" else "time_to_accuracy_s"
    measured = summary.get(key)
    pred = state["prediction"]["predicted_s"]
    state["verify"] = {
        "run_dir": str(tune_dir / "verify"),
        "reached": summary["reached"],
        "measured_s": measured,
        "measured_wall_s": summary.get("time_to_accuracy_s"),
        "measured_iterations": None,
        "samples_to_accuracy": summary.get("samples_to_accuracy"),
        "ratio_predicted_to_measured": (
            pred / measured if measured and pred and math.isfinite(pred) else None
        ),
    }
    recs = [json.loads(x) for x in (tune_dir / "verify" / "metrics.jsonl").read_text().splitlines()]
    hit = [r for r in recs if r["test_accuracy"] >= cfg.train.target_accuracy]
    if hit:
        state["verify"]["measured_iterations"] = hit[0]["iterations"]
    (tune_dir / "tune.json").write_text(json.dumps(state, indent=1, default=_json_default))
    write_report(tune_dir, state)
    return state


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, np.floating | np.integer):
        return o.item()
    return str(o)


def _clean(o: Any) -> Any:
    """NaN/inf → None (strict JSON), numpy scalars → Python."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    if isinstance(o, np.floating | np.integer):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def tune(
    config: RunConfig,
    out_dir: str | Path,
    *,
    budget_s: float | None = None,
    progress: bool = True,
    verify: bool = False,
) -> dict[str, Any]:
    """Run the search and write the tune directory; returns the state saved in ``tune.json``.

    Args:
        config: base config: model, data, target accuracy, the cluster (``protocol.
            num_learners`` = λ devices, ``protocol.batch_size`` = b of the cold start),
            ``[tune]`` settings.
        out_dir: the tune directory (created; must not hold a tune already).
        budget_s: overrides ``tune.budget_s`` (wall seconds).
        progress: show a progress bar over the budget and one line per decision.
        verify: train the plan afterwards and add the measured point (:func:`verify_plan`).

    Writes ``plan.toml``, ``report.md`` and figures, ``decisions.jsonl``, ``tune.json``,
    ``probes/`` (one run directory per probe and the segment).

    Raises:
        ConfigError: bad settings (including ``dist.num_processes`` above this machine's
            CPU cores and ``tune.families`` the layouts cannot probe, see
            :func:`tune_layout`), an unavailable runtime, an ``out_dir`` that is a file or
            holds a tune, a budget below the setup and one probe, or a cold start in which
            every probe diverged.
        DistRunFailed: (``dist`` runtime) a probe or long run lost a process before it
            completed (:mod:`distsgd.runtime.launch`).
        KeyboardInterrupt: Ctrl-C; the probes' run directories and ``decisions.jsonl``
            written so far stay in ``out_dir``, no plan is written.
    """
    from distsgd.tuner.report import write_report

    check_runtime(config.runtime)
    settings = config.tune
    if budget_s is not None:
        settings = dataclasses.replace(settings, budget_s=budget_s)
        config = config.replace(tune=settings)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file: expected a directory (new or empty)")
    if (out / "plan.toml").exists() or (out / "decisions.jsonl").exists():
        raise ConfigError(
            f"output directory {str(out)!r} already holds a tune; choose another --out"
        )
    t0 = time.perf_counter()
    budget = settings.budget_s
    num_processes, lam, ps_lam = tune_layout(config)
    cfg, initial, num_params, timings = _fixed_profile(config, num_processes)
    network = None
    if cfg.runtime == "dist":
        t1 = time.perf_counter()
        network = calibrate_network(num_params, repeats=10)
        timings["build_s"] += time.perf_counter() - t1  # a dist run starts processes too
        cfg = cfg.replace(
            cluster=dataclasses.replace(
                cfg.cluster,
                latency_s=network.latency_s,
                bandwidth_gbps=network.bandwidth_gbps,
                jitter=0.0,
            )
        )
    cluster = cluster_model(cfg, num_params)
    first = Candidate("hardsync", lam, cfg.protocol.batch_size, 0.1, 0.0)
    wall_per_clock = 1.0
    if cfg.runtime == "sim":  # the simulation computes every learner in this one process
        wall_per_clock = pm.compute_seconds(
            pm.samples_per_iteration(first.layout()), cluster
        ) / pm.seconds_per_iteration(first.layout(), cluster)
    costs = TuneBudget(
        budget,
        settings.segment_fraction,
        _STEADY_SHARE,
        first_probe_estimate(settings.probe_seconds, wall_per_clock, timings["build_s"]),
        timings["eval_s"],
        start=t0,
    )
    if costs.minimum_s() > budget:
        raise ConfigError(
            f"--budget {budget:g}s is not allowed for this config: expected at least "
            f"{math.ceil(costs.minimum_s())}s (the setup took {costs.elapsed():.1f} s and "
            f"one probe of {settings.probe_seconds:g} s is expected to take "
            f"{costs.first_probe_s:.1f} s wall)"
        )
    out.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no directory
    bar = tqdm(
        total=round(budget),
        unit="s",
        desc="tune",
        disable=not progress,
        dynamic_ncols=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s budget {postfix}",
    )
    log = DecisionLog(out / "decisions.jsonl", echo=tqdm.write if progress else None)
    c = cfg.cluster
    if cfg.runtime == "dist":
        log(
            "setup",
            f"probes on {num_processes} real processes (dist runtime, wall clock): hardsync "
            f"and SMA on λ = {lam} learners (devices), the parameter-server layouts on "
            f"λ = {ps_lam} learners and {cfg.dist.num_servers} server rank(s)",
            "candidates are limited to layouts that fit the processes",
        )
        assert network is not None
        log(
            "setup",
            f"cluster model of this machine: device {c.seconds_per_batch * 1e3:.3f} ms/batch "
            f"+ {c.seconds_per_sample * 1e6:.1f} µs/sample, network latency "
            f"{network.latency_s * 1e6:.1f} µs, bandwidth {network.bandwidth_gbps:.3f} Gbit/s",
            (
                "device calibrated with one process's threads"
                if config.cluster.needs_calibration
                else "device profile given by the config"
            )
            + "; network measured between two gloo processes (netcal); it predicts the "
            "wall seconds per iteration of unprobed configurations (no jitter term), scaled "
            "by measured / predicted of the probed ones",
        )
    else:
        log(
            "setup",
            f"device profile {c.seconds_per_batch * 1e3:.3f} ms/batch + "
            f"{c.seconds_per_sample * 1e6:.1f} µs/sample, λ = {cfg.protocol.num_learners}",
            "calibrated once on this machine so every probe runs on the same simulated cluster"
            if config.cluster.needs_calibration
            else "given by the config",
        )
    prober = Prober(cfg, out, settings.probe_seconds, settings.score_window, initial)
    clock = "simulated" if prober.simulated else "wall"

    def elapsed() -> float:
        return costs.elapsed()

    def tick_bar(phase: str, extra: str = "") -> None:
        bar.n = min(round(elapsed()), bar.total)
        bar.set_postfix_str(f"{phase} {extra}".strip(), refresh=True)

    def probe(cand: Candidate, snapshot: str) -> ProbeResult:
        tick_bar("probe", cand.label())
        r = prober(cand, snapshot)
        costs.record_probe(r.wall_s, r.train_wall_s)
        for note in r.notes:
            log("probe", f"note on {cand.label()}", note)
        tick_bar("probe", cand.label())
        return r

    search_end = costs.search_end
    search = OmnivoreSearch(
        probe,
        settings,
        lam,
        cfg.protocol.batch_size,
        log,
        ps_learners=ps_lam,
        # the first probe may use the whole budget (a plan needs one), the others must be
        # expected to end within the search's share
        out_of_budget=lambda: not costs.may_search_probe(bool(search.results)),
    )
    log(
        "setup",
        f"probes of {settings.probe_seconds:g} {clock} seconds each",
        "equal-time probes from the same snapshot fold hardware and statistical efficiency "
        "into one score (Omnivore)",
    )
    log(
        "setup",
        f"budget {budget:g} s wall; a step starts only if its expected cost fits in the "
        "time left to its phase",
        f"setup took {costs.elapsed():.1f} s; first probe expected to take "
        f"{costs.first_probe_s:.1f} s wall, later ones as long as the longest so far; "
        f"one evaluation {timings['eval_s']:.2f} s. Slack: one step's overrun of its "
        "expected cost, plus writing the plan and report",
    )
    best = search.cold_start("initial")
    if best is None:
        raise ConfigError(
            "tune.lrs = "
            f"{settings.lrs!r} is not allowed: every cold-start probe diverged or none ran; "
            "expected smaller learning rates or a larger budget"
        )
    chosen = best

    # ---- beyond Omnivore: joint search ranked by the performance model ----------------
    ref = chosen.candidate
    b_ref = pm.samples_per_iteration(ref.layout())
    noise = settings.noise_scale or float(b_ref)
    ranked: list[tuple[float, Candidate]] = []
    if settings.extra_probes > 0:
        cands = joint_candidates(search, ref, settings)
        scales = he_scales(search.results, cluster) if not prober.simulated else None
        ranked = rank_candidates(cands, ref, 1.0, cluster, noise, he_scale=scales)
        ref_time = pm.seconds_per_iteration(ref.layout(), cluster)
        log(
            "joint",
            f"ranked {len(ranked)} unprobed configurations by predicted time to accuracy",
            f"HE from the cluster model × SE carried from {ref.shape()} with the batch-size "
            f"law, B_noise = {noise:g} samples"
            + (" (tune.noise_scale)" if settings.noise_scale else " (= its samples per iteration)"),
            ranking=[{"label": c.label(), "relative_time": t / ref_time} for t, c in ranked[:10]],
        )
        extra: list[ProbeResult] = []
        for t_pred, cand in ranked[: settings.extra_probes]:
            if not costs.may_search_probe(True):
                log(
                    "joint",
                    f"skip {cand.label()}",
                    f"search budget spent: a probe is expected to take "
                    f"{costs.expected_probe_s():.1f} s, {max(costs.left(search_end), 0):.1f} s "
                    "left to the search",
                )
                continue
            log(
                "joint",
                f"probe {cand.label()}",
                f"predicted {t_pred / ref_time:.2f}× the time of {ref.shape()}",
            )
            r = probe(cand, "initial")
            search.results.append(r)
            extra.append(r)
            log(
                "joint",
                f"probed {cand.label()}: " + ("NaN" if r.diverged else f"score {r.score:.4f}"),
                f"equal-time score against {chosen.score:.4f} for {ref.label()}",
                score=None if r.diverged else r.score,
            )
        better = pick_best(extra, settings.tie_buffer)
        if better is not None and better.score < chosen.score * (1 - settings.tie_buffer):
            log(
                "joint",
                f"choose {better.candidate.label()}",
                f"its score {better.score:.4f} beats {chosen.score:.4f} by more than "
                f"{100 * settings.tie_buffer:g}%",
            )
            chosen = better
        else:
            log(
                "joint",
                f"keep {chosen.candidate.label()}",
                "no configuration of the joint search beat its equal-time score by more than "
                f"{100 * settings.tie_buffer:g}%",
            )

    # ---- the long run of the best configuration ---------------------------------------
    eval_every = min(cfg.train.eval_every_samples or _PLAN_EVAL_EVERY, _PLAN_EVAL_EVERY)
    rate = chosen.samples / chosen.train_wall_s if chosen.train_wall_s > 0 else math.nan
    seg_wall = costs.first_segment_seconds(rate, eval_every)
    segments: list[ProbeResult] = []
    summaries: list[dict[str, Any]] = []
    seg_epochs = 0.0
    seg_summary: dict[str, Any] = {}
    if seg_wall <= 0:
        log(
            "segment",
            "skipped the long run",
            f"{max(costs.left(), 0):.1f} s of the budget left, less than a run of one probe's "
            "training plus its build and evaluations; the plan is the cold start's choice "
            "without a predicted time to accuracy",
        )
    else:
        log(
            "segment",
            f"train {chosen.candidate.label()} from the initial weights",
            f"until {100 * cfg.train.target_accuracy:g}% test accuracy or {seg_wall:.1f} wall "
            f"seconds of training, evaluating every {eval_every} samples (Omnivore's long "
            "run; it gives the steady-state snapshot and the loss curve for the SE fit; its "
            "length is what the budget leaves after its evaluations and the later phases)",
        )
        tick_bar("segment", chosen.candidate.label())
        segment, seg_summary = prober.segment(
            chosen.candidate, seg_wall, eval_every, "segment", save_eval_weights=True
        )
        tick_bar("segment")
        seg_epochs = float(seg_summary.get("epochs", 0.0) or 0.0)
        log(
            "segment",
            "reached the target" if seg_summary.get("reached") else "stopped before the target",
            f"best accuracy {seg_summary.get('best_accuracy', 0):.4f} after {seg_epochs:.3f} "
            f"epochs, {seg_summary.get('virtual_s', 0):.2f} {clock} s, "
            f"{seg_summary.get('train_wall_s', 0):.1f} wall s of training",
        )
        segments.append(segment)
        summaries.append(seg_summary)

    # ---- steady state, the step and the run after it ------------------------------------
    steady: Candidate | None = None
    switch: Candidate | None = None
    step_at: dict[str, Any] | None = None  # the long run's evaluation the plan steps at
    step_runs: list[dict[str, Any]] = []
    plan_segments = list(segments)
    measured_chain: float | None = None
    clock_key = "virtual_s" if prober.simulated else "wall_s"
    tta_key = "time_to_accuracy_virtual_s" if prober.simulated else "time_to_accuracy_s"
    if not segments:
        log("steady state", "skipped", "no long run; no snapshot")
    elif segments[0].diverged:
        log("steady state", "skipped", "the long run diverged; no snapshot")
    else:
        seg = segments[0]
        reached = bool(seg_summary.get("reached"))
        best_s = float(seg_summary.get(tta_key) or math.inf) if reached else math.inf
        if reached:
            measured_chain = best_s
            switch = dataclasses.replace(chosen.candidate, lr=chosen.candidate.lr / 10)
            log(
                "steady state",
                f"skipped; try {switch.label()} from earlier snapshots",
                f"the long run reached the target after {best_s:.2f} {clock} s; a step to "
                "η/10 (the lower η of Omnivore's steady-state grid) at an earlier evaluation "
                "may reach it sooner",
            )
        else:
            steady_end = costs.steady_end()
            search.out_of_budget = lambda: not costs.may_probe(steady_end)
            steady = search.steady_state(chosen.candidate, "segment")
            switch = steady
            if dataclasses.replace(steady, lr=chosen.candidate.lr) != chosen.candidate:
                switch = plan_switch(search.results, chosen.candidate, "segment", settings)
                log(
                    "steady state",
                    f"continue with {switch.label()}",
                    f"steady state recommends {steady.label()}; a run config can change only "
                    "η mid-run (a step of the schedule), so the family, layout and μ stay and "
                    f"η is the better of η and η/10 at μ = {chosen.candidate.momentum:g} from "
                    "the same snapshot",
                )
        seg_rate = seg.samples / seg.train_wall_s if seg.train_wall_s > 0 else rate
        max_epochs = cfg.train.max_epochs or 10.0
        if switch.lr < chosen.candidate.lr:
            points = step_points(
                seg.evals,
                cfg.train.target_accuracy,
                settings.step_margin,
                settings.step_points,
                include_last=not reached,
            )
            # a point needs epochs left to train (the long run may have stopped at
            # train.max_epochs)
            spent = [p for p in points if max_epochs - float(p["epoch"]) < 0.01]
            if spent:
                log(
                    "step",
                    f"skip the step at epoch {spent[0]['epoch']:.3f}",
                    f"train.max_epochs = {max_epochs:g} leaves no epochs to train after it",
                )
                points = [p for p in points if p not in spent]
            pool = [
                p
                for p in step_pool(seg.evals, cfg.train.target_accuracy)
                if max_epochs - float(p["epoch"]) >= 0.01
            ]
            if not points and settings.step_points == 0:
                log("step", "no step search", "tune.step_points = 0")
            elif not points and not pool:
                log(
                    "step",
                    "no step search",
                    "no evaluation of the long run came before the target with epochs left",
                )
            elif not points:
                log(
                    "step",
                    "no evaluation of the long run qualifies as a step point",
                    f"none reached {100 * (cfg.train.target_accuracy - settings.step_margin):g}"
                    "% test accuracy before the target (tune.step_margin)",
                )

            def run_step(point: dict[str, Any], horizon: float) -> tuple[ProbeResult, dict] | None:
                at = f"epoch {point['epoch']:.3f} (accuracy {point['test_accuracy']:.4f})"
                wall = costs.second_segment_seconds(seg_rate, eval_every)
                if wall <= 0:
                    log(
                        "step",
                        f"skip the step at {at}",
                        f"{max(costs.left(), 0):.1f} s of the budget left, less than a run of "
                        "one probe's training plus its build and evaluations",
                    )
                    return None
                name = f"eval{point['eval']}"
                prober.eval_snapshot(seg, int(point["eval"]), name)
                limit = (
                    f"within {horizon:.4g} {clock} s (to beat the soonest so far)"
                    if math.isfinite(horizon)
                    else f"within {wall:.1f} wall s of training"
                )
                log(
                    "step",
                    f"train {switch.label()} from the long run's {at}",
                    f"until the target {limit}: the time to accuracy of a plan stepping η "
                    f"{chosen.candidate.lr:g} → {switch.lr:g} there",
                )
                tick_bar("step", f"epoch {point['epoch']:.2f}")
                result = prober.segment(
                    switch,
                    wall,
                    eval_every,
                    f"step-{name}",
                    snapshot=name,
                    max_epochs=max_epochs - float(point["epoch"]),
                    max_clock_s=horizon if math.isfinite(horizon) else 0.0,
                )
                tick_bar("step")
                return result

            choice = choose_step(
                points,
                best_s,
                clock_key,
                tta_key,
                run_step,
                log,
                clock,
                long_run_reached=reached,
                pool=pool,
                tie_buffer=settings.tie_buffer,
            )
            step_runs = choice.runs
            if choice.point is not None:
                step_at = choice.point
                assert choice.run is not None
                plan_segments = [_truncate(seg, int(step_at["iterations"])), choice.run]
                measured_chain = choice.seconds if math.isfinite(choice.seconds) else None
        elif not reached:
            wall2 = costs.second_segment_seconds(seg_rate, eval_every)
            left = max(max_epochs - seg_epochs, 0.01)
            if wall2 <= 0:
                log(
                    "segment",
                    f"skipped the run of {switch.label()} from the long run's snapshot",
                    f"{max(costs.left(), 0):.1f} s of the budget left, less than a run of one "
                    "probe's training plus its build and evaluations",
                )
            else:
                log(
                    "segment",
                    f"train {switch.label()} from the long run's snapshot",
                    f"until the target, {left:.2f} more epochs or {wall2:.1f} wall seconds of "
                    "training (steady state keeps η; it measures the time to accuracy)",
                )
                tick_bar("segment 2", switch.label())
                seg2, sum2 = prober.segment(
                    switch, wall2, eval_every, "segment2", snapshot="segment", max_epochs=left
                )
                tick_bar("segment 2")
                plan_segments = [seg, seg2]
                log(
                    "segment",
                    "reached the target" if sum2.get("reached") else "stopped before the target",
                    f"best accuracy {sum2.get('best_accuracy', 0):.4f} after {seg_epochs:.3f} + "
                    f"{float(sum2.get('epochs', 0) or 0):.3f} epochs",
                )
                if sum2.get("reached"):
                    first_s = seg_summary.get("virtual_s" if prober.simulated else "train_wall_s")
                    measured_chain = float(first_s or 0) + float(sum2[tta_key])

    # ---- plan, prediction, report ---------------------------------------------------------
    plan = _plan_config(
        cfg,
        chosen.candidate,
        switch if step_at is not None else None,
        float(step_at["epoch"]) if step_at is not None else 0.0,
        log,
    )
    (out / "plan.toml").write_text(plan.to_toml())
    prediction = predict_plan(plan_segments, cfg.train.target_accuracy)
    prediction["tuner_measured_s"] = measured_chain
    if math.isfinite(prediction["predicted_s"]):
        log(
            "plan",
            f"plan {plan.name}: predicted time to accuracy {prediction['predicted_s']:.2f} "
            f"{clock} s",
            f"HE {prediction['seconds_per_iteration'] * 1e3:.3f} ms per iteration (measured in "
            f"the long runs) × SE {prediction['iterations_to_target']:.0f} iterations (fitted "
            f"loss curve reaching the target loss {prediction['target_loss']:.4f})",
        )
    else:
        log(
            "plan",
            f"plan {plan.name}: no prediction of the time to accuracy",
            prediction.get("reason", "too few training losses or evaluations to fit"),
        )
    # what the model expects on larger clusters (simulated runtime only)
    extrapolation = []
    se_ref = prediction["iterations_to_target"]
    if math.isfinite(se_ref) and prober.simulated:  # larger simulated clusters
        lam0 = cfg.protocol.num_learners
        b_plan = pm.samples_per_iteration(chosen.candidate.layout())
        for mult in (1, 2, 4, 8):
            lam2 = lam0 * mult
            for g in sorted({1, 2, 4, lam2 // 4, lam2} - {0}):
                if lam2 % g:
                    continue
                c2 = Candidate(
                    "hardsync" if g == 1 else "compute_groups",
                    lam2,
                    chosen.candidate.batch_size,
                    chosen.candidate.lr,
                    chosen.candidate.momentum,
                    num_groups=g,
                )
                he = pm.seconds_per_iteration(c2.layout(), cluster)
                se = pm.scale_iterations(
                    se_ref, b_plan, pm.samples_per_iteration(c2.layout()), noise
                )
                extrapolation.append(
                    {
                        "num_learners": lam2,
                        "g": g,
                        "seconds_per_iteration": he,
                        "iterations_to_target": se,
                        "predicted_s": he * se,
                    }
                )
    bar.n = min(round(elapsed()), bar.total)
    bar.close()
    state = {
        "config": str(config.name),
        "runtime": cfg.runtime,
        "clock": clock,
        "budget_s": budget,
        "budget_costs": {
            "first_probe_expected_s": costs.first_probe_s,
            "probe_wall_s_max": costs.expected_probe_s(),
            "eval_s": costs.eval_s,
            "slack": "one step's overrun of its expected cost, plus writing the plan and report",
        },
        "tuning_wall_s": elapsed(),
        "target_accuracy": cfg.train.target_accuracy,
        "num_learners": lam,
        "num_processes": num_processes if cfg.runtime == "dist" else None,
        "network": None if network is None else dataclasses.asdict(network),
        "device_profile": {
            "seconds_per_batch": cfg.cluster.seconds_per_batch,
            "seconds_per_sample": cfg.cluster.seconds_per_sample,
        },
        "noise_scale": noise,
        "chosen": dataclasses.asdict(chosen.candidate),
        "chosen_label": chosen.candidate.label(),
        "plan_name": plan.name,
        "plan_schedule": dataclasses.asdict(plan.schedule),
        "steady_state": None if steady is None else steady.label(),
        "prediction": prediction,
        "segments": [sg.to_json() for sg in plan_segments],
        "long_run": ({**segments[0].to_json(), "summary": summaries[0]} if segments else None),
        "step_at": step_at,
        "step_runs": step_runs,
        "probes": [r.to_json() for r in search.results],
        "best_by_g": {str(g): r.candidate.label() for g, r in search.best_by_g.items()},
        "ranking": [{"label": c.label(), "predicted_relative": t} for t, c in ranked],
        "extrapolation": extrapolation,
        "decisions": len(log.entries),
    }
    state = _clean(state)
    (out / "tune.json").write_text(json.dumps(state, indent=1, default=_json_default))
    write_report(out, state)
    if verify:
        state = verify_plan(out, progress=progress)
    return state
