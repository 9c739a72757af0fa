"""Where the plan steps its learning rate (beyond Omnivore; docs/tuning.md, step 5).

Omnivore's steady state steps η wherever the long run happened to end, a point set by the
budget. The tuner instead tries a run at the lower η from several of the long run's
evaluations (their models are kept, ``train.save_eval_weights``) and plans the step where
the target came soonest:

* :func:`step_pool` — every evaluation a step may start from (before the target);
* :func:`step_points` — the first evaluations tried: up to ``tune.step_points`` within
  ``tune.step_margin`` of the target, spread evenly, latest first;
* :func:`usable_step_points` — those two, less the evaluations with no epochs left to
  train, with the decisions that say why none qualify;
* :func:`choose_step` — runs from the points, each cut where it can no longer beat the
  soonest time to accuracy so far, then a bisection over the pool around the soonest;
* :func:`truncate_run` — the long run up to the chosen point (for the prediction).

Evaluation records are the runs' ``metrics.jsonl`` lines (``eval``, ``samples``,
``epoch``, ``iterations``, ``eval_metric``, the clock's seconds); times are read on the
runtime's clock (:class:`~distsgd.tuner.probes.RunClock`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from distsgd.config import TuneConfig
from distsgd.tuner.omnivore import DecisionLog, ProbeResult
from distsgd.tuner.probes import RunClock

__all__ = [
    "step_pool",
    "step_points",
    "usable_step_points",
    "StepChoice",
    "StepRunFn",
    "choose_step",
    "truncate_run",
]

_MIN_EPOCHS_LEFT = 0.01  # a step point needs this many epochs left to train after it

StepRunFn = Callable[[dict[str, Any], float], tuple[ProbeResult, dict[str, Any]] | None]
"""Trains the lower η from an evaluation's snapshot until the target or a horizon (seconds
on the runtime's clock; inf: none); returns the run and its ``summary.json``, or None
when the budget allows no more runs."""


def step_pool(evals: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Every evaluation a step may start from, in order: after some training and before
    the first that reached ``target`` (all of them if none did)."""
    pool = []
    for e in evals:
        if e.get("samples", 0) <= 0:
            continue
        if e["eval_metric"] >= target:
            break
        pool.append(e)
    return pool


def step_points(
    evals: list[dict[str, Any]],
    target: float,
    margin: float,
    count: int,
    include_last: bool = False,
) -> list[dict[str, Any]]:
    """The evaluations of a long run from which the tuner tries a learning-rate step,
    latest first.

    Qualify: evaluations after some training (``samples > 0``) before the first one that
    reached ``target``, with test accuracy >= ``target − margin``. Of
    these, ``count`` spread evenly from the last qualifying one back to the first (one:
    the last). With ``include_last`` (a long run that stopped before the target) its last
    evaluation is always among them, qualifying or not: Omnivore's steady state steps
    there.

    Args:
        evals: the run's ``metrics.jsonl`` records in order (``eval``, ``samples``,
            ``eval_metric``, …).
        target: the target, in [0, 1].
        margin: accuracy below the target that still qualifies, in (0, 1).
        count: at most this many points (0: only the forced last one).

    Returns:
        The chosen records, latest first.
    """
    before = step_pool(evals, target)
    ok = [e for e in before if e["eval_metric"] >= target - margin]
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


