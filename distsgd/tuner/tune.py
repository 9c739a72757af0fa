"""``distsgd tune``: find the configuration that reaches the target accuracy soonest.

:func:`tune` runs the phases of a :class:`~distsgd.tuner.session.TuneSession` in order
(docs/protocols.md §3; each decision goes to ``decisions.jsonl`` with why): setup, Omnivore's
cold start, the joint search beyond Omnivore, the long run of the best configuration,
Omnivore's steady state, where to step the learning rate
(:mod:`~distsgd.tuner.step_search`), the plan and its predicted time to accuracy HE · SE
(:mod:`~distsgd.tuner.plan`), the report. :func:`verify_plan` trains the plan and adds its
measured time to accuracy.

Budget B = ``tune.budget_s`` (every phase decision is a method of
:class:`~distsgd.tuner.budget.TuneBudget`): the cold start and joint search end at
``(1 − segment_fraction − 0.15)·B``; the first long run gets what is left less a reserve of
``(0.15 + 0.4·segment_fraction)·B`` for the later phases (all that is left if the reserve
leaves it less than one probe's training); steady state ``0.15·B`` from its start; the
second long run the rest; every phase ends at B at the latest, and a phase that finishes
early leaves its time to the next. A step starts only if its expected wall cost fits, so
the tune ends within the budget plus one step's overrun and the report; a budget below the
least that gives a plan with a predicted time to accuracy is refused before the search, with
that minimum (:func:`check_prediction_budget`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from distsgd import launch
from distsgd.config import ConfigError, RunConfig, check_device
from distsgd.trainer import Trainer
from distsgd.tuner import perf_model as pm
from distsgd.tuner.longrun import LongRuns
from distsgd.tuner.plan import _MIN_EVALS as MIN_PREDICTION_EVALS
from distsgd.tuner.plan import PLAN_EVAL_EVERY, predict_plan
from distsgd.tuner.probes import RunClock
from distsgd.tuner.report import write_report, write_tune_json
from distsgd.tuner.session import TuneSession
from distsgd.tuner.setup import TuneSetup, cluster_model, tune_layout

__all__ = ["tune", "tune_layout", "parse_budget", "predict_plan", "verify_plan", "cluster_model"]


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
    ``probes/`` (one run directory per probe, for the long run and each run from its
    snapshots).

    Raises:
        ConfigError: bad settings (including ``dist.num_processes`` above this machine's
            CPU cores and ``tune.families`` the layouts cannot probe, see
            :func:`tune_layout`), an unavailable runtime, an ``out_dir`` that is a file or
            holds a tune, a budget below the least that gives a plan with a prediction
            (:func:`check_prediction_budget`; nothing is left written), or a cold start in which
            every probe diverged.
        DistRunFailed: (``dist`` runtime) a probe or long run lost a process before it
            completed (:mod:`distsgd.launch`).
        KeyboardInterrupt: Ctrl-C; the probes' run directories and ``decisions.jsonl``
            written so far stay in ``out_dir``, no plan is written.
    """
    check_device(config)  # before any probe starts or anything is written
    session = TuneSession.setup(
        config, out_dir, budget_s=budget_s, progress=progress, check=check_prediction_budget
    )
    try:
        session.cold_start()
        session.joint_search()
        after = LongRuns(session)
        after.long_run()
        after.steady_state()
        after.learning_rate_step()
        after.plan()
        saved = session.report()
    finally:
        session.bar.close()  # also when interrupted: the caller's line is not drawn over
        session.prober.close()  # the ranks every dist probe ran on
    if verify:
        saved = verify_plan(session.out, progress=progress)
    return saved


def estimated_samples_per_s(fixed: TuneSetup) -> float:
    """Training samples per wall second of hardsync on λ learners at the config's b on this
    machine, before the search: on the simulated cluster the setup's timing probe measured
    it (the simulator's wall speed, ``timings["train_samples_per_s"]``); on real processes
    the learners compute in parallel, ``λb / HE`` from the calibrated device profile
    (:func:`~distsgd.tuner.perf_model.seconds_per_iteration`)."""
    cfg = fixed.cfg
    if "train_samples_per_s" in fixed.timings:
        return fixed.timings["train_samples_per_s"]
    layout = pm.Layout("hardsync", fixed.layout.num_learners, cfg.protocol.batch_size)
    samples = pm.samples_per_iteration(layout)
    if cfg.runtime == "sim":
        return samples / pm.compute_seconds(samples, fixed.cluster)
    return samples / pm.seconds_per_iteration(layout, fixed.cluster)


