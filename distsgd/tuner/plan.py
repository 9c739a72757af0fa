"""The tune's plan: its run config, its predicted time to accuracy, and what the model
expects of it on larger simulated clusters.

* :func:`plan_config` — the chosen configuration as a config ``distsgd train`` accepts
  (``plan.toml``), with a step of η where the tuner found one;
* :func:`plan_switch` — the η a plan continues with when steady state recommends another
  μ or layout (a run config changes only η mid-run);
* :func:`predict_plan` — Omnivore's prediction HE · SE (Hadjis et al. 2016, §4) from the
  long runs: HE their measured seconds per iteration, SE from a fitted loss curve;
* :func:`extrapolate_plan` — the plan's layout scaled to 1–8× the learners (sim only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from distsgd.config import RunConfig, TuneConfig
from distsgd.tuner import perf_model as pm
from distsgd.tuner.omnivore import Candidate, DecisionLog, ProbeResult, pick_best
from distsgd.tuner.probes import candidate_config

__all__ = [
    "PLAN_EVAL_EVERY",
    "plan_config",
    "plan_switch",
    "predict_plan",
    "extrapolate_plan",
]

PLAN_EVAL_EVERY = 5000  # samples between the evaluations of the plan and the long runs
_MIN_EVALS = 4  # evaluations of the long runs a prediction needs
_MAX_EXTRAPOLATION = 10.0  # a prediction beyond this many times the long runs' seconds: none


def _binned(x: list[float], y: list[float], bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Mean of y over ``bins`` equal runs of consecutive points (smooths tick noise)."""
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if xa.size <= bins:
        return xa, ya
    idx = np.array_split(np.arange(xa.size), bins)
    return np.array([xa[i].mean() for i in idx]), np.array([ya[i].mean() for i in idx])


def _fitted_curves(long_runs: list[ProbeResult]) -> list[pm.LossCurve | None]:
    """Each long run's fitted loss curve over its iterations (None: diverged or fewer than
    3 ticks)."""
    curves: list[pm.LossCurve | None] = []
    for run in long_runs:
        if run.diverged or len(run.losses) < 3:
            curves.append(None)
            continue
        xs, ys = _binned(run.iterations, run.losses)
        curves.append(pm.fit_loss_curve(xs, ys))
    return curves