def usable_step_points(
    evals: list[dict[str, Any]],
    target: float,
    settings: TuneConfig,
    max_epochs: float,
    include_last: bool,
    log: DecisionLog,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`step_points` (``tune.step_margin``, ``tune.step_points``) and
    :func:`step_pool` of a long run's evaluations, without those that leave no epochs to
    train before ``max_epochs`` (the long run may have stopped there); logs a skipped
    point and, when no point is left, why.

    Returns:
        (the points, latest first; the pool, in order).
    """
    points = step_points(evals, target, settings.step_margin, settings.step_points, include_last)
    spent = [p for p in points if max_epochs - float(p["epoch"]) < _MIN_EPOCHS_LEFT]
    if spent:
        log(
            "step",
            f"skip the step at epoch {spent[0]['epoch']:.3f}",
            f"train.max_epochs = {max_epochs:g} leaves no epochs to train after it",
        )
        points = [p for p in points if p not in spent]
    pool = [
        p for p in step_pool(evals, target) if max_epochs - float(p["epoch"]) >= _MIN_EPOCHS_LEFT
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
            f"none reached {100 * (target - settings.step_margin):g}"
            "% test accuracy before the target (tune.step_margin)",
        )
    return points, pool


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
            ``why``, ``reached``, ``time_to_target_s``, ``best_metric``, ``run_dir``,
            ``evals``), as ``tune.json`` keeps them.
    """

    point: dict[str, Any] | None
    seconds: float
    run: ProbeResult | None
    runs: list[dict[str, Any]]


class _StepTrials:
    """The runs :func:`choose_step` tried and the soonest time to accuracy among them."""

    def __init__(
        self,
        long_run_s: float,
        clock: RunClock,
        run_step: StepRunFn,
        log: DecisionLog,
        tie_buffer: float,
    ) -> None:
        self.best_s = long_run_s
        self.best: dict[str, Any] | None = None
        self.best_run: ProbeResult | None = None
        self.runs: list[dict[str, Any]] = []
        self.tried: set[int] = set()
        self.clock, self.run_step, self.log, self.tie_buffer = clock, run_step, log, tie_buffer

    def attempt(self, point: dict[str, Any], why: str) -> bool:
        """Run from ``point`` unless it comes at or after the soonest time so far; False
        when the budget allows no more runs."""
        self.tried.add(int(point["eval"]))
        clock, best_s = self.clock, self.best_s
        horizon = best_s - clock.at(point)
        if horizon <= 0:
            self.log(
                "step",
                f"skip the step at epoch {point['epoch']:.3f}",
                f"the soonest time to accuracy so far ({best_s:.4g} {clock.name} s) comes "
                "before it",
            )
            return True
        out = self.run_step(point, horizon)
        if out is None:
            return False
        run, summary = out
        tta = summary.get(clock.time_to_target_key)
        reached = bool(summary.get("reached")) and tta is not None
        chain = clock.at(point) + float(tta) if reached else math.inf
        self.runs.append(_trial_record(point, why, run, summary, clock, chain, reached))
        at = f"step at epoch {point['epoch']:.3f}"
        if chain < best_s * (1 - self.tie_buffer):
            self.log(
                "step",
                f"{at} reaches the target after {chain:.4g} {clock.name} s",
                "the soonest so far"
                + (f" (before: {best_s:.4g} s)" if math.isfinite(best_s) else ""),
            )
            self.best_s, self.best, self.best_run = chain, point, run
            return True
        outcome = (
            f" reached the target after {chain:.4g} {clock.name} s"
            if reached
            else " did not reach the target within its limit"
        )
        self.log(
            "step",
            at + outcome + f" (best accuracy {summary.get('best_metric') or 0:.4f})",
            f"not sooner than {best_s:.4g} {clock.name} s"
            if math.isfinite(best_s)
            else "no time to accuracy",
        )
        return True

    def refine(self, pool: list[dict[str, Any]]) -> None:
        """Bisect ``pool`` around the soonest step until no untried evaluation lies midway
        or the budget allows no more runs."""
        while self.best is not None:
            ids = [int(e["eval"]) for e in pool]
            if int(self.best["eval"]) not in ids:
                return
            i = ids.index(int(self.best["eval"]))
            done = [j for j, e in enumerate(ids) if e in self.tried]
            lo = max((j for j in done if j < i), default=-1)
            hi = min((j for j in done if j > i), default=len(pool))
            mids = [
                m for m in ((i + hi) // 2, (lo + i + 1) // 2) if m != i and ids[m] not in self.tried
            ]
            if not mids:
                return
            for m in mids:  # the later one first
                why = (
                    f"midway between the soonest step (epoch {self.best['epoch']:.3f}) and its "
                    + ("next tried point" if m > i else "previous tried point (or the start)")
                )
                self.log("step", f"refine: try epoch {pool[m]['epoch']:.3f}", why)
                if not self.attempt(pool[m], why):
                    return


def _trial_record(
    point: dict[str, Any],
    why: str,
    run: ProbeResult,
    summary: dict[str, Any],
    clock: RunClock,
    chain: float,
    reached: bool,
) -> dict[str, Any]:
    """One run of :attr:`StepChoice.runs`: where it started, whether and when (counted
    from the long run's start) it reached the target, its evaluations on the clock."""
    return {
        "eval": point["eval"],
        "epoch": point["epoch"],
        "accuracy": point["eval_metric"],
        "clock_s": point[clock.eval_key],
        "why": why,
        "reached": reached,
        "time_to_target_s": chain if reached else None,
        "best_metric": summary.get("best_metric"),
        "run_dir": run.run_dir,
        "evals": [
            {"clock_s": e.get(clock.eval_key), "eval_metric": e.get("eval_metric")}
            for e in run.evals
        ],
    }


def choose_step(
    points: list[dict[str, Any]],
    long_run_s: float,
    clock: RunClock,
    run_step: StepRunFn,
    log: DecisionLog,
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
    The time to accuracy of a step at the point = the point's time on ``clock`` + the
    run's time to accuracy on it.

    Then, with ``pool`` (:func:`step_pool`), the search refines around the soonest step
    while the budget lasts: it tries the evaluations of ``pool`` midway between the
    soonest step and its nearest tried neighbour on each side (the pool's ends count as
    neighbours), later one first, and repeats until no untried evaluation lies midway —
    a bisection over the pool, so about 2·log2(len(pool)) more runs at most.

    Args:
        points: :func:`step_points`, latest first.
        long_run_s: the long run's own time to accuracy (inf if it stopped before).
        clock: the runtime's clock (:meth:`RunClock.of`): which keys of the evaluation
            records and run summaries hold its seconds.
        long_run_reached: whether the long run reached the target (only for the log).
        pool: the evaluations the refinement may try (None: no refinement).
        tie_buffer: a step replaces the soonest so far only if it is sooner by more than
            this fraction (Omnivore's 1% tie buffer): a tie keeps the step found first, or
            no step.

    No run reached the target sooner: no step (``point`` None) — a step the tuner did not
    see reach the target is not planned, even where steady state chose the lower η.
    """
    trials = _StepTrials(long_run_s, clock, run_step, log, tie_buffer)
    budget_left = all(
        trials.attempt(point, "spread over the qualifying evaluations") for point in points
    )
    if budget_left and pool:
        trials.refine(pool)
    if trials.best is None and trials.runs:
        log(
            "step",
            "no step",
            "no run at the lower η reached the target "
            + ("sooner than the long run" if long_run_reached else "within its limit")
            + ": a step the tuner did not see reach the target is not planned",
        )
    best = trials.best
    return StepChoice(
        best, trials.best_s if best is not None else long_run_s, trials.best_run, trials.runs
    )


def truncate_run(run: ProbeResult, iterations: int) -> ProbeResult:
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