def check_prediction_budget(fixed: TuneSetup) -> None:
    """Refuse a budget below the least that gives a plan with a predicted time to
    accuracy (:meth:`~distsgd.tuner.budget.TuneBudget.prediction_minimum_s`: the setup,
    the first probe and a long run with the evaluations a prediction needs, every
    :data:`~distsgd.tuner.plan.PLAN_EVAL_EVERY` samples at most, at the throughput the
    setup measured (:func:`estimated_samples_per_s`), while the search and steady state keep their shares).

    Called by :meth:`TuneSession.setup` before anything is written or the progress bar
    opens.

    Raises:
        ConfigError: ``--budget`` below that minimum (one line: the value, the minimum
            and what it is made of).
    """
    costs, cfg = fixed.costs, fixed.cfg
    every = min(cfg.train.eval_every_samples or PLAN_EVAL_EVERY, PLAN_EVAL_EVERY)
    samples_per_s = estimated_samples_per_s(fixed)
    build_s = fixed.timings["build_s"]
    minimum = costs.prediction_minimum_s(samples_per_s, every, MIN_PREDICTION_EVALS, build_s)
    budget = cfg.tune.budget_s
    if minimum <= budget:
        return
    long_run = costs.long_run_minimum_s(samples_per_s, every, MIN_PREDICTION_EVALS, build_s)
    raise ConfigError(
        f"--budget {budget:g}s is not allowed for this config: a plan with a predicted time "
        f"to accuracy needs at least {math.ceil(minimum)}s here (setup {costs.elapsed():.1f} "
        f"s, first probe about {costs.first_probe_s:.1f} s, then a long run of about "
        f"{long_run:.1f} s for {MIN_PREDICTION_EVALS} evaluations every {every} samples at "
        f"about {samples_per_s:.0f} samples/s and {costs.eval_s:.2f} s per evaluation, while "
        "the search and steady state keep their shares of the budget)"
    )


def verify_plan(tune_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Train ``tune_dir/plan.toml`` into ``tune_dir/verify`` and add the measured time to
    accuracy (on the plan's runtime clock) next to the prediction in ``tune.json`` and the
    report.

    Raises:
        ConfigError: no plan in ``tune_dir``, or ``verify/`` already holds a run.
    """
    tune_dir = Path(tune_dir)
    plan = tune_dir / "plan.toml"
    if not plan.exists():
        raise ConfigError(f"{plan} does not exist: run distsgd tune first")
    cfg = RunConfig.from_toml(plan)
    if cfg.runtime == "dist":
        summary = launch.run(cfg, tune_dir / "verify", progress=progress)
    else:
        summary = Trainer(cfg, tune_dir / "verify", progress=progress).run()
    state = json.loads((tune_dir / "tune.json").read_text())
    measured = summary.get(RunClock.of(cfg.runtime == "sim").time_to_target_key)
    pred = state["prediction"]["predicted_s"]
    state["verify"] = {
        "run_dir": str(tune_dir / "verify"),
        "reached": summary["reached"],
        "measured_s": measured,
        "measured_wall_s": summary.get("time_to_target_s"),
        "measured_iterations": None,
        "samples_to_target": summary.get("samples_to_target"),
        "ratio_predicted_to_measured": (
            pred / measured if measured and pred and math.isfinite(pred) else None
        ),
    }
    recs = [json.loads(x) for x in (tune_dir / "verify" / "metrics.jsonl").read_text().splitlines()]
    hit = [r for r in recs if r["eval_metric"] >= cfg.train.target]
    if hit:
        state["verify"]["measured_iterations"] = hit[0]["iterations"]
    write_tune_json(tune_dir, state)
    write_report(tune_dir, state)
    return state