def predict_plan(
    long_runs: list[ProbeResult], target: float, reached: bool = False
) -> dict[str, Any]:
    """Predicted time to accuracy of the plan from scratch: HE · SE.

    ``long_runs`` are the long runs in order (the first from the initial weights, each
    next one from the previous one's snapshot, possibly at a lower η). HE: their measured
    seconds per iteration (total seconds / total iterations). SE: the iterations of every
    long run but the last, plus the iterations until the last one's fitted loss curve
    (:func:`~distsgd.tuner.perf_model.fit_loss_curve` on its tick losses, iterations
    counted from its start) reaches the target loss. :func:`fit_error_vs_loss` maps the
    target accuracy to that loss from every long run's evaluation points, each taken as
    (its own fitted curve's loss at the evaluation, accuracy), which removes the lag of
    interval-mean training losses.

    No prediction (with its ``reason``) when the long runs made fewer than 4 evaluations,
    when the target maps to a loss <= 0, when the curve levels off above the target loss,
    or when the prediction exceeds 10× the seconds the long runs measured (extrapolated
    that far the fit says little; the figure is kept as ``extrapolated_s``). The
    ``reason`` advises a larger budget unless ``reached`` (the long runs reached the
    target, so their time to it is measured and a longer run would not help the fit).

    Returns:
        dict with ``seconds_per_iteration``, ``iterations_to_target``, ``target_loss``,
        ``curve`` (of the last long run: L_inf, A, beta, rmse), ``predicted_s``,
        ``segments`` (the number of long runs; ``tune.json``'s key); values are NaN/inf
        when the data do not determine them.
    """
    advice = "" if reached else " (give a larger --budget)"
    iters = sum(r.iterations[-1] for r in long_runs if r.iterations)
    secs = sum(r.virtual_s[-1] for r in long_runs if r.virtual_s)
    he = secs / iters if iters else math.nan
    out: dict[str, Any] = {
        "seconds_per_iteration": he,
        "iterations_to_target": math.nan,
        "target_loss": math.nan,
        "curve": None,
        "predicted_s": math.nan,
        "segments": len(long_runs),
    }
    curves = _fitted_curves(long_runs)
    while len(curves) > 1 and curves[-1] is None:  # a last run too short to fit
        curves.pop()
        long_runs = long_runs[:-1]
    last = curves[-1] if curves else None
    if last is None:
        return out
    out["curve"] = dataclasses.asdict(last)
    pts = [
        (float(curve(e["iterations"])), e["eval_metric"])
        for run, curve in zip(long_runs, curves, strict=True)
        if curve is not None
        for e in run.evals
        if e.get("iterations", 0) > 0
    ]
    if len(pts) < _MIN_EVALS:
        out["reason"] = (
            f"the long run(s) made {len(pts)} evaluation(s), fewer than {_MIN_EVALS}: too few "
            "to map the target accuracy to a training loss" + advice
        )
        return out
    try:
        ev = pm.fit_error_vs_loss(np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    except ValueError:
        return out
    target_loss = ev.target_loss(target)
    if not target_loss > 0:  # cross-entropy is positive: the linear map does not hold there
        out.update(
            target_loss=target_loss,
            reason=f"the evaluation points map the target accuracy to a training loss of "
            f"{target_loss:.4f} <= 0: "
            + (
                "accuracy is not linear in the training loss over these evaluations"
                if reached
                else "the long run ended too far from the target to extrapolate" + advice
            ),
        )
        return out
    before = sum(r.iterations[-1] for r in long_runs[:-1] if r.iterations)
    se = before + pm.iterations_to_loss(last, target_loss)
    if not math.isfinite(se):
        out["reason"] = (
            f"the fitted loss curve levels off at {last.L_inf:.4f}, above the target loss "
            f"{target_loss:.4f}{advice}"
        )
    predicted = pm.time_to_accuracy(he, se)
    if math.isfinite(predicted) and predicted > _MAX_EXTRAPOLATION * secs:
        out.update(
            target_loss=target_loss,
            error_vs_loss={"e0": ev.e0, "s": ev.s},
            extrapolated_s=predicted,
            reason=f"the fitted curve reaches the target loss {target_loss:.4f} after "
            f"{predicted:.4g} s, more than {_MAX_EXTRAPOLATION:g}× the {secs:.4g} s the long "
            "run(s) measured: too far to extrapolate" + advice,
        )
        return out
    out.update(
        target_loss=target_loss,
        iterations_to_target=se,
        predicted_s=predicted,
        error_vs_loss={"e0": ev.e0, "s": ev.s},
    )
    return out


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


def plan_config(
    base: RunConfig,
    cand: Candidate,
    steady: Candidate | None,
    step_epoch: float,
    log: DecisionLog,
) -> RunConfig:
    """The plan: ``base`` with ``cand``'s protocol, layout, η and μ, trained from scratch
    until the target (evaluating at least every :data:`PLAN_EVAL_EVERY` samples, at most
    ``train.max_epochs`` or 10 epochs).

    With ``steady`` = ``cand`` at a lower η and ``step_epoch`` > 0 the schedule steps η to
    ``steady.lr`` at ``step_epoch`` (the factor rounded to 6 digits: 0.1, not 0.0999…);
    a ``steady`` of another layout or μ cannot be planned (a run config holds one) and is
    logged as kept out. Without ``steady`` η is constant.
    """
    cfg = candidate_config(base, cand)
    schedule = dataclasses.replace(base.schedule, kind="constant", warmup_epochs=0.0)
    if steady is not None and steady != cand:
        same_shape = dataclasses.replace(steady, lr=cand.lr) == cand
        if same_shape and steady.lr < cand.lr and step_epoch > 0:
            schedule = dataclasses.replace(
                schedule,
                kind="step",
                decay_epochs=[round(step_epoch, 4)],
                decay_factor=float(f"{steady.lr / cand.lr:.6g}"),  # 0.1, not 0.0999…
            )
            log(
                "plan",
                f"step η {cand.lr:g} → {steady.lr:g} at epoch {step_epoch:.3f}",
                "the run at the lower η from that evaluation's snapshot reached the target soonest",
            )
        else:
            log(
                "plan",
                f"keep {cand.label()} for the whole run",
                f"steady state recommends {steady.label()} after epoch {step_epoch:.3f}; "
                "a run config holds one layout and momentum, so the plan keeps the first phase",
            )
    t = base.train
    train = dataclasses.replace(
        t,
        stop_at_target=True,
        max_seconds=0.0,
        max_virtual_seconds=0.0,
        max_epochs=t.max_epochs or 10.0,
        eval_every_samples=min(t.eval_every_samples or PLAN_EVAL_EVERY, PLAN_EVAL_EVERY),
    )
    name = f"tuned {cand.shape()} η={cand.lr:g} μ={cand.momentum:g}"
    if schedule.kind == "step":
        name += f" (η×{schedule.decay_factor:g} at epoch {schedule.decay_epochs[0]:g})"
    return cfg.replace(name=name, schedule=schedule, train=train)


def extrapolate_plan(
    plan: Candidate,
    num_learners: int,
    iterations_to_target: float,
    cluster: pm.ClusterModel,
    noise_scale: float,
) -> list[dict[str, Any]]:
    """Predicted time to accuracy of the plan's batch size, η and μ on simulated clusters
    of 1, 2, 4 and 8× ``num_learners`` (the base config's λ), hardsync or compute groups
    g ∈ {2, 4, λ/4, λ}: HE from the cluster model, SE carried from the plan's
    ``iterations_to_target`` with the batch-size law (B_noise = ``noise_scale`` samples).

    Returns:
        one record per layout: ``num_learners``, ``g``, ``seconds_per_iteration``,
        ``iterations_to_target``, ``predicted_s`` (seconds on the simulated clock).
    """
    records = []
    b_plan = pm.samples_per_iteration(plan.layout())
    for mult in (1, 2, 4, 8):
        lam = num_learners * mult
        for g in sorted({1, 2, 4, lam // 4, lam} - {0}):
            if lam % g:
                continue
            cand = Candidate(
                "hardsync" if g == 1 else "compute_groups",
                lam,
                plan.batch_size,
                plan.lr,
                plan.momentum,
                num_groups=g,
            )
            he = pm.seconds_per_iteration(cand.layout(), cluster)
            se = pm.scale_iterations(
                iterations_to_target, b_plan, pm.samples_per_iteration(cand.layout()), noise_scale
            )
            records.append(
                {
                    "num_learners": lam,
                    "g": g,
                    "seconds_per_iteration": he,
                    "iterations_to_target": se,
                    "predicted_s": he * se,
                }
            )
    return records
